"""jaxdecode: decoding text from language models with pure, jit-compiled JAX functions.

The flat API: :func:`load` a checkpoint, :func:`generate` (greedy or sampling with any chain of
:mod:`jaxdecode.rules`), :func:`beam_generate`, :func:`score`. The modules underneath take token
arrays and a decoding model (:mod:`jaxdecode.models`: the interface, the adapter for your own
logits function, the reference transformer): :mod:`jaxdecode.sampling`, :mod:`jaxdecode.beam`,
:mod:`jaxdecode.speculative`, :mod:`jaxdecode.score`, :mod:`jaxdecode.exact`.
"""

__version__ = "0.1.0"

from . import rules
from .beam import beam_generate, mode_search
from .checkpoint import CheckpointError, LanguageModel, load
from .contrastive import contrastive_generate
from .rules import RuleError, make_rule
from .sampling import Generation, generate
from .score import score_texts as score
from .models import DecodingModel, FunctionModel
from .vocab import TokenVocab, UnknownCharacterError, Vocab

__all__ = [
    "CheckpointError", "DecodingModel", "FunctionModel", "Generation", "LanguageModel", "RuleError",
    "TokenVocab", "UnknownCharacterError", "Vocab", "beam_generate", "contrastive_generate", "generate", "load",
    "make_rule",
    "mode_search", "rules", "score",
]
