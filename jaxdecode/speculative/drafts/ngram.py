"""A character n-gram table as the draft.

Building a table (counting, estimating, indexing) runs in numpy on the host; the arrays become
device arrays only when the finished :class:`NGramDraft` is made (:meth:`NGramDraft.from_table`).
The lookups of the decoding loop (:meth:`NGramDraft.propose` and the rest) run in jax.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.io.data import read_corpus
from jaxdecode.speculative.acceptance import pick_token
from jaxdecode.speculative.drafts.base import Draft, draft_class, static_field


class NGramState(NamedTuple):
    context: jax.Array  # [B, n-1] int32 the last n-1 tokens of the context; V = none (too short)
    row: jax.Array  # [B] int32 with backoff: the table row of the context's longest seen suffix


@draft_class
class NGramDraft(Draft):
    """A character n-gram model (the chapter's add-0.01 trigram for ``n = 3``).

    Two estimates: add-``alpha`` smoothing of the order-``n`` counts (the chapter's; an unseen
    context gets the uniform distribution), or, with ``backoff=beta``, interpolation with the
    shorter contexts: ``q_k(c | h) = (count(h, c) + beta * q_{k-1}(c | h')) / (count(h) + beta)``
    for every order ``k`` up to ``n - 1`` context tokens (``h'`` is ``h`` without its oldest token,
    ``q_{-1}`` uniform), and a context is looked up at the longest order seen in training.

    ``keys`` ``[K]`` int32: the contexts in the table, as base ``V + 1`` numbers of ``n - 1``
    digits (a shorter context is padded in front with the digit ``V``), sorted; ``logits``
    ``[K + 1, V]`` float32: the log-probabilities of the next token after each, and a last,
    uniform row for a context that is not in the table. Lookup goes through ``index``
    ``[(V + 1)^(n - 1)]`` (a context number's row, when that table is small) or else an
    open-addressing hash table: ``slots`` holds the keys at their positions, ``slot_rows`` their
    rows, and a key sits within ``probes`` slots after its hash (the top ``hash_bits`` bits of
    ``key * HASH`` modulo 2^32).

    With backoff, a draft token costs one lookup instead of one per order: ``goto`` ``[K, V]``
    int32 is the row of the longest seen suffix of (row's context + token), cut to ``n - 1``
    tokens. It is well defined: if ``x + c`` was seen as a context, ``x`` was seen followed by
    ``c``, so the longest seen suffix of a history determines that of the history plus ``c``.
    The draft's state is then that row, walked forward by each token.
    """

    keys: jax.Array
    logits: jax.Array
    index: jax.Array | None
    n: int = static_field()
    V: int = static_field()
    slots: jax.Array | None = None
    slot_rows: jax.Array | None = None
    probes: int = static_field(default=0)
    hash_bits: int = static_field(default=0)
    backoff: bool = static_field(default=False)
    goto: jax.Array | None = None

    MAX_INDEX = 1 << 22
    HASH = 0x9E3779B1  # Fibonacci hashing: the top bits of key * 2^32 / golden ratio

    # ------------------------------------------------------------------ building (numpy)

    @classmethod
    def from_tokens(cls, tokens, V: int, n: int = 3, alpha: float = 0.01,
                    backoff: float | None = None, soft=None) -> NGramDraft:
        """Count every window of ``n`` tokens of ``tokens`` (a 1-D id array); with ``backoff``
        (a positive ``beta``), every shorter window too (see the class).

        ``soft`` ``[len(tokens), V]``: instead of counting each next token once, add
        ``soft[i]`` (a distribution over the token at ``i``, e.g. a target model's prediction
        from the text before it; see :meth:`distill`) to its context's counts."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"NGramDraft: n must be an integer >= 1, got {n!r}")
        if (V + 1) ** (n - 1) >= 2**31:
            raise ValueError(f"NGramDraft: n={n} is too large for V={V} (contexts must fit int32)")
        if not alpha > 0:
            raise ValueError(f"NGramDraft: the smoothing alpha must be > 0, got {alpha!r}")
        if backoff is not None and not (backoff > 0 and np.isfinite(backoff)):
            raise ValueError(f"NGramDraft: backoff (beta) must be a positive number, got {backoff!r}")
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        if len(tokens) < n:
            raise ValueError(f"NGramDraft: the text has {len(tokens)} tokens, fewer than n={n}")
        if tokens.min() < 0 or tokens.max() >= V:
            raise ValueError(f"NGramDraft: token ids must lie in [0, {V})")
        if soft is not None:
            soft = np.asarray(soft)
            if soft.shape != (len(tokens), V):
                raise ValueError(f"NGramDraft: soft counts must have shape {(len(tokens), V)}, "
                                 f"got {soft.shape}")
            if not np.all(np.isfinite(soft)) or soft.min() < 0:
                raise ValueError("NGramDraft: soft counts must be finite and non-negative")

        def count(k, ctx, nxt):  # (sorted distinct contexts, their inverse, [K, V] counts)
            keys, inverse = np.unique(ctx, return_inverse=True)
            inverse = inverse.reshape(-1)
            if soft is None:
                counts = np.zeros((len(keys), V), np.float64)
                np.add.at(counts, (inverse, nxt), 1.0)
            else:  # sum the rows of each context: sort by context, add up each run
                order = np.argsort(inverse, kind="stable")
                starts = np.searchsorted(inverse[order], np.arange(len(keys)))
                counts = np.add.reduceat(soft[k:][order].astype(np.float64), starts, axis=0)
            return keys, inverse, counts

        def contexts(k):  # ids of the k-token contexts of positions k .. len-1 (n-1 digits)
            m = len(tokens) - k
            ctx = np.zeros(m, np.int64)
            for _ in range(n - 1 - k):
                ctx = ctx * (V + 1) + V
            for j in range(k):
                ctx = ctx * (V + 1) + tokens[j:j + m]
            return ctx, tokens[k:]

        if backoff is None:
            keys, _, counts = count(n - 1, *contexts(n - 1))
            counts += alpha
            probs = counts / counts.sum(axis=1, keepdims=True)
        else:
            all_keys, all_probs = [], []
            lower = lower_keys = None
            for k in range(n):
                keys, inverse, counts = count(k, *contexts(k))
                if lower is None:
                    prior = np.full((len(keys), V), 1.0 / V)
                else:  # each context's parent: itself without its oldest token, one order down
                    first = np.unique(inverse, return_index=True)[1]
                    parent_ctx = contexts(k - 1)[0][first + 1]
                    prior = lower[np.searchsorted(lower_keys, parent_ctx)]
                probs = (counts + backoff * prior) / (counts.sum(axis=1, keepdims=True) + backoff)
                all_keys.append(keys)
                all_probs.append(probs)
                lower, lower_keys = probs, keys
            keys = np.concatenate(all_keys)
            order = np.argsort(keys)
            keys, probs = keys[order], np.concatenate(all_probs)[order]
        logp = np.concatenate([np.log(probs), np.full((1, V), -np.log(V))])
        return cls.from_table(keys, logp, n, backoff is not None)

    @classmethod
    def from_table(cls, keys, logp, n: int, backoff: bool, goto=None) -> NGramDraft:
        """A draft from its table: sorted context numbers ``keys`` ``[K]`` and log-probabilities
        ``logp`` ``[K + 1, V]`` (the last row for an unseen context); builds the lookup, and with
        ``backoff`` the transition table unless ``goto`` (saved from an earlier build) is given.
        Everything is built in numpy; the arrays go to the device at the end."""
        keys = np.asarray(keys, np.int64)
        logp = np.asarray(logp, np.float32)
        V = logp.shape[1]
        if logp.shape != (len(keys) + 1, V) or np.any(np.diff(keys) <= 0) or (
                len(keys) and (keys[0] < 0 or keys[-1] >= (V + 1) ** (n - 1))):
            raise ValueError("NGramDraft: a table needs sorted distinct context numbers and one "
                             "row of log-probabilities more than contexts")
        rows = np.arange(len(keys), dtype=np.int32)
        index = slots = slot_rows = None
        probes = bits = 0
        if (V + 1) ** (n - 1) <= cls.MAX_INDEX:
            index = np.full(((V + 1) ** (n - 1),), len(keys), np.int32)
            index[keys] = rows
        else:  # linear probing, filled in hash order: a key lands at max(hash, previous + 1)
            bits = max(1, int(2 * len(keys) - 1).bit_length())  # load factor <= 1/2
            h = cls._hash(keys, bits)
            by_hash = np.argsort(h, kind="stable")
            h = h[by_hash]
            at = np.maximum.accumulate(h - np.arange(len(h))) + np.arange(len(h))
            probes = int(np.max(at - h)) + 1
            slots = np.full(int(at[-1]) + probes + 1, -1, np.int64)
            slots[at] = keys[by_hash]
            slots = slots.astype(np.int32)  # keys < 2^31: they fit
            slot_rows = np.full(len(slots), len(keys), np.int32)
            slot_rows[at] = rows[by_hash]
        if not backoff:
            goto = None
        elif goto is None:
            goto = cls._transitions(keys, n, V)
        else:
            goto = np.asarray(goto)
            if goto.shape != (len(keys), V) or goto.min() < 0 or goto.max() >= len(keys):
                raise ValueError(f"NGramDraft: a transition table must be [{len(keys)}, {V}] rows "
                                 f"of the table, got shape {goto.shape}")
            goto = goto.astype(np.int32)

        def device(a):
            return None if a is None else jnp.asarray(a)

        return cls(device(keys.astype(np.int32)), device(logp), device(index), n, V, device(slots),
                   device(slot_rows), probes, bits, bool(backoff), device(goto))

    @staticmethod
    def _transitions(keys, n: int, V: int) -> np.ndarray:
        """``goto`` (see the class) for a backoff table: every order's contexts, with the empty one."""
        K, width = len(keys), n - 1
        full = (V + 1) ** width
        pad = [V * sum((V + 1) ** j for j in range(m, width)) for m in range(width + 1)]
        if K == 0 or keys[-1] != pad[0]:  # the empty context is the largest number
            raise ValueError("NGramDraft: a backoff table must hold the empty context")
        goto = np.full((K, V), -1, np.int64)
        step = max(1, (1 << 22) // K)  # tokens at a time: a few million (context, token) pairs
        for c0 in range(0, V, step):
            c = np.arange(c0, min(V, c0 + step))
            longer = (keys[:, None] * (V + 1) + c[None, :]) % full  # context + c, cut to n-1 digits
            found = np.full(longer.shape, -1, np.int64)
            for m in range(width, -1, -1):  # longest suffix first
                cand = pad[m] + longer % (V + 1) ** m
                at = np.minimum(np.searchsorted(keys, cand), K - 1)
                hit = (keys[at] == cand) & (found < 0)
                found[hit] = at[hit]
            goto[:, c] = found
        return goto.astype(np.int32)

    @classmethod
    def _hash(cls, keys, bits: int):
        """Slot of each key (numpy int64 or a jax int32 array): the top ``bits`` of key * HASH."""
        if isinstance(keys, np.ndarray):
            return (((keys.astype(np.uint64) * cls.HASH) % (1 << 32)) >> (32 - bits)).astype(np.int64)
        prod = keys.astype(jnp.uint32) * jnp.uint32(cls.HASH)  # wraps modulo 2^32
        return (prod >> (32 - bits)).astype(jnp.int32)

    @classmethod
    def from_corpus(cls, vocab, text: str, n: int = 3, alpha: float = 0.01,
                    train_fraction: float = 0.9, backoff: float | None = None) -> NGramDraft:
        """Estimate from the first ``train_fraction`` of ``text`` (the book's training split)."""
        train = text[:int(train_fraction * len(text))]
        return cls.from_tokens(vocab.encode(train), len(vocab), n=n, alpha=alpha, backoff=backoff)

    @classmethod
    def distill(cls, model, params, tokens, n: int = 6, backoff: float = 2.0, **predict) -> NGramDraft:
        """An n-gram table of the target's own predictions: each context's row is the average of
        what the target predicts after it in ``tokens``
        (:func:`target_predictions` of the decoding model ``model``; ``predict`` goes there), interpolated with the shorter contexts as with ``backoff``.

        Counting estimates the text's next-token distribution; this estimates the target's, which
        is what a draft must match: on the shipped model and corpus, the 6-gram table accepts
        about 0.88 of its proposals against about 0.81 for the counted 5-gram."""
        soft = target_predictions(model, params, tokens, **predict)
        return cls.from_tokens(tokens, model.V, n=n, backoff=backoff, soft=soft)

    # ------------------------------------------------------------------ lookup (jax)

    def check(self, target, need):
        if target.V != self.V:
            raise ValueError(f"NGramDraft: the table has V={self.V}, the target V={target.V}")

    def _rows(self, cid):  # context numbers [...] -> table rows (K where absent)
        K = self.keys.shape[0]
        if self.index is not None:
            return self.index[cid]
        base = self._hash(cid, self.hash_bits)
        window = base[..., None] + jnp.arange(self.probes).reshape((1,) * base.ndim + (-1,))
        match = self.slots[window] == cid[..., None]
        at = jnp.take_along_axis(window, jnp.argmax(match, axis=-1)[..., None], axis=-1)[..., 0]
        return jnp.where(jnp.any(match, axis=-1), self.slot_rows[at], K)

    def _next_logits(self, context):  # [B, n-1] -> log-probabilities [B, V]
        k = self.n - 1
        orders = range(k, -1, -1) if self.backoff else (k,)
        cids = []
        for order in orders:  # the context cut to its last `order` tokens
            cid = jnp.zeros(context.shape[:1], jnp.int32)
            for j in range(k):
                cid = cid * (self.V + 1) + (context[:, j] if j >= k - order else self.V)
            cids.append(cid)
        rows = self._rows(jnp.stack(cids, axis=1))  # [B, orders]
        K = self.keys.shape[0]
        first = jnp.argmax(rows < K, axis=1)  # the longest context in the table
        return self.logits[jnp.take_along_axis(rows, first[:, None], axis=1)[:, 0]]

    def init(self, prompt, lengths, capacity):
        k = self.n - 1
        idx = jnp.asarray(lengths)[:, None] - k + jnp.arange(k)[None, :]  # [B, n-1]
        tok = jnp.take_along_axis(prompt, jnp.maximum(idx, 0), axis=1)
        context = jnp.where(idx >= 0, tok, self.V).astype(jnp.int32)
        row = jnp.zeros(context.shape[:1], jnp.int32)
        if self.goto is not None:  # walk from the empty context over the last n-1 tokens
            row = jnp.full(row.shape, self.keys.shape[0] - 1, jnp.int32)  # the empty context: the largest key
            for j in range(k):
                row = jnp.where(idx[:, j] >= 0, self.goto[row, jnp.maximum(tok[:, j], 0)], row)
            context = context[:, :0]  # not needed: the row is the state
        return NGramState(context, row)

    def propose(self, state, noise, gamma, process, span):
        # unrolled: gamma is small, and a loop costs more per iteration than these few lookups
        context, row, tokens, qs = state.context, state.row, [], []
        for j in range(gamma):
            if self.goto is not None:
                processed = process(self.logits[row])
            else:
                processed = process(self._next_logits(context))
            tok = pick_token(processed, None if noise is None else noise[:, j])
            if self.goto is not None:
                row = self.goto[row, tok]
            else:
                context = jnp.concatenate([context[:, 1:], tok[:, None]], axis=1)
            tokens.append(tok)
            qs.append(processed)
        return jnp.stack(tokens, axis=1), jnp.stack(qs, axis=1), state

    def commit(self, state, tokens, n_accepted, token, active):
        B, G = tokens.shape
        if self.goto is not None:  # walk the accepted proposals, then the new token
            row = state.row
            for j in range(G):
                row = jnp.where(j < n_accepted, self.goto[row, tokens[:, j]], row)
            row = self.goto[row, token]
            return NGramState(state.context, jnp.where(active, row, state.row))
        k = self.n - 1
        seq = jnp.concatenate([state.context, tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)
        seq = seq.at[jnp.arange(B), k + n_accepted].set(token)  # [B, k + G + 1]
        idx = (n_accepted + 1)[:, None] + jnp.arange(k)[None, :]
        context = jnp.take_along_axis(seq, idx, axis=1)
        return NGramState(jnp.where(active[:, None], context, state.context), state.row)


def build(lm, data_path=None, *, n: int | None = None, backoff: float | None = None,
           progress: bool = False) -> NGramDraft:
    """:meth:`NGramDraft.from_corpus` over the corpus (``data_path``, default ``$JAXDECODE_DATA``)."""
    return NGramDraft.from_corpus(lm.vocab, read_corpus(data_path), n=3 if n is None else n,
                                  backoff=backoff)


__all__ = ["NGramDraft", "NGramState", "target_predictions"]


def target_predictions(model, params, tokens, *, stride: int | None = None,
                       batch: int = 16, progress: bool = False) -> np.ndarray:
    """``[N, V]`` float32: row ``i`` is the target's next-token distribution for token ``i``
    given the tokens before it (row 0, which has none, is the one-hot of token 0). The target is
    the decoding model ``model`` (:class:`jaxdecode.models.base.DecodingModel`) with ``params``.

    The text is read in windows of ``T`` tokens starting every ``stride`` (default ``3 T / 4``):
    the first window gives the predictions for tokens 1 .. T, window ``j >= 1`` (starting at
    ``s = j * stride``) those for tokens ``s + T - stride + 1 .. s + T``. A prediction therefore
    sees all earlier tokens up to ``T``, and at least ``T - stride`` of them beyond.
    ``progress`` shows a progress bar (tqdm) on stderr."""
    T, V = model.T, model.V
    stride = (3 * T) // 4 if stride is None else stride
    if not isinstance(stride, int) or not 1 <= stride <= T:
        raise ValueError(f"target_predictions: stride must be an integer in [1, T={T}], got {stride!r}")
    if batch < 1:
        raise ValueError(f"target_predictions: batch must be >= 1, got {batch}")
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    N = len(tokens)
    if N and (tokens.min() < 0 or tokens.max() >= V):
        raise ValueError(f"target_predictions: token ids must lie in [0, {V})")
    out = np.zeros((N, V), np.float32)
    if N == 0:
        return out
    out[0, tokens[0]] = 1.0
    J = 1 + -(-max(0, N - 1 - T) // stride)  # windows until token N - 1 is predicted
    padded = np.zeros(((J - 1) * stride + T + 1,), np.int32)
    padded[:N] = tokens
    starts = np.arange(J) * stride
    def window_probs(p, w):  # each window from an empty cache: the logits of its every position
        logits = model.extend(p, model.empty_cache(w.shape[0], T), w, in_place=False)[0]
        return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)

    probs = jax.jit(window_probs)  # weights as arguments
    params = model.prepare(params, batch)
    from tqdm import tqdm

    bar = tqdm(total=J, desc="target predictions", unit="window", leave=False, disable=not progress,
               file=sys.stderr)
    for b0 in range(0, J, batch):
        part = starts[b0:b0 + batch]
        idx = np.concatenate([part, np.full(batch - len(part), part[-1])])  # one compiled shape
        windows = padded[idx[:, None] + np.arange(T)[None, :]]
        p = np.asarray(probs(params, jnp.asarray(windows)))
        for j, s in enumerate(part):
            first = 0 if s == 0 else T - stride  # window position of the first kept prediction
            lo, hi = s + first + 1, min(s + T + 1, N)  # the tokens it predicts
            if hi > lo:
                out[lo:hi] = p[j, first:first + hi - lo]
        bar.update(len(part))
    bar.close()
    return out
