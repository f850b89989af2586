"""Temperature and the truncation rules (top-k, top-p, min-p, typical, epsilon, eta, top-n-sigma)."""

from __future__ import annotations


import jax
import jax.numpy as jnp

from jaxdecode.rules.base import (
    Rule,
    check_setting,
    column,
    entropy,
    is_first_max,
    processed_logprobs,
    rank_and_sorted,
    rule_class,
    softmax,
    truncate,
    unless_neutral,
)


# ----------------------------------------------------------------------------- temperature


@rule_class
class Temperature(Rule):
    t: jax.Array  # [] or [B] float32; 0 means greedy

    def apply(self, logits, state):
        t = column(self.t)
        greedy = t == 0
        scaled = logits / jnp.where(greedy, 1.0, t)
        return jnp.where(greedy, truncate(logits, is_first_max(logits)), scaled)


def temperature(t) -> Temperature:
    """Divide the logits by ``t``; ``t = 0`` keeps only the (first) argmax, i.e. greedy decoding.

    Sampling from the Boltzmann distribution at temperature ``t``, as in the Boltzmann machine
    of Ackley, Hinton and Sejnowski (1985).
    """
    return Temperature(check_setting("temperature", "t", t, lambda v: v >= 0, "be >= 0"))


def greedy() -> Temperature:
    """Keep only the most probable token: ``temperature(0)``."""
    return temperature(0.0)


# ----------------------------------------------------------------------------- truncation


@rule_class
class TopK(Rule):
    k: jax.Array  # [] or [B] int32 >= 1

    def apply(self, logits, state):
        B, V = logits.shape
        k = jnp.clip(column(self.k), 1, V)  # k > V keeps every token

        def cut(logits):
            desc = -jnp.sort(-logits, axis=-1)  # [B, V]
            kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, (B, 1)), axis=-1)  # [B, 1]
            return truncate(logits, logits >= kth)  # ties with the k-th are kept

        return unless_neutral(k >= V, logits, cut)


def top_k(k) -> TopK:
    """Keep the ``k`` most probable tokens, and any tied with the k-th (Fan, Lewis, Dauphin 2018)."""
    return TopK(check_setting("top_k", "k", k, lambda v: v >= 1, "be an integer >= 1", integer=True))


@rule_class
class TopP(Rule):
    p: jax.Array  # [] or [B] float32 in (0, 1]

    def apply(self, logits, state):
        p = column(self.p)

        def cut(logits):
            rank, probs = rank_and_sorted(logits, softmax(logits))  # [B, V] each, probs in rank order
            before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more probable tokens
            # p = 1 keeps everything: in exact arithmetic no token's preceding mass reaches 1
            drop_sorted = (before >= p) & (p < 1)
            drop = jnp.take_along_axis(drop_sorted, rank, axis=-1)  # back to vocabulary order
            return truncate(logits, ~drop)

        return unless_neutral(p >= 1, logits, cut)


def top_p(p) -> TopP:
    """Nucleus sampling (Holtzman et al. 2020): the smallest set of tokens with mass >= ``p``.

    Tokens are ranked by probability (ties by index); a token is dropped when the tokens ranked
    before it already hold mass ``p``.
    """
    return TopP(check_setting("top_p", "p", p, lambda v: (v > 0) & (v <= 1), "lie in (0, 1]"))


@rule_class
class MinP(Rule):
    ratio: jax.Array  # [] or [B] float32 in [0, 1]

    def apply(self, logits, state):
        def cut(logits):
            top = jnp.max(logits, axis=-1, keepdims=True)
            # p_i / p_max = exp(z_i - z_max): no softmax needed
            return truncate(logits, jnp.exp(logits - top) >= column(self.ratio))

        return unless_neutral(column(self.ratio) <= 0, logits, cut)


def min_p(ratio) -> MinP:
    """Min-p sampling (Nguyen et al. 2024): drop tokens with probability < ``ratio`` * the top one."""
    return MinP(check_setting("min_p", "ratio", ratio, lambda v: (v >= 0) & (v <= 1), "lie in [0, 1]"))


