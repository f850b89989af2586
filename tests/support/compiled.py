"""The reference model's functions as the tests call them for reference values, each compiled into
one program per configuration and static setting. Run operation by operation, one forward pass
compiles dozens of small programs, which is most of what such a test costs."""

import contextlib

import jax

from jaxdecode.models.charlm import transformer as M


def _static(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


class _Compiled:
    """``fn(params, cfg, *arrays, **settings)`` jitted: ``cfg`` and the scalar settings are static,
    the arrays (and array-valued settings such as ``packed``) are arguments."""

    def __init__(self, fn):
        self.fn = fn
        self.programs = {}

    def __call__(self, params, cfg, *args, **kw):
        static = {k: v for k, v in kw.items() if _static(v)}
        arrays = {k: v for k, v in kw.items() if not _static(v)}
        key = (cfg, tuple(sorted(static.items())), tuple(sorted(arrays)), len(args))
        program = self.programs.get(key)
        if program is None:
            fn = self.fn
            program = self.programs[key] = jax.jit(lambda p, a, d: fn(p, cfg, *a, **static, **d))
        return program(params, args, arrays)


# The tests compile at XLA's lowest optimization (tests/conftest.py): their programs mostly run for
# milliseconds. A reference that runs hundreds of full forwards of the shipped model is the
# exception; it compiles as the library's users' programs do (XLA's CPU defaults), which halves
# its time (the book's 300-character greedy loop: 14.4 s against 7.4 s).
LIBRARY_OPTIONS = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False,
                   "xla_cpu_use_fusion_emitters": True}


def optimized_jit(fn, **kw):
    """``jax.jit(fn)`` compiled with :data:`LIBRARY_OPTIONS`."""
    return jax.jit(fn, compiler_options=LIBRARY_OPTIONS, **kw)


@contextlib.contextmanager
def optimized():
    """Inside: programs compile at XLA's optimization level (tests/conftest.py turns it down for the
    suite through ``jax_disable_most_optimizations``; where $XLA_FLAGS was set, nothing changes)."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


forward = _Compiled(M.forward)
prefill = _Compiled(M.prefill)
extend = _Compiled(M.extend)
step = _Compiled(M.step)
chunk_step = _Compiled(M.chunk_step)
window_logits = _Compiled(M.window_logits)


# The statistical draws (tens of thousands of rows) run on the native backend only. The portable
# backend's sampler is the same loop around another forward pass; that it draws what the native one
# does is shown row by row: the same keys and row ids give the same tokens on both backends, on the
# first rows of the same request (a row's draw depends only on its key, row id and prompt). The
# two forwards' logits differ by float rounding, which can move a uniform across a boundary in a
# rare row: at most ``DIFFER_PER_ROWS`` in a row may differ (none did when this was written).
DIFFER_PER_ROWS = 1 / 500


def assert_same_draws(native, portable, what: str = ""):
    """``native`` and ``portable``: token arrays of the same rows on the two backends (the first
    ``len(portable)`` rows of ``native``). At most :data:`DIFFER_PER_ROWS` of the rows may differ."""
    import numpy as np

    native, portable = np.asarray(native)[:len(portable)], np.asarray(portable)
    assert native.shape == portable.shape, (native.shape, portable.shape)
    differ = int((native != portable).reshape(len(native), -1).any(axis=1).sum())
    assert differ <= DIFFER_PER_ROWS * len(native), (what, differ, len(native))
