"""Exact distributions over short continuations, for testing decoders against the truth.

:func:`exact_distribution` enumerates every continuation of ``n`` tokens that has positive
probability under the processed next-token distributions (a :mod:`jaxdecode.rules` rule applied
to the model's logits) and returns its probability. Sampling loops, beam search and speculative
decoding can then be checked against it exactly (greedy / beam) or with a chi-square test
(:func:`chisquare_pvalue`).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.decoding.common import NextLogits, next_logits_for  # noqa: F401 (re-exported)



def _softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    m = np.max(z, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(np.isneginf(z), 0.0, np.exp(z - m))
    return e / np.sum(e, axis=-1, keepdims=True)


@jax.jit
def _apply(rule, logits, state):
    return rule.apply(logits, state)


@jax.jit
def _advance(rule, state, parent, token):
    """The states of the children: each parent's state updated with its child's token."""
    state = jax.tree_util.tree_map(lambda x: x[parent], state)
    return rule.update(state, token)


def exact_distribution(next_logits: NextLogits, prompt, n: int, rule=None, V: int | None = None,
                       *, max_sequences: int = 1_000_000) -> dict[tuple[int, ...], float]:
    """The probability of every ``n``-token continuation of ``prompt`` with positive probability.

    ``next_logits(tokens [N, t]) -> [N, V]`` gives the next-token logits after each full row.
    Level by level, all live prefixes are batched; ``rule`` (if any) processes their logits with
    the state ``rule.init(prompt, [len(prompt)], V, n)`` updated along each prefix; the processed
    logits are normalized in float64 and multiplied along the path. The result sums to 1.
    Rule settings must be scalars (or have a single row): the prefixes form the batch.
    """
    prompt = np.asarray(prompt, np.int64).reshape(-1)
    if n < 0:
        raise ValueError(f"exact_distribution: n must be >= 0, got {n}")
    P = prompt.shape[0]
    prefixes = np.zeros((1, 0), np.int64)  # [N, level] live continuations so far
    probs = np.ones(1, np.float64)  # [N]
    state = None  # the rule's state per live prefix, built once V is known
    for _ in range(n):
        tokens = np.concatenate([np.broadcast_to(prompt, (len(prefixes), P)), prefixes], axis=1)
        logits = np.asarray(next_logits(tokens), np.float32)
        if logits.ndim != 2 or logits.shape[0] != len(prefixes):
            raise ValueError(f"exact_distribution: next_logits returned shape {logits.shape} for "
                             f"{len(prefixes)} rows")
        if V is None:
            V = logits.shape[1]
        elif logits.shape[1] != V:
            raise ValueError(f"exact_distribution: next_logits returned {logits.shape[1]} logits, "
                             f"expected V={V}")
        if rule is not None:
            if state is None:
                state = rule.init(jnp.asarray(prompt[None], jnp.int32),
                                  jnp.asarray([P], jnp.int32), V, n)
            # [1, ...] at the first level, [N, ...] after
            logits = np.asarray(_apply(rule, jnp.asarray(logits), state))
        cond = _softmax64(logits)  # [N, V]
        parent, token = np.nonzero(cond > 0)
        if len(parent) > max_sequences:
            raise ValueError(f"exact_distribution: more than {max_sequences} live continuations; "
                             f"use a shorter horizon or a truncation rule")
        probs = probs[parent] * cond[parent, token]
        prefixes = np.concatenate([prefixes[parent], token[:, None]], axis=1)
        if rule is not None:
            state = _advance(rule, state, jnp.asarray(parent, jnp.int32),
                             jnp.asarray(token, jnp.int32))
    total = probs.sum()
    return {tuple(int(t) for t in row): float(p / total) for row, p in zip(prefixes, probs)}


def model_next_logits(model, cfg=None, batch_size: int = 256) -> NextLogits:
    """``next_logits`` for a loaded model: :func:`next_logits_for` its decoder on the portable
    backend (a forward over each row's last ``T`` tokens). ``model``: a
    :class:`~jaxdecode.models.lm.LanguageModel`, or a reference transformer's parameters with its
    shape ``cfg`` (the decoder the loader builds for that shape)."""
    from jaxdecode.models import decoder_for
    from jaxdecode.models.lm import LanguageModel

    if isinstance(model, LanguageModel):
        if cfg is not None:
            raise TypeError("model_next_logits: a LanguageModel carries its own shape; pass no cfg")
        model = model.with_backend("portable")
        return next_logits_for(model.decoder, model.params, batch_size)
    if cfg is None:
        raise TypeError("model_next_logits: parameters need the model's shape cfg")
    return next_logits_for(decoder_for(cfg, "portable"), model, batch_size)


def chisquare_pvalue(counts: dict, probs: dict, min_expected: float = 5.0) -> float:
    """Chi-square goodness-of-fit p-value of sample ``counts`` against exact ``probs``.

    Cells whose expected count is below ``min_expected`` are pooled (from the smallest up)
    into one cell until it reaches ``min_expected``. A sample outside the support of ``probs``
    gives 0.
    """
    from scipy import stats

    total = sum(counts.values())
    if total == 0:
        raise ValueError("chisquare_pvalue: no samples")
    if any(c > 0 and probs.get(k, 0.0) <= 0 for k, c in counts.items()):
        return 0.0
    keys = sorted(probs, key=lambda k: probs[k])  # ascending expected count
    expected = np.array([probs[k] for k in keys], np.float64)
    expected = expected / expected.sum() * total
    observed = np.array([counts.get(k, 0) for k in keys], np.float64)
    # pool the smallest cells together until the pool is large enough
    cut = 0
    pooled = 0.0
    while cut < len(keys) and (expected[cut] < min_expected or 0 < pooled < min_expected):
        pooled += expected[cut]
        cut += 1
    f_exp = list(expected[cut:])
    f_obs = list(observed[cut:])
    if cut:
        f_exp.insert(0, pooled)
        f_obs.insert(0, observed[:cut].sum())
    if len(f_exp) < 2:
        return 1.0
    return float(stats.chisquare(f_obs, f_exp).pvalue)
