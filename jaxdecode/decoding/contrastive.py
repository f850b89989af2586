"""Contrastive search (Su et al. 2022) as a jitted, batched loop over a decoding model's cache.

At each step, among the ``k`` most probable next tokens ``v`` (under the unmodified model) the
loop takes the one that maximizes

    (1 - alpha) * p(v | x)  -  alpha * max_j cos(h_v, h_j)

where ``h_v`` is the model's final hidden state (after the last LayerNorm: the interface's
``hidden``, Hugging Face's ``hidden_states[-1]``) at the position of ``v``, and ``j`` ranges over
every earlier position of the row, prompt included. ``alpha = 0`` (or ``k = 1``) is greedy search.

All ``k`` candidates of a prompt are scored in one pass: the cache holds ``k`` copies of every
row and the chosen copy's cache replaces the others (``model.reorder``, on ``model.for_beams()``
as in beam search). Past the model window ``T`` the loop switches to the exact window mode.
Deterministic: no key. Stop strings end a row; ``on_chunk`` streams chunks as in
:func:`jaxdecode.decoding.sampling.sample_tokens`. The window mode, the hidden-state history and
the paged cache's cost are in ``docs/python.md`` (Contrastive search).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.decoding import budget as budget_lib
from jaxdecode.decoding.common import (
    SPAN_BUCKET,
    Generation,
    check_int,
    encode_prompts,
    finish_text,
    make_batch,
    push_recent,
    round_up,
    text_streamer,
)
from jaxdecode.decoding.params import CONTRASTIVE, DecodeParams, resolve, stop_automaton_for
from jaxdecode.decoding.sampling import TokenResult
from jaxdecode.decoding.stops import advance, as_automaton
from jaxdecode.models.base import DecodingModel

DEFAULT_CHUNK = 32
HISTORY_BUCKET = 128

__all__ = ["check_settings", "contrastive_generate", "contrastive_tokens"]


class ContrastiveState(NamedTuple):
    logits: jax.Array  # [B, V] next-token logits of each row
    history: jax.Array  # [B, N, d] unit-norm hidden states of the earlier positions
    filled: jax.Array  # [B] positions in ``history``
    recent: jax.Array  # [B, T] the last T tokens of each row (window mode)
    length: jax.Array  # [B] tokens so far (prompt + generated)
    done: jax.Array  # [B] bool: the row has produced a stop string or an end token
    stop_state: jax.Array  # [B] int32 each row's state in the stop automaton (:mod:`.stops`)
    step: jax.Array  # [] int32


class ContrastiveOutput(NamedTuple):
    token: jax.Array  # [B] int32
    model_logprob: jax.Array  # [B]
    emitted: jax.Array  # [B] bool


def _unit(h):
    return h / jnp.maximum(jnp.linalg.norm(h, axis=-1, keepdims=True), 1e-12)


def _candidates(logits, k: int):
    """The k most probable tokens ``[B, k]``, their probabilities and log-probabilities."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    top_lp, cand = jax.lax.top_k(logp, k)
    return cand.astype(jnp.int32), jnp.exp(top_lp), top_lp


def _choose(st: ContrastiveState, cand, prob, top_lp, h_cand, alpha):
    """The chosen candidate per row ``[B]`` given the candidates' unit hidden states ``[B, k, d]``."""
    N = st.history.shape[1]
    sim = jnp.einsum("bkd,bnd->bkn", h_cand, st.history)
    sim = jnp.where(jnp.arange(N)[None, None, :] < st.filled[:, None, None], sim, -jnp.inf)
    penalty = jnp.max(sim, axis=-1)  # [B, k]
    score = (1.0 - alpha)[:, None] * prob - alpha[:, None] * penalty
    choice = jnp.argmax(score, axis=-1).astype(jnp.int32)
    pick = lambda a: jnp.take_along_axis(a, choice[:, None], axis=1)[:, 0]
    return choice, pick(cand), pick(top_lp)


