"""Speculative sampling: a cheap draft proposes, the target verifies several tokens in one pass.

Leviathan, Kalman and Matias (2023), "Fast Inference from Transformers via Speculative Decoding";
Chen et al. (2023), "Accelerating Large Language Model Decoding with Speculative Sampling".

Each iteration, for every row of the batch at once:

1. the draft proposes ``gamma`` tokens ``x_1 .. x_gamma`` from its distributions ``q_i``;
2. the target scores the pending token and the ``gamma`` proposals in ONE :func:`model.extend`
   pass, which gives its distributions ``p_1 .. p_{gamma+1}``;
3. proposal ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
   rejection a token is drawn from the normalized residual ``max(p_i - q_i, 0)``; if all are
   accepted, one more token comes from ``p_{gamma+1}``;
4. each row keeps what it accepted plus that one token: its target cache length (and the
   draft's state) rolls back to exactly that context.

Whatever the draft, each row's output has exactly the target's distribution (processed by the
same stateless rule as the draft's: temperature, top-k, top-p, min-p, ...); the draft only
changes how many tokens each target pass yields. With ``greedy=True`` a proposal is accepted
while it equals the target's argmax and the correction is the argmax, so the output equals
greedy decoding.

Rows accept different numbers of tokens, so each row has its own output buffer, count, target
cache length and draft state. The whole run is a few jitted ``lax.while_loop`` segments, one per
static attended span of the KV cache (as in :mod:`jaxdecode.sampling`): no host round trip per
token. Randomness: row ``r`` draws all the noise of iteration ``i`` (one uniform per draft token,
per acceptance test and for the corrected token; fixed entries per position) from
``fold_in(fold_in(key, r), i)`` (:func:`iteration_noise`). A row's output therefore depends only
on the user key, its row id and its own history, never on its batch.

The KV cache gives the book's exact logits only within the model window ``T``; requests whose
prompt plus ``n`` plus ``gamma + 1`` do not fit are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import kernels
from . import model as M
from .rules import processed_logprobs
from .sampling import (
    PROMPT_BUCKET,
    SPAN_BUCKET,
    Generation,
    batch_bucket,
    encode_prompts,
    pad_rule,
    round_up,
)

NEG_INF = -jnp.inf


def _logprobs(logits):
    """``log_softmax`` that keeps ``-inf`` entries (removed tokens) at ``-inf`` without NaN."""
    return processed_logprobs(logits)


def _take(x, idx):
    """``x[b, j, idx[b, j]]`` for ``x`` ``[B, S, V]`` and ``idx`` ``[B, S]``."""
    return jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]


# ----------------------------------------------------------------------------- acceptance


def row_keys(key: jax.Array, row_ids: jax.Array) -> jax.Array:
    """``[B]`` keys ``fold_in(key, row_id)``."""
    return jax.vmap(lambda r: jax.random.fold_in(key, r))(row_ids)


class Noise(NamedTuple):
    """The randomness of one iteration, for every row (one uniform draw per row and iteration).
    Every entry is uniform in (0, 1); tokens are drawn by inverting the CDF (:func:`_draw`)."""

    accept: jax.Array  # [B, gamma] the acceptance tests
    final: jax.Array  # [B] the corrected (or extra) token
    draft: jax.Array | None  # [B, gamma] the draft's proposals


def iteration_noise(keys, iteration, gamma: int, draft: bool = True) -> Noise:
    """Noise for every row: ``uniform(fold_in(keys[b], iteration))``, cut into its parts.

    Position ``j`` of row ``b`` at iteration ``i`` uses fixed entries of that row's draw, so a
    row's randomness depends only on the user key, its row id, the iteration and the position.
    """
    m = 2 * gamma + 1 if draft else gamma + 1  # one uniform per token, whatever the vocabulary
    tiny = jnp.finfo(jnp.float32).tiny
    i = jnp.asarray(iteration, jnp.uint32)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, i), (m,), minval=tiny))(keys)
    return Noise(u[:, :gamma], u[:, gamma], u[:, gamma + 1:] if draft else None)


def _draw(weights, u):
    """Token ``[B]`` drawn from unnormalized non-negative ``weights`` ``[B, V]`` by inverting the
    CDF with ``u`` ``[B]`` uniform in (0, 1): the first token whose cumulative weight reaches
    ``u`` times the total. That token always has positive weight (the cumulative weight before it
    is below ``u * total > 0``, and ``u * total`` cannot round above the total). One uniform per
    token instead of a Gumbel per vocabulary entry: the noise was most of a draft's cost."""
    cdf = jnp.cumsum(weights, axis=-1)
    return jnp.sum(cdf < u[:, None] * cdf[:, -1:], axis=-1).astype(jnp.int32)


