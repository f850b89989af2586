"""The engine against the plain loop at saturation, and prefix caching on a multi-turn chat.

**Saturation.** The ``jaxdecode serve-bench`` workload (prompts of 16 to 64 characters of held-out
text, lengths drawn from n/4 to n, a stop at a blank line, temperature and top-p drawn per request,
every fourth request greedy), ``--requests`` of them arriving at once, served with ``--slots``
slots by:

- ``loop``: :func:`jaxdecode.generate` over ``--slots`` requests at a time, as a user with a list
  of prompts would run it (the greedy and the sampled requests of a batch in one call each, every
  sampled row with its own temperature, top-p and seed; each batch runs to its longest row);
- ``continuous``: the engine at its defaults (``EngineConfig(slots)``);
- ``static``: the engine with the static policy, otherwise its defaults;
- ``continuous-k1``: the engine with one decode step per device call (the old default);
- any ``--extra`` settings, as ``name=key:value,key:value`` (``paged=cache:paged``).

Generated tokens per second (each request's tokens up to its stop or its ``n``), median of
``--repeats`` passes run in turn after one untimed pass that compiles every program; the ratios
against the loop and against static batching are taken within each pass and their median given.

**Multi-turn chat** (``--chat``): a conversation of five turns, each turn's prompt the whole history
so far (``--history`` tokens by the fifth), served one turn at a time on the ``--cache`` (default
the dense one) with prefix caching on and off, their conversations in turn; the time to first
token of each turn, median of ``--repeats`` conversations.

    python -m benchmarks.bench_engine                                  # the shipped character model
    python -m benchmarks.bench_engine --ckpt checkpoints/shakespeare-bpe --n 48
    python -m benchmarks.bench_engine --chat --ckpt checkpoints/shakespeare-bpe
    python -m benchmarks.bench_engine --extra no-prefix=prefix_caching:false   # reuse off, as an arm
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import jaxdecode
from benchmarks import harness as H
from jaxdecode import rules
from jaxdecode.cli.bench import build_workload, heldout_text
from jaxdecode.serving import Engine, EngineConfig, Request
from jaxdecode.serving.requests import rule_parts


def saturating(lm, count: int, n: int, seed: int) -> list[Request]:
    held = heldout_text(lm, None)
    return [dataclasses.replace(r, arrival=0.0) for r in build_workload(lm, held, count, 1e9, n, 0, seed)]


def run_loop(lm, reqs: list[Request], slots: int) -> tuple[float, int]:
    """Seconds, and the tokens the requests asked for: a row's tokens up to its own ``n`` (its
    batch runs to the longest ``n``; those first tokens are the engine's, drawn with the same keys)."""
    t0 = time.perf_counter()
    tokens = 0
    for b in range(0, len(reqs), slots):
        part = reqs[b:b + slots]
        greedy = [r for r in part if r.greedy]
        sampled = [r for r in part if not r.greedy]
        if greedy:
            gens = jaxdecode.generate(lm, [r.prompt for r in greedy], max(r.n for r in greedy), greedy=True,
                                      stop=part[0].stop)
            tokens += sum(min(len(g.tokens), r.n) for g, r in zip(gens, greedy))
        if sampled:
            parts = [rule_parts(r.rule) for r in sampled]
            rule = rules.chain(rules.temperature(np.array([float(p[0].t) for p in parts], np.float32)),
                               rules.top_p(np.array([float(p[1].p) for p in parts], np.float32)))
            gens = jaxdecode.generate(lm, [r.prompt for r in sampled], max(r.n for r in sampled), rule=rule,
                                      seed=[r.seed for r in sampled], stop=part[0].stop)
            tokens += sum(min(len(g.tokens), r.n) for g, r in zip(gens, sampled))
    return time.perf_counter() - t0, tokens


def run_engine(lm, reqs: list[Request], config: EngineConfig) -> tuple[float, int, list]:
    engine = Engine(lm, config=config)
    t0 = time.perf_counter()
    report = engine.run(reqs)
    secs = time.perf_counter() - t0
    outs = [g for r in report.results for g in r.outputs]
    return secs, sum(len(g.tokens) for g in outs), [g.text for g in outs]


def parse_extra(text: str) -> tuple[str, dict]:
    name, _, spec = text.partition("=")
    fields = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition(":")
        if value.lower() in ("true", "false"):
            fields[key] = value.lower() == "true"
        else:
            fields[key] = int(value) if value.lstrip("-").isdigit() else value
    return name, fields


