"""jaxdecode: decoding text from language models with pure, jit-compiled JAX functions.

The flat API: :func:`load` a checkpoint, :func:`generate` (greedy or sampling with any chain of
:mod:`jaxdecode.rules`), :func:`beam_generate`, :func:`score`. The modules underneath take token
arrays: :mod:`jaxdecode.model`, :mod:`jaxdecode.sampling`, :mod:`jaxdecode.beam`,
:mod:`jaxdecode.speculative`, :mod:`jaxdecode.score`, :mod:`jaxdecode.exact`.
"""

__version__ = "0.1.0"

from . import rules
from .beam import beam_generate, mode_search
from .checkpoint import CheckpointError, LanguageModel, load
from .rules import RuleError
from .sampling import Generation, generate, make_rule
from .score import score_texts as score
from .vocab import UnknownCharacterError, Vocab

__all__ = [
    "CheckpointError", "Generation", "LanguageModel", "RuleError", "UnknownCharacterError", "Vocab",
    "beam_generate", "generate", "load", "make_rule", "mode_search", "rules", "score",
]
