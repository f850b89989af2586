"""A paged KV cache: keys and values in a pool of fixed-size blocks, each row's positions found
through its block table.

Layout, per layer: ``k_pool, v_pool`` ``[num_blocks, heads, block_size, head_dim]``; row ``b``'s
position ``p`` lies in block ``tables[b, p // block_size]`` at offset ``p % block_size``. Rows
share blocks freely (beams, common prompt prefixes): only a block a row still writes into must be
its own. :mod:`jaxdecode.serving.blocks` does that bookkeeping on the host for a serving engine;
:class:`PagedCharLM` does it on the device for the decoding loops.

Three implementations of :func:`paged_attention`, chosen by name:

- ``"portable"``: ``jax.numpy``: gather the blocks through the table, then a masked softmax (the
  model's own :func:`jaxdecode.models.charlm.transformer.attend`). Runs everywhere.
- ``"pallas"``: JAX's Pallas GPU kernel (``jax.experimental.pallas.ops.gpu.paged_attention``), run
  with ``interpret=True`` off the GPU. Its pool is head-major (``[heads, num_blocks, ...]``), so
  the adapter transposes the pool (a copy; a GPU deployment would keep the pool head-major) and
  pre-scales the queries; it takes one query per row, so ``S`` new positions run as ``B * S``
  rows sharing their row's table.
- ``"native"``: the C++ CPU layer (``csrc/paged.cc``): every block a query sees is one segment of
  the kernels in ``csrc/attend.h``, read in place in the pool.

:class:`PagedCharLM` is the reference transformer behind :class:`~jaxdecode.models.DecodingModel`
with a paged cache, so every decoding loop runs on it unchanged; its ``pool_*`` methods are what a
serving engine needs (a prompt into its blocks, a pass for any rows through their tables).
:func:`cache_bytes` compares a workload's paged and contiguous cache memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.native import kernels
from jaxdecode.models.charlm import transformer as M
from jaxdecode.models.base import (  # noqa: F401 (copy_blocks re-exported)
    DecodingModel, Int8Blocks, PagedKV, PagedPool, copy_blocks, empty_blocks, gather_blocks, write_blocks)

__all__ = ["IMPLS", "CacheBytes", "PagedCache", "PagedCharLM", "PagedKV", "cache_bytes", "copy_blocks",
           "paged_attention", "query_limits", "write_cache"]

class Prepared(tuple):
    """A CharLM's parameters for a loop: ``(params, packed or None)`` (packed: the native layer's
    weights, see :meth:`jaxdecode.models.charlm.decoder.CharLMDecoder.prepare`)."""


jax.tree_util.register_pytree_node(Prepared, lambda p: (tuple(p), None), lambda _, c: Prepared(c))


def unpack(p):
    if isinstance(p, Prepared):
        return p[0], p[1]
    return p, None


IMPLS = ("portable", "pallas", "native")
_TARGET = kernels.PAGED_TARGET


# ----------------------------------------------------------------------------- attention


def query_limits(lengths, S: int):
    """``[B, S]``: how many positions each of ``S`` queries sees when they are the last ``S`` of
    ``lengths`` ``[B]`` positions (causal among themselves)."""
    lengths = jnp.asarray(lengths, jnp.int32)
    return lengths[:, None] - S + 1 + jnp.arange(S, dtype=jnp.int32)[None, :]


def paged_attention(q, k_pool, v_pool, tables, lengths, *, scale: float | None = None, impl: str = "portable",
                    interpret: bool | None = None):
    """Softmax attention of queries over keys and values in a block pool.

    ``q``: ``[B, H, D]`` (one decode query per row, which sees positions ``t < lengths[b]``) or
    ``[B, H, S, D]`` (``S`` new positions per row). For the latter ``lengths`` is either ``[B]``, the
    queries being the row's last ``S`` positions of ``lengths[b]`` (causal among themselves), or
    ``[B, S]``, the number of positions each query sees. ``k_pool, v_pool``:
    ``[num_blocks, H, block_size, D]``; ``tables``: ``[B, max_blocks]`` int32 (entries past the
    blocks a row's queries see are ignored). ``scale``: default ``1 / sqrt(D)``. ``impl``: one of
    :data:`IMPLS`; ``interpret`` (``"pallas"`` only): run the kernel in the Pallas interpreter
    (default: unless JAX runs on a GPU). A query that sees nothing gets zeros. Returns ``q``'s
    shape.
    """
    if impl not in IMPLS:
        raise ValueError(f"paged_attention: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if q.ndim not in (3, 4):
        raise ValueError(f"paged_attention: q must be [B, H, D] or [B, H, S, D], got shape {q.shape}")
    single = q.ndim == 3
    q4 = q[:, :, None] if single else q
    B, H, S, D = q4.shape
    if len(k_pool.shape) != 4 or k_pool.shape[1] != H or k_pool.shape[3] != D:
        raise ValueError(f"paged_attention: the pool must be [num_blocks, {H}, block_size, {D}] for q of "
                         f"shape {q.shape}, got {k_pool.shape}")
    if v_pool.shape != k_pool.shape or type(v_pool) is not type(k_pool):
        raise ValueError(f"paged_attention: v_pool {v_pool.shape} differs from k_pool {k_pool.shape}")
    if isinstance(k_pool, Int8Blocks) and impl == "pallas":
        raise ValueError("paged_attention: the Pallas kernel reads float pools only; an int8 pool runs on the "
                         "portable or native implementation")
    if tables.ndim != 2 or tables.shape[0] != B or not jnp.issubdtype(tables.dtype, jnp.integer):
        raise ValueError(f"paged_attention: tables must be integer [{B}, max_blocks], got {tables.dtype} "
                         f"{tables.shape}")
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape == (B,):
        lim = query_limits(lengths, S)
    elif lengths.shape == (B, S) and not single:
        lim = lengths
    else:
        raise ValueError(f"paged_attention: lengths must be [{B}]" + ("" if single else f" or [{B}, {S}]")
                         + f", got shape {lengths.shape}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    tables = jnp.clip(tables.astype(jnp.int32), 0, k_pool.shape[0] - 1)
    lim = jnp.clip(lim, 0, tables.shape[1] * k_pool.shape[2])
    out = {"portable": _portable, "pallas": functools.partial(_pallas, interpret=interpret),
           "native": _native}[impl](q4, k_pool, v_pool, tables, lim, scale)
    return out[:, :, 0] if single else out


def _portable(q, k_pool, v_pool, tables, lim, scale):
    k, v = gather_blocks(k_pool, tables, q.dtype), gather_blocks(v_pool, tables, q.dtype)
    out = M.attend(q, [(k, v, M.visible_below(k.shape[2], lim))], scale)
    return jnp.where((lim > 0)[:, None, :, None], out, 0.0).astype(q.dtype)


def _pallas(q, k_pool, v_pool, tables, lim, scale, interpret):
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged

    B, H, S, D = q.shape
    Mb = tables.shape[1]
    per_block = min(8, Mb)  # pages per compute block; the table is padded to a multiple of it
    tables = jnp.pad(tables, ((0, 0), (0, -Mb % per_block)))
    rows = jnp.transpose(q * jnp.asarray(scale, q.dtype), (0, 2, 1, 3)).reshape(B * S, H, D)
    out = pallas_paged.paged_attention(
        rows, jnp.transpose(k_pool, (1, 0, 2, 3)), jnp.transpose(v_pool, (1, 0, 2, 3)),
        jnp.repeat(tables, S, axis=0), lim.reshape(B * S), block_h=16, pages_per_compute_block=per_block,
        k_splits=1, interpret=interpret)
    return jnp.transpose(out.reshape(B, S, H, D), (0, 2, 1, 3))


@functools.cache
def _native_library() -> str | None:
    """None when the native paged attention is registered (:mod:`jaxdecode.native.kernels`
    registers every target of the library), else why it is unavailable."""
    if not kernels.available():
        return "the native CPU layer is unavailable (no CPU backend or no C++ compiler)"
    return None


def _native(q, k_pool, v_pool, tables, lim, scale):
    failure = _native_library()
    if failure is not None:
        raise kernels.KernelError(f"paged_attention(impl='native'): {failure}")
    if isinstance(k_pool, Int8Blocks):
        # each (row, head) reads back only the blocks its queries see (csrc/paged.cc)
        kernels.check_float32(q)
        call = jax.ffi.ffi_call(kernels.PAGED_INT8_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                vmap_method="sequential")
        return call(q, k_pool.q, k_pool.scale, v_pool.q, v_pool.scale, tables, lim, scale=np.float32(scale))
    kernels.check_float32(q, k_pool, v_pool)
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    return call(q, k_pool, v_pool, tables, lim, scale=np.float32(scale))


# ----------------------------------------------------------------------------- the pool


def write_cache(pool: PagedKV, cache: M.KVCache, tables) -> PagedKV:
    """A dense cache's rows (``cache.k[l]`` ``[B, H, C, D]``, row ``b`` filled up to
    ``cache.length[b]``) written into the blocks ``tables`` ``[B, max_blocks]`` lists: a prompt
    prefilled by a dense decoder (e.g. on the native backend) moved into its blocks."""
    B, _, C, _ = cache.k[0].shape
    tables = jnp.asarray(tables, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32)[None, :], (B, C))
    valid = positions < cache.length[:, None]
    return PagedKV(tuple(_write(p, k, tables, positions, valid) for p, k in zip(pool.k, cache.k)),
                   tuple(_write(p, v, tables, positions, valid) for p, v in zip(pool.v, cache.v)))


_write = write_blocks


def _layers(module: M.CharLM, tokens, pool: PagedKV, tables, lengths, counts, cols: int, impl: str):
    """The model over ``S`` new positions per row (a method of ``CharLM`` for ``apply``): each
    layer writes its new keys and values into the rows' blocks, then attends through the tables."""
    cfg = module.cfg
    B, S = tokens.shape
    positions = lengths[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]
    valid = jnp.arange(S)[None, :] < counts[:, None]
    h = module.tok(tokens) + module.pos(jnp.minimum(positions, cfg.T - 1))
    tab = tables[:, :cols]
    ks, vs = [], []
    for block, kp, vp in zip(module.blocks, pool.k, pool.v):
        weights = None if isinstance(kp, Int8Blocks) else block._fused(h)
        if weights is not None:  # the whole layer as one native call through the tables
            lim = jnp.broadcast_to(lengths[:, None], (B, S))
            h, kp, vp = kernels.paged_layer(h, weights, kp, vp, tables, lim, counts, eps=M.LN_EPS)
        else:
            q, k, v = block.attn.heads(block.ln1(h))
            kp, vp = _write(kp, k, tables, positions, valid), _write(vp, v, tables, positions, valid)
            out = paged_attention(q, kp, vp, tab, positions + 1, impl=impl)
            h = block._ff_residual(h + block.attn.merge(out))
        ks.append(kp)
        vs.append(vp)
    h = module.ln(h)
    return module.tok.attend(h), h, PagedKV(tuple(ks), tuple(vs))