def saturation(lm, args) -> dict:
    reqs = saturating(lm, args.requests, args.n, args.seed)
    base = EngineConfig(args.slots)
    arms = {"loop": lambda: run_loop(lm, reqs, args.slots)[:2],
            "continuous": lambda: run_engine(lm, reqs, base),
            "static": lambda: run_engine(lm, reqs, dataclasses.replace(base, policy="static")),
            "continuous-k1": lambda: run_engine(lm, reqs, dataclasses.replace(base, decode_steps=1))}
    for text in args.extra:
        name, fields = parse_extra(text)
        arms[name] = lambda f=fields: run_engine(lm, reqs, dataclasses.replace(base, **f))
    texts = {}
    for name, arm in arms.items():  # compiles every program
        out = arm()
        if len(out) > 2:
            texts[name] = out[2]
        print(f"warm: {name}", file=sys.stderr, flush=True)
    passes = []
    for _ in range(args.repeats):
        one = {}
        for name, arm in arms.items():
            before = H.load()[0]
            secs, chars = arm()[:2]
            one[name] = {"seconds": secs, "tokens": chars, "load": [before, H.load()[0]]}
        passes.append(one)
    out = {}
    for name in arms:
        secs = statistics.median(p[name]["seconds"] for p in passes)
        rate = statistics.median(p[name]["tokens"] / p[name]["seconds"] for p in passes)
        out[name] = {"seconds": round(secs, 3), "tokens_per_s": round(rate, 1),
                     "vs_loop": round(statistics.median(
                         (p[name]["tokens"] / p[name]["seconds"]) / (p["loop"]["tokens"] / p["loop"]["seconds"])
                         for p in passes), 3),
                     "vs_static": round(statistics.median(
                         (p[name]["tokens"] / p[name]["seconds"]) / (p["static"]["tokens"] / p["static"]["seconds"])
                         for p in passes), 3),
                     "loads": [p[name]["load"] for p in passes]}
    engine_texts = list(texts.values())
    return {"arms": out, "engine_texts_identical": all(t == engine_texts[0] for t in engine_texts),
            "defaults": dataclasses.asdict(base)}


def chat(lm, args) -> dict:
    """Five turns; each turn's prompt is the history so far, growing to ``--history`` tokens."""
    held = heldout_text(lm, None)
    ids = lm.vocab.encode(held[:20 * args.history])
    turns = 5
    per_turn = args.history // (turns - 1)
    texts = [lm.vocab.decode(ids[:per_turn * t + 16]) for t in range(turns)]
    ttft = {True: [[] for _ in range(turns)], False: [[] for _ in range(turns)]}
    for rep in range(args.repeats + 1):
        for caching in (True, False):  # in turn, so that a change of load falls on both
            engine = Engine(lm, config=EngineConfig(1, cache=args.cache, prefix_caching=caching))
            for t, prompt in enumerate(texts):
                engine.submit(Request(prompt, 8, seed=rep, greedy=True))
                t0 = time.perf_counter()
                first = None
                while not engine.idle:
                    engine.step()
                    row = engine.rows(len(engine.requests) - 1)[0]
                    if first is None and row.tokens:
                        first = time.perf_counter() - t0
                if rep:  # the first conversation compiles
                    ttft[caching][t].append(first)
    results = {"on" if caching else "off": [round(statistics.median(x), 5) for x in ttft[caching]]
               for caching in (True, False)}
    prompt_tokens = [len(lm.vocab.encode(t)) for t in texts]
    on, off = results["on"][-1], results["off"][-1]
    return {"prompt_tokens": prompt_tokens, "ttft_s": results, "fifth_turn_on_vs_off": round(on / off, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=None, help="checkpoint folder (default: the shipped model)")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--n", type=int, default=64, help="the most characters (tokens) a request generates")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=KEY:VALUE,...",
                    help="another engine arm: EngineConfig fields over the defaults")
    ap.add_argument("--chat", action="store_true", help="the multi-turn chat instead of saturation")
    ap.add_argument("--history", type=int, default=200, help="--chat: tokens of history by the fifth turn")
    ap.add_argument("--cache", choices=("dense", "paged"), default="dense", help="--chat: the KV cache")
    ap.add_argument("--name", default=None, help="the run's name in the result file (default: the workload and "
                                                  "model, as saturation_bpe or chat_paged_char)")
    ap.add_argument("--out", default=None, help="the result file, to which this run is added under its workload and "
                                                "model (default benchmarks/results/bench_engine.json; '' for none)")
    args = ap.parse_args(argv)
    lm = jaxdecode.load(args.ckpt)
    name = "bpe" if args.ckpt and "bpe" in args.ckpt else "char"
    doc = {**H.result("benchmarks.bench_engine", argv), "backend": lm.decoder.backend, "settings": vars(args)}
    doc |= chat(lm, args) if args.chat else saturation(lm, args)
    print(json.dumps(H.clean(doc), indent=1))
    # one result file, a run per workload and model ("saturation_char", "chat_bpe", "chat_paged_bpe", ...)
    out = H.default_out("bench_engine") if args.out is None else args.out
    if out:
        try:
            runs = json.loads(Path(out).read_text())
        except (OSError, ValueError):
            runs = {}
        workload = ("chat" if args.cache == "dense" else f"chat_{args.cache}") if args.chat else "saturation"
        runs[args.name or f"{workload}_{name}"] = doc
        H.write_json(out, dict(sorted(runs.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