def _accept(p, q, draft, noise: Noise | None, greedy: bool):
    """:func:`accept` with the iteration's ``noise`` (unused when ``greedy``)."""
    B, G = draft.shape
    rows = jnp.arange(B)
    p_draft = p[:, :G]  # [B, G, V] the target at the proposed positions
    if greedy:
        ok = draft == jnp.argmax(p_draft, axis=-1)
    else:
        # accept with probability min(1, p/q): u < p/q, written without the division
        ok = noise.accept * _take(q, draft) < _take(p_draft, draft)
    n_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [B]
    p_next = p[rows, n_accepted]  # [B, V] the target where the row stops
    if greedy:
        return n_accepted, jnp.argmax(p_next, axis=-1).astype(jnp.int32)
    q_next = q[rows, jnp.minimum(n_accepted, G - 1)]
    residual = jnp.maximum(p_next - q_next, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # after a rejection the normalized residual (its mass is positive whenever a rejection can
    # happen); after all accepted, the target's own next distribution (_draw normalizes)
    rejected = (n_accepted < G)[:, None] & (mass > 0)
    return n_accepted, _draw(jnp.where(rejected, residual, p_next), noise.final)


def accept(p, q, draft, key, *, row_ids=None, iteration=0, greedy: bool = False):
    """The acceptance step of speculative sampling on plain arrays.

    ``p`` ``[B, gamma+1, V]``: the target's probabilities at the positions of the proposals and
    one past them; ``q`` ``[B, gamma, V]``: the draft's probabilities the proposals ``draft``
    ``[B, gamma]`` were drawn from. Returns ``n_accepted`` ``[B]`` (how many leading proposals are
    kept) and ``next_token`` ``[B]`` (the residual sample after the first rejection, or a sample
    from ``p[:, gamma]`` when all were accepted). Row ``b`` draws its noise from
    ``fold_in(fold_in(key, row_ids[b]), iteration)`` (:func:`iteration_noise`).

    With ``greedy``, a proposal is kept while it is the argmax of ``p`` (logits work too) and
    ``next_token`` is the argmax where the row stops; ``q`` is not used.
    """
    draft = jnp.asarray(draft, jnp.int32)
    B, G = draft.shape
    p = jnp.asarray(p, jnp.float32)
    if p.shape[:2] != (B, G + 1):
        raise ValueError(f"accept: p must have shape [B, gamma+1, V] = [{B}, {G + 1}, V], "
                         f"got {p.shape}")
    if not greedy:
        q = jnp.asarray(q, jnp.float32)
        if q.shape != (B, G, p.shape[2]):
            raise ValueError(f"accept: q must have shape {(B, G, p.shape[2])}, got {q.shape}")
    row_ids = jnp.arange(B) if row_ids is None else jnp.asarray(row_ids)
    return _accept_keys(p, q, draft, key, row_ids, jnp.asarray(iteration), greedy=greedy)


@functools.partial(jax.jit, static_argnames=("greedy",))
def _accept_keys(p, q, draft, key, row_ids, iteration, greedy):
    noise = None
    if not greedy:
        noise = iteration_noise(row_keys(key, row_ids), iteration, draft.shape[1], draft=False)
    return _accept(p, q, draft, noise, greedy)


# ----------------------------------------------------------------------------- drafts


def _draft(cls):
    """Make ``cls`` a frozen dataclass and a pytree whose fields marked ``static`` are metadata."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = [f.name for f in fields if not f.metadata.get("static", False)]
    meta = [f.name for f in fields if f.metadata.get("static", False)]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def _static():
    return dataclasses.field(metadata={"static": True})


def _pick(processed, u):
    """One token per row from processed logits ``[B, V]``: a draw from ``softmax(logits)`` with
    uniforms ``u`` ``[B]`` (:func:`_draw`), or the argmax if ``u`` is ``None``."""
    if u is None:
        return jnp.argmax(processed, axis=-1).astype(jnp.int32)
    return _draw(jnp.exp(processed - jnp.max(processed, axis=-1, keepdims=True)), u)


class Draft:
    """The interface of a draft. Drafts are pytrees (tables, parameters are leaves), so a jitted
    loop takes them as arguments; shape-changing settings (``n``, the config) are static.

    ``init(prompt [B, P], lengths [B], capacity) -> state``
        state for right-padded prompts; ``capacity`` bounds every position the loop will touch.
    ``propose(state, noise [B, gamma] | None, gamma, process, span)``
    ``-> (tokens [B, gamma], q [B, gamma, V] | None, state)``
        ``gamma`` proposals after each row's accepted context, with the processed logits ``q``
        they were drawn from (``process`` maps raw logits ``[B, V]`` to processed ones). Proposal
        ``j`` is drawn from ``softmax(q_j)`` with the uniform ``noise[:, j]`` (see ``_pick``), or
        is ``argmax(q_j)`` when ``noise`` is ``None`` (greedy decoding). A deterministic draft returns ``q = None`` (a
        point mass on each proposal). ``span`` is the static attended cache span of the segment.
    ``commit(state, tokens [B, gamma], n_accepted [B], token [B], active [B]) -> state``
        advance to the context plus ``tokens[:, :n_accepted]`` plus ``token`` (rolling back
        whatever ``propose`` added beyond that); rows that are not ``active`` keep the state they
        had before ``propose``.
    """

    def check(self, cfg: M.ModelConfig, need: int) -> None:
        """Raise ValueError if the draft cannot serve target ``cfg`` for ``need`` positions."""

    def init(self, prompt, lengths, capacity: int):
        raise NotImplementedError

    def propose(self, state, noise, gamma: int, process, span: int):
        raise NotImplementedError

    def commit(self, state, tokens, n_accepted, token, active):
        raise NotImplementedError


# --- n-gram table


class NGramState(NamedTuple):
    context: jax.Array  # [B, n-1] int32 the last n-1 tokens of the context; V = none (too short)
    row: jax.Array  # [B] int32 with backoff: the table row of the context's longest seen suffix


@_draft
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
    n: int = _static()
    V: int = _static()
    slots: jax.Array | None = None
    slot_rows: jax.Array | None = None
    probes: int = dataclasses.field(default=0, metadata={"static": True})
    hash_bits: int = dataclasses.field(default=0, metadata={"static": True})
    backoff: bool = dataclasses.field(default=False, metadata={"static": True})
    goto: jax.Array | None = None

    MAX_INDEX = 1 << 22
    HASH = 0x9E3779B1  # Fibonacci hashing: the top bits of key * 2^32 / golden ratio

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
        ``backoff`` the transition table unless ``goto`` (saved from an earlier build) is given."""
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
            index = jnp.asarray(index)
        else:  # linear probing, filled in hash order: a key lands at max(hash, previous + 1)
            bits = max(1, int(2 * len(keys) - 1).bit_length())  # load factor <= 1/2
            h = cls._hash(keys, bits)
            by_hash = np.argsort(h, kind="stable")
            h = h[by_hash]
            at = np.maximum.accumulate(h - np.arange(len(h))) + np.arange(len(h))
            probes = int(np.max(at - h)) + 1
            slots = np.full(int(at[-1]) + probes + 1, -1, np.int64)
            slots[at] = keys[by_hash]
            slot_rows = np.full(len(slots), len(keys), np.int32)
            slot_rows[at] = rows[by_hash]
            slots, slot_rows = jnp.asarray(slots, jnp.int32), jnp.asarray(slot_rows)
        if not backoff:
            goto = None
        elif goto is None:
            goto = jnp.asarray(cls._transitions(keys, n, V))
        else:
            goto = np.asarray(goto)
            if goto.shape != (len(keys), V) or goto.min() < 0 or goto.max() >= len(keys):
                raise ValueError(f"NGramDraft: a transition table must be [{len(keys)}, {V}] rows "
                                 f"of the table, got shape {goto.shape}")
            goto = jnp.asarray(goto, jnp.int32)
        return cls(jnp.asarray(keys, jnp.int32), jnp.asarray(logp, jnp.float32), index, n, V,
                   slots, slot_rows, probes, bits, bool(backoff), goto)

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
    def distill(cls, params, cfg: M.ModelConfig, tokens, n: int = 6, backoff: float = 2.0,
                **predict) -> NGramDraft:
        """An n-gram table of the target's own predictions: each context's row is the average of
        what the target predicts after it in ``tokens`` (:func:`target_predictions`; ``predict``
        goes there), interpolated with the shorter contexts as with ``backoff``.

        Counting estimates the text's next-token distribution; this estimates the target's, which
        is what a draft must match: on the shipped model and corpus, the 6-gram table accepts
        about 0.88 of its proposals against about 0.81 for the counted 5-gram."""
        soft = target_predictions(params, cfg, tokens, **predict)
        return cls.from_tokens(tokens, cfg.V, n=n, backoff=backoff, soft=soft)

    def check(self, cfg, need):
        if cfg.V != self.V:
            raise ValueError(f"NGramDraft: the table has V={self.V}, the target V={cfg.V}")

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
            tok = _pick(processed, None if noise is None else noise[:, j])
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


def target_predictions(params, cfg: M.ModelConfig, tokens, *, stride: int | None = None,
                       batch: int = 16, progress: bool = False) -> np.ndarray:
    """``[N, V]`` float32: row ``i`` is the target's next-token distribution for token ``i``
    given the tokens before it (row 0, which has none, is the one-hot of token 0).

    The text is read in windows of ``T`` tokens starting every ``stride`` (default ``3 T / 4``):
    the first window gives the predictions for tokens 1 .. T, window ``j >= 1`` (starting at
    ``s = j * stride``) those for tokens ``s + T - stride + 1 .. s + T``. A prediction therefore
    sees all earlier tokens up to ``T``, and at least ``T - stride`` of them beyond.
    ``progress`` shows a progress bar (tqdm) on stderr."""
    T, V = cfg.T, cfg.V
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
    probs = jax.jit(lambda p, w: jax.nn.softmax(M.forward(p, cfg, w), axis=-1))  # weights as arguments
    from tqdm import tqdm

    bar = tqdm(total=J, desc="target predictions", unit="window", leave=False, disable=not progress)
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


DISTILLED_N = 6
DISTILLED_BACKOFF = 2.0


def distilled_draft(lm, data_path=None, *, n: int = DISTILLED_N, backoff: float = DISTILLED_BACKOFF,
                    train_fraction: float = 0.9, progress: bool = False) -> NGramDraft:
    """:meth:`NGramDraft.distill` of ``lm`` over the training split of the corpus, cached.

    Reading the corpus through the target takes a few minutes of CPU (the shipped model over a
    million characters: about 2 minutes on two cores), so the table is kept in ``drafts/`` under
    ``$JAXDECODE_CACHE`` (default ``~/.cache/jaxdecode``) by a hash of the weights, the text and
    the settings, written atomically. A cache file that cannot be read is rebuilt."""
    import hashlib
    import os
    import tempfile
    import warnings

    from .data import read_corpus

    text = read_corpus(data_path)
    train = text[:int(train_fraction * len(text))]
    tokens = np.asarray(lm.vocab.encode(train), np.int32)
    h = hashlib.sha256()
    h.update(f"distilled-v2 n={n} backoff={backoff!r} V={lm.cfg.V} cfg={lm.cfg}".encode())
    for leaf in jax.tree_util.tree_leaves(lm.params):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    h.update(tokens.tobytes())
    path = kernels.cache_root() / "drafts" / f"distilled-{h.hexdigest()[:24]}.npz"
    if path.exists():
        try:
            with np.load(path) as f:
                return NGramDraft.from_table(f["keys"], f["logp"], n, True, f["goto"])
        except Exception as e:  # noqa: BLE001 - a damaged cache is rebuilt, not fatal
            warnings.warn(f"rebuilding the distilled draft: cannot read {path} ({e})", stacklevel=2)
    draft = NGramDraft.distill(lm.params, lm.cfg, tokens, n=n, backoff=backoff, progress=progress)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, keys=np.asarray(draft.keys), logp=np.asarray(draft.logits),
                     goto=np.asarray(draft.goto))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache only costs the next run the rebuild
        warnings.warn(f"could not cache the distilled draft at {path}: {e}", stacklevel=2)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return draft


