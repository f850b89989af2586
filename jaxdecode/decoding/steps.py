"""The sampling loop's compiled pieces: the loop state, token choice, a chunk of steps on the cache
or on the window, prefill and growth. :mod:`jaxdecode.decoding.sampling` drives them, on one device or
over a mesh of devices (:mod:`jaxdecode.decoding.placement`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import constraints as C
from jaxdecode.decoding.common import pick_tokens, push_recent, step_keys
from jaxdecode.decoding.stops import advance
from jaxdecode.models.base import DecodingModel

DEFAULT_CHUNK = 32
SMALL_BATCH_CHUNK = 64  # up to 4 rows a step is cheap, and each host round trip counts more
WHOLE_CHUNK_MAX = 512  # without streaming or stop strings, up to 4 rows run in one chunk this long



class SamplingState(NamedTuple):
    """The loop carry (everything but the model's cache)."""

    logits: jax.Array  # [B, V] raw next-token logits of the model
    recent: jax.Array  # [B, T] the last T tokens of each row, left-aligned
    length: jax.Array  # [B] tokens so far (prompt + generated), may exceed T
    rule_state: Any  # the rule chain's state
    done: jax.Array  # [B] bool, row has produced a stop string or an end token (or stopped its pattern)
    stop_state: jax.Array  # [B] int32 each row's state in the stop automaton (:mod:`.stops`)
    step: jax.Array  # [] int32, steps taken
    cstate: Any = None  # [B] int32 each row's automaton state (constrained generation), else None


class StepOutput(NamedTuple):
    token: jax.Array  # [B] int32
    model_logprob: jax.Array  # [B] log-probability under the unmodified model
    sample_logprob: jax.Array  # [B] log-probability under the distribution sampled from
    emitted: jax.Array  # [B] bool, the token is part of the row's output


# ----------------------------------------------------------------------------- one step


def _choose(logits, rule, rule_state, key, row_ids, step, greedy: bool, con=None, cstate=None, budget=None):
    """One token per row; with a constraint (``con``, an :class:`~jaxdecode.constraints.Automaton`,
    each row in ``cstate`` with ``budget`` tokens in all) also whether the row stops here, and
    its next automaton state. Returns ``(token, model_lp, sample_lp, rule_state, stop, cstate)``."""
    from jaxdecode.rules import processed_logprobs

    masked, stop, p_stop = logits, jnp.zeros(logits.shape[:1], bool), None
    if con is not None:
        ok, nxt = C.allowed(con, cstate, budget - step)
        p_stop = C.stop_probability(con, cstate, logits, ok)
        masked = C.mask(logits, ok)
    processed = masked if rule is None else rule.apply(masked, rule_state)
    if greedy:
        token = pick_tokens(processed, None, True)
        if con is not None:  # stop when that is the most probable choice
            best = jnp.max(jnp.where(ok, jax.nn.softmax(logits, axis=-1), 0.0), axis=-1)
            stop = p_stop > best
    else:
        keys = step_keys(key, row_ids, step)  # key: one, or one per row
        token = pick_tokens(processed, keys, False)
        if con is not None:
            u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, C.STOP_STREAM)))(keys)
            stop = u < p_stop
    take = lambda lp: jnp.take_along_axis(lp, token[:, None], axis=-1)[:, 0]
    model_lp = take(jax.nn.log_softmax(logits, axis=-1))
    sample_lp = take(processed_logprobs(processed))
    if con is not None:
        sample_lp = sample_lp + jnp.log1p(-jnp.minimum(p_stop, 1.0))
        after = take(nxt)
        cstate = jnp.where(stop | (after < 0), cstate, after)
    if rule is not None:
        rule_state = rule.update(rule_state, token)
    return token, model_lp, sample_lp, rule_state, stop, cstate


def _advance(st: SamplingState, out, stops, T, push: bool = True):
    """The state's recent window (unchanged when ``push`` is False), stop automaton state and
    done flags after ``out``'s token (``stops``: a :class:`~jaxdecode.decoding.stops.StopTable` or None)."""
    token, stop = out[0], out[4]
    recent = push_recent(st.recent, st.length, token, T) if push else st.recent
    stop_state, hit = advance(stops, st.stop_state, token)
    return recent, stop_state, st.done | stop | hit


def _empty_outputs(chunk: int, B: int) -> StepOutput:
    z = lambda dtype: jnp.zeros((chunk, B), dtype)
    return StepOutput(z(jnp.int32), z(jnp.float32), z(jnp.float32), z(bool))


