"""The reference character transformer, ported to Flax, with a KV-cached decoding path.

Semantics follow the PyTorch ``CharLM`` exactly: token plus learned position embeddings, ``L``
pre-norm encoder layers (``x + SA(LN1(x))`` then ``x + FF(LN2(x))``, FF = ``d -> 4d -> d`` with
exact-erf GELU), causal attention, a final LayerNorm (eps 1e-5) and an output layer tied to the
token embedding. Its forward keeps only the last ``T`` tokens and numbers their positions
``0 .. t-1``.

Three entry points, all pure functions of ``params``:

- :func:`forward` -- a whole window, for training and scoring;
- :func:`prefill` -- a right-padded batch of prompts of different lengths into a :class:`KVCache`;
- :func:`extend` / :func:`step` -- append ``S`` (or one) tokens per row to the cache.

Up to ``T`` tokens the cache gives the same logits as :func:`forward`. Past ``T`` the book's model
sees a different window (with shifted positions) at every step; :func:`window_logits` computes that
exactly with a forward over the last ``T`` tokens of each row.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxdecode.native import kernels

LN_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a CharLM: vocabulary ``V``, window ``T``, width ``d``, layers ``L``, heads."""

    V: int
    T: int
    d: int
    L: int
    heads: int

    def __post_init__(self):
        for name in ("V", "T", "d", "L", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config field {name!r} must be a positive integer, got {value!r}")
        if self.d % self.heads:
            raise ValueError(f"config: d={self.d} is not divisible by heads={self.heads}")

    @property
    def head_dim(self) -> int:
        return self.d // self.heads

    def num_params(self) -> int:
        d, L = self.d, self.L
        per_layer = 3 * d * d + 3 * d + d * d + d + 2 * 4 * d * d + 4 * d + d + 4 * d
        return self.V * d + self.T * d + L * per_layer + 2 * d


class KVCache(NamedTuple):
    """Keys and values of every layer, and how many positions of each row are filled.

    ``k[l]``, ``v[l]``: ``[B, heads, capacity, head_dim]``; ``length``: ``[B]`` int32. Entries at
    or beyond ``length[b]`` are garbage and never attended to, so rolling a row back is just
    lowering its length.
    """

    k: tuple
    v: tuple
    length: jax.Array

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]


def _init(std):
    return nn.initializers.normal(stddev=std)


def attend(q, segments, scale: float):
    """Softmax attention of ``q`` ``[B, H, S, D]`` over several ``(k, v, visible)`` segments at once
    (one softmax over all of them), ``k, v`` ``[B, H, T, D]`` or flattened ``[B * H, T, D]``,
    ``visible`` broadcastable to ``[B, H, S, T]`` (bool). The model's one attention: the training
    forward attends over one causal segment; a decode pass over the cache, a chunk buffer and its
    own new positions, without concatenating (copying) the cache. A flattened segment is read as
    it is stored: reshaping a loop-carried buffer that is also updated makes XLA copy it."""
    B, H, S, D = q.shape
    qf = q.reshape(B * H, S, D)

    def scores(k):
        if k.ndim == 3:
            return jnp.einsum("nsd,ntd->nst", qf, k).reshape(B, H, S, k.shape[1])
        return jnp.einsum("bhsd,bhtd->bhst", q, k)

    def mix(w, v):
        if v.ndim == 3:
            return jnp.einsum("nst,ntd->nsd", w.reshape(B * H, S, -1), v).reshape(B, H, S, D)
        return jnp.einsum("bhst,bhtd->bhsd", w, v)

    parts = [jnp.where(ok, scores(k) * scale, -jnp.inf) for k, _, ok in segments]
    w = jax.nn.softmax(jnp.concatenate(parts, axis=-1), axis=-1)
    out, at = 0.0, 0
    for part, (_, v, _) in zip(parts, segments):
        T = part.shape[-1]
        out = out + mix(w[..., at:at + T], v)
        at += T
    return out


def visible_below(n: int, limit):
    """``[B, 1, S, n]`` bool: position ``t < limit[b, s]`` (``limit`` ``[B, S]``)."""
    return (jnp.arange(n)[None, None, :] < limit[:, :, None])[:, None]


