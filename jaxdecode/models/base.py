"""The decoding-model interface: the only thing a decoding loop knows about a model.

A decoding model is a small, immutable, hashable object (it is a static argument of the loops'
jitted programs, so everything it decides, the backend included, is part of what jit compiles).
Its parameters travel separately as a pytree. Its cache is a pytree too, opaque to the loops: they
create it, pass it back, reorder it for beams and truncate it for speculative rollback, only
through the methods of :class:`DecodingModel`, so a paged cache can replace a dense one without
touching a loop.

The model: ``prefill`` (prompts), ``extend`` (tokens appended at each row's own length) and
``window`` (the exact prediction from a row's last ``T`` tokens, used past the window). The
cache: ``empty_cache``, ``reorder``, ``truncate``, ``grow``, ``capacity``, ``lengths``. Optional,
with defaults: ``prepare``, ``chunk_begin / chunk_step / chunk_end``, ``attention_heads``,
``reads_only_filled`` and ``for_beams()``. Each method's docstring gives its shapes;
``docs/own-model.md`` shows a model written against it. Here too: :class:`FunctionModel` (a
logits function as a model) and the paged block pool a serving engine runs on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


def added_positions(model, cache, capacity: int) -> int:
    """What ``grow(cache, capacity)`` adds: ``capacity`` less the cache's (0: nothing to do); a
    capacity below the cache's is refused."""
    have = model.capacity(cache)
    if capacity < have:
        raise ValueError(f"grow: capacity {capacity} is below the current {have}")
    return capacity - have


class DecodingModel:
    """Base class of decoding models (see the module docstring). Shapes: ``B`` rows, ``S`` new
    tokens per row, ``V`` vocabulary, ``d`` hidden width. ``hidden`` is the last layer's output
    after the final LayerNorm (Hugging Face's ``hidden_states[-1]``), or None for a model that has
    none; contrastive search needs it."""

    V: int  # vocabulary size
    T: int  # window: positions the model sees; past it the loops call ``window``
    # whether attending over a mostly empty cache costs nothing extra (then a loop allocates the
    # cache once per request instead of growing it)
    reads_only_filled: bool = False
    backend: str = "portable"  # what `jaxdecode info` reports

    @property
    def attention_heads(self) -> int:
        """Query heads of an attention layer: a loop's memory estimate counts a prompt's attention
        scores by it (:func:`jaxdecode.decoding.budget.row_bytes`). Default: the ``heads`` of the
        model's ``cfg`` where it has one, else 1 (a model without attention)."""
        return int(getattr(getattr(self, "cfg", None), "heads", 1))

    # --- the model
    def empty_cache(self, batch: int, capacity: int):
        """A cache of ``batch`` empty rows with room for ``capacity`` positions."""
        raise NotImplementedError

    def prefill(self, params, tokens, lengths, capacity: int):
        """Right-padded prompts ``tokens [B, P]`` (row ``b`` real up to ``lengths[b]``, ``P <= T``)
        -> ``(logits [B, V], hidden [B, d], cache)``: the logits and final hidden state after each
        prompt's last token."""
        raise NotImplementedError

    def extend(self, params, cache, tokens, span: int | None = None, in_place: bool = True):
        """Append ``tokens [B, S]`` at each row's own length -> ``(logits [B, S, V], hidden [B, S, d],
        cache)``. ``span`` (static) promises that no row attends past that many positions; rows
        must stay within ``T``. ``in_place`` is a hint: True when the caller carries the cache as it is from pass to
        pass, False when it rebuilds it every pass (beam search reorders it)."""
        raise NotImplementedError

    def window(self, params, history, lengths):
        """The exact next-token prediction for rows of any length, ``history [B, N]`` left-aligned
        -> ``(logits [B, V], hidden [B, d])``: a model with window ``T`` sees the last ``T`` tokens
        (past ``T`` the loops use this instead of the cache)."""
        raise NotImplementedError

    def prefill_cache(self, params, tokens, lengths, capacity: int):
        """Only the cache of :meth:`prefill` (a caller that feeds the last token itself)."""
        return self.prefill(params, tokens, lengths, capacity)[2]

    # --- the cache (defaults for a cache with a ``length`` field and batch-first leaves)
    def lengths(self, cache):
        """The positions each row holds ``[B]``."""
        return cache.length

    def truncate(self, cache, lengths):
        """Forget the positions at or past ``lengths [B]`` (speculative rollback)."""
        return cache._replace(length=jnp.asarray(lengths, jnp.int32))

    def reorder(self, cache, rows, span: int | None = None):
        """Row ``i`` becomes row ``rows[i]`` (``rows [B']``: beams, samples of one prompt)."""
        return jax.tree_util.tree_map(lambda a: jnp.take(a, rows, axis=0), cache)

    def paged(self, block_size: int, attention: str = "portable") -> PagedPool:
        """The model on a paged cache for a serving engine (see :class:`PagedPool`)."""
        raise NotImplementedError(f"{type(self).__name__} has no paged cache")

    def for_beams(self) -> DecodingModel:
        """The model beam search runs on: the same predictions from the same parameters, with a
        cache that ``reorder`` moves cheaply (beam search reorders it at every step). Default:
        this model."""
        return self

    def capacity(self, cache) -> int:
        """The positions a row of the cache has room for."""
        raise NotImplementedError

    def grow(self, cache, capacity: int):
        """The cache with room for ``capacity`` positions, its contents kept."""
        raise NotImplementedError

    # --- decoding hints
    def prepare(self, params, rows: int):
        """What a loop whose passes have ``rows`` rows passes to the methods (a backend may pack
        weights once per request). Default: ``params``."""
        return params

    def chunk_begin(self, params, cache, batch: int, chunk: int):
        """Start a chunk of single-token decode steps. A model may keep the chunk's new keys apart
        from a large read-only cache (a loop that writes into a loop-carried cache and reads it
        back in one iteration makes XLA copy it every step). Default: the cache itself."""
        return cache

    def chunk_step(self, params, cache, run, i, token):
        """Step ``i`` of a chunk: ``token`` ``[B]`` -> ``(logits [B, V], hidden [B, d], run)``."""
        logits, hidden, run = self.extend(params, run, token[:, None])
        return logits[:, 0], None if hidden is None else hidden[:, 0], run

    def chunk_end(self, cache, run, steps):
        """The cache after a chunk of ``steps`` steps."""
        return run


