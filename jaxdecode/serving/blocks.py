"""Host-side bookkeeping of a paged KV cache: a pool of fixed-size blocks and each sequence's
block table.

The device holds the keys and values of every layer in a pool of ``num_blocks`` blocks of
``block_size`` positions (a model's paged form, :class:`jaxdecode.models.base.PagedPool`);
position ``p`` of a sequence lies in block ``table[p // block_size]`` at offset ``p % block_size``.
This module decides which blocks each sequence gets; it never touches the device:

- **allocation**: a new sequence gets the blocks its prompt needs; appending tokens takes a new
  block when the last one is full. When the pool runs out, :class:`OutOfBlocks` is raised and
  nothing changes; a request that could not fit even in an empty pool is a ``ValueError``.
- **reference counts and forks**: :meth:`BlockAllocator.fork` shares every block of another
  sequence (beams); a block returns to the free list when no table references it.
- **copy on write**: appending into a shared, partly filled last block first copies it;
  :meth:`~BlockAllocator.append` returns the ``(src, dst)`` copies the device must do
  (:func:`jaxdecode.models.base.copy_blocks`).
- **prefix sharing** (as vLLM's automatic prefix caching): every full, computed block is keyed by
  its tokens and the key of the block before it. A prompt that starts with cached full blocks
  reuses them (:attr:`Allocation.cached`); freed blocks keep their contents and key on the free
  list, least recently freed reused first, until they are needed for something else.

A block becomes shareable only once its keys and values are on the device
(:meth:`BlockAllocator.mark_computed`), and the last prompt position is never taken from the
cache (its logits are needed), as in vLLM.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np

__all__ = ["Allocation", "BlockAllocator", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """The pool has too few free blocks for the request right now (it would fit in an emptier
    pool): queue it, or preempt another sequence and retry. Nothing was changed."""

    def __init__(self, needed: int, free: int, what: str = "the request"):
        self.needed = needed
        self.free = free
        super().__init__(f"out of KV cache blocks: {what} needs {needed} more, {free} free")


@dataclasses.dataclass(frozen=True)
class Allocation:
    """A new sequence's blocks: its block table and how many of its first tokens already have
    their keys and values in the pool (shared prefix blocks: the caller computes only the rest)."""

    blocks: tuple[int, ...]
    cached: int


def _as_tokens(tokens) -> tuple[int, ...]:
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise ValueError(f"tokens must be a 1-d sequence of token ids, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"tokens must be integer token ids, got dtype {a.dtype}")
    return tuple(int(t) for t in a)


class _Seq:
    __slots__ = ("blocks", "tokens", "computed", "keys", "ahead")

    def __init__(self, blocks, tokens, computed, keys, ahead=0):
        self.blocks: list[int] = blocks  # the block table
        self.tokens: list[int] = tokens  # every token so far (the prefix keys are made from them)
        self.computed: int = computed  # tokens whose keys and values are known to be written
        self.keys: list[int] = keys  # prefix key ids of the leading full blocks registered so far
        self.ahead: int = ahead  # positions past the tokens that have blocks already (reserve)

    def copy(self):
        return _Seq(list(self.blocks), list(self.tokens), self.computed, list(self.keys), self.ahead)


class BlockAllocator:
    """Blocks of a pool of ``num_blocks`` blocks of ``block_size`` tokens, for sequences named by
    any hashable id. ``prefix_caching``: share full prompt blocks between sequences (see the
    module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockAllocator: {name} must be a positive integer, got {value!r}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.prefix_caching = bool(prefix_caching)
        self._ref = [0] * self.num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.num_blocks))
        self._seqs: dict[Hashable, _Seq] = {}
        # prefix cache: (key id of the previous block or 0, the block's tokens) -> (key id, block)
        self._cache: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        self._block_key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> its entry in _cache
        self._next_key = 1
        self.hits = 0  # prompt tokens served from the prefix cache so far
        self.queried = 0  # prompt tokens looked up in it (each prompt's full blocks but the last token's)
        self.evictions = 0  # cached blocks taken for other contents (least recently freed first)

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks not referenced by any sequence (cached prefixes among them included)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that ``n_tokens`` positions occupy."""
        return -(-int(n_tokens) // self.block_size)

    def __contains__(self, seq) -> bool:
        return seq in self._seqs

    def sequences(self) -> list:
        return list(self._seqs)

    def table(self, seq) -> list[int]:
        """The block table of ``seq`` (a copy)."""
        return list(self._get(seq).blocks)

    def length(self, seq) -> int:
        return len(self._get(seq).tokens)

    def tokens(self, seq) -> list[int]:
        return list(self._get(seq).tokens)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def tables(self, seqs: Sequence, width: int | None = None, fill: int = 0) -> np.ndarray:
        """The tables of ``seqs`` as an int32 array ``[len(seqs), width]`` padded with ``fill``
        (default width: the longest table)."""
        rows = [self._get(s).blocks for s in seqs]
        width = max((len(r) for r in rows), default=0) if width is None else width
        out = np.full((len(rows), width), fill, np.int32)
        for i, r in enumerate(rows):
            if len(r) > width:
                raise ValueError(f"table width {width} is below the {len(r)} blocks of sequence {seqs[i]!r}")
            out[i, :len(r)] = r
        return out

    def can_allocate(self, tokens) -> bool:
        """Whether :meth:`allocate` of these prompt tokens would succeed now."""
        tokens = _as_tokens(tokens)
        if self.blocks_for(len(tokens)) > self.num_blocks:
            return False
        hits = self._lookup(tokens)
        revived = sum(1 for b in hits if self._ref[b] == 0)
        return self.blocks_for(len(tokens)) - len(hits) + revived <= len(self._free)

    # ------------------------------------------------------------------ changes
    def allocate(self, seq, tokens, *, max_new_tokens: int = 0) -> Allocation:
        """Blocks for a new sequence ``seq`` holding the prompt ``tokens``.

        Full leading blocks found in the prefix cache are shared; :attr:`Allocation.cached` says
        how many tokens they cover (never the last prompt token). ``max_new_tokens``: the most
        tokens the sequence will append; a request that could not fit in the whole pool even when
        it is empty raises ``ValueError``. Raises :class:`OutOfBlocks` (changing nothing) when too
        few blocks are free now.
        """
        if seq in self._seqs:
            raise ValueError(f"sequence {seq!r} already has blocks")
        tokens = _as_tokens(tokens)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        total = self.blocks_for(len(tokens) + max_new_tokens)
        if total > self.num_blocks:
            raise ValueError(f"a request of {len(tokens)} + {max_new_tokens} tokens needs {total} blocks of "
                             f"{self.block_size}, more than the whole pool of {self.num_blocks}")
        hits = self._lookup(tokens)
        revived = sum(1 for b in hits if self._ref[b] == 0)
        fresh = self.blocks_for(len(tokens)) - len(hits)
        if fresh + revived > len(self._free):
            raise OutOfBlocks(fresh + revived, len(self._free))
        keys = []
        for b in hits:
            self._take(b)
            keys.append(self._cache[self._block_key[b]][0])
        blocks = list(hits) + [self._pop_free() for _ in range(fresh)]
        cached = len(hits) * self.block_size
        self.hits += cached
        if self.prefix_caching:
            self.queried += (len(tokens) - 1) // self.block_size * self.block_size
        self._seqs[seq] = _Seq(blocks, list(tokens), cached, keys)
        return Allocation(tuple(blocks), cached)

    def append(self, seq, tokens) -> list[tuple[int, int]]:
        """Append ``tokens`` (one or more ids) to ``seq``: a new block whenever the last is full.

        Returns the ``(src, dst)`` block copies the device must do before writing the new
        positions: a partly filled last block that other sequences share is copied into a block of
        this sequence's own (copy on write). Raises :class:`OutOfBlocks` (changing nothing) when
        too few blocks are free, ``ValueError`` when the sequence would outgrow the whole pool.
        Positions given blocks by :meth:`reserve` take no block (nor copy) again.
        """
        s = self._get(seq)
        if type(tokens) is list and 0 < len(tokens) <= s.ahead and all(type(t) is int for t in tokens):
            # the engine's every step: positions reserved before the call, so no block to take and,
            # unless the sequence was forked since, no block to copy (_grow would change nothing)
            n, bs = len(s.tokens), self.block_size
            if n % bs == 0 or self._ref[s.blocks[n // bs]] == 1:
                s.tokens.extend(tokens)
                s.ahead -= len(tokens)
                return []
        tokens = _as_tokens(np.atleast_1d(np.asarray(tokens)))
        if not tokens:
            return []
        copies = self._grow(seq, s, len(tokens))
        s.tokens.extend(tokens)
        s.ahead = max(0, s.ahead - len(tokens))
        return copies

    def reserve(self, seq, positions: int) -> list[tuple[int, int]]:
        """Blocks for the next ``positions`` positions of ``seq`` before its tokens are known (a
        device call that writes several decode steps): as :meth:`append` does for that many tokens
        (the same copies, the same errors), but the tokens are recorded later by :meth:`append`,
        which then takes no block for them. A reservation shrinks with the tokens appended, and
        :meth:`truncate` drops it."""
        s = self._get(seq)
        positions = int(positions)
        if positions < 0:
            raise ValueError(f"reserve: positions must be >= 0, got {positions}")
        if positions <= s.ahead:
            return []
        copies = self._grow(seq, s, positions)
        s.ahead = positions
        return copies

    def _grow(self, seq, s: _Seq, count: int) -> list[tuple[int, int]]:
        """Blocks for positions ``len(s.tokens) ..`` ``+ count`` (the copy on write of a shared block
        holding the first of them): all or nothing."""
        n, bs = len(s.tokens), self.block_size
        total = self.blocks_for(n + count)
        if total > self.num_blocks:
            raise ValueError(f"sequence {seq!r} would need {total} blocks of {bs}, more than the whole pool "
                             f"of {self.num_blocks}")
        partial = n % bs != 0  # position n lies in a block the sequence holds already
        first = n // bs
        cow = partial and self._ref[s.blocks[first]] > 1
        needed = max(0, total - len(s.blocks)) + cow
        if needed > len(self._free):
            raise OutOfBlocks(needed, len(self._free), f"sequence {seq!r}")
        copies = []
        if cow:
            src = s.blocks[first]
            dst = self._pop_free()
            self._release(src)
            s.blocks[first] = dst
            copies.append((src, dst))
        elif partial and s.ahead == 0:
            self._uncache(s.blocks[first])  # written again (after a truncate): its old key is stale
        while len(s.blocks) < total:
            s.blocks.append(self._pop_free())
        return copies

    def mark_computed(self, seq, n_tokens: int | None = None):
        """Declare that the keys and values of the first ``n_tokens`` (default: all) tokens of
        ``seq`` are written on the device; its full blocks among them become shareable."""
        s = self._get(seq)
        n = len(s.tokens) if n_tokens is None else int(n_tokens)
        if not 0 <= n <= len(s.tokens):
            raise ValueError(f"mark_computed: {n} is outside 0..{len(s.tokens)} tokens of sequence {seq!r}")
        s.computed = max(s.computed, n)
        if not self.prefix_caching:
            return
        bs = self.block_size
        while len(s.keys) < s.computed // bs:
            i = len(s.keys)
            entry = (s.keys[-1] if s.keys else 0, tuple(s.tokens[i * bs:(i + 1) * bs]))
            block = s.blocks[i]
            known = self._cache.get(entry)
            if known is not None:
                s.keys.append(known[0])  # the same prefix already cached in another block
                continue
            if block in self._block_key:  # holds another prefix (it cannot: full blocks are immutable)
                s.keys.append(self._cache[self._block_key[block]][0])
                continue
            key = self._next_key
            self._next_key += 1
            self._cache[entry] = (key, block)
            self._block_key[block] = entry
            s.keys.append(key)

    def fork(self, parent, child):
        """A new sequence ``child`` sharing every block of ``parent`` (a beam)."""
        if child in self._seqs:
            raise ValueError(f"sequence {child!r} already has blocks")
        p = self._get(parent)
        for b in p.blocks:
            self._ref[b] += 1
        self._seqs[child] = p.copy()

    def reorder(self, seqs: Sequence, parents: Sequence[int]):
        """Beam reordering: sequence ``seqs[i]`` becomes a copy of ``seqs[parents[i]]`` (all as
        they were before the call), sharing its blocks."""
        if len(parents) != len(seqs):
            raise ValueError(f"reorder: {len(parents)} parents for {len(seqs)} sequences")
        if len(set(seqs)) != len(seqs):
            raise ValueError("reorder: a sequence is named twice")
        old = [self._get(s) for s in seqs]
        for p in parents:
            if not 0 <= p < len(seqs):
                raise ValueError(f"reorder: parent index {p} is outside 0..{len(seqs) - 1}")
        new = [old[p].copy() for p in parents]
        for s in new:
            for b in s.blocks:
                self._ref[b] += 1
        for s in old:
            for b in reversed(s.blocks):
                self._release(b)
        for name, s in zip(seqs, new):
            self._seqs[name] = s

    def truncate(self, seq, length: int):
        """Forget the positions of ``seq`` from ``length`` on (speculative rollback); blocks past
        the new end are released."""
        s = self._get(seq)
        if not 0 <= length <= len(s.tokens):
            raise ValueError(f"truncate: length {length} is outside 0..{len(s.tokens)} of sequence {seq!r}")
        keep = self.blocks_for(length)
        for b in reversed(s.blocks[keep:]):
            self._release(b)
        del s.blocks[keep:]
        del s.tokens[length:]
        del s.keys[length // self.block_size:]
        s.computed = min(s.computed, length)
        s.ahead = 0
        if length % self.block_size and self._ref[s.blocks[-1]] == 1:
            self._uncache(s.blocks[-1])  # its tail will be written again: no longer a cached prefix

    def free(self, seq):
        """Release every block of ``seq`` (the tail first, so a cached prefix's head stays longest)."""
        s = self._seqs.pop(self._check(seq))
        for b in reversed(s.blocks):
            self._release(b)

    # ------------------------------------------------------------------ checks
    def check(self):
        """Assert the allocator's invariants (a test aid): reference counts equal the number of
        tables that list each block, a block is free exactly when no table lists it, no table
        lists a block twice, and every table covers its sequence's tokens."""
        count = [0] * self.num_blocks
        for name, s in self._seqs.items():
            assert len(set(s.blocks)) == len(s.blocks), f"sequence {name!r} lists a block twice"
            assert len(s.blocks) == self.blocks_for(len(s.tokens) + s.ahead), \
                f"sequence {name!r}: table and length disagree"
            for b in s.blocks:
                count[b] += 1
        assert count == self._ref, "reference counts differ from the tables"
        for b in range(self.num_blocks):
            assert (b in self._free) == (count[b] == 0), \
                f"block {b}: free {b in self._free}, referenced {count[b]}"
        for entry, (_key, b) in self._cache.items():
            assert self._block_key.get(b) == entry, f"block {b}: prefix cache entries disagree"
        assert len(self._block_key) == len(self._cache)

    # ------------------------------------------------------------------ internals
    def _check(self, seq):
        if seq not in self._seqs:
            raise KeyError(f"unknown sequence {seq!r}")
        return seq

    def _get(self, seq) -> _Seq:
        return self._seqs[self._check(seq)]

    def _lookup(self, tokens: tuple[int, ...]) -> list[int]:
        """Blocks of the longest cached run of full leading blocks within ``tokens[:-1]``."""
        if not self.prefix_caching:
            return []
        bs, prev, hits = self.block_size, 0, []
        for i in range((len(tokens) - 1) // bs):
            found = self._cache.get((prev, tokens[i * bs:(i + 1) * bs]))
            if found is None:
                break
            prev, b = found
            hits.append(b)
        return hits

    def _take(self, b: int):
        if self._ref[b] == 0:
            del self._free[b]
        self._ref[b] += 1

    def _pop_free(self) -> int:
        b, _ = self._free.popitem(last=False)  # the least recently freed
        if b in self._block_key:
            self.evictions += 1  # a cached prefix block, reused for other contents
        self._uncache(b)
        self._ref[b] = 1
        return b

    def _uncache(self, b: int):
        entry = self._block_key.pop(b, None)
        if entry is not None:
            del self._cache[entry]

    def _release(self, b: int):
        self._ref[b] -= 1
        assert self._ref[b] >= 0, f"block {b} released more often than taken"
        if self._ref[b] == 0:
            self._free[b] = None
