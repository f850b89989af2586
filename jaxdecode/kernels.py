"""Native decode kernels for the XLA CPU backend, each with a pure-JAX fallback.

XLA CPU turns the attention of a decode step (one or a few queries per row against a long KV
cache) into a batched product over ``B * heads`` tiny matrices, after copying the attended part of
the cache out of the cache buffer. :func:`attention` instead calls a small C++ kernel
(``csrc/attention.cc``, an XLA FFI custom call) that reads every row's keys and values in place,
only up to that row's own length, on XLA's intra-op threads. For decode passes (a step at any
batch up to 1,024 rows, a speculative verify pass, a beam step), :func:`decode_layer` runs a
whole decoder layer as one call on weights packed by :func:`pack`: phase by phase for a few rows,
where reading the weights bounds it, and as a pipeline over blocks of rows for many, where one
core streams the KV cache while another multiplies. :func:`dense` / :func:`packed_dense` serve
single products. Other backends (GPU, TPU) and machines without a C++ compiler use the same
computations written in ``jax.numpy``.

The kernel is compiled on first use with the system's ``c++`` (``-O3 -march=native``) against the
XLA FFI headers that ship with jaxlib, and cached under ``$JAXDECODE_CACHE`` (default
``~/.cache/jaxdecode``) by a hash of its source, jaxlib's version and the CPU. The environment
variable ``JAXDECODE_KERNELS`` selects: ``auto`` (default: use it if it builds), ``0`` (never) or
``1`` (required: an error if it cannot be built).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_SOURCE = Path(__file__).parent / "csrc" / "attention.cc"
_TARGET = "jaxdecode_decode_attention"
_DENSE = "jaxdecode_dense"
_PACKED = "jaxdecode_packed_dense"
_LAYER = "jaxdecode_decode_layer"
DENSE_MAX_ROWS = 2  # from 3 rows on XLA's own matrix product is as fast or faster (measured)
PACKED_MAX_ROWS = 4  # with packed weights (packed_dense), up to here the kernel beats XLA
# decode_layer: one native call per layer beats XLA's operations at every batch measured (1 to
# 256 rows; from 64 rows the call runs as a pipeline, see csrc/attention.cc). The limit bounds the
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


def cache_root() -> Path:
    """Where jaxdecode keeps what it builds: ``$JAXDECODE_CACHE``, default ``~/.cache/jaxdecode``."""
    return Path(os.environ.get("JAXDECODE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxdecode"))


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def build(verbose: bool = False) -> Path:
    """Compile the kernel (if not already cached) and return the shared library's path."""
    import jaxlib

    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + jaxlib.__version__.encode() + _cpu_name().encode()
                         + platform.machine().encode()).hexdigest()[:16]
    out = _cache_dir() / f"attention-{key}.so"
    if out.exists():
        return out
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise KernelError("no C++ compiler found (set CXX or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
           f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise KernelError(f"compiling {_SOURCE.name} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent or interrupted build never leaves half a library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if verbose:
        print(f"built {out}")
    return out


@functools.cache
def _load() -> bool:
    """Build and register the kernel once per process; False if it is off or unavailable."""
    mode = _mode()
    if mode == "0":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxdecodeDecodeAttention), platform="cpu")
        jax.ffi.register_ffi_target(_DENSE, jax.ffi.pycapsule(lib.JaxdecodeDense), platform="cpu")
        jax.ffi.register_ffi_target(_PACKED, jax.ffi.pycapsule(lib.JaxdecodePackedDense), platform="cpu")
        jax.ffi.register_ffi_target(_LAYER, jax.ffi.pycapsule(lib.JaxdecodeDecodeLayer), platform="cpu")
        return True
    except Exception as e:  # no compiler, failed build, unloadable library
        if mode == "1":
            raise e if isinstance(e, KernelError) else KernelError(str(e)) from e
        return False


def available() -> bool:
    """Whether :func:`attention` will use the native kernel on the CPU backend."""
    return _load()


def reads_only_filled() -> bool:
    """Whether :func:`attention` on the default backend reads each row only up to its limit (the
    native kernel), so that a large, mostly empty cache costs nothing extra to attend over."""
    return jax.default_backend() == "cpu" and available()


def packs_rows(rows: int) -> bool:
    """Whether a decode pass of ``rows`` rows on the default backend should be given weights packed
    for :func:`decode_layer` and :func:`packed_dense` (see ``model.pack_params``)."""
    return 0 < rows <= max(LAYER_MAX_ROWS, PACKED_MAX_ROWS) and reads_only_filled()


def fuses_rows(rows: int) -> bool:
    """Whether a decode pass of ``rows`` rows runs each layer as one :func:`decode_layer` call."""
    return 0 < rows <= LAYER_MAX_ROWS and reads_only_filled()


