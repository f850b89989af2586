"""A small language model as the draft: its own parameters and KV cache."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxdecode.models.checkpoint import DRAFT_NAME, load
from jaxdecode.models.base import DecodingModel
from jaxdecode.speculative.acceptance import pick_token
from jaxdecode.speculative.drafts.base import Draft, draft_class, no_backoff, static_field


class ModelDraftState(NamedTuple):
    cache: Any  # the draft model's cache: the context without its last npend tokens
    pending: jax.Array  # [B, 2] int32 tokens of the context not yet in the cache (npend of them)
    npend: jax.Array  # [B] int32 1 or 2
    base: jax.Array  # [B] int32 the cache length before the last propose


@draft_class
class ModelDraft(Draft):
    """A small model with its own parameters and cache (same vocabulary as the target): any
    :class:`jaxdecode.models.DecodingModel`, reached only through that interface.

    The cache holds the accepted context except its last one or two tokens, which the next
    :meth:`propose` feeds in a single ``extend`` (two tokens when every proposal was accepted:
    the last proposal itself was never fed to the draft).
    """

    params: Any
    model: DecodingModel = static_field()

    @classmethod
    def from_lm(cls, lm) -> ModelDraft:
        draft = cls(lm.params, lm.decoder)
        # the draft's tokens, for speculative_generate to check against the target's (kept off the
        # pytree: a jitted loop never needs it)
        object.__setattr__(draft, "vocab", lm.vocab)
        return draft

    def check(self, target, need):
        if target.V != self.model.V:
            raise ValueError(f"ModelDraft: the draft model has V={self.model.V}, the target V={target.V}")
        if need > self.model.T:
            raise ValueError(f"ModelDraft: the request needs {need} positions, more than the draft "
                             f"model's window T={self.model.T}")

    def init(self, prompt, lengths, capacity):
        B, P = prompt.shape
        lengths = jnp.asarray(lengths, jnp.int32)
        cache = self.model.prefill_cache(self.params, prompt[:, :min(P, self.model.T)], lengths - 1, capacity)
        last = jnp.take_along_axis(prompt, (lengths - 1)[:, None], axis=1)[:, 0]
        return ModelDraftState(cache, jnp.stack([last, last], axis=1), jnp.ones((B,), jnp.int32),
                               lengths - 1)

    def propose(self, state, noise, gamma, process, span):
        model = self.model
        base = model.lengths(state.cache)
        # rows with one pending token feed it plus a throwaway copy, read the logits at index 0
        # and count one position: the copy lies past the length and is overwritten next step
        logits2, _, cache = model.extend(self.params, state.cache, state.pending, span)
        logits = jnp.take_along_axis(logits2, (state.npend - 1)[:, None, None], axis=1)[:, 0]
        cache = model.truncate(cache, base + state.npend)
        first = process(logits)
        tok = pick_token(first, None if noise is None else noise[:, 0])

        def body(carry, u):
            cache, tok = carry
            logits, _, cache = model.extend(self.params, cache, tok[:, None], span)
            logits = logits[:, 0]
            processed = process(logits)
            nxt = pick_token(processed, u)
            return (cache, nxt), (nxt, processed)

        xs = None if noise is None else jnp.transpose(noise[:, 1:])
        (cache, _), (toks, qs) = jax.lax.scan(body, (cache, tok), xs, length=gamma - 1)
        tokens = jnp.concatenate([tok[:, None], toks.T], axis=1)  # [B, gamma]
        q = jnp.concatenate([first[:, None], jnp.transpose(qs, (1, 0, 2))], axis=1)  # [B, gamma, V]
        return tokens, q, state._replace(cache=cache, base=base)

    def commit(self, state, tokens, n_accepted, token, active):
        G = tokens.shape[1]
        context = state.base + state.npend  # context length (with the pending tokens)
        full = n_accepted == G
        # the cache holds context + proposals 1..G-1; keep context + the accepted ones
        length = jnp.where(full, context + G - 1, context + n_accepted)
        pending = jnp.where(full[:, None], jnp.stack([tokens[:, -1], token], axis=1),
                            jnp.stack([token, token], axis=1))
        npend = jnp.where(full, 2, 1).astype(jnp.int32)
        return ModelDraftState(
            self.model.truncate(state.cache, jnp.where(active, length, state.base)),
            jnp.where(active[:, None], pending, state.pending),
            jnp.where(active, npend, state.npend),
            state.base)


def draft_folder(lm):
    """The draft of ``lm``: the folder ``<name>-draft`` beside its own (as the shipped pairs are
    laid out), else the shipped character draft."""
    path = getattr(lm, "path", None)
    if path is not None:
        sibling = path.parent / f"{path.name}-draft"
        if (sibling / "config.json").is_file():
            return sibling
    return DRAFT_NAME


def load_draft(lm, folder=None) -> ModelDraft:
    """The draft model in ``folder`` (default: :func:`draft_folder`) for target ``lm``; a draft whose
    tokens are not the target's is refused."""
    from jaxdecode.io.vocab import same_vocabulary

    small = load(draft_folder(lm) if folder is None else folder)
    if small.decoder.V != lm.decoder.V or not same_vocabulary(small.vocab, lm.vocab):
        raise ValueError(f"the draft model {folder or draft_folder(lm)} has other tokens than the model "
                         f"({small.decoder.V} against {lm.decoder.V}): a draft must share the model's tokenizer")
    return ModelDraft.from_lm(small)


def build(lm, data_path=None, *, n: int | None = None, backoff: float | None = None,
           progress: bool = False) -> ModelDraft:
    no_backoff(backoff)
    small = load(draft_folder(lm))
    if small.vocab.chars != lm.vocab.chars:
        raise ValueError("the draft model's vocabulary differs from the target's")
    return ModelDraft.from_lm(small)


__all__ = ["ModelDraft", "ModelDraftState", "load_draft"]
