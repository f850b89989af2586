"""Constrained generation: regular expressions, JSON schemas and lists of choices as dense
automata that run inside the jitted loops.

A pattern is compiled once, on the host, by **outlines-core** (its ``Index`` over a
``Vocabulary`` of the model's tokens, and its JSON-schema-to-regex function) into a
deterministic automaton over token ids. :class:`Constraint` holds it as three arrays:

- ``table [S, V]`` int32: the state after token ``v`` in state ``s``, -1 where ``v`` is forbidden;
- ``final [S]`` bool: the text so far is in the language;
- ``dist [S]`` int32: the fewest tokens that reach a final state from ``s``.

States from which no final state can be reached are removed. A loop carries one automaton state
per row and allows token ``v`` only if its next state can still reach a final state within the
tokens the row has left (``dist[table[s, v]] <= left - 1``): a started output can always be
finished within ``n``. In a final state a row may stop, with the model's probability of the tokens
it cannot take there (``docs/constrained.md``, The end of an output): masking is not conditioning
(:mod:`jaxdecode.decoding.smc` samples the conditional). Several patterns share one batch
(:func:`stack`, state 0 free for rows without one), in a table padded to a power of two so that a
new pattern of a similar size recompiles nothing.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

INF = 1 << 30
STOP_STREAM = 0x5709  # folded into a row's step key for its stop decision (apart from its token draw)


class ConstraintError(ValueError):
    """A pattern that cannot be used: invalid, unmatchable over the vocabulary, or too long for ``n``."""


def _tokens_of(vocab) -> list[str]:
    """The token strings of a :class:`~jaxdecode.io.vocab.Vocab` or :class:`~jaxdecode.io.vocab.TokenVocab`."""
    tokens = getattr(vocab, "tokens", None)
    return list(tokens) if tokens is not None else list(vocab.chars)


def _missing(pattern: str, chars: set[str]) -> list[str]:
    """What a regular expression names that no token contains: literal characters, and classes
    none of whose characters occur (for error messages only; best effort)."""
    try:
        from re import _parser as sre_parse  # Python >= 3.11
    except ImportError:  # pragma: no cover
        import sre_parse
    out: list[str] = []

    def note(item):
        if item not in out:
            out.append(item)

    def walk(items):
        for op, arg in items:
            name = str(op)
            if name == "LITERAL" and chr(arg) not in chars:
                note(repr(chr(arg)))
            elif name == "IN":
                members = set()
                for kind, value in arg:
                    if str(kind) == "LITERAL":
                        members.add(chr(value))
                    elif str(kind) == "RANGE":
                        members.update(chr(c) for c in range(value[0], value[1] + 1))
                    else:
                        members = None  # negations and categories: not judged here
                        break
                if members is not None and not members & chars:
                    note("any of " + "".join(sorted(members))[:40])
            elif name == "SUBPATTERN":
                walk(arg[-1])
            elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                walk(arg[2])
            elif name == "BRANCH":
                for branch in arg[1]:
                    walk(branch)
            elif name == "ATOMIC_GROUP":
                walk(arg)

    try:
        walk(sre_parse.parse(pattern))
    except Exception:
        pass
    return out


# The most positions a pattern may expand to (:func:`_expanded_size`). outlines-core builds its
# automaton from the pattern with every counted repetition written out, at about 10 KB and 0.1 ms
# a position over a 448-token vocabulary: ``a{100000}`` took 9.5 s and 1.1 GB, and a JSON schema's
# ``"minItems": 1000000000`` ran the process out of memory. A JSON object of any shape is 1,611
# positions; an array of 5 to 10 of them, 8,002.
MAX_PATTERN_SIZE = 50_000


def _expanded_size(pattern: str) -> int:
    """How many positions a regular expression has with every counted repetition written out:
    ``x{m,n}`` counts ``x`` n times, ``x{m,}`` m + 1 times (what the automaton builder expands)."""
    from re import _parser as sre_parse

    def size(items) -> int:
        total = 0
        for op, arg in items:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                low, high, sub = arg
                total += size(sub) * max(1, low + 1 if high == sre_parse.MAXREPEAT else high)
            elif name == "SUBPATTERN":
                total += size(arg[-1])
            elif name == "BRANCH":
                total += sum(size(b) for b in arg[1])
            elif name == "ATOMIC_GROUP":
                total += size(arg)
            elif name in ("ASSERT", "ASSERT_NOT"):
                total += size(arg[1])
            else:
                total += 1
        return total

    return size(sre_parse.parse(pattern))


@dataclasses.dataclass(frozen=True, eq=False)
class Constraint:
    """A compiled pattern over a vocabulary of ``V`` tokens (see the module docstring)."""

    pattern: str  # the regular expression
    kind: str  # "regex", "choice" or "json-schema"
    table: np.ndarray  # [S, V] int32, state 0 initial
    final: np.ndarray  # [S] bool
    dist: np.ndarray  # [S] int32
    end_tokens: tuple = ()  # the model's end tokens: allowed in final states only, where they stop a row

    @property
    def eos_stop(self) -> bool:
        """Whether a row stops by generating an end token (a model with one) instead of the
        character model's leftover-mass rule."""
        return bool(self.end_tokens)

    @property
    def states(self) -> int:
        return self.table.shape[0]

    @property
    def V(self) -> int:
        return self.table.shape[1]

    @property
    def min_tokens(self) -> int:
        """The fewest tokens of any output in the language."""
        return int(self.dist[0])

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + self.final.nbytes + self.dist.nbytes

    def walk(self, tokens) -> int:
        """The state after ``tokens`` from the initial state, -1 once a token is forbidden."""
        s = 0
        for t in np.asarray(tokens).reshape(-1):
            s = int(self.table[s, int(t)])
            if s < 0:
                return -1
        return s

    def accepts(self, tokens) -> bool:
        """Whether ``tokens`` spell a string of the language."""
        s = self.walk(tokens)
        return s >= 0 and bool(self.final[s])

    def check_budget(self, n: int) -> None:
        if n < self.min_tokens:
            raise ConstraintError(f"-n {n} is too small for the pattern {self.pattern!r}: its shortest "
                                  f"match takes {self.min_tokens} tokens")


