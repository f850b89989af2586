"""The engine's owner, apart from the event loop: :class:`EngineLoop` turns commands into engine
steps and each request's deltas, and two runners drive it.

- :class:`EngineRunner`: a thread of the server's process. The event loop puts commands in an
  inbox and wakes the thread; the thread answers through ``loop.call_soon_threadsafe``, once per
  step for every request. Simple, but the thread's host work and the event loop's share one GIL.
- :class:`jaxdecode.server.core.ProcessRunner`: the same loop in a process of its own (the
  server's default), so that the HTTP side and the engine's host work run side by side.

Either way the event loop never blocks on the engine, an idle engine sleeps (it does not spin),
and a request is aborted in the engine at its next turn, that is within one engine step of the
client leaving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque

import numpy as np

from jaxdecode.serving.engine import Request

log = logging.getLogger("jaxdecode.server")

FINISHED = "finished"  # the last item of a handle's queue


class Handle:
    """One submitted request as the event loop sees it: ``queue`` receives ``("accepted", index)``
    or ``("error", exception)`` first, then lists of :class:`~jaxdecode.serving.stream.Delta`, then
    ``FINISHED``."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        self.index: int | None = None
        self.aborted = False
        self.key = None  # the engine process's name for it (ProcessRunner)

    def put(self, item):
        """Hand ``item`` to the event loop (from another thread)."""
        self.loop.call_soon_threadsafe(self.deliver, item)

    def deliver(self, item):
        """Put ``item`` in the queue (on the event loop's thread)."""
        if isinstance(item, tuple) and item[0] == "accepted":
            self.index = item[1]
        self.queue.put_nowait(item)


@dataclasses.dataclass
class Stats:
    """What one turn of the loop adds to the metrics (:meth:`jaxdecode.server.metrics.Metrics.add`)."""

    prompt_tokens: int = 0
    generated: int = 0
    ttft: list = dataclasses.field(default_factory=list)  # seconds, one per request's first token
    tpot: list = dataclasses.field(default_factory=list)  # seconds per token, one per finished request
    running: int = 0  # requests with a row in a slot
    queued: int = 0  # the engine's rows waiting for a slot
    blocks: tuple = (0, 0)  # KV blocks used, free
    prefix: tuple = (0, 0, 0)  # the prefix cache so far: tokens looked up, found; evictions


class _Active:
    __slots__ = ("key", "stream", "submitted", "first", "last", "tokens")

    def __init__(self, key, stream, submitted):
        self.key, self.stream, self.submitted = key, stream, submitted
        self.first = self.last = None
        self.tokens = 0


class EngineLoop:
    """The engine driven one turn at a time, whoever owns it. A request is known by the ``key``
    its submitter gives; each call returns ``[(key, item)]``, the items of a :class:`Handle`'s
    queue."""

    def __init__(self, engine):
        self.engine = engine
        self._active: dict[int, _Active] = {}  # by engine index
        self._index: dict = {}  # key -> engine index
        self.stats = Stats()

    @property
    def busy(self) -> bool:
        return bool(self._active)

    def submit(self, key, request: Request, include_stop: bool) -> list:
        try:
            index = self.engine.submit(request)
        except Exception as e:  # refused (a ValueError: the request's fault) or failed: that request only
            if not isinstance(e, ValueError):
                log.exception("the engine failed to take a request")
            return [(key, ("error", e))]
        self._index[key] = index
        self._active[index] = _Active(key, self.engine.stream(index, include_stop), time.perf_counter())
        self.stats.prompt_tokens += len(self.engine.rows(index)[0].prompt)
        self.stats.queued = self.engine.queued
        return [(key, ("accepted", index))]

    def score(self, key, sequences: list, top: int) -> list:
        """The log-probabilities of prompts (:func:`jaxdecode.decoding.score.prompt_logprobs`), run
        between two engine steps: ``[(key, ("scored", [...]))]``, or the error as the key's item."""
        from jaxdecode.decoding.score import prompt_logprobs

        lm = self.engine.lm
        try:
            scored = prompt_logprobs(lm.decoder, lm.params, [np.asarray(s, np.int32) for s in sequences], top)
        except Exception as e:  # a ValueError is the request's fault; anything else is logged
            if not isinstance(e, ValueError):
                log.exception("scoring a prompt failed")
            return [(key, ("error", e))]
        return [(key, ("scored", [tuple(x.tolist() for x in part) for part in scored]))]

    def abort(self, key):
        index = self._index.get(key)
        if index is not None and index in self._active:
            try:
                self.engine.abort(index)
            except Exception:  # (the request then runs to its end)
                log.exception("aborting a request failed")

    def turn(self) -> list:
        """One engine step (if any request is active), then every request's new deltas."""
        if self._active:
            self.engine.step()
        return self.hand_out()

    def hand_out(self) -> list:
        now, out, stats = time.perf_counter(), [], self.stats
        for index in self.engine.touched():  # (the others have nothing new)
            entry = self._active.get(index)
            if entry is None:
                continue
            deltas = entry.stream.poll()
            if deltas:
                new = sum(len(d.tokens) for d in deltas)
                if new:
                    if entry.first is None:
                        entry.first = now
                        stats.ttft.append(now - entry.submitted)
                    entry.last, entry.tokens = now, entry.tokens + new
                    stats.generated += new
                out.append((entry.key, deltas))
            if entry.stream.finished:
                if entry.first is not None and entry.tokens > 1:
                    stats.tpot.append((entry.last - entry.first) / (entry.tokens - 1))
                out.append((entry.key, FINISHED))
                self._drop(index)
        stats.running = len({r.req for r in self.engine.rows_in_slots()})
        stats.queued = self.engine.queued
        stats.blocks = self.engine.kv_blocks()
        counts = self.engine.prefix_counts()  # the paged pool's or the dense slots' (None: off)
        if counts is not None:
            stats.prefix = counts
        return out

    def fail_all(self, error: Exception) -> list:
        """End every request with ``error`` (after a step failed)."""
        out = []
        for index, entry in list(self._active.items()):
            self.engine.abort(index)
            out += [(entry.key, ("error", error)), (entry.key, FINISHED)]
            self._drop(index)
        return out

    def take_stats(self) -> Stats:
        stats = self.stats
        self.stats = Stats(running=stats.running, queued=stats.queued, blocks=stats.blocks, prefix=stats.prefix)
        return stats

    def _drop(self, index):
        entry = self._active.pop(index)
        self._index.pop(entry.key, None)
        self.engine.forget(index)


