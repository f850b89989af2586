"""A generation engine for a stream of requests: continuous batching over a fixed number of slots.

Each sample of a :class:`Request` is one *row*. The engine owns ``slots`` decode slots: a dense KV
cache of that many rows (the model's own cache, through :mod:`jaxdecode.models.base`) or a paged
pool (``cache="paged"``, :class:`PagedExecutor`), and per slot the next-token logits, the rule
settings and the rule state. One :meth:`Engine.step` admits waiting rows into free slots (the
``"continuous"`` or ``"static"`` policy), reads one piece of each unread prompt (chunked prefill,
within ``prefill_budget``), runs one or more decode steps for every slot whose prompt is read, and
lets rows that are done leave.

A sample's text is :func:`jaxdecode.generate`'s for the same request: it draws with its own key
and step, whatever its arrival order, slot or batch. Slots share one layout of rule kinds, each
row with its own settings (the parts it lacks at settings that leave the logits exactly
unchanged); constrained rows carry their automaton state on the device. A request that would
reach past the model window ``T`` is refused. On the paged cache admission reserves every block a
row may still take, so nothing is ever preempted, and full prompt blocks already in the pool are
reused. The engine runs on a clock (:class:`RealClock`, or the simulator's virtual one) and its
device work is an executor's (:class:`ModelExecutor`, or the simulator's replay). Each of these
in full: ``docs/serving.md`` (One engine step, in detail).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence

import numpy as np

from jaxdecode.decoding.common import Generation, finish_text, stop_string_list
from jaxdecode.serving.blocks import BlockAllocator
from jaxdecode.serving.paging import PagedRows, admission_order
from jaxdecode.serving.reuse import DenseReuse, next_piece, piece_width
from jaxdecode.serving.records import (  # noqa: F401
    DeviceCall, RealClock, Report, RequestResult, StepRecord, percentiles)
from jaxdecode.serving.config import CACHES, DEFAULT_PREFILL_CHUNK, POLICIES, EngineConfig
from jaxdecode.serving.executors import ModelExecutor, PagedExecutor
from jaxdecode.serving.requests import (
    TOP_LOGPROBS, Request, best_layout, embed_in_layout, make_rows, neutral_rule, part_kind, rule_parts)
from jaxdecode.serving.stream import RequestStream
from jaxdecode.serving.speculative import SpeculativeRows
from jaxdecode.serving.warmup import warm_up

__all__ = ["CACHES", "POLICIES", "DEFAULT_PREFILL_CHUNK", "Engine", "EngineConfig", "ModelExecutor", "PagedExecutor",
           "RealClock", "Report", "Request", "RequestResult", "StepRecord", "neutral_rule", "rule_parts",
           "percentiles"]

LAYOUT_LOOKAHEAD = 64  # rows in line an empty engine looks at to choose its rule layout


# ----------------------------------------------------------------------------- the engine


def _cut_stop(text: str, stops: list[str]) -> str:
    """``text``, which ends with one of ``stops``, without it (the longest that fits)."""
    for s in sorted(stops, key=len, reverse=True):
        if text.endswith(s):
            return text[:-len(s)]
    return text


class Engine(PagedRows, DenseReuse, SpeculativeRows):
    """Serve a stream of :class:`Request` objects with ``slots`` decode slots.

    The settings are one :class:`~jaxdecode.serving.config.EngineConfig`: ``config=``, or
    ``slots`` and the settings as keywords (``Engine(lm, 8, cache="paged")``); ``self.config``
    holds them. ``policy``: ``"continuous"`` or ``"static"`` (see the module docstring). ``prefill_chunk``:
    the most prompt tokens a row reads per step. ``layout``: a rule chain whose kinds every
    request must fit (its settings are ignored; default: chosen as requests come). ``clock``:
    :class:`RealClock` (default) or a virtual clock. ``executor``: the device side (default
    :class:`ModelExecutor` on ``lm``); ``lm`` supplies the vocabulary and the window either way.
    ``cache``: ``"dense"`` (default) or ``"paged"`` (see the module docstring), with
    ``num_blocks`` (default: ``slots`` rows of the window, the dense cache's memory),
    ``block_size``, ``prefix_caching`` and ``attention`` (the paged attention implementation;
    default native on the native backend, else portable). ``decode_steps``: on either cache, up
    to this many decode steps run in one device call (one host round trip) while no row reads its
    prompt or waits for a free slot (see :meth:`_steps_now`); the texts do not change.
    ``overlap`` (default on; off on a virtual clock): each step sends its device call before it reads
    the previous call's tokens, so the host's work runs while the device computes (a row that meets
    a stop string is seen one call late; ``docs/serving.md``). The texts do not change.
    ``admit_batch`` (continuous policy): while rows run, the rows in line join only once that many
    slots are free (or as many as there are rows in line), so that their prompts are read together
    and the calls between admissions can take several decode steps; 1 (default): as soon as a slot
    is free. ``speculative`` (a draft kind or a :class:`~jaxdecode.speculative.Draft`; with
    ``draft``, ``gamma``, ``speculative_max_rows``): every step is a speculative pass per slot, or
    a plain pass above ``speculative_max_rows`` decoding slots (:mod:`jaxdecode.serving.speculative`,
    ``docs/serving.md``); :meth:`speculative_stats` counts them.

    :meth:`run` serves a list of requests arriving at their ``arrival`` times and returns a
    :class:`Report`; :meth:`submit` and :meth:`step` drive the engine one step at a time.
    """

    def __init__(self, lm, slots: int | None = None, *, config: EngineConfig | None = None, layout=None,
                 clock=None, executor=None, **settings):
        if config is None:
            if slots is None:
                raise ValueError("Engine needs the number of slots (or config=EngineConfig(...))")
            try:
                config = EngineConfig(slots, **settings)
            except TypeError as e:  # an unknown keyword
                raise TypeError(f"Engine: {e}".replace("EngineConfig.__init__()", "Engine()")) from None
        elif slots is not None or settings:
            raise ValueError("give the engine's settings either as config= or as keywords, not both")
        self.config = config
        self.S = config.slots
        self.admit_batch = config.admit_batch
        self.decode_steps = config.steps_per_call
        self.prefill_budget = config.prefill_budget
        self.policy = config.policy
        self.chunk = config.prefill_chunk
        self.lm = lm
        cache, kv_dtype, num_blocks = config.cache, config.kv_dtype, config.num_blocks
        block_size, prefix_caching, attention = config.block_size, config.prefix_caching, config.attention
        self.T, self.V = lm.decoder.T, lm.decoder.V
        self.paged = cache == "paged"
        self.layout = cache  # the cache as asked for (a quantized dense cache runs as a pool: below)
        self.allocator: BlockAllocator | None = None
        if cache == "dense" and kv_dtype != "float32":
            # a quantized dense cache: every slot one block of the whole window, the dense cache's
            # [slots, heads, T, head_dim] layout, kept and read through the pool's code (no prefix
            # sharing; the samples of a request copy their prompt's block when they first write)
            self.paged, block_size, num_blocks, prefix_caching = True, self.T, self.S, False
        if self.paged:
            width = -(-self.T // block_size)
            num_blocks = self.S * width if num_blocks is None else num_blocks
            self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching=prefix_caching)
            if attention is None:
                attention = "native" if getattr(lm.decoder, "backend", "") == "native" else "portable"
            if executor is None:
                executor = PagedExecutor(lm, self.S, num_blocks, block_size, attention, kv_dtype)
        self.kv_dtype = kv_dtype
        # prefix reuse on the dense float32 cache (serving/reuse.py); the int8 dense cache runs as a pool
        self.reuse = bool(prefix_caching) and not self.paged
        executor = self._init_speculative(lm, config, executor)
        self.executor = ModelExecutor(lm, self.S) if executor is None else executor
        self._reset_cache_stats()
        self._init_reuse()
        self.clock = RealClock() if clock is None else clock
        # overlap on a real clock, with an executor whose calls can return before they finish
        self.overlap = bool(config.overlap) and getattr(self.executor, "asynchronous", False) \
            and not getattr(self.clock, "virtual", False)
        self._fetch_kw = {"fetch": False} if self.overlap else {}
        self._inflight: DeviceCall | None = None  # the call sent last, its tokens not read yet
        self.requests: list[Request] = []
        self._rows: list[list] = []  # each request's rows (serving.requests._Row)
        self._arrival: list[float] = []
        self._pending: list = []  # heap of (arrival, index)
        self._waiting: deque = deque()
        self._slots: list = [None] * self.S  # the row in each slot, or None
        self._layout: tuple | None = None
        self._pinned = layout is not None
        if self._pinned:
            self._layout = rule_parts(layout)
            self.executor.set_layout(self._layout)
        self.step_records: list[StepRecord] = []
        self._touched: set[int] = set()  # requests whose rows changed since touched() was last called
        self._reported = 0  # requests before this one were returned by an earlier run

    # --- requests
    def submit(self, request: Request) -> int:
        """Check and queue ``request`` (it arrives at ``request.arrival``); returns its index."""
        return self._queue([self._make_rows(request, len(self.requests))], [request])[0]

    def _make_rows(self, r: Request, i: int) -> list:
        """The rows of request ``i`` (checked; nothing is queued):
        :func:`~jaxdecode.serving.requests.make_rows`."""
        return make_rows(self, r, i)

    def warm_up(self, requests: Sequence[Request]) -> int:
        """Compile, without running them, the programs serving ``requests`` can take, whatever their
        arrival times (:mod:`jaxdecode.serving.warmup`); returns the XLA compilations that took."""
        return warm_up(self, list(requests)) if hasattr(self.executor, "compiling") else 0

    def _queue(self, rows_per_request, requests) -> list[int]:
        out = []
        for rows, r in zip(rows_per_request, requests):
            i = len(self.requests)
            for row in rows:
                row.req = i
            self.requests.append(r)
            self._rows.append(rows)
            self._arrival.append(float(r.arrival))
            heapq.heappush(self._pending, (float(r.arrival), i))
            out.append(i)
        return out

    @property
    def occupied(self) -> int:
        """Slots holding a row."""
        return sum(s is not None for s in self._slots)

    @property
    def idle(self) -> bool:
        """Nothing queued, nothing in a slot, nothing still to arrive."""
        return not self._pending and not self._waiting and self.occupied == 0 and self._inflight is None

    # --- scheduling
    def _release(self, now: float):
        """Requests that have arrived join the queue (a request with n = 0 is done at once)."""
        while self._pending and self._pending[0][0] <= now:
            t, i = heapq.heappop(self._pending)
            for row in self._rows[i]:
                if row.finish is not None:
                    continue  # aborted before it arrived
                if row.n == 0:
                    row.finish, row.t_done = "length", t
                    self._touched.add(i)
                else:
                    self._waiting.append(row)

    def _admit(self):
        free = [s for s in range(self.S) if self._slots[s] is None]
        if not free or not self._waiting:
            return
        if self.policy == "static" and (len(free) < self.S
                                        or (len(self._waiting) < self.S and self._pending)):
            return  # a batch runs to completion; a new one starts full (or with the last rows)
        if not self._admits_now(len(free)):
            return  # too few free slots yet for the rows in line (admit_batch)
        if len(free) == self.S and not self._pinned:
            self._choose_layout()
        entries = []
        group: dict = {}  # request -> its first row admitted in this call (paged: the others fork it)
        while free and self._waiting:
            row = self._waiting[0]
            rules = embed_in_layout(row.parts, self._layout, self.V)
            if rules is None:
                break  # waits until the engine drains (first in, first out)
            if self.paged and not self._place(row, group):
                self.block_waits += 1
                break  # too few free blocks: it waits, and the rows behind it too (first in, first out)
            slot = self._seat(row, free, group) if self.reuse else free.pop(0)
            if slot is None:
                break  # every free slot holds what a waiting prompt piece reads (first in, first out)
            self._waiting.popleft()
            row.slot, self._slots[slot] = slot, row
            entries.append((row.slot, row, rules))
        if entries:
            self.executor.admit(entries)
            if hasattr(self.executor, "constrain"):  # the constraints of the rows in the slots now
                self.executor.constrain([None if r is None else r.constraint for r in self._slots])

    def _choose_layout(self):
        """For an empty engine: of the chains of the first rows in line that the first row fits,
        the one that most of them fit (the current layout first, then the earliest, on ties)."""
        best = best_layout(list(itertools.islice(self._waiting, LAYOUT_LOOKAHEAD)), self._layout, self.V)
        if self._layout is None or [part_kind(p) for p in best] != [part_kind(p) for p in self._layout]:
            self.executor.set_layout(best)
        self._layout = best

    def _prefill(self) -> int:
        """One prompt piece for every row still reading its prompt; returns the tokens run."""
        groups: dict = {}
        for row in self._slots:
            if row is not None and row.prefilled < len(row.prompt):
                groups.setdefault((row.prompt.tobytes(), row.prefilled), []).append(row)
        first, more, tokens = [], [], 0
        for (_, start), rows in sorted(groups.items(), key=lambda item: admission_order(item[1][0])):
            size = next_piece(len(rows[0].prompt), start, self.chunk)
            if self._over_budget(tokens, size):
                break  # the rest wait for the next step
            piece = rows[0].prompt[start:start + size]
            if start == 0:
                first.append(([r.slot for r in rows], piece))
            else:  # continued from a slot that holds the prompt up to start (its own, or a reused prefix's)
                more.append(([r.slot for r in rows], self._reads_from(rows), start, piece,
                             piece_width(size, self.chunk)))
            tokens += size
            for r in rows:
                r.prefilled, r.source = start + size, None
        if first or more:
            self.executor.prefill(first, more)
        return tokens

    def step(self) -> StepRecord | None:
        """One engine step (see the module docstring): admission, prompt pieces and one device call
        of decode steps, then the tokens read back. With ``overlap``, a step sends its call before it
        reads the tokens of the previous step's call, so the host's work between calls runs while
        the device computes. Returns the last record of the call whose tokens it read; None when it
        read none."""
        start = self.clock.now()
        self._release(start)
        self._admit()
        launch = self._launch_passes if self.speculative else self._launch
        call = launch(start) if self.occupied else None
        if self.overlap:
            call, self._inflight = self._inflight, call
        return None if call is None else self._collect(call)

    def _launch(self, start: float) -> DeviceCall:
        """This step's prompt pieces and its device call of decode steps, sent (not waited for). A
        row whose last token the call chooses leaves its slot (and, paged, its blocks) at once: a
        later call that uses them runs after this one on the device."""
        prefill_tokens = self._prefill_paged() if self.paged else self._prefill()
        decoding = np.array([r is not None and r.prefilled == len(r.prompt) for r in self._slots])
        active = int(decoding.sum())
        k = self._steps_now(decoding, prefill_tokens)
        rows, out, single, top = [], None, False, None
        if active:
            rows = [(int(s), self._slots[s]) for s in np.flatnonzero(decoding)]
            if any(r.top_k for _, r in rows):  # before the call, which consumes the logits (k = 1)
                top = self.executor.top_logprobs(TOP_LOGPROBS)
            steps = np.zeros((self.S,), np.int32)
            lengths = np.zeros((self.S,), np.int32)
            for s, r in enumerate(self._slots):
                if r is not None:
                    lengths[s] = r.length + r.pending
                    steps[s] = len(r.tokens) + r.pending if decoding[s] else 0
            self._free_lengths(lengths)
            if self.paged:  # one call for the k steps (k = 1 too): token choice and pass in one program
                out = self._decode_many_paged(decoding, steps, lengths, k)
            elif k > 1:
                limits = np.array([0 if r is None else r.n for r in self._slots], np.int32)
                out = self.executor.decode_many(decoding, steps, lengths, k, limits, **self._fetch_kw)
            else:
                out, single = self.executor.decode(decoding, steps, lengths, **self._fetch_kw), True
            for s, row in rows:
                row.pending += k
                if len(row.tokens) + row.pending >= row.n:  # this call chooses its last token
                    self._vacate(s)
                    if self.paged:
                        self.allocator.free(row.seq)
        return DeviceCall(start, k, rows, out, single, prefill_tokens, active, top)

    def _collect(self, call: DeviceCall) -> StepRecord:
        """Read a call's tokens (waiting for it), add them to their rows, end the rows that met a
        stop string or their ``n``, and record the call's steps."""
        k, stepped, done = call.k, [], []
        made = None
        if call.rows and self.speculative:  # passes: [k, S, m] tokens, each row's count in each pass
            tokens, mlp, slp, made = call.out[:4]
            ends, top = None, None
        elif call.rows:
            tokens, mlp, slp, *ends = (np.asarray(a)[None] if call.single else np.asarray(a)
                                       for a in call.out)
            ends = ends[0] if ends else None  # [k, S]: a constrained row's constraint ended it at that step
            top = None if call.top is None else [np.asarray(a) for a in call.top]
        for s, row in call.rows:
            if made is None:
                row.pending -= k
            if row.finish is not None:
                continue  # it met a stop string in an earlier call: these tokens lie past its end
            stepped.append(row)
            if made is not None:  # the row's tokens of every pass, in order, as the steps of one call
                chosen = [(tokens[j, s, i], mlp[j, s, i], slp[j, s, i], False)
                          for j in range(len(made)) for i in range(made[j, s])]
            else:
                chosen = [(tokens[j, s], mlp[j, s], slp[j, s], ends is not None and ends[j, s]) for j in range(k)]
            for token, model_lp, sample_lp, ended in chosen:  # a row that ends inside a call drops the rest
                if ended:
                    hit = True  # ended by its constraint before this token (as generate's stop decision)
                else:
                    row.tokens.append(int(token))
                    row.mlp.append(float(model_lp))
                    row.slp.append(float(sample_lp))
                    if row.top_k:
                        row.top.append((top[1][s], top[0][s]))
                    hit = any(len(row.tokens) >= len(stop) and row.tokens[-len(stop):] == stop.tolist()
                              for stop in row.stops)
                    # a subword row's text can hold a stop string however the model spelled it
                    hit = (row.watch is not None and row.watch.push(row.tokens[-1])) or hit
                if hit or len(row.tokens) == row.n:
                    row.finish, row.slot = ("stop" if hit else "length"), -1
                    if self._slots[s] is row:
                        self._vacate(s)
                    if self.paged and row.seq in self.allocator:
                        self.allocator.free(row.seq)
                    done.append(row)
                    break
        if self.paged:
            for row in stepped:  # written in the call, in the blocks reserved for them
                if row.finish is None and row.seq in self.allocator:  # (not released by a later call)
                    self.allocator.append(row.seq, row.tokens[-k:])
                    self.allocator.mark_computed(row.seq)
        # the records tile the clock (under overlap a call starts while the one before still runs)
        begin = max(call.start, self.step_records[-1].end) if self.step_records else call.start
        rows = self.S if call.active else 0
        for j in range(k):  # a multi-step call is recorded as its k steps
            end = self.clock.step_done(rows, call.prefill_tokens if j == 0 else 0)
            record = StepRecord(begin, end, rows, call.active, call.prefill_tokens if j == 0 else 0)
            self.step_records.append(record)
            begin = end
        for row in stepped:
            if row.t_first is None:
                row.t_first = end
            self._touched.add(row.req)
        for row in done:
            row.t_done = end
        return record

    def _admits_now(self, free: int) -> bool:
        """Whether rows in line may join with ``free`` slots free (continuous: see ``admit_batch``)."""
        need = min(self.admit_batch, len(self._waiting))
        return self.policy == "static" or not self.occupied or free >= need

    def _steps_now(self, decoding, prefill_tokens: int) -> int:
        """Decode steps in this engine step: up to ``decode_steps`` in one device call (a power of
        two, at most what the row with the most tokens left needs), else one. A row that reaches
        its ``n`` inside the call stops there (the device call holds each row's limit), and a row
        that meets a stop string drops the tokens after it; its slot is free for the next call.
        One step while a row is still reading its prompt in pieces (its next piece waits for the
        call), while a row reads top log-probabilities (from each step's logits before its call),
        and while rows in line could take a free slot that admission left empty (a continuous
        engine waiting for blocks or for a rule layout to drain)."""
        if self.decode_steps == 1 or not decoding.any():
            return 1
        if not getattr(self.executor, "multi_step", False):
            return 1
        live = [r for r, d in zip(self._slots, decoding) if d]
        if any(r.top_k for r in live):
            return 1
        if any(r is not None and r.prefilled < len(r.prompt) for r in self._slots):
            return 1  # a prompt read in pieces: one piece a step
        free = sum(r is None for r in self._slots)
        if self.policy == "continuous" and self._waiting and free and self._admits_now(free):
            return 1
        left = max(r.n - len(r.tokens) - r.pending for r in live)
        k = min(self.decode_steps, left)
        return 1 << (k.bit_length() - 1)  # a power of two: few compiled programs

    def run(self, requests: Sequence[Request] = ()) -> Report:
        """Serve ``requests`` (each arriving ``request.arrival`` seconds after the start; all are
        checked before any work) and any submitted since the last run, until every one is done;
        returns those (in submission order) and this run's steps."""
        requests = list(requests)
        first = len(self.requests)
        rows = [self._make_rows(r, first + k) for k, r in enumerate(requests)]
        self._queue(rows, requests)
        self.clock.start()
        self.step_records = []
        if self.paged or self.reuse:
            self._reset_cache_stats()
        while not self.idle:
            # nothing to run until the next arrival (or nothing left: requests with n = 0 only)
            if self.step() is None and self._inflight is None and not self.idle:
                if not self._pending:
                    raise RuntimeError("the engine stalled with requests queued and no slot busy")
                self.clock.wait_until(self._pending[0][0])
        start, self._reported = self._reported, len(self.requests)
        return self.report(range(start, len(self.requests)))

    def output(self, index: int, sample: int = 0, include_stop: bool = True) -> Generation:
        """Sample ``sample`` of finished request ``index`` as :func:`jaxdecode.generate` returns it
        (``include_stop=False``: the stop string that ended it cut from its text)."""
        request, r = self.requests[index], self._rows[index][sample]
        if r.finish is None:
            raise ValueError(f"request {index} has not finished")
        tokens, text, reason = finish_text(self.lm, np.asarray(r.tokens, np.int32), r.finish == "stop",
                                           request.stop)
        if reason == "stop" and not include_stop:
            text = _cut_stop(text, stop_string_list(request.stop))
        c = len(tokens)
        return Generation(prompt=request.prompt, text=text, tokens=tokens,
                          model_logprobs=np.asarray(r.mlp[:c], np.float32),
                          sample_logprobs=np.asarray(r.slp[:c], np.float32),
                          finish_reason=reason if r.finish == "stop" or reason == "stop" else r.finish)

    # --- serving requests one at a time: streams, aborts
    def rows(self, index: int) -> list:
        """The rows (samples) of request ``index``, as the engine updates them: read-only."""
        return list(self._rows[index])

    def stream(self, index: int, include_stop: bool = True) -> RequestStream:
        """Request ``index``'s output as it is generated
        (:class:`~jaxdecode.serving.stream.RequestStream`)."""
        return RequestStream(self, index, include_stop)

    def abort(self, index: int) -> None:
        """End request ``index`` now: its rows leave the queue or their slots (and, paged, give back
        their blocks) before the next step; their finish reason is ``"abort"``."""
        self._pending = [(t, i) for t, i in self._pending if i != index]
        heapq.heapify(self._pending)
        self._touched.add(index)
        for row in self._rows[index]:
            if row.finish is not None:
                continue
            row.finish, row.t_done = "abort", self.clock.now()
            if row in self._waiting:
                self._waiting.remove(row)
            if row.slot >= 0 and self._slots[row.slot] is row:
                self._vacate(row.slot)
            row.slot = -1
            if self.paged and row.seq in self.allocator:
                self.allocator.free(row.seq)

    def forget(self, index: int) -> None:
        """Drop finished request ``index``'s rows (a server's engine would otherwise keep every
        request it ever served)."""
        if any(r.finish is None for r in self._rows[index]):
            raise ValueError(f"request {index} has not finished")
        self._rows[index], self.requests[index] = [], None
        self._touched.discard(index)

    def touched(self) -> list[int]:
        """The requests whose rows gained tokens or finished since the last call (in order); a
        stream of any other request has nothing new to hand out."""
        out, self._touched = sorted(self._touched), set()
        return out

    def rows_in_slots(self) -> list:
        """The rows in the slots now (read-only)."""
        return [r for r in self._slots if r is not None]

    @property
    def rule_layout(self) -> tuple | None:
        """The rule layout the decode programs run now (None before the first request), and
        whether it was pinned at construction (``layout=``) or follows the requests."""
        return self._layout

    @property
    def layout_pinned(self) -> bool:
        return self._pinned

    def kv_blocks(self) -> tuple[int, int]:
        """KV cache blocks ``(in use, free)``: the paged pool's, or a dense cache's slots (a slot is
        one block of the window)."""
        if self.allocator is not None:
            return self.allocator.num_used, self.allocator.num_free
        return self.occupied, self.S - self.occupied

    @property
    def queued(self) -> int:
        """Rows waiting for a slot or still to arrive."""
        return len(self._waiting) + sum(len(self._rows[i]) for _, i in self._pending)

    def report(self, indices=None) -> Report:
        """The finished requests (default: all) as a :class:`Report`."""
        indices = range(len(self.requests)) if indices is None else indices
        results = []
        for i in indices:
            rows = self._rows[i]
            if any(r.finish is None for r in rows):
                raise ValueError(f"request {i} has not finished")
            outs = [self.output(i, j) for j in range(len(rows))]
            firsts = [r.t_first for r in rows if r.t_first is not None]
            results.append(RequestResult(i, self.requests[i], outs, self._arrival[i],
                                         min(firsts) if firsts else None, max(r.t_done for r in rows)))
        return Report(self.policy, self.S, results, list(self.step_records), self.cache_stats())
