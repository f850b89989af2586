"""Batch generation over many devices, with JAX's own distribution (:mod:`jax.sharding`).

A :class:`~jax.sharding.Mesh` with a batch axis, ``"data"``, spans the devices (every process's,
in a multi-process cluster). The batch's arrays (prompt tokens, lengths, row ids, per-row keys
and rule settings, the rule state, the automaton states of constrained rows, the loop state and
the KV cache) are global arrays split along that axis (``NamedSharding(mesh, P("data"))``, on
whichever axis of a cache leaf holds the rows); the parameters, the stop strings and the
constraint tables are replicated (``P()``).

The decoding loop is the one of :mod:`jaxdecode.decoding.sampling`, and so are its jitted programs
(prefill, the chunks of cached and of window-mode steps, the rule's initial state): each runs
under :func:`jax.shard_map` over the batch axis, so every device runs the single-device program
over its own rows. A row is computed from that row alone, so this is exact and needs no
communication between devices during a request (the compiled programs hold no collective), and
a model's native operations (:mod:`jaxdecode.native.kernels`) see only their device's rows. Letting
XLA's partitioner propagate the shardings through the plain programs instead gathers the index
arrays of every scatter at each step, and gathers the whole KV cache onto every device for each
native call (a custom call it cannot split).

The batch is padded with dummy rows to a multiple of the batch axis's size (on top of the usual
power-of-two bucket). A row's random stream depends only on its key, its row id and the step, so
the texts and tokens equal single-device generation exactly.

Several processes (hosts) run the same program (SPMD): each calls :func:`sharded_sample_tokens`
(or :func:`jaxdecode.decoding.sampling.sharded_generate`) with the same request, builds only the shards of its own devices
(:func:`jax.make_array_from_callback`), and receives every row's result
(:func:`jax.experimental.multihost_utils.process_allgather`). Processes that each hold their own
prompts join them with :func:`gather_prompts` first. See ``docs/multihost.md``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdecode import constraints as C
from jaxdecode.decoding.common import (
    DUMMY_ROW_ID,
    SPAN_BUCKET,
    Batch,
    batch_bucket,
    encode_stops,
    make_batch,
    pad_rule,
    round_up,
)
from jaxdecode.models.base import DecodingModel
from jaxdecode.decoding.steps import (
    DEFAULT_CHUNK,
    SMALL_BATCH_CHUNK,
    WHOLE_CHUNK_MAX,
    SamplingState,
    StepOutput,
    TokenResult,
    _cache_chunk,
    _grow,
    _prefill,
    _rule_init,
    _window_chunk,
    _window_start,
)

AXIS = "data"

__all__ = ["AXIS", "Placement", "gather_prompts", "make_mesh", "pad_batch", "sample_batch",
           "sharded_sample_tokens"]


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh (``"data"``) over ``devices`` (default: ``jax.devices()``, every device of
    every process)."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: no devices given")
    return Mesh(np.array(devices, dtype=object), (AXIS,))


def pad_batch(batch: Batch, multiple: int) -> Batch:
    """``batch`` with dummy rows added until its row count is a multiple of ``multiple``. The new
    rows are named like :func:`jaxdecode.decoding.common.make_batch`'s own dummy rows (from
    ``DUMMY_ROW_ID + Bb`` on), apart from every real row, and their outputs are discarded."""
    Bb = round_up(batch.Bb, multiple)
    extra = Bb - batch.Bb
    if extra == 0:
        return batch
    z = lambda a, fill: np.concatenate([a, np.full((extra,) + a.shape[1:], fill, a.dtype)])
    dummy = (np.arange(batch.Bb, Bb) + DUMMY_ROW_ID).astype(batch.row_ids.dtype)
    ids = np.concatenate([batch.row_ids, dummy])
    return dataclasses.replace(batch, Bb=Bb, prompt=z(batch.prompt, 0), recent=z(batch.recent, 0),
                               length=z(batch.length, 1), row_ids=ids)


def _batch_axes(small, large) -> list[int | None]:
    """Each leaf's batch axis, from the shapes of the same tree at two batch sizes (None: the leaf
    has no batch axis)."""
    axes = []
    for x, y in zip(jax.tree_util.tree_leaves(small), jax.tree_util.tree_leaves(large), strict=True):
        diff = [i for i, (m, n) in enumerate(zip(x.shape, y.shape)) if m != n]
        if len(diff) > 1:
            raise ValueError(f"a leaf of shape {x.shape} has more than one batch axis: it cannot be split")
        axes.append(diff[0] if diff else None)
    return axes


def _rows_struct(tree, extra: int = 0):
    """Shape stand-ins of a tree whose leaves all have a leading batch axis, ``extra`` rows more."""
    grown = lambda a: jax.ShapeDtypeStruct((a.shape[0] + extra,) + a.shape[1:], a.dtype)
    return jax.tree_util.tree_map(grown, tree)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a batch's arrays live and how the loop's programs run on them: rows split along
    ``mesh``'s ``"data"`` axis, everything else replicated over the mesh.

    Every row of the decoding loop is computed from that row alone, so each program runs on each
    device over its own rows (:func:`jax.shard_map` around the jitted functions of
    :mod:`jaxdecode.decoding.sampling`): no device waits for another during a request, and a model's
    native operations (:mod:`jaxdecode.native.kernels`) see only the local rows.
    """

    mesh: Mesh

    def __post_init__(self):
        if AXIS not in self.mesh.axis_names:
            raise ValueError(f"the mesh needs a batch axis named {AXIS!r}, got axes {self.mesh.axis_names}")

    @property
    def ways(self) -> int:
        """How many parts the batch axis splits a batch into."""
        return self.mesh.shape[AXIS]

    @staticmethod
    def spec(axis: int | None) -> P:
        """Split along ``axis`` (None: replicated)."""
        return P() if axis is None else P(*([None] * axis), AXIS)

    def sharding(self, axis: int | None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axis))

    def put(self, x, axis: int | None = 0):
        """A global array from a host value that every process holds in full (a numpy array, or a
        process-local jax array): each process builds only the shards of its own devices."""
        if x is None:
            return None
        axis = axis if np.ndim(x) else None
        sharding = self.sharding(axis)
        if jax.process_count() == 1 or isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, sharding)  # nothing moves when x is already laid out so
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def rows(self, tree):
        """Every leaf split along its first axis."""
        return jax.tree_util.tree_map(lambda a: self.put(a, 0), tree)

    def replicated(self, tree):
        return jax.tree_util.tree_map(lambda a: self.put(a, None), tree)

    def scalar(self, x):
        """A replicated scalar argument (a numpy scalar where one process runs everything: no
        transfer of its own)."""
        return x if jax.process_count() == 1 else self.put(x, None)

    def run(self, fn, args: tuple, axes: tuple, out_specs, donate: tuple[int, ...] = (), **static):
        """``fn(*args, **static)`` on every device over its own rows (``jit(shard_map(...))``).
        ``axes``: for each argument, its leaves' batch axes (a list, one per leaf), or one axis
        (or None) for all its leaves; ``out_specs``: the result's partition specs. One compiled
        program per function, statics, mesh, specs and shapes."""
        def specs(tree_axes, tree):
            if not isinstance(tree_axes, list):
                return jax.tree_util.tree_map(lambda _: self.spec(tree_axes), tree)
            return _spec_tree(self, tree_axes, tree)

        in_specs = tuple(specs(ax, a) for ax, a in zip(axes, args, strict=True))
        program = _program(fn, tuple(sorted(static.items())), self.mesh, _Frozen(in_specs),
                           _Frozen(out_specs), donate)
        return program(*args)

    @staticmethod
    def fetch(tree):
        """The full value of every leaf as numpy arrays, on every process."""
        leaves = jax.tree_util.tree_leaves(tree)
        if all(a.is_fully_addressable for a in leaves if isinstance(a, jax.Array)):
            return jax.device_get(tree)
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)


