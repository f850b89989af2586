"""A generation engine for a stream of requests: continuous batching over a fixed number of slots.

Each sample of a :class:`Request` is one *row*. The engine owns ``slots`` decode slots: a dense KV
cache of that many rows (the model's own cache, through :mod:`jaxdecode.models.base`), and per
slot the next-token logits, the rule settings and the rule state. One engine :meth:`Engine.step`:

1. rows that have arrived wait in a FIFO queue; the scheduling policy moves them into free slots
   (``"continuous"``: whenever a slot is free; ``"static"``: only when every slot is free, and
   then a whole batch of ``slots`` rows, or what is left once no more requests will arrive);
2. rows that are still reading their prompt run one piece of it: prompts longer than
   ``prefill_chunk`` tokens are read in pieces, one per step (chunked prefill: a long prompt does
   not stall the rows that are decoding). A prompt's first piece goes through the model's
   ``prefill`` (its remainder modulo the chunk size, so every later piece is one full chunk),
   later pieces through ``extend``; the resulting cache rows are written into their slots by a
   jitted scatter along the batch axis. Rows of one prompt that are at the same point (the
   samples of a request) share one prefill row;
3. one decode step for every slot whose prompt is read: each row chooses its token from its own
   logits with its own settings, key and step, and the model appends the tokens at each row's own
   position;
4. rows that produced ``n`` tokens or one of their request's stop strings leave, freeing the slot.

**Same outputs as** :func:`jaxdecode.generate`: sample ``j`` of a request with seed ``s`` draws
step ``t`` with the key ``fold_in(fold_in(PRNGKey(s), j), t)`` from the processed logits, as the
sampling loop does, so its tokens do not depend on arrival order, slot, or which requests share
the batch. (The logits themselves come from batches of other shapes than ``generate``'s, which
may move them in the last unit of float32 precision; ``generate`` itself shows the same when a
prompt shares its batch. Tokens can then only differ on a near tie.)

**Rule chains in one batch.** Every slot runs the same chain of rule *kinds* (the layout), each
with its own settings. A request whose chain is the layout with some parts left out joins with a
neutral setting for those parts; each neutral setting leaves the logits exactly (bit for bit)
unchanged: temperature 1, top-k V, top-p 1, min-p 0, typical 1, epsilon 0, eta 0, repetition
penalty 1, frequency and presence penalty 0 (``tests/test_engine.py`` checks this). Top-n-sigma and
n-gram blocking have no such setting. An empty engine chooses its layout among the chains of the
rows in line that the first of them fits: the one most of them fit. A row that does not fit the
running layout waits (first in, first out: the rows behind it wait too) until the engine has
drained. ``layout=`` pins one layout instead (a request that does not fit it is refused). Greedy
and sampled rows share any batch: each row has its own flag.

**Window.** Every row stays within the model window: a request whose prompt plus ``n`` exceeds
``T`` is refused with an error (:func:`jaxdecode.generate` serves such requests in its exact window
mode, a full forward per step).

The engine runs on a clock: :class:`RealClock` (wall time, sleeping until arrivals) or a virtual
one (:class:`jaxdecode.serving.simulator.VirtualClock`, each step costing what a step-time model
says). The device work is done by an executor: :class:`ModelExecutor` runs the model; the
simulator's executor replays known outputs without one. The scheduling code is the same for all.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import (
    PROMPT_BUCKET,
    SPAN_BUCKET,
    Generation,
    batch_bucket,
    check_int,
    encode_stop_strings,
    round_up,
    sample_keys,
)
from ..rules import Chain, Rule, processed_logprobs
from ..rules import penalties as _pen
from ..rules import truncation as _trunc

__all__ = ["POLICIES", "DEFAULT_PREFILL_CHUNK", "Engine", "ModelExecutor", "RealClock", "Report", "Request",
           "RequestResult", "StepRecord", "neutral_rule", "rule_parts", "percentiles"]

POLICIES = ("continuous", "static")
LAYOUT_LOOKAHEAD = 64  # rows in line an empty engine looks at to choose its rule layout
DEFAULT_PREFILL_CHUNK = 128


# ----------------------------------------------------------------------------- requests


@dataclasses.dataclass(eq=False)
class Request:
    """One request: ``num_samples`` continuations of ``n`` tokens after ``prompt``.

    ``seed``: sample ``j`` is drawn with ``PRNGKey(seed)`` and row id ``j`` (as
    :func:`jaxdecode.generate`). ``rule``: a :mod:`jaxdecode.rules` rule or chain, or None; its
    settings are scalars or one per sample (``[num_samples]``). ``greedy``: the argmax of the
    processed logits. ``stop``: a string or strings ending a sample once generated (included in
    its text). ``arrival``: seconds after the start of :meth:`Engine.run`.
    """

    prompt: str
    n: int
    seed: int = 0
    num_samples: int = 1
    rule: Any = None
    greedy: bool = False
    stop: str | Sequence[str] | None = None
    arrival: float = 0.0


@dataclasses.dataclass(eq=False)
class _Row:
    """One sample of a request, as the scheduler tracks it."""

    req: int  # request index
    j: int  # sample index (the row id of the PRNG)
    prompt: np.ndarray  # int32 tokens
    n: int
    stops: list  # of int32 token arrays
    greedy: bool
    key: np.ndarray  # uint32 [2]
    parts: tuple  # the request's rule parts, settings cut to this row
    slot: int = -1
    prefilled: int = 0  # prompt tokens in the cache
    tokens: list = dataclasses.field(default_factory=list)
    mlp: list = dataclasses.field(default_factory=list)
    slp: list = dataclasses.field(default_factory=list)
    finish: str | None = None
    t_first: float | None = None
    t_done: float | None = None

    @property
    def length(self) -> int:
        """Positions of this row in its slot's cache."""
        return self.prefilled + len(self.tokens)


