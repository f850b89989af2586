"""What every benchmark shares: the machine probe, timing in interleaved rounds with the machine's
load before and after each arm, a peer process (Hugging Face, llama.cpp) driven line by line and
timed at its best thread count, and the result file.

A benchmark runs from the repository root as ``python -m benchmarks.NAME``; its result goes to
``benchmarks/results/NAME.json`` (``--out``), one current file per benchmark. This module imports
only the standard library and numpy at the top, so that a peer's environment (torch, no jax) can
import it too.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


# ----------------------------------------------------------------------------- the machine


def load() -> list[float]:
    """The machine's load average over 1, 5 and 15 minutes (this machine's cores are shared, and a
    figure depends on what else ran beside it)."""
    return [round(x, 2) for x in os.getloadavg()]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def git_state() -> dict:
    """The commit the tree is at and whether it has uncommitted changes (read only)."""
    try:
        run = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT,
                                        check=True).stdout.strip()
        return {"commit": run("log", "-1", "--format=%h"),
                "uncommitted_changes": bool(run("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "uncommitted_changes": None}


def machine(**extra) -> dict:
    """The machine a figure was measured on: CPU, cores, memory, platform, Python, jax (when this
    environment has it), the tree's commit and the load average now."""
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        mem_gb = None
    out = {"cpu": cpu_name(), "cores": os.cpu_count(), "memory_gb": mem_gb, "platform": platform.platform(),
           "python": platform.python_version()}
    try:
        import jax

        out |= {"jax": jax.__version__, "jax_backend": jax.default_backend()}
    except ImportError:
        pass
    return out | {"git": git_state(), "load_average": load()} | extra


def describe(m: dict) -> str:
    """A machine in one line."""
    jax = f", jax {m['jax']} ({m['jax_backend']})" if "jax" in m else ""
    return f"{m['cpu']}, {m['cores']} cores{jax}, load {m['load_average'][0]:.2f}"