def write_rows(buf, new, at):
    """``new`` ``[B, H, S, hd]`` into ``buf`` (``[B, H, C, hd]``, or ``[B * H, L, hd]``) at each row's
    position ``at`` ``[B]`` (moved back to fit, as ``dynamic_update_slice`` does)."""
    B, H, _, D = new.shape
    flat = buf.reshape(B, H, -1, D)
    put = jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice(c, n, (0, i, 0)))
    return put(flat, new.astype(buf.dtype), at).reshape(buf.shape)


def _dense(layer: nn.Dense, x, native: bool):
    """``layer(x)``; on the native backend for a few rows, a native product (packed weights when
    the caller passed them, see :func:`pack_params`)."""
    if not native:
        return layer(x)
    v = layer.variables
    p = v["params"]
    rows = math.prod(x.shape[:-1])
    if "packed" in v and kernels.DENSE_MAX_ROWS < rows <= kernels.PACKED_MAX_ROWS:
        return kernels.packed_dense(x, v["packed"]["kernel"], p["bias"])
    if rows <= kernels.DENSE_MAX_ROWS and p["kernel"].shape[1] % 8 == 0:
        return kernels.dense(x, p["kernel"], p["bias"])
    return layer(x)


class Attention(nn.Module):
    cfg: ModelConfig
    native: bool = False

    def setup(self):
        d = self.cfg.d
        self.qkv = nn.Dense(3 * d, kernel_init=_init(0.02), name="qkv")
        self.proj = nn.Dense(d, kernel_init=_init(0.02 / math.sqrt(2 * self.cfg.L)), name="proj")

    def heads(self, x):  # [B, S, d] -> q, k, v each [B, H, S, hd]
        B, S, _ = x.shape
        qkv = _dense(self.qkv, x, self.native).reshape(B, S, 3, self.cfg.heads, self.cfg.head_dim)
        q, k, v = (jnp.transpose(qkv[:, :, i], (0, 2, 1, 3)) for i in range(3))
        return q, k, v

    def merge(self, out):  # [B, H, S, hd] -> proj([B, S, d])
        B, H, S, hd = out.shape
        return _dense(self.proj, jnp.transpose(out, (0, 2, 1, 3)).reshape(B, S, H * hd), self.native)

    def __call__(self, x, segments=()):
        """Attention of the new positions ``x`` ``[B, S, d]`` over ``segments`` (cached keys and
        values with their visibility) and, causally, over themselves. Returns the output and the
        new positions' keys and values ``[B, H, S, hd]``."""
        q, k, v = self.heads(x)
        S = x.shape[1]
        causal = jnp.tril(jnp.ones((S, S), bool))[None, None]
        out = attend(q, [*segments, (k, v, causal)], 1.0 / math.sqrt(self.cfg.head_dim))
        return self.merge(out), (k, v)


