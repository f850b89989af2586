"""Serving: a block allocator with prefix sharing, a continuous-batching engine over any decoding
model's dense or paged cache, and its simulator.

May import: ``models.base`` (the interface), ``decoding``, ``rules``, ``constraints``, ``io``.
Never a concrete model, the native layer, ``eval`` or ``cli``.
"""

from jaxdecode.serving.blocks import Allocation, BlockAllocator, OutOfBlocks

__all__ = ["Allocation", "BlockAllocator", "OutOfBlocks"]
