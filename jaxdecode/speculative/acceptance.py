"""The acceptance test of speculative sampling and its noise: pure functions on arrays.

Randomness: row ``r`` draws all the noise of iteration ``i`` (one uniform per draft token, per
acceptance test and for the corrected token; fixed entries per position) from
``fold_in(fold_in(key, r), i)`` (:func:`iteration_noise`). A row's output therefore depends only
on the user key, its row id and its own history, never on its batch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxdecode.decoding.common import row_keys  # noqa: F401 (re-exported)


def take_at(x, idx):
    """``x[b, j, idx[b, j]]`` for ``x`` ``[B, S, V]`` and ``idx`` ``[B, S]``."""
    return jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]


class Noise(NamedTuple):
    """The randomness of one iteration, for every row (one uniform draw per row and iteration).
    Every entry is uniform in (0, 1); tokens are drawn by inverting the CDF (:func:`draw_token`)."""

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


def draw_token(weights, u):
    """Token ``[B]`` drawn from unnormalized non-negative ``weights`` ``[B, V]`` by inverting the
    CDF with ``u`` ``[B]`` uniform in (0, 1): the first token whose cumulative weight reaches
    ``u`` times the total. That token always has positive weight (the cumulative weight before it
    is below ``u * total > 0``, and ``u * total`` cannot round above the total). One uniform per
    token instead of a Gumbel per vocabulary entry: the noise was most of a draft's cost."""
    cdf = jnp.cumsum(weights, axis=-1)
    return jnp.sum(cdf < u[:, None] * cdf[:, -1:], axis=-1).astype(jnp.int32)


def pick_token(processed, u):
    """One token per row from processed logits ``[B, V]``: a draw from ``softmax(logits)`` with
    uniforms ``u`` ``[B]`` (:func:`draw_token`), or the argmax if ``u`` is ``None``."""
    if u is None:
        return jnp.argmax(processed, axis=-1).astype(jnp.int32)
    return draw_token(jnp.exp(processed - jnp.max(processed, axis=-1, keepdims=True)), u)


def accept_with_noise(p, q, draft, noise: Noise | None, greedy: bool):
    """:func:`accept` with the iteration's ``noise`` (unused when ``greedy``)."""
    B, G = draft.shape
    rows = jnp.arange(B)
    p_draft = p[:, :G]  # [B, G, V] the target at the proposed positions
    if greedy:
        ok = draft == jnp.argmax(p_draft, axis=-1)
    else:
        # accept with probability min(1, p/q): u < p/q, written without the division
        ok = noise.accept * take_at(q, draft) < take_at(p_draft, draft)
    n_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [B]
    p_next = p[rows, n_accepted]  # [B, V] the target where the row stops
    if greedy:
        return n_accepted, jnp.argmax(p_next, axis=-1).astype(jnp.int32)
    q_next = q[rows, jnp.minimum(n_accepted, G - 1)]
    residual = jnp.maximum(p_next - q_next, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # after a rejection the normalized residual (its mass is positive whenever a rejection can
    # happen); after all accepted, the target's own next distribution (draw_token normalizes)
    rejected = (n_accepted < G)[:, None] & (mass > 0)
    return n_accepted, draw_token(jnp.where(rejected, residual, p_next), noise.final)


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
    return accept_with_noise(p, q, draft, noise, greedy)
