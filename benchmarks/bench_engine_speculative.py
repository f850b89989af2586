"""Speculative decoding inside the engine against the plain engine, by the number of concurrent
requests, and where speculation stops paying.

For each concurrency ``c`` (``--concurrency``, default 1, 2, 4, 8, 16, 32), ``c`` sampled requests
(the prompt, ``--n`` tokens, no stop, the end token ignored, seeds 0..c-1) arrive at once at an
engine of ``c`` slots:

- ``plain kK``: the plain engine with ``K`` decode steps a call, for each ``K`` of ``--decode-steps``
  and ``--passes`` (``plain k1`` is its default);
- ``speculative kK``: the engine with the draft model (``speculative=`` the draft, ``--gamma``),
  ``K`` passes a call for each ``K`` of ``--passes`` (default 8, its default), every step a
  speculative pass (``speculative_max_rows`` = ``c``);
- ``speculative-off kK``: the same engine turned down at every step (``speculative_max_rows=0``):
  its plain passes, against which its speculative passes set the crossover;
- ``speculative-default kK`` (``c`` above ``SPECULATIVE_MAX_ROWS``): the same at its default
  ``speculative_max_rows``, which turns it to plain passes above that many decoding rows.

At one request the loops alone are timed too (:func:`jaxdecode.decoding.sampling.sample_tokens`
and :func:`jaxdecode.speculative.speculative_tokens` with the same draft and gamma), so that the
engine's speedup can be set against the loop's in the same run; and the engine's speculative
tokens are checked against :func:`jaxdecode.speculative.speculative_tokens`' for the same seeds.
Tokens per second, median of ``--repeats`` rounds (every arm once per round, in turn) after one
untimed round that compiles; each ratio is taken within a round, then its median given.

    python -m benchmarks.bench_engine_speculative
    python -m benchmarks.bench_engine_speculative --concurrency 1,2,4,8,32 --decode-steps 1 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax

from benchmarks import harness as H
from jaxdecode import speculative as SP
from jaxdecode.decoding import sampling
from jaxdecode.models import checkpoint
from jaxdecode.serving.config import SPECULATIVE_GAMMA, SPECULATIVE_MAX_ROWS, SPECULATIVE_PASSES, EngineConfig
from jaxdecode.serving.engine import Engine, Request
from jaxdecode.speculative.drafts.model import load_draft

PROMPT = "KATHARINA:\nMoved! in good time: "


def add(arms, name, fn, clock: str) -> None:
    """``fn`` as an arm timed by the wall clock, or by this process's CPU time."""
    if clock == "wall":
        arms.add(name, fn)
        return

    def cpu():
        t = time.process_time()
        fn()
        return time.process_time() - t

    arms.add(name, cpu, timed_by_itself=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default="checkpoints/shakespeare-bpe", help="target checkpoint folder")
    ap.add_argument("--draft", default=None, help="draft model folder (default: '<ckpt>-draft')")
    ap.add_argument("--n", type=int, default=200, help="tokens per request")
    ap.add_argument("--gamma", type=int, default=SPECULATIVE_GAMMA)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--decode-steps", default="1,8", help="the plain engines' decode steps per device call")
    ap.add_argument("--passes", default=str(SPECULATIVE_PASSES),
                    help="the speculative engines' passes per device call (each also against a plain engine "
                         "with as many decode steps a call)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time each run by the wall clock, or by this process's CPU time (all its threads: a "
                         "steadier figure while other processes load the machine)")
    ap.add_argument("--out", default=H.default_out("bench_engine_speculative"), help="the result file ('' for none)")
    args = ap.parse_args(argv)

    lm = checkpoint.load(args.ckpt)
    draft = load_draft(lm, args.draft)
    prompt = lm.vocab.encode(PROMPT)
    conc = [int(c) for c in args.concurrency.split(",")]
    requests = lambda c: [Request(PROMPT, args.n, seed=i, ignore_eos=True) for i in range(c)]

    passes = [int(k) for k in args.passes.split(",")]
    steps = sorted({int(k) for k in args.decode_steps.split(",")} | set(passes))
    arms, engines, counts = H.Arms(), {}, {}
    for c in conc:
        for k in steps:
            engines[c, f"plain k{k}"] = Engine(lm, config=EngineConfig(c, decode_steps=k))
        for k in passes:
            engines[c, f"speculative k{k}"] = Engine(lm, config=EngineConfig(
                c, decode_steps=k, speculative=draft, gamma=args.gamma, speculative_max_rows=c))
            # the same engine turned down at every step: its plain passes
            engines[c, f"speculative-off k{k}"] = Engine(lm, config=EngineConfig(
                c, decode_steps=k, speculative=draft, gamma=args.gamma, speculative_max_rows=0))
            if c > SPECULATIVE_MAX_ROWS:
                engines[c, f"speculative-default k{k}"] = Engine(lm, config=EngineConfig(
                    c, decode_steps=k, speculative=draft, gamma=args.gamma))
    for (c, name), engine in engines.items():
        def run(engine=engine, c=c, name=name):
            first = len(engine.requests)
            engine.run(requests(c))  # every row makes n tokens (ignore_eos; the outputs end at an end token)
            counts[c, name] = sum(len(row.tokens) for i in range(first, len(engine.requests))
                                  for row in engine.rows(i))
            return None
        add(arms, (c, name), run, args.clock)
    if 1 in conc:
        key = jax.random.PRNGKey(0)
        add(arms, (1, "loop-plain"), lambda: jax.block_until_ready(
            sampling.sample_tokens(lm.decoder, lm.params, [prompt], args.n, key).tokens), args.clock)
        add(arms, (1, "loop-speculative"), lambda: jax.block_until_ready(SP.speculative_tokens(
            lm.decoder, lm.params, [prompt], args.n, key, draft=draft, gamma=args.gamma).tokens), args.clock)
        counts[1, "loop-plain"] = counts[1, "loop-speculative"] = args.n

    print("# compiling (one untimed round)", file=sys.stderr)
    arms.round()
    for name in arms.runs:
        arms.runs[name].clear()
    load_before = H.load()
    arms.run(args.repeats, log=lambda m: print(m, file=sys.stderr))
    load_after = H.load()

    exact = None
    if 1 in conc:  # the engine's seeded tokens against speculative_tokens' for the same key and row
        engine = engines[1, f"speculative k{passes[0]}"]
        got = []
        for r in requests(3):
            engine.run([r])
            got.append(engine.rows(len(engine.requests) - 1)[0].tokens)
        want = [SP.speculative_tokens(lm.decoder, lm.params, [prompt], args.n, jax.random.PRNGKey(s), draft=draft,
                                      gamma=args.gamma).tokens[0].tolist() for s in range(3)]
        exact = got == want

    rows = []
    for (c, name) in arms.runs:
        tps = [counts[c, name] / r["seconds"] for r in arms.runs[c, name]]
        rows.append({"concurrency": c, "arm": name, "tokens_per_second": statistics.median(tps),
                     "tokens_per_second_runs": tps, **{k: v for k, v in arms.record((c, name)).items()}})
    by = {(r["concurrency"], r["arm"]): r for r in rows}
    for r in rows:  # against plain, within each round (a slow phase of the machine hits both), median
        base = (r["concurrency"], "loop-plain" if r["arm"].startswith("loop") else "plain " + r["arm"].split()[-1])
        ratios = [p["seconds"] / m["seconds"] for p, m in zip(arms.runs[base], arms.runs[r["concurrency"], r["arm"]])]
        r["speedup"], r["speedup_runs"] = statistics.median(ratios), ratios
    for (c, name), engine in engines.items():
        if not name.startswith("plain"):
            next(r for r in rows if (r["concurrency"], r["arm"]) == (c, name)).update(engine.speculative_stats())
    summary = {"tokens_equal_speculative_tokens": exact}
    # each default against the other's: the speculative engine at its passes against the plain one at one step
    if 1 in steps:
        k = passes[-1]
        summary["defaults"] = {c: statistics.median(p["seconds"] / m["seconds"] for p, m in zip(
            arms.runs[c, "plain k1"], arms.runs[c, f"speculative{'-default' if c > SPECULATIVE_MAX_ROWS else ''} k{k}"]))
            for c in conc}
    for k in passes:
        if 1 in conc:
            loop = by[1, "loop-speculative"]["speedup"]
            eng = by[1, f"speculative k{k}"]["speedup"]
            summary[f"k{k}"] = {"loop_speedup_1": loop, "engine_speedup_1": eng, "engine_over_loop_speedup_1": eng / loop}
        paying = [c for c in conc if by[c, f"speculative k{k}"]["speedup"] > 1]
        summary.setdefault(f"k{k}", {})["largest_concurrency_where_speculation_pays"] = max(paying) if paying else 0
        if (conc[0], f"speculative-off k{k}") in by:  # speculative passes against the same engine's plain ones
            ratio = {c: statistics.median(o["seconds"] / m["seconds"] for o, m in zip(
                arms.runs[c, f"speculative-off k{k}"], arms.runs[c, f"speculative k{k}"])) for c in conc}
            summary[f"k{k}"]["speculative_over_plain_passes"] = ratio
            ahead = [c for c in conc if ratio[c] > 1]
            summary[f"k{k}"]["largest_concurrency_where_speculative_passes_pay"] = max(ahead) if ahead else 0

    lines = ["| requests | arm | tokens/s | vs plain | acceptance |", "|---:|---|---:|---:|---:|"]
    for r in rows:
        acc = f"{r['acceptance']:.2f}" if "acceptance" in r and r["proposed"] else ""
        lines.append(f"| {r['concurrency']} | {r['arm']} | {r['tokens_per_second']:,.0f} | {r['speedup']:.2f}x | {acc} |")
    print("\n".join(lines))
    print(summary)
    if args.out:
        meta = {"checkpoint": str(lm.path), "draft": args.draft or "<ckpt>-draft", "n": args.n, "gamma": args.gamma,
                "prompt": PROMPT, "repeats": args.repeats, "clock": args.clock, "speculative_max_rows_default": SPECULATIVE_MAX_ROWS,
                "load_before": load_before, "load_after": load_after}
        H.write_json(args.out, H.result("benchmarks.bench_engine_speculative", argv, meta=meta, summary=summary,
                                        rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