# ----------------------------------------------------------------------------- the decoding model


class PagedCache(NamedTuple):
    """The cache of :class:`PagedCharLM`: the pool, each row's block table ``[B, max_blocks]`` and
    length ``[B]``. Invariant: the blocks a row may still write (table columns from
    ``length // block_size`` on) are listed by no other row and column."""

    k: tuple
    v: tuple
    table: jax.Array
    length: jax.Array

    @property
    def pool(self) -> PagedKV:
        return PagedKV(self.k, self.v)

    @property
    def capacity(self) -> int:
        return self.table.shape[1] * self.k[0].shape[2]


def _own_tails(cache: PagedCache) -> PagedCache:
    """Restore the invariant after rows were copied (reorder) or shortened (truncate): every row
    gets blocks no one else lists for the table columns it may still write, and its partly filled
    last block is copied into the new one. Full blocks stay shared. With at least ``B * max_blocks``
    blocks in the pool there are always enough: the shared columns use at most as many distinct
    blocks as they have entries."""
    table, length = cache.table, cache.length
    N, _, bs, _ = cache.k[0].shape
    B, Mb = table.shape
    full = length // bs
    shared = jnp.arange(Mb)[None, :] < full[:, None]
    used = jnp.zeros((N,), bool).at[jnp.where(shared, table, N)].set(True, mode="drop")
    free = jnp.nonzero(~used, size=N, fill_value=N - 1)[0]
    need = ~shared
    rank = jnp.cumsum(need.reshape(-1)).reshape(B, Mb) - 1
    new_table = jnp.where(shared, table, free[jnp.clip(rank, 0, N - 1)]).astype(jnp.int32)
    last = jnp.clip(full, 0, Mb - 1)[:, None]
    partial = (length % bs != 0) & (full < Mb)
    src = jnp.take_along_axis(table, last, axis=1)[:, 0]
    dst = jnp.where(partial, jnp.take_along_axis(new_table, last, axis=1)[:, 0], N)
    pool = copy_blocks(cache.pool, src, dst)
    return PagedCache(pool.k, pool.v, new_table, length)


