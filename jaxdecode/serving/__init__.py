"""Serving: a paged KV cache with prefix sharing, a continuous-batching engine with its simulator,
and generation sharded over devices."""

from .blocks import Allocation, BlockAllocator, OutOfBlocks
from .paged import PagedCharLM, PagedKV, cache_bytes, copy_blocks, paged_attention, write_cache

__all__ = ["Allocation", "BlockAllocator", "OutOfBlocks", "PagedCharLM", "PagedKV", "cache_bytes", "copy_blocks",
           "paged_attention", "write_cache"]
