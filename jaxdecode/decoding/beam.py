"""Beam search as a chunked ``lax.scan`` over a KV cache, and exact search for the mode.

:func:`beam_search` keeps the ``k`` highest-scoring partial continuations of every prompt, extends
each by every token and keeps the ``k`` best of the ``k * V`` candidates, scored by total
log-probability. It starts from the prompt alone (one live beam, the others at ``-inf``), so with
no end tokens and no length penalty it is exactly the book's ``beam``: per beam the top ``k``
tokens, all candidates sorted, the best ``k`` kept, and ``k = 1`` is greedy decoding.

A candidate that completes an end token or a stop string leaves the beam for a pool of ``k``
finished hypotheses, its score divided by the GNMT length penalty (Wu et al. 2016); a row stops
once no live beam can beat its worst finished hypothesis. The beam axis is flattened into the
batch (row ``b``'s beam ``j`` is model row ``b * k + j``) and each step reorders the cache by
parent through ``model.reorder``, on ``model.for_beams()`` (the reference model's paged twin).
With a constraint each beam carries its automaton state, and a beam in a final state may stop.
How ends, the stopping bound, the layout and constraints work: ``docs/python.md`` (Beam search).

:func:`mode_search` (in :mod:`jaxdecode.decoding.search`, re-exported here) finds the single most probable
continuation by best-first search; :mod:`jaxdecode.eval.studies.beam_curse` compares the two.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import constraints as C
from jaxdecode.decoding import budget as budget_lib
from jaxdecode.decoding.common import (
    SPAN_BUCKET,
    check_int,
    encode_prompts,
    finish_text,
    make_batch,
    pad_rule,
    push_recent,
    round_up,
)
from jaxdecode.decoding.params import BEAM, DecodeParams, resolve, stop_automaton_for
from jaxdecode.decoding.search import SearchBudgetExceeded, mode_search
from jaxdecode.decoding.stops import StopAutomaton, as_automaton, stops_after
from jaxdecode.models.base import DecodingModel

NEG_INF = -jnp.inf
TOKEN_BUCKET = 64  # the generated-token buffers are this many tokens wide, rounded up
DEFAULT_CHUNK = 32


# ----------------------------------------------------------------------------- beam helpers


def flatten_beams(x):
    """[B, k, ...] -> [B * k, ...]: the beam axis folded into the batch (beam j of row b at b*k+j)."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def unflatten_beams(x, k: int):
    """[B * k, ...] -> [B, k, ...]."""
    return x.reshape((x.shape[0] // k, k) + x.shape[1:])


def add_beams(x, k: int):
    """[B, ...] -> [B * k, ...]: every row repeated for its k beams."""
    return jnp.repeat(x, k, axis=0)


def gather_beams(x, parent):
    """x [B, k, ...], parent [B, k] -> [B, k, ...]: beam j becomes beam ``parent[b, j]`` of x."""
    idx = parent.reshape(parent.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def gather_flat(tree, parent):
    """Every leaf [B * k, ...] of ``tree`` reordered so that beam j of row b is its parent."""
    B, k = parent.shape
    flat = (jnp.arange(B)[:, None] * k + parent).reshape(-1)  # [B * k]
    return jax.tree_util.tree_map(lambda x: jnp.take(x, flat, axis=0), tree)


def _beam_rows(parent):
    """The model rows ``[B * k]`` that beam ``j`` of row ``b`` continues: ``b * k + parent[b, j]``."""
    B, k = parent.shape
    return (jnp.arange(B)[:, None] * k + parent).reshape(-1)


def gnmt_length_penalty(length, alpha):
    """The GNMT length penalty ``((5 + length) / 6) ** alpha`` (Wu et al. 2016)."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


# ----------------------------------------------------------------------------- loop state


class BeamState(NamedTuple):
    """The loop carry (everything but the KV cache); B rows (bucketed), k beams, N token slots."""

    logits: jax.Array  # [B*k, V] raw next-token logits of every live beam
    live_score: jax.Array  # [B, k] summed log-probabilities (processed by the rule), -inf = none
    live_logprob: jax.Array  # [B, k] summed log-probabilities under the unmodified model
    live_tokens: jax.Array  # [B, k, N] generated tokens, real up to ``step``
    recent: jax.Array  # [B*k, T] the last T tokens of each beam, left-aligned
    length: jax.Array  # [B*k] tokens so far (prompt + generated), may exceed T
    stop_state: jax.Array  # [B*k] int32 each beam's state in the stop automaton (:mod:`.stops`)
    rule_state: Any  # the rule's state, leaves [B*k, ...]
    fin_score: jax.Array  # [B, k] length-normalized scores of finished hypotheses, best first
    fin_logprob: jax.Array  # [B, k] their unmodified model log-probabilities
    fin_tokens: jax.Array  # [B, k, N] their tokens (end tokens included)
    fin_length: jax.Array  # [B, k] their lengths
    done: jax.Array  # [B] bool: no live beam can still beat the worst finished hypothesis
    step: jax.Array  # [] int32, steps taken
    cstate: Any = None  # [B*k] int32 each beam's automaton state (constrained search), else None


def beam_init(logits, recent, length, rule_state, k: int, N: int, cstate=None) -> BeamState:
    """The state before the first step: one live beam per row (the prompt), k-1 empty ones.

    ``logits`` [B, V], ``recent`` [B, T], ``length`` [B], ``rule_state`` and ``cstate`` (the
    automaton states, or None) are per row; they are repeated for the k beams here.
    """
    B = logits.shape[0]
    score = jnp.where(jnp.arange(k)[None, :] == 0, 0.0, NEG_INF) * jnp.ones((B, 1))  # [B, k]
    rep = functools.partial(add_beams, k=k)
    return BeamState(
        logits=rep(logits), live_score=score, live_logprob=score,
        live_tokens=jnp.zeros((B, k, N), jnp.int32), recent=rep(recent), length=rep(length),
        stop_state=jnp.zeros((B * k,), jnp.int32), rule_state=jax.tree_util.tree_map(rep, rule_state),
        fin_score=jnp.full((B, k), NEG_INF), fin_logprob=jnp.full((B, k), NEG_INF),
        fin_tokens=jnp.zeros((B, k, N), jnp.int32), fin_length=jnp.zeros((B, k), jnp.int32),
        done=jnp.zeros((B,), bool), step=jnp.int32(0), cstate=None if cstate is None else rep(cstate))


# ----------------------------------------------------------------------------- one step


def _write_token(tokens, token, step):
    """tokens [B, k, N] with ``token`` [B, k] written at position ``step``."""
    return jax.lax.dynamic_update_slice(tokens, token[:, :, None], (0, 0, step))


def _select(st: BeamState, rule, stops, alpha, max_len, active, T: int, con=None):
    """Extend every live beam by every token and keep the best; returns (state, parent, token).

    ``stops`` the :class:`~jaxdecode.decoding.stops.StopTable` (or None) that ``st.stop_state``
    walks: a candidate whose token stops its beam finishes (with that token). ``alpha`` [B]
    length-penalty exponents, ``max_len`` [] the number of steps of the search,
    ``con`` the :class:`~jaxdecode.constraints.Automaton` (or None) that ``st.cstate`` walks.
    """
    B, k = st.live_score.shape
    V = st.logits.shape[-1]
    model_lp = jax.nn.log_softmax(st.logits, axis=-1)  # [B*k, V]
    logits = st.logits
    if con is not None:
        ok, _ = C.allowed(con, st.cstate, jnp.broadcast_to(max_len - st.step, st.cstate.shape))
        log_stop = jnp.log(C.stop_probability(con, st.cstate, st.logits, ok))  # [B*k], -inf: cannot stop
        logits = C.mask(st.logits, ok)  # before the rule, as sampling does
    if rule is None:
        lp = model_lp
    else:
        from jaxdecode.rules import processed_logprobs

        lp = processed_logprobs(rule.apply(logits, st.rule_state))
    if con is not None:
        if rule is not None:  # the rule shares out the model's mass on the allowed tokens
            lp = lp + jax.nn.logsumexp(jnp.where(ok, model_lp, NEG_INF), axis=-1, keepdims=True)
        lp = jnp.where(ok, lp, NEG_INF)
    cand = st.live_score[:, :, None] + unflatten_beams(lp, k)  # [B, k, V]
    cand_raw = (st.live_logprob[:, :, None] + unflatten_beams(model_lp, k)).reshape(B, k * V)
    new_len = st.step + 1  # generated length of every candidate

    if stops is not None:
        hits = unflatten_beams(stops_after(stops, st.stop_state), k)  # [B, k, V]
        # a candidate that completes a stop string finishes, constrained or not (as in sampling: the
        # text ends at the stop string, a prefix of the language; its token is one the pattern allows)
        ends = hits
        live_cand = jnp.where(hits, NEG_INF, cand).reshape(B, k * V)
    else:
        live_cand = cand.reshape(B, k * V)
    score, idx = jax.lax.top_k(live_cand, k)  # [B, k], best first
    parent, token = idx // V, (idx % V).astype(jnp.int32)
    # an inactive step must leave the beams (and so the cache rows) where they are
    parent = jnp.where(active, parent, jnp.arange(k)[None, :])

    live_tokens = _write_token(gather_beams(st.live_tokens, parent), token, st.step)
    logprob = jnp.take_along_axis(cand_raw, idx, axis=1)
    flat_token = flatten_beams(token)
    rows = gather_flat((st.recent, st.length, st.stop_state, st.rule_state), parent)
    recent, length, stop_state, rule_state = rows
    recent = push_recent(recent, length, flat_token, T)
    if stops is not None:  # (a live beam never reaches the accepting state: that candidate finished)
        stop_state = stops.table[stop_state, flat_token]
    if rule is not None:
        rule_state = rule.update(rule_state, flat_token)
    cstate = st.cstate
    if con is not None:  # the chosen token from the parent's state (an empty beam's may be -1)
        cstate = jnp.maximum(con.table[cstate[_beam_rows(parent)], flat_token], 0)

    fin = (st.fin_score, st.fin_logprob, st.fin_tokens, st.fin_length)
    done = st.done
    extra = []  # candidates that finish at this step
    if stops is not None:
        # candidates that complete a stop sequence join the pool of k finished hypotheses
        norm = cand / gnmt_length_penalty(new_len, alpha)[:, None, None]
        f_score, f_idx = jax.lax.top_k(jnp.where(ends, norm, NEG_INF).reshape(B, k * V), k)
        f_parent, f_token = f_idx // V, (f_idx % V).astype(jnp.int32)
        f_tokens = _write_token(gather_beams(st.live_tokens, f_parent), f_token, st.step)
        f_logprob = jnp.take_along_axis(cand_raw, f_idx, axis=1)
        f_length = jnp.full((B, k), new_len, jnp.int32)
        extra.append((f_score, f_logprob, f_tokens, f_length))
    if con is not None:
        # every beam in a final state may stop: its tokens as they are, at its current length
        log_stop = unflatten_beams(log_stop, k)
        s_score = (st.live_score + log_stop) / gnmt_length_penalty(st.step, alpha)[:, None]
        s_length = jnp.full((B, k), st.step, jnp.int32)
        extra.append((s_score, st.live_logprob + log_stop, st.live_tokens, s_length))
    if extra:
        pool = [jnp.concatenate(p, axis=1) for p in zip(fin, *extra)]
        _, keep = jax.lax.top_k(pool[0], k)  # [B, k] of 2k or 3k, the older first among equals
        fin = tuple(gather_beams(p, keep) for p in pool)

        # the best a live beam can still reach: its score over the largest penalty ahead (a
        # constrained beam may stop at its current length, else it takes at least one more token)
        shortest = new_len if con is not None else jnp.minimum(new_len + 1, max_len)
        lp_next = gnmt_length_penalty(shortest, alpha)
        bound = score[:, 0] / jnp.maximum(lp_next, gnmt_length_penalty(max_len, alpha))  # [B]
        done = done | (bound < fin[0][:, -1]) | (score[:, 0] == NEG_INF)

    new = st._replace(live_score=score, live_logprob=logprob, live_tokens=live_tokens,
                      recent=recent, length=length + 1, stop_state=stop_state, rule_state=rule_state,
                      fin_score=fin[0], fin_logprob=fin[1], fin_tokens=fin[2], fin_length=fin[3],
                      done=done, step=st.step + 1, cstate=cstate)
    return new, parent, flat_token


def _keep_if_active(active, new, old):
    return jax.tree_util.tree_map(lambda a, b: jnp.where(active, a, b), new, old)


@functools.partial(jax.jit, static_argnames=("model", "span", "chunk"), donate_argnames=("cache",))
def _beam_cache_chunk(params, state: BeamState, cache, rule, stops, alpha, max_len, step_end, con=None,
                      *, model: DecodingModel, span: int, chunk: int):
    """``chunk`` beam steps reading the cache's first ``span`` positions; steps >= step_end are no-ops."""

    def body(carry, _):
        st, cache = carry
        active = st.step < step_end
        new, parent, token = _select(st, rule, stops, alpha, max_len, active, model.T, con)
        cache = model.reorder(cache, _beam_rows(parent), span)
        logits, _, cache = model.extend(params, cache, token[:, None], span=span, in_place=False)
        # an inactive step leaves the state as it was (its cache write lands past the valid length)
        new = _keep_if_active(active, new._replace(logits=logits[:, 0]), st)
        return (new, cache), None

    (state, cache), _ = jax.lax.scan(body, (state, cache), None, length=chunk)
    return state, cache


@functools.partial(jax.jit, static_argnames=("model", "chunk"))
def _beam_window_chunk(params, state: BeamState, rule, stops, alpha, max_len, step_end, con=None, *,
                       model: DecodingModel, chunk: int):
    """``chunk`` beam steps of the exact window mode: the model's prediction from each beam's last T tokens."""

    def body(st, _):
        active = st.step < step_end
        new, _, _ = _select(st, rule, stops, alpha, max_len, active, model.T, con)
        logits, _ = model.window(params, new.recent, new.length)
        return _keep_if_active(active, new._replace(logits=logits), st), None

    state, _ = jax.lax.scan(body, state, None, length=chunk)
    return state


@functools.partial(jax.jit, static_argnames=("model", "capacity", "k", "N"))
def _beam_prefill(params, prompt, recent, lengths, rule_state, cstate=None, *, model, capacity, k, N):
    logits, _, cache = model.prefill(params, prompt, lengths, capacity)
    cache = model.reorder(cache, jnp.repeat(jnp.arange(prompt.shape[0]), k))
    return beam_init(logits, recent, lengths, rule_state, k, N, cstate), cache


@functools.partial(jax.jit, static_argnames=("model", "k", "N"))
def _beam_window_start(params, recent, lengths, rule_state, cstate=None, *, model, k, N):
    logits, _ = model.window(params, recent, lengths)
    return beam_init(logits, recent, lengths, rule_state, k, N, cstate)


@functools.partial(jax.jit, static_argnames=("V", "max_new"))
def _rule_init(rule, prompt, lengths, *, V, max_new):
    return rule.init(prompt, lengths, V, max_new)


# ----------------------------------------------------------------------------- driver


@dataclasses.dataclass
class Hypothesis:
    """One continuation found by beam search."""

    tokens: np.ndarray  # [n] int32 generated tokens (end tokens included)
    score: float  # search score: summed (rule-processed) log-probability / length penalty
    logprob: float  # summed log-probability under the unmodified model (with a constrained stop's)
    finished: bool  # ended with an end token / stop string / constrained stop (else it ran out of steps)


@dataclasses.dataclass
class BeamResult:
    """Per prompt, up to ``n_best`` hypotheses, best first."""

    hypotheses: list[list[Hypothesis]]
    steps: int  # steps run (fewer than n when every row finished early)

    def best(self, i: int = 0) -> Hypothesis:
        return self.hypotheses[i][0]


def _end_sequences(end_tokens, V: int) -> list[np.ndarray] | StopAutomaton:
    if end_tokens is None:
        return []
    if isinstance(end_tokens, StopAutomaton):
        return end_tokens
    if isinstance(end_tokens, (int, np.integer)):
        end_tokens = [end_tokens]
    out = []
    for e in end_tokens:
        e = np.atleast_1d(np.asarray(e, np.int32))
        if e.ndim != 1 or e.size == 0:
            raise ValueError("an end token sequence must be a non-empty 1-d sequence of token ids")
        if e.min() < 0 or e.max() >= V:
            raise ValueError(f"end token ids must lie in [0, {V}), got {e.tolist()}")
        out.append(e)
    return out


def _alpha_per_row(length_penalty_alpha, B: int, Bb: int) -> np.ndarray:
    a = np.asarray(length_penalty_alpha, np.float64)
    if a.ndim == 0:
        a = np.full((B,), float(a))
    if a.shape != (B,):
        raise ValueError(f"length_penalty must be a number or one per prompt ({B}), got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"length_penalty must be finite, got {a.tolist()}")
    return np.concatenate([a, np.zeros(Bb - B)]).astype(np.float32)


def beam_search(model: DecodingModel, params, prompts: Sequence[np.ndarray], n: int, k: int, *,
                n_best: int = 1, length_penalty: float | Sequence[float] = 0.0,
                end_tokens: Sequence[int | Sequence[int]] | None = None, rule=None,
                chunk: int = DEFAULT_CHUNK, constraint=None, memory_budget: int | str | None = None) -> BeamResult:
    """Beam search of width ``k`` for ``n`` tokens after each prompt (token arrays of any lengths)
    with ``model`` (a :class:`jaxdecode.models.DecodingModel`, e.g. ``lm.decoder``) and ``params``.

    ``length_penalty``: the GNMT exponent alpha (a number or one per prompt; traced, so every
    value shares one compiled program). ``end_tokens``: end tokens or stop strings (token
    sequences); a hypothesis that completes one is finished. ``rule``: a :mod:`jaxdecode.rules`
    rule; scores then sum the processed log-probabilities, while ``logprob`` stays the model's.
    ``constraint``: a :class:`jaxdecode.constraints.Constraint` for every prompt, or one per
    prompt (None: free); every hypothesis of a constrained prompt is then in its language, up to
    ``n`` tokens, and one that stops before ``n`` scores the log of the model's stop probability
    (see the module docstring).
    Returns up to ``n_best`` (<= k) hypotheses per prompt, best first. A request whose beams do not
    fit ``memory_budget`` (see :mod:`jaxdecode.decoding.budget`) is refused before anything is
    allocated.
    """
    n = check_int("the number of new tokens n", n, 0)
    k = check_int("the beam width k", k, 1)
    n_best = check_int("n_best", n_best, 1)
    if n_best > k:
        raise ValueError(f"n_best={n_best} exceeds the beam width k={k}")
    chunk = check_int("chunk", chunk, 1)
    model = model.for_beams()
    T = model.T
    batch = make_batch(prompts, n, model.V, T)
    B, Bb = batch.B, batch.Bb
    ends = _end_sequences(end_tokens, model.V)
    alpha = _alpha_per_row(length_penalty, B, Bb)
    con, cstate, _ = C.for_rows(constraint, B, Bb, model.V, n)
    if n == 0:
        empty = np.zeros((0,), np.int32)
        return BeamResult([[Hypothesis(empty, 0.0, 0.0, False)] for _ in range(B)], 0)

    Pmax, Pb = batch.Pmax, batch.Pb
    budget_lib.require(f"beam search of {B} prompts x {k} beams", Bb * k,
                       budget_lib.row_bytes(model, Pmax, n, round_up(min(T, Pmax + n), SPAN_BUCKET)),
                       memory_budget, unit="beams", fewer="fewer prompts or a narrower beam")
    prompt, recent, length = batch.prompt, batch.recent, batch.length
    stops = as_automaton(ends, model.V)
    stop_dev = None if stops is None else stops.device()
    N = round_up(n, TOKEN_BUCKET)

    rule_b = None
    rule_state = None
    if rule is not None:
        rule_b = pad_rule(rule, B, Bb)
        rule_state = _rule_init(rule_b, jnp.asarray(prompt), jnp.asarray(length), V=model.V,
                                max_new=round_up(n, 256))
        rule_b = jax.tree_util.tree_map(functools.partial(add_beams, k=k), rule_b)  # [Bb*k]

    capacity = T + chunk  # slack so that no-op steps of a last partial chunk never clamp a write
    params = model.prepare(params, Bb * k)
    cache = None
    if Pmax <= T:
        state, cache = _beam_prefill(params, jnp.asarray(prompt[:, :min(Pb, T)]), jnp.asarray(recent),
                                     jnp.asarray(length), rule_state, cstate, model=model, capacity=capacity,
                                     k=k, N=N)
        n_cache = min(n, T - Pmax)
    else:
        state = _beam_window_start(params, jnp.asarray(recent), jnp.asarray(length), rule_state, cstate,
                                   model=model, k=k, N=N)
        n_cache = 0
    common = {"rule": rule_b, "stops": stop_dev, "alpha": jnp.asarray(alpha),
              "max_len": jnp.int32(n), "con": con}

    taken = 0
    while taken < n:
        valid = min(chunk, (n_cache if taken < n_cache else n) - taken)
        step_end = jnp.int32(taken + valid)
        if taken < n_cache:
            span = min(capacity, round_up(Pmax + taken + chunk, SPAN_BUCKET))
            state, cache = _beam_cache_chunk(params, state, cache, step_end=step_end, model=model,
                                             span=span, chunk=chunk, **common)
        else:
            cache = None
            state = _beam_window_chunk(params, state, step_end=step_end, model=model, chunk=chunk, **common)
        taken += valid
        if (stop_dev is not None or con is not None) and bool(np.all(np.asarray(state.done)[:B])):
            break  # no row can improve on its finished hypotheses

    return _collect(jax.device_get(state), B, n_best, alpha, taken)


class BeamSearchError(ValueError):
    """A row for which beam search found no hypothesis at all (never an empty list)."""


def _collect(st: BeamState, B: int, n_best: int, alpha: np.ndarray, steps: int) -> BeamResult:
    """The best finished hypotheses and (for rows still searching) live beams of every row."""
    out = []
    for b in range(B):
        cands = []  # (score, logprob, tokens, finished); the pool first among equal scores
        for j in range(st.fin_score.shape[1]):
            if np.isfinite(st.fin_score[b, j]):
                cands.append((float(st.fin_score[b, j]), float(st.fin_logprob[b, j]),
                              st.fin_tokens[b, j, :st.fin_length[b, j]], True))
        if not st.done[b]:
            lp = ((5.0 + steps) / 6.0) ** float(alpha[b])
            for j in range(st.live_score.shape[1]):
                if np.isfinite(st.live_score[b, j]):
                    cands.append((float(np.float32(st.live_score[b, j]) / np.float32(lp)),
                                  float(st.live_logprob[b, j]), st.live_tokens[b, j, :steps], False))
        if not cands:
            raise BeamSearchError(f"beam search: no continuation of prompt {b} has a finite score (every "
                                  f"token the constraint and the rule allow has probability zero)")
        cands.sort(key=lambda c: -c[0])
        out.append([Hypothesis(np.asarray(t, np.int32).copy(), s, lp_, f)
                    for s, lp_, t, f in cands[:n_best]])
    return BeamResult(out, steps)


@dataclasses.dataclass
class BeamText:
    """One continuation of a text prompt found by beam search."""

    prompt: str
    text: str
    tokens: np.ndarray  # [n] int32
    score: float  # summed (rule-processed) log-probability / length penalty
    logprob: float  # summed log-probability under the unmodified model
    finished: bool  # ended with an end token (not in the text), a stop string or a constrained stop

    @property
    def mean_logprob(self) -> float:
        """The model's mean log-probability per generated token (nats; per character for the character model)."""
        return self.logprob / len(self.tokens) if len(self.tokens) else float("nan")


def beam_generate(lm, prompts: str | Sequence[str], params: DecodeParams | int | None = None, k: int | None = None,
                  *, n_best: int = 1, length_penalty: float | Sequence[float] = 0.0,
                  **overrides) -> list[list[BeamText]]:
    """Beam search of width ``k`` for up to ``params.n`` tokens after each prompt with a loaded
    model (``params``: a :class:`~jaxdecode.decoding.params.DecodeParams` or the number of new
    tokens ``n``; keywords override its fields, as for :func:`jaxdecode.generate`).

    Returns one list per prompt (also for a single string) of up to ``n_best`` continuations,
    best first. ``stop``: stop strings that finish a hypothesis (included in its text).
    ``constraint``: a :class:`jaxdecode.constraints.Constraint`, or one per prompt (see
    :func:`beam_search`). The rule settings change the scores (see :func:`beam_search`).
    """
    p = resolve(params, overrides, BEAM)
    if k is None:
        raise TypeError("beam_generate needs the beam width k")
    n, stop, include_stop, rule, constraint = p.n, p.stop, p.include_stop, p.rule(), p.constraint
    chunk = DEFAULT_CHUNK if p.chunk is None else p.chunk
    prompts, encoded = encode_prompts(lm, prompts, 1)
    ends = stop_automaton_for(lm, p)  # stop strings however tokenized, stop token ids and the end tokens
    constraint = C.per_sample(constraint, len(prompts), 1)
    res = beam_search(lm.decoder, lm.params, encoded, n, k, n_best=n_best, length_penalty=length_penalty,
                      end_tokens=ends, rule=rule, chunk=chunk, constraint=constraint, memory_budget=p.memory_budget)
    alpha = _alpha_per_row(length_penalty, len(prompts), len(prompts))

    def text(i, h):
        tokens, text, _ = finish_text(lm, h.tokens, h.finished, stop, include_stop)
        score, logprob = h.score, h.logprob
        if len(tokens) < len(h.tokens):
            con = constraint[i] if isinstance(constraint, list) else constraint
            score, logprob = _rescore(lm, encoded[i], tokens, float(alpha[i]), rule, con)
        return BeamText(prompt=prompts[i], text=text, tokens=tokens, score=score, logprob=logprob,
                        finished=h.finished)

    out = [[text(i, h) for h in hyps] for i, hyps in enumerate(res.hypotheses)]
    return [sorted(hyps, key=lambda t: -t.score) for hyps in out]


def _rescore(lm, prompt, tokens, alpha: float, rule, constraint) -> tuple[float, float]:
    """The score and log-probability of a hypothesis cut short by the text check of
    :func:`finish_text`. The search ends a hypothesis at the token whose bytes complete a stop
    string, which is where its text first contains it, so no hypothesis is cut where the
    vocabulary decodes to its tokens' bytes (every byte-level, sentencepiece or character one);
    for another vocabulary the cut tokens are scored again under the model."""
    if rule is not None or constraint is not None:
        raise RuntimeError("beam search: the vocabulary's text ends a hypothesis before the stop automaton "
                           "did (its decode differs from its tokens' bytes); such a hypothesis can be "
                           "scored again only without a rule or a constraint")
    from jaxdecode.decoding.score import token_logprobs

    seq = np.concatenate([np.asarray(prompt, np.int32), np.asarray(tokens, np.int32)])
    logprob = float(np.sum(token_logprobs(lm.decoder, lm.params, [seq], [len(prompt)])[0], dtype=np.float64))
    return logprob / float(((5.0 + len(tokens)) / 6.0) ** alpha), logprob


__all__ = [
    "BeamResult", "BeamSearchError", "BeamState", "BeamText", "Hypothesis", "SearchBudgetExceeded", "add_beams",
    "beam_generate", "beam_init", "beam_search", "flatten_beams", "gather_beams",
    "gather_flat", "gnmt_length_penalty", "mode_search", "unflatten_beams",
]