def _record(st: ContrastiveState, choice, token, h_cand, logits, stops):
    """The state after each row appends its chosen token (``logits``: the chosen candidate's)."""
    B = st.length.shape[0]
    h = jnp.take_along_axis(h_cand, choice[:, None, None], axis=1)[:, 0]  # [B, d]
    N = st.history.shape[1]
    history = st.history.at[jnp.arange(B), jnp.minimum(st.filled, N - 1)].set(h)
    stop_state, hit = advance(stops, st.stop_state, token)
    return st._replace(logits=logits, history=history, filled=jnp.minimum(st.filled + 1, N),
                       length=st.length + 1, done=st.done | hit, stop_state=stop_state, step=st.step + 1)


def _empty(chunk, B):
    return ContrastiveOutput(jnp.zeros((chunk, B), jnp.int32), jnp.zeros((chunk, B), jnp.float32),
                             jnp.zeros((chunk, B), bool))


def _store(outs, i, token, lp, done):
    out = ContrastiveOutput(token, lp, ~done)
    return jax.tree_util.tree_map(lambda buf, x: buf.at[i].set(x), outs, out)


@functools.partial(jax.jit, static_argnames=("model", "k", "span", "chunk"), donate_argnames=("cache",))
def _cache_chunk(params, st: ContrastiveState, cache, alpha, stops, step_end, *,
                 model: DecodingModel, k: int, span: int, chunk: int):
    """Steps up to ``step_end`` (at most ``chunk``) through the cache of ``B * k`` rows."""
    B = st.logits.shape[0]
    base = jnp.arange(B) * k

    def body(i, carry):
        st, cache, outs = carry
        cand, prob, top_lp = _candidates(st.logits, k)
        logits, hidden, cache = model.extend(params, cache, cand.reshape(B * k, 1), span=span, in_place=False)
        h_cand = _unit(hidden[:, 0]).reshape(B, k, -1)
        choice, token, lp = _choose(st, cand, prob, top_lp, h_cand, alpha)
        rows = base + choice
        cache = model.reorder(cache, jnp.repeat(rows, k), span)
        outs = _store(outs, i, token, lp, st.done)
        st = _record(st, choice, token, h_cand, logits[rows, 0], stops)
        return st, cache, outs

    steps = jnp.clip(step_end - st.step, 0, chunk)
    st, cache, outs = jax.lax.fori_loop(0, steps, body, (st, cache, _empty(chunk, B)))
    # the window mode reads ``recent``: written once per chunk (steps not run point past the end)
    T = model.T
    start = st.length - steps
    at = jnp.where(jnp.arange(chunk)[:, None] < steps, start[None, :] + jnp.arange(chunk)[:, None], T)
    recent = st.recent.at[jnp.broadcast_to(jnp.arange(B)[None, :], at.shape), at].set(outs.token, mode="drop")
    return st._replace(recent=recent), cache, outs


@functools.partial(jax.jit, static_argnames=("model", "k", "chunk"))
def _window_chunk(params, st: ContrastiveState, alpha, stops, step_end, *,
                  model: DecodingModel, k: int, chunk: int):
    """Steps up to ``step_end`` (at most ``chunk``) of the exact window mode."""
    B, T = st.recent.shape

    def body(i, carry):
        st, outs = carry
        cand, prob, top_lp = _candidates(st.logits, k)
        flat = cand.reshape(B * k)
        recent_k = push_recent(jnp.repeat(st.recent, k, axis=0), jnp.repeat(st.length, k), flat, T)
        logits, hidden = model.window(params, recent_k, jnp.repeat(st.length, k) + 1)
        h_cand = _unit(hidden).reshape(B, k, -1)
        choice, token, lp = _choose(st, cand, prob, top_lp, h_cand, alpha)
        rows = jnp.arange(B) * k + choice
        outs = _store(outs, i, token, lp, st.done)
        st = _record(st, choice, token, h_cand, logits[rows], stops)
        return st._replace(recent=recent_k[rows]), outs

    steps = jnp.clip(step_end - st.step, 0, chunk)
    return jax.lax.fori_loop(0, steps, body, (st, _empty(chunk, B)))


