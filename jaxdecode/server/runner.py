"""The engine's owner: one thread that alone touches the engine and the device, fed by the
server's event loop through an inbox, handing each request's deltas back to the loop.

The event loop never blocks on the engine: :meth:`EngineRunner.submit` and :meth:`abort` only put
a command in the inbox and wake the thread, and the thread answers through
``loop.call_soon_threadsafe`` into each request's :class:`asyncio.Queue`. An idle engine waits
on a condition variable (it does not spin). A request is aborted in the engine at the thread's
next turn, that is within one engine step of the client leaving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

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

    def put(self, item):
        """Hand ``item`` to the event loop (from the engine's thread)."""
        self.loop.call_soon_threadsafe(self.deliver, item)

    def deliver(self, item):
        """Put ``item`` in the queue (on the event loop's thread)."""
        self.queue.put_nowait(item)


def _deliver(items):
    for handle, item in items:
        handle.deliver(item)


class _Active:
    __slots__ = ("handle", "stream", "submitted", "first", "last", "tokens")

    def __init__(self, handle, stream, submitted):
        self.handle, self.stream, self.submitted = handle, stream, submitted
        self.first = self.last = None
        self.tokens = 0


class EngineRunner:
    """Drive ``engine`` from a thread of its own (see the module docstring). ``metrics``: an
    object with ``observe(runner)``, ``prompt(tokens)``, ``generated(tokens)``, ``first_token(s)``
    and ``per_token(s)`` (:class:`jaxdecode.server.metrics.Metrics`), or None."""

    def __init__(self, engine, metrics=None):
        self.engine, self.metrics = engine, metrics
        self._inbox: deque = deque()
        self._cv = threading.Condition()
        self._active: dict[int, _Active] = {}
        self._stopping = False
        # read by the event loop (admission control); queued and running: written by the engine's thread
        self.waiting = 0  # requests submitted that the engine's thread has not taken yet
        self.queued = 0  # the engine's rows waiting for a slot (Engine.queued), as of the thread's last turn
        self.running = 0  # requests with a row in a slot
        self._thread = threading.Thread(target=self._loop, name="jaxdecode-engine", daemon=True)

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

    def abort(self, handle: Handle):
        with self._cv:
            handle.aborted = True
            self._inbox.append(("abort", handle))
            self._cv.notify()

    # --- the thread
    def _loop(self):
        engine = self.engine
        while True:
            with self._cv:
                while not self._inbox and not self._active and not self._stopping:
                    self._cv.wait()
                commands = list(self._inbox)
                self._inbox.clear()
                if self._stopping and not commands and not self._active:
                    return
            for command in commands:
                self._command(command)
            try:
                if self._active:
                    engine.step()
                self._hand_out()
                # let the event loop take the GIL now, to send what was handed out: a thread that
                # stays busy in Python would keep it up to the interpreter's switch interval (5 ms)
                time.sleep(0)
            except Exception as e:  # the device call (or the host's work on it) failed: end every request,
                log.exception("engine step failed")  # keep serving (a dead thread would hang every request)
                self._fail_all(e)
                self._hand_out()

    def _command(self, command):
        if command[0] == "submit":
            _, request, handle, include_stop = command
            if handle.aborted:
                self._taken()
                return
            try:
                index = self.engine.submit(request)
            except Exception as e:  # refused (a ValueError: the request's fault) or failed: that request only
                if not isinstance(e, ValueError):
                    log.exception("the engine failed to take a request")
                self._taken()
                handle.put(("error", e))
                return
            # counted as queued before it stops counting as waiting: the event loop always sees it in one
            self.queued = self.engine.queued
            self._taken()
            handle.index = index
            self._active[index] = _Active(handle, self.engine.stream(index, include_stop), time.perf_counter())
            if self.metrics is not None:
                self.metrics.prompt(len(self.engine.rows(index)[0].prompt))
            handle.put(("accepted", index))
        else:
            handle = command[1]
            if handle.index is not None and handle.index in self._active:
                try:
                    self.engine.abort(handle.index)
                except Exception:  # (the request then runs to its end)
                    log.exception("aborting a request failed")

    def _taken(self):
        with self._cv:  # (submit adds to it from the event loop's thread)
            self.waiting -= 1

    def _hand_out(self):
        """Every request's new deltas, handed to the event loop in one call per step (one wake-up of
        the loop, not one per request)."""
        now = time.perf_counter()
        out = []
        for index, entry in list(self._active.items()):
            deltas = entry.stream.poll()
            if deltas:
                new = sum(len(d.tokens) for d in deltas)
                if new:
                    if entry.first is None:
                        entry.first = now
                        if self.metrics is not None:
                            self.metrics.first_token(now - entry.submitted)
                    entry.last, entry.tokens = now, entry.tokens + new
                    if self.metrics is not None:
                        self.metrics.generated(new)
                out.append((entry.handle, deltas))
            if entry.stream.finished:
                if self.metrics is not None and entry.first is not None and entry.tokens > 1:
                    self.metrics.per_token((entry.last - entry.first) / (entry.tokens - 1))
                out.append((entry.handle, FINISHED))
                self.engine.forget(index)
                del self._active[index]
        by_loop: dict = {}
        for handle, item in out:
            by_loop.setdefault(handle.loop, []).append((handle, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)
        self.running = len({r.req for r in self.engine.rows_in_slots()})
        self.queued = self.engine.queued
        if self.metrics is not None:
            self.metrics.observe(self)

    def _fail_all(self, error: Exception):
        for index, entry in list(self._active.items()):
            self.engine.abort(index)
            entry.handle.put(("error", error))
            entry.handle.put(FINISHED)
            entry.stream.done = [True] * len(entry.stream.done)
            self.engine.forget(index)
            del self._active[index]
