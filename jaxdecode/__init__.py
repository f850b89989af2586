"""jaxdecode: decoding text from language models with pure, jit-compiled JAX functions.

The flat API: :func:`load` a checkpoint, :func:`generate` (greedy or sampling with any chain of
:mod:`jaxdecode.rules`), :func:`beam_generate`, :func:`contrastive_generate`, :func:`score`; each
takes a request's settings as one :class:`DecodeParams`, with keywords as overrides.

The package has a folder per layer; each imports only the layers below it (``tests/project/test_layout.py``
checks this):

- ``io``: vocabularies, the corpus, paths and atomic writes;
- ``native``: the C++ CPU layer;
- ``models``: the decoding-model interface (``base``), the language model and checkpoint loading,
  the character transformer (``charlm``) and Hugging Face decoders (``hf``);
- ``rules`` and ``constraints``: what a step may choose;
- ``decoding``: the loops; ``speculative``: speculative decoding and its drafts;
- ``serving``: the continuous-batching engine;
- ``eval``: exact distributions and the studies; ``cli``: the command line.
"""

__version__ = "0.1.0"

from jaxdecode import rules
from jaxdecode.decoding.beam import beam_generate, mode_search
from jaxdecode.decoding.contrastive import contrastive_generate
from jaxdecode.decoding.params import DecodeParams, ParamsError
from jaxdecode.decoding.sampling import Generation, generate
from jaxdecode.decoding.score import score_texts as score
from jaxdecode.io.vocab import TokenVocab, UnknownCharacterError, Vocab
from jaxdecode.models import DecodingModel, FunctionModel
from jaxdecode.models.checkpoint import CheckpointError, LanguageModel, load
from jaxdecode.rules import RuleError, make_rule

__all__ = [
    "CheckpointError", "DecodeParams", "DecodingModel", "FunctionModel", "Generation", "LanguageModel", "ParamsError",
    "RuleError",
    "TokenVocab", "UnknownCharacterError", "Vocab", "beam_generate", "contrastive_generate", "generate", "load",
    "make_rule", "mode_search", "rules", "score",
]