def _attend_segments(q, segments, scale):
    """Softmax attention of ``q`` ``[B, H, S, D]`` over several ``(k, v, visible)`` segments,
    ``k, v`` ``[B, H, T, D]`` and ``visible`` ``[B, 1 or H, S, T]`` bool."""
    scores = [jnp.where(ok, jnp.einsum("bhsd,bhtd->bhst", q, k) * scale, -jnp.inf) for k, _, ok in segments]
    w = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out, at = 0.0, 0
    for k, v, _ in segments:
        out = out + jnp.einsum("bhst,bhtd->bhsd", w[..., at:at + k.shape[2]], v)
        at += k.shape[2]
    return out


def _visible(n, limit):  # [B, 1, S, n]: position t < limit[b, s]
    return (jnp.arange(n)[None, None, :] < limit[:, :, None])[:, None]


def reference_attention(q, k, v, lim, k2, v2, n2, scale):
    """The kernel's computation in ``jax.numpy`` (see :func:`attention`)."""
    B, H, _, D = q.shape
    k2, v2 = k2.reshape(B, H, -1, D), v2.reshape(B, H, -1, D)
    return _attend_segments(q, [(k, v, _visible(k.shape[2], lim)), (k2, v2, _visible(k2.shape[2], n2))],
                            scale)


def attention(q, k, v, lim, k2, v2, n2, scale: float, span: int | None = None):
    """Softmax attention of queries ``q`` ``[B, H, S, D]`` over two key/value buffers.

    Query ``(b, s)`` sees positions ``t < lim[b, s]`` of ``k, v`` ``[B, H, C, D]`` and
    ``t < n2[b, s]`` of ``k2, v2`` ``[B * H, L, D]`` (``lim``, ``n2``: ``[B, S]`` int32). Every
    query must see at least one position. On the CPU backend this is the native kernel when it is
    available, elsewhere :func:`reference_attention`. ``span`` (static, optional) promises
    ``lim <= span``: the fallback then reads only the first ``span`` positions of ``k, v`` (the
    kernel reads each row up to its limit anyway).
    """
    lim = jnp.asarray(lim, jnp.int32)
    n2 = jnp.asarray(n2, jnp.int32)

    def ref(q, k, v, lim, k2, v2, n2):
        if span is not None:
            k, v = k[:, :, :span], v[:, :, :span]
        return reference_attention(q, k, v, lim, k2, v2, n2, scale)

    return _native_or(ref, _ffi(_TARGET, q.shape, scale=np.float32(scale)), q, k, v, lim, k2, v2, n2)


def _native_or(ref, native, *args):
    """``native(*args)`` on the CPU backend when the kernels are available and every float
    argument is float32, else (other backends, other dtypes, kernels off) ``ref(*args)``."""
    if not _load() or any(jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != jnp.float32 for a in args):
        return ref(*args)
    return jax.lax.platform_dependent(*args, cpu=native, default=ref)


def _ffi(target: str, shape, **attrs):
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, jnp.float32), vmap_method="sequential")
    return lambda *args: call(*args, **attrs)


def _affine(x, w, b):
    return jnp.dot(x, w) + b.reshape((1,) * (x.ndim - 1) + (-1,))


def _rows_kernel(target: str, x, N: int):
    """The native product ``target`` on ``x`` ``[..., K]`` flattened to rows, output ``[..., N]``."""
    lead, K = x.shape[:-1], x.shape[-1]
    M = math.prod(lead)
    call = _ffi(target, (M, N))
    return lambda x, w, b: call(x.reshape(M, K), w, b).reshape(*lead, N)


def dense(x, w, b):
    """``x @ w + b`` for ``x`` ``[..., K]``, ``w`` ``[K, N]``, ``b`` ``[N]``.

    With at most :data:`DENSE_MAX_ROWS` rows (a decode step at batch 1 or 2) on the CPU backend,
    the native kernel streams the weights in order, split over XLA's threads: a one-row product is
    bound by reading the weights, which XLA CPU does on one thread. Otherwise (and on other
    backends) an ordinary ``jnp.dot``.
    """
    N = w.shape[1]
    if math.prod(x.shape[:-1]) > DENSE_MAX_ROWS or N % 8:
        return _affine(x, w, b)
    return _native_or(_affine, _rows_kernel(_DENSE, x, N), x, w, b)


