"""Every setting of an :class:`~jaxdecode.serving.engine.Engine`, as one validated object.

The command line, the server and the simulator build one :class:`EngineConfig` from their flags
and hand it to the engine (``Engine(lm, config=...)``); ``Engine(lm, slots, **settings)`` builds
it from keywords. Each field is checked once, here, with a message that names it.
"""

from __future__ import annotations

import dataclasses

from jaxdecode.decoding.common import check_int
from jaxdecode.models.base import KV_DTYPES

POLICIES = ("continuous", "static")
CACHES = ("dense", "paged")
DEFAULT_PREFILL_CHUNK = 128


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """``slots``: decode slots. ``policy``: ``"continuous"`` or ``"static"``. ``prefill_chunk``:
    the most prompt tokens a row reads per step. ``cache``: ``"dense"`` or ``"paged"``, with
    ``num_blocks`` (default: ``slots`` rows of the window), ``block_size``, ``prefix_caching`` and
    ``attention`` (the paged attention implementation; default native on the native backend,
    else portable). ``kv_dtype``: the cache's storage. ``decode_steps``: decode steps per device
    call while no row reads its prompt. ``prefill_budget``: the most prompt tokens of one step
    (default: no limit beyond ``prefill_chunk`` per row). ``overlap``: send each device call
    before reading the previous one's tokens. ``admit_batch``: rows in line join once that many
    slots are free. The engine's docstring says what each changes; none changes a text."""

    slots: int
    policy: str = "continuous"
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    cache: str = "dense"
    num_blocks: int | None = None
    block_size: int = 16
    prefix_caching: bool = True
    attention: str | None = None
    decode_steps: int = 1
    kv_dtype: str = "float32"
    prefill_budget: int | None = None
    overlap: bool = True
    admit_batch: int = 1

    def __post_init__(self):
        check_int("slots", self.slots, 1)
        check_int("admit_batch", self.admit_batch, 1)
        if self.admit_batch > self.slots:
            raise ValueError(f"admit_batch must be at most the slots ({self.slots}), got {self.admit_batch}")
        check_int("decode_steps", self.decode_steps, 1)
        if self.prefill_budget is not None:
            check_int("prefill_budget", self.prefill_budget, 1)
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if self.cache not in CACHES:
            raise ValueError(f"unknown cache {self.cache!r}: choose one of {', '.join(CACHES)}")
        check_int("prefill_chunk", self.prefill_chunk, 1)
        check_int("block_size", self.block_size, 1)
        if self.num_blocks is not None:
            if self.cache != "paged":
                raise ValueError("num_blocks is a setting of the paged cache (cache='paged')")
            check_int("num_blocks", self.num_blocks, 1)
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown KV cache dtype {self.kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
