"""Where benchmarks, their results and the tools live: every benchmark and tool a page names
exists, every result file belongs to a benchmark, nothing under benchmarks/ or tools/ edits
``sys.path``, and no measurement is kept under docs/. The shared harness times arms in turn and
records the load around each run."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def _harness():
    spec = importlib.util.spec_from_file_location("bench_harness", ROOT / "benchmarks" / "harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.quick
def test_no_sys_path_edits_in_benchmarks_or_tools():
    found = [str(p.relative_to(ROOT)) for folder in ("benchmarks", "tools") for p in (ROOT / folder).rglob("*.py")
             if "sys.path" in p.read_text()]
    assert not found, found


@pytest.mark.quick
def test_every_benchmark_and_tool_a_page_names_exists():
    named = set()
    for page in PAGES:
        text = page.read_text()
        named |= {f"benchmarks/{m}.py" for m in re.findall(r"python -m benchmarks\.(\w+)", text)}
        named |= {f"tools/{m}.py" for m in re.findall(r"python -m tools\.(\w+)", text)}
        named |= set(re.findall(r"\b((?:benchmarks|tools)/[\w/]+\.(?:py|json))", text))
    named = {n for n in named if not Path(n).stem.isupper()}  # (NAME: a placeholder)
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert named and not missing, missing


def test_every_result_file_belongs_to_a_benchmark_and_none_is_under_docs():
    results = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert results
    for path in results:
        json.loads(path.read_text())  # whole JSON
        assert (ROOT / "benchmarks" / f"{path.stem}.py").exists() or (ROOT / "tools" / f"{path.stem}.py").exists(), path
    assert not list((ROOT / "docs").rglob("*.json"))  # docs hold prose and pictures; data lives beside its code


def test_arms_run_in_turn_with_the_load_around_each_run(monkeypatch):
    H = _harness()
    order, loads = [], iter(range(100))
    monkeypatch.setattr(H, "load", lambda: [float(next(loads)), 0.0, 0.0])
    arms = H.Arms()
    arms.add("a", lambda: order.append("a"))
    arms.add("b", lambda: order.append("b") or 0.25, timed_by_itself=True)
    arms.run(3, log=lambda m: None)
    assert order == ["a", "b"] * 3  # one run of each arm a round, in turn
    rec = arms.record("b")
    assert rec["seconds"] == [0.25] * 3 and arms.best("b") == arms.median("b") == 0.25
    # each run's load read just before and just after it
    assert rec["load_before"] == [2.0, 6.0, 10.0] and rec["load_after"] == [3.0, 7.0, 11.0]


def test_a_peer_runs_at_its_fastest_thread_count():
    H = _harness()
    cost = {1: 0.5, 2: 0.2, 4: 0.9}
    calls = []
    best = H.best_threads(lambda k: calls.append(k) or cost[k], [1, 2, 4], repeats=2)
    assert best == {"threads": 2, "seconds": 0.2, "seconds_by_threads": cost}
    assert calls == [1, 1, 1, 2, 2, 2, 4, 4, 4]  # a warm-up, then the timed calls


def test_a_result_file_is_plain_json(tmp_path):
    H = _harness()
    np = pytest.importorskip("numpy")
    out = tmp_path / "r.json"
    H.write_json(out, {"a": np.float32(1.5), "b": [float("nan"), np.arange(2)], 3: (1, 2)})
    assert json.loads(out.read_text()) == {"a": 1.5, "b": [None, [0, 1]], "3": [1, 2]}