class _Frozen:
    """A tree of partition specs as a hashable key."""

    def __init__(self, tree):
        self.leaves, self.tree_def = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: isinstance(x, P))
        self.key = (self.tree_def, tuple(self.leaves))

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _Frozen) and self.key == other.key

    def tree(self):
        return jax.tree_util.tree_unflatten(self.tree_def, self.leaves)


@functools.lru_cache(maxsize=256)
def _program(fn, static: tuple, mesh: Mesh, in_specs: _Frozen, out_specs: _Frozen, donate: tuple):
    body = functools.partial(fn, **dict(static))
    # no replication check: the loops' carries mix per-row and shared values, and every output
    # declared replicated (the step count) is computed from replicated inputs alone
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs.tree(), out_specs=out_specs.tree(),
                           check_vma=False)
    return jax.jit(mapped, donate_argnums=donate)


def sharded_sample_tokens(model: DecodingModel, params, prompts: Sequence[np.ndarray], n: int, key: jax.Array,
                          rule=None, greedy: bool = False, row_ids: Sequence[int] | None = None,
                          stops: Sequence[np.ndarray] = (), chunk: int | None = None,
                          on_chunk: Callable[[np.ndarray, np.ndarray], None] | None = None,
                          constraint=None, *, mesh: Mesh | None = None) -> TokenResult:
    """:func:`jaxdecode.decoding.sampling.sample_tokens` with the batch split over ``mesh``'s ``"data"``
    axis (default: :func:`make_mesh`, every device). Same arguments and result; the result is on
    the host of every process. ``key``: one PRNG key, or one per prompt (``[B, 2]``). In a
    multi-process cluster every process passes the same request."""
    placement = Placement(make_mesh() if mesh is None else mesh)
    return sample_batch(model, params, prompts, n, key, rule=rule, greedy=greedy, row_ids=row_ids,
                        stops=stops, chunk=chunk, on_chunk=on_chunk, constraint=constraint,
                        placement=placement)


