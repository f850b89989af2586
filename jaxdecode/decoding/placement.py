"""Where a batch's arrays live and how the sampling loop's programs run on them.

The sampling loop (:mod:`jaxdecode.decoding.sampling`) is written once, against a placement:

- :data:`ONE_DEVICE`: the default device holds every array, and each program is the jitted
  function itself;
- :class:`Placement`: a :class:`~jax.sharding.Mesh` with a batch axis, ``"data"``: the rows are
  split along that axis and everything else is replicated, and each program runs under
  :func:`jax.shard_map`, every device over its own rows (see :mod:`jaxdecode.decoding.sharded`).

A mesh may also have a ``"model"`` axis (:func:`make_mesh` with ``model=M``): the parameters of a
model placed on it (``lm.shard(mesh)``, ``load(folder, mesh=mesh)``) are split along that axis by
:mod:`jaxdecode.models.hf.sharding`, and XLA's partitioner (GSPMD) inserts the collectives. With
such a mesh, :class:`Placement` runs its programs manual over ``"data"`` only (each device group
of a data index over its own rows) and leaves ``"model"`` to the partitioner, and keeps the
parameters where they are instead of replicating them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdecode.decoding.common import DUMMY_ROW_ID, Batch, round_up

AXIS = "data"
MODEL = "model"  # the axis a model's parameters are split along (see jaxdecode.models.hf.sharding)

__all__ = ["AXIS", "MODEL", "ONE_DEVICE", "OneDevice", "Placement", "make_mesh", "model_ways", "pad_batch"]


class OneDevice:
    """Every array on the default device; a program is the jitted function itself, so the loop
    pays nothing for the placement. The same methods as :class:`Placement`."""

    ways = 1
    split = False  # the loop need not work out which axis of each leaf holds the rows

    def put(self, x, axis: int | None = 0):
        return None if x is None else jnp.asarray(x)

    def rows(self, tree):
        return tree

    def replicated(self, tree):
        return tree

    def scalar(self, x):
        return x

    def run(self, fn, args: tuple, axes: tuple, out_specs, donate: tuple[int, ...] = (), **static):
        return fn(*args, **static)

    @staticmethod
    def fetch(tree):
        return jax.device_get(tree)


ONE_DEVICE = OneDevice()


def make_mesh(devices: Sequence[jax.Device] | None = None, *, data: int | None = None,
              model: int | None = None) -> Mesh:
    """A mesh over ``devices`` (default: ``jax.devices()``, every device of every process).

    With neither size given: one axis, ``"data"``, over every device (a model axis of 1). With
    ``data`` and/or ``model``: two axes, ``("data", "model")``, of those sizes (the one left out
    takes the rest of the devices); ``data * model`` must equal the number of devices. Along
    ``"model"`` go consecutive devices (within a process first: the collectives of a decode
    step stay on the fastest links), along ``"data"`` the groups of them."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: no devices given")
    if data is None and model is None:
        return Mesh(np.array(devices, dtype=object), (AXIS,))
    n = len(devices)
    for name, size in (("data", data), ("model", model)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1):
            raise ValueError(f"make_mesh: {name} must be a positive integer, got {size!r}")
    if model is None:
        model = n // data if n % data == 0 else 0
    if data is None:
        data = n // model if n % model == 0 else 0
    if data * model != n or data == 0:
        raise ValueError(f"make_mesh: a mesh of data={data} x model={model} does not cover the {n} "
                         f"devices given (the product must equal the number of devices)")
    return Mesh(np.array(devices, dtype=object).reshape(data, model), (AXIS, MODEL))


def model_ways(mesh: Mesh | None) -> int:
    """How many parts ``mesh``'s ``"model"`` axis splits a model into (1 without one)."""
    return 1 if mesh is None else dict(mesh.shape).get(MODEL, 1)


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


def batch_axes(small, large) -> list[int | None]:
    """Each leaf's batch axis, from the shapes of the same tree at two batch sizes (None: the leaf
    has no batch axis)."""
    axes = []
    for x, y in zip(jax.tree_util.tree_leaves(small), jax.tree_util.tree_leaves(large), strict=True):
        diff = [i for i, (m, n) in enumerate(zip(x.shape, y.shape)) if m != n]
        if len(diff) > 1:
            raise ValueError(f"a leaf of shape {x.shape} has more than one batch axis: it cannot be split")
        axes.append(diff[0] if diff else None)
    return axes


def rows_struct(tree, extra: int = 0):
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
    split = True  # the loop works out each leaf's batch axis for the partition specs

    def __post_init__(self):
        if AXIS not in self.mesh.axis_names:
            raise ValueError(f"the mesh needs a batch axis named {AXIS!r}, got axes {self.mesh.axis_names}")
        if set(self.mesh.axis_names) - {AXIS, MODEL}:
            raise ValueError(f"a mesh's axes are {AXIS!r} and {MODEL!r}, got {self.mesh.axis_names}")

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
        """Every leaf replicated over the batch axis; a leaf already placed on this mesh (the
        parameters of a model split along ``"model"``) stays as it is."""
        return jax.tree_util.tree_map(lambda a: a if self._placed(a) else self.put(a, None), tree)

    def _placed(self, a) -> bool:
        sharding = getattr(a, "sharding", None)
        return (isinstance(a, jax.Array) and isinstance(sharding, NamedSharding)
                and sharding.mesh == self.mesh and AXIS not in jax.tree_util.tree_leaves(tuple(sharding.spec)))

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
            return spec_tree(self, tree_axes, tree)

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
    # with a model axis, only the batch axis is manual: the partitioner splits each device
    # group's program over "model" as the parameters' shardings say
    manual = {AXIS} if model_ways(mesh) > 1 else set(mesh.axis_names)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs.tree(), out_specs=out_specs.tree(),
                           axis_names=manual, check_vma=False)
    return jax.jit(mapped, donate_argnums=donate)


def spec_tree(placement: Placement, axes: list, tree):
    """Partition specs shaped like ``tree``, leaf ``i`` split along ``axes[i]``."""
    leaves, tree_def = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(tree_def, [placement.spec(a) for a in axes])