def pack(w):
    """``w`` ``[K, N]`` in panels of 16 columns, ``[N / 16, K, 16]``, for :func:`packed_dense`."""
    K, N = w.shape
    return w.reshape(K, N // 16, 16).transpose(1, 0, 2)


def unpack(wp):
    """The inverse of :func:`pack`."""
    P, K, _ = wp.shape
    return wp.transpose(1, 0, 2).reshape(K, 16 * P)


def packed_dense(x, wp, b):
    """``x @ w + b`` with ``wp = pack(w)``: the native kernel on CPU (for a few rows), else XLA."""
    ref = lambda x, wp, b: _affine(x, unpack(wp), b)
    return _native_or(ref, _rows_kernel(_PACKED, x, 16 * wp.shape[0]), x, wp, b)


def _row(a, x):  # a [N] shaped to broadcast against x [..., N]
    return a.reshape((1,) * (x.ndim - 1) + (-1,))


def _layer_norm(x, g, b, eps):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * _row(g, x) + _row(b, x)


def reference_decode_layer(x, weights, k, v, lim, k2, v2, n2, eps):
    """:func:`decode_layer`'s computation in ``jax.numpy``."""
    g1, be1, wqkv, bqkv, wo, bo, g2, be2, w1, b1, w2, b2 = weights
    B, S, d = x.shape
    H, D = k.shape[1], k.shape[3]
    qkv = _affine(_layer_norm(x, g1, be1, eps), unpack(wqkv), bqkv)
    q, kn, vn = (jnp.transpose(qkv.reshape(B, S, 3, H, D)[:, :, i], (0, 2, 1, 3)) for i in range(3))
    causal = jnp.tril(jnp.ones((S, S), bool))[None, None]
    k2, v2 = k2.reshape(B, H, -1, D), v2.reshape(B, H, -1, D)
    att = _attend_segments(q, [(k, v, _visible(k.shape[2], lim)), (k2, v2, _visible(k2.shape[2], n2)),
                               (kn, vn, causal)], 1.0 / math.sqrt(D))
    x1 = x + _affine(jnp.transpose(att, (0, 2, 1, 3)).reshape(B, S, d), unpack(wo), bo)
    f = jax.nn.gelu(_affine(_layer_norm(x1, g2, be2, eps), unpack(w1), b1), approximate=False)
    return x1 + _affine(f, unpack(w2), b2), kn, vn


SCHEDULES = {"auto": 0, "phases": 1, "pipeline": 2}


WRITES = {None: 0, "cache": 1, "buffer": 2}


def write_rows(buf, new, at):
    """``new`` ``[B, H, S, hd]`` into ``buf`` (``[B, H, C, hd]``, or ``[B * H, L, hd]``) at each row's
    position ``at`` ``[B]`` (moved back to fit, as ``dynamic_update_slice`` does)."""
    B, H, _, D = new.shape
    flat = buf.reshape(B, H, -1, D)
    put = jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice(c, n, (0, i, 0)))
    return put(flat, new.astype(buf.dtype), at).reshape(buf.shape)


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
    would see with ``write=None``.

    ``schedule`` (``"auto"``, ``"phases"`` or ``"pipeline"``) picks how the native call shares the
    work between threads (``"auto"``: a pipeline over blocks of rows from 64 rows on); it changes
    the order of some sums, hence the last bits of some results, never what is computed.

    On the CPU backend with the kernels available this is one call (see ``csrc/attention.cc``)
    that reads every weight once and runs the small steps in between without XLA's per-operation
    overhead; elsewhere :func:`reference_decode_layer`.
    """
    B, S, d = x.shape
    H, D = k.shape[1], k.shape[3]
    lim = jnp.asarray(lim, jnp.int32)
    n2 = jnp.asarray(n2, jnp.int32)
    mode = WRITES[write]
    shape = {0: (B, H, S, D), 1: k.shape, 2: k2.shape}[mode]
    kv = jax.ShapeDtypeStruct(shape, jnp.float32)
    aliases = {1: {13: 1, 14: 2}, 2: {16: 1, 17: 2}}.get(mode, {})  # operand index -> output
    call = jax.ffi.ffi_call(_LAYER, (jax.ShapeDtypeStruct((B * S, d), jnp.float32), kv, kv),
                            vmap_method="sequential", input_output_aliases=aliases)

    def native(x, k, v, lim, k2, v2, n2, *weights):
        y, kn, vn = call(x.reshape(B * S, d), *weights, k, v, lim, k2, v2, n2, eps=np.float32(eps),
                         schedule=np.int32(SCHEDULES[schedule]), write=np.int32(mode))
        return y.reshape(B, S, d), kn, vn

    def ref(x, k, v, lim, k2, v2, n2, *weights):
        y, kn, vn = reference_decode_layer(x, weights, k, v, lim, k2, v2, n2, eps)
        if mode == 1:
            return y, write_rows(k, kn, lim[:, 0]), write_rows(v, vn, lim[:, 0])
        if mode == 2:
            return y, write_rows(k2, kn, n2[:, 0]), write_rows(v2, vn, n2[:, 0])
        return y, kn, vn

    return _native_or(ref, native, x, k, v, lim, k2, v2, n2, *weights)
