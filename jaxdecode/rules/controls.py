"""Logit controls: a bias added to the logits, the tokens allowed, bad words, a minimum length.

OpenAI's ``logit_bias``, and vLLM's ``allowed_token_ids``, ``bad_words`` and ``min_tokens``, as
rules. Their settings hold a value per token, so unlike the other rules' they are vectors: a bias
or a mask ``[V]`` for every row, or one per row ``[B, V]``; the bad words' token ids ``[W, L]`` or
``[B, W, L]``. ``rule.neutral()`` is the same rule with the setting that leaves every logit exactly
unchanged (zero bias, every token allowed, no bad word, ``m = 0``), of the same shapes: the engine
runs a row that does not use a control at it. :func:`jaxdecode.rules.per_row` broadcasts the
settings to one per row.

A control that removes tokens never leaves a row empty: if every token still in play is removed,
the row keeps its most probable one (as :func:`~jaxdecode.rules.no_repeat_ngram` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.rules.base import (
    NEG_INF,
    Rule,
    RuleError,
    check_setting,
    column,
    is_first_max,
    is_tracer,
    rule_class,
    static_field,
    unless_neutral,
)

# The most bad-word token sequences a row holds (a word with and without a leading space counts
# twice, as in vLLM, whose limit this is) and the most tokens one may have: the shape of every
# BadWords setting, so that requests with bad words share one engine batch.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 32
NO_TOKEN = -1  # pads a bad word's ids on the left
NOT_GENERATED = -2  # a place in the history before the first generated token


def _ban(logits, banned):
    """-inf where ``banned`` [B, V]; a row left with no token in play keeps its argmax."""
    out = jnp.where(banned, NEG_INF, logits)
    empty = ~jnp.any(jnp.isfinite(out), axis=-1, keepdims=True)
    return jnp.where(empty & is_first_max(logits), logits, out)


def _rows(x, ndim: int, B: int):
    """A setting of one row (rank ``ndim``) or one per row, as ``[B, ...]``."""
    return jnp.broadcast_to(x, (B,) + x.shape[-ndim:]) if x.ndim == ndim else x


def _vector(rule: str, name: str, value, dtype, ndim: int = 1):
    """A concrete vector setting as a numpy array of ``dtype``: rank ``ndim`` (one for every row)
    or ``ndim + 1`` (one per row); traced settings are taken as they are."""
    if is_tracer(value):
        return jnp.asarray(value, dtype)
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - anything numpy cannot read is a bad setting
        raise RuleError(f"{rule}: {name} must be an array, got {type(value).__name__}") from None
    if arr.ndim not in (ndim, ndim + 1) or arr.size == 0:
        raise RuleError(f"{rule}: {name} must have {ndim} or {ndim + 1} dimensions (one for every row, or "
                        f"one per row), got shape {arr.shape}")
    if dtype is bool and arr.dtype != bool:
        raise RuleError(f"{rule}: {name} must be an array of True/False, got {arr.dtype}")
    if dtype is not bool and (arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer)
                                                        or np.issubdtype(arr.dtype, np.floating))):
        raise RuleError(f"{rule}: {name} must be an array of numbers, got {arr.dtype}")
    return arr.astype(dtype)


class _Control(Rule):
    """A rule whose settings hold one value per token; ``ROW_NDIM``: each setting's name and rank
    for one row."""

    ROW_NDIM: tuple = ()

    def neutral(self):
        """The same rule with the settings that leave every logit exactly unchanged."""
        raise NotImplementedError

    def per_row(self, B: int):
        """The rule with every setting broadcast to one per row (``[B, ...]``)."""
        return dataclasses.replace(self, **{
            name: np.broadcast_to(np.asarray(v), (B,) + np.shape(v)[np.ndim(v) - nd:])
            if not is_tracer(v) else jnp.broadcast_to(v, (B,) + v.shape[v.ndim - nd:])
            for name, nd in self.ROW_NDIM for v in [getattr(self, name)]})


# ----------------------------------------------------------------------------- logit bias


@rule_class
class LogitBias(_Control):
    bias: jax.Array  # [V] or [B, V] float32, finite

    ROW_NDIM = (("bias", 1),)

    def apply(self, logits, state):
        bias = _rows(self.bias, 1, logits.shape[0])
        # where the bias is 0 the logit is left as it is (x + 0.0 would turn -0.0 into 0.0)
        return jnp.where(bias != 0, logits + bias, logits)

    def neutral(self):
        return LogitBias(np.zeros(np.shape(self.bias), np.float32))


def logit_bias(bias) -> LogitBias:
    """OpenAI's logit bias: ``bias`` (``[V]``, or one per row ``[B, V]``) added to the logits.

    (OpenAI's API takes biases between -100 and 100; :class:`~jaxdecode.DecodeParams` clamps its
    ``logit_bias`` to them. The rule adds any finite value.)"""
    bias = _vector("logit_bias", "bias", bias, np.float32)
    if not is_tracer(bias) and not np.isfinite(bias).all():
        raise RuleError(f"logit_bias: bias must be finite, got {bias[~np.isfinite(bias)][0]}")
    return LogitBias(bias)


# ----------------------------------------------------------------------------- allowed tokens


@rule_class
class AllowedTokens(_Control):
    allowed: jax.Array  # [V] or [B, V] bool

    ROW_NDIM = (("allowed", 1),)

    def apply(self, logits, state):
        return _ban(logits, ~_rows(self.allowed, 1, logits.shape[0]))

    def neutral(self):
        return AllowedTokens(np.ones(np.shape(self.allowed), bool))


def allowed_tokens(allowed) -> AllowedTokens:
    """Only the tokens where ``allowed`` (``[V]`` bool, or one per row ``[B, V]``) is True may be
    chosen: vLLM's ``allowed_token_ids`` as a mask."""
    allowed = _vector("allowed_tokens", "allowed", allowed, bool)
    if not is_tracer(allowed) and not allowed.any(axis=-1).all():
        raise RuleError("allowed_tokens: every row must allow at least one token")
    return AllowedTokens(allowed)


