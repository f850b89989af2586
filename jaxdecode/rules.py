"""Logits transforms: temperature, truncation and penalty rules that compose like optax transforms.

A :class:`Rule` has three pure methods::

    state = rule.init(prompt, lengths, V, max_new)   # prompt [B, P] right-padded, lengths [B]
    logits = rule.apply(logits, state)               # [B, V] -> [B, V]; removed tokens are -inf
    state = rule.update(state, token)                # token [B]: the token just chosen per row

Every rule is a frozen dataclass registered as a pytree. Its numeric settings (temperature, p, k,
penalties, ...) are leaves, float32 or int32 arrays of shape ``[]`` or ``[B]``, so a jitted
function that takes a rule as an argument compiles once for all their values, and each row of
a batch may carry its own setting (:func:`per_row`). Only settings that change shapes are
static (the ``n`` of :func:`no_repeat_ngram`).

Factories check concrete settings before anything is traced and raise :class:`RuleError`; traced
settings are taken as they are. Every truncation keeps at least the most probable token, so a
processed distribution is never empty (typical sampling keeps at least the most typical one).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -jnp.inf


class RuleError(ValueError):
    """A rule's setting lies outside its allowed range."""


# ----------------------------------------------------------------------------- base and helpers


class Rule:
    """Base class: stateless by default; subclasses override :meth:`apply` (and the state pair)."""

    def init(self, prompt, lengths, V: int, max_new: int):
        """State for a batch of right-padded prompts ``[B, P]`` with ``lengths`` ``[B]``."""
        return ()

    def apply(self, logits, state):
        """Transform next-token logits ``[B, V]`` float32; removed tokens become ``-inf``."""
        raise NotImplementedError

    def update(self, state, token):
        """The state after each row appended ``token`` ``[B]`` int32."""
        return state


