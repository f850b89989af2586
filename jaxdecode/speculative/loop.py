"""The speculative decoding loop: a few jitted ``lax.while_loop`` segments over the whole batch,
their statistics and results, and the entry points :func:`speculative_tokens` (token arrays) and
:func:`speculative_generate` (text).

This module computes only: it takes a ready :class:`~jaxdecode.speculative.drafts.Draft` and
reads no files (drafts that need the corpus or a checkpoint are built by
:func:`jaxdecode.speculative.make_draft`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import constraints as C
from jaxdecode.decoding import budget as budget_lib
from jaxdecode.decoding.common import (
    SPAN_BUCKET,
    Generation,
    batch_bucket,
    check_int,
    encode_prompts,
    finish_text,
    make_batch,
    pad_rule,
    round_up,
    sample_keys,
    text_streamer,
)
from jaxdecode.decoding.params import SPECULATIVE, DecodeParams, resolve, stop_automaton_for
from jaxdecode.decoding.stops import as_automaton
from jaxdecode.io.vocab import same_vocabulary
from jaxdecode.models.base import DecodingModel
from jaxdecode.rules import processed_logprobs
from jaxdecode.speculative.acceptance import accept_with_noise, iteration_noise, row_keys, take_at

if TYPE_CHECKING:
    from jaxdecode.speculative.drafts.base import Draft


def _logprobs(logits):
    """``log_softmax`` that keeps ``-inf`` entries (removed tokens) at ``-inf`` without NaN."""
    return processed_logprobs(logits)


class SpecState(NamedTuple):
    """The loop carry."""

    cache: Any  # the target's cache: the context without its last (pending) token
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
    stop_state: jax.Array  # [B] int32 each row's state in the stop automaton (decoding.stops)
    stop_hit: jax.Array  # [B] bool: the row produced a stop string or an end token (its count ends there)
    cstate: Any = None  # [B] int32 automaton state after the context (constrained generation)
    stopped: Any = None  # [B] bool: the row stopped where its pattern allowed it (constrained)


NOISE_TABLE_MAX = 1 << 20  # uniforms: a segment draws its noise up front when it needs at most this many


def check_stateless(rule, V: int) -> None:
    """A ValueError unless ``rule`` (None, a rule or a chain) keeps no state: speculative sampling
    takes stateless rules only."""
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


@functools.partial(jax.jit, static_argnames=("model", "gamma", "span", "greedy"),
                   donate_argnames=("state",))
def _segment(params, draft: Draft, state: SpecState, rule, key, row_ids, n, iter_end, con=None, stops=None, *,
             model: DecodingModel, gamma: int, span: int, greedy: bool) -> SpecState:
    """Iterate while some row is unfinished, every unfinished row fits in ``span`` and the
    iteration is below ``iter_end`` (a host round trip for streaming and stop strings)."""
    B = state.pending.shape[0]
    V = model.V
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

    def live(st):
        on = (st.count < n) & ~st.stop_hit
        return on if st.stopped is None else on & ~st.stopped

    def cond(st):
        active = live(st)
        need = jnp.max(jnp.where(active, st.context + gamma, 0))
        return jnp.any(active) & (need <= span) & (st.iteration < iter_end)

    def choose(st, drafts, q_logits, logits, noise):
        """How many proposals each row accepts and the token after them: ``(n_acc, nxt, stop,
        sample_lp, cstate)``. Under a constraint the target's distribution at each position is
        the masked one extended by a stop choice (index V; ``stop`` marks the rows that chose it,
        ``cstate`` is the automaton state after the pass); a proposal outside the language has
        target probability 0, so it is rejected by construction."""
        if con is None:
            target = process_all(logits)
            sample_lp = _logprobs(target)
            states = None
            if not greedy:
                target = jnp.exp(sample_lp)
        else:
            states = C.draft_states(con, st.cstate, drafts)  # [B, gamma+1], -1 once off the language
            left = n - st.count[:, None] - jnp.arange(gamma + 1)[None, :]
            target, sample_lp = C.extended_target(con, states, left, logits, process_all, greedy)
        if greedy:
            n_acc, nxt = accept_with_noise(target, None, drafts, None, True)
        else:  # a deterministic draft: q is a point mass on each proposal
            q = jax.nn.one_hot(drafts, V) if q_logits is None else jnp.exp(_logprobs(q_logits))
            if con is not None:  # the draft never proposes the stop choice
                q = jnp.concatenate([q, jnp.zeros(q.shape[:2] + (1,), q.dtype)], axis=-1)
            n_acc, nxt = accept_with_noise(target, q, drafts, noise, False)
        if con is None:
            return n_acc, nxt, None, sample_lp, None
        stop = nxt == V
        nxt = jnp.where(stop, 0, nxt)
        at = jnp.take_along_axis(states, n_acc[:, None], axis=1)[:, 0]
        return n_acc, nxt, stop, sample_lp, jnp.where(stop, at, con.table[jnp.maximum(at, 0), nxt])

    def body(st):
        active = live(st)
        noise = noise_at(st)
        drafts, q_logits, dstate = draft.propose(st.draft, None if greedy else noise.draft, gamma,
                                                 process, span)
        fed = jnp.concatenate([st.pending[:, None], drafts], axis=1)  # [B, gamma+1]
        logits, _, cache = model.extend(params, st.cache, fed, span)  # [B, gamma+1, V]
        n_acc, nxt, stop, sample_lp, after = choose(st, drafts, q_logits, logits, noise)
        new = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
        new = new.at[rows, n_acc].set(nxt)  # [B, gamma+1] valid up to n_acc
        write = jax.vmap(lambda buf, x, at: jax.lax.dynamic_update_slice(buf, x, (at,)))
        # finished rows write past n only (the buffer has room), and are cut off on the host
        tokens = write(st.tokens, new, st.count)
        mlp = write(st.model_logprobs, take_at(_logprobs(logits), new), st.count)
        slp = write(st.sample_logprobs, take_at(sample_lp, new), st.count)
        # roll back: keep the pending token and the accepted proposals
        cache = model.truncate(cache, jnp.where(active, st.context + n_acc, model.lengths(st.cache)))
        dstate = draft.commit(dstate, drafts, n_acc, nxt, active)
        on = active.astype(jnp.int32)
        made = n_acc + 1 if stop is None else n_acc + (~stop).astype(jnp.int32)  # tokens this pass
        moved = active if stop is None else active & ~stop
        out = SpecState(
            cache=cache,
            pending=jnp.where(moved, nxt, st.pending),
            context=st.context + on * made,
            draft=dstate,
            tokens=tokens, model_logprobs=mlp, sample_logprobs=slp,
            count=st.count + on * made,
            passes=st.passes + on,
            examined=st.examined + on * jnp.minimum(n_acc + 1, gamma),
            accepted=st.accepted + on * n_acc,
            iteration=st.iteration + 1, stop_state=st.stop_state, stop_hit=st.stop_hit)
        if con is not None:
            out = out._replace(cstate=jnp.where(active, after, st.cstate),
                               stopped=st.stopped | (active & stop))
        return _stop_strings(st, out, active)

    def _stop_strings(st, new, active):
        """``new`` with each active row's tokens of this pass walked through the stop automaton: a
        row whose tokens stop it keeps them up to that one (its count ends there) and is done."""
        if stops is None:
            return new
        made = new.count - st.count  # tokens this pass produced (0 for inactive rows)
        at = st.count[:, None] + jnp.arange(gamma + 1)[None, :]  # [B, gamma+1]
        toks = jnp.take_along_axis(new.tokens, jnp.minimum(at, new.tokens.shape[1] - 1), axis=1)
        _, states = jax.lax.scan(lambda s, t: (stops.table[s, t], stops.table[s, t]), st.stop_state, toks.T)
        states = states.T  # [B, gamma+1]: the state after each new token
        valid = (jnp.arange(gamma + 1)[None, :] < made[:, None]) & (at < n) & active[:, None]
        hit = stops.accept[states] & valid
        stopped = jnp.any(hit, axis=1)
        last = jnp.where(stopped, jnp.argmax(hit, axis=1), jnp.maximum(made - 1, 0))
        state = jnp.where(made > 0, jnp.take_along_axis(states, last[:, None], axis=1)[:, 0], st.stop_state)
        return new._replace(count=jnp.where(stopped, st.count + last + 1, new.count), stop_state=state,
                            stop_hit=st.stop_hit | stopped)

    return jax.lax.while_loop(cond, body, state)


@functools.partial(jax.jit, static_argnames=("model", "capacity", "width", "N"))
def _start(params, draft: Draft, prompt, length, count, *, model, capacity, width, N):
    """The loop's first state: the prompts (but their last tokens) prefilled into the target's
    cache, the draft's state, empty outputs. One call: every dispatch costs host time."""
    B = prompt.shape[0]
    cache = model.prefill_cache(params, prompt[:, :width], length - 1, capacity)
    zeros = jnp.zeros((B,), jnp.int32)
    return SpecState(
        cache=cache,
        pending=jnp.take_along_axis(prompt, (length - 1)[:, None], axis=1)[:, 0],
        context=length,
        draft=draft.init(prompt, length, capacity),
        tokens=jnp.zeros((B, N), jnp.int32),
        model_logprobs=jnp.zeros((B, N), jnp.float32),
        sample_logprobs=jnp.zeros((B, N), jnp.float32),
        count=count, passes=zeros, examined=zeros, accepted=zeros, iteration=jnp.int32(0),
        stop_state=zeros, stop_hit=jnp.zeros((B,), bool))


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
    tokens: np.ndarray  # [B, n] int32 (garbage past a row's count)
    model_logprobs: np.ndarray  # [B, n] float32
    sample_logprobs: np.ndarray  # [B, n] float32
    stats: list  # [B] SpeculativeStats
    counts: np.ndarray = None  # [B] int32 tokens of each row's output (n unless it stopped)
    stopped: np.ndarray = None  # [B] bool: the row produced a stop string