KV_DTYPES = ("float32", "int8")  # how a block pool stores keys and values (:func:`empty_blocks`)


class Int8Blocks(NamedTuple):
    """One layer's keys or values in a block pool, quantized: ``q`` int8 ``[num_blocks, kv_heads,
    block_size, head_dim]`` and ``scale`` float32 ``[num_blocks, kv_heads, block_size]``, one per
    head and position (symmetric: a vector ``x`` is stored as ``round(x / scale)`` with ``scale =
    max|x| / 127``, and read back as ``q * scale``). :func:`write_blocks`, :func:`copy_blocks` and
    :func:`gather_blocks` take it wherever they take a float layer."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return self.q.shape


def quantize(x):
    """``x`` ``[..., D]`` as int8 and a float32 scale ``[...]`` per vector (see :class:`Int8Blocks`)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    q = jnp.round(x / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def dequantize(q, scale, dtype=jnp.float32):
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def empty_blocks(shape, layers: int, dtype=jnp.float32) -> PagedKV:
    """A pool of ``layers`` layers of blocks of ``shape`` ``[num_blocks, kv_heads, block_size,
    head_dim]`` (zeros): float (``dtype`` a float dtype) or ``dtype="int8"``, :class:`Int8Blocks`
    (a quarter of the float32 bytes plus a scale per head and position)."""
    if isinstance(dtype, str) and dtype not in KV_DTYPES and dtype not in ("float16", "bfloat16"):
        raise ValueError(f"unknown KV cache dtype {dtype!r}: choose one of {', '.join(KV_DTYPES)}")
    if dtype == "int8":
        layer = Int8Blocks(jnp.zeros(shape, jnp.int8), jnp.zeros(shape[:-1], jnp.float32))
    else:
        layer = jnp.zeros(shape, dtype)
    layers = tuple(layer for _ in range(layers))
    return PagedKV(layers, layers)


class PagedKV(NamedTuple):
    """A paged cache's block pool: ``k[l]``, ``v[l]`` ``[num_blocks, kv_heads, block_size, head_dim]``
    per layer (float arrays, or :class:`Int8Blocks`). Row ``b``'s position ``p`` lies in block
    ``tables[b, p // block_size]`` at offset ``p % block_size``; the tables are the caller's (a
    serving engine keeps them on the host)."""

    k: tuple
    v: tuple

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(self))


