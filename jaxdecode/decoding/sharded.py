"""Batch generation over many devices, with JAX's own distribution (:mod:`jax.sharding`).

A :class:`~jax.sharding.Mesh` with a batch axis, ``"data"``, spans the devices (every process's,
in a multi-process cluster). The batch's arrays (prompts, keys, rule settings and state, the loop
state and the KV cache) are global arrays split along that axis; the parameters, the stop
strings and the constraint tables are replicated. The batch is padded with dummy rows to a
multiple of the axis's size.

The decoding loop and its jitted programs are those of :mod:`jaxdecode.decoding.sampling`, run
under :func:`jax.shard_map` over the batch axis (:mod:`jaxdecode.decoding.placement`): every device
runs the single-device program over its own rows, with no communication during a request. A
row's random stream depends only on its key, its row id and the step, so the texts and tokens
equal single-device generation exactly.

Several processes run the same program (SPMD): each calls :func:`sharded_sample_tokens` (or
:func:`jaxdecode.generate` with ``mesh=``) with the same request and receives every row's result;
:func:`gather_prompts` joins prompts that each process holds. Why ``shard_map`` rather than XLA's
partitioner, and the multi-host steps: ``docs/multihost.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxdecode.decoding.placement import AXIS, Placement, make_mesh, pad_batch
from jaxdecode.decoding.sampling import Decoding, sample_batch
from jaxdecode.decoding.steps import TokenResult
from jaxdecode.models.base import DecodingModel

__all__ = ["AXIS", "Placement", "gather_prompts", "make_mesh", "pad_batch", "sample_batch",
           "sharded_sample_tokens"]


def sharded_sample_tokens(model: DecodingModel, params, prompts: Sequence[np.ndarray], n: int, key: jax.Array,
                          rule=None, greedy: bool = False, row_ids: Sequence[int] | None = None,
                          stops: Sequence[np.ndarray] = (), chunk: int | None = None,
                          on_chunk: Callable[[np.ndarray, np.ndarray], None] | None = None,
                          constraint=None, *, mesh: Mesh | None = None) -> TokenResult:
    """:func:`jaxdecode.decoding.sampling.sample_tokens` with the batch split over ``mesh``'s ``"data"``
    axis (default: :func:`make_mesh`, every device). Same arguments and result; the result is on
    the host of every process. ``key``: one PRNG key, or one per prompt (``[B, 2]``). In a
    multi-process cluster every process passes the same request."""
    return sample_batch(model, params, prompts, n, key, Decoding(rule, greedy, stops, chunk, constraint),
                        row_ids=row_ids, on_chunk=on_chunk, placement=Placement(make_mesh() if mesh is None else mesh))


def gather_prompts(local: Sequence[np.ndarray]) -> tuple[list[np.ndarray], slice]:
    """Every process's own prompts (token arrays), joined in process order into the global
    request that every process then passes to :func:`sharded_sample_tokens`. Returns the global
    list and the slice of it that is this process's. A collective: every process calls it (with
    zero or more prompts). On one process it returns ``local`` itself."""
    local = [np.asarray(p, np.int32).reshape(-1) for p in local]
    if jax.process_count() == 1:
        return local, slice(0, len(local))
    from jax.experimental import multihost_utils

    gather = multihost_utils.process_allgather
    counts = np.asarray(gather(np.array([len(local)], np.int32))).reshape(-1)
    lens = np.array([len(p) for p in local] + [0] * (int(counts.max()) - len(local)), np.int32)
    width = int(np.asarray(gather(np.array([lens.max(initial=0)], np.int32))).max())
    block = np.zeros((int(counts.max()), max(width, 1)), np.int32)
    for i, p in enumerate(local):
        block[i, :len(p)] = p
    blocks, all_lens = np.asarray(gather(block)), np.asarray(gather(lens))
    out = [blocks[q, i, :all_lens[q, i]] for q in range(len(counts)) for i in range(counts[q])]
    start = int(counts[:jax.process_index()].sum())
    return out, slice(start, start + len(local))