# --- a small model


class ModelDraftState(NamedTuple):
    cache: M.KVCache  # the draft's cache: the context without its last npend tokens
    pending: jax.Array  # [B, 2] int32 tokens of the context not yet in the cache (npend of them)
    npend: jax.Array  # [B] int32 1 or 2
    base: jax.Array  # [B] int32 the cache length before the last propose


@_draft
class ModelDraft(Draft):
    """A small CharLM with its own parameters and KV cache (same vocabulary as the target).

    The cache holds the accepted context except its last one or two tokens, which the next
    :meth:`propose` feeds in a single ``extend`` (two tokens when every proposal was accepted:
    the last proposal itself was never fed to the draft).
    """

    params: Any
    cfg: M.ModelConfig = _static()

    @classmethod
    def from_lm(cls, lm) -> ModelDraft:
        return cls(lm.params, lm.cfg)

    def check(self, cfg, need):
        if cfg.V != self.cfg.V:
            raise ValueError(f"ModelDraft: the draft model has V={self.cfg.V}, the target V={cfg.V}")
        if need > self.cfg.T:
            raise ValueError(f"ModelDraft: the request needs {need} positions, more than the draft "
                             f"model's window T={self.cfg.T}")

    def init(self, prompt, lengths, capacity):
        B, P = prompt.shape
        lengths = jnp.asarray(lengths, jnp.int32)
        _, cache = M.prefill(self.params, self.cfg, prompt[:, :min(P, self.cfg.T)], lengths - 1,
                             capacity=capacity)
        last = jnp.take_along_axis(prompt, (lengths - 1)[:, None], axis=1)[:, 0]
        return ModelDraftState(cache, jnp.stack([last, last], axis=1), jnp.ones((B,), jnp.int32),
                               lengths - 1)

    def propose(self, state, noise, gamma, process, span):
        base = state.cache.length
        # rows with one pending token feed it plus a throwaway copy, read the logits at index 0
        # and count one position: the copy lies past the length and is overwritten next step
        logits2, cache = M.extend(self.params, self.cfg, state.cache, state.pending, span)
        logits = jnp.take_along_axis(logits2, (state.npend - 1)[:, None, None], axis=1)[:, 0]
        cache = cache._replace(length=base + state.npend)
        first = process(logits)
        tok = _pick(first, None if noise is None else noise[:, 0])

        def body(carry, u):
            cache, tok = carry
            logits, cache = M.step(self.params, self.cfg, cache, tok, span)
            processed = process(logits)
            nxt = _pick(processed, u)
            return (cache, nxt), (nxt, processed)

        xs = None if noise is None else jnp.transpose(noise[:, 1:])
        (cache, _), (toks, qs) = jax.lax.scan(body, (cache, tok), xs, length=gamma - 1)
        tokens = jnp.concatenate([tok[:, None], toks.T], axis=1)  # [B, gamma]
        q = jnp.concatenate([first[:, None], jnp.transpose(qs, (1, 0, 2))], axis=1)  # [B, gamma, V]
        return tokens, q, state._replace(cache=cache, base=base)

    def commit(self, state, tokens, n_accepted, token, active):
        G = tokens.shape[1]
        context = state.base + state.npend  # context length (with the pending tokens)
        full = n_accepted == G
        # the cache holds context + proposals 1..G-1; keep context + the accepted ones
        length = jnp.where(full, context + G - 1, context + n_accepted)
        pending = jnp.where(full[:, None], jnp.stack([tokens[:, -1], token], axis=1),
                            jnp.stack([token, token], axis=1))
        npend = jnp.where(full, 2, 1).astype(jnp.int32)
        return ModelDraftState(
            state.cache._replace(length=jnp.where(active, length, state.base)),
            jnp.where(active[:, None], pending, state.pending),
            jnp.where(active, npend, state.npend),
            state.base)


