"""The engine's device work: one decode step for every slot, prefill pieces written into their
slots, on a dense slot cache (:class:`ModelExecutor`) or a paged pool (:class:`PagedExecutor`).
See :mod:`jaxdecode.serving.engine`."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import constraints as C
from jaxdecode.models.base import copy_blocks
from jaxdecode.decoding.common import (
    PROMPT_BUCKET, SPAN_BUCKET, batch_bucket, pick_tokens, round_up, step_keys)
from jaxdecode.rules import Chain, processed_logprobs
from jaxdecode.serving.requests import neutral_rule


# ----------------------------------------------------------------------------- one decode step


def _select(logits, rule, rule_state, keys, row_ids, steps, greedy, cons=None, cstate=None):
    """One token per row, each at its own step: the sampling loop's choice (the same keys and
    :func:`~jaxdecode.decoding.common.pick_tokens`) with a step and a greedy flag per row.

    ``cons``: None (no constrained row), or ``(automaton, offsets, budgets)``: the rows'
    constraints stacked (:func:`~jaxdecode.constraints.stack`, state 0 free), each slot's first
    state in it and its ``n``; ``cstate`` ``[S]``: each slot's state relative to its offset (reset
    at step 0). As the sampling loop's step under a constraint: the allowed tokens masked, then
    in a final state the stop decision (greedy: stopping is likelier than the best allowed token;
    sampled: a uniform draw from the step key's ``STOP_STREAM`` below the stop probability).
    Returns ``(token, model_lp, sample_lp, stop, rule_state, cstate)``, ``stop`` None without
    ``cons``."""
    keys = step_keys(keys, row_ids, steps)
    masked, stop = logits, None
    # a row's automaton state starts at 0 on its first step, in the unconstrained program too: a
    # slot's state outlives its row, and a row admitted while no constrained row runs would
    # otherwise meet its slot's previous state once a constrained row joins the batch
    cstate = jnp.where(steps == 0, 0, cstate)
    if cons is not None:
        auto, offset, budget = cons
        ok, nxt = C.allowed(auto, offset + cstate, budget - steps)
        p_stop = C.stop_probability(auto, offset + cstate, logits, ok)
        masked = C.mask(logits, ok)
    processed = masked if rule is None else rule.apply(masked, rule_state)
    token = pick_tokens(processed, keys, greedy)
    take = lambda lp: jnp.take_along_axis(lp, token[:, None], axis=-1)[:, 0]
    model_lp = take(jax.nn.log_softmax(logits, axis=-1))
    sample_lp = take(processed_logprobs(processed))
    if cons is not None:
        best = jnp.max(jnp.where(ok, jax.nn.softmax(logits, axis=-1), 0.0), axis=-1)
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, C.STOP_STREAM)))(keys)
        stop = jnp.where(greedy, p_stop > best, u < p_stop)
        sample_lp = sample_lp + jnp.log1p(-jnp.minimum(p_stop, 1.0))
        after = take(nxt)
        cstate = jnp.where(stop | (after < 0), cstate, after - offset)
    if rule is not None:
        rule_state = rule.update(rule_state, token)
    return token, model_lp, sample_lp, stop, rule_state, cstate


def _rows_where(mask, new, old):
    """``new`` in the rows where ``mask`` ``[B]``, else ``old`` (pytrees of batch-first leaves)."""
    def pick(a, b):
        return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)

    return jax.tree_util.tree_map(pick, new, old)


def _decode_step(params, cache, logits, rule, rule_state, keys, row_ids, steps, greedy, lengths, decoding,
                 cons, cstate, *, model, span):
    """Choose a token in every slot and append it. ``lengths``: each slot's cache length (0 for a
    free slot); only ``decoding`` slots advance (a slot still reading its prompt keeps its cache
    length, rule state and automaton state: the position written for it is overwritten by its
    next piece). ``cons``, ``cstate``: the constraints (:func:`_select`)."""
    cache = model.truncate(cache, lengths)
    token, mlp, slp, stop, rule_state, cstate = _advance_rows(
        decoding, rule_state, cstate,
        *_select(logits, rule, rule_state, keys, row_ids, steps, greedy, cons, cstate))
    out, _, cache = model.extend(params, cache, token[:, None], span)
    cache = model.truncate(cache, lengths + decoding.astype(jnp.int32))
    return token, mlp, slp, stop, out[:, 0], cache, rule_state, cstate


def _advance_rows(decoding, rule_state, cstate, token, mlp, slp, stop, new_rule_state, new_cstate):
    """:func:`_select`'s outputs with the rule and automaton states advanced in the ``decoding``
    slots only."""
    if rule_state is not None:
        new_rule_state = _rows_where(decoding, new_rule_state, rule_state)
    return token, mlp, slp, stop, new_rule_state, jnp.where(decoding, new_cstate, cstate)


_decode = jax.jit(_decode_step, static_argnames=("model", "span"), donate_argnames=("cache", "rule_state"))


@functools.partial(jax.jit, static_argnames=("model", "span", "k"), donate_argnames=("cache", "rule_state"))
def _decode_many(params, cache, logits, rule, rule_state, keys, row_ids, steps, greedy, lengths, decoding,
                 n, cons, cstate, *, model, span, k):
    """``k`` decode steps in one call (:func:`_decode`'s step in a loop): every ``decoding`` slot
    chooses and appends up to ``k`` tokens, and stops once it has ``n`` (its token limit ``[S]``):
    a row that reaches its limit inside the call keeps its cache, rule and automaton states as
    they are for the rest of it (the tokens chosen for it there are dropped by the engine), so a
    call can run more steps than its shortest row has left. Returns the tokens,
    log-probabilities and (with ``cons``) the constraints' stop decisions ``[k, S]``."""
    last = model.T - 1

    def one(carry, _):
        cache, logits, rule_state, cstate, steps, lengths = carry
        live = decoding & (steps < n)
        # a row past its limit writes nowhere new (its length may be the window's: the write is
        # kept inside it, on the row's own last position, which it no longer needs)
        token, mlp, slp, stop, logits, cache, rule_state, cstate = _decode_step(
            params, cache, logits, rule, rule_state, keys, row_ids, steps, greedy,
            jnp.where(live, lengths, jnp.minimum(lengths, last)), live, cons, cstate, model=model, span=span)
        grown = live.astype(jnp.int32)
        return (cache, logits, rule_state, cstate, steps + grown, lengths + grown), (token, mlp, slp, stop)

    (cache, logits, rule_state, cstate, _, _), (token, mlp, slp, stop) = jax.lax.scan(
        one, (cache, logits, rule_state, cstate, steps, lengths), None, length=k)
    return token, mlp, slp, stop, logits, cache, rule_state, cstate


def scatter_rows(big, small, src, dst):
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
    return scatter_rows(cache, sub, src, dst), scatter_rows(logits, first, src, dst)


@functools.partial(jax.jit, static_argnames=("model", "span"), donate_argnames=("cache", "logits"))
def _extend_insert(params, cache, logits, rows, starts, counts, tokens, src, dst, *, model, span):
    """Append the next prompt piece ``tokens`` ``[G, W]`` (``counts[g]`` real tokens, the rest
    padding) to the first ``starts[g]`` positions of the cache row of slot ``rows[g]``, and write
    result ``src[i]`` (its row and its logits after its last real token) into slot ``dst[i]``.
    Padding rows have ``starts`` and ``counts`` 0."""
    sub = model.reorder(cache, rows)
    sub = model.truncate(sub, starts)
    out, _, sub = model.extend(params, sub, tokens, span, in_place=False)
    sub = model.truncate(sub, starts + counts)
    last = jnp.take_along_axis(out, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)[:, 0]
    return scatter_rows(cache, sub, src, dst), scatter_rows(logits, last, src, dst)


@functools.partial(jax.jit, static_argnames=("k",))
def _top_logprobs(logits, *, k):
    """The ``k`` most probable tokens of each slot's next-token logits: ``(logprobs, ids)`` ``[S, k]``."""
    return jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)


