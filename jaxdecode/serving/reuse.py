"""Prefix reuse on the dense cache: a prompt starts where a slot already holds its first tokens.

A row that leaves its slot leaves its keys and values there until another row is written into
it. The engine keeps, for each free slot, the row that left it. When a row is admitted, its
prompt is compared with what every slot holds (a free slot: the last row's prompt and tokens but
the last; a busy one: its row's prompt pieces read and tokens but the last). The longest common
prefix, at least :data:`REUSE_MIN` tokens and never the whole prompt, is not computed again: the
row's first piece extends the source slot's row from there into the row's own slot. A free
source is taken by the row; a busy one (a concurrent request, another sample) is only read. A
row that reuses nothing takes an empty free slot, else the one left longest ago (an eviction).

Decode calls write a position in every slot: a free slot keeps length 0 (nothing to attend
over), and the first positions it keeps are written again before it is read. Rows whose first
piece has not run are no source, and their source is given to no other row until it has. The
texts do not change (the reused keys and values are a prefill's of the same tokens, up to
float32 rounding, as chunked prefill). The int8 dense cache recomputes every prompt; the paged
cache shares prompt blocks itself. docs/serving.md, "Prefix caching on the dense cache", says
more.
"""

from __future__ import annotations

import itertools

import numpy as np

from jaxdecode.decoding.common import PROMPT_BUCKET, round_up

REUSE_MIN = 16  # the fewest prompt tokens worth reusing (fewer: the prompt is read from its start)
_NOTHING = np.zeros((0,), np.int32)


def piece_width(size: int, chunk: int) -> int:
    """The padded width of a prompt piece of ``size`` tokens that continues a prompt: a power of
    two, at least :data:`PROMPT_BUCKET`, at most ``chunk`` (a full chunk is its own width)."""
    return min(max(PROMPT_BUCKET, 1 << (size - 1).bit_length()), chunk)


