"""The engine's bookkeeping of a paged cache: which blocks a row takes when it is admitted, what
the running rows may still take, the prompt pieces written through block tables and the decode
calls' reservations (see :mod:`jaxdecode.serving.engine`, whose :class:`Engine` this is a part of)."""

from __future__ import annotations

import numpy as np

from jaxdecode.serving.blocks import OutOfBlocks
from jaxdecode.serving.records import cache_stats


def admission_order(row) -> tuple[int, int]:
    """Rows in the order they joined the queue (requests in submission order, then samples)."""
    return row.req, row.j


class PagedRows:
    """The paged-cache half of :class:`~jaxdecode.serving.engine.Engine` (its ``allocator``,
    ``executor``, ``_slots``, ``chunk`` and ``prefill_budget``)."""

    def _reset_cache_stats(self):
        self.peak_blocks = 0 if self.allocator is None else self.allocator.num_used
        self.prefix_hit_tokens = 0  # prompt tokens whose keys and values were found in the pool
        self.block_waits = 0  # admissions refused for too few free blocks

    def _note_peak(self):
        self.peak_blocks = max(self.peak_blocks, self.allocator.num_used)

    def _reserved(self, rows) -> int:
        """Blocks ``rows`` may still take from the pool before they finish: each its blocks up to
        ``prompt + n - 1`` positions (the last token is never written), plus one for the copy on
        write of a shared, partly filled last block."""
        a, bs = self.allocator, self.allocator.block_size
        total = 0
        for r in rows:
            table, length = a.table(r.seq), a.length(r.seq)
            cow = length % bs != 0 and a.refcount(table[-1]) > 1
            total += max(0, a.blocks_for(len(r.prompt) + r.n - 1) - len(table)) + int(cow)
        return total

    def _place(self, row, group: dict) -> bool:
        """Give a row its blocks if the pool can hold it to the end: the prompt's blocks now (shared
        with a sample of its request admitted in the same call, or cached full prefix blocks), and
        what it and every running row may still take reserved. False (nothing changed): it waits."""
        a = self.allocator
        first = group.get(row.req)
        if first is not None:  # a sample of the same prompt: share its blocks, copy on write later
            a.fork(first.seq, row.seq)
            row.prefilled, row.leader, cached = first.prefilled, first.seq, 0
        else:
            try:
                alloc = a.allocate(row.seq, row.prompt)
            except OutOfBlocks:
                return False
            row.prefilled, row.leader, cached = alloc.cached, row.seq, alloc.cached
        if self._reserved([r for r in self._slots if r is not None] + [row]) > a.num_free:
            a.free(row.seq)
            row.prefilled, row.leader = 0, None
            return False
        group.setdefault(row.req, row)
        self.prefix_hit_tokens += cached
        self._note_peak()
        return True

    def _prefill_paged(self) -> int:
        """One prompt piece (up to ``prefill_chunk`` tokens, from the first position not cached) for
        every group of rows writing one prompt into the same blocks; returns the tokens run."""
        groups: dict = {}
        for row in self._slots:
            if row is not None and row.prefilled < len(row.prompt):
                groups.setdefault(row.leader, []).append(row)
        if not groups:
            return 0
        pieces, run, tokens = [], [], 0
        for leader in sorted(groups, key=lambda g: admission_order(groups[g][0])):
            rows = groups[leader]
            start = rows[0].prefilled
            size = min(self.chunk, len(rows[0].prompt) - start)
            if self._over_budget(tokens, size):
                break  # the rest wait for the next step
            pieces.append(([r.slot for r in rows], start, rows[0].prompt[start:start + size]))
            run.append(leader)  # piece i is written through the table of run[i]
            tokens += size
            for r in rows:
                r.prefilled = start + size
        self.executor.prefill_pieces(pieces, self.allocator.tables(run, width=self.table_width))
        for leader in run:
            for r in groups[leader]:  # their full blocks are now written: shareable by later prompts
                self.allocator.mark_computed(r.seq, r.prefilled)
        return tokens

    def _over_budget(self, tokens: int, size: int) -> bool:
        """Whether a piece of ``size`` tokens after ``tokens`` already run this step exceeds the
        prefill budget (the first piece of a step always runs)."""
        return self.prefill_budget is not None and tokens > 0 and tokens + size > self.prefill_budget

    def _decode_many_paged(self, decoding, steps, lengths, k: int):
        """``k`` decode steps in one call on the paged cache: each decoding row first gets blocks
        for the positions the call writes (its ``k`` tokens, but never its last one: within what
        :meth:`_reserved` keeps for it)."""
        a = self.allocator
        tables = np.zeros((self.S, self.table_width), np.int32)
        n = np.zeros((self.S,), np.int32)
        copies = []
        slots = np.flatnonzero(decoding)
        rows = [self._slots[s] for s in slots]
        for row in rows:  # (positions already reserved for tokens not yet read back stay reserved)
            copies += a.reserve(row.seq, row.pending + min(k, row.n - 1 - len(row.tokens) - row.pending))
        tables[slots] = a.tables([row.seq for row in rows], width=self.table_width)
        n[slots] = [row.n for row in rows]
        self._note_peak()
        return self.executor.decode_many(decoding, steps, lengths, k, tables, copies, n, **self._fetch_kw)

    @property
    def table_width(self) -> int:
        """A paged engine's block-table width: the blocks of one full window."""
        return -(-self.T // self.allocator.block_size)

    def cache_stats(self) -> dict | None:
        """A paged engine's cache figures since its last :meth:`run` started (None for the dense
        cache): :func:`~jaxdecode.serving.records.cache_stats`."""
        return cache_stats(self) if self.paged else None

