"""jaxdecode: decoding text from language models with pure, jit-compiled JAX functions.

The flat API: :func:`load` a checkpoint, :func:`generate` (greedy or sampling with any chain of
:mod:`jaxdecode.rules`), :func:`beam_generate`, :func:`contrastive_generate`, :func:`score`.

The package has a folder per layer; each imports only the layers below it (``tests/test_layout.py``
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

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

from jaxdecode import rules
from jaxdecode.decoding.beam import beam_generate, mode_search
from jaxdecode.decoding.contrastive import contrastive_generate
from jaxdecode.decoding.sampling import Generation, generate
from jaxdecode.decoding.score import score_texts as score
from jaxdecode.io.vocab import TokenVocab, UnknownCharacterError, Vocab
from jaxdecode.models import DecodingModel, FunctionModel
from jaxdecode.models.checkpoint import CheckpointError, LanguageModel, load
from jaxdecode.rules import RuleError, make_rule

__all__ = [
    "CheckpointError", "DecodingModel", "FunctionModel", "Generation", "LanguageModel", "RuleError",
    "TokenVocab", "UnknownCharacterError", "Vocab", "beam_generate", "contrastive_generate", "generate", "load",
    "make_rule", "mode_search", "rules", "score",
]

# Module paths of earlier versions, still importable: each names the module it moved to.
MOVED = {
    "jaxdecode.core": "jaxdecode.decoding.common",
    "jaxdecode.budget": "jaxdecode.decoding.budget",
    "jaxdecode.sampling": "jaxdecode.decoding.sampling",
    "jaxdecode.beam": "jaxdecode.decoding.beam",
    "jaxdecode.search": "jaxdecode.decoding.search",
    "jaxdecode.contrastive": "jaxdecode.decoding.contrastive",
    "jaxdecode.smc": "jaxdecode.decoding.smc",
    "jaxdecode.score": "jaxdecode.decoding.score",
    "jaxdecode.serving.sharding": "jaxdecode.decoding.sharded",
    "jaxdecode.serving.paged": "jaxdecode.models.charlm.paged",
    "jaxdecode.model": "jaxdecode.models.charlm.transformer",
    "jaxdecode.train": "jaxdecode.models.charlm.train",
    "jaxdecode.checkpoint": "jaxdecode.models.checkpoint",
    "jaxdecode.kernels": "jaxdecode.native.kernels",
    "jaxdecode.vocab": "jaxdecode.io.vocab",
    "jaxdecode.data": "jaxdecode.io.data",
    "jaxdecode.paths": "jaxdecode.io.paths",
    "jaxdecode.exact": "jaxdecode.eval.exact",
    "jaxdecode.studies": "jaxdecode.eval.studies",
    "jaxdecode.studies.common": "jaxdecode.io.reports",
}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module it moved to (the same module object)."""

    @staticmethod
    def target(name: str) -> str | None:
        for old in sorted(MOVED, key=len, reverse=True):  # the longest moved prefix
            if name == old or name.startswith(old + "."):
                return MOVED[old] + name[len(old):]
        return None

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if self.target(name) else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        # the import system returns whatever sys.modules holds under the name once this returns
        sys.modules[module.__name__] = importlib.import_module(self.target(module.__name__))


if not any(isinstance(f, _MovedModule) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModule())  # before the path finder, which would load a second copy
