"""Reproducer: XLA's CPU compiler fails, or segfaults, once a process reaches the kernel's limit on
memory mappings (``vm.max_map_count``, 65,530 by default).

Every compiled CPU program keeps its machine code in a few memory mappings of its own (about 3 a
program here) until it is freed. A long-lived process that compiles tens of thousands of programs
and keeps them (a test worker: JAX caches every program it compiles) reaches the limit; then
``mmap`` fails with ENOMEM inside the compiler, which reports ``LLVM compilation error: Cannot
allocate memory`` or crashes with a segmentation fault in ``backend_compile_and_load``.

This script gets there in seconds: it takes all but ``--spare`` of the allowed mappings with
small anonymous maps of alternating protection (so that the kernel cannot merge them), then
compiles new programs until one fails.

    python tools/repro_map_count.py    # "LLVM compilation error: Cannot allocate memory", then
                                         # a segmentation fault (exit status 139)

``jax.clear_caches()`` frees the mappings of the programs it drops (measured: 300 programs took
971 mappings; after clearing, 83 remained).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys


def mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spare", type=int, default=40, help="mappings left free before compiling")
    ap.add_argument("--programs", type=int, default=200, help="programs to compile")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    page = mmap.PAGESIZE
    # compile a first batch so that the compiler's own start-up mappings exist, then fill the table
    programs = []
    for i in range(args.programs // 2):
        f = jax.jit(lambda a, s=float(i): jnp.tanh(a * s).sum())
        f(jnp.ones((i + 1,))).block_until_ready()
        programs.append(f)
    target = limit - args.spare
    # one reserved region, then alternate the protection of its pages: each page is a mapping
    need = max(0, target - mappings())
    base = libc.mmap(None, need * page, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        print("mmap of the filler region failed", file=sys.stderr)
        return 2
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for k in range(0, need, 2):
        libc.mprotect(base + k * page, page, 0)  # PROT_NONE
    print(f"mappings: {mappings()} of {limit} (vm.max_map_count)", flush=True)
    for i in range(args.programs // 2, args.programs):
        f = jax.jit(lambda a, s=float(i): jnp.cos(a * s).sum())
        try:
            f(jnp.ones((i + 1,))).block_until_ready()
        except Exception as e:  # noqa: BLE001 - the error XLA reports instead of crashing
            print(f"program {i}: {type(e).__name__}: {str(e).splitlines()[0]} (mappings {mappings()})")
            return 1
        programs.append(f)
    print(f"compiled {args.programs} programs; mappings {mappings()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
