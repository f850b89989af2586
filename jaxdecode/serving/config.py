"""Every setting of an :class:`~jaxdecode.serving.engine.Engine`, as one validated object.

The command line, the server and the simulator build one :class:`EngineConfig` from their flags
and hand it to the engine (``Engine(lm, config=...)``); ``Engine(lm, slots, **settings)`` builds
it from keywords. Each field is checked once, here, with a message that names it. The commands
that run an engine (``jaxdecode serve``, ``jaxdecode serve-bench``) take its flags from
:meth:`EngineConfig.add_flags` and build it with :meth:`EngineConfig.from_args`: one spelling of
each flag, one check of each value.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses

from jaxdecode.decoding.common import check_int
from jaxdecode.models.base import KV_DTYPES

POLICIES = ("continuous", "static")
CACHES = ("dense", "paged")
DEFAULT_PREFILL_CHUNK = 128
# the drafts a speculative engine builds by name: the registry's, and "model" (a draft model's
# folder, --draft; default: the folder "<model>-draft" beside the model's)
SPECULATIVE_KINDS = ("ngram", "distilled", "draft", "lookup", "model")
# decoding slots above which a speculative engine runs plain passes (docs/serving.md: measured on
# shakespeare-bpe with its draft model)
SPECULATIVE_MAX_ROWS = 2
SPECULATIVE_PASSES = 8  # a speculative engine's passes per device call by default
SPECULATIVE_GAMMA = 2  # its draft tokens per pass by default (docs/serving.md: measured with the draft model)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """``slots``: decode slots. ``policy``: ``"continuous"`` or ``"static"``. ``prefill_chunk``: the
    most prompt tokens a row reads per step. ``cache``: ``"dense"`` or ``"paged"``, with
    ``num_blocks`` (default: ``slots`` rows of the window), ``block_size`` and ``attention`` (the
    paged attention implementation; default native on the native backend, else portable).
    ``prefix_caching``: a prompt's start already computed is reused (paged: cached full blocks;
    dense float32: what a slot holds, :mod:`jaxdecode.serving.reuse`). ``kv_dtype``: the cache's
    storage. ``decode_steps``: decode steps per device call while no row reads its prompt.
    ``prefill_budget``: the most prompt tokens of one step (default: no limit beyond
    ``prefill_chunk`` per row). ``overlap``: send each device call before reading the previous one's
    tokens. ``admit_batch``: rows in line join once that many slots are free. ``speculative``: a
    draft kind (:data:`SPECULATIVE_KINDS`) or a ready :class:`~jaxdecode.speculative.Draft`: every
    step is a speculative pass (see :mod:`jaxdecode.serving.speculative`), with ``gamma`` proposals,
    while at most ``speculative_max_rows`` slots decode (default :data:`SPECULATIVE_MAX_ROWS`,
    measured), a plain pass above; ``draft``: the draft model's folder for ``speculative="model"``.
    The engine's docstring says what each changes; only ``speculative`` changes a text."""

    slots: int
    policy: str = "continuous"
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    cache: str = "dense"
    num_blocks: int | None = None
    block_size: int = 16
    prefix_caching: bool = True
    attention: str | None = None
    decode_steps: int | None = None  # None: 1, or SPECULATIVE_PASSES for a speculative engine (steps_per_call)
    kv_dtype: str = "float32"
    prefill_budget: int | None = None
    overlap: bool = True
    admit_batch: int = 1
    speculative: object = None
    draft: str | None = None
    gamma: int | None = None  # None: SPECULATIVE_GAMMA
    speculative_max_rows: int | None = None

    def __post_init__(self):
        n = _SPELLING.get()  # a field's name in a message: its own, or its flag's (from_args)
        check_int(n("slots"), self.slots, 1)
        check_int(n("admit_batch"), self.admit_batch, 1)
        if self.admit_batch > self.slots:
            raise ValueError(f"{n('admit_batch')} must be at most the {n('slots')} ({self.slots}), "
                             f"got {self.admit_batch}")
        if self.decode_steps is not None:
            check_int(n("decode_steps"), self.decode_steps, 1)
        if self.prefill_budget is not None:
            check_int(n("prefill_budget"), self.prefill_budget, 1)
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if self.cache not in CACHES:
            raise ValueError(f"unknown {n('cache')} {self.cache!r}: choose one of {', '.join(CACHES)}")
        check_int(n("prefill_chunk"), self.prefill_chunk, 1)
        check_int(n("block_size"), self.block_size, 1)
        if self.num_blocks is not None:
            if self.cache != "paged":
                raise ValueError(f"{n('num_blocks')} is a setting of the paged cache ({n('cache')} 'paged')")
            check_int(n("num_blocks"), self.num_blocks, 1)
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown KV cache dtype {self.kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
        self._check_speculative(n)

    def _check_speculative(self, n) -> None:
        from jaxdecode.speculative import Draft

        spec = self.speculative
        if spec is None:
            for field in ("draft", "gamma", "speculative_max_rows"):
                if getattr(self, field) is not None:
                    raise ValueError(f"{n(field)} is a setting of speculative decoding ({n('speculative')})")
            return
        if isinstance(spec, str):
            if spec not in SPECULATIVE_KINDS:
                raise ValueError(f"unknown {n('speculative')} draft {spec!r}: choose one of "
                                 f"{', '.join(SPECULATIVE_KINDS)}")
        elif not isinstance(spec, Draft):
            raise ValueError(f"{n('speculative')} must be a draft kind ({', '.join(SPECULATIVE_KINDS)}) or a "
                             f"jaxdecode.speculative.Draft, got {type(spec).__name__}")
        if self.draft is not None and spec != "model":
            raise ValueError(f"{n('draft')} names the draft model's folder: it goes with {n('speculative')} model")
        if self.gamma is not None:
            check_int(n("gamma"), self.gamma, 1)
        if self.speculative_max_rows is not None:
            check_int(n("speculative_max_rows"), self.speculative_max_rows, 0)
        for field, plain in (("cache", "dense"), ("kv_dtype", "float32")):
            if getattr(self, field) != plain:
                raise ValueError(f"speculative decoding in the engine runs on the dense float32 cache: "
                                 f"drop {n(field)} {getattr(self, field)!r}")

    @property
    def steps_per_call(self) -> int:
        """``decode_steps``, or its default: 1, or :data:`SPECULATIVE_PASSES` passes for a
        speculative engine (several passes a call: each call has a cost of its own on the device,
        which overlap does not hide, and a call stops early once its rows are done)."""
        if self.decode_steps is not None:
            return self.decode_steps
        return 1 if self.speculative is None else SPECULATIVE_PASSES

    # ------------------------------------------------------------------ the command line

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser, *, slots: int = 32) -> None:
        """Add one flag for each field but ``policy`` to ``parser`` (``slots``: the command's
        default slot count). ``policy`` has none: ``serve`` runs continuous batching and
        ``serve-bench`` runs both policies to compare them."""
        g = parser.add_argument_group("engine")
        g.add_argument("--slots", type=int, default=slots, metavar="S",
                       help=f"decode slots: rows generated at once (default {slots})")
        g.add_argument("--cache", choices=CACHES, default="dense",
                       help="the KV cache: one row of the window per slot, or a pool of blocks shared by "
                            "prompts with the same leading blocks (default dense)")
        g.add_argument("--num-blocks", type=int, default=None, metavar="B",
                       help="--cache paged: blocks in the pool (default: slots x window / block size, the "
                            "dense cache's memory)")
        g.add_argument("--block-size", type=int, default=16, metavar="P",
                       help="--cache paged: positions per block (default 16)")
        g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                       help="compute every prompt from its start (default: a prompt's start that a slot or "
                            "the paged pool already holds is reused)")
        g.add_argument("--attention", default=None, metavar="IMPL",
                       help="--cache paged: the paged attention implementation (default: native on the "
                            "native backend, else portable)")
        g.add_argument("--kv-dtype", choices=KV_DTYPES, default="float32",
                       help="how the KV cache stores keys and values (int8: one float32 scale per head and "
                            "position; default float32)")
        g.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="TOKENS",
                       help=f"prompt tokens a row reads per engine step (default {DEFAULT_PREFILL_CHUNK})")
        g.add_argument("--prefill-budget", type=int, default=None, metavar="TOKENS",
                       help="the most prompt tokens all rows read in one engine step (default: no limit)")
        g.add_argument("--decode-steps", type=int, default=None, metavar="K",
                       help=f"up to K decode steps (passes) per device call while no request waits (default 1; "
                            f"{SPECULATIVE_PASSES} with --speculative)")
        g.add_argument("--no-overlap", dest="overlap", action="store_false",
                       help="read each device call's tokens before the next call is sent (default: the "
                            "host's work for a step runs while the device computes the previous one)")
        g.add_argument("--admit-batch", type=int, default=1, metavar="M",
                       help="while rows run, rows in line join once M slots are free (or as many as wait), "
                            "their prompts read together (default 1: as soon as a slot is free)")
        g.add_argument("--speculative", choices=SPECULATIVE_KINDS, default=None,
                       help="speculative decoding with this draft: an n-gram table of the corpus (ngram, "
                            "distilled), prompt lookup, or a draft model (model: --draft FOLDER, default the "
                            "folder '<model>-draft' beside the model's); exact: the same distribution")
        g.add_argument("--draft", default=None, metavar="FOLDER",
                       help="--speculative model: the draft model's folder (same tokenizer as the model)")
        g.add_argument("--gamma", type=int, default=None, metavar="G",
                       help=f"--speculative: draft tokens per pass (default {SPECULATIVE_GAMMA})")
        g.add_argument("--speculative-max-rows", type=int, default=None, metavar="R",
                       help=f"--speculative: above R decoding rows a step runs a plain pass (default "
                            f"{SPECULATIVE_MAX_ROWS}, where speculation stopped paying on CPU)")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **fields) -> EngineConfig:
        """The configuration the flags of :meth:`add_flags` give (``fields``: the ones the command
        sets itself, such as ``policy``). A bad value is a ValueError that names its flag."""
        token = _SPELLING.set(_flag)
        try:
            return cls(**{f: getattr(args, f) for f in FLAGS}, **fields)
        finally:
            _SPELLING.reset(token)


def _own(field: str) -> str:
    return field


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


_SPELLING: contextvars.ContextVar = contextvars.ContextVar("spelling", default=_own)
# the fields that are flags: every one but policy
FLAGS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "policy")