class PagedPool:
    """What a serving engine needs of a model to keep its keys and values in a shared block pool
    (:meth:`DecodingModel.paged` returns one): ``T``, ``V``, ``block_size``,
    ``blocks_for(positions)``, ``empty_pool(num_blocks, dtype=float32) -> PagedKV`` (``dtype="int8"``:
    a quantized pool, :class:`Int8Blocks`) and ``pool_forward(params, pool, tables [B, max_blocks],
    lengths [B], tokens [B, S], counts [B]) -> (logits [B, S, V], hidden [B, S, d], pool)``: row
    ``b`` has ``lengths[b]`` positions in its blocks and appends the first ``counts[b]`` of its ``S``
    tokens, each attending causally over its row."""

    block_size: int

    def blocks_for(self, positions: int) -> int:
        return -(-int(positions) // self.block_size)

    def prepare(self, params, rows: int):
        """The parameters as the passes of up to ``rows`` rows take them (e.g. weights packed for
        a native layer), computed once by the engine."""
        return params


def write_blocks(pool_layer, new, tables, positions, valid):
    """``new`` ``[B, H, S, D]`` into its rows' blocks at ``positions`` ``[B, S]`` where ``valid``
    (positions whose table entry is missing or out of range are dropped); quantized on the way
    into an :class:`Int8Blocks` layer."""
    N, _, bs, _ = pool_layer.shape
    Mb = tables.shape[1]
    col = positions // bs
    entry = jnp.take_along_axis(tables, jnp.clip(col, 0, Mb - 1), axis=1)
    ok = valid & (col < Mb) & (entry >= 0) & (entry < N)
    block = jnp.where(ok, entry, N)  # out of range: dropped
    rows = jnp.transpose(new, (0, 2, 1, 3))  # [B, S, H, D]
    if isinstance(pool_layer, Int8Blocks):
        q, scale = quantize(rows)
        return Int8Blocks(pool_layer.q.at[block, :, positions % bs].set(q, mode="drop"),
                          pool_layer.scale.at[block, :, positions % bs].set(scale, mode="drop"))
    return pool_layer.at[block, :, positions % bs].set(rows.astype(pool_layer.dtype), mode="drop")


def copy_blocks(pool: PagedKV, src, dst) -> PagedKV:
    """Block ``src[i]`` copied into block ``dst[i]`` in every layer (the copies on write of
    :meth:`jaxdecode.serving.blocks.BlockAllocator.append`; every source is read before any write)."""
    src = jnp.asarray(src, jnp.int32).reshape(-1)
    dst = jnp.asarray(dst, jnp.int32).reshape(-1)
    if src.shape != dst.shape:
        raise ValueError(f"copy_blocks: {src.shape[0]} sources for {dst.shape[0]} destinations")
    move = lambda a: a.at[dst].set(a[src], mode="drop")
    return jax.tree_util.tree_map(move, pool)


def gather_blocks(pool_layer, tables, dtype=jnp.float32):
    """The blocks ``tables`` ``[B, cols]`` lists, as one dense ``[B, H, cols * block_size, D]``
    (an :class:`Int8Blocks` layer read back as ``dtype``)."""
    idx = jnp.clip(tables, 0, pool_layer.shape[0] - 1)
    if isinstance(pool_layer, Int8Blocks):
        g = dequantize(pool_layer.q[idx], pool_layer.scale[idx], dtype)
    else:
        g = pool_layer[idx]  # [B, cols, H, bs, D]
    B, cols, H, bs, D = g.shape
    return jnp.transpose(g, (0, 2, 1, 3, 4)).reshape(B, H, cols * bs, D)


def prefill_by_extend(model, params, tokens, lengths, capacity):
    """:meth:`DecodingModel.prefill` for a model whose ``extend`` writes a whole prompt into an
    empty cache: the logits and hidden state after each row's last real token."""
    B, P = tokens.shape
    if capacity < P:
        raise ValueError(f"prefill: capacity {capacity} is below the prompt width {P}")
    logits, hidden, cache = model.extend(params, model.empty_cache(B, capacity), tokens, span=P)
    lengths = jnp.asarray(lengths, jnp.int32)
    at = jnp.maximum(lengths - 1, 0)[:, None, None]
    last = lambda a: jnp.take_along_axis(a, at, axis=1)[:, 0]
    return last(logits), last(hidden), model.truncate(cache, lengths)


def window_by_forward(forward, T: int, params, history, lengths):
    """:meth:`DecodingModel.window` from a full causal ``forward(params, tokens) -> (logits,
    hidden)``: each row's last ``T`` tokens (left-aligned ``history``), positions from 0."""
    N = history.shape[1]
    W = min(N, T)
    lengths = jnp.asarray(lengths, jnp.int32)
    start = jnp.clip(lengths - W, 0, N - W)
    windows = jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (W,)))(history, start)
    logits, hidden = forward(params, windows)
    at = jnp.clip(lengths - start - 1, 0, W - 1)[:, None, None]
    take = lambda a: jnp.take_along_axis(a, at, axis=1)[:, 0]
    return take(logits), take(hidden)


