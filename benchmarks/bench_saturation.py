"""Serving at saturation: every request arrives at once; the engine against the static loop.

The shipped model, ``--requests`` held-out prompts (``--prompt-len`` characters each) arriving
together, lengths ``n`` drawn from ``--lengths`` (``uniform``: 32 to 128 characters; ``geometric``:
mean 48, a long tail cut at 224), each with its own seed, top-k 40 and temperature 0.9. Served by
``Engine.run`` with ``--slots`` slots: static batching, and continuous batching with 1 and with
``--decode-steps`` decode steps per device call, on each cache of ``--caches``; and by the plain
batched loop
(``jaxdecode.generate`` over ``--slots`` prompts at a time, each batch run to its longest ``n``;
only each request's own ``n`` characters are counted). Every program is compiled by a first, untimed pass of the same run; then ``--repeats`` timed passes,
interleaved, and the median is reported. Prints and writes JSON with characters per second and
the ratios, the p50/p99 latency and TTFT of the engine runs.

    python -m benchmarks.bench_saturation
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import jaxdecode
from benchmarks import harness as H
from jaxdecode import rules
from jaxdecode.cli.bench import heldout_text
from jaxdecode.serving import Engine, Request


def workload(lm, held: str, count: int, prompt_len: int, lengths: str, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    T = lm.decoder.T
    out = []
    for i in range(count):
        start = int(rng.integers(0, len(held) - prompt_len))
        if lengths == "uniform":
            n = int(rng.integers(32, 129))
        else:
            n = int(min(T - prompt_len, 8 + rng.geometric(1 / 40)))
        out.append(Request(held[start:start + prompt_len], n, seed=seed * 1000 + i,
                           rule=rules.chain(rules.temperature(0.9), rules.top_k(40))))
    return out


def run_engine(lm, reqs, slots, policy, decode_steps, cache="dense", prefill_budget=None, overlap=True,
               admit_batch=1):
    """``cache``: ``dense``, ``paged``, ``dense-int8`` or ``paged-int8`` (quantized), a paged one optionally
    with its block size after a slash (``paged/32``; default the engine's)."""
    cache, _, block = cache.partition("/")
    base, _, dtype = cache.partition("-")  # dense-int8, paged-int8: the quantized caches
    kw = {"cache": base, "kv_dtype": dtype or "float32"}
    if block:
        kw["block_size"] = int(block)
    kw["prefill_budget"] = prefill_budget
    kw["overlap"] = overlap
    kw["admit_batch"] = admit_batch
    t0 = time.perf_counter()
    rep = Engine(lm, slots, policy=policy, decode_steps=decode_steps, **kw).run(reqs)
    secs = time.perf_counter() - t0
    chars = sum(len(g.text) for r in rep.results for g in r.outputs)
    s = rep.summary()
    return {"seconds": secs, "chars": chars, "latency": s["latency"], "ttft": s["ttft"],
            "texts": [[g.text for g in r.outputs] for r in rep.results]}


def run_loop(lm, reqs, slots):
    """The plain batched loop: generate over ``slots`` requests at a time (each row its own n
    through a per-batch n of the longest and the row's text cut to its n: generate takes one n)."""
    t0 = time.perf_counter()
    texts = []
    for b in range(0, len(reqs), slots):
        part = reqs[b:b + slots]
        n = max(r.n for r in part)
        gens = jaxdecode.generate(lm, [r.prompt for r in part], n, seed=[r.seed for r in part],
                                  rule=rules.chain(rules.temperature(0.9), rules.top_k(40)))
        texts += [[g.text[:r.n]] for g, r in zip(gens, part)]
    secs = time.perf_counter() - t0
    # the work the engine does: each request's own n characters
    return {"seconds": secs, "chars": sum(r.n for r in reqs), "texts": texts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--lengths", choices=("uniform", "geometric"), default="uniform")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--caches", default="dense", help="comma-separated: dense, paged, dense-int8, paged-int8, a paged one optionally with its block "
                         "size after a slash (paged/32) (default dense)")
    ap.add_argument("--prefill-budget", type=int, default=None,
                    help="also a continuous arm with this prefill budget (prompt tokens per engine step)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-overlap", action="store_true",
                    help="also run continuous batching at --decode-steps with overlap=False (each call's "
                         "tokens read before the next call is sent)")
    ap.add_argument("--admit-batch", type=int, default=None, metavar="M",
                    help="also run continuous batching at --decode-steps with Engine(admit_batch=M): rows in "
                         "line join once M slots are free")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=H.default_out("bench_saturation"), help="the result file ('' for none)")
    args = ap.parse_args()

    lm = jaxdecode.load()
    held = heldout_text(lm, None)
    reqs = workload(lm, held, args.requests, args.prompt_len, args.lengths, args.seed)
    arms = {"loop": lambda: run_loop(lm, reqs, args.slots)}
    for cache in args.caches.split(","):
        tag = "" if cache == "dense" else f"{cache} "
        arms[f"{tag}static"] = lambda c=cache: run_engine(lm, reqs, args.slots, "static", 1, c)
        arms[f"{tag}continuous"] = lambda c=cache: run_engine(lm, reqs, args.slots, "continuous", 1, c)
        arms[f"{tag}continuous-k{args.decode_steps}"] = lambda c=cache: run_engine(
            lm, reqs, args.slots, "continuous", args.decode_steps, c)
        if args.no_overlap:
            arms[f"{tag}continuous-k{args.decode_steps}-no-overlap"] = lambda c=cache: run_engine(
                lm, reqs, args.slots, "continuous", args.decode_steps, c, overlap=False)
        if args.prefill_budget:
            arms[f"{tag}continuous-k{args.decode_steps}-budget{args.prefill_budget}"] = lambda c=cache: run_engine(
                lm, reqs, args.slots, "continuous", args.decode_steps, c, args.prefill_budget)
        if args.admit_batch:
            name = f"{tag}continuous-k{args.decode_steps}-admit{args.admit_batch}"
            arms[name] = lambda c=cache: run_engine(lm, reqs, args.slots, "continuous", args.decode_steps, c,
                                                    admit_batch=args.admit_batch)
    for name, arm in arms.items():  # compile every program
        arm()
        print(f"warm: {name}", file=sys.stderr, flush=True)
    runs = {name: [] for name in arms}
    loads = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, arm in arms.items():
            before = H.load()[0]
            runs[name].append(arm())
            loads[name].append([before, H.load()[0]])
    result = {**H.result("benchmarks.bench_saturation"), "backend": lm.decoder.backend, "settings": vars(args),
              "arms": {}}
    for name, rs in runs.items():
        secs = statistics.median(r["seconds"] for r in rs)
        row = {"seconds": round(secs, 3), "chars_per_s": round(rs[0]["chars"] / secs, 1),
               "load_before_and_after": loads[name]}
        if "latency" in rs[0]:
            row |= {"latency": rs[0]["latency"], "ttft": rs[0]["ttft"]}
        result["arms"][name] = row
    loop = result["arms"]["loop"]["chars_per_s"]
    for name, row in result["arms"].items():
        static = name.split(" ")[0] + " static" if " " in name else "static"
        base = result["arms"].get(static, result["arms"].get("static", row))["chars_per_s"]
        row["vs_static"] = round(row["chars_per_s"] / base, 3)  # against static batching on the same cache
        row["vs_loop"] = round(row["chars_per_s"] / loop, 3)
        # the same ratio within each round (the arms of a round run one after another, so a change of the
        # machine's speed between rounds cancels), the median over the rounds
        base_runs = runs[static] if static in runs else runs["static"]
        row["vs_static_paired"] = round(statistics.median(
            b["seconds"] / r["seconds"] for r, b in zip(runs[name], base_runs)), 3)
    # every float cache gives each request generate's text; the int8 pool's texts are close, not equal
    engine_texts = [runs[name][0]["texts"] for name in arms if name != "loop" and "int8" not in name]
    result["engine_texts_identical"] = all(t == engine_texts[0] for t in engine_texts)
    for name in arms:
        if "int8" in name:
            pairs = list(zip(runs[name][0]["texts"], engine_texts[0]))
            result["arms"][name]["texts_equal_to_float"] = round(sum(a == b for a, b in pairs) / len(pairs), 3)
    print(json.dumps(result, indent=1))
    if args.out:
        H.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
