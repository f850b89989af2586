"""Where an engine step's time goes: the device calls of each kind, timed one by one.

The engine serves the ``bench_engine`` saturation workload (``--requests`` at once, ``--slots``
slots) without overlap, each device call waited for as it returns, so that the time of each kind
of call (prompt pieces, decode calls, rule-state setup at admission) and the host's time between
them add up to the run's. Prints one line per setting of ``--decode-steps``.

    python -m tools.engine_breakdown                                    # the shipped model
    python -m tools.engine_breakdown --ckpt checkpoints/shakespeare-bpe
"""

from __future__ import annotations

import argparse
import collections
import time

import jax

import jaxdecode
from benchmarks.bench_engine import saturating
from jaxdecode.serving import Engine, EngineConfig

CALLS = ("admit", "prefill", "prefill_pieces", "decode", "decode_many")


def breakdown(lm, reqs, config: EngineConfig, repeats: int) -> dict:
    best = None
    for _ in range(repeats + 1):  # the first compiles
        engine = Engine(lm, config=config)
        ex = engine.executor
        spent, count = collections.Counter(), collections.Counter()

        def timed(name, fn):
            def call(*args, **kwargs):
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                jax.block_until_ready((out, getattr(ex, "cache", None), getattr(ex, "pool", None), ex.logits))
                spent[name] += time.perf_counter() - t0
                count[name] += 1
                return out
            return call

        for name in CALLS:
            if hasattr(ex, name):
                setattr(ex, name, timed(name, getattr(ex, name)))
        t0 = time.perf_counter()
        report = engine.run(reqs)
        total = time.perf_counter() - t0
        if best is None or total < best["seconds"]:
            best = {"seconds": total, "steps": len(report.steps),
                    "tokens": sum(len(g.tokens) for r in report.results for g in r.outputs),
                    "calls": {n: {"seconds": spent[n], "count": count[n]} for n in spent},
                    "host": total - sum(spent.values())}
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--decode-steps", default="1,8")
    ap.add_argument("--cache", default="dense")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default="continuous", help="comma-separated: continuous, static")
    args = ap.parse_args(argv)
    lm = jaxdecode.load(args.ckpt)
    reqs = saturating(lm, args.requests, args.n, 0)
    for policy in args.policies.split(","):
        for k in (int(x) for x in args.decode_steps.split(",")):
            config = EngineConfig(args.slots, policy=policy, decode_steps=k, cache=args.cache, overlap=False)
            b = breakdown(lm, reqs, config, args.repeats)
            parts = ", ".join(f"{n} {v['seconds'] * 1e3:.0f} ms in {v['count']} calls" for n, v in b["calls"].items())
            print(f"{policy}, decode_steps {k}: {b['seconds'] * 1e3:.0f} ms for {b['tokens']} tokens in "
                  f"{b['steps']} steps: {parts}, host {b['host'] * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
