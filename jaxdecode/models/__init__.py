"""Decoding models: the interface the loops use (:mod:`.base`) and the models behind it."""

from jaxdecode.models.base import DecodingModel, FunctionModel, TokenCache, as_decoding_model
from jaxdecode.models.charlm.decoder import CharLMDecoder, decoder_for
from jaxdecode.models.toy import TinyTransformer, multichar_lm

__all__ = ["CharLMDecoder", "DecodingModel", "FunctionModel", "TinyTransformer", "TokenCache", "as_decoding_model",
           "decoder_for", "multichar_lm"]
