"""Speculative sampling: a cheap draft proposes, the target verifies several tokens in one pass.

Leviathan, Kalman and Matias (2023), "Fast Inference from Transformers via Speculative Decoding";
Chen et al. (2023), "Accelerating Large Language Model Decoding with Speculative Sampling".

Each iteration, for every row of the batch at once:

1. the draft proposes ``gamma`` tokens ``x_1 .. x_gamma`` from its distributions ``q_i``;
2. the target scores the pending token and the ``gamma`` proposals in ONE :func:`model.extend`
   pass, which gives its distributions ``p_1 .. p_{gamma+1}``;
3. proposal ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
   rejection a token is drawn from the normalized residual ``max(p_i - q_i, 0)``; if all are
   accepted, one more token comes from ``p_{gamma+1}``;
4. each row keeps what it accepted plus that one token: its target cache length (and the
   draft's state) rolls back to exactly that context.

Whatever the draft, each row's output has exactly the target's distribution (processed by the
same stateless rule as the draft's: temperature, top-k, top-p, min-p, ...); the draft only
changes how many tokens each target pass yields. With ``greedy=True`` a proposal is accepted
while it equals the target's argmax and the correction is the argmax, so the output equals
greedy decoding.

Rows accept different numbers of tokens, so each row has its own output buffer, count, target
cache length and draft state. The whole run is a few jitted ``lax.while_loop`` segments, one per
static attended span of the KV cache (as in :mod:`jaxdecode.decoding.sampling`): no host round trip per
token. Randomness: row ``r`` draws all the noise of iteration ``i`` (one uniform per draft token,
per acceptance test and for the corrected token; fixed entries per position) from
``fold_in(fold_in(key, r), i)`` (:func:`iteration_noise`). A row's output therefore depends only
on the user key, its row id and its own history, never on its batch.

The KV cache gives the book's exact logits only within the model window ``T``; requests whose
prompt plus ``n`` plus ``gamma + 1`` do not fit are refused.

The package, by job: :mod:`.acceptance` (the acceptance test and its noise), :mod:`.loop` (the
jitted loop, its statistics and results), :mod:`.drafts` (the :class:`Draft` interface and the
registry of drafts: :mod:`.drafts.ngram`, :mod:`.drafts.distilled`, :mod:`.drafts.model`,
:mod:`.drafts.lookup`).
"""

from __future__ import annotations

from jaxdecode.speculative.acceptance import Noise, _draw, _pick, accept, iteration_noise, row_keys  # noqa: F401 - _draw, _pick: tests
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
    speculative_tokens,
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
    "accept",
    "check_request",
    "distilled_draft",
    "iteration_noise",
    "make_draft",
    "predicted_chars_per_pass",
    "register_draft",
    "row_keys",
    "speculative_generate",
    "speculative_tokens",
    "target_predictions",
]
