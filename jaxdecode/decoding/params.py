"""One request's decoding settings as one frozen, validated object, and which loop honours which.

:class:`DecodeParams` holds every per-request setting: the rule settings of
:mod:`jaxdecode.rules` (or an explicit chain), greedy choice, the number of new tokens, samples,
seeds, stop strings and stop token ids, the constraint, log-probabilities, the logit controls
(``min_tokens``, ``logit_bias``, ``allowed_token_ids``, ``bad_words``) and how a request is run
(``chunk``, ``memory_budget``, ``max_rows``). It is checked once, when it is built;
a bad value raises one error line naming the field. The loops (:func:`jaxdecode.generate`,
``beam_generate``, ``contrastive_generate``, ``speculative_generate``, ``score``, ``mode_search``) and the
engine's :class:`~jaxdecode.serving.Request` take it, with keywords as overrides::

    p = DecodeParams(n=200, top_p=0.9, seed=3)
    jaxdecode.generate(lm, prompts, p)                 # the same as
    jaxdecode.generate(lm, prompts, n=200, top_p=0.9, seed=3)
    jaxdecode.generate(lm, prompts, p, temperature=0.7)  # p with one field changed

:data:`HONOURED` says which loop honours which setting; a loop given a setting it does not honour
(a value other than the default) refuses it by name: ``beam_generate does not take top_p``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxdecode import rules as R
from jaxdecode.decoding.common import check_int, stop_string_list
from jaxdecode.rules import RULE_ORDER, MinTokens, Rule, RuleError, make_rule

TOP_LOGPROBS = 20  # the most top log-probabilities a request may ask for (OpenAI's limit)


class ParamsError(ValueError):
    """A decoding setting that is invalid, or that a loop does not honour."""


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeParams:
    """Every per-request decoding setting. Rule settings left at None are not applied; ``chain``
    (``rule=`` as a keyword override) is an explicit :mod:`jaxdecode.rules` rule or chain instead
    of the named settings (its settings may hold one value per row). See the module docstring."""

    n: int = 300  # new tokens per sample (at most: a stop or an end token may end a sample sooner)
    greedy: bool = False  # the argmax of the processed logits instead of a draw
    # the rule settings, named as in jaxdecode.rules (make_rule's keywords and order)
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    no_repeat_ngram: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical: float | None = None
    epsilon: float | None = None
    eta: float | None = None
    top_n_sigma: float | None = None
    chain: Any = None  # an explicit rule or chain, instead of the named settings
    num_samples: int = 1  # samples per prompt
    seed: int | tuple[int, ...] = 0  # one seed, or one per prompt
    stop: tuple[str, ...] | None = None  # stop strings (matched on the text however tokenized)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end a sample (kept in its tokens and text)
    include_stop: bool = True  # keep the stop string in the text (False: cut, as OpenAI's API)
    min_tokens: int = 0  # no end token or stop token before this many new tokens
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    allowed_token_ids: tuple[int, ...] | None = None  # only these tokens may be chosen
    bad_words: tuple[str, ...] | None = None  # words a sample may not complete (vLLM's bad_words)
    constraint: Any = None  # a jaxdecode.constraints.Constraint, or one per prompt
    top_logprobs: int = 0  # the most probable tokens reported with each generated token
    ignore_eos: bool = False  # the model's end tokens do not end a sample
    generation_config: bool = True  # a model folder's generation_config.json fills unset rule settings
    chunk: int | None = None  # steps between host round trips (None: the loop's choice)
    memory_budget: int | str | None = None  # bytes (or "2G") a batch may take (None: the device's)
    max_rows: int | None = None  # the most rows of one batch

    def __post_init__(self):
        try:
            self._check()
        except RuleError:
            raise
        except ValueError as e:  # one kind of error for every field
            raise ParamsError(str(e)) from None

    def _check(self):
        put = lambda name, value: object.__setattr__(self, name, value)
        check_int("the number of new tokens n", self.n, 0)
        for name in ("greedy", "include_stop", "ignore_eos", "generation_config"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ParamsError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_int("num_samples", self.num_samples, 1)
        put("seed", _seeds(self.seed))
        if self.stop is not None:
            stops = tuple(stop_string_list(self.stop))
            put("stop", stops or None)
        put("stop_token_ids", _token_ids(self.stop_token_ids, "stop_token_ids"))
        check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.n:
            raise ParamsError(f"min_tokens ({self.min_tokens}) must be at most n ({self.n})")
        put("logit_bias", _logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = _token_ids(self.allowed_token_ids, "allowed_token_ids")
            put("allowed_token_ids", tuple(sorted(set(allowed))))
            if not self.allowed_token_ids:
                raise ParamsError("allowed_token_ids must hold at least one token id (None: every token)")
        put("bad_words", _bad_words(self.bad_words))
        top = check_int("top_logprobs", self.top_logprobs, 0)
        if top > TOP_LOGPROBS:
            raise ParamsError(f"top_logprobs must be at most {TOP_LOGPROBS}, got {top}")
        if self.chunk is not None:
            check_int("chunk", self.chunk, 1)
        if self.max_rows is not None:
            check_int("max_rows", self.max_rows, 1)
        named = self.rule_settings()
        if self.chain is not None:
            if named:
                raise ParamsError(f"give either a rule (chain) or the named rule settings "
                                  f"({', '.join(named)}), not both")
            if not isinstance(self.chain, Rule):
                raise ParamsError(f"rule must be a jaxdecode rule or chain of rules, got {type(self.chain).__name__}")
        put("_rule", self.chain if self.chain is not None else make_rule(**named))  # checks every setting

    def rule_settings(self) -> dict:
        """The named rule settings that are set, as :func:`jaxdecode.rules.make_rule` keywords."""
        return {name: getattr(self, name) for name in RULE_ORDER if getattr(self, name) is not None}

    def rule(self):
        """The rule chain the settings make (``chain`` when given), or None for none."""
        return self._rule

    def replace(self, **overrides) -> DecodeParams:
        """A copy with ``overrides`` (field names; ``rule=`` for ``chain``), checked again. Setting a
        named rule setting drops an explicit chain and the other way round."""
        overrides = _aliases(overrides)
        unknown = sorted(set(overrides) - set(FIELDS))
        if unknown:
            raise TypeError(f"unknown decoding setting(s): {', '.join(unknown)}")
        if overrides.get("chain") is not None:
            overrides = {name: None for name in RULE_ORDER} | overrides
        elif any(overrides.get(name) is not None for name in RULE_ORDER):
            overrides = {"chain": None} | overrides
        return dataclasses.replace(self, **overrides)

    def changed(self) -> dict:
        """The fields whose values differ from the defaults."""
        return {f: getattr(self, f) for f in FIELDS if not _same(getattr(self, f), getattr(DEFAULTS, f))}

    def check_for(self, loop: str) -> DecodeParams:
        """``self``, or a :class:`ParamsError` naming the first setting ``loop`` does not honour."""
        for name in self.changed():
            if loop not in HONOURED[name]:
                raise ParamsError(f"{loop} does not take {'rule' if name == 'chain' else name}")
        return self

    def __eq__(self, other):
        if not isinstance(other, DecodeParams):
            return NotImplemented
        return all(_same(getattr(self, f), getattr(other, f)) for f in FIELDS)

    __hash__ = None  # settings may hold arrays (a chain's per-row settings)

    def __repr__(self):
        return f"DecodeParams({', '.join(f'{k}={v!r}' for k, v in self.changed().items())})"




def _aliases(overrides: dict) -> dict:
    out = {}
    for name, value in overrides.items():
        name = ALIASES.get(name, name)
        if name in out:
            raise TypeError(f"the setting {name} is given twice")
        out[name] = value
    return out


def stop_automaton_for(lm, p: DecodeParams):
    """The stop automaton of a text request with settings ``p`` on a loaded model: its stop
    strings, its stop token ids and (unless ``ignore_eos``) the model's end tokens; None if none."""
    from jaxdecode.decoding.stops import byte_stop_automaton

    ends = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(getattr(lm, "eos_ids", ())))
    if not p.stop and not ends:
        return None
    return byte_stop_automaton(lm.vocab, p.stop or (), ends)


