"""The :class:`Draft` interface and the registry of the drafts the library builds by name
(:func:`make_draft`, :data:`DRAFTS`, a :class:`~jaxdecode.io.registry.Registry` of
:class:`DraftSpec`).

A draft module defines its draft class (a pytree made with :func:`draft_class`) and a builder,
``build(lm, data_path=None, *, n=None, backoff=None, progress=False) -> Draft``, that makes the
draft for target ``lm``, reading the corpus (``data_path``, default ``$JAXDECODE_DATA``) or
loading checkpoints as it needs; :data:`DRAFTS` names it (``"ngram:build"``), and the module is
imported when the draft is first built. A draft of one's own is added with
``DRAFTS.add(DraftSpec(...))`` or the :func:`register_draft` decorator.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import jax

from jaxdecode.io.registry import Registry


def draft_class(cls):
    """Make ``cls`` a frozen dataclass and a pytree whose fields marked ``static`` are metadata."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = [f.name for f in fields if not f.metadata.get("static", False)]
    meta = [f.name for f in fields if f.metadata.get("static", False)]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def static_field(**kwargs):
    """A dataclass field that is pytree metadata (static under jit): a setting, not an array."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


class Draft:
    """The interface of a draft. Drafts are pytrees (tables, parameters are leaves), so a jitted
    loop takes them as arguments; shape-changing settings (``n``, the config) are static.

    ``init(prompt [B, P], lengths [B], capacity) -> state``
        state for right-padded prompts; ``capacity`` bounds every position the loop will touch.
    ``propose(state, noise [B, gamma] | None, gamma, process, span)``
    ``-> (tokens [B, gamma], q [B, gamma, V] | None, state)``
        ``gamma`` proposals after each row's accepted context, with the processed logits ``q``
        they were drawn from (``process`` maps raw logits ``[B, V]`` to processed ones). Proposal
        ``j`` is drawn from ``softmax(q_j)`` with the uniform ``noise[:, j]`` (see
        :func:`jaxdecode.speculative.acceptance.pick_token`), or is ``argmax(q_j)`` when ``noise`` is
        ``None`` (greedy decoding). A deterministic draft returns ``q = None`` (a point mass on
        each proposal). ``span`` is the static attended cache span of the segment.
    ``commit(state, tokens [B, gamma], n_accepted [B], token [B], active [B]) -> state``
        advance to the context plus ``tokens[:, :n_accepted]`` plus ``token`` (rolling back
        whatever ``propose`` added beyond that); rows that are not ``active`` keep the state they
        had before ``propose``.
    """

    def check(self, target, need: int) -> None:
        """Raise ValueError if the draft cannot serve the ``target`` decoding model for ``need``
        positions."""

    def init(self, prompt, lengths, capacity: int):
        raise NotImplementedError

    def propose(self, state, noise, gamma: int, process, span: int):
        raise NotImplementedError

    def commit(self, state, tokens, n_accepted, token, active):
        raise NotImplementedError


# ----------------------------------------------------------------------------- the registry

Builder = Callable[..., Draft]


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    """A draft that :func:`make_draft` and the command line build by name.

    ``builder``: ``(lm, data_path=None, *, n=None, backoff=None, progress=False) -> Draft``, or
    where to find one, ``"module:function"`` under :mod:`jaxdecode.speculative.drafts` (imported
    when the draft is first built). ``about``: the one-line description the command line shows.
    """

    name: str
    about: str
    builder: str | Builder

    def build(self, *args, **kwargs) -> Draft:
        builder = self.builder
        if isinstance(builder, str):
            module, _, attr = builder.partition(":")
            builder = getattr(importlib.import_module(f"jaxdecode.speculative.drafts.{module}"), attr)
        return builder(*args, **kwargs)


# In the order the command line lists them.
DRAFTS: Registry[DraftSpec] = Registry("draft kind", (
    DraftSpec("ngram", "an n-gram table counted from the corpus's training split (default: the chapter's "
                       "add-0.01 trigram; n and an interpolating backoff can be set)", "ngram:build"),
    DraftSpec("distilled", "an n-gram table of the model's own predictions over the corpus's training split "
                           "(default: 6-gram, backoff 2); built once (minutes), cached", "distilled:build"),
    DraftSpec("draft", "the shipped small draft model (shakespeare-char-draft)", "model:build"),
    DraftSpec("lookup", "prompt lookup: continue the last earlier occurrence of the context's last n "
                        "characters (default 3)", "lookup:build"),
))


def register_draft(name: str, description: str) -> Callable[[Builder], Builder]:
    """Register the decorated builder ``(lm, data_path=None, *, n=None, backoff=None,
    progress=False) -> Draft`` as the draft ``name`` of :func:`make_draft` (and the CLI): the
    same as ``DRAFTS.add(DraftSpec(name, description, builder))``."""

    def register(builder: Builder) -> Builder:
        DRAFTS.add(DraftSpec(name, description, builder))
        return builder

    return register


def make_draft(kind: str, lm, data_path=None, *, n: int | None = None,
               backoff: float | None = None, progress: bool = False) -> Draft:
    """A draft for target ``lm`` by registered name (:data:`DRAFTS`): ``"ngram"`` (an n-gram
    table from the training split of the corpus: by default the chapter's add-0.01 trigram;
    ``n`` tokens, and with ``backoff=beta`` interpolated with the shorter contexts, see
    :class:`NGramDraft`), ``"distilled"`` (a table of the target's own predictions over the same
    text, by default a 6-gram with backoff 2, see :func:`distilled_draft`; ``progress`` shows its
    first, slow build), ``"draft"`` (the shipped small model ``shakespeare-char-draft``) or
    ``"lookup"`` (prompt lookup over the last ``n`` tokens, default 3)."""
    return DRAFTS.lookup(kind).build(lm, data_path, n=n, backoff=backoff, progress=progress)


def no_backoff(backoff) -> None:
    """For the builders of drafts that are not n-gram tables."""
    if backoff is not None:
        raise ValueError("backoff applies to the n-gram drafts only")