# --- prompt lookup


class LookupState(NamedTuple):
    history: jax.Array  # [B, capacity] int32 each row's context, left-aligned
    length: jax.Array  # [B] int32


@_draft
class PromptLookupDraft(Draft):
    """Continue the most recent earlier occurrence of the context's last ``n`` tokens.

    Deterministic: ``q`` is a point mass on the proposal. The continuation copies the tokens that
    followed the occurrence, reading on into the proposals themselves when it reaches the end of
    the context (so a repeating pattern keeps repeating). Without an occurrence it proposes the
    last token again.
    """

    n: int = _static()

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"PromptLookupDraft: n must be an integer >= 1, got {self.n!r}")

    def init(self, prompt, lengths, capacity):
        B, P = prompt.shape
        w = min(P, capacity)  # padding may be wider than the capacity, real prompts are not
        history = jnp.zeros((B, capacity), jnp.int32).at[:, :w].set(prompt[:, :w])
        return LookupState(history, jnp.asarray(lengths, jnp.int32))

    def _match_end(self, history, length):
        """[B]: the last index j <= length-2 where history[j-n+1 .. j] equals the context's last
        n tokens; length - 2 (repeat the last token) where there is none."""
        _B, C = history.shape
        j = jnp.arange(C)[None, :]
        match = (j >= self.n - 1) & (j <= length[:, None] - 2) & (length[:, None] >= self.n)
        for i in range(self.n):
            want = jnp.take_along_axis(history, jnp.maximum(length - 1 - i, 0)[:, None], axis=1)
            shifted = jnp.pad(history, ((0, 0), (i, 0)))[:, :C]  # shifted[b, j] = history[b, j-i]
            match &= shifted == want
        found = jnp.any(match, axis=1)
        last = C - 1 - jnp.argmax(match[:, ::-1], axis=1)
        return jnp.where(found, last, length - 2)

    def propose(self, state, noise, gamma, process, span):
        history, length = state
        B = history.shape[0]
        start = self._match_end(history, length)
        rows = jnp.arange(B)
        tokens = []
        for i in range(1, gamma + 1):
            # start + i < length + i - 1: always an earlier context or proposal position
            tok = history[rows, jnp.maximum(start + i, 0)]
            history = history.at[rows, length + i - 1].set(tok, mode="drop")
            tokens.append(tok)
        return jnp.stack(tokens, axis=1), None, state

    def commit(self, state, tokens, n_accepted, token, active):
        history, length = state
        B, _G = tokens.shape
        seq = jnp.concatenate([tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)
        seq = seq.at[jnp.arange(B), n_accepted].set(token)  # [B, G + 1]
        write = jax.vmap(lambda h, s, at: jax.lax.dynamic_update_slice(h, s, (at,)))
        # inactive rows write past their length only (garbage there is never read)
        history = write(history, seq, length)
        return LookupState(history, jnp.where(active, length + n_accepted + 1, length))


def make_draft(kind: str, lm, data_path=None, *, n: int | None = None,
               backoff: float | None = None, progress: bool = False) -> Draft:
    """A draft for target ``lm``: ``"ngram"`` (an n-gram table from the training split of the
    corpus: by default the chapter's add-0.01 trigram; ``n`` tokens, and with ``backoff=beta``
    interpolated with the shorter contexts, see :class:`NGramDraft`), ``"distilled"`` (a table
    of the target's own predictions over the same text, by default a 6-gram with backoff 2, see
    :func:`distilled_draft`; ``progress`` shows its first, slow build), ``"draft"`` (the shipped
    small model ``shakespeare-char-draft``) or ``"lookup"`` (prompt lookup over the last ``n``
    tokens, default 3)."""
    if backoff is not None and kind not in ("ngram", "distilled"):
        raise ValueError("backoff applies to the n-gram drafts only")
    if kind == "distilled":
        return distilled_draft(lm, data_path, n=DISTILLED_N if n is None else n,
                               backoff=DISTILLED_BACKOFF if backoff is None else backoff,
                               progress=progress)
    if kind == "ngram":
        from .data import read_corpus

        return NGramDraft.from_corpus(lm.vocab, read_corpus(data_path), n=3 if n is None else n,
                                      backoff=backoff)
    if kind == "draft":
        from .checkpoint import DRAFT_NAME, load

        small = load(DRAFT_NAME)
        if small.vocab.chars != lm.vocab.chars:
            raise ValueError("the draft model's vocabulary differs from the target's")
        return ModelDraft.from_lm(small)
    if kind == "lookup":
        return PromptLookupDraft(3 if n is None else n)
    raise ValueError(f"unknown draft kind {kind!r}: use 'ngram', 'distilled', 'draft' or 'lookup'")


# ----------------------------------------------------------------------------- the loop


class SpecState(NamedTuple):
    """The loop carry."""

    cache: M.KVCache  # the target's cache: the context without its last (pending) token
    pending: jax.Array  # [B] int32 the context's last token
    context: jax.Array  # [B] int32 context length: prompt + generated
    draft: Any  # the draft's state
    tokens: jax.Array  # [B, N] int32 generated tokens (valid up to count, then garbage)
    model_logprobs: jax.Array  # [B, N] float32 under the unmodified target
    sample_logprobs: jax.Array  # [B, N] float32 under the processed target
    count: jax.Array  # [B] int32 tokens generated (may overshoot n by up to gamma)
    passes: jax.Array  # [B] int32 target passes
    examined: jax.Array  # [B] int32 proposals that met the acceptance test
    accepted: jax.Array  # [B] int32 proposals accepted
    iteration: jax.Array  # [] int32


NOISE_TABLE_MAX = 1 << 20  # uniforms: a segment draws its noise up front when it needs at most this many


def _stateless(rule, V: int) -> None:
    if rule is None:
        return
    state = jax.eval_shape(lambda r: r.init(jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32),
                                            V, 1), rule)
    if jax.tree_util.tree_leaves(state):
        raise ValueError(
            f"{type(rule).__name__}: rules that keep state (repetition/frequency/presence "
            "penalties, no-repeat n-grams) are not supported with speculative decoding; use "
            "stateless rules (temperature, top-k, top-p, min-p, ...)")