def _seeds(seed):
    if isinstance(seed, (list, tuple, np.ndarray)):
        seeds = list(seed)
    else:
        seeds = [seed]
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not -2**63 <= s < 2**64:
            raise ParamsError(f"a seed must be an integer (seed: one, or one per prompt), got {s!r}")
    if isinstance(seed, (list, tuple, np.ndarray)):
        return tuple(int(s) for s in seeds)
    return int(seed)


def _token_ids(ids, name: str) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (int, np.integer)):
        ids = [ids]
    if isinstance(ids, (str, bytes, Mapping)):
        raise ParamsError(f"{name} must be token ids (integers >= 0), got {ids!r}")
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
            raise ParamsError(f"{name} must be token ids (integers >= 0), got {t!r}")
        out.append(int(t))
    return tuple(out)


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range of a logit bias: [-100, 100]; a value beyond is clamped


def _logit_bias(bias) -> dict[int, float] | None:
    """``{token id: bias}`` checked, the biases clamped to [-100, 100]; None for none."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ParamsError(f"logit_bias must map token ids to biases (a dict), got {type(bias).__name__}")
    out = {}
    for t, b in bias.items():
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
            raise ParamsError(f"logit_bias: a key must be a token id (an integer >= 0), got {t!r}")
        if isinstance(b, (int, np.integer)) and not isinstance(b, bool):
            b = min(max(int(b), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)  # (an int of any size)
        elif not isinstance(b, (float, np.floating)) or not math.isfinite(b):
            raise ParamsError(f"logit_bias: the bias of token {int(t)} must be a finite number, got {b!r}")
        out[int(t)] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(b)))
    return out or None


def _bad_words(words) -> tuple[str, ...] | None:
    if words is None:
        return None
    words = [words] if isinstance(words, str) else words
    if isinstance(words, (bytes, Mapping)) or not hasattr(words, "__iter__"):
        raise ParamsError(f"bad_words must be a list of words, got {type(words).__name__}")
    words = list(words)
    for w in words:
        if not isinstance(w, str):
            raise ParamsError(f"bad_words: a word must be a string, got {w!r}")
        if not w.strip():
            raise ParamsError(f"bad_words: a word must not be empty or only white space, got {w!r}")
    return tuple(words) or None


def _same(a, b) -> bool:
    """Equal settings: numbers and strings by value, a rule or constraint as the same object or
    equal pytrees, arrays elementwise."""
    if a is b:
        return True
    if isinstance(a, Rule) or isinstance(b, Rule):
        if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):
            return False
        return all(np.array_equal(np.asarray(x), np.asarray(y))
                   for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
    if isinstance(a, (np.ndarray, jax.Array)) or isinstance(b, (np.ndarray, jax.Array)):
        return np.shape(a) == np.shape(b) and bool(np.array_equal(np.asarray(a), np.asarray(b)))
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(DecodeParams))
DEFAULTS = DecodeParams()
ALIASES = {"rule": "chain"}  # the loops' keyword for an explicit rule

assert set(RULE_ORDER) <= set(FIELDS), "DecodeParams must have a field for every named rule setting"


# ----------------------------------------------------------------------------- which loop honours what

GENERATE, BEAM, SPECULATIVE, CONTRASTIVE, SCORE, MODE, ENGINE = (
    "generate", "beam_generate", "speculative_generate", "contrastive_generate", "score", "mode_search",
    "the engine")
LOOPS: tuple[str, ...] = (GENERATE, BEAM, SPECULATIVE, CONTRASTIVE, SCORE, MODE, ENGINE)

_RULES = frozenset({GENERATE, BEAM, SPECULATIVE, ENGINE})
_STATEFUL = frozenset({GENERATE, BEAM, ENGINE})  # speculative decoding takes stateless rules only

#: Each setting and the loops that honour it; a loop refuses a setting it is not listed for.
HONOURED: dict[str, frozenset[str]] = {
    "n": frozenset({GENERATE, BEAM, SPECULATIVE, CONTRASTIVE, MODE, ENGINE}),
    "greedy": frozenset({GENERATE, SPECULATIVE, ENGINE}),
    "repetition_penalty": _STATEFUL,
    "frequency_penalty": _STATEFUL,
    "presence_penalty": _STATEFUL,
    "no_repeat_ngram": _STATEFUL,
    **{name: _RULES for name in RULE_ORDER if name not in
       ("repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram")},
    "chain": _RULES,
    "num_samples": frozenset({GENERATE, SPECULATIVE, ENGINE}),
    "seed": frozenset({GENERATE, SPECULATIVE, ENGINE}),
    "stop": frozenset({GENERATE, BEAM, SPECULATIVE, CONTRASTIVE, ENGINE}),
    "stop_token_ids": frozenset({GENERATE, BEAM, SPECULATIVE, CONTRASTIVE, MODE, ENGINE}),
    "include_stop": frozenset({GENERATE, BEAM, SPECULATIVE, CONTRASTIVE}),
    "min_tokens": frozenset({GENERATE, ENGINE}),
    "logit_bias": frozenset({GENERATE, ENGINE}),
    "allowed_token_ids": frozenset({GENERATE, ENGINE}),
    "bad_words": frozenset({GENERATE, ENGINE}),
    "constraint": frozenset({GENERATE, BEAM, SPECULATIVE, SCORE, MODE, ENGINE}),
    "top_logprobs": frozenset({ENGINE}),
    "ignore_eos": frozenset({ENGINE}),
    "generation_config": frozenset({GENERATE}),
    "chunk": frozenset({GENERATE, BEAM, CONTRASTIVE}),
    "memory_budget": frozenset({GENERATE, BEAM, SPECULATIVE, CONTRASTIVE, SCORE}),
    "max_rows": frozenset({GENERATE, SCORE}),
}

assert set(HONOURED) == set(FIELDS), "HONOURED must list every field of DecodeParams"

# the rows of the table in docs/python.md: a label and the fields it stands for
TABLE_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("`n`", ("n",)),
    ("`greedy`", ("greedy",)),
    ("`temperature`, `top_k`, `top_p`, `min_p`, `typical`, `epsilon`, `eta`, `top_n_sigma`",
     ("temperature", "top_k", "top_p", "min_p", "typical", "epsilon", "eta", "top_n_sigma")),
    ("`repetition_penalty`, `frequency_penalty`, `presence_penalty`, `no_repeat_ngram`",
     ("repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram")),
    ("`rule` (an explicit chain)", ("chain",)),
    ("`num_samples`, `seed`", ("num_samples", "seed")),
    ("`stop`", ("stop",)),
    ("`stop_token_ids`", ("stop_token_ids",)),
    ("`include_stop`", ("include_stop",)),
    ("`min_tokens`, `logit_bias`, `allowed_token_ids`, `bad_words`",
     ("min_tokens", "logit_bias", "allowed_token_ids", "bad_words")),
    ("`constraint`", ("constraint",)),
    ("`top_logprobs`, `ignore_eos`", ("top_logprobs", "ignore_eos")),
    ("`generation_config`", ("generation_config",)),
    ("`chunk`", ("chunk",)),
    ("`memory_budget`", ("memory_budget",)),
    ("`max_rows`", ("max_rows",)),
)


def table_markdown() -> str:
    """:data:`HONOURED` as the markdown table of ``docs/python.md``."""
    heads = ["`generate`", "`beam_generate`", "`speculative_generate`", "`contrastive_generate`", "`score`",
             "`mode_search`", "engine (`Request`)"]
    lines = ["| setting | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for label, names in TABLE_ROWS:
        loops = {HONOURED[n] for n in names}
        assert len(loops) == 1, f"the table row {label} joins settings honoured by different loops"
        honoured = loops.pop()
        lines.append(f"| {label} | " + " | ".join("yes" if loop in honoured else "" for loop in LOOPS) + " |")
    return "\n".join(lines)


assert sorted(n for _, names in TABLE_ROWS for n in names) == sorted(FIELDS), \
    "TABLE_ROWS must show every field of DecodeParams once"


# ----------------------------------------------------------------------------- the loops' entry


def resolve(params, overrides: dict, loop: str) -> DecodeParams:
    """The settings a loop runs with: ``params`` (a :class:`DecodeParams`, None for the defaults,
    or an int: the number of new tokens, as the loops' third positional argument always was) with
    the keyword ``overrides``, checked against what ``loop`` honours."""
    overrides = dict(overrides)
    if params is None:
        params = DEFAULTS
    elif isinstance(params, (int, np.integer)) and not isinstance(params, bool):
        if "n" in overrides:
            raise TypeError(f"{loop} got the number of new tokens n twice (as an argument and as n=)")
        overrides["n"] = params
        params = DEFAULTS
    elif not isinstance(params, DecodeParams):
        raise TypeError(f"{loop}: params must be a DecodeParams (or the number of new tokens n), "
                        f"got {type(params).__name__}")
    try:
        out = params.replace(**overrides) if overrides else params
    except TypeError as e:
        raise TypeError(f"{loop}: {e}") from None
    return out.check_for(loop)


# ----------------------------------------------------------------------------- the logit controls


def logit_controls(lm, p: DecodeParams, rows: int | None = None) -> tuple[Rule, ...]:
    """The rules ``p``'s logit controls make on the model ``lm``, in vLLM's order (the tokens
    allowed, bad words, ``min_tokens``, the logit bias), to apply before its rule chain: they see
    the model's logits. Each setting is one row's (``[V]``; the engine's rows) or, with ``rows``,
    one per row (``[rows, V]``: the loops' batches). ``()`` if none is set.

    ``min_tokens`` removes the stop token ids and, unless ``ignore_eos``, the model's end tokens;
    it cannot be combined with stop strings or a constraint, which end a sample by other means.
    A token id outside the vocabulary, or bad words beyond :data:`jaxdecode.rules.MAX_BAD_WORDS`
    sequences of :data:`jaxdecode.rules.MAX_BAD_WORD_TOKENS` tokens, raise :class:`ParamsError`."""
    V = lm.decoder.V
    parts = []

    def mask(ids, name):
        bad = [t for t in ids if t >= V]
        if bad:
            raise ParamsError(f"{name}: the token id {bad[0]} lies outside the vocabulary of {V} tokens")
        m = np.zeros((V,), bool)
        m[list(ids)] = True
        return m

    if p.allowed_token_ids is not None:
        parts.append(R.allowed_tokens(mask(p.allowed_token_ids, "allowed_token_ids")))
    if p.bad_words:
        seqs = R.bad_word_ids(lm.vocab, p.bad_words)
        if len(seqs) > R.MAX_BAD_WORDS:
            raise ParamsError(f"bad_words: {len(seqs)} token sequences (a word may count twice: with and "
                              f"without a space before it), at most {R.MAX_BAD_WORDS}")
        long = [s for s in seqs if len(s) > R.MAX_BAD_WORD_TOKENS]
        if long:
            raise ParamsError(f"bad_words: a word of {len(long[0])} tokens, at most {R.MAX_BAD_WORD_TOKENS}")
        for s in seqs:
            mask(s, "bad_words")
        if seqs:
            parts.append(R.bad_words(seqs))
    if p.min_tokens:
        if p.stop or p.constraint is not None:
            raise ParamsError("min_tokens is not supported with stop strings or a constraint (it masks the "
                              "end tokens and stop token ids only)")
        ends = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(getattr(lm, "eos_ids", ())))
        if ends:
            parts.append(R.min_tokens(p.min_tokens, mask(ends, "stop_token_ids")))
    if p.logit_bias:
        bias = np.zeros((V,), np.float32)
        ids = list(p.logit_bias)
        mask(ids, "logit_bias")
        bias[ids] = list(p.logit_bias.values())
        parts.append(R.logit_bias(bias))
    if rows is not None:
        parts = [R.per_row(part, rows) for part in parts]
    return tuple(parts)


def neutral_controls(V: int) -> tuple[Rule, ...]:
    """Every logit control, in :func:`logit_controls`' order, at its neutral setting for one row of a
    ``V``-token vocabulary: the head of an engine layout that every request's controls fit."""
    return (R.allowed_tokens(np.ones((V,), bool)), R.bad_words([]), R.min_tokens(0, np.zeros((V,), bool)),
            R.logit_bias(np.zeros((V,), np.float32)))


def with_controls(lm, p: DecodeParams, rule, rows: int | None = None):
    """``rule`` (a rule, a chain or None) with :func:`logit_controls` before it. With ``rows``, the
    logit controls an explicit chain holds get one setting per row too."""
    if rows is not None and rule is not None:
        rule = _controls_per_row(rule, rows)
    parts = logit_controls(lm, p, rows)
    if not parts:
        return rule
    return R.chain(*parts, *(() if rule is None else (rule,)))


def _controls_per_row(rule, B: int):
    if isinstance(rule, R.Chain):
        return R.Chain(tuple(_controls_per_row(r, B) for r in rule.rules))
    return rule.per_row(B) if hasattr(rule, "per_row") else rule


__all__ = ["DEFAULTS", "FIELDS", "HONOURED", "LOOPS", "DecodeParams", "MinTokens", "ParamsError", "RuleError",
           "logit_controls", "neutral_controls", "resolve", "stop_automaton_for", "table_markdown",
           "with_controls"]
