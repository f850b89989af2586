"""Stop strings and end tokens as one automaton over tokens, carried per row on the device.

A row must end at the step its text completes a stop string, however the model spelled it: a
byte-level BPE vocabulary spells ``"\\nB"`` as ``["\\n", "B"]``, ``["\\nB"]`` or with the ``"B"``
inside a longer token (``"\\nBy"``), and a multi-byte character may be split over tokens. So the
stop strings are matched on bytes: an Aho–Corasick automaton over the UTF-8 bytes of every stop
string (:func:`aho_corasick`), lifted to tokens by running each token's bytes through it
(:func:`byte_stop_automaton`). The result is a table ``[S, V]`` (the state after each token from
each state) and an accepting mask ``[S]``: a row carries one ``int32`` state, ``state =
table[state, token]`` after each token, and the row has stopped once ``accept[state]``. A
token whose bytes complete a stop string anywhere inside it leads to the accepting state, which
is absorbing; the model's end tokens lead there too (they have no text), so one lookup covers
both ways a row ends. A character vocabulary is the trivial case (a token is a character).

The bytes of a string of valid UTF-8 occur in a byte stream exactly where the string occurs in
the stream's text (UTF-8 is self-synchronizing, and a lossy decoder restarts at the byte after a
bad one), so the step at which the accepting state is reached is the step at which the decoded
text first contains a stop string: :func:`jaxdecode.decoding.common.finish_text` finds the same
tokens on the host.

The state count is padded to a power of two (at least :data:`MIN_STATES`), so new stop strings
of similar lengths reuse the loops' compiled programs. Token sequences (``stops=[array, ...]``)
get the same kind of automaton over token ids (:func:`as_automaton`). On the host,
:meth:`StopAutomaton.step` advances one row and :meth:`StopAutomaton.first_hit` finds a stop.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MIN_STATES = 8
MAX_TABLE_BYTES = 1 << 30  # a table larger than this is refused (too many stop strings for the vocabulary)


class StopTable(NamedTuple):
    """The device form of a :class:`StopAutomaton` (a traced argument of the loops)."""

    table: jax.Array  # [S, V] int32: the state after each token from each state
    accept: jax.Array  # [S] bool: the row has stopped


@dataclasses.dataclass(frozen=True, eq=False)
class StopAutomaton:
    """Stop strings (or token sequences) and end tokens over a vocabulary of ``V`` tokens; state
    0 is the start (nothing generated yet)."""

    table: np.ndarray  # [S, V] int32, S a power of two
    accept: np.ndarray  # [S] bool
    strings: tuple[str, ...] = ()  # the stop strings (empty for token sequences)
    ends: tuple[int, ...] = ()  # the end tokens that lead to the accepting state

    start = 0

    @property
    def states(self) -> int:
        return self.table.shape[0]

    @property
    def V(self) -> int:
        return self.table.shape[1]

    def step(self, state: int, token: int) -> int:
        """The state after ``token``."""
        return int(self.table[state, int(token)])

    def hit(self, state: int) -> bool:
        """Whether a row in ``state`` has stopped."""
        return bool(self.accept[state])

    def first_hit(self, tokens, state: int = 0) -> int:
        """How many of ``tokens`` a row keeps: up to and including the first token at which it
        stops, or -1 when it does not stop."""
        for i, t in enumerate(np.asarray(tokens).reshape(-1).tolist()):
            state = int(self.table[state, t])
            if self.accept[state]:
                return i + 1
        return -1

    def device(self) -> StopTable:
        """The table and mask as device arrays (made once per automaton)."""
        dev = self.__dict__.get("_device")
        if dev is None:
            dev = StopTable(jnp.asarray(self.table), jnp.asarray(self.accept))
            object.__setattr__(self, "_device", dev)
        return dev


def aho_corasick(patterns: Sequence[Sequence[int]], A: int) -> tuple[np.ndarray, int]:
    """The Aho–Corasick automaton of ``patterns`` (non-empty sequences over symbols ``0..A-1``) as
    a complete table ``[n, A]`` from state 0; every state where a pattern ends is merged into one
    absorbing state, returned with the table (the last)."""
    goto: list[dict[int, int]] = [{}]
    out = [False]
    for p in patterns:
        if len(p) == 0:
            raise ValueError("a stop string must not be empty")
        s = 0
        for c in p:
            c = int(c)
            if not 0 <= c < A:
                raise ValueError(f"a stop sequence's symbols must lie in [0, {A}), got {c}")
            if c not in goto[s]:
                goto[s][c] = len(goto)
                goto.append({})
                out.append(False)
            s = goto[s][c]
        out[s] = True
    n = len(goto)
    delta = np.zeros((n, A), np.int32)
    fail = np.zeros(n, np.int64)
    for c, t in goto[0].items():
        delta[0, c] = t
    queue = deque(goto[0].values())
    while queue:  # breadth first: a state's failure state is shallower, so its row is done
        s = queue.popleft()
        out[s] = out[s] or out[fail[s]]
        delta[s] = delta[fail[s]]
        for c, t in goto[s].items():
            fail[t] = delta[fail[s], c]
            delta[s, c] = t
            queue.append(t)
    keep = np.flatnonzero(~np.asarray(out))  # the root first (patterns are non-empty)
    done = len(keep)
    renumber = np.full(n, done, np.int32)
    renumber[keep] = np.arange(done, dtype=np.int32)
    table = np.concatenate([renumber[delta[keep]], np.full((1, A), done, np.int32)])
    return table, done


def _pad(table: np.ndarray, done: int) -> tuple[np.ndarray, np.ndarray]:
    """The table padded to a power of two states (unreachable rows to the start) and its mask."""
    n, V = table.shape
    S = max(MIN_STATES, 1 << max(0, (n - 1).bit_length()))
    if S * V * 4 > MAX_TABLE_BYTES:
        raise ValueError(f"the stop strings need an automaton of {n} states over {V} tokens "
                         f"({S * V * 4 / 2**30:.1f} GiB): give fewer or shorter stop strings")
    out = np.zeros((S, V), np.int32)
    out[:n] = table
    accept = np.zeros(S, bool)
    accept[done] = True
    return out, accept


def token_bytes(vocab) -> list[bytes]:
    """The bytes each token of ``vocab`` stands for in generated text (a subword tokenizer's
    ``token_bytes``, else each token's characters in UTF-8)."""
    if hasattr(vocab, "token_bytes"):
        return [vocab.token_bytes(i) for i in range(len(vocab))]
    return [t.encode("utf-8") for t in vocab.chars]


def _lift(delta: np.ndarray, done: int, pieces: list[bytes], pattern_bytes: bytes) -> np.ndarray:
    """The token table ``[n, V]``: each state's walk through each token's bytes (the accepting
    state absorbs, so a stop string completed inside a token is kept)."""
    n, V = delta.shape[0], len(pieces)
    table = np.zeros((n, V), np.int32)  # a token without a byte of any pattern goes to the start
    others = bytes(sorted(set(range(256)) - set(pattern_bytes)))
    relevant = [i for i, b in enumerate(pieces) if b.translate(None, others)]
    empty = [i for i, b in enumerate(pieces) if not b]  # no text: the state stays
    table[:, empty] = np.arange(n, dtype=np.int32)[:, None]
    if relevant:
        relevant.sort(key=lambda i: -len(pieces[i]))
        lens = np.array([len(pieces[i]) for i in relevant])
        M = np.zeros((len(relevant), int(lens[0])), np.uint8)
        for j, i in enumerate(relevant):
            M[j, :lens[j]] = np.frombuffer(pieces[i], np.uint8)
        cur = np.repeat(np.arange(n, dtype=np.int32)[:, None], len(relevant), axis=1)  # [n, R]
        for j in range(int(lens[0])):
            m = int(np.sum(lens > j))  # the tokens longer than j come first
            cur[:, :m] = delta[cur[:, :m], M[None, :m, j]]
        table[:, relevant] = cur
    table[done] = done
    return table


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # vocab -> {key: automaton}


def byte_stop_automaton(vocab, strings: Sequence[str], ends: Sequence[int] = ()) -> StopAutomaton:
    """The automaton that stops a row whose text contains one of ``strings`` (matched on the
    UTF-8 bytes of each token of ``vocab``) or that generates one of the end tokens ``ends``.
    Cached per vocabulary."""
    strings, ends = tuple(strings), tuple(sorted({int(e) for e in ends}))
    key = (strings, ends)
    try:
        per_vocab = _CACHE.setdefault(vocab, {})
    except TypeError:  # not weakly referable: no cache
        per_vocab = {}
    if key in per_vocab:
        return per_vocab[key]
    from jaxdecode.decoding.common import stop_string_list

    encoded = [s.encode("utf-8") for s in stop_string_list(list(strings))]
    delta, done = aho_corasick(encoded, 256)
    pieces = per_vocab.get("token bytes")
    if pieces is None:
        pieces = per_vocab["token bytes"] = token_bytes(vocab)
    table = _lift(delta, done, pieces, b"".join(encoded))
    V = len(pieces)
    for e in ends:
        if not 0 <= e < V:
            raise ValueError(f"end token {e} lies outside the vocabulary of {V}")
        table[:, e] = done
    out = StopAutomaton(*_pad(table, done), strings=strings, ends=ends)
    if len(per_vocab) > 16:  # the token bytes and the 16 latest automata
        per_vocab.pop(next(k for k in per_vocab if k != "token bytes"))
    per_vocab[key] = out
    return out


def token_stop_automaton(sequences: Sequence[Sequence[int]], V: int) -> StopAutomaton:
    """The automaton that stops a row once it generates one of the token ``sequences``."""
    seqs = [np.asarray(s).reshape(-1) for s in sequences]
    for s in seqs:
        if s.size and not np.issubdtype(s.dtype, np.integer):
            raise ValueError(f"a stop sequence must hold token ids, got dtype {s.dtype}")
    table, done = aho_corasick([s.tolist() for s in seqs], V)
    ends = tuple(int(s[0]) for s in seqs if len(s) == 1)
    return StopAutomaton(*_pad(table, done), ends=ends)


def as_automaton(stops, V: int) -> StopAutomaton | None:
    """A loop's ``stops`` argument as an automaton: a :class:`StopAutomaton` as it is, token
    sequences through :func:`token_stop_automaton`; None for no stops."""
    if stops is None:
        return None
    if isinstance(stops, StopAutomaton):
        if stops.V != V:
            raise ValueError(f"the stop automaton was built for {stops.V} tokens, the model has {V}")
        return stops
    stops = list(stops)
    return token_stop_automaton(stops, V) if stops else None


def stop_automaton(lm, stop: str | Sequence[str] | None) -> StopAutomaton | None:
    """The automaton of a loaded model's request: its stop strings, matched on the text however
    tokenized, and the model's end tokens; None when there are neither."""
    from jaxdecode.decoding.common import stop_string_list

    strings = stop_string_list(stop)
    ends = tuple(getattr(lm, "eos_ids", ()))
    if not strings and not ends:
        return None
    return byte_stop_automaton(lm.vocab, strings, ends)


def advance(stops: StopTable | None, state, token):
    """On the device: each row's state after ``token`` ``[B]``, and whether it has stopped."""
    if stops is None:
        return state, jnp.zeros(state.shape, bool)
    state = stops.table[state, token]
    return state, stops.accept[state]


def stops_after(stops: StopTable, state):
    """On the device: ``[B, V]`` bools, whether appending each token stops the row (beam search)."""
    return stops.accept[stops.table[state]]


__all__ = ["StopAutomaton", "StopTable", "aho_corasick", "advance", "as_automaton", "byte_stop_automaton",
           "stop_automaton", "stops_after", "token_bytes", "token_stop_automaton"]
