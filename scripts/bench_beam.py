"""Beam search speed: jaxdecode's scan against the chapter's Python beam loop.

    python scripts/bench_beam.py [--ckpt DIR] [-k 5] [-n 120] [--batches 1,32] [--out FILE]

The chapter's loop runs one full forward over each hypothesis per step (jitted here, the text
padded to a multiple of 64 so it compiles a handful of times) and sorts the k*k candidates in
Python. Rows: characters per second (prompts x n / wall time); compile time separately.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import beam, checkpoint
from jaxdecode import model as M

PROMPTS = ["KATHARINA:\nMoved! in good time: ", "ROMEO:\nIs the day so young? ", "KING RICHARD II:\n",
           "First Citizen:\nBefore we proceed any further, hear me speak.\n"]


def book_beam(lm, ids, n, k):
    cfg, params = lm.cfg, lm.params
    f = jax.jit(lambda p, x, i: jax.nn.log_softmax(M.forward(p, cfg, x)[0, i]))
    beams = [(0.0, list(ids))]
    for _ in range(n):
        cand = []
        for score, seq in beams:
            ctx = seq[-cfg.T:]
            width = -(-len(ctx) // 64) * 64
            x = np.zeros((1, width), np.int32)
            x[0, :len(ctx)] = ctx
            lp = np.asarray(f(params, jnp.asarray(x), len(ctx) - 1))
            top = np.argsort(-lp, kind="stable")[:k]
            cand += [(score + float(lp[i]), seq + [int(i)]) for i in top]
        beams = sorted(cand, key=lambda c: -c[0])[:k]
    return beams[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("-n", type=int, default=120)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lm = checkpoint.load(args.ckpt)
    k, n = args.k, args.n
    ids = lm.vocab.encode(PROMPTS[0])
    book_beam(lm, ids, n, k)  # compile every width
    t = time.perf_counter()
    book_beam(lm, ids, n, k)
    book = n / (time.perf_counter() - t)
    rows = [{"row": "book beam loop", "batch": 1, "chars_per_s": book, "compile_s": None}]
    print("| row | prompts | chars/s | vs book loop | compile s |\n|---|---:|---:|---:|---:|")
    print(f"| book beam loop (k={k}) | 1 | {book:,.1f} | 1.0x | |", flush=True)
    for B in [int(b) for b in args.batches.split(",")]:
        prompts = [lm.vocab.encode(PROMPTS[i % len(PROMPTS)]) for i in range(B)]
        t = time.perf_counter()
        beam.beam_search(lm.decoder, lm.params, prompts, n, k)
        first = time.perf_counter() - t
        t = time.perf_counter()
        beam.beam_search(lm.decoder, lm.params, prompts, n, k)
        warm = time.perf_counter() - t
        rate = B * n / warm
        rows.append({"row": "jaxdecode beam_search", "batch": B, "chars_per_s": rate,
                     "compile_s": max(0.0, first - warm)})
        print(f"| jaxdecode beam_search (k={k}) | {B} | {rate:,.0f} | {rate / book:.0f}x | {first - warm:.1f} |",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"k": k, "n": n, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
