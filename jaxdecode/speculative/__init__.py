"""Speculative sampling: a cheap draft proposes, the target verifies several tokens in one pass.

Leviathan, Kalman and Matias (2023), "Fast Inference from Transformers via Speculative Decoding";
Chen et al. (2023), "Accelerating Large Language Model Decoding with Speculative Sampling".

Each iteration the draft proposes ``gamma`` tokens, the target scores them in ONE
``model.extend`` pass, each proposal is accepted with probability ``min(1, p/q)``, and the first
rejection is replaced by a draw from the normalized residual ``max(p - q, 0)`` (one more token
from the target when all are accepted). Whatever the draft, each row's output has exactly the
target's distribution (processed by the same stateless rule); the draft only changes how many
tokens each target pass yields. ``greedy=True`` equals greedy decoding. Rows accept different
numbers of tokens, each with its own buffers and cache length, in a few jitted
``lax.while_loop`` segments; a row's noise depends only on the user key, its row id and its own
history. Requests that do not fit the model window ``T`` are refused. The steps in full:
``docs/python.md`` (Speculative sampling).

The package, by job: :mod:`.acceptance` (the acceptance test and its noise), :mod:`.loop` (the
jitted loop, its statistics and results), :mod:`.drafts` (the :class:`Draft` interface and the
registry of drafts: :mod:`.drafts.ngram`, :mod:`.drafts.distilled`, :mod:`.drafts.model`,
:mod:`.drafts.lookup`).
"""

from __future__ import annotations

from jaxdecode.speculative.acceptance import Noise, iteration_noise, row_keys
# the acceptance test on arrays and the token-level engine: reachable here, not in __all__ (their
# arguments are the loop's own; a request's settings are speculative_generate's DecodeParams)
from jaxdecode.speculative.acceptance import accept  # noqa: F401
from jaxdecode.speculative.drafts import DRAFTS, Draft, DraftSpec, make_draft, register_draft
from jaxdecode.speculative.drafts.distilled import (
    DISTILLED_BACKOFF,
    DISTILLED_N,
    distilled_draft,
    target_predictions,
)
from jaxdecode.speculative.drafts.lookup import LookupState, PromptLookupDraft
from jaxdecode.speculative.drafts.model import ModelDraft, ModelDraftState
from jaxdecode.speculative.drafts.ngram import NGramDraft, NGramState
from jaxdecode.speculative.loop import (
    SpeculativeGeneration,
    SpeculativeResult,
    SpeculativeStats,
    check_request,
    predicted_chars_per_pass,
    speculative_generate,
    speculative_tokens,  # noqa: F401
)

__all__ = [
    "DISTILLED_BACKOFF",
    "DISTILLED_N",
    "DRAFTS",
    "DraftSpec",
    "Draft",
    "LookupState",
    "ModelDraft",
    "ModelDraftState",
    "NGramDraft",
    "NGramState",
    "Noise",
    "PromptLookupDraft",
    "SpeculativeGeneration",
    "SpeculativeResult",
    "SpeculativeStats",
    "check_request",
    "distilled_draft",
    "iteration_noise",
    "make_draft",
    "predicted_chars_per_pass",
    "register_draft",
    "row_keys",
    "speculative_generate",
    "target_predictions",
]
