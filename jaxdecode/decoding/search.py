"""Exact search for the most probable continuation (the mode), optionally within a pattern's language.

:func:`mode_search` is best-first (uniform-cost) search over prefixes of the continuation, keyed
by their log-probability under the model; :mod:`jaxdecode.eval.studies.beam_curse` compares it with
beam search (:mod:`jaxdecode.decoding.beam`).

With a constraint (:mod:`jaxdecode.constraints`) a prefix is extended only by the tokens the
pattern allows with the tokens left (those whose next state still reaches a final state in
time), and a prefix in a final state may also *stop*, with the model's probability of the tokens
it cannot take there (1 where it can take none): the output's log-probability is the model's
log-probability of its tokens plus, for an output that stops before ``n`` tokens, the log of
its stop probability. This is the end-of-output rule constrained sampling and beam search use.
"""

from __future__ import annotations

import functools
import heapq

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.decoding.common import PROMPT_BUCKET, check_int, make_batch, round_up
from jaxdecode.decoding.params import MODE, resolve
from jaxdecode.models.base import DecodingModel


class SearchBudgetExceeded(RuntimeError):
    """Exact search expanded more nodes than its budget allows."""


@functools.partial(jax.jit, static_argnames=("model",))
def _expand_cached(params, cache, prompt_logits, tokens, depth, *, model):
    """Next-token log-probabilities [m, V] after prompt + ``tokens[i, :depth[i]]``.

    ``cache`` holds the prompt (one row), ``prompt_logits`` [1, V] the logits after it.
    """
    m = tokens.shape[0]
    rows = model.reorder(cache, jnp.zeros((m,), jnp.int32))
    logits, _, _ = model.extend(params, rows, tokens)  # [m, W, V]; causal: padding never looks back
    at = jnp.maximum(depth - 1, 0)[:, None, None]
    out = jnp.take_along_axis(logits, at, axis=1)[:, 0]
    out = jnp.where((depth == 0)[:, None], prompt_logits, out)
    return jax.nn.log_softmax(out, axis=-1)


@functools.partial(jax.jit, static_argnames=("model",))
def _expand_window(params, history, lengths, *, model):
    return jax.nn.log_softmax(model.window(params, history, lengths)[0], axis=-1)


@functools.partial(jax.jit, static_argnames=("model", "capacity"))
def _prompt_prefill(params, prompt, length, *, model, capacity):
    logits, _, cache = model.prefill(params, prompt, length, capacity)
    return logits, cache


def _bucket(x: int, least: int, factor: int, cap: int | None = None) -> int:
    """The smallest ``least * factor**k`` that is at least ``x``, at most ``cap``."""
    b = least
    while b < x:
        b *= factor
    return b if cap is None else min(b, cap)


def _choices(constraint, n: int):
    """``choices(state, depth, lp [V]) -> (tokens, next states, stop log-probability)`` at a node:
    every token with no constraint (and no stop); else the allowed tokens and, in a final state,
    the log of the model's mass on the others (0 where none is allowed; -inf outside a final state)."""
    if constraint is None:
        return lambda state, depth, lp: (np.arange(lp.shape[0]), None, -np.inf)
    table, final, dist = constraint.table, constraint.final, constraint.dist

    def choices(state, depth, lp):
        nxt = table[state]
        ok = (nxt >= 0) & (dist[np.maximum(nxt, 0)] <= n - depth - 1)
        tokens = np.flatnonzero(ok)
        stop = -np.inf
        if final[state] and not constraint.eos_stop:  # with end tokens, generating one is the stop
            blocked = float(np.exp(lp[~ok]).sum()) if len(tokens) else 1.0
            stop = float(np.log(blocked)) if blocked > 0 else -np.inf
        return tokens, nxt[tokens], stop

    return choices