def _processor(rule, B: int, V: int):
    if rule is None:
        return lambda logits: logits
    state = rule.init(jnp.zeros((B, 1), jnp.int32), jnp.ones((B,), jnp.int32), V, 1)
    return lambda logits: rule.apply(logits, state)


@functools.partial(jax.jit, static_argnames=("cfg", "gamma", "span", "greedy"),
                   donate_argnames=("state",))
def _segment(params, draft: Draft, state: SpecState, rule, key, row_ids, n, packed=None, *,
             cfg: M.ModelConfig, gamma: int, span: int, greedy: bool) -> SpecState:
    """Iterate while some row is unfinished and every unfinished row fits in ``span``.
    ``packed``: the weights packed for passes of a few rows (``model.pack_params``), or None."""
    B = state.pending.shape[0]
    V = cfg.V
    rows = jnp.arange(B)
    keys = row_keys(key, row_ids)
    process = _processor(rule, B, V)
    process_all = jax.vmap(process, in_axes=1, out_axes=1)  # over the positions of [B, S, V]

    # A row makes at least one token a pass, so this segment runs at most n passes. When their
    # noise is small, draw it all here, in one vectorized call: each iteration then slices its
    # row of the table instead of running the generator (a loop of a few dozen tiny operations,
    # which costs more than the numbers themselves). Same values either way.
    n_max = state.tokens.shape[1]  # static, and at least n
    table = None
    if not greedy and B * n_max * (2 * gamma + 1) <= NOISE_TABLE_MAX:
        its = state.iteration + jnp.arange(n_max, dtype=jnp.int32)
        table = jax.vmap(lambda i: iteration_noise(keys, i, gamma), out_axes=1)(its)  # [B, n_max, ..]

    def noise_at(st):
        if greedy:
            return None
        if table is None:
            return iteration_noise(keys, st.iteration, gamma)
        k = jnp.minimum(st.iteration - state.iteration, n_max - 1)
        return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, k, 1, False), table)

    def cond(st):
        active = st.count < n
        need = jnp.max(jnp.where(active, st.context + gamma, 0))
        return jnp.any(active) & (need <= span)

    def body(st):
        active = st.count < n
        noise = noise_at(st)
        drafts, q_logits, dstate = draft.propose(st.draft, None if greedy else noise.draft, gamma,
                                                 process, span)
        fed = jnp.concatenate([st.pending[:, None], drafts], axis=1)  # [B, gamma+1]
        logits, cache = M.extend(params, cfg, st.cache, fed, span, packed)  # [B, gamma+1, V]
        processed = process_all(logits)
        sample_lp = _logprobs(processed)
        if greedy:
            n_acc, nxt = _accept(processed, None, drafts, None, True)
        elif q_logits is None:  # a deterministic draft: q is a point mass on each proposal
            n_acc, nxt = _accept(jnp.exp(sample_lp), jax.nn.one_hot(drafts, V), drafts, noise, False)
        else:
            n_acc, nxt = _accept(jnp.exp(sample_lp), jnp.exp(_logprobs(q_logits)), drafts, noise,
                                 False)
        new = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
        new = new.at[rows, n_acc].set(nxt)  # [B, gamma+1] valid up to n_acc
        write = jax.vmap(lambda buf, x, at: jax.lax.dynamic_update_slice(buf, x, (at,)))
        # finished rows write past n only (the buffer has room), and are cut off on the host
        tokens = write(st.tokens, new, st.count)
        mlp = write(st.model_logprobs, _take(_logprobs(logits), new), st.count)
        slp = write(st.sample_logprobs, _take(sample_lp, new), st.count)
        # roll back: keep the pending token and the accepted proposals
        cache = cache._replace(length=jnp.where(active, st.context + n_acc, st.cache.length))
        dstate = draft.commit(dstate, drafts, n_acc, nxt, active)
        on = active.astype(jnp.int32)
        return SpecState(
            cache=cache,
            pending=jnp.where(active, nxt, st.pending),
            context=st.context + on * (n_acc + 1),
            draft=dstate,
            tokens=tokens, model_logprobs=mlp, sample_logprobs=slp,
            count=st.count + on * (n_acc + 1),
            passes=st.passes + on,
            examined=st.examined + on * jnp.minimum(n_acc + 1, gamma),
            accepted=st.accepted + on * n_acc,
            iteration=st.iteration + 1)

    return jax.lax.while_loop(cond, body, state)


