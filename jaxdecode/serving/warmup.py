"""Compiling an engine's programs before it serves (:meth:`jaxdecode.serving.engine.Engine.warm_up`).

The engine runs a bounded set of program shapes, padded to buckets (the rows of a prefill to a
power of two, a prompt piece to :data:`~jaxdecode.decoding.common.PROMPT_BUCKET` positions, a
dense decode step's span to :data:`~jaxdecode.decoding.common.SPAN_BUCKET`, the decode steps of
one call to a power of two), but which of them a stream of requests meets depends on timing: how
many prompts start in one step, how long the longest row is when a call runs, how many steps a
call can take. A server that compiles on first use stalls its first requests; a benchmark that
does times the compiler. :func:`warm_up` compiles every shape that serving a given set of
requests can take, whatever their arrival times, without running any of them (the executor's
:meth:`~jaxdecode.serving.executors.ModelExecutor.compiling`: jit's ahead-of-time compile, which
fills the cache the calls use).

Constrained requests add the decode programs over their stacked automaton: one per table size
the rows in the slots can make (:func:`_table_sizes`), besides the unconstrained ones when some
request has no constraint.
"""

from __future__ import annotations

import contextlib

import numpy as np

from jaxdecode.decoding.common import PROMPT_BUCKET, SPAN_BUCKET, batch_bucket, round_up
from jaxdecode.serving.requests import embed_in_layout, make_rows, part_kind
from jaxdecode.serving.reuse import REUSE_MIN, next_piece, piece_width


@contextlib.contextmanager
def count_compiles():
    """Counts the XLA compilations inside the block (``[count]``, filled in as they happen): a timed
    run that compiles is timing the compiler."""
    from jax._src import dispatch, monitoring

    counted = [0]

    def listener(event, duration, **kwargs):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            counted[0] += 1

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counted
    finally:
        monitoring.unregister_event_duration_listener(listener)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(max(1, limit).bit_length()) if 1 << i <= limit]