_OUT = StepOutput(*([P(None, AXIS)] * 4))  # a chunk's outputs [chunk, B]: rows on the second axis


def sample_batch(model, params, prompts, n, key, rule=None, greedy=False, row_ids=None, stops=(), chunk=None,
                 on_chunk=None, constraint=None, *, placement: Placement) -> TokenResult:
    """One batch of :func:`jaxdecode.decoding.sampling.sample_tokens` (the same loop and programs), with
    every array placed and every program run by ``placement``."""
    batch = make_batch(prompts, n, model.V, model.T, row_ids)
    B = batch.B
    batch = pad_batch(batch, placement.ways)
    Bb, T, ways = batch.Bb, model.T, placement.ways
    local = Bb // ways  # rows per device
    if np.ndim(key) not in (1, 2) or jax.dtypes.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        raise ValueError(f"key must be one PRNG key or one per prompt, got shape {np.shape(key)}")
    key_data = np.asarray(key)
    if key_data.ndim == 2:  # one key per row: the dummy rows take the first
        if key_data.shape[0] != B:
            raise ValueError(f"{key_data.shape[0]} keys for {B} prompts: give one key, or one per prompt")
        key_data = np.concatenate([key_data, np.broadcast_to(key_data[:1], (Bb - B, key_data.shape[1]))])
    key_axis = 0 if key_data.ndim == 2 else None
    if n == 0:
        e = np.zeros((B, 0), np.int32)
        return TokenResult(e, e.astype(np.float32), e.astype(np.float32), np.zeros(B, np.int32),
                           np.zeros(B, bool))
    key = placement.put(key_data, key_axis)
    con, cstate, budget = C.for_rows(constraint, B, Bb, model.V, n)
    con, cstate, budget = placement.replicated(con), placement.put(cstate), placement.put(budget)
    whole = model.reads_only_filled
    if chunk is None:
        chunk = SMALL_BATCH_CHUNK if B <= 4 else DEFAULT_CHUNK
        if B <= 4 and on_chunk is None and not stops and con is None and whole:
            chunk = max(chunk, min(batch_bucket(n), WHOLE_CHUNK_MAX))
    chunk = min(chunk, batch_bucket(n))
    Pmax, Pb = batch.Pmax, batch.Pb
    rule_b = placement.rows(pad_rule(rule, B, Bb))
    stop_arr, stop_lens = placement.replicated(encode_stops(stops))
    S = stop_arr.shape[1] if stop_arr is not None else 1
    prompt, length = placement.put(batch.prompt), placement.put(batch.length)
    recent, row_ids_b = placement.put(batch.recent), placement.put(batch.row_ids)
    max_new = round_up(n, 256)

    rule_state, rule_axes = None, None
    if rule_b is not None:
        # which axis of each leaf of the rule's state holds the rows: compare its shape at two
        # batch sizes (every leaf of a padded rule has the rows first)
        init = lambda r, p, l: r.init(p, l, model.V, max_new)
        shapes = [jax.eval_shape(init, *(_rows_struct(a, extra) for a in (rule_b, prompt, length)))
                  for extra in (0, 1)]
        rule_axes = _batch_axes(*shapes)
        rule_state = placement.run(_rule_init, (rule_b, prompt, length), (0, 0, 0),
                                   _spec_tree(placement, rule_axes, shapes[0]), V=model.V, max_new=max_new)

    def capacity(taken):
        return round_up((min(T, Pmax + n) if whole else Pmax + taken) + chunk, SPAN_BUCKET)

    params = placement.replicated(model.prepare(params, local))
    state_axes = SamplingState(logits=0, recent=0, length=0, rule_state=rule_axes, done=0, tail=0, step=None,
                               cstate=None if cstate is None else 0)
    common = (rule_b, key, row_ids_b, stop_arr, stop_lens)
    common_axes = (0, key_axis, 0, None, None)
    cache, cache_axes = None, None
    if Pmax <= T:
        # the axis of each cache leaf that holds the rows (a model lays its cache out as it likes)
        cache_shape, bigger = (jax.eval_shape(lambda b=b: model.empty_cache(b, capacity(0)))
                               for b in (local, local + 1))
        cache_axes = _batch_axes(cache_shape, bigger)
        cache_specs = _spec_tree(placement, cache_axes, cache_shape)
        prompt_T = prompt if Pb <= T else placement.put(batch.prompt[:, :T])
        logits, cache = placement.run(_prefill, (params, prompt_T, length), (None, 0, 0),
                                      (P(AXIS), cache_specs), model=model, capacity=capacity(0))
        n_cache = min(n, T - Pmax)
    else:
        logits = placement.run(_window_start, (params, recent, length), (None, 0, 0), P(AXIS), model=model)
        n_cache = 0
    state = SamplingState(
        logits=logits, recent=recent, length=length, rule_state=rule_state,
        done=placement.put(np.zeros((Bb,), bool)), tail=placement.put(np.full((Bb, S), -1, np.int32)),
        step=placement.put(np.int32(0), None), cstate=cstate)
    state_specs = _state_specs(placement, state, state_axes)

    outs, taken = [], 0
    while taken < n:
        valid = min(chunk, (n_cache if taken < n_cache else n) - taken)
        step_end = placement.scalar(np.int32(taken + valid))
        if taken < n_cache:
            if model.capacity(cache) < capacity(taken):
                cache = placement.run(_grow, (cache,), (cache_axes,), cache_specs, model=model,
                                      capacity=capacity(taken))
            state, cache, out = placement.run(
                _cache_chunk, (params, state, cache) + common + (step_end, con, budget),
                (None, _axes_list(state_axes, state), cache_axes) + common_axes + (None, None, 0),
                (state_specs, cache_specs, _OUT), donate=(2,), model=model, chunk=chunk, greedy=greedy)
        else:
            cache = None
            state, out = placement.run(
                _window_chunk, (params, state) + common + (step_end, con, budget),
                (None, _axes_list(state_axes, state)) + common_axes + (None, None, 0),
                (state_specs, _OUT), model=model, chunk=chunk, greedy=greedy)
        out, done = placement.fetch((out, state.done))
        out = StepOutput(*(np.asarray(a)[:valid, :B].T for a in out))  # [B, valid]
        outs.append(out)
        taken += valid
        if on_chunk is not None:
            on_chunk(out.token, out.emitted)
        if (stop_arr is not None or con is not None) and bool(np.all(np.asarray(done)[:B])):
            break  # every row has stopped

    cat = lambda i: np.concatenate([o[i] for o in outs], axis=1)
    tokens, mlp, slp, emitted = cat(0), cat(1), cat(2), cat(3)
    counts = emitted.sum(axis=1).astype(np.int32)
    stopped = np.asarray(done)[:B]
    return TokenResult(tokens.astype(np.int32), mlp.astype(np.float32), slp.astype(np.float32),
                       counts, stopped)


def _spec_tree(placement: Placement, axes: list, tree):
    """Partition specs shaped like ``tree``, leaf ``i`` split along ``axes[i]``."""
    leaves, tree_def = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(tree_def, [placement.spec(a) for a in axes])


def _axes_list(state_axes: SamplingState, state: SamplingState) -> list:
    """The loop state's per-leaf batch axes, in its leaves' order."""
    out = []
    for field, ax in zip(state, state_axes):
        n = len(jax.tree_util.tree_leaves(field))
        out.extend(ax if isinstance(ax, list) else [ax] * n)
    return out


def _state_specs(placement: Placement, state: SamplingState, state_axes: SamplingState):
    return _spec_tree(placement, _axes_list(state_axes, state), state)


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
