"""The engine's clock and what it reports: :class:`RealClock`, a :class:`StepRecord` per step, a
:class:`RequestResult` per request and the run's :class:`Report` (see
:mod:`jaxdecode.serving.engine`)."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from jaxdecode.serving.requests import Request

class RealClock:
    """Wall-clock time since :meth:`start`; waiting for an arrival sleeps."""

    virtual = False

    def __init__(self):
        self._t0 = time.perf_counter()

    def start(self):
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def step_done(self, rows: int, prefill_tokens: int) -> float:
        return self.now()

    def wait_until(self, t: float):
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


@dataclasses.dataclass
class DeviceCall:
    """An engine's device call of ``k`` decode steps (and the prompt pieces before it), as sent:
    ``rows`` the ``(slot, row)`` pairs that choose tokens in it, ``out`` its tokens and
    log-probabilities (``single``: one step's ``[S]`` arrays, else ``[k, S]``), maybe still being
    computed."""

    start: float
    k: int
    rows: list
    out: tuple | None
    single: bool
    prefill_tokens: int
    active: int
    top: tuple | None = None  # the top log-probabilities (values, ids) [S, TOP_LOGPROBS] before its step

@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One engine step: when it started and ended (clock seconds), the rows its decode pass
    computed (every slot, or 0 without a decode pass), the rows that chose a token, and the prompt
    tokens it prefilled."""

    start: float
    end: float
    rows: int
    active: int
    prefill_tokens: int

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclasses.dataclass
class RequestResult:
    """A finished request: its samples (as :func:`jaxdecode.generate` returns them) and timings
    (clock seconds). ``first_token`` is None for ``n = 0``."""

    index: int
    request: Request
    outputs: list
    arrival: float
    first_token: float | None
    finish: float

    @property
    def tokens(self) -> int:
        return sum(len(g.tokens) for g in self.outputs)

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first token of any of its samples."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def latency(self) -> float:
        """End to end: arrival to its last sample's last token."""
        return self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, along its longest sample."""
        longest = max((len(g.tokens) for g in self.outputs), default=0)
        if self.first_token is None or longest < 2:
            return None
        return (self.finish - self.first_token) / (longest - 1)


def percentiles(values, qs=(50, 99)) -> dict:
    vals = [v for v in values if v is not None]
    return {f"p{q}": (float(np.percentile(vals, q)) if vals else None) for q in qs}


@dataclasses.dataclass
class Report:
    """What :meth:`Engine.run` returns: the requests in submission order and the steps."""

    policy: str
    slots: int
    results: list
    steps: list
    cache: dict | None = None  # a paged engine's cache figures (Engine.cache_stats), else None

    def summary(self) -> dict:
        """Throughput (generated tokens per second from the first arrival to the last finish),
        p50/p99 of latency, time to first token and time per output token, mean slot use."""
        res = self.results
        tokens = sum(r.tokens for r in res)
        t0 = min((r.arrival for r in res), default=0.0)
        t1 = max((r.finish for r in res), default=0.0)
        span = t1 - t0
        busy = [s for s in self.steps if s.rows]
        return {
            "policy": self.policy,
            "slots": self.slots,
            "requests": len(res),
            "tokens": tokens,
            "seconds": span,
            "throughput": tokens / span if span > 0 else None,
            "latency": percentiles(r.latency for r in res),
            "ttft": percentiles(r.ttft for r in res),
            "tpot": percentiles(r.tpot for r in res),
            "steps": len(self.steps),
            "mean_active": float(np.mean([s.active for s in busy])) if busy else 0.0,
            "mean_step_seconds": float(np.mean([s.seconds for s in self.steps])) if self.steps else None,
        } | ({} if self.cache is None else {"cache": dict(self.cache)})


def cache_stats(engine) -> dict:
    """A paged engine's cache figures since its last run started: the pool, the peak of blocks in
    use and its bytes, what a contiguous cache of ``slots`` rows of the window ``T`` takes, and
    the prompt tokens served from cached prefix blocks."""
    a = engine.allocator
    pool = getattr(engine.executor, "pool", None)  # (a stand-in executor may have none)
    per = None if pool is None else pool.nbytes // (a.num_blocks * a.block_size)  # a position, all layers
    nbytes = lambda positions: None if per is None else int(positions * per)
    # a contiguous float32 cache of the same heads: every slot holding the whole window
    dense = None if pool is None else 2 * len(pool.k) * math.prod(pool.k[0].shape[1::2]) * 4
    return {"layout": engine.layout, "block_size": a.block_size, "num_blocks": a.num_blocks,
            "kv_dtype": engine.kv_dtype, "bytes_per_position": per, "peak_blocks": engine.peak_blocks,
            "peak_bytes": nbytes(engine.peak_blocks * a.block_size),
            "pool_bytes": nbytes(a.num_blocks * a.block_size),
            "contiguous_bytes": None if dense is None else int(engine.S * engine.T * dense),
            "prefix_hit_tokens": engine.prefix_hit_tokens, "block_waits": engine.block_waits}
