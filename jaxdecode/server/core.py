"""The engine in a process of its own (``jaxdecode serve``'s default): :class:`ProcessRunner`, on
the server's side, and :func:`core_main`, the process.

Why a process: on a busy server the event loop's work (parsing requests, one JSON chunk per token
per stream, socket writes) and the engine's host work (admission, reading tokens back, decoding
text) would otherwise share one GIL, and every millisecond the event loop holds it is a
millisecond the device waits for its next call. vLLM splits its API server from its engine core
the same way.

The two sides talk over a pipe. The server sends ``("submit", key, request, include_stop)``,
``("score", key, token sequences, top)`` (a prompt's log-probabilities, answered ``("scored", ...)``),
``("abort", key)`` and ``("stop",)``; the process answers, once per engine step, ``("step",
items, stats)``: every request's new items (a :class:`~jaxdecode.server.runner.Handle`'s queue
items, by key) and the step's :class:`~jaxdecode.server.runner.Stats`. On the server's side one
thread blocks on the pipe and hands each message to the event loop (``call_soon_threadsafe``);
the event loop only sends. The pipe stays blocking: an event loop that watched it (``add_reader``)
would make it non-blocking under uvloop (libuv does), and a burst of submissions then fails with
``BlockingIOError`` once the pipe's buffer is full instead of waiting the moment it takes the
engine to read. An idle engine process blocks on the pipe; it does not spin. It ends when told to
stop (after the requests in flight) or when the server's side of the pipe closes.

A request's constraint crosses the pipe as the pattern it was compiled from (``("regex",
pattern)``, ...) and is compiled again, once, on the engine's side: a compiled automaton over a
subword vocabulary can take megabytes. A pattern not compiled before compiles in a worker thread
there, and the engine keeps stepping its other requests meanwhile (a large JSON schema takes seconds).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import multiprocessing
import os
import queue
import signal
import threading
from multiprocessing.reduction import ForkingPickler

from jaxdecode.server.handlers import cached, compiled
from jaxdecode.server.runner import FINISHED, EngineLoop, Handle

log = logging.getLogger("jaxdecode.server")

STARTUP_S = 600.0  # loading the model (and compiling, with warm-up) in the engine's process
SEND_QUEUE = 256  # the engine's answers written to the pipe by a thread: at most this many queued


class EngineStartError(RuntimeError):
    """The engine's process could not start (its options were refused, or it died); the message
    says why."""


@dataclasses.dataclass(frozen=True)
class ConstraintSpec:
    """A constraint as it crosses the pipe: what :func:`jaxdecode.server.handlers.compiled` takes."""

    kind: str  # "regex", "choice" or "json"
    key: str


class ProcessRunner:
    """The server's side of the engine's process (see the module docstring); the interface of
    :class:`~jaxdecode.server.runner.EngineRunner`. ``build``: a picklable callable that returns
    the engine, the vocabulary and the model's generation defaults, called in the new process; ``metrics``: a
    :class:`~jaxdecode.server.metrics.Metrics`, or None."""

    def __init__(self, build, metrics=None):
        self.metrics = metrics
        ctx = multiprocessing.get_context("spawn")  # (a forked copy of a process running JAX is unsafe)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=core_main, args=(child, build), name="jaxdecode-engine", daemon=True)
        self._child = child
        self._handles: dict[int, Handle] = {}
        self._next = 0
        self._loop = None
        self._reader: threading.Thread | None = None
        self._stopped = threading.Event()  # the process said it stopped, or its pipe closed
        self._dead = False
        self.waiting = 0  # submitted, not yet taken by the engine
        self._unanswered: set[int] = set()  # their keys
        self.queued = 0  # the engine's rows waiting for a slot, as of its last step
        self.running = 0
        # the engine's window and vocabulary, the model's generation defaults, once launched
        self.T = self.V = self.vocab = self.defaults = None
        self.blocks_at_start = (0, 0)  # KV blocks used and free, as the engine starts

    def launch(self, timeout: float = STARTUP_S):
        """Start the process and wait until its engine is built (before the server listens)."""
        self._proc.start()
        self._child.close()
        if not self._conn.poll(timeout):
            self._proc.kill()
            raise EngineStartError(f"the engine's process did not start within {timeout:.0f} s")
        try:
            message = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise EngineStartError(f"the engine's process died while starting (exit code "
                                   f"{self._proc.exitcode})") from None
        if message[0] == "failed":
            self._proc.join(30)
            raise EngineStartError(message[1])
        _, self.T, self.V, self.vocab, self.defaults, self.compiled_at_start, self.blocks_at_start = message

    def start(self):
        """Begin reading the engine's answers (for the running event loop)."""
        self._loop = asyncio.get_running_loop()
        os.set_blocking(self._conn.fileno(), True)
        self._reader = threading.Thread(target=self._read, name="jaxdecode-engine-pipe", daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 30.0):
        """Let the engine finish what is running, then end its process."""
        if self._proc.is_alive() and not self._dead:
            try:
                self._conn.send(("stop",))
                if self._reader is not None:  # it reads what is left, until the process says it stopped
                    self._stopped.wait(timeout)
                else:
                    while self._conn.poll(timeout):  # (what is left of the requests: nobody listens now)
                        if self._conn.recv()[0] == "stopped":
                            break
            except (EOFError, OSError):
                pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    @property
    def alive(self) -> bool:
        return not self._dead and self._proc.is_alive()

    def submit(self, request, handle: Handle, include_stop: bool = False):
        if not self.alive:
            handle.deliver(("error", RuntimeError("the engine's process is not running")))
            handle.deliver(FINISHED)
            return
        key, self._next = self._next, self._next + 1
        self._handles[key] = handle
        handle.key = key
        if request.constraint is not None:
            from jaxdecode.server.handlers import spec_of

            request = dataclasses.replace(request, constraint=ConstraintSpec(*spec_of(request.constraint)))
        self.waiting += 1
        self._unanswered.add(key)
        self._send(("submit", key, request, include_stop))

    def score(self, sequences: list, top: int, handle: Handle):
        """Score prompts in the engine's process (:meth:`~jaxdecode.server.runner.EngineLoop.score`);
        the answer, ``("scored", ...)`` or ``("error", e)``, comes to ``handle``."""
        if not self.alive:
            handle.deliver(("error", RuntimeError("the engine's process is not running")))
            return
        key, self._next = self._next, self._next + 1
        self._handles[key] = handle
        handle.key = key
        self._send(("score", key, sequences, top))

    def abort(self, handle: Handle):
        handle.aborted = True
        key = getattr(handle, "key", None)
        if key in self._handles and self.alive:
            self._send(("abort", key))

    def _send(self, message):
        try:
            self._conn.send(message)
        except OSError:
            self._died()

    # --- the reader thread, and on the event loop
    def _read(self):
        """The reader thread: each message to the event loop, until the process stops or dies."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._stopped.set()
                self._call(self._died)
                return
            if message[0] == "stopped":
                self._stopped.set()
                return
            if message[0] == "step":
                self._call(self._step, message[1], message[2])

    def _call(self, fn, *args):
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    def _step(self, items, stats):
        handles = self._handles
        for key, item in items:
            handle = handles.get(key)
            if handle is None:
                continue
            if isinstance(item, tuple) and item[0] in ("accepted", "error"):
                if key in self._unanswered:  # its first answer (an error may also end a running one)
                    self._unanswered.discard(key)
                    self.waiting -= 1
                if item[0] == "error":
                    del handles[key]
            elif item == FINISHED or isinstance(item, tuple) and item[0] == "scored":
                del handles[key]
            handle.deliver(item)
        self.running, self.queued = stats.running, stats.queued
        if self.metrics is not None:
            self.metrics.add(stats, self.waiting)

    def _died(self):
        if self._dead:
            return
        self._dead = True
        log.error("the engine's process stopped (exit code %s)", self._proc.exitcode)
        error = RuntimeError("the engine's process stopped")
        for handle in self._handles.values():
            handle.deliver(("error", error))
            handle.deliver(FINISHED)
        self._handles.clear()
        self._unanswered.clear()
        self.waiting = 0


def core_main(conn, build):
    """The engine's process: build the engine, then serve the pipe until told to stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the server stops it, after its requests, on a signal
        signal.signal(sig, signal.SIG_IGN)
    try:
        engine, vocab, defaults = build()
    except Exception as e:  # noqa: BLE001 (a checkpoint error, options the engine refused, ...)
        known = isinstance(e, (ValueError, OSError))
        if not known:
            log.debug("building the engine failed", exc_info=True)
        conn.send(("failed", str(e) if known else f"the engine could not be built: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", engine.T, engine.V, vocab, defaults, getattr(engine, "compiled_at_start", (0, 0.0)),
               engine.kv_blocks()))
    loop, stopping = EngineLoop(engine), False
    sender = _Sender(conn)
    # requests whose constraint compiles in a worker thread (key -> [future, request, include_stop,
    # aborted]): a JSON schema can take seconds, and the engine keeps stepping its other requests
    compiling: dict = {}
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxdecode-compile")
    while True:
        try:
            if not loop.busy and not stopping and not compiling:
                commands = [conn.recv()]  # idle: sleep until the server sends something
            elif not loop.busy and compiling:  # idle but for compiles: look at them every 10 ms
                commands = [conn.recv()] if conn.poll(0.01) else []
            else:
                commands = []
            while conn.poll():
                commands.append(conn.recv())
        except (EOFError, OSError):
            pool.shutdown(wait=False, cancel_futures=True)
            return  # the server is gone
        if sender.failed:
            pool.shutdown(wait=False, cancel_futures=True)
            return  # (likewise: its side of the pipe closed)
        out = []
        for command in commands:
            if command[0] == "submit":
                _, key, request, include_stop = command
                c = request.constraint
                if isinstance(c, ConstraintSpec) and cached(c.kind, c.key, vocab) is None:
                    compiling[key] = [pool.submit(compiled, c.kind, c.key, vocab), request, include_stop, False]
                else:
                    out += _submit(loop, key, request, include_stop, vocab)
            elif command[0] == "score":
                out += loop.score(command[1], command[2], command[3])
            elif command[0] == "abort":
                if command[1] in compiling:
                    compiling[command[1]][3] = True  # (aborted once it is taken)
                loop.abort(command[1])
            else:
                stopping = True
        for key, (future, request, include_stop, aborted) in list(compiling.items()):
            if future.done():
                del compiling[key]
                out += _submit(loop, key, request, include_stop, vocab, future)
                if aborted:
                    loop.abort(key)
        was_busy = loop.busy
        try:
            out += loop.turn()
        except Exception as e:  # noqa: BLE001 (a failed step ends its requests; the engine serves on)
            log.exception("engine step failed")
            out += loop.fail_all(RuntimeError(f"{type(e).__name__}: {e}"))
        if not out and not was_busy and compiling:
            continue  # (nothing to tell the server while it waits for a compile)
        out = [(key, _portable(item)) for key, item in out]
        sender.send(("step", out, loop.take_stats()))
        if stopping and not loop.busy and not compiling:
            sender.send(("stopped",))
            sender.close()
            pool.shutdown(wait=False)
            return