def _piece_widths(engine, prompts) -> tuple[set, set]:
    """The padded widths of the prompt pieces that start a prefill, and those of the pieces that
    continue one (the dense cache's ``extend``: full chunks, and with prefix reuse the first piece
    after a reused prefix). A paged prompt may start after any number of cached full blocks (a
    prefix hit), and every piece goes through one program."""
    C, T, widths, more = engine.chunk, engine.T, set(), set()
    for P in prompts:
        if engine.paged:
            bs = engine.allocator.block_size
            starts = range(0, P, bs) if engine.allocator.prefix_caching else [0]
            for start in starts:
                for s in range(start, P, C):
                    widths.add(min(round_up(min(C, P - s), PROMPT_BUCKET), T))
        else:
            widths.add(min(round_up(P - C * ((P - 1) // C), PROMPT_BUCKET), T))
            if P > C:
                more.add(C)
            if getattr(engine, "reuse", False) and P > REUSE_MIN:  # resumed after REUSE_MIN.. P - 1 tokens
                more |= {piece_width(next_piece(P, start, C), C) for start in range(REUSE_MIN, P)}
                widths.add(min(round_up(engine.write_reach(), PROMPT_BUCKET), T))  # a source's first positions
    return widths, more


def warm_up(engine, requests) -> int:
    """Compile (not run) every program ``engine`` can take to serve ``requests`` and returns the
    number of XLA compilations that took (0 when all were compiled before). The engine must be
    idle; its state does not change."""
    if not engine.idle:
        raise ValueError("warm_up needs an idle engine (nothing queued, running or still to arrive)")
    rows = [row for i, r in enumerate(requests) for row in make_rows(engine, r, i)]
    if not rows:
        return 0
    ex, S = engine.executor, engine.S
    if engine.layout_pinned:
        layouts = [engine.rule_layout]
    else:  # each chain of kinds among the rows (the engine's layout is one of the rows' chains)
        layouts = list({tuple(part_kind(p) for p in r.parts): r.parts for r in rows}.values())
    prompts = sorted({len(r.prompt) for r in rows})
    longest = max(len(r.prompt) + r.n - 1 for r in rows)
    widths, more = _piece_widths(engine, prompts)
    groups = _powers_of_two(batch_bucket(min(S, len(rows))))
    steps = _powers_of_two(min(engine.decode_steps, max(r.n for r in rows)))
    if not getattr(ex, "multi_step", False):
        steps = [1]
    cons = list({id(r.constraint): r.constraint for r in rows if r.constraint is not None}.values())
    if not hasattr(ex, "constrain"):
        cons = []
    # 0: the unconstrained programs; then each automaton size, with the smallest constraint padded to it
    sizes = ([0] if not cons or any(r.constraint is None for r in rows) else []) + _table_sizes(cons)
    smallest = min(cons, key=lambda c: c.states) if cons else None
    with count_compiles() as counted:
        for layout in layouts:
            ex.set_layout(layout)
            row = next((r for r in rows if embed_in_layout(r.parts, layout, engine.V) is not None), rows[0])
            with ex.compiling():
                ex.admit([(0, row, embed_in_layout(row.parts, layout, engine.V))])
                if hasattr(ex, "warm_slot_updates"):
                    ex.warm_slot_updates(groups)  # the rows one admission sends
                _prefills(engine, widths, more, groups)
                for size in sizes:
                    if cons:
                        ex.constrain([smallest if size else None] + [None] * (S - 1), rows=size)
                    if getattr(engine, "speculative", False):
                        _passes(engine, steps, prompts[0], longest)
                    else:
                        _decodes(engine, steps, prompts[0], longest)
        if cons:
            ex.constrain([None] * S)  # an idle engine's slots hold no constraint
        if engine.rule_layout is not None:
            ex.set_layout(engine.rule_layout)  # back to the layout the engine runs
    return counted[0]


def _table_sizes(constraints) -> list[int]:
    """The row counts of every automaton the engine can stack from some of ``constraints``
    (:func:`jaxdecode.constraints.stack`: a free state, then each constraint's states, padded to a
    power of two): one for each sum of the states of some of them."""
    sums = {0}
    for c in constraints:
        sums |= {s + c.states for s in sums}
    return sorted({1 << s.bit_length() for s in sums if s > 0})


def _prefills(engine, widths, more, groups):
    ex, S = engine.executor, engine.S
    slots = list(range(S))
    for G in groups:
        pieces = [slots[g:g + 1] for g in range(min(G, S))]  # (G rows after padding)
        for W in sorted(widths):
            tokens = [np.zeros((W,), np.int32)] * len(pieces)
            if engine.paged:
                tables = np.zeros((len(pieces), engine.table_width), np.int32)
                ex.prefill_pieces([(s, 0, t) for s, t in zip(pieces, tokens)], tables)
            else:
                ex.prefill(list(zip(pieces, tokens)), [])
        if not engine.paged:
            for W in sorted(more):
                ex.prefill([], [(s, 0, 0, np.zeros((W,), np.int32), W) for s in pieces])


def _passes(engine, steps, shortest, longest):
    """A speculative engine's programs: its passes (speculative, and plain where the engine can
    turn itself down), each number a call and each span, and the draft's rebuild of a slot for
    each padded text length."""
    ex, S, gamma = engine.executor, engine.S, engine.gamma
    decoding = np.ones((S,), bool)
    zeros = np.zeros((S,), np.int32)
    kinds = [True] + ([False] if engine.speculative_max_rows < S else [])
    for speculative in kinds:
        for k in steps:
            reach = gamma + 1 if speculative else 1  # a call's span is its first pass's (SpeculativeExecutor.span)
            for span in sorted({min(engine.T, round_up(L + reach, SPAN_BUCKET)) for L in range(shortest - 1, longest)}):
                ex.passes(decoding, zeros, np.full((S,), max(span - reach, 0), np.int32), zeros, zeros, k, speculative)
    for W in sorted({min(round_up(L, PROMPT_BUCKET), engine.T) for L in range(shortest, longest + 1)}):
        ex.sync_drafts([(0, np.zeros((W,), np.int32))])


def _decodes(engine, steps, shortest, longest):
    """Every decode program: each number of steps a call, and (dense) each span its rows' longest
    length can round up to."""
    ex, S = engine.executor, engine.S
    decoding = np.ones((S,), bool)
    zeros = np.zeros((S,), np.int32)
    for k in steps:
        if engine.paged:
            tables = np.zeros((S, engine.table_width), np.int32)
            copies = [(0, 0)]  # one copy on write: the block copies' program too
            ex.decode_many(decoding, zeros, zeros, k, tables, copies, np.full((S,), k + 1, np.int32))
            continue
        spans = sorted({min(engine.T, round_up(L + k, SPAN_BUCKET)) for L in range(shortest, longest + 1)})
        for span in spans:
            lengths = np.full((S,), span - k, np.int32)  # the longest row's length that gives this span
            if k == 1:
                ex.decode(decoding, zeros, lengths)
            else:
                ex.decode_many(decoding, zeros, lengths, k)