class Block(nn.Module):
    """A pre-norm encoder layer: ``x + SA(LN1(x))``, then ``+ FF(LN2(.))``."""

    cfg: ModelConfig
    native: bool = False

    def setup(self):
        d = self.cfg.d
        self.ln1 = nn.LayerNorm(epsilon=LN_EPS, name="ln1")
        self.attn = Attention(self.cfg, self.native, name="attn")
        self.ln2 = nn.LayerNorm(epsilon=LN_EPS, name="ln2")
        self.ff1 = nn.Dense(4 * d, kernel_init=_init(0.02), name="ff1")
        self.ff2 = nn.Dense(d, kernel_init=_init(0.02 / math.sqrt(2 * self.cfg.L)), name="ff2")

    def __call__(self, x, segments=()):
        a, kv = self.attn(self.ln1(x), segments)
        return self._ff_residual(x + a), kv

    def decode(self, x, k, v, lim, k2, v2, n2):
        """The layer for ``S`` new positions per row ``x`` ``[B, S, d]``: position ``s`` of row ``b``
        sees cache positions ``t < lim[b, s]`` of ``k, v`` ``[B, H, C, hd]``, buffer positions
        ``t < n2[b, s]`` of ``k2, v2`` ``[B * H, L, hd]`` and new positions ``0..s``. Returns the
        output and the new keys and values ``[B, H, S, hd]``. The portable code of
        :func:`jaxdecode.native.kernels.decode_layer`, which the native layer is tested against."""
        segments = [(k, v, visible_below(k.shape[2], lim))]
        if k2.shape[1]:
            segments.append((k2, v2, visible_below(k2.shape[1], n2)))
        return self(x, segments)

    def _fused(self, x):
        """The layer's weights for :func:`jaxdecode.native.kernels.decode_layer`, or None when this pass
        does not run as one native call (portable backend, no packed weights, too many rows)."""
        v = self.variables
        if not self.native or "packed" not in v or self.cfg.d % 16 or not kernels.fuses_rows(math.prod(x.shape[:-1])):
            return None
        p, pk = v["params"], v["packed"]
        return (p["ln1"]["scale"], p["ln1"]["bias"], pk["attn"]["qkv"]["kernel"], p["attn"]["qkv"]["bias"],
                pk["attn"]["proj"]["kernel"], p["attn"]["proj"]["bias"], p["ln2"]["scale"], p["ln2"]["bias"],
                pk["ff1"]["kernel"], p["ff1"]["bias"], pk["ff2"]["kernel"], p["ff2"]["bias"])

    def _ff_residual(self, x):
        return x + _dense(self.ff2, jax.nn.gelu(_dense(self.ff1, self.ln2(x), self.native), approximate=False),
                          self.native)

    def cached(self, x, k_cache, v_cache, length, span, in_place=True):
        """Append the new positions ``x`` to the cache at each row's ``length``; attend over the
        cache's first ``span`` positions (the portable path reads only those)."""
        B, S, _ = x.shape
        lim = jnp.broadcast_to(length[:, None], (B, S))
        none = jnp.zeros((B * self.cfg.heads, 0, self.cfg.head_dim), k_cache.dtype)
        n2 = jnp.zeros((B, S), jnp.int32)
        weights = self._fused(x)
        if weights is not None:
            if in_place:  # the new keys and values are written into the cache by the call itself
                return kernels.decode_layer(x, weights, k_cache, v_cache, lim, none, none, n2, eps=LN_EPS,
                                            write="cache")
            x, k, v = kernels.decode_layer(x, weights, k_cache, v_cache, lim, none, none, n2, eps=LN_EPS)
        elif self.native:  # the native attention reads the cache in place, new positions included
            q, k, v = self.attn.heads(self.ln1(x))
            k_cache, v_cache = write_rows(k_cache, k, length), write_rows(v_cache, v, length)
            seen = length[:, None] + 1 + jnp.arange(S)[None, :]  # query s sees up to its own position
            out = kernels.attention(q, k_cache, v_cache, seen, none, none, n2, 1.0 / math.sqrt(q.shape[3]))
            return self._ff_residual(x + self.attn.merge(out)), k_cache, v_cache
        else:
            x, (k, v) = self.decode(x, k_cache[:, :, :span], v_cache[:, :, :span], lim, none, none, n2)
        return x, write_rows(k_cache, k, length), write_rows(v_cache, v, length)

    def cached_kv(self, x, k_cache, v_cache, length):
        """Only what the cache needs from this layer: its keys and values of ``x``, written."""
        _, k, v = self.attn.heads(self.ln1(x))
        return write_rows(k_cache, k, length), write_rows(v_cache, v, length)

    def chunked(self, x, k_main, v_main, main_len, k_loc, v_loc, i):
        """One decode step (``x`` ``[B, 1, d]``) that reads the main cache and writes its keys into
        the chunk buffer at index ``i`` (see :func:`chunk_step`)."""
        B = x.shape[0]
        lim = main_len[:, None]
        n2 = jnp.full((B, 1), i, jnp.int32)
        weights = self._fused(x)
        if weights is not None:
            return kernels.decode_layer(x, weights, k_main, v_main, lim, k_loc, v_loc, n2, eps=LN_EPS,
                                        write="buffer")
        if self.native:
            q, k, v = self.attn.heads(self.ln1(x))
            H, D = q.shape[1], q.shape[3]
            k_loc = jax.lax.dynamic_update_slice(k_loc, k.reshape(B * H, 1, D), (0, i, 0))
            v_loc = jax.lax.dynamic_update_slice(v_loc, v.reshape(B * H, 1, D), (0, i, 0))
            out = kernels.attention(q, k_main, v_main, lim, k_loc, v_loc, n2 + 1, 1.0 / math.sqrt(D))
            return self._ff_residual(x + self.attn.merge(out)), k_loc, v_loc
        # portable: write the new keys first, then attend over the cache and the buffer up to and
        # including them. Reading the buffer before writing it would make XLA copy the buffer
        # (both the old and the new value would be live) every step.
        q, k, v = self.attn.heads(self.ln1(x))
        H, D = q.shape[1], q.shape[3]
        k_loc = jax.lax.dynamic_update_slice(k_loc, k.reshape(B * H, 1, D).astype(k_loc.dtype), (0, i, 0))
        v_loc = jax.lax.dynamic_update_slice(v_loc, v.reshape(B * H, 1, D).astype(v_loc.dtype), (0, i, 0))
        out = attend(q, [(k_main, v_main, visible_below(k_main.shape[2], lim)),
                         (k_loc, v_loc, visible_below(k_loc.shape[1], n2 + 1))], 1.0 / math.sqrt(D))
        return self._ff_residual(x + self.attn.merge(out)), k_loc, v_loc