@jax.jit
def _set_slot_rows(inputs, dst, rows):
    """The slots' inputs (a pytree of ``[S, ...]`` device arrays) with rows ``rows[i]`` written at
    slots ``dst[i]``; a ``dst`` past the end is dropped (padding)."""
    return jax.tree_util.tree_map(lambda a, r: a.at[dst].set(r.astype(a.dtype), mode="drop"), inputs, rows)


@functools.partial(jax.jit, static_argnames=("V",), donate_argnames=("rule_state",))
def _init_rule_rows(rule, rule_state, prompt, lengths, dst, *, V):
    """The rule state of new rows (prompts ``[K, T]``) written into slots ``dst``."""
    return scatter_rows(rule_state, rule.init(prompt, lengths, V, 0), jnp.arange(prompt.shape[0]), dst)


# ----------------------------------------------------------------------------- executors


class ModelExecutor:
    """The device side of an :class:`Engine`: a dense cache of ``slots`` rows of ``lm``'s model,
    with each slot's logits, rule settings and rule state.

    The cache's leaves must be batch-first, and the cache a prefill returns for ``W`` positions
    must be the leading corner of one of capacity ``T`` (the reference model's and
    :class:`FunctionModel`'s are). The capacity is the model window ``T``; a decode step attends
    over the filled span, rounded up to :data:`jaxdecode.decoding.common.SPAN_BUCKET` positions.
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
                                 f"{type(self.model).__name__} has a leaf of shape {leaf.shape} "
                                 f"for {slots} rows")
        self._init_slots(slots)

    def _init_slots(self, slots: int):
        """Each slot's logits, key, row id, greedy flag and rule settings (no layout yet)."""
        self.logits = jnp.zeros((slots, self.V), jnp.float32)
        # rows written into slots per call, padded to one size (one program per prefill shape)
        self._rows_bucket = batch_bucket(slots)
        self.keys = np.zeros((slots, 2), np.uint32)
        self.row_ids = np.zeros((slots,), np.uint32)
        self.greedy = np.zeros((slots,), bool)
        self._treedefs: list = []
        self._settings: list = []  # per layout part: one [slots] array per leaf
        self.rule_state = None
        self._on_device = None  # _slot_inputs() as device arrays (None: to be sent whole)
        self._changed: set[int] = set()  # slots whose host inputs changed since they were sent
        # constraints: the stacked automaton (None: no row in the slots has one), each constraint's
        # offset in it (by id; the object kept so that its id stays its own), each slot's offset and
        # n (host), and each slot's state relative to its offset (device; reset at the row's step 0)
        self._auto, self._offset_of = None, {}
        self.coffset, self.budget = np.zeros((slots,), np.int32), np.zeros((slots,), np.int32)
        self.cstate = jnp.asarray(np.zeros((slots,), np.int32))

    def set_layout(self, layout: tuple):
        """Start a new rule layout (every slot is free)."""
        self._treedefs, self._settings = [], []
        self._on_device = None
        for part in layout:
            neutral = neutral_rule(part, self.V)
            leaves, treedef = jax.tree_util.tree_flatten(part if neutral is None else neutral)
            self._treedefs.append(treedef)
            # one setting per slot: a neutral setting has one row's shape (a scalar, or a logit
            # control's [V] vector); the parts without one have scalar settings
            self._settings.append([
                np.array(np.broadcast_to(a, (self.S,) + np.shape(a))) if neutral is not None
                else np.full((self.S,), np.asarray(a).reshape(-1)[0], np.asarray(a).dtype) for a in leaves])
        self.rule_state = None
        if layout:
            prompt = jnp.zeros((self.S, self.T), jnp.int32)
            self.rule_state = _init_state(self._rule(), prompt, jnp.ones((self.S,), jnp.int32), V=self.V)

    def _rule(self, rows=slice(None)):
        """The layout with every slot's settings, or those of slots ``rows`` (copies: the host
        arrays change as rows come)."""
        if not self._treedefs:
            return None
        return Chain(tuple(jax.tree_util.tree_unflatten(td, [a[rows].copy() for a in leaves])
                           for td, leaves in zip(self._treedefs, self._settings)))

    def _slot_inputs(self):
        """Every slot's rule settings, key, row id, greedy flag and constraint inputs (:func:`_select`'s
        ``cons``) as device arrays, not sent with every decode call (each host array a call takes is
        a transfer; the automaton is on the device already). After an admission only the new rows
        are sent and written into them (a rule layout's logit controls hold ``[S, V]`` settings)."""
        if self._on_device is not None and self._changed:
            slots = sorted(self._changed)
            dst = np.full((batch_bucket(len(slots)),), self.S, np.int32)  # padded (one program per size)
            dst[:len(slots)] = slots
            rows = np.minimum(dst, self.S - 1)  # (the padding's values are dropped)
            new = self._call(_set_slot_rows, self._on_device[:4],
                             dst, (self._rule(rows), self.keys[rows], self.row_ids[rows], self.greedy[rows]))
            if new is None:  # compiled only (warm-up)
                return self._on_device
            self._on_device = new + (self._cons(),)
        elif self._on_device is None:
            self._on_device = jax.device_put((self._rule(), self.keys.copy(), self.row_ids.copy(),
                                              self.greedy.copy(), self._cons()))
        self._changed.clear()
        return self._on_device

    def _cons(self):
        return None if self._auto is None else (self._auto, jnp.asarray(self.coffset), jnp.asarray(self.budget))

    def warm_slot_updates(self, counts):
        """Compile (inside :meth:`compiling`) the updates of ``counts`` admitted rows each."""
        self._slot_inputs()
        for count in counts:
            self._changed = set(range(min(count, self.S)))
            self._slot_inputs()
        self._changed.clear()

    def constrain(self, constraints, rows: int = 0):
        """After an admission: ``constraints`` ``[S]``, the constraint of the row in each slot (None:
        free, or unconstrained). The automaton is stacked again (and sent) only when one of them
        is not in it (so a table may keep a finished row's constraint until then), and dropped when
        none is left; its row count is a power of two, at least ``rows`` (the warm-up's sizes)."""
        live = list({id(c): c for c in constraints if c is not None}.values())
        if not live:
            self._auto, self._offset_of = None, {}
        elif rows or any(id(c) not in self._offset_of for c in live):
            auto, starts = C.stack(live, self.V)
            if rows > auto.table.shape[0]:  # padded with states no row reaches
                pad = lambda a, v: np.concatenate(
                    [np.asarray(a), np.full((rows - len(a),) + a.shape[1:], v, a.dtype)])
                auto = auto._replace(table=pad(auto.table, -1), final=pad(auto.final, False),
                                     dist=pad(auto.dist, C.INF), leftover=pad(auto.leftover, True))
            auto = C.Automaton(*(jnp.asarray(a) for a in auto))  # (sent once)
            self._auto, self._offset_of = auto, {id(c): (c, int(o)) for c, o in zip(live, starts)}
        self.coffset[:] = [0 if c is None else self._offset_of[id(c)][1] for c in constraints]
        if self._on_device is not None:
            self._on_device = self._on_device[:4] + (self._cons(),)

    def admit(self, entries):
        """``entries``: ``(slot, row, rules)`` with ``rules`` the row's rule for each layout part."""
        for slot, row, rules in entries:
            self._changed.add(slot)
            self.keys[slot], self.row_ids[slot], self.greedy[slot] = row.key, row.j, row.greedy
            self.budget[slot] = row.n
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
            state = self._call(_init_rule_rows, self._slot_inputs()[0], self.rule_state, prompt, lengths, dst,
                               V=self.V)
            self.rule_state = self.rule_state if state is None else state

    def prefill(self, first, more):
        """Run prompt pieces for the rows in ``slots`` (one prompt, at the same point): ``first``
        lists ``(slots, tokens)``, pieces that start their prompts; ``more`` lists ``(slots,
        source, start, tokens, width)``, pieces that continue the first ``start`` positions of
        slot ``source``'s cache row (its own slot's, or a reused prefix's), padded to ``width``
        (one call per width)."""
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
            out = self._call(_prefill_insert, self.params, self.cache, self.logits, tokens, lengths, src, dst,
                             model=self.model)
            self._store(out, "cache", "logits")
        widths: dict = {}
        for item in more:
            widths.setdefault(item[4], []).append(item)
        for W, items in sorted(widths.items(), reverse=True):
            G, K = batch_bucket(len(items)), self._rows_bucket
            rows, starts, counts = (np.zeros((G,), np.int32) for _ in range(3))
            tokens = np.zeros((G, W), np.int32)
            src, dst = np.zeros((K,), np.int32), np.full((K,), self.S, np.int32)
            i = 0
            for g, (slots, source, start, piece, _) in enumerate(items):
                rows[g], starts[g], counts[g], tokens[g, :len(piece)] = source, start, len(piece), piece
                for s in slots:
                    src[i], dst[i] = g, s
                    i += 1
            out = self._call(_extend_insert, self.params, self.cache, self.logits, rows, starts, counts, tokens,
                             src, dst, model=self.model, span=self.capacity)
            self._store(out, "cache", "logits")

    def top_logprobs(self, k: int):
        """The model's ``k`` most probable next tokens in every slot, before the next decode call:
        device arrays ``(logprobs, ids)`` ``[S, k]`` (``k`` at most the vocabulary)."""
        return self._call(_top_logprobs, self.logits, k=min(k, self.V))

    multi_step = True  # decode_many runs several steps per call
    asynchronous = True  # decode calls take fetch=False: device arrays back, read when needed

    def decode_many(self, decoding, steps, lengths, k: int, n=None, fetch: bool = True):
        """``k`` decode steps in one call (as :meth:`decode` ``k`` times with the decoding rows'
        steps and lengths advancing by one each time, each row stopping at its limit ``n`` ``[S]``,
        default: none). Returns numpy ``(tokens, model_logprobs, sample_logprobs)`` ``[k, S]``, and
        the constraints' stop decisions when the slots hold a constrained row (``fetch=False``:
        device arrays, the call possibly still running)."""
        n = np.full((self.S,), np.iinfo(np.int32).max, np.int32) if n is None else np.asarray(n, np.int32)
        span = min(self.capacity, round_up(int(lengths.max()) + k, SPAN_BUCKET))
        rule, keys, row_ids, greedy, cons = self._slot_inputs()
        out = self._call(_decode_many, self.params, self.cache, self.logits, rule, self.rule_state, keys,
                         row_ids, steps.astype(np.int32), greedy, lengths.astype(np.int32), decoding, n, cons,
                         self.cstate, model=self.model, span=span, k=k)
        return self._store(out, *_DECODED, "logits", "cache", "rule_state", "cstate", fetch=fetch)

    def decode(self, decoding, steps, lengths, fetch: bool = True):
        """One decode step: ``decoding`` ``[S]`` the slots that choose a token, ``steps`` their
        steps, ``lengths`` every slot's cache length (0: free). Returns numpy ``(tokens,
        model_logprobs, sample_logprobs)`` ``[S]``, and the stop decisions as :meth:`decode_many`
        (``fetch=False``: device arrays)."""
        span = min(self.capacity, round_up(int(lengths.max()) + 1, SPAN_BUCKET))
        rule, keys, row_ids, greedy, cons = self._slot_inputs()
        out = self._call(_decode, self.params, self.cache, self.logits, rule, self.rule_state, keys, row_ids,
                         steps.astype(np.int32), greedy, lengths.astype(np.int32), decoding, cons,
                         self.cstate, model=self.model, span=span)
        return self._store(out, *_DECODED, "logits", "cache", "rule_state", "cstate", fetch=fetch)

    # --- compiling ahead (:mod:`jaxdecode.serving.warmup`)
    _dry = False

    @contextlib.contextmanager
    def compiling(self):
        """Inside the block every device call is compiled (its program put in jit's cache) and not
        run: the executor's state stays as it was, and the calls return None."""
        self._dry = True
        try:
            yield self
        finally:
            self._dry = False

    def _call(self, fn, *args, **static):
        """``fn(*args, **static)``, or while :meth:`compiling`, its program compiled and None."""
        if self._dry:
            fn.lower(*args, **static).compile()
            return None
        return fn(*args, **static)

    def _store(self, out, *names, fetch: bool | None = None):
        """A call's outputs kept as the attributes ``names`` (None: handed back, fetched unless
        ``fetch`` is False, except outputs that are None); None after a call that was only compiled."""
        if out is None:
            return None
        back = []
        for name, value in zip(names, out):
            if name is None:
                if value is not None:
                    back.append(value)
            else:
                setattr(self, name, value)
        return _fetch(tuple(back), fetch) if fetch is not None else None