@functools.partial(jax.jit, static_argnames=("model", "k", "N", "capacity"))
def _start(params, prompt, recent, length, *, model: DecodingModel, k: int, N: int, capacity: int):
    """The prompt's hidden states (all positions) and logits, and its cache repeated k times.

    The prompt goes in as one ``extend`` from an empty cache: every row's prompt (right-padded)
    at positions ``0..P-1``; the padding is forgotten with ``truncate``. With ``capacity`` 0 (a
    prompt longer than ``T``) the last ``T`` tokens (``recent``) go in instead and no cache is kept.
    """
    B = prompt.shape[0]
    cached = capacity > 0
    tokens = prompt if cached else recent
    seen = length if cached else jnp.minimum(length, model.T)
    cache = model.empty_cache(B, capacity if cached else tokens.shape[1])
    logits, hidden, cache = model.extend(params, cache, tokens, span=tokens.shape[1], in_place=False)
    if hidden is None:
        raise ValueError("contrastive search needs the model's hidden states; this model returns none")
    last = jnp.maximum(seen - 1, 0)
    logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    P = tokens.shape[1]
    history = jnp.zeros((B, N, hidden.shape[-1]), hidden.dtype).at[:, :min(P, N)].set(_unit(hidden)[:, :N])
    st = ContrastiveState(logits=logits, history=history, filled=seen, recent=recent, length=length,
                          done=jnp.zeros((B,), bool), stop_state=jnp.zeros((B,), jnp.int32),
                          step=jnp.int32(0))
    if not cached:
        return st, None
    cache = model.truncate(cache, length)
    return st, model.reorder(cache, jnp.repeat(jnp.arange(B), k))


def check_settings(k, alpha, V: int, B: int) -> tuple[int, np.ndarray]:
    """``k`` as an int in ``[1, V]`` and ``alpha`` (one number or one per prompt) in ``[0, 1]``."""
    k = check_int("the contrastive candidate count k", k, 1)
    if k > V:
        raise ValueError(f"the contrastive candidate count k={k} exceeds the vocabulary size {V}")
    a = np.asarray(alpha, np.float64)
    if a.ndim > 1 or (a.ndim == 1 and a.shape[0] != B):
        raise ValueError(f"alpha must be one number or one per prompt ({B}), got shape {a.shape}")
    if not np.all(np.isfinite(a)) or np.any(a < 0) or np.any(a > 1):
        raise ValueError(f"the contrastive degeneration weight alpha must lie in [0, 1], got {alpha!r}")
    return k, np.broadcast_to(a, (B,)).astype(np.float32)