class CharLM(nn.Module):
    """The Flax module; use the functions below rather than calling it directly. ``native``
    selects the backend of the decode paths (see :mod:`jaxdecode.native.kernels`); the training forward
    is the same on both."""

    cfg: ModelConfig
    native: bool = False

    def setup(self):
        c = self.cfg
        self.tok = nn.Embed(c.V, c.d, embedding_init=_init(0.02), name="tok")
        self.pos = nn.Embed(c.T, c.d, embedding_init=_init(0.02), name="pos")
        self.blocks = [Block(c, self.native, name=f"block_{i}") for i in range(c.L)]
        self.ln = nn.LayerNorm(epsilon=LN_EPS, name="ln")

    def __call__(self, tokens, return_hidden=False, return_kv=False):
        t = tokens.shape[1]
        h = self.tok(tokens) + self.pos(jnp.arange(t))[None]
        kvs = []
        for block in self.blocks:
            h, kv = block(h)
            kvs.append(kv)
        h = self.ln(h)
        logits = self.tok.attend(h)
        out = (logits,)
        if return_hidden:
            out += (h,)
        if return_kv:
            out += (kvs,)
        return out if len(out) > 1 else logits

    def cached(self, tokens, cache: KVCache, span: int, in_place: bool = True, cache_only: bool = False):
        """Returns ``(logits [B, S, V], hidden [B, S, d], cache)`` (None, None with ``cache_only``)."""
        S = tokens.shape[1]
        positions = cache.length[:, None] + jnp.arange(S)[None, :]
        h = self.tok(tokens) + self.pos(jnp.minimum(positions, self.cfg.T - 1))
        ks, vs = [], []
        for i, (block, kc, vc) in enumerate(zip(self.blocks, cache.k, cache.v)):
            if cache_only and i == len(self.blocks) - 1:  # the rest of the last layer is unused
                kc, vc = block.cached_kv(h, kc, vc, cache.length)
            else:
                h, kc, vc = block.cached(h, kc, vc, cache.length, span, in_place)
            ks.append(kc)
            vs.append(vc)
        cache = KVCache(tuple(ks), tuple(vs), cache.length + S)
        if cache_only:
            return None, None, cache
        h = self.ln(h)
        return self.tok.attend(h), h, cache

    def chunked(self, token, cache: KVCache, local: KVCache, i):
        positions = jnp.minimum(cache.length + i, self.cfg.T - 1)[:, None]
        h = self.tok(token[:, None]) + self.pos(positions)
        ks, vs = [], []
        for block, kc, vc, kl, vl in zip(self.blocks, cache.k, cache.v, local.k, local.v):
            h, kl, vl = block.chunked(h, kc, vc, cache.length, kl, vl, i)
            ks.append(kl)
            vs.append(vl)
        h = self.ln(h)[:, 0]
        return self.tok.attend(h), h, KVCache(tuple(ks), tuple(vs), local.length)