def next_piece(P: int, start: int, chunk: int) -> int:
    """The size of the prompt piece that starts at ``start`` of a prompt of ``P`` tokens: what is
    left over after whole chunks, so that every later piece is one full chunk."""
    rest = P - start
    return rest - chunk * ((rest - 1) // chunk)


def resume_at(P: int, match: int, chunk: int, limit: int) -> int:
    """Where a prompt of ``P`` tokens whose first ``match`` tokens are held starts reading: at most
    ``match`` and ``P - 1``, low enough that the first piece's padded width stays below ``limit``
    (the window less what a decode call may write past a slot's length). 0: no reuse."""
    start = min(match, P - 1)
    while start >= REUSE_MIN:
        width = piece_width(next_piece(P, start, chunk), chunk)
        if start + width <= limit:
            return start
        start = limit - width
    return 0


class DenseReuse:
    """The dense-cache prefix reuse half of :class:`~jaxdecode.serving.engine.Engine` (its
    ``_slots``, ``S``, ``T``, ``chunk`` and ``reuse``)."""

    def _init_reuse(self):
        self._kept: list = [None] * self.S  # per free slot: the row whose keys and values it holds
        self._dirty = [0] * self.S  # ... but for its first positions, written by decode calls while free
        self._used = [0] * self.S  # when the slot was last left (least recently used goes first)
        self._ticks = itertools.count(1)
        # since the engine started: prompt tokens looked up, found; slots whose history was evicted
        self.prefix_queried = self.prefix_hits = self.prefix_evictions = 0

    def write_reach(self) -> int:
        """Positions a decode call writes from a slot's length (a speculative pass: ``gamma + 1``)."""
        return self.gamma + 1 if self.speculative else 1

    @staticmethod
    def _held(row) -> np.ndarray:
        """The tokens whose keys and values ``row``'s own slot holds: its prompt pieces read, and
        once decoding its tokens but the last (a speculative engine has not written it yet)."""
        if row.source is not None:  # its first piece has not run: its slot holds nothing of it yet
            return _NOTHING
        if row.prefilled < len(row.prompt) or len(row.tokens) < 2:
            return row.prompt[:row.prefilled]
        return np.concatenate([row.prompt, np.asarray(row.tokens[:-1], np.int32)])

    def _reads_from(self, rows) -> int:
        """The slot that the next prompt piece of ``rows`` (one prompt, at one point) continues: the
        first row's source until its first piece runs. A source whose first positions decode calls
        wrote while it was free (a free slot's decode position is 0) gets them written again first:
        a prefill of its first tokens, which the prompt shares. The piece then writes each row's
        slot whole, so none of them is left marked: a mark left on a slot whose row then decodes
        would have a later reader write that prefill into it, its next-token logits included."""
        row = rows[0]
        source = row.slot if row.source is None else row.source
        if self._dirty[source]:
            width = round_up(self._dirty[source], PROMPT_BUCKET)
            self.executor.prefill([([source], row.prompt[:width])], [])
            self._dirty[source] = 0
        for r in rows:
            self._dirty[r.slot] = 0
        return source

    @staticmethod
    def _held_length(row) -> int:
        """``len(_held(row))``, without building it."""
        if row.source is not None:
            return 0
        if row.prefilled < len(row.prompt) or len(row.tokens) < 2:
            return row.prefilled
        return len(row.prompt) + len(row.tokens) - 1

    def _slot_length(self, s: int) -> int:
        row = self._slots[s]
        if row is not None:
            return self._held_length(row)
        kept = self._kept[s]
        return 0 if kept is None else self._held_length(kept)

    def _slot_tokens(self, s: int) -> np.ndarray:
        row = self._slots[s]
        if row is not None:
            return self._held(row)
        kept = self._kept[s]
        return _NOTHING if kept is None else self._held(kept)

    def _vacate(self, s: int) -> None:
        """Row ``self._slots[s]`` leaves slot ``s``; the slot keeps its keys and values."""
        row, self._slots[s] = self._slots[s], None
        if self.reuse and row is not None:
            self._kept[s] = None if row.source is not None else row
            self._dirty[s] = 0
            self._used[s] = next(self._ticks)

    def _seat(self, row, free: list, group: dict):
        """Choose a free slot for ``row`` (removed from ``free``) and where its prompt starts
        reading (``row.prefilled``, ``row.source``); None (nothing changed) when every free slot
        must wait for a row's first piece."""
        first = group.get(row.req)
        if first is not None:  # a sample of a request admitted in this call: one prefill row for all
            slot = self._evict(free)
            if slot is not None:
                row.prefilled, row.source = first.prefilled, first.source
            return slot
        P = len(row.prompt)
        self.prefix_queried += P - 1  # all but the last token could be found (as the paged cache counts)
        best, match = None, 0
        if P > REUSE_MIN:
            want = row.prompt[:P - 1]
            for s in range(self.S):
                other = self._slots[s] if self._slots[s] is not None else self._kept[s]
                if other is None or not len(other.prompt) or other.prompt[0] != want[0] \
                        or self._slot_length(s) < REUSE_MIN:
                    continue  # (most slots: their rows start with another token)
                held = self._slot_tokens(s)
                m = min(len(held), len(want))
                diff = np.flatnonzero(held[:m] != want[:m])
                m = int(diff[0]) if diff.size else m
                # the longest; on ties a free slot (it is taken: nothing else is evicted)
                if m > match or (m == match and best is not None and self._slots[best] is not None
                                 and self._slots[s] is None):
                    best, match = s, m
        reach = self.write_reach()
        start = resume_at(P, match, self.chunk, self.T - reach + 1) if match else 0
        if start and start < max(round_up(reach, PROMPT_BUCKET), self._dirty[best]):
            start = 0  # (a source's first positions written again must lie within the reused start)
        if start and self._slots[best] is None:
            free.remove(best)
            slot = best
        else:
            slot = self._evict(free)
            if slot is None:
                return None
        self._kept[slot] = None
        if start:
            row.prefilled, row.source = start, best
            self.prefix_hits += start
            self.prefix_hit_tokens += start
        group.setdefault(row.req, row)
        return slot

    def _evict(self, free: list):
        """The free slot a row without reuse takes: one holding nothing, else the one left longest
        ago; never one a waiting first piece reads from. None: none may be taken now."""
        pinned = {r.source for r in self._slots if r is not None and r.source is not None}
        open_ = [s for s in free if s not in pinned]
        if not open_:
            return None
        empty = [s for s in open_ if self._slot_length(s) < REUSE_MIN]
        slot = empty[0] if empty else min(open_, key=lambda s: self._used[s])
        if not empty:
            self.prefix_evictions += 1
        free.remove(slot)
        self._kept[slot], self._dirty[slot] = None, 0
        return slot

    def _free_lengths(self, lengths: np.ndarray) -> None:
        """Before a decode call (``lengths`` ``[S]``): a free slot keeps length 0, so that the call
        attends over nothing there; its write there spoils the first positions of the history it
        keeps, which are written again if it is reused (:meth:`_reads_from`)."""
        if not self.reuse:
            return
        reach = self.write_reach()
        for s in range(self.S):
            if self._slots[s] is None and self._kept[s] is not None:
                lengths[s] = 0
                self._dirty[s] = max(self._dirty[s], reach)

    def prefix_counts(self) -> tuple[int, int, int] | None:
        """The prefix cache's counts since the engine started: prompt tokens looked up, prompt
        tokens found (not computed again), and cached blocks evicted (the dense cache: slots whose
        history was overwritten). None without prefix caching."""
        if self.allocator is not None:
            a = self.allocator
            return (a.queried, a.hits, a.evictions) if a.prefix_caching else None
        return (self.prefix_queried, self.prefix_hits, self.prefix_evictions) if self.reuse else None
