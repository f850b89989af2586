"""Requests of any size: throughput of ``generate`` against the batch size, and one request of
100,000 samples split by the memory budget.

    python -m benchmarks.bench_large [--samples 100000] [--n 16] [--out FILE]

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
import time

import jaxdecode as jd
from benchmarks import harness as H
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
    ap.add_argument("--out", default=H.default_out("bench_large"), help="the result file ('' for none)")
    args = ap.parse_args()

    lm = jd.load(backend=args.backend)
    sizes = [int(s) for s in args.sizes.split(",")]
    for size in sizes:  # warm up every batch size's programs
        chars_per_s(lm, min(size, args.rows), args.n, size)
    arms = H.Arms()
    for size in sizes:
        arms.add(size, lambda size=size: jd.generate(lm, PROMPT, args.n, seed=1, num_samples=args.rows,
                                                    max_rows=size))
    arms.run(args.repeats)
    sweep = {size: args.rows * args.n / arms.best(size) for size in sizes}
    for size, cps in sweep.items():
        print(f"max_rows {size:>5}: {cps:9,.0f} chars/s", flush=True)
    best = max(sweep, key=sweep.get)
    load_before = H.load()[0]
    cps, dt = chars_per_s(lm, args.samples, args.n, None, progress="100k samples")
    result = {
        **H.result("benchmarks.bench_large"),
        "load_before_and_after_large_request": [load_before, H.load()[0]],
        "sweep_runs": {size: arms.record(size) for size in sizes},
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
    print(json.dumps(H.clean(result), indent=2))
    if args.out:
        H.write_json(args.out, result)


if __name__ == "__main__":
    main()
