"""The native CPU layer: C++ decode operations called through XLA's FFI (``jax.ffi``).

XLA CPU turns the attention of a decode step (one or a few queries per row against a long KV
cache) into a batched product over ``B * heads`` tiny matrices, after copying the attended part of
the cache out of the cache buffer. :func:`attention` instead calls a C++ kernel that reads every
row's keys and values in place, only up to that row's own length. For decode passes (a step at
any batch up to 1,024 rows, a speculative verify pass, a beam step), :func:`decode_layer` runs a
whole decoder layer as one call on weights packed by :func:`pack`. :func:`dense` /
:func:`packed_dense` serve single products.

This module only builds, loads and calls the native code; it has no ``jax.numpy`` fallback. The
portable computation is the model's own code (:mod:`jaxdecode.models.charlm.transformer`), which the native layer is
tested against, and which every other backend (GPU, TPU) runs. Whether a model uses this layer
is decided once, when it is built (:func:`select`), never behind jit's back.

The library is compiled on first use with the system's C++ compiler (``-O3 -march=native``)
from ``csrc/*.cc`` against the XLA FFI headers that ship with jaxlib, and cached under
``$JAXDECODE_CACHE/kernels`` by a hash of the sources, jaxlib's version, the CPU and
``$JAXDECODE_CXXFLAGS`` (extra compiler flags, for sanitizer builds).
``JAXDECODE_KERNELS`` selects the default backend of loaded models: ``auto`` (the native layer
on the CPU backend if it builds), ``0`` (never) or ``1`` (required: an error if it cannot be
built or the default backend is not the CPU).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.io import paths

_CSRC = Path(__file__).parent / "csrc"
_TARGET = "jaxdecode_decode_attention"
_DENSE = "jaxdecode_dense"
_PACKED = "jaxdecode_packed_dense"
_LAYER = "jaxdecode_decode_layer"
_PAGED_LAYER = "jaxdecode_paged_layer"
_HF_LAYER = "jaxdecode_hf_layer"
_LINEAR = {"float32": ("jaxdecode_linear_f32", "JaxdecodeLinearF32"),
           "bfloat16": ("jaxdecode_linear_bf16", "JaxdecodeLinearBF16"),
           "float16": ("jaxdecode_linear_f16", "JaxdecodeLinearF16"),
           "int8": ("jaxdecode_linear_s8", "JaxdecodeLinearS8")}
_LINEAR4 = ("jaxdecode_linear_q4", "JaxdecodeLinearQ4")  # int4 in groups of 32 (csrc/linear4.h)
GROUP4 = 32
PAGED_TARGET = "jaxdecode_paged_attention"  # called by the CharLM's paged form (models/charlm/paged.py)
PAGED_INT8_TARGET = "jaxdecode_paged_attention_int8"  # the same over an int8 pool (models/base.py, Int8Blocks)
DENSE_MAX_ROWS = 2  # from 3 rows on XLA's own matrix product is as fast or faster (measured)
PACKED_MAX_ROWS = 4  # with packed weights (packed_dense), up to here the kernel beats XLA
# decode_layer: one native call per layer beats XLA's operations at every batch measured (1 to
# 256 rows; from 64 rows the call runs as a pipeline, see csrc/layer.cc). The limit bounds the
# call's scratch memory (10 * d floats a row).
LAYER_MAX_ROWS = 1024
PREFILL_MAX_ROWS = 64  # prompts of up to this many positions in all are prefilled through it


class KernelError(RuntimeError):
    """The native kernel was required (``JAXDECODE_KERNELS=1``) but could not be built."""


def _mode() -> str:
    mode = os.environ.get("JAXDECODE_KERNELS", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise KernelError(f"JAXDECODE_KERNELS must be auto, 0 or 1, got {mode!r}")
    return mode


def _cpu_name() -> str:
    """The CPU's model name and feature flags (the library is built with -march=native)."""
    found = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")) and line not in found:
                    found.append(line)
                if len(found) == 2:
                    break
    except OSError:
        pass
    return "".join(found) or platform.processor()


def _sources() -> list[Path]:
    """The C++ sources of the native layer (compiled together into one library) and its headers."""
    return sorted(_CSRC.glob("*.cc")) + sorted(_CSRC.glob("*.h"))


