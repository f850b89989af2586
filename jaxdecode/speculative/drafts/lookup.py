"""Prompt lookup as the draft: continue an earlier occurrence of the context's last tokens."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxdecode.speculative.drafts.base import Draft, draft_class, no_backoff, static_field


class LookupState(NamedTuple):
    history: jax.Array  # [B, capacity] int32 each row's context, left-aligned
    length: jax.Array  # [B] int32


@draft_class
class PromptLookupDraft(Draft):
    """Continue the most recent earlier occurrence of the context's last ``n`` tokens.

    Deterministic: ``q`` is a point mass on the proposal. The continuation copies the tokens that
    followed the occurrence, reading on into the proposals themselves when it reaches the end of
    the context (so a repeating pattern keeps repeating). Without an occurrence it proposes the
    last token again.
    """

    n: int = static_field()

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"PromptLookupDraft: n must be an integer >= 1, got {self.n!r}")

    def init(self, prompt, lengths, capacity):
        B, P = prompt.shape
        w = min(P, capacity)  # padding may be wider than the capacity, real prompts are not
        history = jnp.zeros((B, capacity), jnp.int32).at[:, :w].set(prompt[:, :w])
        return LookupState(history, jnp.asarray(lengths, jnp.int32))

    def _match_end(self, history, length):
        """[B]: the last index j <= length-2 where history[j-n+1 .. j] equals the context's last
        n tokens; length - 2 (repeat the last token) where there is none."""
        _B, C = history.shape
        j = jnp.arange(C)[None, :]
        match = (j >= self.n - 1) & (j <= length[:, None] - 2) & (length[:, None] >= self.n)
        for i in range(self.n):
            want = jnp.take_along_axis(history, jnp.maximum(length - 1 - i, 0)[:, None], axis=1)
            shifted = jnp.pad(history, ((0, 0), (i, 0)))[:, :C]  # shifted[b, j] = history[b, j-i]
            match &= shifted == want
        found = jnp.any(match, axis=1)
        last = C - 1 - jnp.argmax(match[:, ::-1], axis=1)
        return jnp.where(found, last, length - 2)

    def propose(self, state, noise, gamma, process, span):
        history, length = state
        B = history.shape[0]
        start = self._match_end(history, length)
        rows = jnp.arange(B)
        tokens = []
        for i in range(1, gamma + 1):
            # start + i < length + i - 1: always an earlier context or proposal position
            tok = history[rows, jnp.maximum(start + i, 0)]
            history = history.at[rows, length + i - 1].set(tok, mode="drop")
            tokens.append(tok)
        return jnp.stack(tokens, axis=1), None, state

    def commit(self, state, tokens, n_accepted, token, active):
        history, length = state
        B, _G = tokens.shape
        seq = jnp.concatenate([tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)
        seq = seq.at[jnp.arange(B), n_accepted].set(token)  # [B, G + 1]
        write = jax.vmap(lambda h, s, at: jax.lax.dynamic_update_slice(h, s, (at,)))
        # inactive rows write past their length only (garbage there is never read)
        history = write(history, seq, length)
        return LookupState(history, jnp.where(active, length + n_accepted + 1, length))


def build(lm, data_path=None, *, n: int | None = None, backoff: float | None = None,
           progress: bool = False) -> PromptLookupDraft:
    no_backoff(backoff)
    return PromptLookupDraft(3 if n is None else n)


__all__ = ["LookupState", "PromptLookupDraft"]