# ----------------------------------------------------------------------------- functional API


def init_params(cfg: ModelConfig, key: jax.Array):
    """Random parameters (GPT-style normal init), as used for training and for tests."""
    return CharLM(cfg).init(key, jnp.zeros((1, 1), jnp.int32))["params"]


def forward(params, cfg: ModelConfig, tokens: jax.Array, return_hidden: bool = False):
    """Logits ``[B, t, V]`` for every position of ``tokens`` ``[B, n]``, keeping the last T.

    With ``return_hidden``, also the final (post-LayerNorm) hidden states ``[B, t, d]``.
    """
    tokens = tokens[:, -cfg.T:]
    return CharLM(cfg).apply({"params": params}, tokens, return_hidden=return_hidden)


def empty_cache(cfg: ModelConfig, batch: int, capacity: int | None = None, dtype=jnp.float32):
    capacity = cfg.T if capacity is None else capacity
    shape = (batch, cfg.heads, capacity, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.L))
    return KVCache(zeros, zeros, jnp.zeros((batch,), jnp.int32))


def prefill(params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
            capacity: int | None = None, packed=None, *, native: bool = False, return_hidden: bool = False):
    """Run right-padded prompts ``tokens`` ``[B, P]`` (row b real up to ``lengths[b]``).

    Returns the next-token logits after each prompt ``[B, V]`` (and, with ``return_hidden``, the
    final hidden state there ``[B, d]``) and a cache holding the prompts. Requires ``P <= T``;
    padding past a row's length is causal-masked away and later overwritten. ``native``: the
    backend (see :mod:`jaxdecode.native.kernels`); with it and ``packed`` (:func:`pack_params`), when the
    ``B * P`` positions are few enough, the prompts go through :func:`extend` on an empty cache,
    one native call per layer.
    """
    lengths, capacity, fused = _prefill_setup(cfg, tokens, lengths, capacity, packed, native)
    B, P = tokens.shape
    last_of = lambda a: jnp.take_along_axis(a, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    if fused:
        logits, hidden, cache = extend(params, cfg, empty_cache(cfg, B, capacity), tokens, capacity, packed,
                                       native=True, return_hidden=True)
        cache = cache._replace(length=lengths)
    else:
        logits, hidden, kvs = CharLM(cfg, native).apply({"params": params}, tokens, return_hidden=True,
                                                         return_kv=True)
        pad = [(0, 0), (0, 0), (0, capacity - P), (0, 0)]
        cache = KVCache(tuple(jnp.pad(k, pad) for k, _ in kvs), tuple(jnp.pad(v, pad) for _, v in kvs), lengths)
    if return_hidden:
        return last_of(logits), last_of(hidden), cache
    return last_of(logits), cache


def prefill_cache(params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
                  capacity: int | None = None, packed=None, *, native: bool = False) -> KVCache:
    """:func:`prefill` for a caller that needs only the cache (it feeds the prompt's last token
    itself, as speculative decoding does). On the native path this skips the last layer's
    attention and feed-forward and the head: about a fifth of the work."""
    lengths, capacity, fused = _prefill_setup(cfg, tokens, lengths, capacity, packed, native)
    if fused:
        variables = {"params": params, "packed": packed}
        empty = empty_cache(cfg, tokens.shape[0], capacity)
        _, _, cache = CharLM(cfg, True).apply(variables, tokens, empty, capacity, True, True,
                                              method=CharLM.cached)
        return cache._replace(length=lengths)
    return prefill(params, cfg, tokens, lengths, capacity, packed, native=native)[1]


def _prefill_setup(cfg: ModelConfig, tokens, lengths, capacity, packed, native):
    """Checks shared by the prefills; returns a copy of ``lengths`` (the cache must not alias
    the caller's array), the capacity, and whether the prompts go through the fused native layers
    (native backend, ``packed`` weights and few enough positions in all)."""
    lengths = jnp.array(lengths, jnp.int32)
    chex.assert_rank(tokens, 2)
    chex.assert_shape(lengths, (tokens.shape[0],))
    B, P = tokens.shape
    if P > cfg.T:
        raise ValueError(f"prefill: padded prompt width {P} exceeds the model window T={cfg.T}")
    capacity = cfg.T if capacity is None else capacity
    fused = (native and packed is not None and B * P <= kernels.PREFILL_MAX_ROWS
             and kernels.fuses_rows(B * P) and capacity >= P)
    return lengths, capacity, fused


def pack_params(params):
    """The dense kernels of ``params`` in the panel layout of :func:`jaxdecode.native.kernels.pack`, as a
    ``packed`` variable collection for :func:`extend` and :func:`chunk_step` (passes of a few
    rows, which then run each layer as one native call on CPU)."""
    def walk(tree):
        out = {}
        for name, sub in tree.items():
            if isinstance(sub, dict) and "kernel" in sub and getattr(sub["kernel"], "ndim", 0) == 2:
                if name != "tok" and sub["kernel"].shape[1] % 16 == 0:
                    out[name] = {"kernel": kernels.pack(sub["kernel"])}
            elif isinstance(sub, dict):
                inner = walk(sub)
                if inner:
                    out[name] = inner
        return out

    return walk(dict(params))


_pack_jit = jax.jit(pack_params)
_PACKED: list = []  # (the parameter leaves, their packed weights), most recent first


def packed_params(params):
    """:func:`pack_params` of ``params``, computed once per parameter set: the last two sets are
    kept, recognised by the identity of their (immutable) arrays."""
    leaves = tuple(jax.tree_util.tree_leaves(params))
    if not all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) for a in leaves):
        return _pack_jit(params)  # numpy arrays can change in place: no caching
    for known, packed in _PACKED:
        if len(known) == len(leaves) and all(a is b for a, b in zip(known, leaves)):
            return packed
    packed = _pack_jit(params)
    _PACKED.insert(0, (leaves, packed))
    del _PACKED[2:]
    return packed


