"""Beam search speed (k = 5) at 1 and 64 prompts, beside Hugging Face ``generate(num_beams=5)``
on the same weights and the chapter's Python beam loop, measured in one run.

    python -m benchmarks.bench_beam [--ckpt DIR] [-k 5] [-n 120] [--batches 1,64] [--rounds 2]
                                    [--hf-python .venv-hf/bin/python] [--out FILE]

Every row continues the same prompt (``B`` copies of it, as HF's rows do), ``n`` characters,
characters per second = prompts x n / wall time of a warm call (the fastest of ``--rounds``; all
rows are timed in turn in each round, so a slow moment of the machine hits them alike); compile
time separately (first call minus warm call). Rows:

- ``book beam loop``: the chapter's loop, one full forward per hypothesis per step (jitted, the
  text padded to a multiple of 64) and the k*k candidates sorted in Python; one prompt only;
- ``beam_search, native, paged`` and ``beam_search, portable, paged``: the default on each
  backend (``lm.decoder.for_beams()``, the paged cache: a reorder moves block-table entries);
  the portable path is what GPU and TPU users run;
- ``beam_search, native, dense`` and ``beam_search, portable, dense``: the same loop on the dense
  cache (a reorder copies the filled span of every beam);
- ``greedy, k*B rows``: ``sample_tokens`` greedy on the native backend with as many rows as the
  beams: the model's own cost per step with no beam work, a floor under any beam search here;
- ``HF generate num_beams=k``: ``benchmarks/bench_hf.py --serve`` in its own environment
  (``--hf-python``; left out when there is none), at its fastest torch thread count of
  ``--hf-threads``, ``length_penalty=0``, ``max_new_tokens = min_new_tokens = n``, no end token.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecode as jd
from benchmarks import harness as H
from benchmarks.bench_backends import DEFAULT_HF_PYTHON, HF, PROMPT
from jaxdecode.decoding import beam
from jaxdecode.models import checkpoint
from jaxdecode.models.charlm import transformer as M
from jaxdecode.models.charlm.decoder import CharLMDecoder


class DenseBeams(CharLMDecoder):
    """A decoder with beam search kept on its dense cache (for comparison only)."""

    def for_beams(self):
        return self


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
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hf-python", default=str(DEFAULT_HF_PYTHON) if DEFAULT_HF_PYTHON.exists() else None,
                    help="the Python of the environment that runs benchmarks/bench_hf.py; 'none' leaves HF out")
    ap.add_argument("--hf-threads", default=None, help="torch thread counts to try (default: every core, and 1)")
    ap.add_argument("--out", default=H.default_out("bench_beam"), help="the result file ('' for none)")
    args = ap.parse_args()
    k, n = args.k, args.n
    native = checkpoint.load(args.ckpt, backend="native")
    portable = native.with_backend("portable")
    dense = DenseBeams(native.cfg, True)
    dense_portable = DenseBeams(native.cfg, False)
    ids = native.vocab.encode(PROMPT)
    hf = HF(args.hf_python, n, args.ckpt) if args.hf_python not in (None, "", "none") else None

    def search(model, B):
        return lambda: beam.beam_search(model, native.params, [ids] * B, n, k).best(0).tokens

    arms, compile_s, threads = H.Arms(), {}, {}
    for B in [int(b) for b in args.batches.split(",")]:
        rows = {}
        if B == 1:
            rows[("book beam loop", B)] = lambda: book_beam(native, ids, n, k)
        rows[("beam_search, native, paged", B)] = search(native.decoder, B)
        rows[("beam_search, native, dense", B)] = search(dense, B)
        rows[("beam_search, portable, paged", B)] = search(portable.decoder, B)
        rows[("beam_search, portable, dense", B)] = search(dense_portable, B)
        rows[(f"greedy, {k * B} rows (no beam work)", B)] = (
            lambda B=B: [g.text for g in jd.generate(native, [PROMPT] * (k * B), n, greedy=True)])
        for key, fn in rows.items():
            compile_s[key] = H.compile_seconds(fn)
            arms.add(key, fn)
        if hf is not None:
            ask = lambda th, B=B: float(hf.ask(f"{B} beam{k} threads={th}"))
            threads[B] = H.best_threads(ask, H.thread_counts(args.hf_threads))
            arms.add((f"HF generate num_beams={k}", B), lambda B=B, ask=ask: ask(threads[B]["threads"]),
                     timed_by_itself=True)
    same = [beam.beam_search(m, native.params, [ids], n, k).best(0).tokens.tolist()
            for m in (native.decoder, dense, portable.decoder, dense_portable)]
    arms.run(args.rounds, log=lambda m: print(m, file=sys.stderr, flush=True))
    best = {key: arms.best(key) for key in arms.arms}
    if hf is not None:
        hf.close()
    out = []
    print("| row | prompts | chars/s | vs HF | compile s |\n|---|---:|---:|---:|---:|")
    for (name, B), dt in best.items():
        rate = B * n / dt
        hf_key = (f"HF generate num_beams={k}", B)
        vs = rate / (B * n / best[hf_key]) if hf_key in best else None
        out.append({"row": name, "prompts": B, "chars_per_s": rate, "seconds": dt, "vs_hf": vs,
                    "compile_s": compile_s.get((name, B)), "runs": arms.record((name, B)),
                    "threads": threads[B]["threads"] if name.startswith("HF") else None})
        c = compile_s.get((name, B))
        print(f"| {name} | {B} | {rate:,.0f} | {'' if vs is None else f'{vs:.2f}x'} | "
              f"{'' if c is None else f'{c:.1f}'} |")
    result = H.result("benchmarks.bench_beam", k=k, n=n, prompt=PROMPT, rounds=args.rounds,
                      hf=None if hf is None else hf.info,
                      same_best_hypothesis_every_variant=all(s == same[0] for s in same), rows=out)
    print(f"best hypothesis identical on every variant: {result['same_best_hypothesis_every_variant']}")
    if args.out:
        H.write_json(args.out, result)


if __name__ == "__main__":
    main()