def _split(out):
    """A logits function's output: logits, or (logits, hidden)."""
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, None


class TokenCache(NamedTuple):
    """The cache of :class:`FunctionModel`: every row's tokens so far."""

    tokens: jax.Array  # [B, capacity] int32, left-aligned, real up to length
    length: jax.Array  # [B] int32


@dataclasses.dataclass(frozen=True)
class FunctionModel(DecodingModel):
    """Decode your own model: any JAX function ``logits_fn(params, tokens [B, t]) -> logits [B, t, V]``
    (or ``(logits, hidden [B, t, d])``) with no cache of its own.

    ``logits_fn`` must be causal (position ``t``'s output depends only on tokens ``0..t``) and
    number positions from 0 at the first token it is given. ``T`` is its window: past ``T``
    tokens it is given each row's last ``T`` (as the reference model's forward does). The "cache"
    keeps the tokens; every pass runs the function over the filled span, so a step costs a whole
    forward: fine for small models, tests and studies, and every loop runs on it unchanged.
    """

    logits_fn: Callable[..., Any]
    V: int
    T: int = 1024

    def __post_init__(self):
        for name in ("V", "T"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"FunctionModel: {name} must be a positive integer, got {value!r}")

    def empty_cache(self, batch, capacity):
        return TokenCache(jnp.zeros((batch, capacity), jnp.int32), jnp.zeros((batch,), jnp.int32))

    def capacity(self, cache):
        return cache.tokens.shape[1]

    def grow(self, cache, capacity):
        pad = capacity - cache.tokens.shape[1]
        if pad < 0:
            raise ValueError(f"grow: capacity {capacity} is below the current {cache.tokens.shape[1]}")
        return cache if pad == 0 else cache._replace(tokens=jnp.pad(cache.tokens, ((0, 0), (0, pad))))

    def prefill(self, params, tokens, lengths, capacity):
        B, P = tokens.shape
        lengths = jnp.asarray(lengths, jnp.int32)
        logits, hidden = _split(self.logits_fn(params, tokens))
        at = jnp.maximum(lengths - 1, 0)[:, None, None]
        last = lambda a: None if a is None else jnp.take_along_axis(a, at, axis=1)[:, 0]
        cache = TokenCache(jnp.pad(tokens.astype(jnp.int32), ((0, 0), (0, capacity - P))), lengths)
        return last(logits), last(hidden), cache

    def extend(self, params, cache, tokens, span=None, in_place=True):
        B, S = tokens.shape
        # rows stay within T on the cache path: the function never sees more than T tokens
        span = min(self.capacity(cache) if span is None else span, self.T)
        put = jax.vmap(lambda row, new, at: jax.lax.dynamic_update_slice(row, new, (at,)))
        history = put(cache.tokens, tokens.astype(jnp.int32), cache.length)
        logits, hidden = _split(self.logits_fn(params, history[:, :span]))
        idx = jnp.clip(cache.length[:, None] + jnp.arange(S)[None, :], 0, span - 1)  # [B, S]
        take = lambda a: None if a is None else jnp.take_along_axis(a, idx[:, :, None], axis=1)
        return take(logits), take(hidden), TokenCache(history, cache.length + S)

    def window(self, params, history, lengths):
        N = history.shape[1]
        W = min(N, self.T)
        start = jnp.clip(lengths - W, 0, N - W)
        windows = jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (W,)))(history, start)
        logits, hidden = _split(self.logits_fn(params, windows))
        idx = jnp.clip(lengths - start - 1, 0, W - 1)[:, None, None]
        at = lambda a: None if a is None else jnp.take_along_axis(a, idx, axis=1)[:, 0]
        return at(logits), at(hidden)


def as_decoding_model(model, *, V: int | None = None, T: int = 1024) -> DecodingModel:
    """``model`` if it is a :class:`DecodingModel`, else a :class:`FunctionModel` around the
    function ``model`` (``V`` required)."""
    if isinstance(model, DecodingModel):
        return model
    if callable(model):
        if V is None:
            raise ValueError("a logits function needs its vocabulary size V")
        return FunctionModel(model, V, T)
    raise TypeError(f"expected a DecodingModel or a logits function, got {type(model).__name__}")