def contrastive_tokens(model: DecodingModel, params, prompts: Sequence[np.ndarray], n: int, k: int = 4,
                       alpha: float | Sequence[float] = 0.6, stops=(),
                       chunk: int = DEFAULT_CHUNK,
                       on_chunk: Callable[[np.ndarray, np.ndarray], None] | None = None,
                       memory_budget: int | str | None = None) -> TokenResult:
    """Contrastive search for ``n`` tokens after each prompt (token arrays of any lengths >= 1).

    ``k`` candidates per step (static: one program per value), ``alpha`` the weight of the
    degeneration penalty (traced; one number or one per prompt). Returns a
    :class:`~jaxdecode.decoding.sampling.TokenResult` whose ``sample_logprobs`` are 0 (the choice is
    deterministic) and whose ``model_logprobs`` are the unmodified model's. The cache holds ``k``
    copies of every row; a request whose copies do not fit ``memory_budget`` (see
    :mod:`jaxdecode.decoding.budget`) is refused before anything is allocated. ``stops``: token
    sequences, or a :class:`~jaxdecode.decoding.stops.StopAutomaton`, as for sampling.
    """
    model = model.for_beams()  # the cache of k copies per row is reordered at every step
    batch = make_batch(prompts, n, model.V, model.T)
    B, Bb, T = batch.B, batch.Bb, model.T
    k, alpha_b = check_settings(k, alpha, model.V, B)
    chunk = check_int("chunk", chunk, 1)
    if n == 0:
        e = np.zeros((B, 0), np.int32)
        return TokenResult(e, e.astype(np.float32), e.astype(np.float32), np.zeros(B, np.int32), np.zeros(B, bool))
    alpha = jnp.asarray(np.concatenate([alpha_b, np.zeros(Bb - B, np.float32)]))
    Pmax = batch.Pmax
    stops = as_automaton(stops, model.V)
    stop_dev = None if stops is None else stops.device()
    N = round_up(min(Pmax, T) + n, HISTORY_BUCKET)
    cached = Pmax <= T
    n_cache = min(n, T - Pmax) if cached else 0
    capacity = round_up(min(T, Pmax + n) + chunk, SPAN_BUCKET) if cached else 0
    budget_lib.require(f"contrastive search of {B} rows x {k} candidates", Bb * k,
                       budget_lib.row_bytes(model, Pmax, n, max(capacity, 1)), memory_budget,
                       unit="row copies", fewer="fewer rows or candidates")
    params = model.prepare(params, Bb * k)
    prompt = batch.prompt[:, :min(batch.Pb, T)] if cached else batch.prompt[:, :0]
    st, cache = _start(params, jnp.asarray(prompt), jnp.asarray(batch.recent), jnp.asarray(batch.length),
                       model=model, k=k, N=N, capacity=capacity)
    common = {"alpha": alpha, "stops": stop_dev}

    outs, taken = [], 0
    while taken < n:
        valid = min(chunk, (n_cache if taken < n_cache else n) - taken)
        step_end = np.int32(taken + valid)
        if taken < n_cache:
            span = min(capacity, round_up(Pmax + taken + chunk, SPAN_BUCKET))
            st, cache, out = _cache_chunk(params, st, cache, step_end=step_end, model=model, k=k, span=span,
                                          chunk=chunk, **common)
        else:
            cache = None
            st, out = _window_chunk(params, st, step_end=step_end, model=model, k=k, chunk=chunk, **common)
        out = ContrastiveOutput(*(np.asarray(a)[:valid, :B].T for a in jax.device_get(out)))
        outs.append(out)
        taken += valid
        if on_chunk is not None:
            on_chunk(out.token, out.emitted)
        if stop_dev is not None and bool(np.all(np.asarray(st.done)[:B])):
            break

    cat = lambda i: np.concatenate([o[i] for o in outs], axis=1)
    tokens, mlp, emitted = cat(0), cat(1).astype(np.float32), cat(2)
    return TokenResult(tokens.astype(np.int32), mlp, np.zeros_like(mlp), emitted.sum(axis=1).astype(np.int32),
                       np.asarray(st.done)[:B])


def contrastive_generate(lm, prompts: str | Sequence[str], params: DecodeParams | int | None = None, k: int = 4,
                         alpha: float | Sequence[float] = 0.6, *,
                         on_text: Callable[[int, str], None] | None = None, **overrides) -> list[Generation]:
    """Contrastive search with a loaded model ``lm``: one :class:`Generation` per prompt
    (``sample_logprobs`` are 0: the choice is deterministic). ``params``: a
    :class:`~jaxdecode.decoding.params.DecodeParams` or the number of new tokens ``n``; keywords
    override its fields, as for :func:`jaxdecode.generate`. ``alpha`` may give one value per
    prompt; they share one compiled program."""
    p = resolve(params, overrides, CONTRASTIVE)
    prompts, rows = encode_prompts(lm, prompts, 1)
    res = contrastive_tokens(lm.decoder, lm.params, rows, p.n, k, alpha, stops=stop_automaton_for(lm, p),
                             chunk=DEFAULT_CHUNK if p.chunk is None else p.chunk,
                             on_chunk=text_streamer(lm, on_text), memory_budget=p.memory_budget)
    out = []
    for r, prompt in enumerate(prompts):
        toks, text, reason = finish_text(lm, res.tokens[r, :res.counts[r]], res.stopped[r], p.stop, p.include_stop)
        c = len(toks)
        out.append(Generation(prompt=prompt, text=text, tokens=toks, model_logprobs=res.model_logprobs[r, :c],
                              sample_logprobs=res.sample_logprobs[r, :c], finish_reason=reason))
    return out