def _build_dir() -> Path:
    """``$JAXDECODE_CACHE/kernels``; with caching off, a temporary folder for this process."""
    d = paths.cache_dir("kernels")
    if d is None:
        d = Path(tempfile.gettempdir()) / f"jaxdecode-kernels-{os.getpid()}"
    return d


def build(verbose: bool = False) -> Path:
    """Compile the native layer (if not already built) and return the shared library's path."""
    import jaxlib

    sources = _sources()
    h = hashlib.sha256()
    for f in sources:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    extra = os.environ.get("JAXDECODE_CXXFLAGS", "").split()  # e.g. -fsanitize=address (docs/testing.md)
    h.update(jaxlib.__version__.encode() + _cpu_name().encode() + platform.machine().encode())
    h.update("\0".join(extra).encode())
    out = _build_dir() / f"native-{h.hexdigest()[:16]}.so"
    if out.exists():
        return out
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise KernelError("no C++ compiler found (set CXX or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # one build at a time per library: a second process waits, then finds the first one's library
    with paths.lock(out.with_name(out.name + ".lock")):
        if out.exists():
            return out
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        flags = ["-O3", "-march=native", "-std=c++17", "-fPIC", *extra]
        print("jaxdecode: compiling the native CPU kernels (once, under a minute)...", file=sys.stderr, flush=True)
        try:
            with tempfile.TemporaryDirectory(dir=out.parent) as objs:
                # one compiler per source file, as many at once as there are cores, then one link
                units = [f for f in sources if f.suffix == ".cc"]
                jobs = [[cxx, *flags, f"-I{jax.ffi.include_dir()}", f"-I{_CSRC}", "-c", str(f), "-o",
                         str(Path(objs) / (f.stem + ".o"))] for f in units]
                run = lambda cmd: subprocess.run(cmd, capture_output=True, text=True, check=False)
                with concurrent.futures.ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
                    results = list(pool.map(run, jobs))
                if all(r.returncode == 0 for r in results):
                    results.append(run([cxx, *flags, "-shared", *[cmd[-1] for cmd in jobs], "-o", tmp]))
                failed = next((r for r in results if r.returncode != 0), None)
                if failed is not None:
                    raise KernelError(f"compiling the native layer ({_CSRC}) failed:\n{failed.stderr[-2000:]}")
            os.replace(tmp, out)  # atomic: an interrupted build never leaves half a library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    if verbose:
        print(f"built {out}")
    return out


@functools.cache
def _library() -> str | None:
    """Build and register the native layer once per process; None, or why it is unavailable."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxdecodeDecodeAttention), platform="cpu")
        jax.ffi.register_ffi_target(_DENSE, jax.ffi.pycapsule(lib.JaxdecodeDense), platform="cpu")
        jax.ffi.register_ffi_target(_PACKED, jax.ffi.pycapsule(lib.JaxdecodePackedDense), platform="cpu")
        jax.ffi.register_ffi_target(_LAYER, jax.ffi.pycapsule(lib.JaxdecodeDecodeLayer), platform="cpu")
        jax.ffi.register_ffi_target(_PAGED_LAYER, jax.ffi.pycapsule(lib.JaxdecodePagedLayer), platform="cpu")
        jax.ffi.register_ffi_target(_HF_LAYER, jax.ffi.pycapsule(lib.JaxdecodeHFLayer), platform="cpu")
        for target, symbol in (*_LINEAR.values(), _LINEAR4):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        jax.ffi.register_ffi_target(PAGED_TARGET, jax.ffi.pycapsule(lib.JaxdecodePagedAttention), platform="cpu")
        jax.ffi.register_ffi_target(PAGED_INT8_TARGET, jax.ffi.pycapsule(lib.JaxdecodePagedAttentionInt8),
                                    platform="cpu")
        return None
    except Exception as e:  # no compiler, failed build, unloadable library
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def select(mode: str | None = None) -> tuple[bool, str]:
    """Decide once whether a model uses the native layer: ``(native, why)``.

    ``mode``: ``"auto"``, ``"0"``/``"portable"`` or ``"1"``/``"native"``; default
    ``$JAXDECODE_KERNELS``. Off the CPU backend nothing is built. ``"1"`` raises
    :class:`KernelError` (one line) when the native layer cannot be used.
    """
    source = "JAXDECODE_KERNELS" if mode is None else "backend"
    mode = _mode() if mode is None else {"portable": "0", "native": "1"}.get(mode, mode)
    if mode not in ("auto", "0", "1"):
        raise KernelError(f"backend must be auto, native or portable, got {mode!r}")
    if mode == "0":
        return False, ("portable: the native layer is turned off (JAXDECODE_KERNELS=0)" if source != "backend"
                       else "portable: chosen by the caller")
    platform_name = jax.default_backend()
    if platform_name != "cpu":
        if mode == "1":
            raise KernelError(f"the native layer ({source}=native) needs the CPU backend, but JAX runs on {platform_name}")
        return False, f"portable: JAX runs on {platform_name} (the native layer is for the CPU only)"
    failure = _library()
    if failure is not None:
        if mode == "1":
            raise KernelError(f"the native CPU layer is required ({source}=native) but unavailable: {failure}")
        return False, f"portable: the native CPU layer could not be built ({failure})"
    why = {("JAXDECODE_KERNELS", "1"): "required by JAXDECODE_KERNELS=1", ("backend", "1"): "chosen by the caller"}.get(
        (source, mode), f"built and loaded ({source}=auto)")
    return True, f"native: the C++ CPU layer, {why}"


def available() -> bool:
    """Whether the native layer can be used in this process (CPU backend, built and loaded)."""
    return jax.default_backend() == "cpu" and _library() is None


def fuses_rows(rows: int) -> bool:
    """Whether a native decode pass of ``rows`` rows runs each layer as one :func:`decode_layer` call."""
    return 0 < rows <= LAYER_MAX_ROWS


def check_float32(*args):
    """Raise TypeError unless every floating operand is float32 (what the native layer computes in)."""
    for a in args:
        if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != jnp.float32:
            raise TypeError(f"the native CPU layer computes in float32, got an operand of dtype {a.dtype}")


def attention(q, k, v, lim, k2, v2, n2, scale: float):
    """Softmax attention of queries ``q`` ``[B, H, S, D]`` over two key/value buffers, natively.

    Query ``(b, s)`` sees positions ``t < lim[b, s]`` of ``k, v`` ``[B, H, C, D]`` and
    ``t < n2[b, s]`` of ``k2, v2`` ``[B * H, L, D]`` (``lim``, ``n2``: ``[B, S]`` int32). Every
    query must see at least one position. The model's portable equivalent is
    :func:`jaxdecode.models.charlm.transformer.attend`.
    """
    lim = jnp.asarray(lim, jnp.int32)
    n2 = jnp.asarray(n2, jnp.int32)
    check_float32(q, k, v, k2, v2)
    return _ffi(_TARGET, q.shape, scale=np.float32(scale))(q, k, v, lim, k2, v2, n2)


def _registered() -> None:
    """Build and register the library before a call names its targets (a call made without
    :func:`select` first, e.g. directly from a test); a KernelError when it cannot be built."""
    failure = _library()
    if failure is not None:
        raise KernelError(f"the native CPU layer is unavailable: {failure}")


def _ffi(target: str, shape, **attrs):
    _registered()
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, jnp.float32), vmap_method="sequential")
    return lambda *args: call(*args, **attrs)


def _rows_kernel(target: str, x, N: int):
    """The native product ``target`` on ``x`` ``[..., K]`` flattened to rows, output ``[..., N]``."""
    lead, K = x.shape[:-1], x.shape[-1]
    M = math.prod(lead)
    call = _ffi(target, (M, N))
    return lambda x, w, b: call(x.reshape(M, K), w, b).reshape(*lead, N)


def dense(x, w, b):
    """``x @ w + b`` natively, for ``x`` ``[..., K]`` (a few rows), ``w`` ``[K, N]`` (``N % 8 == 0``),
    ``b`` ``[N]``: the kernel streams the weights in order, split over XLA's threads (a one-row
    product is bound by reading the weights, which XLA CPU does on one thread)."""
    check_float32(x, w, b)
    return _rows_kernel(_DENSE, x, w.shape[1])(x, w, b)


def pack(w):
    """``w`` ``[K, N]`` in panels of 16 columns, ``[N / 16, K, 16]``, for :func:`packed_dense`."""
    K, N = w.shape
    return w.reshape(K, N // 16, 16).transpose(1, 0, 2)


def unpack(wp):
    """The inverse of :func:`pack`."""
    P, K, _ = wp.shape
    return wp.transpose(1, 0, 2).reshape(K, 16 * P)


def pack4(u, scale):
    """Int4 weights ``u`` ``[K, N]`` (uint8 values 0..15, the weight ``(u - 8) * scale``) and their
    float16 scales ``[K / 32, N]`` (one per column and group of 32 along ``K``) packed for
    :func:`linear`: ``(up [N / 16, K / 2, 16] uint8, sp [N / 16, K / 32, 16] float16)``. Each
    panel of 16 columns holds, per group of 32 along ``K``, four blocks of 64 bytes; block ``t``'s
    bytes ``4c .. 4c + 3`` are column ``c``'s, byte ``i`` holding ``u[32g + 8t + i]`` in its low four
    bits and ``u[32g + 8t + 4 + i]`` in its high four (csrc/linear4.h: one instruction sums four
    weights of each of 16 columns). numpy in, numpy out."""
    u = np.asarray(u, np.uint8)
    K, N = u.shape
    G, P = K // GROUP4, N // 16
    parts = (u & 15).reshape(G, 4, 2, 4, P, 16)  # (g, t, low/high, i, panel, c)
    blocks = parts[:, :, 0] | (parts[:, :, 1] << 4)  # (g, t, i, panel, c)
    up = np.ascontiguousarray(blocks.transpose(3, 0, 1, 4, 2).reshape(P, K // 2, 16))
    scale = np.asarray(scale, np.float16)
    sp = np.ascontiguousarray(scale.reshape(G, P, 16).transpose(1, 0, 2))
    return up, sp


def unpack4(up, sp):
    """The inverse of :func:`pack4`: ``(u [K, N] uint8, scale [K / 32, N] float16)``."""
    up, sp = np.asarray(up), np.asarray(sp)
    P, half, _ = up.shape
    K, G = 2 * half, 2 * half // GROUP4
    blocks = up.reshape(P, G, 4, 16, 4).transpose(1, 2, 4, 0, 3)  # (g, t, i, panel, c)
    u = np.stack([blocks & 15, blocks >> 4], axis=2).reshape(K, 16 * P)
    return u, sp.transpose(1, 0, 2).reshape(G, 16 * P)


def packed_dense(x, wp, b):
    """``x @ w + b`` natively with ``wp = pack(w)`` (for a few rows)."""
    check_float32(x, wp, b)
    return _rows_kernel(_PACKED, x, 16 * wp.shape[0])(x, wp, b)


def linear(x, wp, scale=None):
    """``x @ W`` natively for ``x`` ``[..., K]`` float32 (any number of rows) and ``W`` ``[K, N]``
    packed by :func:`pack` in the dtype it is kept in: float32, bfloat16, float16, or int8 with
    ``scale`` ``[N]`` float32 (``W = Q * scale`` per column); or int4 packed by :func:`pack4`
    (``wp`` uint8, ``scale`` its float16 scales). The kernel widens each weight to
    float32 as it reads it (int4: sums each group of 32 in integers against the rows split into
    three signed bytes, csrc/linear4.h), and reads each panel of 16 columns once for all the rows
    (csrc/linear.cc).
    A row's result does not depend on the other rows of the call."""
    name = jnp.dtype(wp.dtype).name
    if name == "uint8":  # int4, two weights a byte
        if scale is None or jnp.dtype(scale.dtype) != jnp.float16:
            raise TypeError("the native linear layer needs float16 scales with int4 weights")
        check_float32(x)
        lead, K = x.shape[:-1], x.shape[-1]
        M, N = math.prod(lead), 16 * wp.shape[0]
        _registered()
        call = jax.ffi.ffi_call(_LINEAR4[0], jax.ShapeDtypeStruct((M, N), jnp.float32), vmap_method="sequential")
        return call(x.reshape(M, K), wp, scale).reshape(*lead, N)
    if name not in _LINEAR:
        raise TypeError(f"the native linear layer takes float32, bfloat16, float16, int8 or int4 (uint8) "
                        f"weights, got {name}")
    if (name == "int8") != (scale is not None):
        raise TypeError("the native linear layer needs a scale with int8 weights, and only with them")
    check_float32(x)
    scale = jnp.zeros((0,), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
    lead, K = x.shape[:-1], x.shape[-1]
    M, N = math.prod(lead), 16 * wp.shape[0]
    _registered()
    call = jax.ffi.ffi_call(_LINEAR[name][0], jax.ShapeDtypeStruct((M, N), jnp.float32), vmap_method="sequential")
    return call(x.reshape(M, K), wp, scale).reshape(*lead, N)


def hf_layer(x, pos, cos, sin, weights: dict, k, v, heads: int, eps: float, scale: float,
             window: int | None = None):
    """One Hugging Face decoder layer of the Llama kind (RMSNorm before each block, rotate-half
    rotation, grouped-query attention, a SiLU-gated MLP; optional q/k/v biases and per-head q/k
    norms) as a single native call (csrc/hf_layer.cc), for any number of new positions per row.

    ``x`` ``[B, S, d]`` float32 at positions ``pos`` ``[B, S]``; ``cos``, ``sin`` ``[B, S, D / 2]``
    the rotation there; ``weights``: ``norm1_w``, ``norm2_w`` ``[d]``, ``qkv`` and ``gu`` (gate
    then up) and ``wo``, ``w_down``, each ``{"packed": [N / 16, K, 16], "scale"?}`` in one dtype
    (:func:`pack`; int8 with its scale; or int4 by :func:`pack4`), and optionally ``bqkv`` ``[N]``, ``q_norm``, ``k_norm``
    ``[D]``. Each row's new keys and values are written into the cache ``k, v`` ``[B, KV, C, D]``
    at its positions (in place where XLA can donate it), and position ``pos[b, s]`` attends to the
    cache's positions ``0..pos[b, s]`` (the last ``window`` of them, if given); a row whose
    positions run past the cache is written at its end (as ``dynamic_update_slice`` writes) and sees
    all of it. Returns
    ``(y [B, S, d], k, v)``. Each product is summed as :func:`linear` sums it."""
    B, S, d = x.shape
    R = B * S
    check_float32(x, k, v, cos, sin)
    none = jnp.zeros((0,), jnp.float32)
    mats = []
    for name in ("qkv", "wo", "gu", "w_down"):
        w = weights[name]
        s = w.get("scale")
        if s is not None and jnp.dtype(w["packed"].dtype) != jnp.uint8:  # int4's stay float16
            s = jnp.asarray(s, jnp.float32)
        mats += [w["packed"], none if s is None else s]
    vec = lambda name: jnp.asarray(weights[name], jnp.float32) if weights.get(name) is not None else none
    kv = jax.ShapeDtypeStruct(k.shape, jnp.float32)
    _registered()
    call = jax.ffi.ffi_call(_HF_LAYER, (jax.ShapeDtypeStruct((R, d), jnp.float32), kv, kv),
                            vmap_method="sequential", input_output_aliases={17: 1, 18: 2})
    y, k, v = call(x.reshape(R, d), jnp.asarray(pos, jnp.int32).reshape(R), cos.reshape(R, -1),
                   sin.reshape(R, -1), vec("norm1_w"), vec("bqkv"), vec("q_norm"), vec("k_norm"), *mats[:4],
                   vec("norm2_w"), *mats[4:], k, v, rows_per_batch=np.int64(S), heads=np.int64(heads),
                   window=np.int64(window or 0), eps=np.float32(eps), scale=np.float32(scale))
    return y.reshape(B, S, d), k, v


SCHEDULES = {"auto": 0, "phases": 1, "pipeline": 2}
WRITES = {None: 0, "cache": 1, "buffer": 2}


def decode_layer(x, weights, k, v, lim, k2, v2, n2, eps: float, schedule: str = "auto",
                 write: str | None = None):
    """One pre-norm decoder layer for a few new positions per row, as a single native call.

    ``x`` ``[B, S, d]`` are the inputs at ``S`` new positions of each row; ``weights`` is the
    tuple ``(ln1 scale, ln1 bias, qkv kernel, qkv bias, proj kernel, proj bias, ln2 scale, ln2 bias,
    ff1 kernel, ff1 bias, ff2 kernel, ff2 bias)`` with the four kernels packed by :func:`pack`.
    New position ``s`` of row ``b`` attends to positions ``t < lim[b, s]`` of the cache ``k, v``
    ``[B, H, C, hd]``, ``t < n2[b, s]`` of the buffer ``k2, v2`` ``[B * H, L, hd]``, and the new
    positions ``0..s`` of its row. Returns the layer's output ``[B, S, d]`` and the new positions'
    keys and values ``[B, H, S, hd]``, for the caller to write into its cache; or, with ``write``
    ``"cache"`` (``"buffer"``), the cache ``k, v`` (the buffer ``k2, v2``) with the new positions
    written at ``lim[:, 0]`` (``n2[:, 0]``), in place where XLA can donate it. The ``S`` new
    positions must fit there (``lim[:, 0] + S <= C``); the queries then see exactly what they
    would see with ``write=None``. The model's portable equivalent is
    :meth:`jaxdecode.models.charlm.transformer.Block.decode`, which the tests compare this with.

    ``schedule`` (``"auto"``, ``"phases"`` or ``"pipeline"``) picks how the native call shares the
    work between threads (``"auto"``: a pipeline over blocks of rows from 64 rows on); it changes
    the order of some sums, hence the last bits of some results, never what is computed.
    """
    B, S, d = x.shape
    H, D = k.shape[1], k.shape[3]
    lim = jnp.asarray(lim, jnp.int32)
    n2 = jnp.asarray(n2, jnp.int32)
    check_float32(x, k, v, k2, v2, *weights)
    mode = WRITES[write]
    shape = {0: (B, H, S, D), 1: k.shape, 2: k2.shape}[mode]
    kv = jax.ShapeDtypeStruct(shape, jnp.float32)
    aliases = {1: {13: 1, 14: 2}, 2: {16: 1, 17: 2}}.get(mode, {})  # operand index -> output
    _registered()
    call = jax.ffi.ffi_call(_LAYER, (jax.ShapeDtypeStruct((B * S, d), jnp.float32), kv, kv),
                            vmap_method="sequential", input_output_aliases=aliases)
    y, kn, vn = call(x.reshape(B * S, d), *weights, k, v, lim, k2, v2, n2, eps=np.float32(eps),
                     schedule=np.int32(SCHEDULES[schedule]), write=np.int32(mode))
    return y.reshape(B, S, d), kn, vn


def paged_layer(x, weights, k_pool, v_pool, tables, lim, counts, eps: float, schedule: str = "auto"):
    """:func:`decode_layer` for a paged cache: one native call per layer that reads and writes the
    keys and values through block tables.

    ``k_pool, v_pool`` ``[num_blocks, H, block_size, hd]``: row ``b``'s position ``t`` lies in block
    ``tables[b, t // block_size]`` (``tables`` ``[B, max_blocks]`` int32) at offset
    ``t % block_size``. New position ``s`` of row ``b`` (``x`` ``[B, S, d]``) sees the row's pool
    positions ``t < lim[b, s]`` (``lim`` ``[B, S]``) and its new positions ``0..s``; the first
    ``counts[b]`` (``[B]``) new positions are written into the pool at ``lim[b, 0]`` onwards (their
    blocks must be the row's own: rows may share the blocks they only read). Every table entry
    read or written must name a block of the pool, else the call fails. Returns the layer's output
    ``[B, S, d]`` and the pool, written in place where XLA can donate it. The portable equivalent is
    :func:`jaxdecode.models.base.write_blocks` followed by the layer over the gathered blocks,
    which the tests compare this with."""
    B, S, d = x.shape
    lim = jnp.asarray(lim, jnp.int32)
    counts = jnp.asarray(counts, jnp.int32)
    tables = jnp.asarray(tables, jnp.int32)
    check_float32(x, k_pool, v_pool, *weights)
    _registered()
    pool = jax.ShapeDtypeStruct(k_pool.shape, jnp.float32)
    call = jax.ffi.ffi_call(_PAGED_LAYER, (jax.ShapeDtypeStruct((B * S, d), jnp.float32), pool, pool),
                            vmap_method="sequential", input_output_aliases={13: 1, 14: 2})
    y, k_pool, v_pool = call(x.reshape(B * S, d), *weights, k_pool, v_pool, tables, lim, counts,
                             eps=np.float32(eps), schedule=np.int32(SCHEDULES[schedule]))
    return y.reshape(B, S, d), k_pool, v_pool