# ----------------------------------------------------------------------------- rule layouts


_NEUTRAL = {
    _trunc.Temperature: 1.0,
    _trunc.TopP: 1.0,
    _trunc.MinP: 0.0,
    _trunc.Typical: 1.0,
    _trunc.Epsilon: 0.0,
    _trunc.Eta: 0.0,
    _pen.RepetitionPenalty: 1.0,
    _pen.FrequencyPenalty: 0.0,
    _pen.PresencePenalty: 0.0,
    _trunc.TopK: None,  # V: every token
}


def rule_parts(rule) -> tuple:
    """The rules a rule (or chain, nested or not) applies, in order; ``()`` for None."""
    if rule is None:
        return ()
    if isinstance(rule, Chain):
        return tuple(p for r in rule.rules for p in rule_parts(r))
    if isinstance(rule, Rule):
        return (rule,)
    raise ValueError(f"a request's rule must be a jaxdecode rule, a chain of rules or None, "
                     f"got {type(rule).__name__}")


def neutral_rule(part, V: int):
    """``part``'s kind with the setting that leaves logits exactly unchanged, or None if the kind
    has none."""
    kind = type(part)
    if kind not in _NEUTRAL:
        return None
    value = V if _NEUTRAL[kind] is None else _NEUTRAL[kind]
    leaves, treedef = jax.tree_util.tree_flatten(part)
    return jax.tree_util.tree_unflatten(treedef, [np.asarray(value, np.asarray(a).dtype) for a in leaves])


def _kind(part):
    return jax.tree_util.tree_structure(part)


def _embed(parts: tuple, layout: tuple, V: int):
    """Each layout part's rule for a row with ``parts``: its own where it has that part, else the
    neutral one; None if ``parts`` is not the layout with neutral-capable parts left out."""
    out, i = [], 0
    for lp in layout:
        if i < len(parts) and _kind(parts[i]) == _kind(lp):
            out.append(parts[i])
            i += 1
        else:
            neutral = neutral_rule(lp, V)
            if neutral is None:
                return None
            out.append(neutral)
    return out if i == len(parts) else None


def _kinds_text(parts) -> str:
    return ", ".join(type(p).__name__ for p in parts) or "no rule"


def _row_settings(parts: tuple, j: int, num_samples: int, index: int) -> tuple:
    """The parts with every setting cut to sample ``j`` (settings are scalars or one per sample)."""
    def cut(a):
        a = np.asarray(a)
        if a.ndim == 0:
            return a
        if a.shape != (num_samples,):
            raise ValueError(f"request {index}: a rule setting has shape {a.shape}; give a scalar or one value "
                             f"per sample ({num_samples},)")
        return a[j]

    return tuple(jax.tree_util.tree_map(cut, p) for p in parts)


