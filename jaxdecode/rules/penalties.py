"""Penalty rules: repetition, frequency and presence penalties, and n-gram blocking."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.rules.base import (
    Rule,
    RuleError,
    check_setting,
    column,
    is_first_max,
    is_tracer,
    rule_class,
    static_field,
    truncate,
    unless_neutral,
)


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


@rule_class
class RepetitionPenalty(Rule):
    theta: jax.Array  # [] or [B] float32 > 0

    def init(self, prompt, lengths, V, max_new):
        return _prompt_counts(prompt, lengths, V) > 0  # seen [B, V] bool

    def apply(self, logits, state):
        theta = column(self.theta)

        def penalize(logits):
            penalized = jnp.where(logits > 0, logits / theta, logits * theta)
            return jnp.where(state, penalized, logits)

        return unless_neutral(theta == 1, logits, penalize)

    def update(self, state, token):
        B = state.shape[0]
        return state.at[jnp.arange(B), jnp.asarray(token, jnp.int32)].set(True)


def repetition_penalty(theta) -> RepetitionPenalty:
    """CTRL's repetition penalty (Keskar et al. 2019), for tokens seen in prompt or output.

    Positive logits are divided by ``theta``, negative ones multiplied, as Hugging Face's
    ``RepetitionPenaltyLogitsProcessor``.
    """
    return RepetitionPenalty(check_setting("repetition_penalty", "theta", theta, lambda v: v > 0,
                                      "be > 0"))


@rule_class
class FrequencyPenalty(Rule):
    f: jax.Array  # [] or [B] float32, finite

    def init(self, prompt, lengths, V, max_new):
        return jnp.zeros((jnp.shape(prompt)[0], V), jnp.int32)  # generated counts [B, V]

    def apply(self, logits, state):
        f = column(self.f)
        return unless_neutral(f == 0, logits, lambda logits: logits - state.astype(jnp.float32) * f)

    def update(self, state, token):
        return _count(state, token)


def frequency_penalty(f) -> FrequencyPenalty:
    """OpenAI's frequency penalty: subtract ``f`` times a token's count in the generated text."""
    return FrequencyPenalty(check_setting("frequency_penalty", "f", f, np.isfinite, "be finite"))


@rule_class
class PresencePenalty(Rule):
    p: jax.Array  # [] or [B] float32, finite

    def init(self, prompt, lengths, V, max_new):
        return jnp.zeros((jnp.shape(prompt)[0], V), jnp.int32)  # generated counts [B, V]

    def apply(self, logits, state):
        p = column(self.p)
        return unless_neutral(p == 0, logits, lambda logits: logits - (state > 0).astype(jnp.float32) * p)

    def update(self, state, token):
        return _count(state, token)


def presence_penalty(p) -> PresencePenalty:
    """OpenAI's presence penalty: subtract ``p`` from every token already generated."""
    return PresencePenalty(check_setting("presence_penalty", "p", p, np.isfinite, "be finite"))


class History(NamedTuple):
    """Each row's tokens so far, prompt then generated: ``tokens`` [B, P + max_new] int32
    (left-aligned, real up to ``length``), ``length`` [B] int32."""

    tokens: jax.Array
    length: jax.Array


@rule_class
class NoRepeatNGram(Rule):
    n: int = static_field()

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
        return truncate(logits, keep | (empty & is_first_max(logits)))

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
    if is_tracer(n):
        raise RuleError("no_repeat_ngram: n must be a concrete integer >= 1 (it is static)")
    check_setting("no_repeat_ngram", "n", n, lambda v: v >= 1, "be an integer >= 1", integer=True)
    if np.ndim(n) != 0:
        raise RuleError(f"no_repeat_ngram: n must be a single integer >= 1, got shape {np.shape(n)}")
    return NoRepeatNGram(int(n))