def _deliver(items):
    for handle, item in items:
        handle.deliver(item)


class EngineRunner:
    """Drive ``engine`` from a thread of this process (see the module docstring). ``metrics``: a
    :class:`jaxdecode.server.metrics.Metrics`, or None."""

    def __init__(self, engine, metrics=None):
        self.engine, self.metrics = engine, metrics
        self._core = EngineLoop(engine)
        self._inbox: deque = deque()
        self._cv = threading.Condition()
        self._stopping = False
        # read by the event loop (admission control); queued and running: written by the engine's thread
        self.waiting = 0  # requests submitted that the engine's thread has not taken yet
        self.queued = 0  # the engine's rows waiting for a slot (Engine.queued), as of the thread's last turn
        self.running = 0  # requests with a row in a slot
        self._thread = threading.Thread(target=self._loop, name="jaxdecode-engine", daemon=True)
        self.blocks_at_start = engine.kv_blocks()  # KV blocks used and free, as the engine starts

    def start(self):
        self._thread.start()

    def stop(self, timeout: float = 30.0):
        """Finish what is running, then end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: Request, handle: Handle, include_stop: bool = False):
        with self._cv:
            self.waiting += 1
            self._inbox.append(("submit", request, handle, include_stop))
            self._cv.notify()

    def score(self, sequences: list, top: int, handle: Handle):
        """Score prompts (:meth:`EngineLoop.score`) between two steps; the answer comes to ``handle``."""
        with self._cv:
            self._inbox.append(("score", sequences, top, handle))
            self._cv.notify()

    def abort(self, handle: Handle):
        with self._cv:
            handle.aborted = True
            self._inbox.append(("abort", handle))
            self._cv.notify()

    # --- the thread
    def _loop(self):
        core = self._core
        while True:
            with self._cv:
                while not self._inbox and not core.busy and not self._stopping:
                    self._cv.wait()
                commands = list(self._inbox)
                self._inbox.clear()
                if self._stopping and not commands and not core.busy:
                    return
            out = []
            for command in commands:
                out += self._command(command)
            try:
                out += core.turn()
            except Exception as e:  # the device call (or the host's work on it) failed: end every request,
                log.exception("engine step failed")  # keep serving (a dead thread would hang every request)
                out += core.fail_all(e)
            self._hand_out(out)
            # let the event loop take the GIL now, to send what was handed out: a thread that
            # stays busy in Python would keep it up to the interpreter's switch interval (5 ms)
            time.sleep(0)

    def _command(self, command) -> list:
        if command[0] == "abort":
            self._core.abort(command[1])
            return []
        if command[0] == "score":
            _, sequences, top, handle = command
            return self._core.score(handle, sequences, top)
        _, request, handle, include_stop = command
        try:
            if handle.aborted:
                return []
            out = self._core.submit(handle, request, include_stop)
            # counted as queued before it stops counting as waiting: the event loop always sees it in one
            self.queued = self.engine.queued
            return out
        finally:
            with self._cv:  # (submit adds to it from the event loop's thread)
                self.waiting -= 1

    def _hand_out(self, out):
        """Every request's new items, handed to the event loop in one call per step (one wake-up of
        the loop, not one per request)."""
        by_loop: dict = {}
        for handle, item in out:
            by_loop.setdefault(handle.loop, []).append((handle, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)
        stats = self._core.take_stats()
        self.running, self.queued = stats.running, stats.queued
        if self.metrics is not None:
            self.metrics.add(stats, self.waiting)