def extend(params, cfg: ModelConfig, cache: KVCache, tokens: jax.Array, span: int | None = None,
           packed=None, in_place: bool = True, *, native: bool = False, return_hidden: bool = False):
    """Append ``tokens`` ``[B, S]`` to every row; logits ``[B, S, V]`` at the new positions (and with
    ``return_hidden`` the final hidden states ``[B, S, d]``), and the cache.

    ``span`` (static) bounds the attended cache prefix: it must be at least
    ``max(cache.length) + S`` and at most the capacity. Attending only over the filled span is
    what keeps a decode step cheap when the cache is mostly empty. The caller guarantees every
    row stays within ``T`` positions (beyond that, use :func:`window_logits`). ``native``: the
    backend. ``packed`` (:func:`pack_params` of ``params``, computed once outside the loop) lets
    a native pass of a few rows (``B * S``, see :func:`jaxdecode.native.kernels.fuses_rows`) run each
    layer as one call (:func:`jaxdecode.native.kernels.decode_layer`). That call writes the new keys and
    values into the cache itself, which saves a copy when the caller's loop carries the cache as
    it is; ``in_place=False`` leaves the write to XLA, for a caller that rebuilds the cache each
    step (beam search reorders it), where writing in place would cost a copy instead.
    """
    span = cache.capacity if span is None else span
    variables = {"params": params} if packed is None else {"params": params, "packed": packed}
    logits, hidden, cache = CharLM(cfg, native).apply(variables, tokens, cache, span, in_place,
                                                      method=CharLM.cached)
    return (logits, hidden, cache) if return_hidden else (logits, cache)


