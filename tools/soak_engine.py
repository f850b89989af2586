"""Soak run: the serving engine on the shipped model serves thousands of requests with random
settings, on the dense and the paged cache in turn, while a second thread compiles new programs in
the same process. Checks that it survives, that every block returns to the pool after each round,
that sampled requests equal :func:`jaxdecode.generate` alone, and that resident memory is flat
after warm-up.

    python tools/soak_engine.py --requests 3000 --out soak.json

Prints one line per round and writes the figures as JSON (see ``docs/soak.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecode
from jaxdecode import rules
from jaxdecode.models import checkpoint
from jaxdecode.serving.engine import Engine
from jaxdecode.serving.requests import Request

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def random_request(rng: np.random.Generator, vocab_chars: str, T: int) -> Request:
    p = int(rng.integers(1, 48))
    prompt = "".join(rng.choice(list(vocab_chars), p))
    n = int(rng.integers(1, min(96, T - p)))
    kind = int(rng.integers(0, 4))
    rule = None
    if kind == 1:
        rule = rules.chain(rules.temperature(float(rng.uniform(0.5, 1.5))), rules.top_k(int(rng.integers(1, 40))))
    elif kind == 2:
        rule = rules.chain(rules.temperature(float(rng.uniform(0.5, 1.5))), rules.top_p(float(rng.uniform(0.5, 1.0))))
    elif kind == 3:
        rule = rules.chain(rules.temperature(float(rng.uniform(0.7, 1.2))), rules.top_k(int(rng.integers(5, 60))))
    stop = None if rng.random() < 0.7 else str(rng.choice(["\n", "e", ", ", ":\n"]))
    return Request(prompt=prompt, n=n, seed=int(rng.integers(0, 2**31)), num_samples=int(rng.integers(1, 4)),
                   rule=rule, greedy=bool(rng.random() < 0.2), stop=stop)


def compiler(stop: threading.Event, counter: list[int]) -> None:
    """Compile new programs until told to stop: shapes never seen before, so each call compiles."""
    rng = np.random.default_rng(1)
    while not stop.is_set():
        m, k = int(rng.integers(8, 200)), int(rng.integers(8, 200))
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        s = float(rng.uniform())  # one scale per program
        f = jax.jit(lambda a, s=s: jnp.tanh(a @ a.T * s).sum(axis=0) + jnp.cumsum(a[:, 0]).sum())
        f(x).block_until_ready()
        counter[0] += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--per-round", type=int, default=150)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--check-every", type=int, default=10, help="compare every k-th request with generate")
    ap.add_argument("--no-compiler", action="store_true", help="no second thread compiling beside the engine")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    lm = checkpoint.load()  # the shipped model, native backend where it builds
    chars = "".join(c for c in lm.vocab.chars if c.isalpha() or c in " ,.\n:")
    rng = np.random.default_rng(0)
    stop = threading.Event()
    compiled = [0]
    thread = threading.Thread(target=compiler, args=(stop, compiled), daemon=True)
    if not args.no_compiler:
        thread.start()
    rounds, served, checked, mismatches = [], 0, 0, 0
    t0 = time.perf_counter()
    try:
        r = 0
        while served < args.requests:
            cache = ("dense", "paged")[r % 2]
            eng = Engine(lm, args.slots, cache=cache)
            batch = [random_request(rng, chars, lm.decoder.T) for _ in range(args.per_round)]
            report = eng.run(batch)
            outs = [res.outputs for res in report.results]
            if cache == "paged":
                a = eng.allocator
                assert a.num_free == a.num_blocks and not a.sequences(), (a.num_free, a.num_blocks)
            for i in range(0, len(batch), args.check_every):
                q = batch[i]
                want = jaxdecode.generate(lm, q.prompt, q.n, seed=q.seed, num_samples=q.num_samples, rule=q.rule,
                                          greedy=q.greedy, stop=q.stop)
                got = outs[i]
                checked += 1
                if [g.text for g in got] != [w.text for w in want]:
                    mismatches += 1
            served += len(batch)
            rounds.append({"round": r, "cache": cache, "served": served, "rss_mib": round(rss_mib(), 1),
                           "mappings": sum(1 for _ in open("/proc/self/maps")),
                           "compiled_beside": compiled[0], "checked": checked, "mismatches": mismatches,
                           "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(rounds[-1]), flush=True)
            r += 1
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
    warm = rounds[min(2, len(rounds) - 1)]["rss_mib"]
    end = rounds[-1]["rss_mib"]
    summary = {"requests": served, "rounds": len(rounds), "checked_against_generate": checked,
               "mismatches": mismatches, "compiled_beside": compiled[0], "rss_after_warmup_mib": warm,
               "rss_end_mib": end, "rss_growth_mib": round(end - warm, 1), "backend": lm.decoder.backend,
               "seconds": round(time.perf_counter() - t0, 1), "rounds_detail": rounds}
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds_detail"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
