"""Requests of any size: throughput of ``generate`` against the batch size, and one request of
100,000 samples split by the memory budget.

    python scripts/bench_large.py [--samples 100000] [--n 16] [--out docs/bench_large.json]

1. Throughput (characters/s) of ``generate`` for a request of ``--rows`` samples of ``--n``
   characters after a 20-character prompt, run in batches of at most 32 ... 2048 rows
   (``max_rows``), best of ``--repeats``: where throughput peaks, and what a batch size too large
   costs.
2. One request of ``--samples`` samples with the library's defaults (the memory budget and
   :data:`jaxdecode.decoding.budget.MAX_ROWS`), with its progress bar: its throughput beside the best
   batch size's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import numpy as np

import jaxdecode as jd
from jaxdecode.decoding import budget

PROMPT = "KATHARINA:\nMoved! i"  # 20 characters


def chars_per_s(lm, rows: int, n: int, max_rows: int | None, progress=False) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = jd.generate(lm, PROMPT, n, seed=1, num_samples=rows, max_rows=max_rows, progress=progress)
    dt = time.perf_counter() - t0
    assert len(out) == rows and all(len(g.text) == n for g in out)
    return rows * n / dt, dt


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--rows", type=int, default=4096, help="samples per request in the batch-size sweep")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sizes", default="32,64,128,256,512,1024,2048")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--out", default="docs/bench_large.json")
    args = ap.parse_args()

    lm = jd.load(backend=args.backend)
    sizes = [int(s) for s in args.sizes.split(",")]
    sweep = {}
    for size in sizes:  # warm up every batch size's programs
        chars_per_s(lm, min(size, args.rows), args.n, size)
    for _ in range(args.repeats):
        for size in sizes:
            cps, _ = chars_per_s(lm, args.rows, args.n, size)
            sweep[size] = max(sweep.get(size, 0.0), cps)
            print(f"max_rows {size:>5}: {cps:9,.0f} chars/s", flush=True)
    best = max(sweep, key=sweep.get)
    cps, dt = chars_per_s(lm, args.samples, args.n, None, progress="100k samples")
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} on {jax.default_backend()}",
        "load_average_before_last_run": os.getloadavg()[0],
        "backend": lm.decoder.backend,
        "prompt": PROMPT, "n": args.n, "sweep_rows": args.rows,
        "sweep_chars_per_s": sweep,
        "best_max_rows": best,
        "default_max_rows": budget.MAX_ROWS,
        "default_rows_per_batch": budget.rows_per_batch(
            budget.row_bytes(lm.decoder, len(PROMPT), args.n, 256, lm.cfg.heads)),
        "large_request": {"samples": args.samples, "seconds": dt, "chars_per_s": cps,
                          "ratio_to_best": cps / sweep[best]},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
