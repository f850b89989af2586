"""Hugging Face model folders (the families of :data:`SUPPORTED`) with their tokenizers and end tokens.

``load_hf(folder)`` reads ``config.json`` (:mod:`.config`), the safetensors weights, single or
sharded (:mod:`.weights`), ``generation_config.json`` for the end tokens, and ``tokenizer.json``
(:mod:`.tokenizer`), and returns a :class:`~jaxdecode.models.lm.LanguageModel` whose decoder is an
:class:`~.transformer.HFDecoder`: every loop and the engine run on it as on the reference model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from jaxdecode.models.hf.config import SUPPORTED, ConfigError, HFConfig, end_tokens, generation_defaults
from jaxdecode.models.hf.families import read_config
from jaxdecode.models.hf.tokenizer import HFTokenizer, TokenizerError
from jaxdecode.models.hf.transformer import HFCache, HFDecoder
from jaxdecode.models.hf.weights import WeightsError, read_params

DTYPES = ("float32", "bfloat16", "float16")
VISION_UNUSED = ("an image-text model: text is decoded with its language model; the vision tower is "
                 "left unused")


class HFError(ValueError):
    """A Hugging Face folder that cannot be loaded (one line naming the problem)."""


def is_hf_folder(folder: Path) -> bool:
    """Whether ``folder``'s config.json is a Hugging Face one (it names a ``model_type``)."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and "model_type" in raw and "chars" not in raw


def load_hf(folder, *, dtype: str = "float32", max_length: int | None = None):
    """Load a Hugging Face folder. ``dtype``: the parameters' and the computation's (norms,
    softmax and logits stay float32); ``max_length``: a window smaller than the config's
    ``max_position_embeddings`` (the loops allocate and re-read up to the window)."""
    import jax.numpy as jnp

    from jaxdecode.models.lm import LanguageModel

    folder = Path(folder)
    if dtype not in DTYPES:
        raise HFError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                   or max_length < 2):
        raise HFError(f"max_length must be an integer >= 2, got {max_length!r}")
    try:
        cfg, raw = read_config(folder)
        vocab = HFTokenizer(folder / "tokenizer.json", cfg.V)
        eos = end_tokens(folder, raw, cfg.V, vocab.size)
        defaults = generation_defaults(folder)
        params = read_params(folder, cfg, getattr(jnp, dtype))
    except (ConfigError, TokenizerError, WeightsError) as e:
        raise HFError(str(e)) from None
    vocab.eos_ids = eos  # constraints allow them in final states
    decoder = HFDecoder(cfg, dtype, max_length)
    meta = {"model_type": cfg.model_type, "format": "huggingface", "dtype": dtype,
            "architectures": raw.get("architectures"), "eos_token_id": list(eos)}
    if defaults:  # generate and the command line apply them when the user sets none
        meta["generation_defaults"] = defaults
    if cfg.multimodal:
        meta["note"] = VISION_UNUSED
        warnings.warn(f"{folder}: {VISION_UNUSED}", stacklevel=2)
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta=meta, path=folder, decoder=decoder,
                         eos_ids=eos, generation_defaults=defaults)


__all__ = ["DTYPES", "HFCache", "HFConfig", "HFDecoder", "HFError", "HFTokenizer", "SUPPORTED",
           "is_hf_folder", "load_hf", "read_config"]