def compile_regex(pattern: str, vocab, kind: str = "regex") -> Constraint:
    """Compile ``pattern`` (Python / Rust ``regex`` syntax, matched in full) over ``vocab``."""
    from outlines_core import Index, Vocabulary

    if not isinstance(pattern, str) or not pattern:
        raise ConstraintError("the pattern is empty")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ConstraintError(f"invalid regular expression {pattern!r}: {e}") from None
    size = _expanded_size(pattern)
    if size > MAX_PATTERN_SIZE:
        raise ConstraintError(f"the pattern is too large to compile: its counted repetitions ({{n}}, or a JSON "
                              f"schema's maxLength, minItems, maxItems...) expand it to {size} positions, more "
                              f"than {MAX_PATTERN_SIZE}")
    if getattr(vocab, "subword", False):
        return _compile_bytes(pattern, vocab, kind)
    tokens = _tokens_of(vocab)
    V = len(tokens)
    missing = _missing(pattern, set("".join(tokens)))
    # The pattern is anchored at both ends by outlines-core only with a trailing "$" (without it
    # the index drops every transition that leaves a final state for a non-final one: ``(ab)+``
    # would accept only "ab"), and with "$" it refuses a pattern that matches the empty string.
    # A sentinel token that no text contains goes in front: the state after it is the start.
    used = set("".join(tokens))
    sentinel = next(chr(c) for c in [*range(1, 32), *range(0xE000, 0xF900)] if chr(c) not in used)
    mapping = {t: [i] for i, t in enumerate(tokens)}
    mapping[sentinel] = [V + 1]
    try:
        index = Index(f"{re.escape(sentinel)}(?:{pattern})$", Vocabulary(V, mapping))
    except ValueError as e:
        text = str(e)
        if "incompatible" in text or "no transitions" in text.lower():
            found = re.search(r"characters: \[(.*)\]", text)
            named = ", ".join(missing) if missing else found.group(1) if found else "?"
            raise ConstraintError(f"no string over the model's vocabulary matches {pattern!r}: the "
                                  f"vocabulary lacks the characters {named}") from None
        raise ConstraintError(f"cannot compile {pattern!r}: {text}") from None

    return _from_index(index, V, V + 1, pattern, kind, missing)


