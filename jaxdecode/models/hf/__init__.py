"""Hugging Face model folders (the families of :data:`SUPPORTED`) with their tokenizers and end tokens.

``load_hf(folder)`` reads ``config.json`` (:mod:`.config`), the safetensors weights, single or
sharded (:mod:`.weights`), ``generation_config.json`` for the end tokens, and ``tokenizer.json``
(:mod:`.tokenizer`), and returns a :class:`~jaxdecode.models.lm.LanguageModel` whose decoder is an
:class:`~.transformer.HFDecoder`: every loop and the engine run on it as on the reference model.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path

from jaxdecode.models.hf.config import ConfigError, HFConfig, end_tokens, generation_defaults
from jaxdecode.models.hf.families import SUPPORTED, read_config
from jaxdecode.models.hf.linear import STORED, WEIGHTS, mode, prepare
from jaxdecode.models.hf.quantized import QuantizedError, is_quantized, kind, packed, read_int8
from jaxdecode.models.hf.sharding import ShardingError
from jaxdecode.models.hf.sliced import read_sliced
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


def load_hf(folder, *, dtype: str = "float32", max_length: int | None = None, weights: str = "auto",
            backend: str | None = None, mesh=None):
    """Load a Hugging Face folder. ``dtype``: the parameters' and the computation's (norms,
    softmax and logits stay float32); ``max_length``: a window smaller than the config's
    ``max_position_embeddings`` (the loops allocate and re-read up to the window); ``weights``:
    how the matrices are kept (:mod:`.linear`: ``"auto"``, ``"float32"``, ``"stored"``,
    ``"bfloat16"``, ``"int8"``); ``backend``: ``"native"`` (the C++ products on the CPU),
    ``"portable"``, or ``None``/``"auto"`` (:func:`jaxdecode.native.kernels.select`). The native
    path computes in float32: with ``dtype="bfloat16"``, ``"auto"`` is the portable path.
    ``mesh``: split the parameters over its ``"model"`` axis (:mod:`.sharding`; the portable path
    only), each device's slice read from the safetensors files."""
    import jax.numpy as jnp

    from jaxdecode.models.lm import LanguageModel

    folder = Path(folder)
    if dtype not in DTYPES:
        raise HFError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                   or max_length < 2):
        raise HFError(f"max_length must be an integer >= 2, got {max_length!r}")
    if mesh is not None:
        if backend == "native":
            raise HFError("the native CPU layer runs on one device: a model on a mesh needs backend='portable'")
        backend = "portable"
    native, how = choose_weights(dtype, weights, backend)
    stored: set = set()
    try:
        cfg, raw = read_config(folder)
        vocab = HFTokenizer(folder / "tokenizer.json", cfg.V)
        eos = end_tokens(folder, raw, cfg.V, vocab.size)
        defaults = generation_defaults(folder)
        if is_quantized(raw):  # saved by `jaxdecode quantize`: read back as written
            held = kind(raw)
            if weights not in ("auto", held) or dtype != "float32":
                raise HFError(f"{folder} holds {held} weights: load it with weights 'auto' or '{held}' and dtype "
                              f"float32")
            params, how, kept = read_int8(folder, cfg, mesh), held, held
            params = packed(params) if native else params
        elif mesh is not None:  # each device's slice read from the files, in its kept form
            params, kept = read_sliced(folder, cfg, dtype, how, mesh)
        else:
            params = read_params(folder, cfg, getattr(jnp, dtype), stored)
    except (ConfigError, TokenizerError, WeightsError, QuantizedError, ShardingError) as e:
        raise HFError(str(e)) from None
    if not is_quantized(raw) and mesh is None:
        kept = STORED.get(stored.pop(), "float32") if len(stored) == 1 else "float32"
        params = prepare(params, cfg, how, kept, native)
    vocab.eos_ids = eos  # constraints allow them in final states
    decoder = HFDecoder(cfg, dtype, max_length, "native" if native else "portable")
    meta = {"model_type": cfg.model_type, "format": "huggingface", "dtype": dtype,
            "weights": {"float32": dtype, "stored": kept}.get(how, how),
            "architectures": raw.get("architectures"), "eos_token_id": list(eos)}
    if defaults:  # generate and the command line apply them when the user sets none
        meta["generation_defaults"] = defaults
    if cfg.multimodal:
        meta["note"] = VISION_UNUSED
        warnings.warn(f"{folder}: {VISION_UNUSED}", stacklevel=2)
    kept_option = "auto" if dtype != "float32" else {"float16": "stored"}.get(meta["weights"], meta["weights"])
    reload = functools.partial(load_hf, folder, dtype=dtype, max_length=max_length, weights=kept_option)
    lm = LanguageModel(params=params, cfg=cfg, vocab=vocab, meta=meta, path=folder, decoder=decoder,
                       eos_ids=eos, generation_defaults=defaults, reload=reload)
    if mesh is None:
        return lm
    try:  # the parameters are in place already: this sets the decoder's mesh
        return lm.shard(mesh)
    except ShardingError as e:
        raise HFError(str(e)) from None


def choose_weights(dtype: str, weights: str, backend: str | None) -> tuple[bool, str]:
    """``(native, how the matrices are kept)`` for a load's options (one-line HFError if refused)."""
    from jaxdecode.native import kernels

    if weights not in WEIGHTS:
        raise HFError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if dtype != "float32":
        if backend == "native":
            raise HFError(f"the native CPU layer computes in float32, not {dtype}")
        if weights not in ("auto", "float32"):
            raise HFError(f"weights={weights!r} needs dtype float32 (dtype {dtype} keeps every weight in {dtype})")
        return False, "float32"
    try:
        native, _ = kernels.select(None if backend in (None, "auto") else backend)
    except kernels.KernelError as e:
        raise HFError(str(e)) from None
    return native, mode(weights, native)


__all__ = ["DTYPES", "HFCache", "HFConfig", "HFDecoder", "HFError", "HFTokenizer", "SUPPORTED",
           "is_hf_folder", "load_hf", "read_config"]