def _rule(cls):
    """Make ``cls`` a frozen dataclass and a pytree: fields marked ``static`` are metadata.

    Registered with ``register_pytree_with_keys`` rather than ``register_dataclass``: with the
    latter, two rule classes with the same field layout (``MinP(ratio)``, ``Epsilon(eps)``) get
    tree structures that compare equal, so a jitted function could reuse one rule's program for
    the other.
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if not f.metadata.get("static", False))
    meta = tuple(f.name for f in fields if f.metadata.get("static", False))

    def flatten_with_keys(rule):
        children = [(jax.tree_util.GetAttrKey(n), getattr(rule, n)) for n in data]
        return children, tuple(getattr(rule, n) for n in meta)

    def flatten(rule):
        return [getattr(rule, n) for n in data], tuple(getattr(rule, n) for n in meta)

    def unflatten(aux, children):
        return cls(**dict(zip(data, children)), **dict(zip(meta, aux)))

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


def _static():
    return dataclasses.field(metadata={"static": True})


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _setting(rule: str, name: str, value, ok, allowed: str, *, integer: bool = False):
    """Validate a concrete setting and return it as a float32 (int32) array of shape [] or [B].

    ``ok(values)`` is a numpy predicate over float64 values; ``allowed`` completes the message
    "``rule``: ``name`` must ``allowed``, got ...". NaN is always rejected.
    """
    dtype = jnp.int32 if integer else jnp.float32
    if _is_tracer(value):
        return jnp.asarray(value, dtype)
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - anything numpy cannot read is a bad setting
        raise RuleError(f"{rule}: {name} must be a number, got {value!r}") from None
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer)
                                 or np.issubdtype(arr.dtype, np.floating)):
        raise RuleError(f"{rule}: {name} must be a number, got {value!r}")
    if arr.ndim > 1:
        raise RuleError(f"{rule}: {name} must be a scalar or a [B] vector, got shape {arr.shape}")
    vals = arr.astype(np.float64).reshape(-1)
    good = ~np.isnan(vals) & ok(vals)
    if integer:
        good &= np.isfinite(vals) & (vals == np.round(vals))
    if not good.all():
        bad = vals[~good][0]
        raise RuleError(f"{rule}: {name} must {allowed}, got {_fmt(bad)}")
    return jnp.asarray(arr, dtype)


def _col(x):
    """A setting of shape [] or [B] as a column [1, 1] or [B, 1] against [B, V] logits."""
    return jnp.reshape(x, (-1, 1))


def _is_first_max(logits):
    """[B, V] bool: the (first) argmax of each row."""
    V = logits.shape[-1]
    return jnp.arange(V)[None, :] == jnp.argmax(logits, axis=-1)[:, None]


def _truncate(logits, keep):
    return jnp.where(keep, logits, NEG_INF)


def _softmax(logits):
    return jnp.exp(processed_logprobs(logits))


def _entropy(logp):
    """Entropy in nats of each row of log-probabilities [B, V] (removed tokens contribute 0)."""
    p = jnp.exp(logp)
    return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)


def _canonical_zero(x):
    # lax.sort orders -0.0 before 0.0; make equal values sort as ties
    return jnp.where(x == 0, 0.0, x)


PAIRWISE_RANK_MAX_V = 512  # up to here ranks come from comparing pairs ([B, V, V]), beyond from sorting


def _descending_rank(logits):
    """[B, V] int32: each token's place when the row is sorted by decreasing logit, ties by index
    (the order of a stable ``argsort(-logits)``), counted by comparing every pair."""
    key = _canonical_zero(logits)
    V = key.shape[-1]
    mine, other = key[:, :, None], key[:, None, :]  # [B, i, j]
    earlier = (jnp.arange(V)[None, :] < jnp.arange(V)[:, None])[None]  # [1, i, j]: j < i
    return jnp.sum((other > mine) | ((other == mine) & earlier), axis=-1, dtype=jnp.int32)


def _rank_and_sorted(logits, values):
    """Each token's descending rank (see :func:`_descending_rank`) and ``values`` in rank order.
    For vocabularies of a few hundred tokens by comparing pairs, several times faster than XLA's
    sort on CPU (and exact: one nonzero term per sum); larger ones, where [B, V, V] would not fit,
    sort."""
    V = logits.shape[-1]
    if V > PAIRWISE_RANK_MAX_V:
        order = jnp.argsort(-_canonical_zero(logits), axis=-1, stable=True)
        return jnp.argsort(order, axis=-1).astype(jnp.int32), jnp.take_along_axis(values, order, axis=-1)
    rank = _descending_rank(logits)
    hit = rank[:, :, None] == jnp.arange(V)[None, None, :]
    return rank, jnp.sum(jnp.where(hit, values[:, :, None], 0.0), axis=1)


def processed_logprobs(logits):
    """``log_softmax`` over the last axis that maps ``-inf`` entries to ``-inf`` without NaN."""
    logits = jnp.asarray(logits)
    finite = jnp.isfinite(logits)
    m = jnp.max(jnp.where(finite, logits, NEG_INF), axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    shifted = logits - m
    lse = jnp.log(jnp.sum(jnp.where(logits == NEG_INF, 0.0, jnp.exp(shifted)), axis=-1,
                          keepdims=True))
    return jnp.where(logits == NEG_INF, NEG_INF, shifted - lse)


def per_row(rule, B: int):
    """``rule`` with every numeric setting broadcast to shape ``[B]`` (one value per row)."""
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(jnp.asarray(x), (B,)), rule)


# ----------------------------------------------------------------------------- temperature


@_rule
class Temperature(Rule):
    t: jax.Array  # [] or [B] float32; 0 means greedy

    def apply(self, logits, state):
        t = _col(self.t)
        greedy = t == 0
        scaled = logits / jnp.where(greedy, 1.0, t)
        return jnp.where(greedy, _truncate(logits, _is_first_max(logits)), scaled)


def temperature(t) -> Temperature:
    """Divide the logits by ``t``; ``t = 0`` keeps only the (first) argmax, i.e. greedy decoding.

    Sampling from the Boltzmann distribution at temperature ``t``, as in the Boltzmann machine
    of Ackley, Hinton and Sejnowski (1985).
    """
    return Temperature(_setting("temperature", "t", t, lambda v: v >= 0, "be >= 0"))


def greedy() -> Temperature:
    """Keep only the most probable token: ``temperature(0)``."""
    return temperature(0.0)


# ----------------------------------------------------------------------------- truncation


@_rule
class TopK(Rule):
    k: jax.Array  # [] or [B] int32 >= 1

    def apply(self, logits, state):
        B, V = logits.shape
        k = jnp.clip(_col(self.k), 1, V)  # k > V keeps every token
        desc = -jnp.sort(-logits, axis=-1)  # [B, V]
        kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, (B, 1)), axis=-1)  # [B, 1]
        return _truncate(logits, logits >= kth)  # ties with the k-th are kept


def top_k(k) -> TopK:
    """Keep the ``k`` most probable tokens, and any tied with the k-th (Fan, Lewis, Dauphin 2018)."""
    return TopK(_setting("top_k", "k", k, lambda v: v >= 1, "be an integer >= 1", integer=True))


@_rule
class TopP(Rule):
    p: jax.Array  # [] or [B] float32 in (0, 1]

    def apply(self, logits, state):
        p = _col(self.p)
        rank, probs = _rank_and_sorted(logits, _softmax(logits))  # [B, V] each, probs in rank order
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more probable tokens
        # p = 1 keeps everything: in exact arithmetic no token's preceding mass reaches 1
        drop_sorted = (before >= p) & (p < 1)
        drop = jnp.take_along_axis(drop_sorted, rank, axis=-1)  # back to vocabulary order
        return _truncate(logits, ~drop)


def top_p(p) -> TopP:
    """Nucleus sampling (Holtzman et al. 2020): the smallest set of tokens with mass >= ``p``.

    Tokens are ranked by probability (ties by index); a token is dropped when the tokens ranked
    before it already hold mass ``p``.
    """
    return TopP(_setting("top_p", "p", p, lambda v: (v > 0) & (v <= 1), "lie in (0, 1]"))


@_rule
class MinP(Rule):
    ratio: jax.Array  # [] or [B] float32 in [0, 1]

    def apply(self, logits, state):
        top = jnp.max(logits, axis=-1, keepdims=True)
        # p_i / p_max = exp(z_i - z_max): no softmax needed
        return _truncate(logits, jnp.exp(logits - top) >= _col(self.ratio))


def min_p(ratio) -> MinP:
    """Min-p sampling (Nguyen et al. 2024): drop tokens with probability < ``ratio`` * the top one."""
    return MinP(_setting("min_p", "ratio", ratio, lambda v: (v >= 0) & (v <= 1), "lie in [0, 1]"))


@_rule
class Typical(Rule):
    mass: jax.Array  # [] or [B] float32 in (0, 1]

    def apply(self, logits, state):
        _B, V = logits.shape
        mass = _col(self.mass)
        logp = processed_logprobs(logits)
        ent = _entropy(logp)[:, None]  # [B, 1]
        score = jnp.abs(-logp - ent)  # |surprisal - entropy|, inf for removed tokens
        order = jnp.argsort(score, axis=-1, stable=True)  # [B, V] most typical first
        sorted_score = jnp.take_along_axis(score, order, axis=-1)
        cum = jnp.cumsum(jnp.take_along_axis(jnp.exp(logp), order, axis=-1), axis=-1)
        last = jnp.minimum(jnp.sum(cum < mass, axis=-1, keepdims=True), V - 1)  # [B, 1]
        cut = jnp.take_along_axis(sorted_score, last, axis=-1)
        keep = (score <= cut) | (mass >= 1)
        return _truncate(logits, keep)


def typical(mass) -> Typical:
    """Locally typical sampling (Meister, Pimentel, Wiher, Cotterell 2023).

    Rank tokens by ``|-log p - H|`` (H the entropy) and keep the smallest most-typical prefix
    whose mass reaches ``mass`` (and tokens tied with its last), at least one token. As
    Hugging Face's ``TypicalLogitsWarper``; this can drop the most probable token.
    """
    return Typical(_setting("typical", "mass", mass, lambda v: (v > 0) & (v <= 1),
                            "lie in (0, 1]"))


@_rule
class Epsilon(Rule):
    eps: jax.Array  # [] or [B] float32 in [0, 1)

    def apply(self, logits, state):
        keep = _softmax(logits) >= _col(self.eps)
        top = jnp.max(logits, axis=-1, keepdims=True)
        return _truncate(logits, keep | (logits >= top))


def epsilon(eps) -> Epsilon:
    """Epsilon sampling (Hewitt, Manning, Liang 2022): keep tokens with probability >= ``eps``.

    The most probable token is always kept, as in Hugging Face's ``EpsilonLogitsWarper``.
    """
    return Epsilon(_setting("epsilon", "eps", eps, lambda v: (v >= 0) & (v < 1),
                            "lie in [0, 1)"))


@_rule
class Eta(Rule):
    eta: jax.Array  # [] or [B] float32 in [0, 1)

    def apply(self, logits, state):
        logp = processed_logprobs(logits)
        eta = _col(self.eta)
        ent = _entropy(logp)[:, None]  # nats
        threshold = jnp.minimum(eta, jnp.sqrt(eta) * jnp.exp(-ent))
        top = jnp.max(logits, axis=-1, keepdims=True)
        return _truncate(logits, (jnp.exp(logp) >= threshold) | (logits >= top))


def eta(eta) -> Eta:
    """Eta sampling (Hewitt, Manning, Liang 2022): threshold ``min(eta, sqrt(eta) * exp(-H))``.

    H is the entropy in nats. The most probable token is always kept, as in Hugging Face's
    ``EtaLogitsWarper``.
    """
    return Eta(_setting("eta", "eta", eta, lambda v: (v >= 0) & (v < 1), "lie in [0, 1)"))


@_rule
class TopNSigma(Rule):
    n: jax.Array  # [] or [B] float32 > 0

    def apply(self, logits, state):
        finite = jnp.isfinite(logits)
        count = jnp.maximum(jnp.sum(finite, axis=-1, keepdims=True), 1)
        mean = jnp.sum(jnp.where(finite, logits, 0.0), axis=-1, keepdims=True) / count
        var = jnp.sum(jnp.where(finite, (logits - mean) ** 2, 0.0), axis=-1, keepdims=True) / count
        top = jnp.max(logits, axis=-1, keepdims=True)
        return _truncate(logits, logits >= top - _col(self.n) * jnp.sqrt(var))


def top_n_sigma(n) -> TopNSigma:
    """Top-nσ (Tang et al. 2024): keep logits >= max logit - ``n`` * their standard deviation.

    The mean and (population) standard deviation run over the tokens still in play (finite
    logits), as llama.cpp does, so the rule is well defined after another truncation.
    """
    return TopNSigma(_setting("top_n_sigma", "n", n, lambda v: v > 0, "be > 0"))


# ----------------------------------------------------------------------------- penalties


def _prompt_counts(prompt, lengths, V: int):
    """[B, V] int32: how often each token occurs in the real part of each prompt row."""
    prompt = jnp.asarray(prompt, jnp.int32)
    B, P = prompt.shape
    real = (jnp.arange(P)[None, :] < jnp.asarray(lengths)[:, None]).astype(jnp.int32)
    return jnp.zeros((B, V), jnp.int32).at[jnp.arange(B)[:, None], prompt].add(real)


def _count(counts, token):
    B = counts.shape[0]
    return counts.at[jnp.arange(B), jnp.asarray(token, jnp.int32)].add(1)


@_rule
class RepetitionPenalty(Rule):
    theta: jax.Array  # [] or [B] float32 > 0

    def init(self, prompt, lengths, V, max_new):
        return _prompt_counts(prompt, lengths, V) > 0  # seen [B, V] bool

    def apply(self, logits, state):
        theta = _col(self.theta)
        penalized = jnp.where(logits > 0, logits / theta, logits * theta)
        return jnp.where(state, penalized, logits)

    def update(self, state, token):
        B = state.shape[0]
        return state.at[jnp.arange(B), jnp.asarray(token, jnp.int32)].set(True)


def repetition_penalty(theta) -> RepetitionPenalty:
    """CTRL's repetition penalty (Keskar et al. 2019), for tokens seen in prompt or output.

    Positive logits are divided by ``theta``, negative ones multiplied, as Hugging Face's
    ``RepetitionPenaltyLogitsProcessor``.
    """
    return RepetitionPenalty(_setting("repetition_penalty", "theta", theta, lambda v: v > 0,
                                      "be > 0"))


@_rule
class FrequencyPenalty(Rule):
    f: jax.Array  # [] or [B] float32, finite

    def init(self, prompt, lengths, V, max_new):
        return jnp.zeros((jnp.shape(prompt)[0], V), jnp.int32)  # generated counts [B, V]

    def apply(self, logits, state):
        return logits - state.astype(jnp.float32) * _col(self.f)

    def update(self, state, token):
        return _count(state, token)


def frequency_penalty(f) -> FrequencyPenalty:
    """OpenAI's frequency penalty: subtract ``f`` times a token's count in the generated text."""
    return FrequencyPenalty(_setting("frequency_penalty", "f", f, np.isfinite, "be finite"))


@_rule
class PresencePenalty(Rule):
    p: jax.Array  # [] or [B] float32, finite

    def init(self, prompt, lengths, V, max_new):
        return jnp.zeros((jnp.shape(prompt)[0], V), jnp.int32)  # generated counts [B, V]

    def apply(self, logits, state):
        return logits - (state > 0).astype(jnp.float32) * _col(self.p)

    def update(self, state, token):
        return _count(state, token)


def presence_penalty(p) -> PresencePenalty:
    """OpenAI's presence penalty: subtract ``p`` from every token already generated."""
    return PresencePenalty(_setting("presence_penalty", "p", p, np.isfinite, "be finite"))


