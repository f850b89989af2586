"""Serving benchmark: static against continuous batching on the shipped model, on the wall clock.

For each slot count, the ``jaxdecode serve-bench`` workload (requests arriving as a Poisson process,
prompts from the held-out text, lengths up to ``--n``, each with its own seed and settings) is
served by static and by continuous batching (after a first pass on a virtual clock that compiles
every program), ``--repeats`` times each, interleaved; the run of median throughput is reported.
Every engine step is recorded; the step-time model
``t = a + b * rows + c * prefill_tokens`` is fitted to all of them (several slot counts separate
``a`` from ``b``) and the simulator, replaying each run's outputs with that fit, predicts every run:
how far the prediction is from the measurement says how far to trust ``serve-bench --simulate``.

With ``--caches dense,paged`` (the default) every slot count is also served on the paged KV cache
(``Engine(cache="paged")``, ``--num-blocks`` blocks of ``--block-size``): those rows add the peak
paged cache memory beside a contiguous cache of ``slots x T`` positions and the prompt tokens found
in the pool (prefix hits; give ``--shared-prefix`` to have some). Each cache gets its own step-time
fit (the paged engine's steps run other programs).

Writes ``benchmarks/results/bench_serving.json`` (its ``step_model``, the dense cache's fit, is
what ``serve-bench --step-model`` reads; ``step_model_paged`` is the paged one's).

    python -m benchmarks.bench_serving                                # 32 requests at 4/s, 1,2,4,8 slots
    python -m benchmarks.bench_serving --requests 8 --slots 1,2 --n 16 --out /tmp/smoke.json  # a smoke run
    python -m benchmarks.bench_serving --requests 6 --slots 2 --n 16 --repeats 1 --caches paged \
        --shared-prefix 32 --out /tmp/smoke-paged.json                                        # paged only
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jaxdecode
from benchmarks import harness as H
from jaxdecode.cli.bench import build_workload, heldout_text
from jaxdecode.serving.engine import DEFAULT_PREFILL_CHUNK, Engine, RealClock
from jaxdecode.serving.simulator import DEFAULT_STEP_MODEL, StepTimeModel, VirtualClock, scripts_of, simulate


def _rel(pred, real):
    if pred is None or real is None or real == 0:
        return None
    return (pred - real) / real


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    p.add_argument("--slots", default="1,2,4,8", help="slot counts, separated by commas")
    p.add_argument("--n", type=int, default=64, help="the most characters a request generates")
    p.add_argument("--shared-prefix", type=int, default=0)
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each policy per slot count; the one of median throughput is reported")
    p.add_argument("--ckpt", default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--backend", default=None, help="native or portable (default: auto)")
    p.add_argument("--caches", default="dense,paged", help="dense, paged or both, separated by commas")
    p.add_argument("--block-size", type=int, default=16, help="paged cache: positions per block")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="paged cache: blocks in the pool (default: slots x T / block size)")
    p.add_argument("--out", default=H.default_out("bench_serving"), help="the result file")
    args = p.parse_args(argv)
    slot_counts = [int(s) for s in args.slots.split(",") if s.strip()]
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    if not caches or any(c not in ("dense", "paged") for c in caches):
        p.error(f"--caches must list dense and/or paged, got {args.caches!r}")

    def cache_kw(kind):
        return {} if kind == "dense" else dict(cache="paged", num_blocks=args.num_blocks,
                                                block_size=args.block_size)

    lm = jaxdecode.load(args.ckpt, backend=args.backend)
    requests = build_workload(lm, heldout_text(lm, args.data), args.requests, args.rate, args.n,
                              args.shared_prefix, args.seed)
    load_before = os.getloadavg()
    runs, loads, t0 = [], {}, time.perf_counter()
    records = {kind: [] for kind in caches}
    for S in slot_counts:
        for kind in caches:
            for policy in ("static", "continuous"):  # compile every program first
                Engine(lm, S, policy=policy, prefill_chunk=args.prefill_chunk,
                       clock=VirtualClock(DEFAULT_STEP_MODEL), **cache_kw(kind)).run(requests)
            tries = {"static": [], "continuous": []}
            for _ in range(args.repeats):  # interleaved, so that a busy spell of the machine hits both
                for policy in tries:
                    before = H.load()[0]
                    rep = Engine(lm, S, policy=policy, prefill_chunk=args.prefill_chunk, clock=RealClock(),
                                 **cache_kw(kind)).run(requests)
                    rep.load = [before, H.load()[0]]
                    records[kind] += rep.steps
                    tries[policy].append(rep)
            for policy, reps in tries.items():
                reps = sorted(reps, key=lambda r: r.summary()["throughput"])
                rep = reps[len(reps) // 2]  # the run of median throughput
                runs.append((S, kind, policy, rep, [r.summary()["throughput"] for r in reps]))
                loads[S, kind, policy] = [r.load for r in reps]
                s = rep.summary()
                line = (f"slots {S:>2} {kind:5} {policy:10} {s['throughput']:8.1f} tok/s  latency p50 "
                        f"{s['latency']['p50']:.3f} p99 {s['latency']['p99']:.3f} s  ttft p50 {s['ttft']['p50']:.3f} "
                        f"p99 {s['ttft']['p99']:.3f} s  step {1e3 * s['mean_step_seconds']:.2f} ms")
                c = s.get("cache")
                if c:
                    line += (f"  cache peak {c['peak_bytes'] / 1024:.0f} KiB ({c['peak_blocks']} blocks) vs "
                             f"contiguous {c['contiguous_bytes'] / 1024:.0f} KiB, prefix hits "
                             f"{c['prefix_hit_tokens']} tokens, {c['block_waits']} waits")
                print(line, flush=True)
    fits = {}
    for kind in caches:
        fit = StepTimeModel.fit(records[kind], note=f"{args.ckpt or 'shipped model'}, {lm.decoder.backend} backend, "
                                                    f"{kind} cache, {os.cpu_count()} CPUs")
        fits[kind] = fit
        print(f"fit ({kind}): t = {fit.a * 1e3:.3f} ms + {fit.b * 1e3:.4f} ms/row + {fit.c * 1e3:.5f} ms/prefill "
              f"token (rms error {fit.residual(records[kind]) * 1e3:.3f} ms over {len(records[kind])} steps)")

    results = []
    for S, kind, policy, rep, throughputs in runs:
        real = rep.summary()
        sim = simulate(lm, requests, slots=S, policy=policy, step_model=fits[kind], scripts=scripts_of(rep),
                       prefill_chunk=args.prefill_chunk, **cache_kw(kind)).summary()
        results.append({
            "slots": S, "cache": kind, "policy": policy, "measured": real, "simulated": sim,
            "throughput_of_each_repeat": throughputs,
            "load_before_and_after_each_repeat": loads[S, kind, policy],
            "relative_error": {"throughput": _rel(sim["throughput"], real["throughput"]),
                               "latency_p50": _rel(sim["latency"]["p50"], real["latency"]["p50"]),
                               "latency_p99": _rel(sim["latency"]["p99"], real["latency"]["p99"]),
                               "ttft_p50": _rel(sim["ttft"]["p50"], real["ttft"]["p50"])},
        })
    doc = {
        "command": H.command("benchmarks.bench_serving", argv),
        "settings": {"requests": args.requests, "rate": args.rate, "slots": slot_counts, "n": args.n,
                     "shared_prefix": args.shared_prefix, "prefill_chunk": args.prefill_chunk, "seed": args.seed,
                     "repeats": args.repeats, "caches": caches, "block_size": args.block_size,
                     "num_blocks": args.num_blocks},
        "machine": H.machine(load_average_before=load_before, backend=lm.decoder.backend),
        "wall_seconds": time.perf_counter() - t0,
        "step_model": fits[caches[0]].to_dict(),
        "step_model_rms_error": fits[caches[0]].residual(records[caches[0]]),
        "step_model_paged": fits["paged"].to_dict() if "paged" in fits else None,
        "steps_measured": sum(len(r) for r in records.values()),
        "results": results,
    }
    H.write_json(args.out, doc)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