# ----------------------------------------------------------------------------- one decode step


def _select(logits, rule, rule_state, keys, row_ids, steps, greedy):
    """One token per row, each at its own step: the sampling loop's choice (see
    ``jaxdecode.sampling._choose``) with a step and a greedy flag per row."""
    processed = logits if rule is None else rule.apply(logits, rule_state)
    best = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    row_keys = jax.vmap(lambda k, r, s: jax.random.fold_in(jax.random.fold_in(k, r), s))(keys, row_ids, steps)
    drawn = jax.vmap(jax.random.categorical)(row_keys, processed).astype(jnp.int32)
    token = jnp.where(greedy, best, drawn)
    take = lambda lp: jnp.take_along_axis(lp, token[:, None], axis=-1)[:, 0]
    model_lp = take(jax.nn.log_softmax(logits, axis=-1))
    sample_lp = take(processed_logprobs(processed))
    if rule is not None:
        rule_state = rule.update(rule_state, token)
    return token, model_lp, sample_lp, rule_state


def _rows_where(mask, new, old):
    """``new`` in the rows where ``mask`` ``[B]``, else ``old`` (pytrees of batch-first leaves)."""
    def pick(a, b):
        return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)

    return jax.tree_util.tree_map(pick, new, old)


@functools.partial(jax.jit, static_argnames=("model", "span"), donate_argnames=("cache", "rule_state"))
def _decode(params, cache, logits, rule, rule_state, keys, row_ids, steps, greedy, lengths, decoding, *,
            model, span):
    """Choose a token in every slot and append it. ``lengths``: each slot's cache length (0 for a
    free slot); only ``decoding`` slots advance (a slot still reading its prompt keeps its cache
    length and rule state: the position written for it is overwritten by its next piece)."""
    cache = model.truncate(cache, lengths)
    token, mlp, slp, new_state = _select(logits, rule, rule_state, keys, row_ids, steps, greedy)
    if rule_state is not None:
        rule_state = _rows_where(decoding, new_state, rule_state)
    out, _, cache = model.extend(params, cache, token[:, None], span)
    cache = model.truncate(cache, lengths + decoding.astype(jnp.int32))
    return token, mlp, slp, out[:, 0], cache, rule_state


def _scatter_rows(big, small, src, dst):
    """Rows ``small[src[i]]`` written into ``big[dst[i]]`` for pytrees of batch-first leaves; a
    ``dst`` past the end is dropped (padding). A leaf of ``small`` whose rows are smaller (a
    prefill's cache, which holds only its prompt's positions) fills the leading corner of the row:
    the positions past it are left as they are, garbage past the row's length. The dense cache's
    insert; a paged cache would write block tables instead."""
    def put(b, s):
        corner = (dst,) + tuple(slice(0, n) for n in s.shape[1:])
        return b.at[corner].set(jnp.take(s, src, axis=0).astype(b.dtype), mode="drop")

    return jax.tree_util.tree_map(put, big, small)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache", "logits"))
def _prefill_insert(params, cache, logits, tokens, lengths, src, dst, *, model):
    """Prefill right-padded prompt pieces ``tokens`` ``[U, W]`` and write prefill row ``src[i]`` into
    slot ``dst[i]`` (its ``W`` cache positions and its next-token logits)."""
    first, _, sub = model.prefill(params, tokens, lengths, tokens.shape[1])
    return _scatter_rows(cache, sub, src, dst), _scatter_rows(logits, first, src, dst)


@functools.partial(jax.jit, static_argnames=("model", "span"), donate_argnames=("cache", "logits"))
def _extend_insert(params, cache, logits, rows, real, tokens, src, dst, *, model, span):
    """Append the next prompt piece ``tokens`` ``[G, C]`` to the cache rows of slots ``rows``
    (``real`` marks the rows that are not padding) and write result ``src[i]`` into slot
    ``dst[i]``."""
    sub = model.reorder(cache, rows)
    sub = model.truncate(sub, jnp.where(real, model.lengths(sub), 0))
    out, _, sub = model.extend(params, sub, tokens, span, in_place=False)
    return _scatter_rows(cache, sub, src, dst), _scatter_rows(logits, out[:, -1], src, dst)