# a decode call's outputs handed back: tokens, model and sample log-probabilities, and the
# constraints' stop decisions (None, so not handed back, when no row in the slots is constrained)
_DECODED = (None, None, None, None)


def _fetch(arrays, fetch: bool):
    """``arrays`` as numpy (waiting for the call that computes them), or as they are."""
    return tuple(np.asarray(a) for a in jax.device_get(arrays)) if fetch else arrays


@functools.partial(jax.jit, static_argnames=("V",))
def _init_state(rule, prompt, lengths, *, V):
    return rule.init(prompt, lengths, V, 0)


def _paged_select_step(logits, rule, rule_state, keys, row_ids, steps, greedy, decoding, cons, cstate):
    """The paged engine's choice of a token in every slot (its rule and automaton states advanced
    in the ``decoding`` slots only); :func:`_paged_decode_many` then writes the tokens of the rows
    that go on into the blocks the host reserved for them."""
    return _advance_rows(decoding, rule_state, cstate,
                         *_select(logits, rule, rule_state, keys, row_ids, steps, greedy, cons, cstate))


def _paged_forward_step(params, pool, logits, tables, lengths, tokens, counts, src, dst, *, model):
    """``counts[g]`` new positions of row ``g`` (``tokens`` ``[G, C]``, after ``lengths[g]`` cached
    ones) through its block table; the logits after row ``src[i]``'s last new position are written
    into slot ``dst[i]`` (a ``dst`` past the end is dropped)."""
    out, _, pool = model.pool_forward(params, pool, tables, lengths, tokens, counts)
    last = jnp.take_along_axis(out, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)[:, 0]
    return pool, scatter_rows(logits, last, src, dst)


