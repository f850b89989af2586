"""Every Hugging Face family as one decoder behind the decoding-model interface.

:class:`HFDecoder` is a decoder-only transformer in plain ``jax.numpy`` whose variants are fields
of its :class:`~.config.HFConfig` (which family sets which: :mod:`.families`; each family's
variants: ``docs/huggingface.md``, What is supported):

- the Llama line: RMSNorm (in float32; Gemma's ``* (1 + w)``), rotary positions (rotate-half,
  with scaling, local bases, partial dimensions), grouped-query attention, optional soft-capping
  and q/k norms, a sliding window per layer (a query at ``i`` sees keys at ``i - W < j <= i``), a
  gated MLP or a mixture of experts (:mod:`.moe`), and the norms, multipliers and output
  variants of its families;
- GPT-2: LayerNorm, learned positions, a ``gelu_new`` MLP with biases, tied output.

The cache is ``k``, ``v``: per layer ``[B, KV, capacity, hd]`` (keys after rotation), and the rows'
lengths: a query reads only positions below its own, so whatever lies at or past a row's length
is never read before it is written (truncating is setting lengths). Past the window ``T``
(``max_position_embeddings``) the loops call :meth:`HFDecoder.window`, a forward over each row's
last ``T`` tokens numbered from 0. Compute runs in the parameters' dtype (float32 by default,
bfloat16 for accelerators), with norms, softmax and logits in float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.models.base import (
    DecodingModel,
    PagedKV,
    PagedPool,
    added_positions,
    empty_blocks,
    gather_blocks,
    window_by_forward,
    write_blocks,
)
from jaxdecode.models.hf.config import HFConfig
from jaxdecode.models.hf.linear import fused_split, matmul
from jaxdecode.models.hf.moe import moe_mlp


class HFCache(NamedTuple):
    """The dense cache of :class:`HFDecoder` (every leaf batch-first)."""

    k: tuple  # L arrays [B, KV, capacity, hd]: rotated keys
    v: tuple  # L arrays [B, KV, capacity, hd]
    length: jax.Array  # [B] int32 positions filled per row


def _vec(v, ndim):
    """A ``[n]`` vector shaped to broadcast over the last axis of an ``ndim``-d array."""
    return v.reshape((1,) * (ndim - 1) + (-1,))


def inv_frequencies(cfg: HFConfig, local: bool = False) -> np.ndarray:
    """RoPE's inverse frequencies ``[rotary_dim / 2]`` (float32), with ``rope_scaling`` applied; of
    a sliding layer with its own base if ``local``."""
    hd = cfg.rotary_dim or cfg.head_dim
    if local and cfg.local_rope_theta is not None:
        return (1.0 / cfg.local_rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)).astype(np.float32)
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    s = cfg.scaling
    kind = s.get("rope_type")
    if kind == "linear":
        inv = inv / s["factor"]
    elif kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def _norm(cfg: HFConfig, x, w, b=None):
    x32 = x.astype(jnp.float32)
    if cfg.norm == "rms":
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + cfg.eps)
    else:
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + cfg.eps)
    if cfg.norm_offset:  # Gemma: times (1 + w) in float32, then to the compute dtype
        return (y * (1.0 + _vec(w, x.ndim).astype(jnp.float32))).astype(x.dtype)
    y = y.astype(x.dtype) * _vec(w, x.ndim)
    return y if b is None else y + _vec(b, x.ndim)


def _softcap(x, cap):
    return x if cap is None else cap * jnp.tanh(x / cap)


def _act(name: str, x):
    if name in ("silu", "swish"):
        return jax.nn.silu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "relu":
        return jax.nn.relu(x)
    return jax.nn.gelu(x, approximate=True)  # gelu_new, gelu_pytorch_tanh, gelu_fast


def check_room(length, S: int, C: int) -> None:
    """Raise ValueError unless ``S`` new positions fit a cache of capacity ``C`` after each row's
    ``length``: always from the static shapes, and from the lengths themselves where they are
    known (outside a traced program). A write past the end would not fail on its own:
    ``dynamic_update_slice`` moves it back inside, over the last positions."""
    if S > C:
        raise ValueError(f"extend: {S} new positions do not fit the cache's capacity of {C}")
    if isinstance(length, jax.core.Tracer):
        return
    filled = int(np.max(np.asarray(length), initial=0))
    if filled + S > C:
        raise ValueError(f"extend: a row holds {filled} positions, and {S} more exceed the cache's "
                         f"capacity of {C}")


@dataclasses.dataclass(frozen=True)
class HFDecoder(DecodingModel):
    """A Hugging Face decoder of shape ``cfg`` (hashable: a static argument of the loops' programs)."""

    cfg: HFConfig
    dtype: str = "float32"
    T_limit: int | None = None  # a smaller window than the config's, if asked for
    backend: str = "portable"  # "native": the parameters' matrices are packed for the CPU kernel (.linear)
    fuse: bool = True  # native: a layer of the Llama kind as one call (kernels.hf_layer), where it fits
    mesh: object = None  # the jax.sharding.Mesh its parameters are split over (.sharding), if any

    def _on_mesh(self, kv):
        """A KV cache leaf ``[B or blocks, KV, positions, hd]`` constrained to the mesh's layout
        (split by key/value head where k and v are, :mod:`.sharding`)."""
        if self.mesh is None:
            return kv
        from jaxdecode.models.hf.sharding import cache_sharding

        return jax.lax.with_sharding_constraint(kv, cache_sharding(self.cfg, self.mesh, kv.ndim))

    @property
    def V(self):
        return self.cfg.V

    @property
    def T(self):
        return self.cfg.T if self.T_limit is None else min(self.cfg.T, self.T_limit)

    @property
    def reads_only_filled(self):
        return False

    # --- pieces
    def _rope(self, x, pos, layer):
        """Rotate ``x [B, S, n, hd]`` to positions ``pos [B, S]`` (rotate-half, over the first
        ``rotary_dim`` of each head), with layer ``layer``'s base."""
        cfg = self.cfg
        inv = jnp.asarray(inv_frequencies(cfg, cfg.window(layer) is not None))  # [rd/2]
        angle = pos.astype(jnp.float32)[:, :, None] * inv[None, None, :]  # [B, S, rd/2]
        cos = jnp.concatenate([jnp.cos(angle)] * 2, axis=-1)[:, :, None, :]
        sin = jnp.concatenate([jnp.sin(angle)] * 2, axis=-1)[:, :, None, :]
        x32 = x.astype(jnp.float32)
        rd = 2 * inv.shape[0]
        xr, rest = x32[..., :rd], x32[..., rd:]
        half = rd // 2
        rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
        out = xr * cos + rotated * sin
        return (out if rd == x.shape[-1] else jnp.concatenate([out, rest], axis=-1)).astype(x.dtype)

    def _embed(self, params, tokens, pos):
        x = params["embed"][tokens].astype(self.dtype)  # (a matrix may be kept in another dtype)
        if self.cfg.embed_scale:  # Gemma: sqrt(d), rounded to the parameters' dtype as transformers does
            x = x * jnp.asarray(math.sqrt(self.cfg.d), x.dtype)
        if self.cfg.embed_multiplier != 1.0:  # Granite
            x = x * jnp.asarray(self.cfg.embed_multiplier, x.dtype)
        if self.cfg.positions == "learned":
            x = x + params["pos"][jnp.clip(pos, 0, self.cfg.T - 1)]
        return x

    def _qkv(self, p, x, pos, layer):
        cfg = self.cfg
        B, S, _ = x.shape
        h = x if cfg.layout == "post" else _norm(cfg, x, p["norm1_w"], p.get("norm1_b"))
        if "qkv" in p:  # fused on the native path (.linear)
            q, k, v = fused_split(cfg, matmul(h, p["qkv"]), "qkv")
        else:
            q, k, v = matmul(h, p["wq"]), matmul(h, p["wk"]), matmul(h, p["wv"])
        if "bq" in p:
            q, k, v = q + _vec(p["bq"], 3), k + _vec(p["bk"], 3), v + _vec(p["bv"], 3)
        if cfg.qk_norm == "all":
            q, k = _norm(cfg, q, p["q_norm"]), _norm(cfg, k, p["k_norm"])
        if cfg.clip_qkv is not None:
            q, k, v = (jnp.clip(a, -cfg.clip_qkv, cfg.clip_qkv) for a in (q, k, v))
        q = q.reshape(B, S, cfg.heads, cfg.head_dim)
        k = k.reshape(B, S, cfg.kv_heads, cfg.head_dim)
        v = v.reshape(B, S, cfg.kv_heads, cfg.head_dim)
        if cfg.qk_norm == "head":
            q, k = _norm(cfg, q, p["q_norm"]), _norm(cfg, k, p["k_norm"])
        if cfg.rotates(layer):
            q, k = self._rope(q, pos, layer), self._rope(k, pos, layer)
        return q, k, v  # [B, S, heads or KV, hd]

    def _attend(self, q, k, v, pos, kpos, layer):
        """q ``[B, S, H, hd]`` at positions ``pos [B, S]``; k/v ``[B, KV, K, hd]`` at ``kpos [K]``
        -> ``[B, S, H * hd]``. A query sees keys at or before its position (and within layer
        ``layer``'s sliding window)."""
        cfg = self.cfg
        B, S, H, hd = q.shape
        G = cfg.groups
        scale = cfg.scale
        if self.backend == "native" and cfg.window(layer) is None and cfg.attn_softcap is None:
            return self._attend_native(q, k, v, pos, scale)
        q = q.reshape(B, S, cfg.kv_heads, G, hd)
        scores = jnp.einsum("bskgh,bkth->bkgst", q, k, preferred_element_type=jnp.float32) * scale
        scores = _softcap(scores, cfg.attn_softcap)
        visible = kpos[None, None, :] <= pos[:, :, None]  # [B, S, K]
        window = cfg.window(layer)
        if window is not None:
            visible &= kpos[None, None, :] > pos[:, :, None] - window
        scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
        w = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgst,bkth->bskgh", w, v)
        return out.reshape(B, S, H * hd)

    def _attend_native(self, q, k, v, pos, scale):
        """:meth:`_attend` through the native kernel (keys at positions ``0..K-1``; no window or
        soft-capping): each row's keys and values read in place up to the query's position, the
        ``G`` query heads of a key/value head as ``G * S`` queries of it."""
        from jaxdecode.native import kernels

        B, S, H, hd = q.shape
        KV, G = self.cfg.kv_heads, self.cfg.groups
        qn = q.astype(jnp.float32).reshape(B, S, KV, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, KV, G * S, hd)
        lim = jnp.broadcast_to((pos + 1)[:, None, :], (B, G, S)).reshape(B, G * S).astype(jnp.int32)
        empty = jnp.zeros((B * KV, 0, hd), jnp.float32)
        out = kernels.attention(qn, k.astype(jnp.float32), v.astype(jnp.float32), lim, empty, empty,
                                jnp.zeros_like(lim), scale)
        out = out.reshape(B, KV, G, S, hd).transpose(0, 3, 1, 2, 4).reshape(B, S, H * hd)
        return out.astype(q.dtype)

    def _finish(self, p, x, att, layer):
        cfg = self.cfg
        a = matmul(att, p["wo"]) + (_vec(p["bo"], 3) if "bo" in p else 0)
        x = x + self._residual(a if cfg.layout == "pre" else _norm(cfg, a, p["norm_pa"]))
        h = x if cfg.layout == "post" else _norm(cfg, x, p["norm2_w"], p.get("norm2_b"))
        if cfg.is_moe(layer):
            out = moe_mlp(cfg, p, h, lambda z: _act(cfg.act, z))
        else:
            if "gu" in p:  # fused on the native path (.linear)
                gate, up = fused_split(cfg, matmul(h, p["gu"]), "gu")
            else:
                up = matmul(h, p["w_up"])
                gate = matmul(h, p["w_gate"]) if cfg.mlp == "gated" else None
            up = up + (_vec(p["b_up"], 3) if "b_up" in p else 0)
            if cfg.mlp == "gated":
                gate = gate + (_vec(p["b_gate"], 3) if "b_gate" in p else 0)
                mid = _act(cfg.act, gate) * up
            else:
                mid = _act(cfg.act, up)
            out = matmul(mid, p["w_down"]) + (_vec(p["b_down"], 3) if "b_down" in p else 0)
        return x + self._residual(out if cfg.layout == "pre" else _norm(cfg, out, p["norm_pf"]))

    def _residual(self, y):
        """A block's output as added to the residual stream (Granite's residual multiplier)."""
        m = self.cfg.residual_multiplier
        return y if m == 1.0 else y * jnp.asarray(m, y.dtype)

    def _head(self, params, x):
        hidden = _norm(self.cfg, x, params["norm_w"], params.get("norm_b"))
        if "head" in params:
            logits = matmul(hidden, params["head"], jnp.float32)
        else:
            logits = jnp.einsum("bsd,vd->bsv", hidden, params["embed"], preferred_element_type=jnp.float32)
        if self.cfg.logits_scaling != 1.0:  # Granite
            logits = logits / self.cfg.logits_scaling
        return _softcap(logits, self.cfg.final_softcap), hidden.astype(jnp.float32)

    # --- the full forward
    def forward(self, params, tokens):
        """Tokens ``[B, t]`` -> ``(logits [B, t, V], hidden [B, t, d])``, positions from 0."""
        tokens = jnp.asarray(tokens, jnp.int32)
        B, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (B, t))
        x = self._embed(params, tokens, pos)
        for i, p in enumerate(params["layers"]):
            q, k, v = self._qkv(p, x, pos, i)
            att = self._attend(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), pos, pos[0], i)
            x = self._finish(p, x, att, i)
        return self._head(params, x)

    def __call__(self, params, tokens):
        return self.forward(params, tokens)

    # --- the decoding-model interface
    def empty_cache(self, batch, capacity):
        cfg = self.cfg
        shape = (batch, cfg.kv_heads, capacity, cfg.head_dim)
        zeros = lambda: tuple(self._on_mesh(jnp.zeros(shape, self.dtype)) for _ in range(cfg.L))
        return HFCache(zeros(), zeros(), jnp.zeros((batch,), jnp.int32))  # separate buffers: donatable

    def capacity(self, cache):
        return cache.k[0].shape[2]

    def extend(self, params, cache, tokens, span=None, in_place=True):
        x, cache = self._through_layers(params, cache, tokens, span)
        logits, hidden = self._head(params, x)
        return logits, hidden, cache

    def _through_layers(self, params, cache, tokens, span=None):
        """The new positions through every layer: their last hidden states (before the final norm)
        and the cache holding them."""
        tokens = jnp.asarray(tokens, jnp.int32)
        B, S = tokens.shape
        C = self.capacity(cache)
        check_room(cache.length, S, C)
        span = C if span is None else min(span, C)
        pos = cache.length[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]  # [B, S]
        x = self._embed(params, tokens, pos)
        write = jax.vmap(lambda buf, new, at: jax.lax.dynamic_update_slice(buf, new, (0, at, 0)))
        kpos = jnp.arange(span, dtype=jnp.int32)
        ks, vs = [], []
        turns = {}  # the rotation at pos, once per base, for the fused layers
        for i, (p, kc, vc) in enumerate(zip(params["layers"], cache.k, cache.v)):  # kc, vc [B, KV, C, hd]
            if self._fusable(p, i, kc, vc):
                x, kc, vc = self._fused(p, x, pos, i, kc, vc, turns)
                ks.append(kc)
                vs.append(vc)
                continue
            q, k, v = self._qkv(p, x, pos, i)
            kc = write(kc, k.transpose(0, 2, 1, 3).astype(kc.dtype), cache.length)
            vc = write(vc, v.transpose(0, 2, 1, 3).astype(vc.dtype), cache.length)
            att = self._attend(q, kc[:, :, :span], vc[:, :, :span], pos, kpos, i)
            x = self._finish(p, x, att, i)
            ks.append(kc)
            vs.append(vc)
        return x, HFCache(tuple(ks), tuple(vs), cache.length + S)

    def _fusable(self, p, layer, kc, vc) -> bool:
        """Whether layer ``layer`` runs as one native call (:func:`~jaxdecode.native.kernels.hf_layer`):
        of a family whose entry says the fused layer covers it (``native_layer``), a pre-norm
        RMSNorm layer with full rotate-half rotation or none (over a sliding window or not), a
        SiLU-gated MLP, at most q/k/v biases and per-head q/k norms, no residual multiplier, its
        four matrices packed in one dtype, over a float32 cache. Any other layer takes the
        product-by-product path below, which is the same computation."""
        cfg = self.cfg
        mats = [p.get(k) for k in ("qkv", "wo", "gu", "w_down")]
        return (self.backend == "native" and self.fuse and cfg.native_layer and cfg.residual_multiplier == 1.0
                and jnp.dtype(self.dtype) == jnp.float32
                and kc.dtype == jnp.float32 and vc.dtype == jnp.float32
                and cfg.layout == "pre" and cfg.norm == "rms" and not cfg.norm_offset
                and cfg.mlp == "gated" and cfg.act in ("silu", "swish") and cfg.positions == "rope"
                and (cfg.rotary_dim or cfg.head_dim) == cfg.head_dim
                and cfg.attn_softcap is None and cfg.clip_qkv is None and cfg.qk_norm in ("", "head")
                and not cfg.is_moe(layer) and cfg.head_dim % 2 == 0
                and all(isinstance(w, dict) and "packed" in w for w in mats)
                and len({w["packed"].dtype for w in mats}) == 1
                and not any(k in p for k in ("bo", "b_up", "b_gate", "b_down", "norm1_b", "norm2_b")))

    def _fused(self, p, x, pos, layer, kc, vc, turns):
        """Layer ``layer`` as one native call; ``turns`` caches the rotation's cos and sin at ``pos``
        (a layer without rotation turns by 0: cos 1, sin 0)."""
        from jaxdecode.native import kernels

        cfg = self.cfg
        window = cfg.window(layer)
        local = window is not None and cfg.local_rope_theta is not None
        key = local if cfg.rotates(layer) else "none"
        if key not in turns:
            inv = jnp.asarray(inv_frequencies(cfg, window is not None))
            angle = pos.astype(jnp.float32)[:, :, None] * inv[None, None, :]
            turns[key] = ((jnp.cos(angle), jnp.sin(angle)) if key != "none"
                          else (jnp.ones_like(angle), jnp.zeros_like(angle)))
        cos, sin = turns[key]
        w = dict(p)
        if "bq" in p:
            w["bqkv"] = jnp.concatenate([p["bq"], p["bk"], p["bv"]]).astype(jnp.float32)
        return kernels.hf_layer(x, pos, cos, sin, w, kc, vc, heads=cfg.heads, eps=cfg.eps,
                                scale=cfg.scale, window=window)

    def prefill(self, params, tokens, lengths, capacity):
        """:func:`~jaxdecode.models.base.prefill_by_extend`'s result, with the output layer computed
        at each row's last real token only (a vocabulary-wide product per prompt, not per token)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        B, P = tokens.shape
        if capacity < P:
            raise ValueError(f"prefill: capacity {capacity} is below the prompt width {P}")
        x, cache = self._through_layers(params, self.empty_cache(B, capacity), tokens, span=P)
        lengths = jnp.asarray(lengths, jnp.int32)
        last = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)  # [B, 1, d]
        logits, hidden = self._head(params, last)
        return logits[:, 0], hidden[:, 0], self.truncate(cache, lengths)

    def window(self, params, history, lengths):
        return window_by_forward(self.forward, self.T, params, history, lengths)

    def paged(self, block_size, attention="portable"):
        if attention not in ("portable", "native"):  # (native: its products; the attention is portable)
            raise NotImplementedError(f"{self.cfg.model_type} runs paged attention on the portable path "
                                      f"only, not {attention!r}")
        return HFPaged(self, int(block_size))

    def reorder(self, cache, rows, span=None):
        return jax.tree_util.tree_map(lambda a: jnp.take(a, rows, axis=0), cache)

    def truncate(self, cache, lengths):
        return cache._replace(length=jnp.asarray(lengths, jnp.int32))

    def grow(self, cache, capacity):
        pad = added_positions(self, cache, capacity)
        if pad == 0:
            return cache
        widths = ((0, 0), (0, 0), (0, pad), (0, 0))
        grow = lambda layers: tuple(jnp.pad(a, widths) for a in layers)
        return cache._replace(k=grow(cache.k), v=grow(cache.v))


@dataclasses.dataclass(frozen=True)
class HFPaged(PagedPool):
    """:class:`HFDecoder` on a block pool (a serving engine's paged cache): per layer, the new keys
    and values are written into the rows' blocks, then each query attends over its row's blocks
    gathered through the table (portable ``jax.numpy``)."""

    decoder: HFDecoder
    block_size: int = 16

    @property
    def V(self):
        return self.decoder.V

    @property
    def T(self):
        return self.decoder.T

    def empty_pool(self, num_blocks: int, dtype=None) -> PagedKV:
        if not isinstance(num_blocks, (int, np.integer)) or num_blocks < 1:
            raise ValueError(f"empty_pool: num_blocks must be a positive integer, got {num_blocks!r}")
        cfg = self.decoder.cfg
        pool = empty_blocks((int(num_blocks), cfg.kv_heads, self.block_size, cfg.head_dim), cfg.L,
                            dtype or self.decoder.dtype)
        return pool if self.decoder.mesh is None else jax.tree_util.tree_map(self.decoder._on_mesh, pool)

    def pool_forward(self, params, pool: PagedKV, tables, lengths, tokens, counts=None,
                     cols: int | None = None):
        d = self.decoder
        tables = jnp.asarray(tables, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        tokens = jnp.asarray(tokens, jnp.int32)
        B, S = tokens.shape
        counts = jnp.full((B,), S, jnp.int32) if counts is None else jnp.asarray(counts, jnp.int32)
        cols = tables.shape[1] if cols is None else min(int(cols), tables.shape[1])
        pos = lengths[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]  # [B, S]
        valid = jnp.arange(S)[None, :] < counts[:, None]
        kpos = jnp.arange(cols * self.block_size, dtype=jnp.int32)
        x = d._embed(params, tokens, pos)
        ks, vs = [], []
        for i, p in enumerate(params["layers"]):
            q, k, v = d._qkv(p, x, pos, i)
            kp = write_blocks(pool.k[i], k.transpose(0, 2, 1, 3), tables, pos, valid)
            vp = write_blocks(pool.v[i], v.transpose(0, 2, 1, 3), tables, pos, valid)
            keys, values = (gather_blocks(a, tables[:, :cols], d.dtype) for a in (kp, vp))
            att = d._attend(q, keys, values, pos, kpos, i)
            x = d._finish(p, x, att, i)
            ks.append(kp)
            vs.append(vp)
        logits, hidden = d._head(params, x)
        return logits, hidden, PagedKV(tuple(ks), tuple(vs))


__all__ = ["HFCache", "HFDecoder", "HFPaged", "inv_frequencies"]
