"""Where a test run's time went, from the lines JAXDECODE_TEST_PROFILE=<folder> writes (tests/conftest.py).

    JAXDECODE_TEST_PROFILE=/tmp/prof python -m pytest -n auto
    python tools/test_profile.py /tmp/prof [--tests 30] [--json out.json]

Prints each worker's span and busy time (and how long the run ended on one worker alone), then per
file: tests, worker-seconds of wall, CPU seconds (the process's threads; and the processes the tests
started), XLA compiles and their seconds, tracing and lowering seconds, persistent-cache hits; then the
longest tests.
"""

import argparse
import collections
import glob
import json
import os
from pathlib import Path

COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
HITS = "/jax/compilation_cache/cache_hits"


def load(folder):
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def summary(rows):
    ev = lambda r, k: r["events"].get(k, 0)  # noqa: E731
    workers = collections.defaultdict(list)
    for r in rows:
        workers[r["worker"]].append(r)
    start = min(r["start"] for r in rows)
    spans = {w: (min(r["start"] for r in rs) - start, max(r["start"] + r["wall"] for r in rs) - start,
                 sum(r["wall"] for r in rs)) for w, rs in workers.items()}
    ends = sorted(e for _, e, _ in spans.values())
    files = collections.defaultdict(lambda: collections.Counter())
    for r in rows:
        f = files[r["test"].split("::")[0]]
        f["tests"] += 1
        f["wall"] += r["wall"]
        f["cpu"] += r["cpu"]
        f["child_cpu"] += r["child_cpu"]
        f["compiles"] += ev(r, COMPILE + ":n")
        f["compile_s"] += ev(r, COMPILE + ":s")
        f["trace_s"] += ev(r, TRACE + ":s")
        f["lower_s"] += ev(r, LOWER + ":s")
        f["hits"] += ev(r, HITS + ":n")
        f["slow_wall"] += r["wall"] if r["slow"] else 0
        f["quick"] += r.get("quick", False)
        f["quick_wall"] += r["wall"] if r.get("quick") else 0
    total = collections.Counter()
    for f in files.values():
        total.update(f)
    return {"spans": spans, "alone_at_end": ends[-1] - ends[-2] if len(ends) > 1 else 0.0,
            "files": dict(files), "total": total}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--tests", type=int, default=30, help="how many of the longest tests to list")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--write-units", action="store_true",
                    help="write tests/support/unit_seconds.json, the work units' CPU seconds that order a run "
                         "(every file group; other units of 3 s or more; units the run did not measure keep "
                         "their figures)")
    a = ap.parse_args()
    rows = load(a.folder)
    s = summary(rows)
    for w, (b, e, busy) in sorted(s["spans"].items()):
        print(f"{w}: from {b:7.1f} s to {e:7.1f} s, busy {busy:7.1f} s")
    print(f"the last worker alone at the end: {s['alone_at_end']:.1f} s")
    head = (f"{'file':34} {'tests':>5} {'wall':>7} {'cpu':>7} {'child':>6} {'compiles':>8} "
            f"{'xla_s':>6} {'trace':>6} {'lower':>6} {'hits':>5} {'slow':>6} {'quick':>5} {'q_wall':>6}")
    print(head)
    order = sorted(s["files"].items(), key=lambda kv: -kv[1]["wall"])
    for name, f in order + [("total", s["total"])]:
        print(f"{os.path.basename(name):34} {f['tests']:5d} {f['wall']:7.1f} {f['cpu']:7.1f} "
              f"{f['child_cpu']:6.1f} {f['compiles']:8d} {f['compile_s']:6.1f} {f['trace_s']:6.1f} "
              f"{f['lower_s']:6.1f} {f['hits']:5d} {f['slow_wall']:6.1f} {f['quick']:5d} "
              f"{f['quick_wall']:6.1f}")
    print()
    for r in sorted(rows, key=lambda r: -r["wall"])[:a.tests]:
        ev = r["events"]
        print(f"{r['wall']:7.1f} s wall {r['cpu']:7.1f} s cpu {ev.get(COMPILE + ':n', 0):5d} compiles "
              f"{ev.get(COMPILE + ':s', 0):6.1f} s xla  {r['worker']:5} "
              f"{'slow ' if r['slow'] else ''}{r['test']}")
    if a.write_units:
        units = collections.Counter()
        for r in rows:
            if r.get("unit"):
                units[r["unit"]] += r["cpu"] + r["child_cpu"]
        table = {u: max(1, round(sec)) for u, sec in sorted(units.items(), key=lambda kv: (-round(kv[1]), kv[0]))
                 if sec >= 3 or u.startswith("file:")}  # every file's group: a cheap one with many tests too
        out = Path(__file__).resolve().parents[1] / "tests" / "support" / "unit_seconds.json"
        # units this run did not measure (the slow tests, after a run without them) keep their figures
        kept = json.loads(out.read_text()) if out.exists() else {}
        table = dict(sorted(({**kept, **table}).items(), key=lambda kv: (-kv[1], kv[0])))
        out.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {out} ({len(table)} units)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1, default=float)


if __name__ == "__main__":
    main()
