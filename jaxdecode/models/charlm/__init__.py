"""The character-level transformer (the shipped model): its Flax module (``transformer``), its
decoding-model adapter (``decoder``), its paged form (``paged``) and its training (``train``).

May import: ``models.base``, ``native``, ``io``.
"""

from jaxdecode.models.charlm.decoder import BEAM_BLOCK, CharLMDecoder, Prepared, decoder_for

__all__ = ["BEAM_BLOCK", "CharLMDecoder", "Prepared", "decoder_for"]
