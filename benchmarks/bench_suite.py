"""The engine's arms in one run: for the shipped character model and ``shakespeare-bpe``, saturation
(the plain loop, the continuous engine at its defaults, static batching), the multi-turn chat with
prefix caching on and off, and, on ``shakespeare-bpe`` with its draft, speculative decoding at 1, 4
and 32 concurrent requests.

Each part is its benchmark's own run (:mod:`benchmarks.bench_engine`, :mod:`benchmarks.bench_engine_speculative`),
one after the other in this process; the result file holds each part's whole result and a summary
table, printed at the end.

    python -m benchmarks.bench_suite
    python -m benchmarks.bench_suite --repeats 5
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchmarks import bench_engine, bench_engine_speculative
from benchmarks import harness as H

MODELS = {"char": None, "bpe": "checkpoints/shakespeare-bpe"}


def _part(main, argv: list[str]) -> dict:
    """``main(argv + --out <temporary file>)``, and the result it wrote."""
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "part.json")
        if main(argv + ["--out", out]) != 0:
            raise SystemExit(f"bench_suite: {main.__module__} {' '.join(argv)} failed")
        return json.loads(Path(out).read_text())


def summary(parts: dict) -> list[dict]:
    """One row per figure the issue's table asks for."""
    rows = []
    for model in MODELS:
        arms = parts[f"saturation_{model}"]["saturation"]["arms"]
        for arm in ("loop", "continuous", "static"):
            rows.append({"model": model, "part": "saturation", "arm": arm, "tokens_per_s": arms[arm]["tokens_per_s"],
                         "vs_loop": arms[arm]["vs_loop"], "vs_static": arms[arm]["vs_static"]})
        chat = parts[f"chat_{model}"]["chat"]
        rows.append({"model": model, "part": "chat", "arm": "fifth turn's TTFT, prefix caching on / off",
                     "on_s": chat["ttft_s"]["on"][-1], "off_s": chat["ttft_s"]["off"][-1],
                     "ratio": chat["fifth_turn_on_vs_off"]})
    spec = parts["speculative_bpe"]["summary"]
    for c, ratio in spec["defaults"].items():
        rows.append({"model": "bpe", "part": "speculative", "arm": f"{c} concurrent, engine defaults over plain",
                     "ratio": ratio})
    k = next(key for key in spec if key.startswith("k") and "loop_speedup_1" in spec[key])
    rows.append({"model": "bpe", "part": "speculative", "arm": "1 request: engine's gain / the loop's",
                 "loop": spec[k]["loop_speedup_1"], "engine": spec[k]["engine_speedup_1"],
                 "ratio": spec[k]["engine_over_loop_speedup_1"]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="each part's timed rounds")
    ap.add_argument("--out", default=H.default_out("bench_suite"), help="the result file ('' for none)")
    args = ap.parse_args(argv)
    reps = ["--repeats", str(args.repeats)]
    parts = {}
    for model, ckpt in MODELS.items():
        where = ["--ckpt", ckpt] if ckpt else []
        parts[f"saturation_{model}"] = _part(bench_engine.main, where + reps)
        parts[f"chat_{model}"] = _part(bench_engine.main, where + reps + ["--chat"])
    parts["speculative_bpe"] = _part(bench_engine_speculative.main,
                                     ["--ckpt", MODELS["bpe"], "--concurrency", "1,4,32", "--decode-steps", "1"]
                                     + reps)
    if args.out:  # (the parts kept even if the summary below fails)
        H.write_json(args.out, H.result("benchmarks.bench_suite", argv, summary=None, parts=parts))
    rows = summary({name: _flatten(name, p) for name, p in parts.items()})
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        H.write_json(args.out, H.result("benchmarks.bench_suite", argv, summary=rows, parts=parts))
    return 0


def _flatten(name: str, part: dict) -> dict:
    """A part's result under the key :func:`summary` reads (bench_engine keeps one run per key)."""
    if name.startswith("speculative"):
        return part
    (run,) = part.values()
    return {name.split("_")[0]: run}


if __name__ == "__main__":
    sys.exit(main())