class History(NamedTuple):
    """Each row's tokens so far, prompt then generated: ``tokens`` [B, P + max_new] int32
    (left-aligned, real up to ``length``), ``length`` [B] int32."""

    tokens: jax.Array
    length: jax.Array


@_rule
class NoRepeatNGram(Rule):
    n: int = _static()

    def init(self, prompt, lengths, V, max_new):
        prompt = jnp.asarray(prompt, jnp.int32)
        return History(jnp.pad(prompt, ((0, 0), (0, max_new))), jnp.asarray(lengths, jnp.int32))

    def apply(self, logits, state):
        tokens, length = state
        B, N = tokens.shape
        V, n = logits.shape[-1], self.n
        if N < n:  # no n-gram fits in the buffer
            return logits
        M = N - n + 1  # start positions of candidate n-grams
        match = jnp.arange(M)[None, :] <= (length[:, None] - n)  # [B, M] lies in the history
        for j in range(n - 1):  # its first n-1 tokens equal the last n-1 of the history
            at = jnp.clip(length - (n - 1) + j, 0, N - 1)[:, None]
            match &= tokens[:, j:j + M] == jnp.take_along_axis(tokens, at, axis=1)
        completes = tokens[:, n - 1:n - 1 + M]  # [B, M] the token each n-gram ends with
        banned = jnp.zeros((B, V), jnp.int32).at[jnp.arange(B)[:, None], completes].max(
            match.astype(jnp.int32)) > 0
        keep = ~banned
        # if every token in play is banned, fall back to the argmax rather than no token at all
        empty = ~jnp.any(keep & jnp.isfinite(logits), axis=-1, keepdims=True)
        return _truncate(logits, keep | (empty & _is_first_max(logits)))

    def update(self, state, token):
        tokens, length = state
        B = tokens.shape[0]
        tokens = tokens.at[jnp.arange(B), length].set(jnp.asarray(token, jnp.int32), mode="drop")
        return History(tokens, length + 1)