class Probe:
    """The machine's matmul peak and read bandwidth, measured as often as a benchmark asks (every
    round, beside the rows): a bound uses the best of them, so that a slow moment of a shared
    machine cannot lower it."""

    SIZES_MB = (16, 32, 64, 128, 256, 512, 1024)

    def __init__(self):
        import jax
        import jax.numpy as jnp

        self.peaks: list[float] = []
        self.bandwidths: dict[int, list[float]] = {}
        self._sum = jax.jit(jnp.sum)
        self._square = jax.jit(lambda a: a @ a)

    @staticmethod
    def working_set(nbytes: int) -> int:
        """``nbytes`` rounded up to a power of two of at least 1 MB: a model whose weights fit in
        the last-level cache is bounded by that cache, not by DRAM."""
        return max(1 << 20, 1 << (int(nbytes) - 1).bit_length())

    def measure_peak(self) -> float:
        import jax.numpy as jnp

        a = jnp.ones((1024, 1024), jnp.float32)
        self._square(a).block_until_ready()
        self.peaks.append(2 * 1024**3 / best_of(lambda: self._square(a), 10))
        return self.peaks[-1]

    def measure_bandwidth(self, nbytes: int) -> float:
        import jax.numpy as jnp

        size = self.working_set(nbytes)
        x = jnp.ones((size // 4,), jnp.float32)
        self._sum(x).block_until_ready()
        reps = max(10, min(50, (1 << 30) // size))
        self.bandwidths.setdefault(size, []).append(size / best_of(lambda: self._sum(x), reps))
        return self.bandwidths[size][-1]

    def measure(self) -> None:
        """One more measurement of the peak and of every working set's bandwidth."""
        self.measure_peak()
        for mb in self.SIZES_MB:
            self.measure_bandwidth(mb << 20)

    def peak(self) -> float:
        """The best matmul rate (FLOP/s) measured in this run."""
        return max(self.peaks) if self.peaks else self.measure_peak()

    def bandwidth(self, nbytes: int) -> float:
        """The best read bandwidth (bytes/s) measured in this run for the working set of ``nbytes``."""
        size = self.working_set(nbytes)
        return max(self.bandwidths[size]) if size in self.bandwidths else self.measure_bandwidth(size)

    def record(self) -> dict:
        return {"matmul_peak_flops": self.peaks,
                "read_bandwidth": {f"{s >> 20} MB": v for s, v in sorted(self.bandwidths.items())}}


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> dict:
    """Bytes per second reading ``nbytes`` of float32 once: numpy's sum and jitted ``jnp.sum``, the
    best of ``repeats`` each (a working set far past the last-level cache: DRAM's rate)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = np.ones(nbytes // 4, np.float32)
    out = {"numpy sum": nbytes / best_of(a.sum, repeats)}
    x = jnp.asarray(a)
    del a
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    out["jnp.sum"] = nbytes / best_of(lambda: total(x), repeats)
    return out


# ----------------------------------------------------------------------------- timing


def seconds(fn: Callable) -> float:
    """The wall seconds of one call of ``fn``, its result ready (a jax array is waited for)."""
    t = time.perf_counter()
    out = fn()
    if "jax" in sys.modules:
        sys.modules["jax"].block_until_ready(out)
    return time.perf_counter() - t


def best_of(fn: Callable, repeats: int = 3) -> float:
    """The fastest of ``repeats`` calls of ``fn``, in seconds."""
    return min(seconds(fn) for _ in range(repeats))


def compile_seconds(fn: Callable) -> float:
    """A first call's seconds beyond a warm call's: the compiling (and any first-call cost)."""
    first = seconds(fn)
    return max(0.0, first - seconds(fn))


class Arms:
    """Arms timed in interleaved rounds: every round runs each arm once, in turn, so that a slow
    phase of the machine falls on every arm alike; the load average is recorded before and after
    each run of an arm. An arm is a callable; by default a run's figure is its wall seconds, or an
    arm returns its own seconds (``timed_by_itself``: a peer's process timing a call there)."""

    def __init__(self):
        self.arms: dict = {}
        self.runs: dict = {}

    def add(self, name, fn: Callable, timed_by_itself: bool = False) -> None:
        self.arms[name] = (fn, timed_by_itself)
        self.runs[name] = []

    def round(self) -> None:
        for name, (fn, own) in self.arms.items():
            before = load()[0]
            s = float(fn()) if own else seconds(fn)
            self.runs[name].append({"seconds": s, "load_before": before, "load_after": load()[0]})

    def run(self, rounds: int, between: Callable | None = None, log=print) -> None:
        """``rounds`` rounds (``between``: called before each, such as a probe of the machine)."""
        for r in range(rounds):
            t0 = time.perf_counter()
            if between is not None:
                between()
            self.round()
            log(f"# round {r + 1}/{rounds}: {time.perf_counter() - t0:.0f} s")

    def best(self, name) -> float:
        return min(r["seconds"] for r in self.runs[name])

    def median(self, name) -> float:
        return statistics.median(r["seconds"] for r in self.runs[name])

    def record(self, name) -> dict:
        """An arm's every run: seconds and the load before and after."""
        runs = self.runs[name]
        return {"seconds": [r["seconds"] for r in runs], "load_before": [r["load_before"] for r in runs],
                "load_after": [r["load_after"] for r in runs]}


# ----------------------------------------------------------------------------- a peer process


class Peer:
    """A program in another environment (torch, llama.cpp), driven one request line at a time: it
    writes one JSON line describing itself, then answers each line it reads with one line. A line
    starting ``{"error"`` is its failure, raised here."""

    def __init__(self, cmd: list[str], name: str, env: dict | None = None, cwd=ROOT):
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     cwd=cwd, env=env)
        self.info = json.loads(self.answer())

    def answer(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} ended (exit code {self.proc.poll()})")
        if line.startswith('{"error"'):
            raise RuntimeError(f"{self.name}: {json.loads(line)['error']}")
        return line

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def best_threads(timer: Callable[[int], float], counts, repeats: int = 1) -> dict:
    """A peer at its best thread count: ``timer(threads)`` runs one call with that many threads and
    returns its seconds; each count is timed ``repeats`` times (after one warm-up), and the
    fastest count is chosen. On a machine whose cores other work also uses, a peer's threads wait
    for each other at every operation, and fewer threads can be faster."""
    by = {}
    for k in counts:
        timer(k)
        by[k] = min(timer(k) for _ in range(repeats))
    best = min(by, key=by.get)
    return {"threads": best, "seconds": by[best], "seconds_by_threads": by}


def thread_counts(text: str | None) -> list[int]:
    """``--threads`` as a list (default: every core, and one)."""
    if not text:
        return list(dict.fromkeys((os.cpu_count() or 1, 1)))
    return [int(t) for t in text.split(",")]


# ----------------------------------------------------------------------------- the result


def default_out(name: str) -> str:
    """The current result file of benchmark ``name``."""
    return str(RESULTS / f"{name}.json")


def command(module: str, argv=None) -> str:
    """The command line that reproduces a run, from the repository root."""
    return " ".join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def clean(obj):
    """``obj`` as plain JSON values: numpy numbers and arrays as numbers and lists, a NaN or an
    infinity as null, keys as strings, anything else by its ``str``."""
    import math

    import numpy as np

    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return clean(obj.tolist())
    if isinstance(obj, np.generic):
        return clean(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def write_json(path, doc: dict) -> None:
    """Write ``doc`` (:func:`clean`) to ``path`` whole or not at all (a temporary file, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(clean(doc), indent=1, ensure_ascii=False, allow_nan=False) + "\n")
    os.replace(tmp, path)


def result(module: str, argv=None, **fields) -> dict:
    """A result document: the command, the machine (its load now) and ``fields``."""
    return {"command": command(module, argv), "machine": machine(), **fields}