@functools.partial(jax.jit, static_argnames=("cfg", "capacity", "width", "N"))
def _start(params, draft: Draft, prompt, length, count, packed=None, *, cfg, capacity, width, N):
    """The loop's first state: the prompts (but their last tokens) prefilled into the target's
    cache, the draft's state, empty outputs. One call: every dispatch costs host time."""
    B = prompt.shape[0]
    cache = M.prefill_cache(params, cfg, prompt[:, :width], length - 1, capacity=capacity, packed=packed)
    zeros = jnp.zeros((B,), jnp.int32)
    return SpecState(
        cache=cache,
        pending=jnp.take_along_axis(prompt, (length - 1)[:, None], axis=1)[:, 0],
        context=length,
        draft=draft.init(prompt, length, capacity),
        tokens=jnp.zeros((B, N), jnp.int32),
        model_logprobs=jnp.zeros((B, N), jnp.float32),
        sample_logprobs=jnp.zeros((B, N), jnp.float32),
        count=count, passes=zeros, examined=zeros, accepted=zeros, iteration=jnp.int32(0))


@dataclasses.dataclass
class SpeculativeStats:
    """Counts of one row (or summed over rows) of a speculative run."""

    gamma: int
    passes: int  # target passes (one extend of gamma + 1 positions each)
    proposed: int  # draft tokens proposed: gamma per pass
    examined: int  # proposals that met the acceptance test (up to and including the first rejection)
    accepted: int  # proposals accepted
    generated: int  # tokens produced, including the overshoot cut off at n

    @property
    def acceptance_rate(self) -> float:
        """alpha: the share of examined proposals that were accepted."""
        return self.accepted / self.examined if self.examined else float("nan")

    @property
    def chars_per_pass(self) -> float:
        return self.generated / self.passes if self.passes else float("nan")

    @property
    def predicted_chars_per_pass(self) -> float:
        """``(1 - alpha^(gamma+1)) / (1 - alpha)``: tokens per pass if acceptances were i.i.d."""
        return predicted_chars_per_pass(self.acceptance_rate, self.gamma)

    @classmethod
    def total(cls, stats: Sequence[SpeculativeStats]) -> SpeculativeStats:
        stats = list(stats)
        if len({s.gamma for s in stats}) != 1:
            raise ValueError("SpeculativeStats.total: the stats have different gammas")
        return cls(stats[0].gamma, *(sum(getattr(s, f) for s in stats)
                                     for f in ("passes", "proposed", "examined", "accepted", "generated")))

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, chars_per_pass=self.chars_per_pass,
                 predicted_chars_per_pass=self.predicted_chars_per_pass)
        return d


