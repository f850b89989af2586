"""A loaded model: parameters, vocabulary, decoder and end tokens, whatever the checkpoint format."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass
class LanguageModel:
    """A loaded model: its ``params``, its ``vocab``, metadata, and the ``decoder`` the loops run it
    through (a :class:`jaxdecode.models.DecodingModel`). For the reference transformer, ``cfg`` is
    its shape and the decoder is built from it on ``backend`` (``"native"``, ``"portable"`` or
    ``None``/``"auto"``: ``$JAXDECODE_KERNELS``, see :func:`jaxdecode.native.kernels.select`)."""

    params: Any
    cfg: Any
    vocab: Any  # a Vocab, TokenVocab or HFTokenizer
    meta: dict
    path: Path | None = None
    decoder: Any = None
    backend: dataclasses.InitVar[str | None] = None
    eos_ids: tuple[int, ...] = ()  # end-of-sequence token ids: a row ends at the first one it generates
    # a folder's generation_config.json defaults: make_rule settings and "greedy" (applied by
    # jaxdecode.decoding.common.default_settings when a request sets none)
    generation_defaults: dict = dataclasses.field(default_factory=dict)
    # reload(backend=...): the same folder loaded on another backend (a Hugging Face folder, whose
    # matrices are kept per path); None where the decoder is rebuilt from cfg
    reload: Any = None

    def __post_init__(self, backend):
        if self.decoder is None:
            if self.cfg is None:
                raise ValueError("LanguageModel needs a cfg or a decoder")
            from jaxdecode.models.charlm.decoder import decoder_for

            self.decoder = decoder_for(self.cfg, backend)
        if len(self.vocab) != self.decoder.V:
            raise ValueError(f"the vocabulary has {len(self.vocab)} tokens but the model has V={self.decoder.V}")

    @property
    def num_params(self) -> int:
        return sum(int(np.size(a)) for a in jax.tree_util.tree_leaves(self.params))

    def with_backend(self, backend: str) -> LanguageModel:
        """The same model on another backend (``"native"`` or ``"portable"``)."""
        from jaxdecode.models.charlm.decoder import CharLMDecoder, decoder_for

        if not isinstance(self.decoder, CharLMDecoder):
            if backend in ("auto", None) or backend == getattr(self.decoder, "backend", "portable"):
                return self
            if self.reload is not None:  # a Hugging Face folder: its weights are packed per path, read again
                return self.reload(backend=backend)
            raise ValueError("only the reference transformer and Hugging Face folders have a native backend; "
                             "this model runs on the portable jax.numpy path")
        return dataclasses.replace(self, decoder=decoder_for(self.cfg, backend))

    def shard(self, mesh, *, embedding: str = "vocab") -> LanguageModel:
        """The same model with its parameters split over ``mesh``'s ``"model"`` axis (a mesh of
        :func:`jaxdecode.decoding.placement.make_mesh`) by the partition rules of its family
        (:mod:`jaxdecode.models.hf.sharding`, :mod:`jaxdecode.models.charlm.sharding`). Every loop
        and the engine then run it as they are; the native CPU layer stays on one device, so a
        model on it is refused. ``embedding``: split the embedding and output layer by
        ``"vocab"`` (default) or by ``"hidden"`` size."""
        from jaxdecode.models.charlm.decoder import CharLMDecoder
        from jaxdecode.models.hf import sharding

        sharding.check_mesh(mesh)
        shape = {k: int(v) for k, v in dict(mesh.shape).items()}
        if getattr(self.decoder, "backend", "portable") == "native":
            raise sharding.ShardingError("the native CPU layer runs on one device: load the model with "
                                         "backend='portable' to place it on a mesh")
        meta = dict(self.meta, mesh=shape)
        if isinstance(self.decoder, CharLMDecoder):
            from jaxdecode.models.charlm.sharding import place

            if embedding != "vocab":
                raise sharding.ShardingError("the character model's embedding is split by vocabulary only")
            return dataclasses.replace(self, params=place(self.params, self.cfg, mesh), meta=meta)
        from jaxdecode.models.hf.transformer import HFDecoder

        if not isinstance(self.decoder, HFDecoder):
            raise sharding.ShardingError(f"{type(self.decoder).__name__} has no partition rules: only the "
                                         "character model and Hugging Face folders run on a model axis")
        return dataclasses.replace(self, params=sharding.place(self.params, self.decoder.cfg, mesh, embedding),
                                   decoder=dataclasses.replace(self.decoder, mesh=mesh), meta=meta,
                                   reload=None)

    @property
    def end_stops(self) -> list[np.ndarray]:
        """The end tokens as one-token stop sequences (what the loops stop a row at)."""
        return [np.asarray([e], np.int32) for e in self.eos_ids]
