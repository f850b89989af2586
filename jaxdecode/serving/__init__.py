"""Serving: a continuous-batching engine over any decoding model's dense or paged cache, its
configuration, a block allocator with prefix sharing, and its simulator.

May import: ``models.base`` (the interface), ``decoding``, ``rules``, ``constraints``, ``io``.
Never a concrete model, the native layer, ``eval`` or ``cli``.
"""

from jaxdecode.serving.blocks import Allocation, BlockAllocator, OutOfBlocks
from jaxdecode.serving.config import EngineConfig
from jaxdecode.serving.engine import Engine
from jaxdecode.serving.requests import Request

__all__ = ["Allocation", "BlockAllocator", "Engine", "EngineConfig", "OutOfBlocks", "Request"]