def _compile_bytes(pattern: str, vocab, kind: str) -> Constraint:
    """A subword vocabulary: each token matched as the bytes it stands for (byte-level BPE tokens
    may hold part of a multi-byte character), special tokens excluded; the model's end tokens are
    allowed in final states, where generating one ends the row."""
    from outlines_core import Index, Vocabulary

    V = len(vocab)
    special = set(getattr(vocab, "special", ()))
    ends = tuple(int(e) for e in getattr(vocab, "eos_ids", ()))
    mapping: dict[bytes, list[int]] = {}
    for i in range(V):
        b = vocab.token_bytes(i)
        if b and i not in special and i not in ends:
            mapping.setdefault(b, []).append(i)
    sentinel = "\ue000\uf8ff\ue001"
    mapping.setdefault(sentinel.encode("utf-8"), []).append(V + 1)
    try:
        index = Index(f"{re.escape(sentinel)}(?:{pattern})$", Vocabulary(V, mapping))
    except ValueError as e:
        text = str(e)
        if "incompatible" in text or "no transitions" in text.lower():
            raise ConstraintError(f"no string over the model's vocabulary matches {pattern!r}") from None
        raise ConstraintError(f"cannot compile {pattern!r}: {text}") from None
    c = _from_index(index, V, V + 1, pattern, kind, [])
    if not ends:
        return c
    table = c.table.copy()
    for e in ends:  # an end token keeps a final state (the row stops there) and is forbidden elsewhere
        table[:, e] = np.where(c.final, np.arange(c.states), -1)
    return dataclasses.replace(c, table=table, end_tokens=ends)


def _from_index(index, V: int, sentinel_id: int, pattern: str, kind: str, missing) -> Constraint:
    """The dense automaton of an outlines-core index, from the state after the sentinel token."""
    transitions = index.get_transitions()
    finals = set(index.get_final_states())
    start = index.get_next_state(index.get_initial_state(), sentinel_id)
    # number the states breadth-first from the initial one, skipping the end token (id V)
    order, seen = [start], {start: 0}
    for s in order:
        for t, nxt in sorted(transitions.get(s, {}).items()):
            if t < V and nxt not in seen:
                seen[nxt] = len(order)
                order.append(nxt)
    S = len(order)
    table = np.full((S, V), -1, np.int64)
    for s in order:
        for t, nxt in transitions.get(s, {}).items():
            if t < V:
                table[seen[s], t] = seen[nxt]
    final = np.array([s in finals for s in order], bool)
    dist = _distance_to_final(table, final)
    if dist[0] >= INF:
        lack = f": the vocabulary lacks the characters {', '.join(missing)}" if missing else ""
        raise ConstraintError(f"no string over the model's vocabulary matches {pattern!r}{lack}")
    # forbid every token that leads where no final state can be reached, then drop those states
    live = dist < INF
    table = np.where((table >= 0) & live[np.maximum(table, 0)], table, -1)
    keep = np.flatnonzero(live)
    renumber = np.full(S, -1, np.int64)
    renumber[keep] = np.arange(len(keep))
    table = np.where(table >= 0, renumber[np.maximum(table, 0)], -1)[keep]
    return Constraint(pattern, kind, table.astype(np.int32), final[keep], dist[keep].astype(np.int32))


def _distance_to_final(table: np.ndarray, final: np.ndarray) -> np.ndarray:
    """Fewest tokens from each state to a final state (breadth-first over reversed edges)."""
    S = table.shape[0]
    parents: list[list[int]] = [[] for _ in range(S)]
    for s, t in zip(*np.nonzero(table >= 0)):
        parents[table[s, t]].append(s)
    dist = np.full(S, INF, np.int64)
    queue = deque(np.flatnonzero(final).tolist())
    dist[list(queue)] = 0
    while queue:
        s = queue.popleft()
        for p in parents[s]:
            if dist[p] == INF:
                dist[p] = dist[s] + 1
                queue.append(p)
    return dist


