"""Sampling from the model *conditioned* on a constraint: sequential Monte Carlo, and exact
enumeration for small languages.

Masking every step (:mod:`jaxdecode.constraints`, ``generate(..., constraint=c)``) keeps the
output in the language, but it renormalizes each next-token distribution locally, without
knowing how much of the model's probability lies on valid completions further on: it does not
draw from the model's distribution conditioned on the output being in the language. This module
draws from that conditional approximately (:func:`smc_generate`) and computes it exactly where the
language within ``n`` tokens is small (:func:`exact_conditional`, :func:`masked_distribution`,
:func:`enumerate_outputs`).

SMC (Lew et al. 2023; Loula et al. 2025) runs ``particles`` partial outputs as rows of one batch.
Each step proposes from the masked sampler and multiplies each particle's weight by ``Z_t``, the
model's mass on the allowed tokens at a step from a non-final state (every step with end tokens);
particles are resampled when the effective sample size falls below ``ess_threshold *
particles``. The log of the mean final weight estimates the log-probability that the model's
output is in the language. Everything here is the raw model: a decoding rule would change both
the target and the proposal.

The target, the proposal, the weights and the enumeration are derived in ``docs/constrained.md``
(SMC and exact enumeration: the derivation).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import constraints as C
from jaxdecode.decoding import budget as budget_lib
from jaxdecode.decoding.common import (
    PROMPT_BUCKET,
    SPAN_BUCKET,
    batch_bucket,
    encode_prompts,
    next_logits_for,
    round_up,
)

RESAMPLE_STREAM = 0x5E5A  # folded into the key for a resampling draw (apart from the step draws)

__all__ = ["Enumeration", "SMCResult", "enumerate_outputs", "exact_conditional", "masked_distribution",
           "smc_generate", "total_variation", "kl_divergence"]


# ----------------------------------------------------------------------------- helpers


def _encode(lm, prompt) -> np.ndarray:
    """A text prompt through :func:`~jaxdecode.decoding.common.encode_prompts`, or token ids."""
    if isinstance(prompt, str):
        return np.asarray(encode_prompts(lm, prompt, 1)[1][0], np.int32).reshape(-1)
    toks = np.asarray(prompt, np.int32).reshape(-1)
    if toks.size == 0:
        raise ValueError("the prompt is empty: give at least one token")
    return toks


def _check(constraint, n: int) -> None:
    if not isinstance(constraint, C.Constraint):
        raise TypeError(f"constraint must be a compiled jaxdecode.constraints.Constraint, got "
                        f"{type(constraint).__name__}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    constraint.check_budget(int(n))


def total_variation(p: dict, q: dict) -> float:
    """``1/2 sum |p - q|`` over the union of the keys."""
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def kl_divergence(p: dict, q: dict) -> float:
    """``KL(p || q) = sum p log(p / q)`` in nats; ``inf`` where ``q`` misses mass of ``p``."""
    out = 0.0
    for k, pk in p.items():
        if pk <= 0:
            continue
        qk = q.get(k, 0.0)
        if qk <= 0:
            return math.inf
        out += pk * (math.log(pk) - math.log(qk))
    return max(out, 0.0)


# ----------------------------------------------------------------------------- exact enumeration


def _log_softmax64(logits) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@dataclasses.dataclass
class Enumeration:
    """Every complete output of a constraint within ``n`` tokens after a prompt (see the module
    docstring): ``tokens[i]``, ``texts[i]``, ``log_p[i] = log P(y)`` (the model's, stop term
    included) and ``log_q[i] = log Q(y)`` (the masked sampler's)."""

    tokens: list[tuple[int, ...]]
    texts: list[str]
    log_p: np.ndarray
    log_q: np.ndarray

    @property
    def log_normalizer(self) -> float:
        """``log sum_y P(y)``: the log-probability that the model's output is in the language."""
        m = float(np.max(self.log_p))
        return m + math.log(float(np.sum(np.exp(self.log_p - m))))

    def _by_text(self, logs: np.ndarray) -> dict[str, float]:
        m = float(np.max(logs))
        w = np.exp(logs - m)
        w = w / w.sum()
        out: dict[str, float] = {}
        for text, x in zip(self.texts, w):
            out[text] = out.get(text, 0.0) + float(x)
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def conditional(self) -> dict[str, float]:
        """The exact conditional ``P(y) / sum P``, by text, most probable first."""
        return self._by_text(self.log_p)

    def masked(self) -> dict[str, float]:
        """The masked sampler's ``Q(y)`` (it sums to 1), by text, most probable first."""
        return self._by_text(self.log_q)


def enumerate_outputs(lm, prompt, n: int, constraint: C.Constraint, max_outputs: int = 10_000,
                      batch_size: int = 256) -> Enumeration:
    """Walk the automaton breadth first over the allowed tokens after ``prompt`` (a string, or
    token ids), up to ``n`` tokens, computing ``P`` and ``Q`` of every complete output (see the
    module docstring). Raises :class:`ValueError` when the language within ``n`` tokens has more
    than ``max_outputs`` complete outputs."""
    _check(constraint, n)
    model, params = lm.decoder, lm.params
    prompt = _encode(lm, prompt)
    table, final, dist = constraint.table, constraint.final, constraint.dist
    ends = np.zeros(table.shape[1], bool)
    ends[list(constraint.end_tokens)] = True
    prefixes = np.zeros((1, 0), np.int64)  # [N, t] live prefixes
    states = np.zeros(1, np.int64)
    log_p = np.zeros(1, np.float64)
    log_q = np.zeros(1, np.float64)
    out_tokens: list[tuple[int, ...]] = []
    out_p: list[float] = []
    out_q: list[float] = []

    def emit(rows, extra_p, extra_q):
        out_tokens.extend(tuple(int(t) for t in prefixes[r]) for r in rows)
        out_p.extend((log_p[rows] + extra_p).tolist())
        out_q.extend((log_q[rows] + extra_q).tolist())

    def too_many(live: int):
        if len(out_tokens) + live > max_outputs:
            raise ValueError(f"the language of {constraint.pattern!r} has more than {max_outputs} complete "
                             f"outputs within n={n} tokens (found {len(out_tokens)} and {live} live prefixes "
                             f"at length {prefixes.shape[1]}); raise max_outputs or use smc_generate")

    for t in range(n):
        left = n - t
        rows = np.concatenate([np.broadcast_to(prompt, (len(prefixes), len(prompt))), prefixes], axis=1)
        logp = _log_softmax64(next_logits_for(model, params, batch_size)(rows))  # [N, V]
        nxt = table[states]  # [N, V]
        ok = (nxt >= 0) & (dist[np.maximum(nxt, 0)] <= left - 1)
        p = np.exp(logp)
        Z = np.where(ok, p, 0.0).sum(axis=1)
        is_final = final[states]
        if ends.any():  # the stop is an end token (allowed in final states only): P has p(end), Q p(end)/Z
            stop = np.where(ok & ends[None, :], p, 0.0).sum(axis=1)
            fin = np.flatnonzero(stop > 0)
            with np.errstate(divide="ignore"):
                emit(fin, np.log(stop[fin]), np.log(stop[fin]) - np.log(Z[fin]))
            ok = ok & ~ends[None, :]
            cont = np.zeros(len(states))  # every step of Q is p/Z
        else:
            # stop probability in a final state: the mass of the tokens that cannot be taken (1 if none can)
            stop = np.where(is_final, np.where(ok.any(axis=1), np.where(ok, 0.0, p).sum(axis=1), 1.0), 0.0)
            fin = np.flatnonzero(is_final & (stop > 0))
            with np.errstate(divide="ignore"):
                log_stop = np.log(stop[fin])
                # Q's step: p/Z from a non-final state; (1 - s) * p/Z from a final one (the literal
                # sampler, whose 1 - s equals Z)
                cont = np.where(is_final, np.log1p(-np.minimum(stop, 1.0)), 0.0)
            emit(fin, log_stop, log_stop)
        parent, token = np.nonzero(ok)
        too_many(len(parent))
        step_q = cont[parent] + logp[parent, token] - np.log(Z[parent])
        log_q = log_q[parent] + step_q
        log_p = log_p[parent] + logp[parent, token]
        states = nxt[parent, token].astype(np.int64)
        prefixes = np.concatenate([prefixes[parent], token[:, None]], axis=1)
        if len(prefixes) == 0:
            break
    if len(prefixes):  # n tokens: final by the budget rule, ended by the length limit (s = 1)
        assert final[states].all(), "the budget rule left a non-final state at n tokens"
        emit(np.arange(len(prefixes)), 0.0, 0.0)
    too_many(0)
    texts = [lm.vocab.decode(np.asarray(t, np.int32)) for t in out_tokens]
    return Enumeration(out_tokens, texts, np.asarray(out_p, np.float64), np.asarray(out_q, np.float64))


def exact_conditional(lm, prompt, n: int, constraint: C.Constraint,
                      max_outputs: int = 10_000) -> dict[str, float]:
    """The model's distribution over complete outputs conditioned on the language:
    ``P(y) / sum P`` (see the module docstring), text -> probability, most probable first."""
    return enumerate_outputs(lm, prompt, n, constraint, max_outputs).conditional()


def masked_distribution(lm, prompt, n: int, constraint: C.Constraint,
                        max_outputs: int = 10_000) -> dict[str, float]:
    """The distribution the masked sampler draws from, ``Q(y)`` (see the module docstring),
    text -> probability, most probable first."""
    return enumerate_outputs(lm, prompt, n, constraint, max_outputs).masked()


# ----------------------------------------------------------------------------- SMC


class _Particles(NamedTuple):
    """The device state of the particles (the token history stays on the host)."""

    logits: jax.Array  # [Nb, V] next-token logits
    cstate: jax.Array  # [Nb] int32 automaton state
    done: jax.Array  # [Nb] bool: stopped (and every padding row)
    logw: jax.Array  # [Nb] float32 log-weight (-inf on padding rows)


@functools.partial(jax.jit, static_argnames=("model", "capacity"))
def _smc_start(params, prompt, length, *, model, capacity):
    """Prefill the prompt ``[1, Pb]`` once: its logits ``[1, V]`` and cache."""
    logits, _, cache = model.prefill(params, prompt, length, capacity)
    return logits, cache


@functools.partial(jax.jit, static_argnames=("model",))
def _smc_repeat(cache, logits, rows, *, model):
    """The one-row prefill as ``len(rows)`` rows."""
    return model.reorder(cache, rows), logits[rows]


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def _smc_step(params, cache, parts: _Particles, auto: C.Automaton, key, step, n, *, model):
    """One step of every particle: propose from the masked model (stop or token), weight by
    ``Z_t`` in non-final states, feed the token. Returns the cache, the particles, each row's
    token and whether it took it ``[Nb]``, and the effective sample size."""
    Nb = parts.logits.shape[0]
    left = jnp.broadcast_to(n - step, (Nb,)).astype(jnp.int32)
    ok, nxt = C.allowed(auto, parts.cstate, left)
    p_stop = C.stop_probability(auto, parts.cstate, parts.logits, ok)
    logp = jax.nn.log_softmax(parts.logits, axis=-1)
    log_z = jax.nn.logsumexp(jnp.where(ok, logp, -jnp.inf), axis=-1)
    k_tok, k_stop = jax.random.split(jax.random.fold_in(key, step))
    token = jax.random.categorical(k_tok, C.mask(parts.logits, ok), axis=-1).astype(jnp.int32)
    # a model's end token (allowed in final states only) is the stop; else the leftover-mass draw
    stop = (jax.random.uniform(k_stop, (Nb,)) < p_stop) | auto.end[token]
    active = ~parts.done
    go = active & ~stop
    # the weight: Z_t at a step from a non-final state, 1 from a final one; with end tokens Z_t at
    # every step (see the module docstring)
    weighted = ~auto.final[parts.cstate] | ~auto.leftover[parts.cstate]
    logw = parts.logw + jnp.where(active & weighted, log_z, 0.0)
    after = jnp.take_along_axis(nxt, token[:, None], axis=1)[:, 0]
    cstate = jnp.where(go, after, parts.cstate)
    done = parts.done | (active & stop)
    logits, _, cache = model.extend(params, cache, token[:, None])
    w = jnp.exp(logw - jnp.max(logw))
    ess = jnp.sum(w) ** 2 / jnp.sum(w * w)
    return cache, _Particles(logits[:, 0], cstate, done, logw), token, go, ess


@functools.partial(jax.jit, static_argnames=("model", "systematic"), donate_argnames=("cache",))
def _smc_resample(cache, parts: _Particles, key, N, *, model, systematic: bool):
    """Draw ``N`` ancestors by weight (rows ``>= N`` are padding and keep themselves), reorder the
    cache and the particles, reset every weight to the mean. Returns the cache, the particles
    and the ancestors ``[Nb]``."""
    Nb = parts.logw.shape[0]
    rows = jnp.arange(Nb)
    real = rows < N
    if systematic:
        w = jax.nn.softmax(parts.logw)
        cdf = jnp.cumsum(w)
        pos = (jax.random.uniform(key) + rows.astype(jnp.float32)) / N.astype(jnp.float32)
        anc = jnp.searchsorted(cdf, pos, side="right")
    else:
        anc = jax.random.categorical(key, parts.logw, shape=(Nb,))
    anc = jnp.where(real, jnp.clip(anc, 0, N - 1), rows).astype(jnp.int32)
    mean = jax.nn.logsumexp(parts.logw) - jnp.log(N.astype(jnp.float32))
    logw = jnp.where(real, mean, -jnp.inf)
    parts = _Particles(parts.logits[anc], parts.cstate[anc], parts.done[anc], logw)
    return model.reorder(cache, anc), parts, anc


@dataclasses.dataclass
class SMCResult:
    """The particles of :func:`smc_generate` after ``n`` steps (all complete)."""

    texts: list[str]  # [particles] each particle's output
    tokens: list[np.ndarray]  # [particles] its tokens
    weights: np.ndarray  # [particles] normalized weights (float64)
    distribution: dict[str, float]  # the estimated conditional: weight per distinct text, largest first
    log_marginal: float  # log of the mean weight: estimates log sum_y P(y) over the language
    ess: list[float]  # the effective sample size after each step's reweighting (before resampling)
    resampled: list[int]  # the steps (0-based) after which the particles were resampled
    particles: int

    @property
    def final_ess(self) -> float:
        return float(1.0 / np.sum(self.weights ** 2))


def smc_generate(lm, prompt, n: int, constraint: C.Constraint, particles: int, *, seed: int = 0,
                 ess_threshold: float = 0.5, resampling: str = "systematic",
                 memory_budget: int | str | None = None) -> SMCResult:
    """Sequential Monte Carlo for the model conditioned on ``constraint`` (see the module
    docstring): ``particles`` rows of one batch after ``prompt`` (a string or token ids), up to
    ``n`` tokens, the masked model as the proposal, weights ``Z_t``, resampling (``"systematic"``
    or ``"multinomial"``) when the effective sample size falls below ``ess_threshold *
    particles``. Deterministic given ``seed`` (and ``particles``).

    The prompt and the ``n`` tokens must fit in the model window ``T`` (the particles run through
    the cache). Programs: one per (bucketed particles, cache capacity, prompt bucket); the
    particles are padded to a power of two with finished, weightless rows. The particles share one
    batch (resampling couples them): a request whose particles do not fit ``memory_budget`` (see
    :mod:`jaxdecode.decoding.budget`) is refused before anything is allocated.
    """
    _check(constraint, n)
    n = int(n)
    if isinstance(particles, bool) or not isinstance(particles, (int, np.integer)) or particles < 1:
        raise ValueError(f"particles must be an integer >= 1, got {particles!r}")
    if not 0.0 <= float(ess_threshold) <= 1.0:
        raise ValueError(f"ess_threshold must lie in [0, 1], got {ess_threshold!r}")
    if resampling not in ("systematic", "multinomial"):
        raise ValueError(f"resampling must be 'systematic' or 'multinomial', got {resampling!r}")
    model = lm.decoder
    toks = _encode(lm, prompt)
    P = len(toks)
    if P + n > model.T:
        raise ValueError(f"smc_generate: the prompt ({P} tokens) and n={n} must fit in the model window "
                         f"T={model.T}")
    N = int(particles)
    Nb = batch_bucket(N)
    budget_lib.require(f"SMC with {N} particles", Nb,
                       budget_lib.row_bytes(model, P, n, min(model.T, round_up(P + n, SPAN_BUCKET))),
                       memory_budget, unit="particles", fewer="fewer particles")
    auto, starts, _ = C.for_rows([constraint] * N + [None] * (Nb - N), Nb, Nb, model.V, n)
    capacity = min(model.T, round_up(P + n, SPAN_BUCKET))
    params = model.prepare(lm.params, Nb)
    Pb = min(round_up(P, PROMPT_BUCKET), model.T)
    padded = np.zeros((1, Pb), np.int32)
    padded[0, :P] = toks
    logits, cache = _smc_start(params, jnp.asarray(padded), jnp.asarray([P], jnp.int32), model=model,
                               capacity=capacity)
    cache, logits = _smc_repeat(cache, logits, jnp.zeros((Nb,), jnp.int32), model=model)
    real = np.arange(Nb) < N
    logw = jnp.asarray(np.where(real, 0.0, -np.inf), jnp.float32)  # padding rows: done, weightless
    parts = _Particles(logits, starts, jnp.asarray(~real), logw)

    key = jax.random.PRNGKey(seed)
    step_key, resample_key = jax.random.split(key)
    history = np.zeros((Nb, n), np.int32)
    count = np.zeros(Nb, np.int32)
    ess_log, resampled = [], []
    n_arr, N_arr = jnp.int32(n), jnp.int32(N)
    for t in range(n):
        cache, parts, token, go, ess = _smc_step(params, cache, parts, auto, step_key, jnp.int32(t), n_arr,
                                                 model=model)
        token, go, ess, done = jax.device_get((token, go, ess, parts.done))
        history[go, t] = token[go]  # a particle's t-th token: it has taken t before (it never paused)
        count += go
        ess_log.append(float(ess))
        if bool(np.all(done)) or t == n - 1:
            break  # nothing left to extend, or the last step: no resampling at the end
        if ess < ess_threshold * N:
            cache, parts, anc = _smc_resample(cache, parts, jax.random.fold_in(resample_key, t), N_arr,
                                              model=model, systematic=resampling == "systematic")
            anc = np.asarray(anc)
            history, count = history[anc], count[anc]
            resampled.append(t)

    logw = np.asarray(parts.logw, np.float64)[:N]
    m = float(np.max(logw))
    w = np.exp(logw - m)
    log_marginal = m + math.log(float(w.sum())) - math.log(N)
    weights = w / w.sum()
    tokens = [history[i, :count[i]].copy() for i in range(N)]
    texts = [lm.vocab.decode(t) for t in tokens]
    dist: dict[str, float] = {}
    for text, x in zip(texts, weights):
        dist[text] = dist.get(text, 0.0) + float(x)
    dist = dict(sorted(dist.items(), key=lambda kv: (-kv[1], kv[0])))
    return SMCResult(texts, tokens, weights, dist, log_marginal, ess_log, resampled, N)