@dataclasses.dataclass(frozen=True)
class PagedCharLM(DecodingModel, PagedPool):
    """The reference transformer (:mod:`jaxdecode.models.charlm.transformer`) with a paged KV cache, behind the
    decoding-model interface; parameters are the ``CharLM`` parameters.

    ``block_size``: positions per block. ``attention``: the :func:`paged_attention` implementation
    (the rest of the model is the portable ``jax.numpy`` code). A new cache lays row ``b``'s table
    out as blocks ``b * m .. (b + 1) * m - 1``; :meth:`reorder` (beams) copies table rows, not the
    cache: rows share their full blocks, and each row gets a copy of its partly filled last block
    only (so ``k`` beams cost one block each per step instead of a copy of their caches).
    """

    cfg: M.ModelConfig
    block_size: int = 16
    attention: str = "portable"

    def __post_init__(self):
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"PagedCharLM: block_size must be a positive integer, got {self.block_size!r}")
        if self.attention not in IMPLS:
            raise ValueError(f"PagedCharLM: attention must be one of {', '.join(IMPLS)}, "
                             f"got {self.attention!r}")

    @classmethod
    def from_decoder(cls, decoder, block_size: int = 16, attention: str = "portable") -> PagedCharLM:
        """The paged counterpart of a :class:`~jaxdecode.models.CharLMDecoder`."""
        return cls(decoder.cfg, block_size, attention)

    @property
    def V(self):
        return self.cfg.V

    @property
    def T(self):
        return self.cfg.T

    @property
    def backend(self):
        return f"paged ({self.attention})"

    @property
    def attention_heads(self):
        return self.cfg.heads

    @property
    def reads_only_filled(self):
        # the native attention reads a row's blocks only up to its length; the others read every
        # table column they are given
        return self.attention == "native"

    def blocks_for(self, positions: int) -> int:
        return -(-int(positions) // self.block_size)

    # --- the serving engine's operations: one shared pool, tables kept on the host
    def empty_pool(self, num_blocks: int, dtype=jnp.float32) -> PagedKV:
        """A pool of ``num_blocks`` blocks for every layer (zeros; ``dtype="int8"``: quantized,
        :class:`~jaxdecode.models.base.Int8Blocks`)."""
        if not isinstance(num_blocks, (int, np.integer)) or num_blocks < 1:
            raise ValueError(f"empty_pool: num_blocks must be a positive integer, got {num_blocks!r}")
        c = self.cfg
        return empty_blocks((int(num_blocks), c.heads, self.block_size, c.head_dim), c.L, dtype)

    def pool_prefill(self, params, pool: PagedKV, tables, tokens, lengths):
        """Whole prompts with nothing cached: ``tokens`` ``[B, P]`` right-padded (row ``b`` real up
        to ``lengths[b]``, ``P <= T``) through the model's dense forward, their keys and values
        written into the blocks ``tables`` ``[B, max_blocks]`` lists. Returns the logits ``[B, V]``
        and final hidden states ``[B, d]`` after each prompt, and the pool."""
        P = tokens.shape[1]
        if P > self.T:
            raise ValueError(f"pool_prefill: padded prompt width {P} exceeds the model window T={self.T}")
        lengths = jnp.asarray(lengths, jnp.int32)
        logits, hidden, kvs = M.CharLM(self.cfg).apply({"params": unpack(params)[0]}, tokens, return_hidden=True,
                                                        return_kv=True)
        dense = M.KVCache(tuple(k for k, _ in kvs), tuple(v for _, v in kvs), lengths)
        pool = write_cache(pool, dense, tables)
        last = lambda a: jnp.take_along_axis(a, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
        return last(logits), last(hidden), pool

    def pool_forward(self, params, pool: PagedKV, tables, lengths, tokens, counts=None,
                     cols: int | None = None):
        """``S`` new positions per row through the tables: a decode step (``S = 1``), a chunk of a
        prompt (chunked prefill), or a prompt's part after its cached prefix. Row ``b`` has
        ``lengths[b]`` positions already in its blocks and appends the first ``counts[b]``
        (default ``S``) of ``tokens[b]`` (``[B, S]``) at positions ``lengths[b]..``: their keys and
        values are written into the blocks ``tables`` lists (which must hold them), and each new
        position attends causally over its row. ``cols`` (static): attend only over the first
        ``cols`` table columns (every row's positions must lie within them). ``params``: the
        CharLM parameters, or :meth:`prepare`'s. Returns logits
        ``[B, S, V]`` and hidden states ``[B, S, d]`` (padding positions past ``counts``: garbage)
        and the pool."""
        tables = jnp.asarray(tables, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        B, S = tokens.shape
        counts = jnp.full((B,), S, jnp.int32) if counts is None else jnp.asarray(counts, jnp.int32)
        cols = tables.shape[1] if cols is None else min(int(cols), tables.shape[1])
        params, packed = unpack(params)
        variables = {"params": params} if packed is None else {"params": params, "packed": packed}
        return M.CharLM(self.cfg, packed is not None).apply(variables, tokens, pool, tables, lengths, counts, cols,
                                                            self.attention, method=_layers)

    # --- the decoding-model interface
    def prepare(self, params, rows):
        """With the native attention, passes of up to 1,024 rows on a float pool run each layer as
        one native call through the tables (:func:`jaxdecode.native.kernels.paged_layer`), on weights
        packed once per parameter set; otherwise the plain CharLM parameters."""
        params, _ = unpack(params)
        native = self.attention == "native" and kernels.available() and kernels.fuses_rows(rows)
        packed = M.packed_params(params) if native and self.cfg.d % 16 == 0 else None
        return Prepared((params, packed))

    def empty_cache(self, batch, capacity):
        m = max(1, self.blocks_for(capacity))
        pool = self.empty_pool(batch * m)
        table = jnp.arange(batch * m, dtype=jnp.int32).reshape(batch, m)
        return PagedCache(pool.k, pool.v, table, jnp.zeros((batch,), jnp.int32))

    def prefill(self, params, tokens, lengths, capacity):
        B, P = tokens.shape
        lengths = jnp.array(lengths, jnp.int32)
        cache = self.empty_cache(B, max(capacity, P))
        logits, hidden, pool = self.pool_prefill(params, cache.pool, cache.table, tokens, lengths)
        return logits, hidden, PagedCache(pool.k, pool.v, cache.table, lengths)

    def extend(self, params, cache, tokens, span=None, in_place=True):
        S = tokens.shape[1]
        cols = None if span is None else self.blocks_for(span)
        logits, hidden, pool = self.pool_forward(params, cache.pool, cache.table, cache.length, tokens,
                                                 cols=cols)
        return logits, hidden, PagedCache(pool.k, pool.v, cache.table, cache.length + S)

    def window(self, params, history, lengths):
        return M.window_logits(unpack(params)[0], self.cfg, history, lengths, return_hidden=True)

    def capacity(self, cache):
        return cache.capacity

    def grow(self, cache, capacity):
        B, m = cache.table.shape
        m2 = self.blocks_for(capacity)
        if m2 < m:
            raise ValueError(f"grow: capacity {capacity} is below the current {cache.capacity}")
        if m2 == m:
            return cache
        N = cache.k[0].shape[0]
        extra = N + jnp.arange(B * (m2 - m), dtype=jnp.int32).reshape(B, m2 - m)
        pad = lambda a: jnp.pad(a, ((0, B * (m2 - m)), (0, 0), (0, 0), (0, 0)))
        return PagedCache(tuple(map(pad, cache.k)), tuple(map(pad, cache.v)),
                          jnp.concatenate([cache.table, extra], axis=1), cache.length)

    def reorder(self, cache, rows, span=None):
        rows = jnp.asarray(rows, jnp.int32)
        B2, m = rows.shape[0], cache.table.shape[1]
        N = cache.k[0].shape[0]
        k, v = cache.k, cache.v
        if B2 * m > N:  # more rows than before (beams from prompts): room for their own blocks
            pad = lambda a: jnp.pad(a, ((0, B2 * m - N), (0, 0), (0, 0), (0, 0)))
            k, v = tuple(map(pad, k)), tuple(map(pad, v))
        return _own_tails(PagedCache(k, v, jnp.take(cache.table, rows, axis=0), jnp.take(cache.length, rows)))

    def truncate(self, cache, lengths):
        return _own_tails(cache._replace(length=jnp.asarray(lengths, jnp.int32)))


# ----------------------------------------------------------------------------- memory


class CacheBytes(NamedTuple):
    """KV cache memory of a workload: ``paged`` (the blocks in use) against ``contiguous`` (every
    row reserving ``capacity`` positions), in bytes."""

    paged: int
    contiguous: int
    blocks: int  # blocks in use
    bytes_per_position: int  # keys and values of one position in every layer

    @property
    def ratio(self) -> float:
        """``paged / contiguous``."""
        return self.paged / self.contiguous if self.contiguous else float("nan")


def cache_bytes(cfg: M.ModelConfig, lengths, block_size: int, capacity: int | None = None, *,
                blocks: int | None = None, dtype=jnp.float32) -> CacheBytes:
    """KV cache memory for rows of ``lengths`` positions: paged with blocks of ``block_size``
    (``ceil(length / block_size)`` blocks a row, or ``blocks`` in all when rows share blocks, e.g.
    :attr:`jaxdecode.serving.blocks.BlockAllocator.num_used`) against a contiguous cache where each
    row reserves ``capacity`` positions (default the window ``T``)."""
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"cache_bytes: lengths must be >= 0, got min {lengths.min()}")
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"cache_bytes: block_size must be a positive integer, got {block_size!r}")
    capacity = cfg.T if capacity is None else int(capacity)
    if lengths.size and lengths.max() > capacity:
        raise ValueError(f"cache_bytes: a row of {lengths.max()} positions exceeds the capacity {capacity}")
    if dtype == "int8":  # int8 values and a float32 scale per head and position
        per = 2 * cfg.L * cfg.heads * (cfg.head_dim + 4)
    else:
        per = 2 * cfg.L * cfg.d * jnp.dtype(dtype).itemsize
    used = int((-(-lengths // block_size)).sum()) if blocks is None else int(blocks)
    return CacheBytes(used * block_size * per, int(lengths.size) * capacity * per, used, per)
