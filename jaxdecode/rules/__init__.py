"""Logits transforms: temperature, truncation and penalty rules that compose like optax transforms.

The rule interface and :func:`chain` are in :mod:`.base`, the rules in :mod:`.truncation` and
:mod:`.penalties`; this module holds the one registry of named rules (their order and their
command-line flags) and :func:`make_rule`.

A :class:`Rule` has three pure methods::

    state = rule.init(prompt, lengths, V, max_new)   # prompt [B, P] right-padded, lengths [B]
    logits = rule.apply(logits, state)               # [B, V] -> [B, V]; removed tokens are -inf
    state = rule.update(state, token)                # token [B]: the token just chosen per row

Every rule is a frozen dataclass registered as a pytree. Its numeric settings (temperature, p, k,
penalties, ...) are leaves, float32 or int32 arrays of shape ``[]`` or ``[B]``, so a jitted
function that takes a rule as an argument compiles once for all their values, and each row of
a batch may carry its own setting (:func:`per_row`). Only settings that change shapes are
static (the ``n`` of :func:`no_repeat_ngram`). The logit controls of :mod:`.controls` (a logit bias,
the tokens allowed, bad words, a minimum length) hold a value per token: ``[V]`` or ``[B, V]``.

Factories check concrete settings before anything is traced and raise :class:`RuleError`; traced
settings are taken as they are. Every truncation keeps at least the most probable token, so a
processed distribution is never empty (typical sampling keeps at least the most typical one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxdecode.io.registry import Registry
from jaxdecode.rules.base import Chain, Rule, RuleError, chain, per_row, processed_logprobs
from jaxdecode.rules.controls import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    AllowedTokens,
    BadWords,
    LogitBias,
    MinTokens,
    allowed_tokens,
    bad_word_ids,
    bad_words,
    logit_bias,
    min_tokens,
)
from jaxdecode.rules.penalties import (
    FrequencyPenalty,
    History,
    NoRepeatNGram,
    PresencePenalty,
    RepetitionPenalty,
    frequency_penalty,
    no_repeat_ngram,
    presence_penalty,
    repetition_penalty,
)
from jaxdecode.rules.truncation import (
    Epsilon,
    Eta,
    MinP,
    Temperature,
    TopK,
    TopNSigma,
    TopP,
    Typical,
    epsilon,
    eta,
    greedy,
    min_p,
    temperature,
    top_k,
    top_n_sigma,
    top_p,
    typical,
)

# ----------------------------------------------------------------------------- registry


KINDS = ("penalty", "temperature", "truncation")  # the order make_rule applies them in


@dataclasses.dataclass(frozen=True)
class RuleSpec:
    """A rule that can be set by name: in :func:`make_rule` and as a command-line flag.

    ``name`` is the keyword of :func:`make_rule` (and the factory's name); the flag is
    ``--name-with-dashes``. ``kind`` places the rule in the order of application (:data:`KINDS`);
    ``type`` converts the flag's text (``int`` for settings that must be integers); ``help`` and
    ``metavar`` are the flag's help line and value name (``None``: argparse's default).
    ``neutral``: the setting that leaves every logit exactly unchanged (``"V"``: the vocabulary
    size), or None where the rule has none; a batch of rows with different chains runs each row's
    missing parts at it.
    """

    name: str
    factory: Callable[..., Rule]
    kind: str
    type: type = float
    help: str = ""
    metavar: str | None = None
    neutral: float | str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


# In the order make_rule applies them: penalties see the raw logits, then temperature, then the
# truncations (as Hugging Face and vLLM order their processors).
REGISTRY: tuple[RuleSpec, ...] = (
    RuleSpec("repetition_penalty", repetition_penalty, "penalty", float,
             "CTRL penalty for characters already seen", neutral=1.0),
    RuleSpec("frequency_penalty", frequency_penalty, "penalty", float, "subtract count * f", neutral=0.0),
    RuleSpec("presence_penalty", presence_penalty, "penalty", float,
             "subtract p from characters generated before", neutral=0.0),
    RuleSpec("no_repeat_ngram", no_repeat_ngram, "penalty", int, "forbid repeating any n-gram"),
    RuleSpec("temperature", temperature, "temperature", float, "divide logits by this; 0 = greedy",
             neutral=1.0),
    RuleSpec("top_k", top_k, "truncation", int, "keep the k most probable characters", neutral="V"),
    RuleSpec("top_p", top_p, "truncation", float, "keep the smallest set with mass >= p (nucleus)",
             neutral=1.0),
    RuleSpec("min_p", min_p, "truncation", float,
             "keep characters with prob >= this fraction of the top one", neutral=0.0),
    RuleSpec("typical", typical, "truncation", float, "locally typical sampling with this mass", neutral=1.0),
    RuleSpec("epsilon", epsilon, "truncation", float, "epsilon sampling: keep prob >= eps", neutral=0.0),
    RuleSpec("eta", eta, "truncation", float, "eta sampling", neutral=0.0),
    RuleSpec("top_n_sigma", top_n_sigma, "truncation", float,
             "keep logits within n standard deviations of the max"),
)

RULES: Registry[RuleSpec] = Registry("decoding setting", REGISTRY)  # refuses a name registered twice

RULE_ORDER: tuple[str, ...] = tuple(spec.name for spec in REGISTRY)

#: Each rule's setting that leaves the logits exactly unchanged (``"V"``: the vocabulary size).
NEUTRAL: dict[str, float | str] = {spec.name: spec.neutral for spec in REGISTRY if spec.neutral is not None}

assert [KINDS.index(s.kind) for s in REGISTRY] == sorted(KINDS.index(s.kind) for s in REGISTRY), \
    "REGISTRY must list the rules in the order of KINDS"


def make_rule(**settings):
    """Build the rule chain for named settings (``top_p=0.9, temperature=0.8, ...``), or ``None``.

    The parts are applied in :data:`RULE_ORDER`, whatever the order of the keywords. Settings
    that are ``None`` are skipped; an unknown name or an invalid value raises :class:`RuleError`
    before anything is traced.
    """
    unknown = set(settings) - set(RULES)
    if unknown:
        raise RuleError(f"unknown decoding setting(s): {', '.join(sorted(unknown))}")
    parts = [spec.factory(settings[spec.name]) for spec in REGISTRY
             if settings.get(spec.name) is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else chain(*parts)


__all__ = [
    "KINDS",
    "MAX_BAD_WORDS",
    "MAX_BAD_WORD_TOKENS",
    "NEUTRAL",
    "REGISTRY",
    "RULES",
    "RULE_ORDER",
    "AllowedTokens",
    "BadWords",
    "Chain",
    "Epsilon",
    "Eta",
    "FrequencyPenalty",
    "History",
    "LogitBias",
    "MinP",
    "MinTokens",
    "NoRepeatNGram",
    "PresencePenalty",
    "RepetitionPenalty",
    "Rule",
    "RuleError",
    "RuleSpec",
    "Temperature",
    "TopK",
    "TopNSigma",
    "TopP",
    "Typical",
    "allowed_tokens",
    "bad_word_ids",
    "bad_words",
    "chain",
    "epsilon",
    "eta",
    "frequency_penalty",
    "greedy",
    "logit_bias",
    "make_rule",
    "min_p",
    "min_tokens",
    "no_repeat_ngram",
    "per_row",
    "presence_penalty",
    "processed_logprobs",
    "repetition_penalty",
    "temperature",
    "top_k",
    "top_n_sigma",
    "top_p",
    "typical",
]