def step(params, cfg: ModelConfig, cache: KVCache, token: jax.Array, span: int | None = None,
         packed=None, in_place: bool = True, *, native: bool = False):
    """Append one token per row (``[B]``); returns next-token logits ``[B, V]`` and the cache.
    ``packed``, ``in_place``, ``native``: as for :func:`extend`."""
    logits, cache = extend(params, cfg, cache, token[:, None], span, packed, in_place, native=native)
    return logits[:, 0], cache


def empty_local(cfg: ModelConfig, batch: int, chunk: int, dtype=jnp.float32) -> KVCache:
    """The per-chunk buffer of :func:`chunk_step`: ``[B * heads, chunk, hd]`` per layer."""
    zeros = tuple(jnp.zeros((batch * cfg.heads, chunk, cfg.head_dim), dtype) for _ in range(cfg.L))
    return KVCache(zeros, zeros, jnp.zeros((batch,), jnp.int32))


def chunk_step(params, cfg: ModelConfig, cache: KVCache, local: KVCache, i, token, packed=None, *,
               native: bool = False):
    """Decode step ``i`` of a chunk: the main ``cache`` is read, never written.

    A decode loop that writes each new key into a large loop-carried cache and reads it back in
    the same iteration makes XLA copy the cache every step. Here the keys of the current chunk go
    into a small ``local`` buffer ``[B * H, chunk, hd]`` at index ``i`` (the same for every row);
    attention covers the whole main cache (valid below ``cache.length``) and the local buffer up
    to ``i``, so the caller sizes the cache to what it wants attended (see ``grow_cache``).
    :func:`merge_chunk` appends the buffer to the cache after the chunk. Returns logits ``[B, V]``,
    the final hidden state ``[B, d]`` and the updated buffer. ``packed``, ``native``: as for
    :func:`extend`.
    """
    variables = {"params": params} if packed is None else {"params": params, "packed": packed}
    return CharLM(cfg, native).apply(variables, token, cache, local, i, method=CharLM.chunked)


def grow_cache(cache: KVCache, capacity: int) -> KVCache:
    """The same cache with room for ``capacity`` positions (unchanged if it already has that)."""
    if capacity < cache.capacity:
        raise ValueError(f"grow_cache: capacity {capacity} is below the current {cache.capacity}")
    if capacity == cache.capacity:
        return cache
    pad = [(0, 0), (0, 0), (0, capacity - cache.capacity), (0, 0)]
    return KVCache(tuple(jnp.pad(k, pad) for k in cache.k), tuple(jnp.pad(v, pad) for v in cache.v),
                   cache.length)


def merge_chunk(cache: KVCache, local: KVCache, steps) -> KVCache:
    """Append the first ``steps`` entries of a chunk buffer to every row of the cache."""
    B, H = cache.k[0].shape[:2]
    unfold = lambda n: n.reshape(B, H, *n.shape[1:])
    ks = tuple(write_rows(c, unfold(n), cache.length) for c, n in zip(cache.k, local.k))
    vs = tuple(write_rows(c, unfold(n), cache.length) for c, n in zip(cache.v, local.v))
    return KVCache(ks, vs, cache.length + steps)


def window_logits(params, cfg: ModelConfig, history: jax.Array, lengths: jax.Array,
                  return_hidden: bool = False):
    """The book's exact next-token logits for rows of any length: a forward over the last T
    (with ``return_hidden``, also the final hidden state there ``[B, d]``).

    ``history`` ``[B, N]`` holds each row's tokens left-aligned, ``lengths`` ``[B]`` how many are
    real. Row b sees ``history[b, max(0, len-T):len]`` numbered from position 0.
    """
    _B, N = history.shape
    W = min(N, cfg.T)
    start = jnp.clip(lengths - W, 0, N - W)

    def take(row, s):
        return jax.lax.dynamic_slice(row, (s,), (W,))

    windows = jax.vmap(take)(history, start)
    logits, hidden = forward(params, cfg, windows, return_hidden=True)
    idx = jnp.clip(lengths - start - 1, 0, W - 1)
    at = lambda a: jnp.take_along_axis(a, idx[:, None, None], axis=1)[:, 0]
    return (at(logits), at(hidden)) if return_hidden else at(logits)