def no_repeat_ngram(n: int) -> NoRepeatNGram:
    """Ban every token that would complete an n-gram already in prompt + output.

    As Hugging Face's ``NoRepeatNGramLogitsProcessor`` (from the n-gram blocking of Paulus,
    Xiong, Socher 2018). ``n`` changes shapes and is static. If every token is banned, the
    argmax is kept so that the distribution is never empty.
    """
    if _is_tracer(n):
        raise RuleError("no_repeat_ngram: n must be a concrete integer >= 1 (it is static)")
    _setting("no_repeat_ngram", "n", n, lambda v: v >= 1, "be an integer >= 1", integer=True)
    if np.ndim(n) != 0:
        raise RuleError(f"no_repeat_ngram: n must be a single integer >= 1, got shape {np.shape(n)}")
    return NoRepeatNGram(int(n))


# ----------------------------------------------------------------------------- composition


@_rule
class Chain(Rule):
    rules: tuple  # of Rule

    def init(self, prompt, lengths, V, max_new):
        return tuple(r.init(prompt, lengths, V, max_new) for r in self.rules)

    def apply(self, logits, state):
        for r, s in zip(self.rules, state, strict=True):
            logits = r.apply(logits, s)
        return logits

    def update(self, state, token):
        return tuple(r.update(s, token) for r, s in zip(self.rules, state, strict=True))


def chain(*rules: Rule) -> Chain:
    """Apply ``rules`` in order; the state is the tuple of their states (as ``optax.chain``)."""
    for i, r in enumerate(rules):
        if not isinstance(r, Rule):
            raise RuleError(f"chain: argument {i} must be a Rule, got {type(r).__name__}")
    return Chain(tuple(rules))


__all__ = [
    "Chain",
    "Epsilon",
    "Eta",
    "FrequencyPenalty",
    "History",
    "MinP",
    "NoRepeatNGram",
    "PresencePenalty",
    "RepetitionPenalty",
    "Rule",
    "RuleError",
    "Temperature",
    "TopK",
    "TopNSigma",
    "TopP",
    "Typical",
    "chain",
    "epsilon",
    "eta",
    "frequency_penalty",
    "greedy",
    "min_p",
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
