"""Drafts for speculative sampling: the interface and registry (:mod:`.base`) and the drafts."""

from jaxdecode.speculative.drafts.base import (  # noqa: F401 (the building blocks, for draft modules elsewhere)
    DRAFTS,
    Builder,
    Draft,
    DraftSpec,
    draft_class,
    make_draft,
    no_backoff,
    register_draft,
    static_field,
)
from jaxdecode.speculative.drafts import ngram, distilled, model, lookup  # noqa: F401, I001

__all__ = ["DRAFTS", "Builder", "Draft", "DraftSpec", "make_draft", "register_draft"]