def mode_search(model: DecodingModel, weights, prompt: np.ndarray, params=None, node_budget: int = 100_000, *,
                lower_bound: float | None = None, batch: int = 32, **overrides) -> tuple[np.ndarray, float, int]:
    """The most probable continuation of up to ``params.n`` tokens of ``model`` with its parameters
    ``weights`` after ``prompt`` (token ids): (tokens, log-probability, nodes expanded).

    ``params``: a :class:`~jaxdecode.decoding.params.DecodeParams` or the number of new tokens
    ``n``; keywords override its fields, as for :func:`jaxdecode.generate`. Of its settings the
    search honours ``n``, ``stop_token_ids`` and ``constraint`` (``end_tokens=`` is the older
    name of ``stop_token_ids``); ``node_budget``, ``lower_bound`` and ``batch`` are its own.

    Best-first search over prefixes (uniform-cost search with a heap keyed by minus the
    log-probability): log-probabilities only fall as a prefix grows, so the first complete
    hypothesis popped is the mode. Nodes are expanded up to ``batch`` at a time, in heap order, in
    one model call over as many rows and positions as they need (each rounded up to a bucket); a complete hypothesis is only returned when it is the top of the heap with no
    expansion pending, so batching never changes the answer. Children whose log-probability falls
    below ``lower_bound`` (that of any known continuation, by default greedy's) cannot lead to the
    mode and are not pushed. Raises :class:`SearchBudgetExceeded` after ``node_budget`` expansions.

    ``constraint``: a :class:`jaxdecode.constraints.Constraint`; the result is then the most
    probable output in its language (see the module docstring): up to ``n`` tokens, its
    log-probability including the log stop probability where it stops before ``n``. A stop is
    a complete hypothesis (a leaf) whose log-probability is at most its prefix's, so the first
    complete hypothesis popped is still the mode. The default lower bound is then the best stop
    (or the end) along constrained greedy's path.

    ``stop_token_ids``: token ids that end a continuation (a model's EOS): a prefix that generates
    one is complete there (a leaf, the end token its last token), so the mode may be shorter
    than ``n``.
    """
    if "end_tokens" in overrides:
        if "stop_token_ids" in overrides:
            raise TypeError("mode_search: give the end tokens once (stop_token_ids=, or its older name end_tokens=)")
        overrides["stop_token_ids"] = overrides.pop("end_tokens")
    p = resolve(params, overrides, MODE)
    n, constraint, end_tokens = p.n, p.constraint, p.stop_token_ids
    prompt = make_batch([prompt], n, model.V, model.T).prompt[0, :len(np.asarray(prompt).reshape(-1))]
    node_budget = check_int("node_budget", node_budget, 1)
    batch = check_int("batch", batch, 1)
    if constraint is not None:
        from jaxdecode.constraints import Constraint, ConstraintError

        if not isinstance(constraint, Constraint):
            raise ConstraintError(f"a constraint must be a compiled Constraint, got {type(constraint).__name__}")
        if constraint.V != model.V:
            raise ConstraintError(f"the constraint was compiled for {constraint.V} tokens, the model has {model.V}")
        constraint.check_budget(n)
    P = len(prompt)
    T = model.T
    if n == 0:
        return np.zeros((0,), np.int32), 0.0, 0

    W = max(n - 1, 1)  # a node to expand has at most n - 1 generated tokens
    if P + n <= T:
        Pb = round_up(P, PROMPT_BUCKET)
        padded = np.zeros((1, Pb), np.int32)
        padded[0, :P] = prompt
        prompt_logits, cache = _prompt_prefill(weights, jnp.asarray(padded[:, :min(Pb, T)]),
                                               jnp.asarray([P], jnp.int32), model=model,
                                               capacity=round_up(Pb + W, PROMPT_BUCKET))

        def expand(nodes):
            # only as many rows and positions as the nodes need (each a bucket, so a search
            # compiles a few programs): a node near the root costs a short forward, not W tokens
            width = min(W, _bucket(max(len(t) for t in nodes), 4, 2))
            tokens = np.zeros((_bucket(len(nodes), 1, 4, batch), width), np.int32)
            depth = np.zeros((tokens.shape[0],), np.int32)
            for i, t in enumerate(nodes):
                tokens[i, :len(t)] = t
                depth[i] = len(t)
            out = _expand_cached(weights, cache, prompt_logits, jnp.asarray(tokens), jnp.asarray(depth),
                                 model=model)
            return np.asarray(out, np.float64)[:len(nodes)]
    else:
        def expand(nodes):  # the book's window: a forward over the last T tokens of each prefix
            rows = _bucket(len(nodes), 1, 4, batch)
            history = np.zeros((rows, T), np.int32)
            lengths = np.ones((rows,), np.int32)
            for i, t in enumerate(nodes):
                seq = np.concatenate([prompt, np.asarray(t, np.int32)])[-T:]
                history[i, :len(seq)] = seq
                lengths[i] = len(seq)
            out = _expand_window(weights, jnp.asarray(history), jnp.asarray(lengths), model=model)
            return np.asarray(out, np.float64)[:len(nodes)]

    ends = {int(e) for e in end_tokens}
    choices = _choices(constraint, n)
    expanded = 0
    if lower_bound is None:  # greedy decoding's log-probability (its best stop, constrained)
        toks, state, total, lower_bound = (), 0, 0.0, -np.inf
        for depth in range(n):
            lp = expand([toks])[0]
            expanded += 1
            tokens, states, stop = choices(state, depth, lp)
            lower_bound = max(lower_bound, total + stop)
            if len(tokens) == 0 or stop > np.max(lp[tokens]):
                break  # constrained greedy stops here
            i = int(np.argmax(lp[tokens]))
            toks += (int(tokens[i]),)
            state = 0 if states is None else int(states[i])
            total += float(lp[tokens[i]])
            if int(tokens[i]) in ends:
                lower_bound = max(lower_bound, total)
                break
        else:
            lower_bound = max(lower_bound, total)
    # float32 sums along different paths differ by rounding: keep a margin so that the
    # known continuation itself is never pruned
    bound = lower_bound - 1e-3 * (1.0 + abs(lower_bound))

    heap = [(0.0, 0, (), 0, False)]  # (-log-probability, tie-breaker, generated tokens, state, stopped)
    pushed = 1
    while heap:
        nodes = []
        while heap and len(nodes) < batch:
            neg, _, toks, state, stopped = heap[0]
            if stopped or len(toks) == n:
                if not nodes:
                    return np.asarray(toks, np.int32), -neg, expanded
                break  # expand the pending nodes first: their children may beat it
            heapq.heappop(heap)
            nodes.append((neg, toks, state))
        if expanded + len(nodes) > node_budget:
            raise SearchBudgetExceeded(
                f"exact search exceeded its node budget of {node_budget:,} expansions "
                f"({expanded:,} expanded, {len(heap):,} prefixes waiting); raise node_budget")
        lps = expand([t for _, t, _ in nodes])
        expanded += len(nodes)
        for (neg, toks, state), lp in zip(nodes, lps):
            tokens, states, stop = choices(state, len(toks), lp)
            if stop > -np.inf and -neg + stop >= bound:  # the output ends here (a leaf)
                heapq.heappush(heap, (neg - stop, pushed, toks, state, True))
                pushed += 1
            child = lp[tokens] - neg  # log-probabilities of the children
            for i in np.flatnonzero(child >= bound):
                nxt = 0 if states is None else int(states[i])
                heapq.heappush(heap, (-float(child[i]), pushed, toks + (int(tokens[i]),), nxt,
                                      int(tokens[i]) in ends))
                pushed += 1
    raise RuntimeError("exact search pruned every continuation: lower_bound exceeds the mode's "
                       "log-probability")


__all__ = ["SearchBudgetExceeded", "mode_search"]