@rule_class
class Typical(Rule):
    mass: jax.Array  # [] or [B] float32 in (0, 1]

    def apply(self, logits, state):
        return unless_neutral(column(self.mass) >= 1, logits, self._cut)

    def _cut(self, logits):
        _B, V = logits.shape
        mass = column(self.mass)
        logp = processed_logprobs(logits)
        ent = entropy(logp)[:, None]  # [B, 1]
        score = jnp.abs(-logp - ent)  # |surprisal - entropy|, inf for removed tokens
        order = jnp.argsort(score, axis=-1, stable=True)  # [B, V] most typical first
        sorted_score = jnp.take_along_axis(score, order, axis=-1)
        cum = jnp.cumsum(jnp.take_along_axis(jnp.exp(logp), order, axis=-1), axis=-1)
        last = jnp.minimum(jnp.sum(cum < mass, axis=-1, keepdims=True), V - 1)  # [B, 1]
        cut = jnp.take_along_axis(sorted_score, last, axis=-1)
        keep = (score <= cut) | (mass >= 1)
        return truncate(logits, keep)


def typical(mass) -> Typical:
    """Locally typical sampling (Meister, Pimentel, Wiher, Cotterell 2023).

    Rank tokens by ``|-log p - H|`` (H the entropy) and keep the smallest most-typical prefix
    whose mass reaches ``mass`` (and tokens tied with its last), at least one token. As
    Hugging Face's ``TypicalLogitsWarper``; this can drop the most probable token.
    """
    return Typical(check_setting("typical", "mass", mass, lambda v: (v > 0) & (v <= 1),
                            "lie in (0, 1]"))


@rule_class
class Epsilon(Rule):
    eps: jax.Array  # [] or [B] float32 in [0, 1)

    def apply(self, logits, state):
        keep = softmax(logits) >= column(self.eps)
        top = jnp.max(logits, axis=-1, keepdims=True)
        return truncate(logits, keep | (logits >= top))


def epsilon(eps) -> Epsilon:
    """Epsilon sampling (Hewitt, Manning, Liang 2022): keep tokens with probability >= ``eps``.

    The most probable token is always kept, as in Hugging Face's ``EpsilonLogitsWarper``.
    """
    return Epsilon(check_setting("epsilon", "eps", eps, lambda v: (v >= 0) & (v < 1),
                            "lie in [0, 1)"))


@rule_class
class Eta(Rule):
    eta: jax.Array  # [] or [B] float32 in [0, 1)

    def apply(self, logits, state):
        logp = processed_logprobs(logits)
        eta = column(self.eta)
        ent = entropy(logp)[:, None]  # nats
        threshold = jnp.minimum(eta, jnp.sqrt(eta) * jnp.exp(-ent))
        top = jnp.max(logits, axis=-1, keepdims=True)
        return truncate(logits, (jnp.exp(logp) >= threshold) | (logits >= top))


def eta(eta) -> Eta:
    """Eta sampling (Hewitt, Manning, Liang 2022): threshold ``min(eta, sqrt(eta) * exp(-H))``.

    H is the entropy in nats. The most probable token is always kept, as in Hugging Face's
    ``EtaLogitsWarper``.
    """
    return Eta(check_setting("eta", "eta", eta, lambda v: (v >= 0) & (v < 1), "lie in [0, 1)"))


@rule_class
class TopNSigma(Rule):
    n: jax.Array  # [] or [B] float32 > 0

    def apply(self, logits, state):
        finite = jnp.isfinite(logits)
        count = jnp.maximum(jnp.sum(finite, axis=-1, keepdims=True), 1)
        mean = jnp.sum(jnp.where(finite, logits, 0.0), axis=-1, keepdims=True) / count
        var = jnp.sum(jnp.where(finite, (logits - mean) ** 2, 0.0), axis=-1, keepdims=True) / count
        top = jnp.max(logits, axis=-1, keepdims=True)
        return truncate(logits, logits >= top - column(self.n) * jnp.sqrt(var))


def top_n_sigma(n) -> TopNSigma:
    """Top-nσ (Tang et al. 2024): keep logits >= max logit - ``n`` * their standard deviation.

    The mean and (population) standard deviation run over the tokens still in play (finite
    logits), as llama.cpp does, so the rule is well defined after another truncation.
    """
    return TopNSigma(check_setting("top_n_sigma", "n", n, lambda v: v > 0, "be > 0"))