@functools.partial(jax.jit, static_argnames=("V",), donate_argnames=("rule_state",))
def _init_rule_rows(rule, rule_state, prompt, lengths, dst, *, V):
    """The rule state of new rows (prompts ``[K, T]``) written into slots ``dst``."""
    return _scatter_rows(rule_state, rule.init(prompt, lengths, V, 0), jnp.arange(prompt.shape[0]), dst)


# ----------------------------------------------------------------------------- executors


class ModelExecutor:
    """The device side of an :class:`Engine`: a dense cache of ``slots`` rows of ``lm``'s model,
    with each slot's logits, rule settings and rule state.

    The cache's leaves must be batch-first, and the cache a prefill returns for ``W`` positions
    must be the leading corner of one of capacity ``T`` (the reference model's and
    :class:`FunctionModel`'s are). The capacity is the model window ``T``; a decode step attends
    over the filled span, rounded up to :data:`jaxdecode.core.SPAN_BUCKET` positions.
    """

    def __init__(self, lm, slots: int):
        self.model = lm.decoder
        self.S, self.T, self.V = slots, self.model.T, self.model.V
        self.capacity = self.T
        self.params = self.model.prepare(lm.params, slots)
        # one buffer per leaf (an empty cache may share one zero array between leaves; the steps
        # donate the cache, and a buffer cannot be donated twice)
        self.cache = jax.tree_util.tree_map(jnp.copy, self.model.empty_cache(slots, self.capacity))
        for leaf in jax.tree_util.tree_leaves(self.cache):
            if leaf.ndim == 0 or leaf.shape[0] != slots:
                raise ValueError(f"the engine needs a cache whose leaves are batch-first; "
                                 f"{type(self.model).__name__} has a leaf of shape {leaf.shape} for {slots} rows")
        self.logits = jnp.zeros((slots, self.V), jnp.float32)
        # rows written into slots per call, padded to one size (one program per prefill shape)
        self._rows_bucket = batch_bucket(slots)
        self.keys = np.zeros((slots, 2), np.uint32)
        self.row_ids = np.zeros((slots,), np.uint32)
        self.greedy = np.zeros((slots,), bool)
        self._treedefs: list = []
        self._settings: list = []  # per layout part: one [slots] array per leaf
        self.rule_state = None

    def set_layout(self, layout: tuple):
        """Start a new rule layout (every slot is free)."""
        self._treedefs, self._settings = [], []
        for part in layout:
            neutral = neutral_rule(part, self.V)
            leaves, treedef = jax.tree_util.tree_flatten(part if neutral is None else neutral)
            self._treedefs.append(treedef)
            self._settings.append([np.full((self.S,), np.asarray(a).reshape(-1)[0], np.asarray(a).dtype)
                                   for a in leaves])
        self.rule_state = None
        if layout:
            prompt = jnp.zeros((self.S, self.T), jnp.int32)
            self.rule_state = _init_state(self._rule(), prompt, jnp.ones((self.S,), jnp.int32), V=self.V)

    def _rule(self):
        """The layout with every slot's settings (copies: the host arrays change as rows come)."""
        if not self._treedefs:
            return None
        return Chain(tuple(jax.tree_util.tree_unflatten(td, [a.copy() for a in leaves])
                           for td, leaves in zip(self._treedefs, self._settings)))

    def admit(self, entries):
        """``entries``: ``(slot, row, rules)`` with ``rules`` the row's rule for each layout part."""
        for slot, row, rules in entries:
            self.keys[slot], self.row_ids[slot], self.greedy[slot] = row.key, row.j, row.greedy
            for store, rule in zip(self._settings, rules):
                for arr, value in zip(store, jax.tree_util.tree_leaves(rule)):
                    arr[slot] = np.asarray(value)
        if self.rule_state is not None and entries:
            K = self._rows_bucket
            prompt = np.zeros((K, self.T), np.int32)
            lengths = np.ones((K,), np.int32)
            dst = np.full((K,), self.S, np.int32)
            for i, (slot, row, _) in enumerate(entries):
                prompt[i, :len(row.prompt)] = row.prompt
                lengths[i], dst[i] = len(row.prompt), slot
            self.rule_state = _init_rule_rows(self._rule(), self.rule_state, prompt, lengths, dst, V=self.V)

    def prefill(self, first, more):
        """Run prompt pieces: ``first`` and ``more`` list ``(slots, tokens)``, a piece for the rows in
        ``slots`` (one prompt, at the same point); ``first`` pieces start their prompts, ``more``
        pieces (all of one length) continue them."""
        if first:
            U, K = batch_bucket(len(first)), self._rows_bucket
            W = min(round_up(max(len(t) for _, t in first), PROMPT_BUCKET), self.T)
            tokens = np.zeros((U, W), np.int32)
            lengths = np.ones((U,), np.int32)
            src, dst = np.zeros((K,), np.int32), np.full((K,), self.S, np.int32)
            i = 0
            for g, (slots, piece) in enumerate(first):
                tokens[g, :len(piece)], lengths[g] = piece, len(piece)
                for s in slots:
                    src[i], dst[i] = g, s
                    i += 1
            self.cache, self.logits = _prefill_insert(self.params, self.cache, self.logits, tokens, lengths, src,
                                                      dst, model=self.model)
        if more:
            G, K = batch_bucket(len(more)), self._rows_bucket
            C = len(more[0][1])
            rows, real = np.zeros((G,), np.int32), np.zeros((G,), bool)
            tokens = np.zeros((G, C), np.int32)
            src, dst = np.zeros((K,), np.int32), np.full((K,), self.S, np.int32)
            i = 0
            for g, (slots, piece) in enumerate(more):
                rows[g], real[g], tokens[g] = slots[0], True, piece
                for s in slots:
                    src[i], dst[i] = g, s
                    i += 1
            self.cache, self.logits = _extend_insert(self.params, self.cache, self.logits, rows, real, tokens,
                                                     src, dst, model=self.model, span=self.capacity)

    def decode(self, decoding, steps, lengths):
        """One decode step: ``decoding`` ``[S]`` the slots that choose a token, ``steps`` their
        steps, ``lengths`` every slot's cache length (0: free). Returns numpy ``(tokens,
        model_logprobs, sample_logprobs)`` ``[S]``."""
        span = min(self.capacity, round_up(int(lengths.max()) + 1, SPAN_BUCKET))
        token, mlp, slp, self.logits, self.cache, self.rule_state = _decode(
            self.params, self.cache, self.logits, self._rule(), self.rule_state, self.keys.copy(),
            self.row_ids.copy(), steps.astype(np.int32), self.greedy.copy(), lengths.astype(np.int32), decoding,
            model=self.model, span=span)
        return tuple(np.asarray(a) for a in jax.device_get((token, mlp, slp)))