@functools.partial(jax.jit, static_argnames=("model", "chunk", "greedy"), donate_argnames=("cache",))
def cache_chunk(params, state: SamplingState, cache, rule, key, row_ids, stops, step_end, con=None,
                 budget=None, *, model: DecodingModel, chunk: int, greedy: bool):
    """Steps up to ``step_end`` (at most ``chunk``) through the model's cache (see ``chunk_begin``
    in :mod:`jaxdecode.models.base`).

    The loop runs exactly the steps asked for (a dynamic trip count), so a last, partial chunk
    costs no idle steps and needs no program of its own. Outputs past the steps run are zeros
    (``emitted`` False).
    """
    B = state.logits.shape[0]
    steps = jnp.clip(step_end - state.step, 0, chunk)

    def body(i, carry):
        st, run, outs = carry
        out = _choose(st.logits, rule, st.rule_state, key, row_ids, st.step, greedy, con, st.cstate, budget)
        token, mlp, slp, rule_state, stop, cstate = out
        # the recent window is written once after the loop (nothing in it reads the window, and
        # a step that writes it also copies it)
        recent, stop_state, done = _advance(st, out, stops, model.T, push=False)
        logits, _, run = model.chunk_step(params, cache, run, i, token)
        new = SamplingState(logits, recent, st.length + 1, rule_state, done, stop_state, st.step + 1, cstate)
        out = StepOutput(token, mlp, slp, ~st.done & ~stop)
        outs = jax.tree_util.tree_map(lambda buf, x: buf.at[i].set(x), outs, out)
        return new, run, outs

    start = state.length
    run = model.chunk_begin(params, cache, B, chunk)
    state, run, outs = jax.lax.fori_loop(0, steps, body, (state, run, _empty_outputs(chunk, B)))
    cache = model.chunk_end(cache, run, steps)
    # every row stays inside the window on this path (the caller switches to the window mode at
    # T), so step i's token goes to position start + i; steps not run point past the end
    T = model.T
    at = jnp.where(jnp.arange(chunk)[:, None] < steps, start[None, :] + jnp.arange(chunk)[:, None], T)
    recent = state.recent.at[jnp.broadcast_to(jnp.arange(B)[None, :], at.shape), at].set(outs.token, mode="drop")
    return state._replace(recent=recent), cache, outs


@functools.partial(jax.jit, static_argnames=("model", "chunk", "greedy"))
def window_chunk(params, state: SamplingState, rule, key, row_ids, stops, step_end, con=None,
                  budget=None, *, model: DecodingModel, chunk: int, greedy: bool):
    """Steps up to ``step_end`` (at most ``chunk``) of the exact window mode: the model's
    prediction from each row's last T tokens."""
    B = state.logits.shape[0]

    def body(i, carry):
        st, outs = carry
        out = _choose(st.logits, rule, st.rule_state, key, row_ids, st.step, greedy, con, st.cstate, budget)
        token, mlp, slp, rule_state, stop, cstate = out
        recent, stop_state, done = _advance(st, out, stops, model.T)
        logits, _ = model.window(params, recent, st.length + 1)
        new = SamplingState(logits, recent, st.length + 1, rule_state, done, stop_state, st.step + 1, cstate)
        outs = jax.tree_util.tree_map(lambda buf, x: buf.at[i].set(x), outs,
                                      StepOutput(token, mlp, slp, ~st.done & ~stop))
        return new, outs

    steps = jnp.clip(step_end - state.step, 0, chunk)
    return jax.lax.fori_loop(0, steps, body, (state, _empty_outputs(chunk, B)))


@functools.partial(jax.jit, static_argnames=("model", "capacity"))
def prefill(params, tokens, lengths, *, model, capacity):
    """The sampling loop's compiled prefill (what a study times): the logits after each row's
    prompt and the cache of ``capacity`` positions it fills."""
    logits, _, cache = model.prefill(params, tokens, lengths, capacity)
    return logits, cache


@functools.partial(jax.jit, static_argnames=("model", "capacity"))
def prefill_shared(params, tokens, lengths, rows, *, model, capacity):
    """Prefill each distinct prompt once, then give row ``i`` the cache of prompt ``rows[i]``."""
    logits, _, cache = model.prefill(params, tokens, lengths, capacity)
    return jnp.take(logits, rows, axis=0), model.reorder(cache, rows)


@functools.partial(jax.jit, static_argnames=("model", "capacity"))
def grow(cache, *, model, capacity):
    """The cache with room for ``capacity`` positions."""
    return model.grow(cache, capacity)


@functools.partial(jax.jit, static_argnames=("model",))
def window_start(params, recent, lengths, *, model):
    """The next-token logits of the exact window mode's first step, from each row's last T tokens."""
    return model.window(params, recent, lengths)[0]


@functools.partial(jax.jit, static_argnames=("V", "max_new"))
def rule_init(rule, prompt, lengths, *, V, max_new):
    """The rule's initial state for the batch, compiled."""
    return rule.init(prompt, lengths, V, max_new)


# ----------------------------------------------------------------------------- driver


@dataclasses.dataclass
class TokenResult:
    tokens: np.ndarray  # [B, n] int32 (garbage where not emitted)
    model_logprobs: np.ndarray  # [B, n]
    sample_logprobs: np.ndarray  # [B, n]
    counts: np.ndarray  # [B] tokens emitted per row
    stopped: np.ndarray  # [B] bool