def compile_choices(options: Sequence[str], vocab) -> Constraint:
    """One of ``options`` exactly."""
    options = list(options)
    if not options or any(not isinstance(o, str) or not o for o in options):
        raise ConstraintError("give at least one choice, each a non-empty string")
    return compile_regex("|".join(f"(?:{re.escape(o)})" for o in options), vocab, kind="choice")


def compile_json_schema(schema: str | dict, vocab) -> Constraint:
    """JSON text that satisfies ``schema`` (through outlines-core's schema-to-regex function)."""
    from outlines_core.json_schema import build_regex_from_schema

    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        json.loads(text)
        pattern = build_regex_from_schema(text)
    except (ValueError, TypeError) as e:
        raise ConstraintError(f"invalid JSON schema: {e}") from None
    return compile_regex(pattern, vocab, kind="json-schema")


# ----------------------------------------------------------------------------- on the device


class Automaton(NamedTuple):
    """Several constraints in one table (a traced argument of the loops); state 0 is free."""

    table: jax.Array  # [S, V] int32
    final: jax.Array  # [S] bool
    dist: jax.Array  # [S] int32
    leftover: jax.Array  # [S] bool: a final state stops with the leftover mass (no end token)
    end: jax.Array  # [V] bool: the model's end tokens (generating one in a final state is the stop)


def stack(constraints: Sequence[Constraint | None], V: int) -> tuple[Automaton, np.ndarray]:
    """One automaton for a batch whose row ``i`` follows ``constraints[i]`` (None: free), and
    each row's initial state. Identical constraint objects share their states."""
    tables, finals, dists = [np.zeros((1, V), np.int32)], [np.ones(1, bool)], [np.zeros(1, np.int32)]
    leftovers = [np.ones(1, bool)]
    offsets: dict[int, int] = {}
    starts = np.zeros(len(constraints), np.int32)
    at = 1
    for i, c in enumerate(constraints):
        if c is None:
            continue
        if c.V != V:
            raise ConstraintError(f"the constraint was compiled for {c.V} tokens, the model has {V}")
        if id(c) not in offsets:
            offsets[id(c)] = at
            tables.append(np.where(c.table >= 0, c.table + at, -1).astype(np.int32))
            finals.append(c.final)
            dists.append(c.dist)
            leftovers.append(np.full(c.states, not c.eos_stop))
            at += c.states
        starts[i] = offsets[id(c)]
    S = 1 << max(0, (at - 1).bit_length())
    table = np.full((S, V), -1, np.int32)
    table[:at] = np.concatenate(tables)
    final = np.zeros(S, bool)
    final[:at] = np.concatenate(finals)
    dist = np.full(S, INF, np.int32)
    dist[:at] = np.concatenate(dists)
    leftover = np.ones(S, bool)
    leftover[:at] = np.concatenate(leftovers)
    end = np.zeros(V, bool)
    for c in constraints:
        if c is not None:
            end[list(c.end_tokens)] = True
    return (Automaton(jnp.asarray(table), jnp.asarray(final), jnp.asarray(dist), jnp.asarray(leftover),
                      jnp.asarray(end)), starts)


def for_rows(constraint, B: int, Bb: int, V: int, n: int):
    """A loop's constraint arguments for ``B`` rows bucketed to ``Bb``: ``constraint`` is one
    :class:`Constraint` for every row, or a sequence with one per row (None: unconstrained).
    Returns ``(automaton, initial states [Bb], budget [Bb])``, or ``(None, None, None)``."""
    if constraint is None:
        return None, None, None
    per_row = [constraint] * B if isinstance(constraint, Constraint) else list(constraint)
    if len(per_row) != B:
        raise ConstraintError(f"give one constraint per row ({B}), got {len(per_row)}")
    for c in per_row:
        if c is not None and not isinstance(c, Constraint):
            raise ConstraintError(f"a constraint must be a compiled Constraint or None, got {type(c).__name__}")
        if c is not None:
            c.check_budget(n)
    if all(c is None for c in per_row):
        return None, None, None
    auto, starts = stack(per_row + [None] * (Bb - B), V)
    return auto, jnp.asarray(starts), jnp.full((Bb,), n, jnp.int32)