@functools.partial(jax.jit, static_argnames=("V",))
def _init_state(rule, prompt, lengths, *, V):
    return rule.init(prompt, lengths, V, 0)


# ----------------------------------------------------------------------------- clock and records


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
        }


# ----------------------------------------------------------------------------- the engine


class Engine:
    """Serve a stream of :class:`Request` objects with ``slots`` decode slots.

    ``policy``: ``"continuous"`` or ``"static"`` (see the module docstring). ``prefill_chunk``:
    the most prompt tokens a row reads per step. ``layout``: a rule chain whose kinds every
    request must fit (its settings are ignored; default: chosen as requests come). ``clock``:
    :class:`RealClock` (default) or a virtual clock. ``executor``: the device side (default
    :class:`ModelExecutor` on ``lm``); ``lm`` supplies the vocabulary and the window either way.

    :meth:`run` serves a list of requests arriving at their ``arrival`` times and returns a
    :class:`Report`; :meth:`submit` and :meth:`step` drive the engine one step at a time.
    """

    def __init__(self, lm, slots: int, *, policy: str = "continuous", prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 layout=None, clock=None, executor=None):
        self.S = check_int("slots", slots, 1)
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.chunk = check_int("prefill_chunk", prefill_chunk, 1)
        self.lm = lm
        self.T, self.V = lm.decoder.T, lm.decoder.V
        self.executor = ModelExecutor(lm, slots) if executor is None else executor
        self.clock = RealClock() if clock is None else clock
        self.requests: list[Request] = []
        self._rows: list[list[_Row]] = []
        self._arrival: list[float] = []
        self._pending: list = []  # heap of (arrival, index)
        self._waiting: deque[_Row] = deque()
        self._slots: list[_Row | None] = [None] * self.S
        self._layout: tuple | None = None
        self._pinned = layout is not None
        if self._pinned:
            self._layout = rule_parts(layout)
            self.executor.set_layout(self._layout)
        self.step_records: list[StepRecord] = []
        self._reported = 0  # requests before this one were returned by an earlier run

    # --- requests
    def submit(self, request: Request) -> int:
        """Check and queue ``request`` (it arrives at ``request.arrival``); returns its index."""
        return self._queue([self._make_rows(request, len(self.requests))], [request])[0]

    def _make_rows(self, r: Request, i: int) -> list:
        """The rows of request ``i`` (checked; nothing is queued)."""
        if not isinstance(r, Request):
            raise ValueError(f"request {i}: expected a Request, got {type(r).__name__}")
        if not isinstance(r.prompt, str) or not r.prompt:
            raise ValueError(f"request {i}: the prompt must be a non-empty string, got {r.prompt!r}")
        n = check_int(f"request {i}: the number of new tokens n", r.n, 0)
        N = check_int(f"request {i}: num_samples", r.num_samples, 1)
        if not isinstance(r.greedy, (bool, np.bool_)):
            raise ValueError(f"request {i}: greedy must be True or False, got {r.greedy!r}")
        if isinstance(r.arrival, bool) or not isinstance(r.arrival, (int, float, np.integer, np.floating)) \
                or not math.isfinite(r.arrival) or r.arrival < 0:
            raise ValueError(f"request {i}: arrival must be a finite time >= 0 seconds, got {r.arrival!r}")
        try:
            prompt = self.lm.vocab.encode(r.prompt)
            stops = encode_stop_strings(self.lm, r.stop)
            keys, row_ids = sample_keys(1, N, r.seed)
            parts = rule_parts(r.rule)
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
        if len(prompt) + n > self.T:
            raise ValueError(f"request {i}: prompt ({len(prompt)} tokens) + n ({n}) = {len(prompt) + n} exceeds "
                             f"the model window T = {self.T}; the engine keeps every row within the window "
                             f"(jaxdecode.generate serves longer requests in its exact window mode)")
        if self._pinned and _embed(parts, self._layout, self.V) is None:
            raise ValueError(f"request {i}: its rule chain ({_kinds_text(parts)}) does not fit the engine's "
                             f"layout ({_kinds_text(self._layout)}): it must be the layout with parts left out, "
                             f"and only parts with a neutral setting may be left out")
        keys = np.asarray(keys, np.uint32)
        return [_Row(i, int(j), prompt, n, stops, bool(r.greedy), keys[j], _row_settings(parts, j, N, i))
                for j in row_ids]

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
        return not self._pending and not self._waiting and self.occupied == 0

    # --- scheduling
    def _release(self, now: float):
        """Requests that have arrived join the queue (a request with n = 0 is done at once)."""
        while self._pending and self._pending[0][0] <= now:
            t, i = heapq.heappop(self._pending)
            for row in self._rows[i]:
                if row.n == 0:
                    row.finish, row.t_done = "length", t
                else:
                    self._waiting.append(row)

    def _admit(self):
        free = [s for s in range(self.S) if self._slots[s] is None]
        if not free or not self._waiting:
            return
        if self.policy == "static" and (len(free) < self.S or (len(self._waiting) < self.S and self._pending)):
            return  # a batch runs to completion; a new one starts full (or with the last rows)
        if len(free) == self.S and not self._pinned:
            self._choose_layout()
        entries = []
        while free and self._waiting:
            row = self._waiting[0]
            rules = _embed(row.parts, self._layout, self.V)
            if rules is None:
                break  # waits until the engine drains (first in, first out)
            self._waiting.popleft()
            row.slot = free.pop(0)
            self._slots[row.slot] = row
            entries.append((row.slot, row, rules))
        if entries:
            self.executor.admit(entries)

    def _choose_layout(self):
        """For an empty engine: of the chains of the first rows in line that the first row fits,
        the one that most of them fit (the current layout first, then the earliest, on ties)."""
        line = list(itertools.islice(self._waiting, LAYOUT_LOOKAHEAD))
        head = line[0]
        candidates = ([] if self._layout is None else [self._layout]) + [r.parts for r in line]
        candidates = [c for c in candidates if _embed(head.parts, c, self.V) is not None]
        best = max(candidates, key=lambda c: sum(_embed(r.parts, c, self.V) is not None for r in line))
        if self._layout is None or [_kind(p) for p in best] != [_kind(p) for p in self._layout]:
            self.executor.set_layout(best)
        self._layout = best

    def _prefill(self) -> int:
        """One prompt piece for every row still reading its prompt; returns the tokens run."""
        groups: dict = {}
        for row in self._slots:
            if row is not None and row.prefilled < len(row.prompt):
                groups.setdefault((row.prompt.tobytes(), row.prefilled), []).append(row)
        first, more, tokens = [], [], 0
        for (_, start), rows in groups.items():
            P, C = len(rows[0].prompt), self.chunk
            size = P - C * ((P - 1) // C) if start == 0 else C
            piece = rows[0].prompt[start:start + size]
            (first if start == 0 else more).append(([r.slot for r in rows], piece))
            tokens += size
            for r in rows:
                r.prefilled = start + size
        if first or more:
            self.executor.prefill(first, more)
        return tokens

    def step(self) -> StepRecord | None:
        """One engine step (see the module docstring); None when no slot had work."""
        start = self.clock.now()
        self._release(start)
        self._admit()
        if self.occupied == 0:
            return None
        prefill_tokens = self._prefill()
        decoding = np.array([r is not None and r.prefilled == len(r.prompt) for r in self._slots])
        active = int(decoding.sum())
        if active:
            steps = np.array([len(r.tokens) if d else 0 for r, d in zip(self._slots, decoding)], np.int32)
            lengths = np.array([0 if r is None else r.length for r in self._slots], np.int32)
            tokens, mlp, slp = self.executor.decode(decoding, steps, lengths)
        end = self.clock.step_done(self.S if active else 0, prefill_tokens)
        for s in np.flatnonzero(decoding):
            row = self._slots[s]
            row.tokens.append(int(tokens[s]))
            row.mlp.append(float(mlp[s]))
            row.slp.append(float(slp[s]))
            if row.t_first is None:
                row.t_first = end
            hit = any(len(row.tokens) >= len(stop) and row.tokens[-len(stop):] == stop.tolist()
                      for stop in row.stops)
            if hit or len(row.tokens) == row.n:
                row.finish, row.t_done, row.slot = ("stop" if hit else "length"), end, -1
                self._slots[s] = None
        record = StepRecord(start, end, self.S if active else 0, active, prefill_tokens)
        self.step_records.append(record)
        return record

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
        while not self.idle:
            if self.step() is None:  # nothing to run until the next arrival
                if not self._pending:
                    raise RuntimeError("the engine stalled with requests queued and no slot busy")
                self.clock.wait_until(self._pending[0][0])
        start, self._reported = self._reported, len(self.requests)
        return self.report(range(start, len(self.requests)))

    def report(self, indices=None) -> Report:
        """The finished requests (default: all) as a :class:`Report`."""
        indices = range(len(self.requests)) if indices is None else indices
        results = []
        for i in indices:
            rows = self._rows[i]
            if any(r.finish is None for r in rows):
                raise ValueError(f"request {i} has not finished")
            outs = [Generation(prompt=self.requests[i].prompt, text=self.lm.vocab.decode(r.tokens),
                               tokens=np.asarray(r.tokens, np.int32),
                               model_logprobs=np.asarray(r.mlp, np.float32),
                               sample_logprobs=np.asarray(r.slp, np.float32), finish_reason=r.finish)
                    for r in rows]
            firsts = [r.t_first for r in rows if r.t_first is not None]
            results.append(RequestResult(i, self.requests[i], outs, self._arrival[i],
                                         min(firsts) if firsts else None, max(r.t_done for r in rows)))
        return Report(self.policy, self.S, results, list(self.step_records))
