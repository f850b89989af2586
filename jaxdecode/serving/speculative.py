"""Speculative decoding inside the engine: the device programs of a speculative engine step and
:class:`SpeculativeExecutor`, the dense executor that runs them. See :mod:`jaxdecode.serving.engine`.

A speculative engine keeps each decoding slot as :func:`jaxdecode.speculative.speculative_tokens`
keeps a row: the target's cache holds the row's context without its last token (the *pending*
token), and the draft keeps its own state for the slot. One engine step is one device call of up
to ``decode_steps`` *passes* for every decoding slot (:func:`_passes`), each of one of two kinds:

- a speculative pass (:func:`_spec_pass`): the draft proposes ``gamma`` tokens, the target scores
  the pending token and the proposals in one ``extend`` over the slots' caches, and each slot
  accepts its own number of proposals (the acceptance test of :mod:`jaxdecode.speculative`,
  with the noise of the row's key, id and pass number: :func:`_pass_noise`); its cache length
  advances by what it kept;
- a plain pass (:func:`_plain_pass`): the target reads the pending token and the slot draws one
  token from the processed distribution with the uniform the same pass of speculative sampling
  would use for its corrected token (greedy: the argmax). The engine runs it above
  ``speculative_max_rows`` decoding slots, where a speculative pass stops paying.

Every pass of a row, of either kind, draws from its own pass number's noise, so each token is an
exact draw from the processed target given the text before it. A row whose passes were all
speculative has exactly :func:`~jaxdecode.speculative.speculative_generate`'s text for its seed
and row id. After plain passes the slot's draft state is behind; the next speculative pass first
builds it again from the row's text (:func:`_draft_rows`). A call leaves each slot's values on the
device for the next, which the engine sends before it reads the last one's tokens (``overlap``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.decoding.common import PROMPT_BUCKET, SPAN_BUCKET, round_up
from jaxdecode.rules import processed_logprobs
from jaxdecode.serving.config import SPECULATIVE_GAMMA, SPECULATIVE_MAX_ROWS
from jaxdecode.serving.executors import ModelExecutor, scatter_rows
from jaxdecode.serving.records import DeviceCall
from jaxdecode.speculative import make_draft
from jaxdecode.speculative.drafts.model import load_draft
from jaxdecode.speculative.acceptance import Noise, accept_with_noise, draw_token, row_keys, take_at


def _pass_noise(keys, row_ids, passes, gamma: int):
    """Each row's uniforms for its pass number: ``uniform(fold_in(fold_in(key, row_id), pass))``
    of :func:`jaxdecode.speculative.iteration_noise` (with the draft's share), one pass per row."""
    tiny = jnp.finfo(jnp.float32).tiny
    m = 2 * gamma + 1
    ks = row_keys(keys, row_ids)
    u = jax.vmap(lambda k, i: jax.random.uniform(jax.random.fold_in(k, i), (m,), minval=tiny))(
        ks, passes.astype(jnp.uint32))
    return Noise(u[:, :gamma], u[:, gamma], u[:, gamma + 1:])


def _processor(rule, rule_state):
    if rule is None:
        return lambda logits: logits
    return lambda logits: rule.apply(logits, rule_state)


def _spec_pass(params, cache, draft, dstate, rule, rule_state, noise, greedy, lengths, pending, decoding, *, model,
               gamma, span):
    """One speculative pass for every ``decoding`` slot (:mod:`jaxdecode.speculative.loop`'s loop
    body with a greedy flag and a pass number per slot). ``lengths``: each slot's cache length
    (a decoding slot's context less its pending token ``pending``; a slot that is not decoding
    keeps its length). Returns the tokens ``[S, gamma + 1]`` (valid up to ``made``), their
    log-probabilities under the target and the processed target, ``made`` ``[S]``, the
    accepted proposals ``[S]``, the cache and the draft state."""
    S, V = pending.shape[0], model.V
    rows = jnp.arange(S)
    process = _processor(rule, rule_state)
    process_all = jax.vmap(process, in_axes=1, out_axes=1)

    def draft_process(logits):
        # a greedy row's draft proposes the argmax of its processed logits (a point mass), as
        # speculative_tokens' greedy loop does; sampled rows draw from them
        p = process(logits)
        best = jnp.arange(V)[None, :] == jnp.argmax(p, axis=-1)[:, None]
        return jnp.where(greedy[:, None], jnp.where(best, 0.0, -jnp.inf), p)

    cache = model.truncate(cache, lengths)
    drafts, q_logits, dnew = draft.propose(dstate, noise.draft, gamma, draft_process, span)
    fed = jnp.concatenate([pending[:, None], drafts], axis=1)  # [S, gamma + 1]
    logits, _, cache = model.extend(params, cache, fed, span)
    target = process_all(logits)
    sample_lp = processed_logprobs(target)
    n_greedy, next_greedy = accept_with_noise(target, None, drafts, None, True)
    q = jax.nn.one_hot(drafts, V) if q_logits is None else jnp.exp(processed_logprobs(q_logits))
    n_sampled, next_sampled = accept_with_noise(jnp.exp(sample_lp), q, drafts, noise, False)
    n_acc = jnp.where(greedy, n_greedy, n_sampled)
    nxt = jnp.where(greedy, next_greedy, next_sampled)
    new = jnp.concatenate([drafts, jnp.zeros((S, 1), jnp.int32)], axis=1).at[rows, n_acc].set(nxt)
    mlp = take_at(processed_logprobs(logits), new)
    slp = take_at(sample_lp, new)
    cache = model.truncate(cache, jnp.where(decoding, lengths + 1 + n_acc, lengths))
    dnew = draft.commit(dnew, drafts, n_acc, nxt, decoding)
    return new, mlp, slp, n_acc + 1, n_acc, cache, dnew


def _plain_pass(params, cache, draft, dstate, rule, rule_state, noise, greedy, lengths, pending, decoding, *, model,
                gamma, span):
    """One plain pass for every ``decoding`` slot: the pending token read, one token drawn from
    the processed target with the pass's corrected-token uniform (greedy: the argmax). Returns
    :func:`_spec_pass`'s outputs for one token a slot (``[S, 1]``) and the cache."""
    process = _processor(rule, rule_state)
    cache = model.truncate(cache, lengths)
    logits, _, cache = model.extend(params, cache, pending[:, None], span)
    logits = logits[:, 0]
    processed = process(logits)
    sampled = draw_token(jnp.exp(processed - jnp.max(processed, axis=-1, keepdims=True)), noise.final)
    token = jnp.where(greedy, jnp.argmax(processed, axis=-1).astype(jnp.int32), sampled)
    take = lambda lp: jnp.take_along_axis(lp, token[:, None], axis=-1)
    mlp = take(processed_logprobs(logits))
    slp = take(processed_logprobs(processed))
    cache = model.truncate(cache, jnp.where(decoding, lengths + 1, lengths))
    one = jnp.ones_like(pending)
    return token[:, None], mlp, slp, one, one * 0, cache, dstate


@functools.partial(jax.jit, static_argnames=("model", "gamma", "span", "k", "speculative"),
                   donate_argnames=("cache", "dstate"))
def _passes(params, cache, draft, dstate, rule, rule_state, keys, row_ids, greedy, slots, carried, *, model, gamma,
            span, k, speculative):
    """Up to ``k`` passes (speculative or plain) in one call. ``slots`` ``[6, S]`` int32, one array
    (one transfer): each slot's pass number, cache length, pending token and the tokens it may
    still make (``left``), whether it decodes, and whether it goes on from the call before
    (``carried``: then its first four come from that call's ``carried`` output instead, which the
    host has not read yet). A decoding slot takes part in a pass while it has made fewer than
    ``left`` tokens in the call (a *live* slot). The call stops early, as the loop's segment
    does, once no slot is live or a live slot's next pass would write past ``span``.
    Returns the passes' tokens ``[k, S, m + 2]`` int32 (each pass's tokens, then the tokens made
    and the proposals accepted; zeros where a slot took no part or the pass did not run), their
    log-probabilities ``[2, k, S, m]`` (model, sample), each slot's four values after the call
    (``carried`` for the next), the cache and the draft state."""
    state = jnp.where(slots[5] > 0, carried, slots[:4])
    passes, lengths, pending, left = state
    decoding = slots[4] > 0
    one = _spec_pass if speculative else _plain_pass
    m = gamma + 1 if speculative else 1
    S = lengths.shape[0]
    # a slot takes part in consecutive passes from the first: its j-th pass here is its pass
    # passes + j. Every pass's noise drawn up front, in one vectorized call (the generator is a few
    # dozen tiny operations, which cost more per pass than the numbers themselves)
    table = jax.vmap(lambda j: _pass_noise(keys, row_ids, passes + j, gamma))(jnp.arange(k, dtype=jnp.int32))

    def cond(carry):
        j, _, _, lengths, _, made_so_far, _, _, _ = carry
        on = decoding & (made_so_far < left)
        fits = jnp.all(~on | (lengths + m <= span))
        return (j < k) & jnp.any(on) & fits

    def body(carry):
        j, cache, dstate, lengths, pending, made_so_far, took, ints, floats = carry
        on = decoding & (made_so_far < left)
        noise = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, False), table)
        tokens, mlp, slp, made, acc, cache, dstate = one(
            params, cache, draft, dstate, rule, rule_state, noise, greedy, lengths, pending, on,
            model=model, gamma=gamma, span=span)
        made = jnp.where(on, made, 0)
        last = jnp.take_along_axis(tokens, jnp.maximum(made - 1, 0)[:, None], axis=1)[:, 0]
        row = jnp.concatenate([tokens, made[:, None], jnp.where(on, acc, 0)[:, None]], axis=1)
        ints = jax.lax.dynamic_update_index_in_dim(ints, row, j, 0)
        floats = jax.lax.dynamic_update_index_in_dim(floats, jnp.stack([mlp, slp]), j, 1)
        return (j + 1, cache, dstate, lengths + made, jnp.where(on, last, pending), made_so_far + made,
                took + on.astype(jnp.int32), ints, floats)

    if not speculative:  # a plain pass leaves the draft's state as it is: keep it out of the loop
        kept, dstate = dstate, None
    zeros = jnp.zeros_like(lengths)
    carry = (jnp.int32(0), cache, dstate, lengths, pending, zeros, zeros,
             jnp.zeros((k, S, m + 2), jnp.int32), jnp.zeros((2, k, S, m), jnp.float32))
    _, cache, dstate, lengths, pending, made, took, ints, floats = jax.lax.while_loop(cond, body, carry)
    after = jnp.stack([passes + took, lengths, pending, left - made])
    return ints, floats, after, cache, dstate if speculative else kept


