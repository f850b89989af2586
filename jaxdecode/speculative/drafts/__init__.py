"""Drafts for speculative sampling: the interface and registry (:mod:`.base`) and the drafts."""

from jaxdecode.speculative.drafts.base import (  # noqa: F401 (the private helpers, for draft modules elsewhere)
    DRAFTS,
    Builder,
    Draft,
    DraftSpec,
    _draft,
    _no_backoff,
    _static,
    make_draft,
    register_draft,
)
from jaxdecode.speculative.drafts import ngram, distilled, model, lookup  # noqa: F401, I001

__all__ = ["DRAFTS", "Builder", "Draft", "DraftSpec", "make_draft", "register_draft"]
