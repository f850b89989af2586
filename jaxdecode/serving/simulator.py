"""A scheduler simulator: the serving engine's own scheduling code on a virtual clock.

:func:`simulate` runs an :class:`~jaxdecode.serving.engine.Engine` with a :class:`VirtualClock`,
on which each engine step costs what a :class:`StepTimeModel` says, and a :class:`ReplayExecutor`
in place of the model: it replays each row's tokens from a real run (or, without one, emits
placeholder tokens until the row's ``n``). Everything else (the queue, admission, chunked
prefill, stop strings, when rows leave) is the engine's code, so the simulated schedule is the
one the engine would run if its steps took the modelled time.

The step-time model is ``t_step = a + b * rows + c * prefill_tokens``: ``rows`` is the number of
rows the step's decode pass computes (in this dense-slot engine every slot, whatever number of
them is active; 0 for a step without a decode pass) and ``prefill_tokens`` the prompt tokens it
reads. :meth:`StepTimeModel.fit` fits it by least squares to the
:class:`~jaxdecode.serving.engine.StepRecord` of real runs (several slot counts are needed to
separate ``a`` from ``b``) and it saves to and loads from JSON.

:func:`compare` runs static and continuous batching for several slot counts on one workload;
:func:`poisson_arrivals` draws the arrival times of a Poisson process.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

import numpy as np

from jaxdecode.serving.engine import DEFAULT_PREFILL_CHUNK, POLICIES, Engine, Report, Request

__all__ = ["DEFAULT_STEP_MODEL", "ReplayExecutor", "StepClock", "StepTimeModel", "VirtualClock", "compare",
           "poisson_arrivals", "scripts_of", "simulate", "with_arrivals"]


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
    """``seconds = a + b * rows + c * prefill_tokens`` for one engine step (never below ``floor``)."""

    a: float
    b: float
    c: float
    floor: float = 1e-6
    note: str = ""

    def __post_init__(self):
        for name in ("a", "b", "c", "floor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"step-time model: {name} must be a finite number, got {v!r}")
        if self.floor <= 0:
            raise ValueError(f"step-time model: floor must be > 0, got {self.floor!r}")

    def __call__(self, rows: int, prefill_tokens: int) -> float:
        return max(self.a + self.b * rows + self.c * prefill_tokens, self.floor)

    @classmethod
    def fit(cls, records: Sequence, note: str = "", trim: float | None = 4.0) -> StepTimeModel:
        """Least squares over :class:`~jaxdecode.serving.engine.StepRecord` objects (their
        ``rows``, ``prefill_tokens`` and ``seconds``). Columns that never vary are left out (their
        coefficient is 0) rather than guessed. With ``trim``, steps further than ``trim`` robust
        standard deviations (1.4826 median absolute deviations) from the first fit, such as a step
        paused by another process, are left out of a second fit."""
        records = list(records)
        if len(records) < 2:
            raise ValueError(f"fitting a step-time model needs at least 2 steps, got {len(records)}")
        X = np.array([[1.0, r.rows, r.prefill_tokens] for r in records])
        y = np.array([r.seconds for r in records])
        use = [0] + [k for k in (1, 2) if np.ptp(X[:, k]) > 0]
        coef = np.zeros(3)
        coef[use] = np.linalg.lstsq(X[:, use], y, rcond=None)[0]
        if trim is not None:
            r = y - X @ coef
            dev = np.abs(r - np.median(r))
            keep = dev <= max(trim * 1.4826 * np.median(dev), 1e-12)
            if keep.sum() > len(use) and not keep.all():
                coef[use] = np.linalg.lstsq(X[keep][:, use], y[keep], rcond=None)[0]
        return cls(float(coef[0]), float(coef[1]), float(coef[2]), note=note)

    def residual(self, records: Sequence) -> float:
        """The root mean square of (measured - modelled) step seconds."""
        err = [r.seconds - self(r.rows, r.prefill_tokens) for r in records]
        return float(np.sqrt(np.mean(np.square(err)))) if err else 0.0

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "c": self.c, "floor": self.floor, "note": self.note,
                "formula": "seconds = a + b * rows + c * prefill_tokens"}

    @classmethod
    def from_dict(cls, d: dict, where: str = "step-time model") -> StepTimeModel:
        if not isinstance(d, dict) or any(k not in d for k in ("a", "b", "c")):
            raise ValueError(f"{where}: expected an object with the coefficients a, b and c")
        try:
            return cls(d["a"], d["b"], d["c"], d.get("floor", 1e-6), d.get("note", ""))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def save(self, path) -> None:
        from jaxdecode.io.reports import write_json

        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path) -> StepTimeModel:
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read a step-time model from {path}: {e}") from None
        if isinstance(d, dict) and "step_model" in d:  # a benchmark's output holds its fit
            d = d["step_model"]
        return cls.from_dict(d, f"step-time model in {path}")


# The fit in benchmarks/results/bench_serving.json: the shipped model's engine steps (dense
# cache) on the native CPU backend of a quiet 2-core machine. What `serve-bench --simulate` uses
# unless given a fit of its own.
DEFAULT_STEP_MODEL = StepTimeModel(a=6.28e-4, b=9.18e-5, c=7.23e-5,
                                   note="shipped model, native CPU backend, 2 CPUs "
                                        "(benchmarks/results/bench_serving.json)")


class VirtualClock:
    """Time advanced only by the engine's steps (by ``step_model``) and by waiting for arrivals."""

    virtual = True

    def __init__(self, step_model: StepTimeModel):
        self.step_model = step_model
        self.t = 0.0

    def start(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def step_done(self, rows: int, prefill_tokens: int) -> float:
        self.t += self.step_model(rows, prefill_tokens)
        return self.t

    def wait_until(self, t: float):
        self.t = max(self.t, t)


class StepClock(VirtualClock):
    """Time counted in engine steps: each step the engine records takes one unit, and waiting
    for an arrival jumps to it, so a request arriving at ``t`` joins at the first step that starts
    at or after step ``t``, on any machine. Unlike :class:`VirtualClock` it is not virtual: the
    engine runs as on a real clock (``overlap`` stays on). Tests use it to script the timing of
    arrivals, admissions and slot assignments (``tests/serving/test_engine_schedules.py``)."""

    virtual = False

    def __init__(self):
        super().__init__(StepTimeModel(1.0, 0.0, 0.0))


class ReplayExecutor:
    """An engine executor without a model: row ``j`` of request ``i`` emits ``scripts[(i, j)]``
    (the tokens of a real run; past their end, or without a script, token 0). The engine's stop
    strings and ``n`` end the rows as in the real run."""

    def __init__(self, slots: int, scripts: dict | None = None):
        self.S = slots
        self.scripts = scripts or {}
        self._rows = [None] * slots

    def set_layout(self, layout):
        pass

    def admit(self, entries):
        for slot, row, _ in entries:
            self._rows[slot] = row

    def prefill(self, first, more):
        pass

    def prefill_pieces(self, pieces, tables):  # a paged engine's prompt pieces
        pass

    def decode_many(self, decoding, steps, lengths, k, tables=None, copies=None, n=None):
        """A paged engine's steps (``k`` of them; the blocks are the engine's business)."""
        out = [self.decode(decoding, steps + j * decoding, lengths) for j in range(k)]
        return tuple(np.stack(a) for a in zip(*out))

    def decode(self, decoding, steps, lengths):
        tokens = np.zeros((self.S,), np.int32)
        for s in np.flatnonzero(decoding):
            row = self._rows[s]
            script = self.scripts.get((row.req, row.j))
            if script is not None and steps[s] < len(script):
                tokens[s] = script[steps[s]]
        zeros = np.zeros((self.S,), np.float32)
        return tokens, zeros, zeros


def scripts_of(report: Report) -> dict:
    """The tokens of every row of a real run, for :class:`ReplayExecutor`."""
    return {(r.index, j): g.tokens for r in report.results for j, g in enumerate(r.outputs)}


def simulate(lm, requests: Sequence[Request], *, slots: int, policy: str, step_model: StepTimeModel,
             scripts: dict | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, **cache) -> Report:
    """Serve ``requests`` with the engine's scheduler on a virtual clock (see the module docstring).
    ``lm`` supplies the vocabulary and window only; ``scripts``: each row's tokens from a real run
    (:func:`scripts_of`), so stop strings end rows where they really did. ``cache``: the engine's
    cache settings (``cache="paged"``, ``num_blocks``, ``block_size``, ``prefix_caching``): a paged
    engine's admission, with its block allocator, is simulated too."""
    # speculation changes what a step costs and how many tokens it makes, which the step model and
    # the scripts do not say: the simulated engine is the plain one
    cache = {k: v for k, v in cache.items() if k not in ("speculative", "draft", "gamma", "speculative_max_rows")}
    engine = Engine(lm, slots, policy=policy, prefill_chunk=prefill_chunk, clock=VirtualClock(step_model),
                    executor=ReplayExecutor(slots, scripts), **cache)
    return engine.run(requests)


def compare(lm, requests: Sequence[Request], slot_counts: Sequence[int], step_model: StepTimeModel, *,
            scripts: dict | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, **cache) -> list[dict]:
    """:meth:`Report.summary` of every policy at every slot count (simulated; ``cache`` as
    :func:`simulate`)."""
    out = []
    for S in slot_counts:
        for policy in POLICIES[::-1]:
            rep = simulate(lm, requests, slots=S, policy=policy, step_model=step_model, scripts=scripts,
                           prefill_chunk=prefill_chunk, **cache)
            out.append(rep.summary())
    return out


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times (seconds, from 0) of ``count`` requests of a Poisson process of ``rate`` per
    second: cumulative exponential gaps, the first request at its gap."""
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"the number of requests must be an integer >= 0, got {count!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"the arrival rate must be a finite number > 0 per second, got {rate!r}")
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, size=count))


def with_arrivals(requests: Sequence[Request], arrivals: Sequence[float]) -> list[Request]:
    """Copies of ``requests`` arriving at ``arrivals``."""
    if len(requests) != len(arrivals):
        raise ValueError(f"{len(arrivals)} arrival times for {len(requests)} requests")
    return [dataclasses.replace(r, arrival=float(t)) for r, t in zip(requests, arrivals)]