@functools.partial(jax.jit, static_argnames=("capacity",), donate_argnames=("dstate",))
def _draft_rows(draft, dstate, prompt, lengths, dst, *, capacity):
    """The draft state of texts ``prompt`` ``[K, W]`` (right-padded, ``lengths`` ``[K]``) written
    into slots ``dst`` (a ``dst`` past the end is dropped)."""
    return scatter_rows(dstate, draft.init(prompt, lengths, capacity), jnp.arange(prompt.shape[0]), dst)


@functools.partial(jax.jit, static_argnames=("capacity", "slots"))
def _draft_empty(draft, *, capacity, slots):
    return draft.init(jnp.zeros((slots, 1), jnp.int32), jnp.ones((slots,), jnp.int32), capacity)


class PassesOut:
    """A call of passes' outputs as the engine reads them: ``(tokens [k, S, m], model_logprobs,
    sample_logprobs, made [k, S], accepted [k, S])`` numpy, fetched (waiting for the call) when
    first read; ``on_fetch`` then sees them first (the host's counts of the rows)."""

    def __init__(self, ints, floats, speculative: bool, k: int, on_fetch=None):
        self.speculative, self.k = speculative, k
        self._device, self._host, self._on_fetch = (ints, floats), None, on_fetch

    def fetch(self) -> tuple:
        if self._host is None:
            ints, floats = (np.asarray(a) for a in jax.device_get(self._device))
            self._host, self._device = (ints[..., :-2], floats[0], floats[1], ints[..., -2], ints[..., -1]), None
            on_fetch, self._on_fetch = self._on_fetch, None
            if on_fetch is not None:
                on_fetch(self._host)
        return self._host

    def __getitem__(self, i):
        return self.fetch()[i]

    def __len__(self) -> int:
        return 5