_paged_forward = jax.jit(_paged_forward_step, static_argnames=("model",), donate_argnames=("pool", "logits"))


@functools.partial(jax.jit, static_argnames=("model", "k"), donate_argnames=("pool", "logits", "rule_state"))
def _paged_decode_many(params, pool, logits, rule, rule_state, keys, row_ids, steps, greedy, decoding,
                       positions, tables, n, cons, cstate, *, model, k):
    """``k`` paged decode steps in one call: every ``decoding`` slot chooses a token
    (:func:`_paged_select_step`) and, unless it was the row's last (``n`` tokens), writes it at its
    next position through its block table (:func:`_paged_forward_step`, whose blocks the host
    reserved) for the next step's logits, as the engine's one-step path does. Returns the tokens,
    log-probabilities and (with ``cons``) the constraints' stop decisions ``[k, S]``."""
    S = logits.shape[0]
    slots = jnp.arange(S, dtype=jnp.int32)

    def one(carry, _):
        pool, logits, rule_state, cstate, steps, positions = carry
        token, mlp, slp, stop, rule_state, cstate = _paged_select_step(
            logits, rule, rule_state, keys, row_ids, steps, greedy, decoding, cons, cstate)
        write = decoding & (steps + 1 < n)
        pool, logits = _paged_forward_step(params, pool, logits, tables, positions, token[:, None],
                                           write.astype(jnp.int32), slots, jnp.where(write, slots, S),
                                           model=model)
        grown = decoding.astype(jnp.int32)
        return (pool, logits, rule_state, cstate, steps + grown, positions + grown), (token, mlp, slp, stop)

    (pool, logits, rule_state, cstate, _, _), (token, mlp, slp, stop) = jax.lax.scan(
        one, (pool, logits, rule_state, cstate, steps, positions), None, length=k)
    return token, mlp, slp, stop, pool, logits, rule_state, cstate