class _Sender:
    """The engine process's answers, written to the pipe by a thread of their own, in order: the
    engine's next step does not wait for the write (nor for the server's side to read it)."""

    def __init__(self, conn):
        self.conn, self.failed = conn, False
        self._queue: queue.Queue = queue.Queue(SEND_QUEUE)  # (full: the engine waits for the server)
        self._thread = threading.Thread(target=self._run, name="jaxdecode-engine-send", daemon=True)
        self._thread.start()

    def send(self, message):
        self._queue.put(ForkingPickler.dumps(message))  # pickled here: what the step handed out may change

    def close(self, timeout: float = 30.0):
        """Write what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self):
        while (data := self._queue.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except (EOFError, OSError):
                self.failed = True
                return


def _submit(loop, key, request, include_stop: bool, vocab, future=None) -> list:
    """``request`` submitted to the engine with its constraint compiled (by ``future``, or here:
    one found in the cache); a constraint that fails to compile is the request's error."""
    c = request.constraint
    if isinstance(c, ConstraintSpec):
        try:
            c = future.result() if future is not None else compiled(c.kind, c.key, vocab)
        except Exception as e:  # noqa: BLE001 (the server compiled it first: not expected, but that request's)
            return [(key, ("error", e if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}")))]
        request = dataclasses.replace(request, constraint=c)
    return loop.submit(key, request, include_stop)


def _portable(item):
    """An item as it can cross the pipe: an error becomes a ValueError (the request's fault) or a
    RuntimeError with the original's name and message (an exception of a library need not pickle)."""
    if isinstance(item, tuple) and item[0] == "error":
        e = item[1]
        e = ValueError(str(e)) if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}")
        return ("error", e)
    return item