def predicted_chars_per_pass(alpha: float, gamma: int) -> float:
    """Expected tokens per target pass for i.i.d. acceptances at rate ``alpha`` (Leviathan et al.)."""
    if math.isnan(alpha):
        return float("nan")
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclasses.dataclass
class SpeculativeResult:
    tokens: np.ndarray  # [B, n] int32
    model_logprobs: np.ndarray  # [B, n] float32
    sample_logprobs: np.ndarray  # [B, n] float32
    stats: list  # [B] SpeculativeStats


def _batch_bucket(b: int) -> int:
    """Powers of two up to 1024 rows, then multiples of 1024 (big batches waste little)."""
    return batch_bucket(b) if b <= 1024 else round_up(b, 1024)


def check_request(cfg: M.ModelConfig, max_prompt: int, n: int, gamma: int) -> None:
    """Raise ValueError unless prompt + n + gamma + 1 fits in the model window."""
    need = max_prompt + n + gamma + 1
    if need > cfg.T:
        raise ValueError(
            f"speculative decoding: the prompt ({max_prompt}) plus n ({n}) plus gamma + 1 "
            f"({gamma + 1}) is {need} positions, more than the model window T={cfg.T}; the KV cache "
            f"is exact only within the window: shorten the request or use plain sampling")


def speculative_tokens(params, cfg: M.ModelConfig, prompts, n: int, key: jax.Array, *,
                       draft: Draft, gamma: int = 4, rule=None, greedy: bool = False,
                       row_ids: Sequence[int] | None = None) -> SpeculativeResult:
    """Generate ``n`` tokens after each prompt (token arrays, or one ``[B, P]`` array) by
    speculative sampling from target ``params``/``cfg`` with ``draft``.

    ``rule`` (stateless) processes both the target's and the draft's logits; the output has the
    processed target's distribution. ``row_ids`` (default ``0..B-1``) name the rows for the PRNG.
    """
    if not isinstance(gamma, (int, np.integer)) or isinstance(gamma, bool) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
    gamma = int(gamma)
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:  # equal lengths: no per-row work
        lens = np.full((prompts.shape[0],), prompts.shape[1], np.int32)
    else:
        prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        lens = np.array([len(p) for p in prompts], np.int32)
    B = len(lens)
    if B == 0:
        raise ValueError("no prompts given")
    if n < 0:
        raise ValueError(f"the number of new tokens must be >= 0, got {n}")
    if lens.min() < 1:
        raise ValueError("every prompt needs at least one token")
    row_ids = np.arange(B) if row_ids is None else np.asarray(row_ids)
    if row_ids.shape != (B,):
        raise ValueError(f"row_ids must have one id per prompt ({B}), got shape {row_ids.shape}")
    _stateless(rule, cfg.V)
    Pmax = int(lens.max())
    check_request(cfg, Pmax, n, gamma)
    draft.check(cfg, Pmax + n + gamma + 1)
    if n == 0:
        e = np.zeros((B, 0), np.int32)
        zero = SpeculativeStats(gamma, 0, 0, 0, 0, 0)
        return SpeculativeResult(e, e.astype(np.float32), e.astype(np.float32),
                                 [dataclasses.replace(zero) for _ in range(B)])

    Bb = _batch_bucket(B)
    Pb = round_up(Pmax, PROMPT_BUCKET)
    prompt = np.zeros((Bb, Pb), np.int32)
    length = np.ones((Bb,), np.int32)
    length[:B] = lens
    if isinstance(prompts, np.ndarray):
        prompt[:B, :Pmax] = prompts
    else:
        for i, p in enumerate(prompts):
            prompt[i, :len(p)] = p
    count = np.zeros((Bb,), np.int32)
    count[B:] = n  # padding rows start finished
    row_ids_b = np.concatenate([row_ids, np.arange(B, Bb) + 2**30]).astype(np.uint32)
    rule_b = pad_rule(rule, B, Bb)
    # room for every write of a finished row (at most 2 gamma + 2 past the window)
    capacity = cfg.T + 2 * gamma + 2
    N = round_up(n + 2 * gamma + 2, 64)

    # A verify pass multiplies every weight matrix by Bb * (gamma + 1) rows: when those are few,
    # each layer is one native CPU call (kernels.decode_layer) on weights packed once
    packed = M.packed_params(params) if kernels.packs_rows(Bb * (gamma + 1)) else None
    state = _start(params, draft, prompt, length, count, packed, cfg=cfg, capacity=capacity,
                   width=min(Pb, cfg.T), N=N)
    n_j = np.int32(n)  # numpy: a jnp scalar would cost a dispatch of its own
    ids_j = row_ids_b
    if kernels.reads_only_filled():
        # the native CPU attention reads each row only up to its length: one segment over the
        # whole window runs every row to the end (unfinished rows stay within T, checked above)
        state = _segment(params, draft, state, rule_b, key, ids_j, n_j, packed, cfg=cfg, gamma=gamma,
                         span=cfg.T, greedy=greedy)
    else:
        while True:
            count_h, context_h = jax.device_get((state.count, state.context))
            active = count_h < n
            if not active.any():
                break
            # finished rows may attend to garbage, which is never read back
            span = min(cfg.T, round_up(int(context_h[active].max()) + gamma, SPAN_BUCKET))
            state = _segment(params, draft, state, rule_b, key, ids_j, n_j, packed, cfg=cfg,
                             gamma=gamma, span=span, greedy=greedy)

    # only what is returned comes back to the host (not the cache); cut on the host, since a
    # slice on the device would compile once per (B, n)
    tokens, mlp, slp, passes, examined, accepted, count = jax.device_get(
        (state.tokens, state.model_logprobs, state.sample_logprobs, state.passes, state.examined,
         state.accepted, state.count))
    tokens, mlp, slp = tokens[:B, :n], mlp[:B, :n], slp[:B, :n]
    stats = [SpeculativeStats(gamma, int(passes[b]), gamma * int(passes[b]), int(examined[b]),
                              int(accepted[b]), int(count[b]))
             for b in range(B)]
    return SpeculativeResult(np.asarray(tokens, np.int32), np.asarray(mlp, np.float32),
                             np.asarray(slp, np.float32), stats)