def _batch_bucket(b: int) -> int:
    """Powers of two up to 1024 rows, then multiples of 1024 (big batches waste little)."""
    return batch_bucket(b) if b <= 1024 else round_up(b, 1024)


def check_request(model: DecodingModel, max_prompt: int, n: int, gamma: int) -> None:
    """Raise ValueError unless prompt + n + gamma + 1 fits in the model window."""
    need = max_prompt + n + gamma + 1
    if need > model.T:
        raise ValueError(
            f"speculative decoding: the prompt ({max_prompt}) plus n ({n}) plus gamma + 1 "
            f"({gamma + 1}) is {need} positions, more than the model window T={model.T}; the cache "
            f"is exact only within the window: shorten the request or use plain sampling")


STREAM_ITERATIONS = 16  # target passes between host round trips when streaming
NO_LIMIT = np.int32(2**31 - 1)


def speculative_tokens(model: DecodingModel, params, prompts, n: int, key: jax.Array, *,
                       draft: Draft, gamma: int = 4, rule=None, greedy: bool = False,
                       row_ids: Sequence[int] | None = None, stops: Sequence[np.ndarray] = (),
                       on_chunk: Callable[[np.ndarray, np.ndarray], None] | None = None,
                       constraint=None, memory_budget: int | str | None = None) -> SpeculativeResult:
    """Generate ``n`` tokens after each prompt (token arrays, or one ``[B, P]`` array) by
    speculative sampling from the target ``model`` (a :class:`jaxdecode.models.DecodingModel`,
    e.g. ``lm.decoder``) with ``params``, proposed by ``draft``.

    The token-level engine that :func:`speculative_generate` runs, not in ``__all__``: its
    arguments are the loop's own and change with it; a request's settings belong in
    :func:`speculative_generate`'s :class:`~jaxdecode.decoding.params.DecodeParams`.

    ``rule`` (stateless) processes both the target's and the draft's logits; the output has the
    processed target's distribution. ``row_ids`` (default ``0..B-1``) name the rows for the PRNG.
    ``stops``: token sequences that end a row once generated, or a
    :class:`~jaxdecode.decoding.stops.StopAutomaton` (stop strings however tokenized, end tokens):
    each pass walks a row's new tokens through it on the device, and a row that stops keeps its
    tokens up to the one that stopped it (the others are exactly those of the run without stops).
    ``on_chunk(tokens [B, c], emitted [B, c])`` streams new tokens every ``STREAM_ITERATIONS``
    target passes (a host round trip); the tokens do not change.
    ``constraint``: as for :func:`jaxdecode.decoding.sampling.sample_tokens`; the output then has the
    distribution of constrained plain sampling (stops included), whatever the draft proposes.
    A request whose rows do not fit ``memory_budget`` (see :mod:`jaxdecode.decoding.budget`) is
    refused before anything is allocated.
    """
    gamma = check_int("gamma", gamma, 1)
    batch = make_batch(prompts, n, model.V, model.T, row_ids)
    B, Pmax, T = batch.B, batch.Pmax, model.T
    check_stateless(rule, model.V)
    check_request(model, Pmax, n, gamma)
    draft.check(model, Pmax + n + gamma + 1)
    stops = as_automaton(stops, model.V)
    if n == 0:
        e = np.zeros((B, 0), np.int32)
        zero = SpeculativeStats(gamma, 0, 0, 0, 0, 0)
        return SpeculativeResult(e, e.astype(np.float32), e.astype(np.float32),
                                 [dataclasses.replace(zero) for _ in range(B)], np.zeros(B, np.int32),
                                 np.zeros(B, bool))

    Bb = _batch_bucket(B)
    budget_lib.require(f"speculative decoding of {B} rows", Bb,
                       budget_lib.row_bytes(model, Pmax, n + gamma + 1, min(T, Pmax + n + gamma + 1)),
                       memory_budget, fewer="fewer rows or samples")
    prompt = np.zeros((Bb, batch.Pb), np.int32)
    prompt[:B] = batch.prompt[:B]
    length = np.ones((Bb,), np.int32)
    length[:B] = batch.lens
    count = np.zeros((Bb,), np.int32)
    count[B:] = n  # padding rows start finished
    row_ids_b = np.concatenate([batch.row_ids[:B], np.arange(B, Bb) + 2**30]).astype(np.uint32)
    key = jnp.asarray(key)
    if key.ndim == 2:  # one key per row: the padding rows take the first
        if key.shape[0] != B:
            raise ValueError(f"{key.shape[0]} keys for {B} prompts: give one key, or one per prompt")
        key = jnp.concatenate([key, jnp.broadcast_to(key[:1], (Bb - B, key.shape[1]))])
    rule_b = pad_rule(rule, B, Bb)
    # room for every write of a finished row (at most 2 gamma + 2 past the window)
    capacity = T + 2 * gamma + 2
    N = round_up(n + 2 * gamma + 2, 64)

    # A verify pass has Bb * (gamma + 1) rows: the model may prepare its weights for that once
    params = model.prepare(params, Bb * (gamma + 1))
    state = _start(params, draft, prompt, length, count, model=model, capacity=capacity,
                   width=min(batch.Pb, T), N=N)
    con, cstate, _ = C.for_rows(constraint, B, Bb, model.V, n)
    if con is not None:
        state = state._replace(cstate=cstate, stopped=jnp.zeros((Bb,), bool))
    n_j = np.int32(n)  # numpy: a jnp scalar would cost a dispatch of its own
    ids_j = row_ids_b
    stop_dev = None if stops is None else stops.device()
    sent = np.zeros(B, np.int32)  # tokens of each row streamed so far
    while True:
        count_h, context_h, iteration, stopped_h, hit_h = jax.device_get(
            (state.count, state.context, state.iteration, state.stopped, state.stop_hit))
        active = (count_h < n) & ~hit_h
        if stopped_h is not None:
            active &= ~stopped_h
        if not active.any():
            break
        if model.reads_only_filled:
            # attention reads each row only up to its length: one segment over the whole window
            # (unfinished rows stay within T, checked above)
            span = T
        else:  # finished rows may attend to garbage, which is never read back
            span = min(T, round_up(int(context_h[active].max()) + gamma, SPAN_BUCKET))
        iter_end = np.int32(iteration + STREAM_ITERATIONS) if on_chunk is not None else NO_LIMIT
        state = _segment(params, draft, state, rule_b, key, ids_j, n_j, iter_end, con, stop_dev, model=model,
                         gamma=gamma, span=span, greedy=greedy)
        if on_chunk is not None:
            _stream(state, B, n, sent, on_chunk)

    # only what is returned comes back to the host (not the cache); cut on the host, since a
    # slice on the device would compile once per (B, n)
    tokens, mlp, slp, passes, examined, accepted, count, con_stop, hit = jax.device_get(
        (state.tokens, state.model_logprobs, state.sample_logprobs, state.passes, state.examined,
         state.accepted, state.count, state.stopped, state.stop_hit))
    tokens, mlp, slp = tokens[:B, :n], mlp[:B, :n], slp[:B, :n]
    counts = np.minimum(count[:B], n).astype(np.int32)  # a stopped row's count ends at its stop
    stopped = hit[:B] if con_stop is None else hit[:B] | con_stop[:B]
    stats = [SpeculativeStats(gamma, int(passes[b]), gamma * int(passes[b]), int(examined[b]),
                              int(accepted[b]), int(count[b])) for b in range(B)]
    return SpeculativeResult(np.asarray(tokens, np.int32), np.asarray(mlp, np.float32),
                             np.asarray(slp, np.float32), stats, counts, stopped)