class SpeculativeExecutor(ModelExecutor):
    """A :class:`ModelExecutor` whose decode steps are speculative passes (:func:`_spec_pass`) or
    plain passes in the same layout (:func:`_plain_pass`), with ``draft``'s state for every slot.
    A call's tokens are read when needed (:class:`PassesOut`): each slot's length, pending token,
    pass number and tokens left after a call stay on the device (``carried``), where the next call
    can take them before the host has read them."""

    multi_step = True  # several passes per call (decode_steps)
    asynchronous = True  # the engine may send the next call before it reads this one's tokens

    def __init__(self, lm, slots: int, draft, gamma: int):
        super().__init__(lm, slots)
        self.draft, self.gamma = draft, gamma
        # the draft's state reaches at most 2 gamma + 2 past the last position (as the loop's)
        self.draft_capacity = self.T + 2 * gamma + 2
        self.dstate = jax.tree_util.tree_map(
            jnp.copy, _draft_empty(draft, capacity=self.draft_capacity, slots=slots))
        self.carried = jnp.zeros((4, slots), jnp.int32)  # each slot's values after the last call (_passes)
        for leaf in jax.tree_util.tree_leaves(self.dstate):
            if leaf.ndim == 0 or leaf.shape[0] != slots:
                raise ValueError(f"the engine needs a draft whose state is batch-first; {type(draft).__name__} "
                                 f"has a leaf of shape {leaf.shape} for {slots} rows")

    def sync_drafts(self, texts):
        """``texts``: ``(slot, tokens)``: the draft state of each slot built for its text."""
        if not texts:
            return
        K = self._rows_bucket
        for start in range(0, len(texts), K):
            part = texts[start:start + K]
            W = min(round_up(max(len(t) for _, t in part), PROMPT_BUCKET), self.T)
            prompt = np.zeros((K, W), np.int32)
            lengths = np.ones((K,), np.int32)
            dst = np.full((K,), self.S, np.int32)
            for i, (slot, t) in enumerate(part):
                prompt[i, :len(t)], lengths[i], dst[i] = t, len(t), slot
            out = self._call(_draft_rows, self.draft, self.dstate, prompt, lengths, dst,
                             capacity=self.draft_capacity)
            self.dstate = self.dstate if out is None else out

    def passes(self, decoding, passes, lengths, pending, left, k: int, speculative: bool, carried=None,
               on_fetch=None):
        """Up to ``k`` passes (speculative or plain) for every ``decoding`` slot, each slot stopping
        once it has made ``left`` ``[S]`` tokens: ``passes`` ``[S]`` each slot's pass number,
        ``lengths`` its cache length, ``pending`` its pending token; a ``carried`` ``[S]`` slot goes
        on from the last call instead (its values as that call left them, on the device), and
        ``lengths`` holds at least its length. The call stops early once no slot takes part or a
        slot's next pass would reach past the span of its first (:meth:`span`). Returns a
        :class:`PassesOut` (``on_fetch``: its callback), zeros in the passes that did not run."""
        span = self.span(lengths, k, speculative)
        rule, keys, row_ids, greedy, _ = self._slot_inputs()
        carried = np.zeros((self.S,), bool) if carried is None else carried
        slots = np.stack([passes, lengths, pending, left, decoding, carried]).astype(np.int32)
        out = self._call(_passes, self.params, self.cache, self.draft, self.dstate, rule, self.rule_state, keys,
                         row_ids, greedy, slots, self.carried, model=self.model, gamma=self.gamma, span=span, k=k,
                         speculative=speculative)
        if out is None:
            return None
        ints, floats, self.carried, self.cache, self.dstate = out
        return PassesOut(ints, floats, speculative, k, on_fetch)

    def span(self, lengths, k: int, speculative: bool) -> int:
        """The attended span of a call's passes from cache lengths ``lengths``: that of its first
        pass, which writes ``gamma + 1`` positions (a plain one, 1); the call stops before a pass
        that would write past it (``k`` does not widen it: the span is paid every pass)."""
        reach = int(lengths.max()) + (self.gamma + 1 if speculative else 1)
        return min(self.T, round_up(reach, SPAN_BUCKET))

    def decode(self, *args, **kwargs):
        raise NotImplementedError("a speculative engine decodes through passes()")

    def decode_many(self, *args, **kwargs):
        raise NotImplementedError("a speculative engine decodes through passes()")


