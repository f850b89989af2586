"""The reference character transformer behind the decoding-model interface.

:class:`CharLMDecoder` adapts the Flax ``CharLM`` (:mod:`jaxdecode.models.charlm.transformer`) to
:class:`~jaxdecode.models.base.DecodingModel`. Its backend is fixed when it is built: ``native``
runs decode passes through the C++ CPU layer (:mod:`jaxdecode.native.kernels`), ``portable`` runs the
model's own ``jax.numpy`` code, which is what GPU and TPU users get. The backend is a field of the
(hashable) decoder, so it is part of every compiled program's cache key.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxdecode.native import kernels
from jaxdecode.models.charlm import transformer as M
from jaxdecode.models.base import DecodingModel
from jaxdecode.models.charlm.paged import PagedCharLM, Prepared, unpack as _unpack


BEAM_BLOCK = 16  # positions per block of the paged cache beam search runs on


@dataclasses.dataclass(frozen=True)
class CharLMDecoder(DecodingModel):
    """``CharLM`` of shape ``cfg`` on a backend (``native=True``: the C++ CPU layer)."""

    cfg: M.ModelConfig
    native: bool = False
    why: str = dataclasses.field(default="", compare=False)  # how the backend was chosen

    @classmethod
    def build(cls, cfg: M.ModelConfig, backend: str | None = None) -> CharLMDecoder:
        """Choose the backend once: ``"native"``, ``"portable"`` or ``"auto"`` (default
        ``$JAXDECODE_KERNELS``; see :func:`jaxdecode.native.kernels.select`)."""
        native, why = kernels.select(backend)
        return cls(cfg, native, why)

    @property
    def V(self):
        return self.cfg.V

    @property
    def T(self):
        return self.cfg.T

    @property
    def backend(self):
        return "native" if self.native else "portable"

    @property
    def attention_heads(self):
        return self.cfg.heads

    @property
    def reads_only_filled(self):
        # the native attention reads each row only up to its length
        return self.native

    def with_backend(self, backend: str) -> CharLMDecoder:
        return CharLMDecoder.build(self.cfg, backend)

    def paged(self, block_size, attention="portable"):

        return PagedCharLM(self.cfg, int(block_size), attention)

    def for_beams(self):
        """Beams run on the paged cache (:class:`jaxdecode.models.charlm.paged.PagedCharLM`, blocks of
        :data:`BEAM_BLOCK` positions, attention on this decoder's backend): a reorder copies
        block-table rows and each beam's partly filled last block, where the dense cache copies
        every beam's filled span at every step (``docs/benchmarks.md``, beam search)."""

        return PagedCharLM.from_decoder(self, BEAM_BLOCK, "native" if self.native else "portable")

    # --- the model
    def prepare(self, params, rows: int):
        """On the native backend, passes of up to 1,024 rows run each layer as one call on weights
        packed once per parameter set (:func:`jaxdecode.models.charlm.transformer.packed_params`)."""
        params, _ = _unpack(params)
        packed = M.packed_params(params) if self.native and kernels.fuses_rows(rows) else None
        return Prepared((params, packed))

    def empty_cache(self, batch, capacity):
        return M.empty_cache(self.cfg, batch, capacity)

    def prefill(self, params, tokens, lengths, capacity):
        params, packed = _unpack(params)
        return M.prefill(params, self.cfg, tokens, lengths, capacity, packed, native=self.native,
                         return_hidden=True)

    def prefill_cache(self, params, tokens, lengths, capacity):
        params, packed = _unpack(params)
        return M.prefill_cache(params, self.cfg, tokens, lengths, capacity, packed, native=self.native)

    def extend(self, params, cache, tokens, span=None, in_place=True):
        params, packed = _unpack(params)
        return M.extend(params, self.cfg, cache, tokens, span, packed, in_place, native=self.native,
                        return_hidden=True)

    def window(self, params, history, lengths):
        params, _ = _unpack(params)
        return M.window_logits(params, self.cfg, history, lengths, return_hidden=True)

    # --- the cache
    def capacity(self, cache):
        return cache.capacity

    def grow(self, cache, capacity):
        return M.grow_cache(cache, capacity)

    def reorder(self, cache, rows, span=None):
        """Rows reordered; with ``span``, only the first ``span`` positions are copied (those past
        it lie beyond every row's length: garbage, overwritten before it is read)."""
        def gather(c):  # [B, H, capacity, hd]
            if span is None or span >= c.shape[2]:
                return jnp.take(c, rows, axis=0)
            return jax.lax.dynamic_update_slice(c, jnp.take(c[:, :, :span], rows, axis=0), (0, 0, 0, 0))

        return M.KVCache(tuple(map(gather, cache.k)), tuple(map(gather, cache.v)),
                         jnp.take(cache.length, rows, axis=0))

    # --- chunks of decode steps
    def _in_place(self, params, batch):
        _, packed = _unpack(params)
        return self.native and packed is not None and kernels.fuses_rows(batch)

    def chunk_begin(self, params, cache, batch, chunk):
        # One native call per layer writes the step's keys into the cache in place, and the loop
        # carries the cache. Otherwise they go to a small chunk buffer, merged after the chunk.
        if self._in_place(params, batch):
            return cache
        return M.empty_local(self.cfg, batch, chunk, cache.k[0].dtype)

    def chunk_step(self, params, cache, run, i, token):
        p, packed = _unpack(params)
        if self._in_place(params, token.shape[0]):
            logits, hidden, run = M.extend(p, self.cfg, run, token[:, None], None, packed, True, native=True,
                                           return_hidden=True)
            return logits[:, 0], hidden[:, 0], run
        return M.chunk_step(p, self.cfg, cache, run, i, token, packed, native=self.native)

    def chunk_end(self, cache, run, steps):
        if run is cache or isinstance(run, M.KVCache) and run.k[0].ndim == 4:
            return run
        return M.merge_chunk(cache, run, steps)


@functools.cache
def decoder_for(cfg: M.ModelConfig, backend: str | None = None) -> CharLMDecoder:
    """The decoder of ``cfg`` on ``backend`` (chosen once per process and setting)."""
    return CharLMDecoder.build(cfg, backend)
