"""Log-probabilities of given continuations under the model, in batched passes.

The semantics are the book's: the log-probability of the token at index ``t`` is read from the
model run on the last ``T`` tokens before it. Up to ``T`` tokens that is one forward over the
whole text; every position past ``T`` gets its own window (batched).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.decoding import budget as budget_lib
from jaxdecode.decoding.params import SCORE, DecodeParams, resolve
from jaxdecode.models.base import DecodingModel

WIDTH_BUCKET = 64
WINDOW_BATCH = 64


@dataclasses.dataclass
class Score:
    prompt: str
    text: str
    logprobs: np.ndarray  # [tokens of text] natural-log probability of each token of text
    in_language: bool | None = None  # the text is in the constraint's language (None: no constraint)

    @property
    def mean_logprob(self) -> float:
        """Mean log-probability per token (per character for the character model; nats): the book's score."""
        return float(np.mean(self.logprobs)) if len(self.logprobs) else float("nan")

    @property
    def probabilities(self) -> np.ndarray:
        """The probability the model gave each token."""
        return np.exp(self.logprobs)


@functools.partial(jax.jit, static_argnames=("model", "top"))
def _token_logprobs(params, tokens, *, model: DecodingModel, top: int = 0):
    """[B, W] tokens -> [B, W-1] log p(tokens[:, t+1] | tokens[:, :t+1]) for W <= T + 1: one pass
    of the whole rows through an empty cache. With ``top`` > 0 also, from the same pass, the
    ``top`` most probable tokens at each position ([B, W-1, top] log-probabilities and ids) and
    each token's rank (1: the most probable)."""
    B, W = tokens.shape
    logits, _, _ = model.extend(params, model.empty_cache(B, W - 1), tokens[:, :-1])
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    if not top:
        return chosen
    values, ids = jax.lax.top_k(lp, top)
    return chosen, values, ids, 1 + jnp.sum(lp > chosen[..., None], axis=-1)


