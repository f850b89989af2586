"""The :class:`Draft` interface and the registry of the drafts the library builds by name
(:func:`make_draft`, :data:`DRAFTS`; the draft modules register on import of the package).

A draft module defines its draft class (a pytree made with :func:`_draft`) and registers a
builder with :func:`register_draft`: ``builder(lm, data_path=None, *, n=None, backoff=None,
progress=False) -> Draft`` makes the draft for target ``lm``, reading the corpus
(``data_path``, default ``$JAXDECODE_DATA``) or loading checkpoints as it needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax


def _draft(cls):
    """Make ``cls`` a frozen dataclass and a pytree whose fields marked ``static`` are metadata."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = [f.name for f in fields if not f.metadata.get("static", False)]
    meta = [f.name for f in fields if f.metadata.get("static", False)]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def _static(**kwargs):
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
        :func:`jaxdecode.speculative.accept._pick`), or is ``argmax(q_j)`` when ``noise`` is
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

DRAFTS: dict[str, str] = {}  # name -> one-line description, in registration order
_BUILDERS: dict[str, Builder] = {}


def register_draft(name: str, description: str) -> Callable[[Builder], Builder]:
    """Register the decorated builder ``(lm, data_path=None, *, n=None, backoff=None,
    progress=False) -> Draft`` as the draft ``name`` of :func:`make_draft` (and the CLI)."""

    def register(builder: Builder) -> Builder:
        if name in _BUILDERS:
            raise ValueError(f"a draft named {name!r} is already registered")
        _BUILDERS[name] = builder
        DRAFTS[name] = description
        return builder

    return register


def _names() -> str:
    names = [repr(k) for k in DRAFTS]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def make_draft(kind: str, lm, data_path=None, *, n: int | None = None,
               backoff: float | None = None, progress: bool = False) -> Draft:
    """A draft for target ``lm`` by registered name (:data:`DRAFTS`): ``"ngram"`` (an n-gram
    table from the training split of the corpus: by default the chapter's add-0.01 trigram;
    ``n`` tokens, and with ``backoff=beta`` interpolated with the shorter contexts, see
    :class:`NGramDraft`), ``"distilled"`` (a table of the target's own predictions over the same
    text, by default a 6-gram with backoff 2, see :func:`distilled_draft`; ``progress`` shows its
    first, slow build), ``"draft"`` (the shipped small model ``shakespeare-char-draft``) or
    ``"lookup"`` (prompt lookup over the last ``n`` tokens, default 3)."""
    builder = _BUILDERS.get(kind)
    if builder is None:
        raise ValueError(f"unknown draft kind {kind!r}: use {_names()}")
    return builder(lm, data_path, n=n, backoff=backoff, progress=progress)


def _no_backoff(backoff) -> None:
    """For the builders of drafts that are not n-gram tables."""
    if backoff is not None:
        raise ValueError("backoff applies to the n-gram drafts only")
