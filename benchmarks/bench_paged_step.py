"""One engine step on the paged cache against one on the dense cache, every slot decoding.

The shipped model, ``--slots`` rows (held-out prompts of ``--prompt-len`` characters, top-k 40 at
temperature 0.9, each with its own seed and room for ``--steps`` more characters), served by one
engine per arm: ``dense``, and ``paged`` in blocks of each of ``--blocks`` positions. Each engine
first reads every prompt and runs ``--warm`` decode steps (every program compiled); then the arms
take ``Engine.step`` in turn, one step each per round, so that the machine's changes of speed fall
on every arm alike. A step's time is the whole engine step: the host's scheduling and block
bookkeeping, the device call, and the tokens brought back. Reports each arm's median step and its
ratio to the dense step of the same rounds (the median of the per-round ratios), over the cache
lengths the timed steps cover.

    python -m benchmarks.bench_paged_step
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

import jaxdecode
from benchmarks import harness as H
from jaxdecode import rules
from jaxdecode.cli.bench import heldout_text
from jaxdecode.serving import Engine, Request


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--warm", type=int, default=64, help="decode steps before the timed ones")
    ap.add_argument("--steps", type=int, default=256, help="timed decode steps")
    ap.add_argument("--blocks", default="16,32", help="comma-separated block sizes of the paged arms")
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "int8"))
    ap.add_argument("--out", default=H.default_out("bench_paged_step"), help="the result file ('' for none)")
    args = ap.parse_args()

    lm = jaxdecode.load()
    held = heldout_text(lm, None)
    rng = np.random.default_rng(0)
    n = args.warm + args.steps + 1
    if args.prompt_len + n > lm.decoder.T:
        ap.error(f"--prompt-len + --warm + --steps + 1 = {args.prompt_len + n} exceeds the window "
                 f"T = {lm.decoder.T}")
    starts = rng.integers(0, len(held) - args.prompt_len, size=args.slots)
    reqs = [Request(held[s:s + args.prompt_len], n, seed=i, rule=rules.chain(rules.temperature(0.9), rules.top_k(40)))
            for i, s in enumerate(starts)]
    arms = {"dense": Engine(lm, args.slots)}
    for b in (int(x) for x in args.blocks.split(",")):
        arms[f"paged/{b}"] = Engine(lm, args.slots, cache="paged", block_size=b, kv_dtype=args.kv_dtype)
    for engine in arms.values():
        for r in reqs:
            engine.submit(r)
        engine.clock.start()
        while any(row is None or row.prefilled < len(row.prompt) for row in engine._slots):
            engine.step()  # admission and the prompts (every slot busy after the first step)
        for _ in range(args.warm):
            engine.step()
    steps = H.Arms()
    for name, engine in arms.items():
        steps.add(name, engine.step)
    steps.run(args.steps, log=lambda m: None)
    times = {name: steps.record(name)["seconds"] for name in arms}
    texts = {name: [[int(t) for t in row.tokens] for row in sorted(
        (r for rows in e._rows for r in rows), key=lambda r: r.req)] for name, e in arms.items()}
    dense = np.asarray(times["dense"])
    result = {**H.result("benchmarks.bench_paged_step"), "backend": lm.decoder.backend, "settings": vars(args),
              "cache_lengths": [args.prompt_len + args.warm, args.prompt_len + args.warm + args.steps], "arms": {}}
    for name, ts in times.items():
        ts = np.asarray(ts)
        result["arms"][name] = {"median_ms": round(1e3 * statistics.median(ts), 3),
                                "p25_ms": round(1e3 * float(np.percentile(ts, 25)), 3),
                                "vs_dense": round(float(np.median(ts / dense)), 3),
                                "load_before_first_and_after_last": [steps.runs[name][0]["load_before"],
                                                                     steps.runs[name][-1]["load_after"]]}
    result["tokens_identical"] = all(t == texts["dense"] for name, t in texts.items() if "int8" not in name) \
        if args.kv_dtype == "float32" else None
    print(json.dumps(result, indent=1))
    if args.out:
        H.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