@functools.partial(jax.jit, donate_argnames=("pool",))
def _copy_pool_blocks(pool, src, dst):
    return copy_blocks(pool, src, dst)


class PagedExecutor(ModelExecutor):
    """The device side of a paged :class:`Engine`: one pool of ``num_blocks`` blocks of
    ``block_size`` positions (the model's :meth:`~jaxdecode.models.DecodingModel.paged` form)
    holding every slot's keys and values, found through block tables the engine's
    :class:`~jaxdecode.serving.blocks.BlockAllocator` keeps on the host; with each slot's logits,
    rule settings and rule state as :class:`ModelExecutor`. ``attention``: the paged attention
    implementation, which the model's paged form checks."""

    multi_step = True  # decode_many runs several steps per call, in blocks the host reserved first

    def __init__(self, lm, slots: int, num_blocks: int, block_size: int, attention: str = "portable",
                 kv_dtype: str = "float32"):
        try:  # the model's own paged form: the pool is part of the model interface
            self.model = lm.decoder.paged(int(block_size), attention)
        except NotImplementedError as e:
            raise ValueError(f"the paged cache needs a model with a paged form: {e}") from None
        self.S, self.T, self.V = slots, self.model.T, self.model.V
        self.capacity = self.T
        self.width = self.model.blocks_for(self.T)  # table columns: a row never exceeds the window
        self.params = self.model.prepare(lm.params, slots)
        # one buffer per leaf (the empty pool shares its zeros; the passes donate the pool)
        self.pool = jax.tree_util.tree_map(jnp.copy, self.model.empty_pool(num_blocks, kv_dtype))
        self._copies_bucket = batch_bucket(slots)
        self._init_slots(slots)

    def prefill_pieces(self, pieces, tables):
        """``pieces``: ``(slots, start, tokens)``: a prompt piece written at positions ``start..``
        of the blocks in the matching row of ``tables`` ``[G, width]``, its logits for every slot of
        ``slots`` (the samples sharing those blocks)."""
        G, K = batch_bucket(len(pieces)), self._rows_bucket
        W = min(round_up(max(len(t) for _, _, t in pieces), PROMPT_BUCKET), self.T)
        tokens = np.zeros((G, W), np.int32)
        lengths, counts = np.zeros((G,), np.int32), np.zeros((G,), np.int32)
        tab = np.zeros((G, self.width), np.int32)
        src, dst = np.zeros((K,), np.int32), np.full((K,), self.S, np.int32)
        i = 0
        for g, (slots, start, piece) in enumerate(pieces):
            tokens[g, :len(piece)], lengths[g], counts[g], tab[g] = piece, start, len(piece), tables[g]
            for s in slots:
                src[i], dst[i] = g, s
                i += 1
        out = self._call(_paged_forward, self.params, self.pool, self.logits, tab, lengths, tokens, counts,
                         src, dst, model=self.model)
        self._store(out, "pool", "logits")

    def decode(self, decoding, steps, lengths, fetch: bool = True):
        raise NotImplementedError("the paged cache decodes through decode_many, in blocks the engine "
                                  "reserved first (k = 1 included)")

    def _copy(self, copies):
        if copies:
            C = round_up(len(copies), self._copies_bucket)
            src, dst = np.zeros((C,), np.int32), np.full((C,), self.pool.num_blocks, np.int32)
            src[:len(copies)], dst[:len(copies)] = zip(*copies)
            pool = self._call(_copy_pool_blocks, self.pool, src, dst)
            self.pool = self.pool if pool is None else pool

    def decode_many(self, decoding, steps, lengths, k: int, tables, copies, n, fetch: bool = True):
        """``k`` decode steps in one call (:func:`_paged_decode_many`): ``tables`` ``[S, width]``
        list each slot's blocks with the next ``k`` positions reserved (after the block copies
        ``copies``), ``n`` ``[S]`` each slot's token limit. Returns numpy ``(tokens,
        model_logprobs, sample_logprobs)`` ``[k, S]``, and the stop decisions as
        :meth:`ModelExecutor.decode_many` (``fetch=False``: device arrays)."""
        self._copy(copies)
        rule, keys, row_ids, greedy, cons = self._slot_inputs()
        out = self._call(_paged_decode_many, self.params, self.pool, self.logits, rule, self.rule_state, keys,
                         row_ids, steps.astype(np.int32), greedy, decoding, lengths.astype(np.int32),
                         tables.astype(np.int32), n.astype(np.int32), cons, self.cstate,
                         model=self.model, k=k)
        return self._store(out, *_DECODED, "pool", "logits", "rule_state", "cstate", fetch=fetch)
