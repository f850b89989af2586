"""The decoder's weight matrices as they are kept in memory, and the one product that reads them.

A decode step at a small batch is bound by reading the weights, so how they are kept decides its
speed. ``weights`` (``load(..., weights=...)``, ``--weights``) chooses for the matrices of the
attention, the MLP and the output layer: ``"auto"`` (``"stored"`` on the native CPU path,
``"float32"`` on the portable one), ``"float32"``, ``"stored"``, ``"bfloat16"``, ``"int8"``
(symmetric, one float32 scale per output column: ``W[:, n] = Q[:, n] * s[n]``) or ``"int4"``
(symmetric groups of 32 along the input, one float16 scale per group and column: llama.cpp's
Q4_0 rounding; int8 where the input is not a multiple of 32). Norms, biases, the router and the
experts stay in the compute dtype. Each choice, its held-out loss and why int4 is symmetric:
``docs/huggingface.md`` (Precisions and GGUF files).

A matrix is one of these leaves of the parameter tree, and :func:`matmul` dispatches on which:

- an array ``[K, N]`` (any float dtype): ``x @ W``, widened to ``x``'s dtype;
- ``{"q": int8 [K, N], "scale": [N]}``: the portable int8 product ``(x @ Q) * s``;
- ``{"q4": int4 [K, N], "scale": float16 [K / 32, N]}``: the portable int4 product (XLA's 4-bit type);
- ``{"packed": [N / 16, K, 16], "scale"?}``: the native CPU kernel
  (:func:`jaxdecode.native.kernels.linear`; int4 packed by :func:`jaxdecode.native.kernels.pack4`),
  where q, k and v are one matrix (``qkv``), and so are the MLP's gate and up (``gu``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

WEIGHTS = ("auto", "float32", "stored", "bfloat16", "int8", "int4")
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
STORED = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
FUSED = {"qkv": ("wq", "wk", "wv"), "gu": ("w_gate", "w_up")}


def quantize(w) -> tuple[np.ndarray, np.ndarray]:
    """``w`` ``[K, N]`` -> ``(q int8 [K, N], scale float32 [N])`` with ``w ≈ q * scale``, one
    symmetric scale per column (a column of zeros gets scale 1)."""
    w = np.asarray(w, np.float32)
    scale = np.abs(w).max(axis=0) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


GROUP = 32  # int4: the weights along the input dimension that share one scale


def quantize4(w, zero_point: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``w`` ``[K, N]`` (``K`` a multiple of :data:`GROUP`) -> ``(u uint8 [K, N] in 0..15, scale
    float16 [K / 32, N], low float16 [K / 32, N] or None)``, each group of 32 weights along ``K``
    of a column with its own scale: ``w ≈ (u - 8) * scale`` (symmetric: the group's weight of
    largest magnitude is ``-8 * scale`` exactly, llama.cpp's Q4_0 rounding), or with
    ``zero_point`` ``w ≈ u * scale + low`` (the group's least weight is ``low``, its greatest
    ``15 * scale + low``: llama.cpp's Q4_1). The scales are rounded to float16 first and the
    weights rounded against the rounded scales."""
    w = np.asarray(w, np.float32)
    K, N = w.shape
    if K % GROUP:
        raise ValueError(f"int4 weights need an input dimension that is a multiple of {GROUP}, got {K}")
    g = w.reshape(K // GROUP, GROUP, N)
    if zero_point:
        lo, hi = g.min(axis=1), g.max(axis=1)
        scale = ((hi - lo) / 15).astype(np.float16)
        low = lo.astype(np.float16)
        s32 = scale.astype(np.float32)
        inv = np.divide(1.0, s32, out=np.zeros_like(s32), where=s32 > 0)
        u = np.clip(np.rint((g - low.astype(np.float32)[:, None]) * inv[:, None]), 0, 15)
        return u.astype(np.uint8).reshape(K, N), scale, low
    idx = np.abs(g).argmax(axis=1)
    extreme = np.take_along_axis(g, idx[:, None], axis=1)[:, 0]  # signed, of largest magnitude
    scale = (extreme / -8).astype(np.float16)
    s32 = scale.astype(np.float32)
    inv = np.divide(1.0, s32, out=np.zeros_like(s32), where=s32 != 0)
    u = np.clip(np.rint(g * inv[:, None]) + 8, 0, 15)
    return u.astype(np.uint8).reshape(K, N), scale, None


def dequantize4(u, scale, low=None) -> np.ndarray:
    """The float32 matrix ``[K, N]`` of :func:`quantize4`'s output."""
    u = np.asarray(u)
    s = np.repeat(np.asarray(scale, np.float32), GROUP, axis=0)
    if low is None:
        return (u.astype(np.float32) - 8) * s
    return u.astype(np.float32) * s + np.repeat(np.asarray(low, np.float32), GROUP, axis=0)


def matmul(h, w, out_dtype=None):
    """``h [..., K] @ W -> [..., N]`` for a matrix kept in any of the module's forms, in
    ``out_dtype`` (default ``h``'s dtype)."""
    out_dtype = out_dtype or h.dtype
    if isinstance(w, dict):
        if "packed" in w:
            from jaxdecode.native import kernels

            return kernels.linear(h.astype(jnp.float32), w["packed"], w.get("scale")).astype(out_dtype)
        if "q4" in w:
            K, N = w["q4"].shape
            s = w["scale"].astype(h.dtype)
            wide = (w["q4"].astype(h.dtype).reshape(K // GROUP, GROUP, N) * s[:, None, :]).reshape(K, N)
            return jnp.matmul(h, wide, preferred_element_type=jnp.float32).astype(out_dtype)
        y = jnp.matmul(h, w["q"].astype(h.dtype), preferred_element_type=jnp.float32)
        return (y * w["scale"].reshape((1,) * (y.ndim - 1) + (-1,))).astype(out_dtype)
    return jnp.matmul(h, w if w.dtype == h.dtype else w.astype(h.dtype), preferred_element_type=out_dtype)


def mode(weights: str, native: bool) -> str:
    """The concrete mode of ``weights`` (``"auto"`` resolved for the path)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "auto":
        return "stored" if native else "float32"
    return weights


def _kept(a, how: str, stored: str, native: bool):
    """Matrix ``a`` ``[K, N]`` (numpy float32) in mode ``how``."""
    if how == "int4" and a.shape[0] % GROUP == 0:
        u, scale, _ = quantize4(a)
        return packed_int4(u, scale) if native and a.shape[1] % 16 == 0 else portable_int4(u, scale)
    if how in ("int8", "int4"):
        q, scale = quantize(a)
        return packed_int8({"q": q, "scale": jnp.asarray(scale)}) if native else \
            {"q": jnp.asarray(q), "scale": jnp.asarray(scale)}
    dtype = {"float32": None, "stored": stored, "bfloat16": "bfloat16"}[how]
    if native and a.shape[1] % 16 == 0:
        return {"packed": _packed(a.astype(jnp.dtype(dtype or jnp.float32)))}
    return jnp.asarray(a, dtype or jnp.float32)


def _packed(a) -> jnp.ndarray:
    """``a`` ``[K, N]`` packed for the native kernel, on the host (numpy: no program is compiled
    per shape, as XLA's reshape and transpose would; the rounding to bfloat16 is the same), and
    placed on huge pages (:mod:`jaxdecode.native.memory`)."""
    from jaxdecode.native import kernels, memory

    return memory.place(kernels.pack(np.asarray(a)))


def packed_int8(w: dict) -> dict:
    """A portable int8 matrix ``{"q", "scale"}`` (``q`` on the host or the device) packed for the
    native kernel (where its width allows: a multiple of 16 columns; else as it is)."""
    if w["q"].shape[1] % 16:
        return dict(w, q=jnp.asarray(w["q"]))
    return {"packed": _packed(w["q"]), "scale": w["scale"]}


def portable_int4(u, scale) -> dict:
    """The portable int4 matrix of :func:`quantize4`'s ``u`` (0..15) and ``scale``."""
    q = (np.asarray(u, np.int8) - 8).astype(jnp.int4)
    return {"q4": jnp.asarray(q), "scale": jnp.asarray(np.asarray(scale, np.float16))}


def packed_int4(u, scale) -> dict:
    """The native int4 matrix (:func:`jaxdecode.native.kernels.pack4`) of ``u`` (0..15) and ``scale``."""
    from jaxdecode.native import kernels, memory

    up, sp = kernels.pack4(u, scale)
    return {"packed": memory.place(up), "scale": jnp.asarray(sp)}


def prepare(params: dict, cfg, how: str, stored: str, native: bool) -> dict:
    """``params`` (as read, in float32) with their matrices kept in mode ``how``;
    ``stored``: the dtype the folder holds them in; ``native``: packed for the CPU kernel (q, k and
    v fused, gate and up fused). A tied output layer gets a matrix of its own (``head``,
    ``embed.T``) where the form differs from the embedding's array."""
    if how == "float32" and not native:
        return params
    layers = []
    for p in params["layers"]:
        p = dict(p)
        if native:
            for fused, parts in FUSED.items():
                if all(k in p for k in parts):
                    p[fused] = np.concatenate([np.asarray(p.pop(k), np.float32) for k in parts], axis=1)
        for k in (*MATRICES, *FUSED):
            if k in p:
                p[k] = _kept(np.asarray(p[k], np.float32), how, stored, native)
        layers.append(p)
    out = dict(params, layers=tuple(layers))
    head = params.get("head")
    if head is None and (native or how in ("int8", "int4")):
        head = np.asarray(params["embed"], np.float32).T
    if head is not None:
        out["head"] = _kept(np.asarray(head, np.float32), how, stored, native)
    if how in ("stored", "bfloat16"):
        out["embed"] = jnp.asarray(np.asarray(params["embed"], np.float32), stored if how == "stored" else how)
    return out


def fused_split(cfg, y, fused: str):
    """The parts of a fused product ``y`` (q, k, v or gate, up)."""
    if fused == "qkv":
        q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        return y[..., :q], y[..., q:q + kv], y[..., q + kv:]
    F = y.shape[-1] // 2
    return y[..., :F], y[..., F:]


__all__ = ["GROUP", "MATRICES", "STORED", "WEIGHTS", "dequantize4", "fused_split", "matmul", "mode",
           "packed_int4", "packed_int8", "portable_int4", "prepare", "quantize", "quantize4"]
