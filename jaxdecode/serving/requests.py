"""The engine's requests and rows, and how rule chains of different requests share one batch
(the layout of rule kinds and their neutral settings): see :mod:`jaxdecode.serving.engine`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxdecode.rules import Chain, Rule
from jaxdecode.rules import penalties as _pen
from jaxdecode.rules import truncation as _trunc


# ----------------------------------------------------------------------------- requests


@dataclasses.dataclass(eq=False)
class Request:
    """One request: ``num_samples`` continuations of ``n`` tokens after ``prompt``.

    ``seed``: sample ``j`` is drawn with ``PRNGKey(seed)`` and row id ``j`` (as
    :func:`jaxdecode.generate`). ``rule``: a :mod:`jaxdecode.rules` rule or chain, or None; its
    settings are scalars or one per sample (``[num_samples]``). ``greedy``: the argmax of the
    processed logits. ``stop``: a string or strings ending a sample once generated (included in
    its text). ``arrival``: seconds after the start of :meth:`Engine.run`. ``prompt`` may also be
    token ids. ``top_logprobs``: for each generated token, the model's ``top_logprobs`` most
    probable tokens and their log-probabilities (at most :data:`TOP_LOGPROBS`). ``ignore_eos``:
    the model's end tokens do not end a sample.
    """

    prompt: str | Sequence[int]
    n: int
    seed: int = 0
    num_samples: int = 1
    rule: Any = None
    greedy: bool = False
    stop: str | Sequence[str] | None = None
    arrival: float = 0.0
    top_logprobs: int = 0
    ignore_eos: bool = False
    constraint: Any = None  # a jaxdecode.constraints.Constraint every sample's text must match


TOP_LOGPROBS = 20  # the most top log-probabilities a request may ask for (OpenAI's limit)


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
    leader: tuple | None = None  # paged cache: the sequence whose blocks its prompt is written into
    tokens: list = dataclasses.field(default_factory=list)
    pending: int = 0  # tokens chosen in device calls whose results the engine has not read yet
    mlp: list = dataclasses.field(default_factory=list)
    slp: list = dataclasses.field(default_factory=list)
    finish: str | None = None
    t_first: float | None = None
    t_done: float | None = None
    top_k: int = 0  # top log-probabilities asked for
    top: list = dataclasses.field(default_factory=list)  # per token: (ids, logprobs) [TOP_LOGPROBS]
    watch: Any = None  # a subword row's stop-string check on its text (stream.StopWatch), or None

    @property
    def length(self) -> int:
        """Positions of this row in its slot's cache."""
        return self.prefilled + len(self.tokens)

    @property
    def seq(self) -> tuple:
        """Its sequence name in a paged engine's block allocator."""
        return (self.req, self.j)


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


def best_layout(line, current, V: int) -> tuple:
    """Of the chains of the rows in ``line`` (and the ``current`` layout, if any) that the first
    row fits, the one that most of them fit (the current layout first, then the earliest, on ties)."""
    candidates = ([] if current is None else [current]) + [r.parts for r in line]
    candidates = [c for c in candidates if _embed(line[0].parts, c, V) is not None]
    return max(candidates, key=lambda c: sum(_embed(r.parts, c, V) is not None for r in line))


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
