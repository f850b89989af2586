"""Weights placed on huge pages of the host's memory, for the native CPU path.

A decode step at a small batch streams every weight from memory once. Over ordinary 4 KB pages
that is a new address translation every 4 KB (131,000 a step for the 106M Llama in float32),
and on a virtual machine each miss walks two page tables; the hardware prefetchers also stop at
each page's end. Linux's transparent huge pages (2 MB) remove almost all of it, but only for
memory that asks for them (``madvise``, the kernel's default mode) or in ``always`` mode, and XLA's
allocator does not ask.

:func:`place` copies a host array into memory mapped here and advised ``MADV_HUGEPAGE``, and
gives it to JAX without a copy (``jax.device_put`` of an aligned host array on the CPU backend
aliases it and keeps it alive). The arrays share slabs of :data:`SLAB` bytes, aligned to 2 MB,
each array at a 4 KB boundary, so that small matrices do not each round up to a huge page. A slab
is unmapped when the last array in it is freed (and, for the one being filled, when the next one
replaces it).

Where huge pages are unavailable (not Linux, no ``MADV_HUGEPAGE``, another backend) or
``JAXDECODE_HUGEPAGES=0`` (for comparisons), :func:`place` is ``jnp.asarray``. The values are
the same either way; only where they live differs (``docs/benchmarks.md`` has the measurement).
"""

from __future__ import annotations

import mmap
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

HUGE = 2 << 20  # a huge page on x86-64 and most arm64 kernels
SLAB = 64 << 20  # arrays are packed into slabs of this size (a larger array gets its own)
ALIGN = 4096
SMALLEST = 256 << 10  # smaller arrays stay in XLA's memory (norms, scales, biases)

_lock = threading.Lock()
_slab: list = [None, 0]  # the slab being filled (a uint8 array over an mmap) and its next offset


def enabled() -> bool:
    """Whether :func:`place` puts arrays on huge pages in this process."""
    flag = os.environ.get("JAXDECODE_HUGEPAGES", "1").strip().lower()
    if flag not in ("0", "1"):
        raise ValueError(f"JAXDECODE_HUGEPAGES must be 0 or 1, got {flag!r}")
    return flag == "1" and hasattr(mmap, "MADV_HUGEPAGE") and jax.default_backend() == "cpu"


def _mapping(nbytes: int) -> np.ndarray:
    size = -(-nbytes // HUGE) * HUGE
    m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(m, np.uint8)
    start = -raw.ctypes.data % HUGE  # the first 2 MB boundary inside the mapping
    m.madvise(mmap.MADV_HUGEPAGE, start, size)
    return raw[start:start + size]


def _room(nbytes: int) -> np.ndarray:
    """``nbytes`` of huge-page memory at a 4 KB boundary."""
    need = -(-nbytes // ALIGN) * ALIGN
    if need > SLAB // 2:
        return _mapping(need)[:nbytes]
    with _lock:
        slab, at = _slab
        if slab is None or at + need > slab.size:
            slab, at = _mapping(SLAB), 0
        _slab[:] = [slab, at + need]
    return slab[at:at + nbytes]


def place(a) -> jax.Array:
    """Host array ``a`` as a JAX array on the default (CPU) device, on huge pages where they
    are available and ``a`` is at least :data:`SMALLEST` bytes."""
    a = np.asarray(a)
    if a.nbytes < SMALLEST or not enabled():
        return jnp.asarray(a)
    view = _room(a.nbytes).view(a.dtype).reshape(a.shape)
    view[...] = a
    return jax.device_put(view)


__all__ = ["enabled", "place"]
