"""Drafts for speculative sampling: the interface and registry (:mod:`.base`) and the drafts,
which register themselves on import, in the order the command line lists them."""

from jaxdecode.speculative.drafts.base import (  # noqa: F401 (the private helpers, for draft modules elsewhere)
    DRAFTS,
    Builder,
    Draft,
    _draft,
    _no_backoff,
    _static,
    make_draft,
    register_draft,
)
from jaxdecode.speculative.drafts import ngram, distilled, model, lookup  # noqa: F401, I001

__all__ = ["DRAFTS", "Builder", "Draft", "make_draft", "register_draft"]