@dataclasses.dataclass
class SpeculativeGeneration(Generation):
    """A :class:`jaxdecode.sampling.Generation` with the speculative run's counts for its row."""

    stats: SpeculativeStats = None


def speculative_generate(lm, prompts: str | Sequence[str], n: int, *, draft: Draft, gamma: int = 4,
                         seed: int = 0, key: jax.Array | None = None, rule=None, greedy: bool = False,
                         num_samples: int = 1) -> list[SpeculativeGeneration]:
    """Generate ``n`` characters after each prompt by speculative sampling with ``draft``.

    Returns ``len(prompts) * num_samples`` generations, prompt-major; sample ``j`` of prompt
    ``i`` uses row id ``i * num_samples + j`` (as :func:`jaxdecode.sampling.generate`). Each
    carries its row's :class:`SpeculativeStats`; :meth:`SpeculativeStats.total` sums them.
    """
    prompts, rows = encode_prompts(lm, prompts, num_samples)
    key = jax.random.PRNGKey(seed) if key is None else key
    res = speculative_tokens(lm.params, lm.cfg, rows, n, key, draft=draft, gamma=gamma, rule=rule,
                             greedy=greedy)
    return [SpeculativeGeneration(prompt=prompts[r // num_samples], text=lm.vocab.decode(res.tokens[r]),
                                  tokens=res.tokens[r], model_logprobs=res.model_logprobs[r],
                                  sample_logprobs=res.sample_logprobs[r], finish_reason="length",
                                  stats=res.stats[r])
            for r in range(len(rows))]


__all__ = [
    "Draft",
    "ModelDraft",
    "NGramDraft",
    "Noise",
    "PromptLookupDraft",
    "SpeculativeGeneration",
    "SpeculativeResult",
    "SpeculativeStats",
    "accept",
    "check_request",
    "iteration_noise",
    "make_draft",
    "predicted_chars_per_pass",
    "speculative_generate",
    "speculative_tokens",
]