def per_sample(constraint, prompts: int, num_samples: int):
    """A text entry point's ``constraint`` (one for all, or one per prompt) for its rows
    (prompt-major, ``num_samples`` each)."""
    if constraint is None or isinstance(constraint, Constraint):
        return constraint
    constraint = list(constraint)
    if len(constraint) != prompts:
        raise ConstraintError(f"give one constraint per prompt ({prompts}), got {len(constraint)}")
    return [c for c in constraint for _ in range(num_samples)]


def allowed(auto: Automaton, state, left):
    """``[B, V]`` bool: the tokens each row may take in ``state`` ``[B]`` with ``left`` ``[B]``
    tokens left (this one included), and their next states ``[B, V]``."""
    nxt = auto.table[state]
    ok = (nxt >= 0) & (auto.dist[jnp.maximum(nxt, 0)] <= (left - 1)[:, None])
    return ok, nxt


def stop_probability(auto: Automaton, state, logits, ok):
    """``[B]``: the model's probability of stopping in ``state``: the mass of the tokens the row
    cannot take if the state is final (1 when it can take none), else 0."""
    p = jax.nn.softmax(logits, axis=-1)
    blocked = jnp.sum(jnp.where(ok, 0.0, p), axis=-1)
    none = ~jnp.any(ok, axis=-1)
    return jnp.where(auto.final[state] & auto.leftover[state], jnp.where(none, 1.0, blocked), 0.0)


def mask(logits, ok):
    """``logits`` with forbidden tokens at -inf (unchanged for a row that may take none)."""
    return jnp.where(ok | ~jnp.any(ok, axis=-1, keepdims=True), logits, -jnp.inf)


def draft_states(auto: Automaton, state, drafts):
    """``[B, G+1]``: the automaton state before each of ``G`` proposed tokens ``drafts [B, G]``
    and after the last, from ``state`` ``[B]``; -1 from the first token the pattern forbids."""
    def walk(s, d):
        nxt = jnp.where(s < 0, -1, auto.table[jnp.maximum(s, 0), d])
        return nxt, s

    last, before = jax.lax.scan(walk, state, drafts.T)
    return jnp.concatenate([before.T, last[:, None]], axis=1)


def extended_target(auto: Automaton, states, left, logits, process, greedy: bool):
    """The distribution a constrained step draws from, over ``V + 1`` choices (index ``V``:
    stop), at each of ``S`` positions: ``states``, ``left`` ``[B, S]``, raw ``logits``
    ``[B, S, V]``, ``process`` the rule over ``[B, S, V]``. Sampling: ``p(stop) = s`` and
    ``p(v) = (1 - s) * softmax(process(masked logits))[v]``; greedy: a point mass on the choice
    :func:`jaxdecode.decoding.sampling` makes. Returns probabilities ``[B, S, V+1]`` and their logs. A
    position off the language (state -1) stops with probability 1."""
    B, S, V = logits.shape
    flat = lambda a: a.reshape((B * S,) + a.shape[2:])
    st, lf, lg = flat(states), flat(left), flat(logits)
    ok, _ = allowed(auto, jnp.maximum(st, 0), lf)
    ok = ok & (st >= 0)[:, None]
    p_stop = jnp.where(st >= 0, stop_probability(auto, jnp.maximum(st, 0), lg, ok), 1.0)
    processed = process(mask(lg, ok).reshape(B, S, V)).reshape(B * S, V)
    if greedy:
        best = jnp.max(jnp.where(ok, jax.nn.softmax(lg, axis=-1), 0.0), axis=-1)
        choice = jnp.where(p_stop > best, V, jnp.argmax(processed, axis=-1))
        p = jax.nn.one_hot(choice, V + 1)
    else:
        p_tok = jax.nn.softmax(processed, axis=-1) * (1.0 - p_stop)[:, None]
        p = jnp.concatenate([jnp.where(ok, p_tok, 0.0), p_stop[:, None]], axis=-1)
    logp = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)
    return p.reshape(B, S, V + 1), logp.reshape(B, S, V + 1)


__all__ = ["Automaton", "Constraint", "ConstraintError", "allowed", "for_rows", "compile_choices", "compile_json_schema",
           "compile_regex", "draft_states", "extended_target", "mask", "stack", "stop_probability"]
