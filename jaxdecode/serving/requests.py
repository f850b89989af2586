"""The engine's requests and rows, and how rule chains of different requests share one batch
(the layout of rule kinds and their neutral settings): see :mod:`jaxdecode.serving.engine`."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxdecode import constraints as C
from jaxdecode.decoding.common import encode_stop_strings, sample_keys, stop_string_list
from jaxdecode.decoding.params import (  # noqa: F401 (re-exported)
    DEFAULTS, ENGINE, TOP_LOGPROBS, DecodeParams, with_controls)
from jaxdecode.rules import REGISTRY, Chain, Rule
from jaxdecode.serving.stream import stop_watch

# ----------------------------------------------------------------------------- requests


@dataclasses.dataclass(eq=False)
class Request:
    """One request: ``num_samples`` continuations of up to ``n`` tokens after ``prompt``.

    ``params``: the request's :class:`~jaxdecode.decoding.params.DecodeParams`; the other fields,
    where given, override it (a field left at None takes the value of ``params``, or its
    default). ``seed``: sample ``j`` is drawn with ``PRNGKey(seed)`` and row id ``j`` (as
    :func:`jaxdecode.generate`). ``rule``: a :mod:`jaxdecode.rules` rule or chain (``params``'
    named settings otherwise make one); its settings are scalars or one per sample
    (``[num_samples]``). ``greedy``: the argmax of the processed logits. ``stop``: a string or
    strings ending a sample once generated (included in its text); ``params.stop_token_ids`` end
    one too. ``arrival``: seconds after the start of :meth:`Engine.run`. ``prompt`` may also be
    token ids. ``top_logprobs``: for each generated token, the model's ``top_logprobs`` most
    probable tokens and their log-probabilities (at most :data:`TOP_LOGPROBS`). ``ignore_eos``:
    the model's end tokens do not end a sample. ``constraint``: a compiled
    :class:`~jaxdecode.constraints.Constraint` (:func:`~jaxdecode.constraints.compile_regex`,
    ``compile_choices``, ``compile_json_schema``) every sample's text follows, ending where the
    pattern lets it as in :func:`jaxdecode.generate` (not with ``ignore_eos`` on a model whose end
    token ends the pattern's text). The settings are checked when the engine takes the request.
    """

    prompt: str | Sequence[int]
    n: int | None = None
    seed: int | None = None
    num_samples: int | None = None
    rule: Any = None
    greedy: bool | None = None
    stop: str | Sequence[str] | None = None
    arrival: float = 0.0
    top_logprobs: int | None = None
    ignore_eos: bool | None = None
    constraint: Any = None  # a jaxdecode.constraints.Constraint every sample's text must match
    params: DecodeParams | None = None

    def __post_init__(self):
        # the fields given override params; the others show its values. A setting that does not
        # check is kept as given and refused, with the request's number, when the engine takes it.
        base = DEFAULTS if self.params is None else self.params
        given = {name: getattr(self, name) for name in _SHARED if getattr(self, name) is not None}
        if not isinstance(base, DecodeParams):
            self._invalid = TypeError(f"params must be a DecodeParams, got {type(base).__name__}")
            base = DEFAULTS
        else:
            try:
                self.params, self._invalid = base.replace(**_as_params(given)), None
            except (ValueError, TypeError) as e:
                self._invalid = e
        for name in _SHARED:
            if getattr(self, name) is None:
                setattr(self, name, getattr(base, _AS.get(name, name)))


_SHARED = ("n", "seed", "num_samples", "rule", "greedy", "stop", "top_logprobs", "ignore_eos", "constraint")
_AS = {"rule": "chain"}  # Request's name of a DecodeParams field


def _as_params(fields: dict) -> dict:
    return {_AS.get(k, k): v for k, v in fields.items()}




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
    source: int | None = None  # dense cache: the slot its first piece continues (a reused prefix), until it runs
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
    constraint: Any = None  # its request's jaxdecode.constraints.Constraint, or None
    passes: int = 0  # a speculative engine's passes for it (the pass number of its noise)
    draft_at: int = -1  # a speculative engine: the context length its slot's draft state is for

    @property
    def length(self) -> int:
        """Positions of this row in its slot's cache."""
        return self.prefilled + len(self.tokens)

    @property
    def seq(self) -> tuple:
        """Its sequence name in a paged engine's block allocator."""
        return (self.req, self.j)


def make_rows(engine, r: Request, i: int) -> list:
    """The rows of request ``i`` for ``engine`` (an :class:`~jaxdecode.serving.engine.Engine`),
    checked; nothing is queued."""
    if not isinstance(r, Request):
        raise ValueError(f"request {i}: expected a Request, got {type(r).__name__}")
    if r._invalid is not None:
        raise type(r._invalid)(f"request {i}: {r._invalid}")
    try:
        p = r.params.check_for(ENGINE)
    except ValueError as e:
        raise type(e)(f"request {i}: {e}") from None
    n, N = p.n, p.num_samples
    if isinstance(r.arrival, bool) or not isinstance(r.arrival, (int, float, np.integer, np.floating)) \
            or not math.isfinite(r.arrival) or r.arrival < 0:
        raise ValueError(f"request {i}: arrival must be a finite time >= 0 seconds, got {r.arrival!r}")
    top_k = p.top_logprobs
    _check_constraint(p.constraint, n, engine.V, p.ignore_eos, i)
    try:
        prompt = prompt_tokens(engine.lm, engine.V, r.prompt)
        stops = encode_stop_strings(engine.lm, p.stop)
        if p.ignore_eos:
            stops = stops[:len(stops) - len(getattr(engine.lm, "end_stops", []))]
        for t in p.stop_token_ids:
            if t >= engine.V:
                raise ValueError(f"the stop token id {t} lies outside the vocabulary of {engine.V}")
            stops.append(np.asarray([t], np.int32))
        keys, row_ids = sample_keys(1, N, p.seed)
        parts = rule_parts(with_controls(engine.lm, p, p.rule()))
    except ValueError as e:
        raise ValueError(f"request {i}: {e}") from None
    if len(prompt) + n > engine.T:
        raise ValueError(f"request {i}: prompt ({len(prompt)} tokens) + n ({n}) = {len(prompt) + n} exceeds "
                         f"the model window T = {engine.T}; the engine keeps every row within the window "
                         f"(jaxdecode.generate serves longer requests in its exact window mode)")
    if getattr(engine, "speculative", False):
        _check_speculative(engine, p, prompt, parts, i)
    if engine.paged and n > 0:
        a = engine.allocator
        need = a.blocks_for(len(prompt) + n - 1)
        if need > a.num_blocks:
            raise ValueError(f"request {i}: prompt ({len(prompt)} tokens) + n ({n}) needs {need} blocks of "
                             f"{a.block_size} positions per sample, more than the whole pool of "
                             f"{a.num_blocks} blocks: it could never be served")
    if engine._pinned and embed_in_layout(parts, engine._layout, engine.V) is None:
        raise ValueError(f"request {i}: its rule chain ({_kinds_text(parts)}) does not fit the engine's "
                         f"layout ({_kinds_text(engine._layout)}): it must be the layout with parts "
                         f"left out, and only parts with a neutral setting may be left out")
    keys = np.asarray(keys, np.uint32)
    texts = stop_string_list(p.stop)
    return [_Row(i, int(j), prompt, n, stops, bool(p.greedy), keys[j], _row_settings(parts, j, N, i),
                 top_k=top_k, watch=stop_watch(engine.lm, texts), constraint=p.constraint) for j in row_ids]


def _check_speculative(engine, p, prompt, parts, i: int) -> None:
    """What a speculative engine refuses: settings speculative decoding does not support, and a
    request whose prompt, ``n`` and ``gamma + 1`` proposals do not fit in the window."""
    from jaxdecode.speculative.loop import check_stateless

    say = f"request {i}: the engine decodes speculatively"
    if p.constraint is not None:
        raise ValueError(f"{say} and does not take constraint; serve it on an engine without --speculative")
    if p.top_logprobs:
        raise ValueError(f"{say} and does not return top_logprobs; ask without them or serve the request "
                         f"on an engine without --speculative")
    try:
        check_stateless(Chain(parts) if parts else None, engine.V)
    except ValueError as e:
        raise ValueError(f"{say}: {e}") from None
    need = len(prompt) + p.n + engine.gamma + 1
    if p.n > 0 and need > engine.T:
        raise ValueError(f"{say}: prompt ({len(prompt)} tokens) + n ({p.n}) + gamma + 1 ({engine.gamma + 1}) = "
                         f"{need} exceeds the model window T = {engine.T}")
    try:
        engine.draft.check(engine.lm.decoder, need)
    except ValueError as e:
        raise ValueError(f"request {i}: {e}") from None


def _check_constraint(c, n: int, V: int, ignore_eos: bool, i: int) -> None:
    """A request's constraint: None, or a compiled one for this vocabulary whose shortest text fits
    in ``n`` tokens (as :func:`jaxdecode.generate` checks it)."""
    if c is None:
        return
    if not isinstance(c, C.Constraint):
        raise C.ConstraintError(f"request {i}: a constraint must be a compiled "
                                f"jaxdecode.constraints.Constraint (compile_regex, compile_choices, "
                                f"compile_json_schema), got {type(c).__name__}")
    if c.V != V:
        raise C.ConstraintError(f"request {i}: the constraint was compiled for {c.V} tokens, "
                                f"the model has {V}")
    if ignore_eos and c.eos_stop:
        raise C.ConstraintError(f"request {i}: ignore_eos cannot be combined with a constraint on "
                                f"this model: its end token is how a constrained text ends")
    if n > 0:  # (generate returns no tokens for n = 0 without looking at the pattern)
        try:
            c.check_budget(n)
        except C.ConstraintError as e:
            raise C.ConstraintError(f"request {i}: {e}") from None


def prompt_tokens(lm, V: int, prompt) -> np.ndarray:
    """A prompt's tokens: a non-empty string encoded, or token ids checked."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt must be a non-empty string")
        tokens = lm.vocab.encode(prompt)
        if len(tokens) == 0:
            raise ValueError(f"the prompt {prompt!r} encodes to no tokens")
        return tokens
    ids = np.asarray(prompt)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError("the prompt must be a non-empty string or a non-empty list of token ids")
    if ids.min() < 0 or ids.max() >= V:
        raise ValueError(f"prompt token ids must lie in [0, {V}), got min {ids.min()} max {ids.max()}")
    return ids.astype(np.int32)


# ----------------------------------------------------------------------------- rule layouts


@functools.cache
def _neutral_by_kind() -> dict:
    """Each rule class with its neutral setting (:data:`jaxdecode.rules.NEUTRAL`; None for top-k:
    the vocabulary size), built once from the rules' registry."""
    return {type(spec.factory(1 if spec.neutral == "V" else spec.neutral)):
            None if spec.neutral == "V" else spec.neutral for spec in REGISTRY if spec.neutral is not None}


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
    has none (a logit control's is its ``neutral()``, of the same shapes)."""
    if hasattr(part, "neutral"):
        return part.neutral()
    kind = type(part)
    table = _neutral_by_kind()
    if kind not in table:
        return None
    value = V if table[kind] is None else table[kind]
    leaves, treedef = jax.tree_util.tree_flatten(part)
    return jax.tree_util.tree_unflatten(treedef, [np.asarray(value, np.asarray(a).dtype) for a in leaves])


def part_kind(part):
    """What a layout matches a rule part by: its tree structure (its type and static settings)."""
    return jax.tree_util.tree_structure(part)


def embed_in_layout(parts: tuple, layout: tuple, V: int):
    """Each layout part's rule for a row with ``parts``: its own where it has that part, else the
    neutral one; None if ``parts`` is not the layout with neutral-capable parts left out."""
    out, i = [], 0
    for lp in layout:
        if i < len(parts) and part_kind(parts[i]) == part_kind(lp):
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
    candidates = [c for c in candidates if embed_in_layout(line[0].parts, c, V) is not None]
    return max(candidates, key=lambda c: sum(embed_in_layout(r.parts, c, V) is not None for r in line))


def _kinds_text(parts) -> str:
    return ", ".join(type(p).__name__ for p in parts) or "no rule"


def _row_settings(parts: tuple, j: int, num_samples: int, index: int) -> tuple:
    """The parts with every setting cut to sample ``j`` (settings are one for every sample or one per
    sample: a scalar or ``[num_samples]``; a logit control's ``[V]`` or ``[num_samples, V]``)."""
    def cut(a, nd=0):
        a = np.asarray(a)
        if a.ndim == nd:
            return a
        if a.ndim != nd + 1 or a.shape[0] != num_samples:
            one, per = ("a scalar", f"({num_samples},)") if nd == 0 else \
                (f"one of {nd} dimensions", f"({num_samples}, ...)")
            raise ValueError(f"request {index}: a rule setting has shape {a.shape}; give {one} or one "
                             f"value per sample {per}")
        return a[j]

    def cut_part(p):
        if hasattr(p, "ROW_NDIM"):  # a logit control: its settings' ranks for one row
            return dataclasses.replace(p, **{name: cut(getattr(p, name), nd) for name, nd in p.ROW_NDIM})
        return jax.tree_util.tree_map(cut, p)

    return tuple(cut_part(p) for p in parts)
