from .blocks import Allocation, BlockAllocator, OutOfBlocks
from .paged import PagedCharLM, PagedKV, cache_bytes, copy_blocks, paged_attention, write_cache