def _stream(state: SpecState, B: int, n: int, sent, on_chunk) -> None:
    """After a segment: hand each row's new tokens to ``on_chunk`` (``sent`` updated in place)."""
    count, tokens = jax.device_get((state.count, state.tokens))
    upto = np.minimum(count[:B], n)
    width = int(max(1, (upto - sent).max()))
    new = np.zeros((B, width), np.int32)
    emitted = np.zeros((B, width), bool)
    for b in range(B):
        k = upto[b] - sent[b]
        new[b, :k] = tokens[b, sent[b]:upto[b]]
        emitted[b, :k] = True
    if emitted.any():
        on_chunk(new, emitted)
    sent[:] = np.maximum(sent, upto)


@dataclasses.dataclass
class SpeculativeGeneration(Generation):
    """A :class:`jaxdecode.decoding.sampling.Generation` with the speculative run's counts for its row."""

    stats: SpeculativeStats = None


def speculative_generate(lm, prompts: str | Sequence[str], params: DecodeParams | int | None = None, *,
                         draft: Draft, gamma: int = 4, key: jax.Array | None = None,
                         on_text: Callable[[int, str], None] | None = None,
                         **overrides) -> list[SpeculativeGeneration]:
    """Generate up to ``params.n`` tokens after each prompt by speculative sampling with ``draft``
    (``params``: a :class:`~jaxdecode.decoding.params.DecodeParams` or the number of new tokens
    ``n``; keywords override its fields, as for :func:`jaxdecode.generate`).

    Returns ``len(prompts) * num_samples`` generations, prompt-major; sample ``j`` of prompt
    ``i`` is drawn with its prompt's seed and row id ``j`` (as :func:`jaxdecode.generate`:
    ``seed`` is one seed or one per prompt). Each carries its row's :class:`SpeculativeStats`;
    :meth:`SpeculativeStats.total` sums them. ``stop``: stop strings (the text ends after the
    first); ``on_text(row, new_text)`` streams. ``constraint``: a
    :class:`jaxdecode.constraints.Constraint`, or one per prompt. Rules must keep no state.
    """
    p = resolve(params, overrides, SPECULATIVE)
    num_samples, stop, include_stop = p.num_samples, p.stop, p.include_stop
    vocab = getattr(draft, "vocab", None)  # a draft model's tokens (ModelDraft.from_lm) must be the target's
    # (a vocabulary of another size is refused by the draft's check, naming both sizes)
    if vocab is not None and len(vocab) == len(lm.vocab) and not same_vocabulary(vocab, lm.vocab):
        raise ValueError("the draft model's vocabulary is not the target's (other tokens under the same ids): "
                         "a draft must share the target's tokenizer")
    prompts, rows = encode_prompts(lm, prompts, num_samples)
    stop_tokens = stop_automaton_for(lm, p)
    seed = list(p.seed) if isinstance(p.seed, tuple) else p.seed
    keys, row_ids = sample_keys(len(prompts), num_samples, seed, key)
    res = speculative_tokens(lm.decoder, lm.params, rows, p.n, keys, row_ids=row_ids, draft=draft, gamma=gamma,
                             rule=p.rule(), greedy=p.greedy, stops=stop_tokens, on_chunk=text_streamer(lm, on_text),
                             constraint=C.per_sample(p.constraint, len(prompts), num_samples),
                             memory_budget=p.memory_budget)
    out = []
    for r in range(len(rows)):
        toks, text, reason = finish_text(lm, res.tokens[r, :res.counts[r]], res.stopped[r], stop, include_stop)
        c = len(toks)
        out.append(SpeculativeGeneration(
            prompt=prompts[r // num_samples], text=text, tokens=toks, model_logprobs=res.model_logprobs[r, :c],
            sample_logprobs=res.sample_logprobs[r, :c], finish_reason=reason, stats=res.stats[r]))
    return out


__all__ = [
    "NOISE_TABLE_MAX",
    "SpeculativeGeneration",
    "SpeculativeResult",
    "SpeculativeStats",
    "check_request",
    "predicted_chars_per_pass",
    "speculative_generate",
]
