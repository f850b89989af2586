"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) for :class:`~.transformer.HFDecoder`.

A router (``h @ router``, softmax in float32) picks each token's ``top_k`` experts; their
weights are the chosen probabilities, renormalized to sum to 1 where the family does (Mixtral,
``norm_topk_prob``). Each expert is a gated MLP ``down(act(gate h) * up h)``; the layer's output
is the weighted sum of the chosen experts' outputs, plus Qwen2-MoE's shared expert times
``sigmoid(h @ shared_gate)``.

Two ways to compute it, chosen by the number of tokens ``N`` of the call (a static shape):

- ``gather`` (decode steps, few tokens): for each token and each of its chosen experts, that
  expert's matrices are sliced out (``dynamic_slice`` on the expert axis: contiguous, no gather
  of scattered rows) and multiplied: a step reads ``top_k`` experts, not all;
- ``dense`` (prefill, many tokens): every expert runs on every token and the outputs are
  combined with weights that are zero off the chosen experts: no gather, but ``experts / top_k``
  times the arithmetic. It wins once ``N * top_k`` reaches about ``GATHER_LIMIT * experts``
  (docs/benchmarks.md, "Mixture of experts").

Parameters of a layer (``E`` experts, ``F`` the expert width)::

    router [d, E]; e_gu [E, 2F, d] (each expert's gate rows, then its up rows, as stored);
    e_down [E, F, d]; s_gate, s_up [d, Fs], s_down [Fs, d], s_router [d, 1] (shared expert only)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# gather while N * top_k < GATHER_LIMIT * experts (measured: docs/benchmarks.md)
GATHER_LIMIT = 1.0


def route(cfg, p, x):
    """``(weights [N, k] in x's dtype, experts [N, k] int32)`` for tokens ``x [N, d]``."""
    logits = jnp.einsum("nd,de->ne", x, p["router"], preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top, idx = jax.lax.top_k(probs, cfg.top_k)
    if cfg.norm_topk:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(x.dtype), idx


def gathered(p, x, weights, idx, act):
    """Only the chosen experts: each sliced out of the stacked matrices, token by token."""
    F = p["e_down"].shape[1]
    rows = []
    for n in range(x.shape[0]):
        out = jnp.zeros_like(x[n])
        for j in range(idx.shape[1]):
            gu = jax.lax.dynamic_index_in_dim(p["e_gu"], idx[n, j], 0, keepdims=False) @ x[n]  # [2F]
            mid = act(gu[:F]) * gu[F:] * weights[n, j]
            out = out + mid @ jax.lax.dynamic_index_in_dim(p["e_down"], idx[n, j], 0, keepdims=False)
        rows.append(out)
    return jnp.stack(rows)


def dense(p, x, weights, idx, act):
    """Every expert on every token, combined with zero weight off the chosen ones."""
    E, F = p["e_down"].shape[:2]
    combine = jnp.sum(jax.nn.one_hot(idx, E, dtype=x.dtype) * weights[:, :, None], axis=1)  # [N, E]
    gu = jnp.einsum("nd,efd->nef", x, p["e_gu"])
    mid = act(gu[..., :F]) * gu[..., F:] * combine[:, :, None]
    return jnp.einsum("nef,efd->nd", mid, p["e_down"])


def use_gather(cfg, n_tokens: int) -> bool:
    return n_tokens * cfg.top_k < GATHER_LIMIT * cfg.experts


def moe_mlp(cfg, p, h, act, how: str | None = None):
    """The mixture on ``h [B, S, d]`` -> ``[B, S, d]``; ``how``: "gather" or "dense" (default: by
    the number of tokens)."""
    B, S, d = h.shape
    x = h.reshape(B * S, d)
    weights, idx = route(cfg, p, x)
    how = how or ("gather" if use_gather(cfg, B * S) else "dense")
    out = (gathered if how == "gather" else dense)(p, x, weights, idx, act)
    if "s_gate" in p:
        shared = (act(x @ p["s_gate"]) * (x @ p["s_up"])) @ p["s_down"]
        gate = jax.nn.sigmoid(jnp.einsum("nd,do->no", x, p["s_router"], preferred_element_type=jnp.float32))
        out = out + gate.astype(x.dtype) * shared
    return out.reshape(B, S, d)


__all__ = ["GATHER_LIMIT", "dense", "gathered", "moe_mlp", "route", "use_gather"]