def prompt_logprobs(model: DecodingModel, params, sequences: Sequence[np.ndarray], top: int):
    """For each token sequence of 2 to ``T + 1`` tokens, from one pass: the log-probability of
    every token after the first (as :func:`token_logprobs` from index 1), the ``top`` most probable
    tokens at each of those positions, and each token's rank. ``[(logprobs [n], top_logprobs
    [n, top], top_ids [n, top], ranks [n])]``, n the sequence's length less one."""
    T, out = model.T, []
    for i, s in enumerate(sequences):
        if not 2 <= len(s) <= T + 1:
            raise ValueError(f"sequence {i}: give 2 to {T + 1} tokens, got {len(s)}")
    for s in sequences:  # one row each, the width bucketed as token_logprobs buckets it
        W = min(T + 1, -(-len(s) // WIDTH_BUCKET) * WIDTH_BUCKET)
        row = np.zeros((1, W), np.int32)
        row[0, :len(s)] = s
        parts = _token_logprobs(params, jnp.asarray(row), model=model, top=max(1, top))
        n = len(s) - 1
        out.append(tuple(np.asarray(x)[0, :n] for x in parts))
    return [(lp, vals[:, :top], ids[:, :top], rank) for lp, vals, ids, rank in out]


@functools.partial(jax.jit, static_argnames=("model",))
def _window_logprobs(params, windows, targets, *, model: DecodingModel):
    """[N, T] windows (each the T tokens before its target) -> [N] log-probabilities."""
    N, T = windows.shape
    logits, _ = model.window(params, windows, jnp.full((N,), T, jnp.int32))
    lp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]


def token_logprobs(model: DecodingModel, params, sequences: Sequence[np.ndarray], starts: Sequence[int], *,
                   memory_budget: int | str | None = None, max_rows: int | None = None):
    """For each token sequence, the log-probability under ``model`` of every token from index
    ``start`` on (past the window ``T``, each from the ``T`` tokens before it). Any number of
    sequences runs in batches that fit ``memory_budget`` (see :mod:`jaxdecode.decoding.budget`)."""
    T = model.T
    if len(sequences) != len(starts):
        raise ValueError(f"{len(starts)} starts for {len(sequences)} sequences")
    for i, s in enumerate(sequences):
        s = np.asarray(s)
        if s.ndim != 1 or len(s) < 2:
            raise ValueError(f"sequence {i}: give at least two tokens (a context and a token to score)")
        if s.min() < 0 or s.max() >= model.V:
            raise ValueError(f"sequence {i}: token ids must lie in [0, {model.V}), got min {s.min()} max {s.max()}")
        if not 1 <= starts[i] < len(s):
            raise ValueError(f"sequence {i}: scoring starts at index {starts[i]}; it must lie in [1, {len(s)})")
    out = []
    # positions t <= T: one forward over the first min(len, T + 1) tokens, batched and bucketed
    heads = [np.asarray(s[:T + 1], np.int32) for s in sequences]
    W = min(T + 1, max(2, -(-max(len(h) for h in heads) // WIDTH_BUCKET) * WIDTH_BUCKET))
    # in batches that fit the memory budget (jaxdecode.decoding.budget): a row holds its cache, the
    # attention scores and the log-softmax over W positions
    scores = 4 * model.attention_heads * W * W
    per_row = budget_lib.SAFETY * (budget_lib.cache_bytes(model, 1, W) + scores + 12 * W * model.V)
    size = budget_lib.rows_per_batch(int(per_row), memory_budget, max_rows)
    first = np.zeros((len(heads), W - 1), np.float32)
    for part in budget_lib.groups(len(heads), size):
        B = len(part)
        Bb = 1 << max(0, (B - 1).bit_length())
        batch = np.zeros((Bb, W), np.int32)
        for j, i in enumerate(part):
            batch[j, :len(heads[i])] = heads[i]
        first[part.start:part.stop] = np.asarray(_token_logprobs(params, jnp.asarray(batch), model=model))[:B]
    # positions t > T: the book's window of the T tokens before t
    windows, targets, owner = [], [], []
    for i, s in enumerate(sequences):
        for t in range(max(T + 1, starts[i]), len(s)):
            windows.append(s[t - T:t])
            targets.append(s[t])
            owner.append(i)
    late = np.zeros((len(windows),), np.float32)
    for j in range(0, len(windows), WINDOW_BATCH):
        w = np.zeros((WINDOW_BATCH, T), np.int32)
        tg = np.zeros((WINDOW_BATCH,), np.int32)
        part = windows[j:j + WINDOW_BATCH]
        w[:len(part)] = np.stack(part)
        tg[:len(part)] = targets[j:j + WINDOW_BATCH]
        late[j:j + len(part)] = np.asarray(_window_logprobs(params, jnp.asarray(w), jnp.asarray(tg), model=model))[:len(part)]
    owner = np.asarray(owner)
    for i, s in enumerate(sequences):
        start = starts[i]
        if start < 1:
            raise ValueError("scoring starts at index 1 or later: the first token has no context")
        early = first[i, start - 1:min(len(s), T + 1) - 1]
        out.append(np.concatenate([early, late[owner == i]]).astype(np.float32))
    return out


def score_texts(lm, texts: Sequence[str], prompts: Sequence[str] | None = None,
                params: DecodeParams | None = None, **overrides) -> list[Score]:
    """Score each text as a continuation of its prompt (default: a newline, the corpus's separator).
    ``params``: a :class:`~jaxdecode.decoding.params.DecodeParams` (keywords override its fields);
    scoring honours ``constraint`` (each score then also says whether its text, as the vocabulary
    encodes it, is in the pattern's language: ``in_language``), ``memory_budget`` and
    ``max_rows``. A text and a prompt may also be given as one string each."""
    if params is not None and not isinstance(params, DecodeParams):  # a constraint, as the fourth argument was
        overrides = {"constraint": params} | overrides
        params = None
    settings = resolve(params, overrides, SCORE)
    constraint = settings.constraint
    texts = [texts] if isinstance(texts, str) else list(texts)
    prompts = [prompts] if isinstance(prompts, str) else prompts
    if not texts:
        raise ValueError("no texts to score")
    prompts = list(prompts) if prompts is not None else ["\n"] * len(texts)
    if len(prompts) != len(texts):
        raise ValueError(f"{len(prompts)} prompts for {len(texts)} texts")
    prompts = [p if p else "\n" for p in prompts]
    seqs, starts = [], []
    for p, t in zip(prompts, texts):
        if not t:
            raise ValueError("the text to score is empty")
        prompt = lm.vocab.encode(p)
        # the continuation is a piece inside a sequence: no special tokens of its own (a BOS)
        seqs.append(np.concatenate([prompt, getattr(lm.vocab, "encode_piece", lm.vocab.encode)(t)]))
        starts.append(len(prompt))
    lps = token_logprobs(lm.decoder, lm.params, seqs, starts, memory_budget=settings.memory_budget,
                         max_rows=settings.max_rows)
    member = [None if constraint is None else constraint.accepts(s[st:]) for s, st in zip(seqs, starts)]
    return [Score(prompt=p, text=t, logprobs=lp, in_language=m) for p, t, lp, m in zip(prompts, texts, lps, member)]