# ----------------------------------------------------------------------------- bad words


@rule_class
class BadWords(_Control):
    """Token sequences that may not be completed, as vLLM's ``bad_words``: ``words`` [W, L] (or
    [B, W, L]) int32, each sequence right-aligned and padded on the left with -1, a row of -1 for
    no word; ``shape`` (W, L) is static, so that rules of other shapes are other kinds. The state
    is each row's last L - 1 generated tokens (-2 before the first)."""

    words: jax.Array
    shape: tuple = static_field()

    ROW_NDIM = (("words", 2),)

    def init(self, prompt, lengths, V, max_new):
        return jnp.full((jnp.shape(prompt)[0], self.shape[1] - 1), NOT_GENERATED, jnp.int32)

    def apply(self, logits, state):
        B, V = logits.shape
        words = _rows(self.words, 2, B)  # [B, W, L]
        prefix, last = words[:, :, :-1], words[:, :, -1]

        def ban(logits):
            # a sequence's first tokens are the row's last generated ones (the padding matches anything)
            done = jnp.all((prefix == NO_TOKEN) | (prefix == state[:, None, :]), axis=-1) & (last >= 0)  # [B, W]
            ids = jnp.where(done, last, V)  # V: nothing (dropped)
            banned = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], ids].set(True, mode="drop")
            return _ban(logits, banned)

        return unless_neutral(last < 0, logits, ban)

    def update(self, state, token):
        if state.shape[1] == 0:
            return state
        return jnp.concatenate([state[:, 1:], jnp.asarray(token, jnp.int32)[:, None]], axis=1)

    def neutral(self):
        return BadWords(np.full(np.shape(self.words), NO_TOKEN, np.int32), self.shape)


def bad_words(sequences: Sequence[Sequence[int]],
              shape: tuple[int, int] = (MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS)) -> BadWords:
    """Ban the last token of each token sequence in ``sequences`` where the row's last generated
    tokens are the rest of it (a one-token sequence is always banned): vLLM's ``bad_words`` on
    their token ids (:func:`bad_word_ids` encodes words as vLLM does). The same sequences for
    every row; ``shape``: at most W sequences of at most L tokens."""
    W, L = shape
    seqs = [list(s) for s in sequences]
    if len(seqs) > W:
        raise RuleError(f"bad_words: {len(seqs)} token sequences, at most {W}")
    words = np.full((W, L), NO_TOKEN, np.int32)
    for i, s in enumerate(seqs):
        if not s or len(s) > L:
            raise RuleError(f"bad_words: a sequence must have 1 to {L} tokens, got {len(s)}")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0 for t in s):
            raise RuleError(f"bad_words: token ids must be integers >= 0, got {s}")
        words[i, L - len(s):] = s
    return BadWords(words, (W, L))


def bad_word_ids(vocab, words: Sequence[str]) -> list[list[int]]:
    """Words as the token sequences vLLM bans for them: each word, its leading white space
    stripped, encoded alone, and with one space before it where that gives as many tokens and a
    different first token (a BPE vocabulary's word in the middle of a text); no special tokens.
    A word the vocabulary cannot encode (a character outside a character model's vocabulary) can
    never be written, and bans nothing."""
    encode = vocab.encode_piece if hasattr(vocab, "encode_piece") else vocab.encode
    out: list[list[int]] = []
    for word in words:
        word = word.lstrip()
        try:
            plain = [int(t) for t in encode(word)]
        except ValueError:
            continue
        if not plain:
            continue
        out.append(plain)
        try:
            spaced = [int(t) for t in encode(" " + word)]
        except ValueError:
            continue
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


# ----------------------------------------------------------------------------- min_tokens


@rule_class
class MinTokens(_Control):
    """No token of ``ends`` (``[V]`` or ``[B, V]`` bool: the end tokens and stop token ids) before
    ``m`` (``[]`` or ``[B]`` int32) new tokens. The state counts each row's new tokens."""

    m: jax.Array
    ends: jax.Array

    ROW_NDIM = (("m", 0), ("ends", 1))

    def init(self, prompt, lengths, V, max_new):
        return jnp.zeros((jnp.shape(prompt)[0],), jnp.int32)

    def apply(self, logits, state):
        early = state[:, None] < column(self.m)  # [B, 1]
        return unless_neutral(~early, logits, lambda logits: _ban(logits, early & _rows(self.ends, 1, logits.shape[0])))

    def update(self, state, token):
        return state + 1

    def neutral(self):
        return MinTokens(np.zeros(np.shape(self.m), np.int32), np.zeros(np.shape(self.ends), bool))


def min_tokens(m, ends) -> MinTokens:
    """vLLM's ``min_tokens``: the tokens where ``ends`` is True (``[V]``, or one per row ``[B, V]``)
    are removed until a row has ``m`` new tokens (``m``: one count, or one per row)."""
    m = check_setting("min_tokens", "m", m, lambda v: v >= 0, "be an integer >= 0", integer=True)
    return MinTokens(m, _vector("min_tokens", "ends", ends, bool))