def build_draft(lm, config):
    """The draft ``config.speculative`` names (built for ``lm``), or the ready draft it holds."""
    kind = config.speculative
    if not isinstance(kind, str):
        return kind
    if kind == "model":
        return load_draft(lm, config.draft)
    return make_draft(kind, lm)


class SpeculativeRows:
    """The :class:`~jaxdecode.serving.engine.Engine`'s speculative side: its settings, its step of
    passes and their counts."""

    def _init_speculative(self, lm, config, executor):
        """Read the speculative settings of ``config``; returns the executor to use (a
        :class:`SpeculativeExecutor` unless one is given)."""
        self.speculative = config.speculative is not None
        self.gamma = SPECULATIVE_GAMMA if config.gamma is None else config.gamma
        self.draft = None
        self.speculative_counts = {"speculative_passes": 0, "plain_passes": 0, "proposed": 0, "examined": 0,
                                   "accepted": 0}
        if self.speculative:
            self.draft = build_draft(lm, config)
            self.speculative_max_rows = (SPECULATIVE_MAX_ROWS if config.speculative_max_rows is None
                                         else config.speculative_max_rows)
            if executor is None:
                executor = SpeculativeExecutor(lm, self.S, self.draft, self.gamma)
        return executor

    def _launch_passes(self, start: float) -> DeviceCall:
        """A speculative engine's step: this step's prompt pieces, then up to ``decode_steps``
        passes for every slot whose prompt is read, in one call: speculative while at most
        ``speculative_max_rows`` slots decode, else plain (:mod:`jaxdecode.serving.speculative`).
        A row that decoded in the call still in flight (its tokens not read yet) goes on from where
        that call leaves it, on the device; its length is known only up to what that call may add,
        and the span is taken from that bound. A row whose draft state is behind (after plain
        passes) is built again from its text, so the call in flight is read first then."""
        prefill_tokens = self._prefill()
        decoding = self._decoding_slots()
        inflight = self._inflight
        if inflight is not None and inflight.rows and self._needs_text(decoding, inflight):
            self._collect(inflight)  # (its steps recorded now)
            self._inflight = inflight = None
            decoding = self._decoding_slots()
        active = int(decoding.sum())
        rows, out = [], None
        if active:
            speculative = active <= self.speculative_max_rows
            k = self._steps_now(decoding, prefill_tokens)
            rows = [(int(s), self._slots[s]) for s in np.flatnonzero(decoding)]
            if k > 1:  # a call stops once its rows are done: as many passes as a row may take (a power
                # of two up to its n, as warm_up compiles), not what its tokens left would need at one a pass
                k = 1 << (min(self.decode_steps, max(r.n for _, r in rows)).bit_length() - 1)
            flying = {} if inflight is None or not inflight.rows else dict(inflight.rows)
            reach = 0 if not flying else inflight.out.k * (self.gamma + 1 if inflight.out.speculative else 1)
            passes, lengths, pending, left = (np.zeros((self.S,), np.int32) for _ in range(4))
            carried = np.zeros((self.S,), bool)
            stale = []
            for s, r in enumerate(self._slots):
                if r is None:
                    continue
                if not decoding[s]:
                    lengths[s] = r.length  # a prompt still being read keeps its cache
                    continue
                if flying.get(s) is r:  # it goes on from the call in flight: at most reach further
                    carried[s] = True
                    lengths[s] = min(r.length - 1 + reach, len(r.prompt) + r.n - 2)
                    continue
                lengths[s] = r.length - 1  # the context but its last token, which is fed now
                pending[s] = r.tokens[-1] if r.tokens else r.prompt[-1]
                passes[s], left[s] = r.passes, r.n - len(r.tokens)
                if speculative and r.draft_at != r.length:
                    stale.append((s, np.concatenate([r.prompt, np.asarray(r.tokens, np.int32)])))
            self._free_lengths(lengths)
            if speculative:
                self.executor.sync_drafts(stale)
            out = self.executor.passes(decoding, passes, lengths, pending, left, k, speculative, carried,
                                       functools.partial(self._passes_read, rows, speculative))
        return DeviceCall(start, 1, rows, out, False, prefill_tokens, active)

    def _decoding_slots(self) -> np.ndarray:
        return np.array([r is not None and r.prefilled == len(r.prompt) for r in self._slots])

    def _needs_text(self, decoding, inflight) -> bool:
        """Whether this step's call needs the tokens of the call in flight first: its passes are
        speculative and a row that went on in plain passes there needs its draft state built again
        from its text."""
        if inflight.out.speculative or int(decoding.sum()) > self.speculative_max_rows:
            return False
        flying = dict(inflight.rows)
        return any(flying.get(s) is r for s, r in enumerate(self._slots) if decoding[s])

    def _passes_read(self, rows, speculative: bool, out) -> None:
        """A call's counts, as its tokens are read (before they are added to their rows): each row's
        passes (its next pass number), and where its draft state now stands."""
        made, accepted = out[3], out[4]  # [k, S]
        counts = self.speculative_counts
        counts["speculative_passes" if speculative else "plain_passes"] += int(np.count_nonzero(made.any(axis=1)))
        for s, r in rows:
            took = int(np.count_nonzero(made[:, s]))
            r.passes += took
            if speculative:
                counts["proposed"] += self.gamma * took
                counts["examined"] += int(np.minimum(accepted[:, s] + 1, self.gamma)[made[:, s] > 0].sum())
                counts["accepted"] += int(accepted[:, s].sum())
                r.draft_at = r.length + int(made[:, s].sum())

    def speculative_stats(self) -> dict:
        """A speculative engine's passes since it started: speculative and plain, draft tokens
        proposed and accepted, and the acceptance share of the proposals."""
        c = dict(self.speculative_counts)
        c["acceptance"] = c["accepted"] / c["examined"] if c["examined"] else float("nan")
        return c


__all__ = ["SpeculativeExecutor", "SpeculativeRows", "build_draft"]
