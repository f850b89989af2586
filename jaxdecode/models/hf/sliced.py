"""Reading a Hugging Face folder straight onto a mesh: each device's slice from the safetensors files.

``load(folder, mesh=...)`` places every parameter with :func:`jax.make_array_from_callback`: the
callback receives a device's index into the parameter (from the partition rules of
:mod:`.sharding`) and reads that slice of the checkpoint tensor with
``safe_open(...).get_slice(name)[rows, cols]``. No whole matrix is read, on the host or on a
device, unless a device holds the whole of it (a replicated parameter). A file is opened for one
parameter and closed after it, so its mapped pages do not add up over the load: the host holds
the devices' parameters and, at most, one matrix's pages besides.

A parameter is a rectangle of one checkpoint tensor, transposed or not (:class:`Piece`): where it
lies is found by running the reader's own split (:func:`.weights.split_tensor`: transposes, fused q/k/v
or gate/up cut into parts) over index grids instead of values, so fused tensors (GPT-2's
``c_attn``, Phi-3's ``qkv_proj`` and ``gate_up_proj``) are read part by part, each device its rows
of its part. The experts of a mixture are stacked pieces, and their gate and up are joined, as
:func:`.weights.read_params` joins them.

The matrices are kept as :func:`.linear.prepare` keeps them on the portable path (``weights``
float32, stored, bfloat16 or int8), slice by slice. An int8 matrix's scale is one per column of
the whole matrix: a device holding all of its columns' rows (a column-split matrix) computes
them from its slice; for a row-split one (o, down) the column maxima are gathered over the
matrix read in row blocks of one device's share. The values equal a one-device load's, bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import jax
import numpy as np
from safetensors import SafetensorError

from jaxdecode.models.hf import sharding
from jaxdecode.models.hf.linear import MATRICES, STORED
from jaxdecode.models.hf.weights import (
    FLOAT_DTYPES,
    INDEX_FILE,
    WeightsError,
    check_layers,
    match_table,
    shard_files,
    short_error,
    split_tensor,
    tensor_table,
)

READ_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError, TypeError, KeyError)


class Files:
    """The folder's safetensors files, each opened on demand and kept open until :meth:`close`
    (one parameter's reads: a file's mapping is dropped between parameters)."""

    def __init__(self):
        self.open: dict[Path, object] = {}
        self.stack = contextlib.ExitStack()

    def get(self, path: Path):
        from safetensors import safe_open

        if path not in self.open:
            self.open[path] = self.stack.enter_context(safe_open(str(path), framework="numpy"))
        return self.open[path]

    def close(self):
        self.stack.close()
        self.open.clear()
        self.stack = contextlib.ExitStack()


def _range(s: slice, n: int) -> tuple[int, int]:
    start, stop, step = s.indices(n)
    if step != 1:
        raise ValueError(f"a device's index has a step of {step}")
    return start, stop


@dataclasses.dataclass(frozen=True)
class Piece:
    """A parameter that is the rectangle of checkpoint tensor ``name`` (in ``path``) starting at
    ``origin``, transposed or not: ``param[i, j] = tensor[r0 + i, c0 + j]``, or
    ``tensor[r0 + j, c0 + i]`` when ``transposed`` (1-D: ``param[i] = tensor[r0 + i]``)."""

    path: Path
    name: str
    shape: tuple[int, ...]
    origin: tuple[int, ...]
    transposed: bool = False

    def read(self, files: Files, index: tuple) -> np.ndarray:
        ranges = [_range(s, n) for s, n in zip(index, self.shape, strict=True)]
        if self.transposed:
            ranges = ranges[::-1]
        sl = tuple(slice(o + a, o + b) for o, (a, b) in zip(self.origin, ranges, strict=True))
        a = np.asarray(files.get(self.path).get_slice(self.name)[sl], np.float32)
        return a.T if self.transposed else a

    def flipped(self) -> Piece:
        """The transpose of this parameter (a tied output layer from the embedding)."""
        return dataclasses.replace(self, shape=self.shape[::-1], transposed=not self.transposed)


@dataclasses.dataclass(frozen=True)
class Stacked:
    """Pieces stacked along a new first axis (the experts of a layer)."""

    parts: tuple

    @property
    def shape(self):
        return (len(self.parts), *self.parts[0].shape)

    def read(self, files: Files, index: tuple) -> np.ndarray:
        a, b = _range(index[0], len(self.parts))
        return np.stack([self.parts[j].read(files, index[1:]) for j in range(a, b)])


@dataclasses.dataclass(frozen=True)
class Joined:
    """Parameters joined along ``axis`` (an expert's gate and up)."""

    parts: tuple
    axis: int

    @property
    def shape(self):
        s = list(self.parts[0].shape)
        s[self.axis] = sum(p.shape[self.axis] for p in self.parts)
        return tuple(s)

    def read(self, files: Files, index: tuple) -> np.ndarray:
        a, b = _range(index[self.axis], self.shape[self.axis])
        out, at = [], 0
        for p in self.parts:
            n = p.shape[self.axis]
            lo, hi = max(a, at), min(b, at + n)
            if lo < hi:
                out.append(p.read(files, index[:self.axis] + (slice(lo - at, hi - at),) + index[self.axis + 1:]))
            at += n
        return np.concatenate(out, axis=self.axis)


def _layout(views: list[np.ndarray]) -> tuple[tuple[int, ...], bool]:
    """``(origin, transposed)`` of a parameter from its index grids (each element's row, and
    column, in the checkpoint tensor)."""
    if len(views) == 1:
        (r,) = views
        if r.size and r[-1] != r[0] + r.size - 1:
            raise WeightsError("a fused tensor is split in a way the sliced reader cannot follow")
        return (int(r[0]),), False
    r, c = views
    a, b = r.shape
    r0, c0 = int(r[0, 0]), int(c[0, 0])
    if r[0, -1] == r0 and c[-1, 0] == c0 and r[-1, -1] == r0 + a - 1 and c[-1, -1] == c0 + b - 1:
        return (r0, c0), False
    if r[-1, 0] == r0 and c[0, -1] == c0 and r[-1, -1] == r0 + b - 1 and c[-1, -1] == c0 + a - 1:
        return (r0, c0), True
    raise WeightsError("a fused tensor is split in a way the sliced reader cannot follow")


def pieces(cfg, param: str, how: str | None, shape: tuple[int, ...], path: Path, name: str) -> list:
    """``(parameter, Piece)`` for each parameter checkpoint tensor ``name`` holds: the reader's
    split run over index grids (broadcast views: no memory), each part's corners read back."""
    if len(shape) == 1:
        grids = [np.arange(shape[0])]
    else:
        grids = [np.broadcast_to(np.arange(shape[0])[:, None], shape), np.broadcast_to(np.arange(shape[1]), shape)]
    split = [split_tensor(cfg, param, how, g) for g in grids]
    out = []
    for parts in zip(*split, strict=True):
        views = [v for _, v in parts]
        origin, transposed = _layout(views)
        out.append((parts[0][0], Piece(path, name, tuple(views[0].shape), origin, transposed)))
    return out


def _sources(folder: Path, cfg, files: Files) -> tuple[dict, set]:
    """The parameter tree as :class:`Piece`, :class:`Stacked` and :class:`Joined` sources (each
    tensor's header checked: the index's file holds it, its dtype and shape), and the storage
    dtypes met."""
    paths, source = shard_files(folder)
    index = source if source.name == INDEX_FILE else None
    check_layers(paths, source, cfg)
    table = tensor_table(cfg)
    found = match_table(paths, source, cfg, table)
    flat: dict = {}
    layers: dict[str, list] = {}
    stored: set = set()
    held: dict[Path, set] = {}
    for canon, (name, path) in found.items():
        param, layer, how, shape = table[canon]
        try:
            f = files.get(path)
            if path not in held:
                held[path] = set(f.keys())
            if index is not None and name not in held[path]:
                raise WeightsError(f"{index} puts tensor {name!r} in {path.name}, which does not hold it")
            sl = f.get_slice(name)
            kind, got = sl.get_dtype(), tuple(sl.get_shape())
        except WeightsError:
            raise
        except READ_ERRORS as e:
            raise WeightsError(f"{path}: corrupt or truncated safetensors file ({short_error(e)})") from None
        if kind not in FLOAT_DTYPES:
            raise WeightsError(f"{path}: tensor {name!r} is stored as {kind}; expected one of "
                               f"{', '.join(FLOAT_DTYPES)}")
        if got != shape:
            raise WeightsError(f"{path}: tensor {name!r} has shape {got}, the config implies {shape}")
        stored.add(kind)
        for pname, piece in pieces(cfg, param, how, shape, path, name):
            if layer is None:
                flat[pname] = piece
            else:
                layers.setdefault(pname, [None] * cfg.L)[layer] = piece
    files.close()
    experts: dict = {}
    for k in [k for k in layers if "/" in k]:  # e_gate/j -> e_gate [E, ...]
        base, j = k.split("/")
        for i, p in enumerate(layers.pop(k)):
            experts.setdefault(base, [[None] * cfg.experts for _ in range(cfg.L)])[i][int(j)] = p
    for base, per_layer in experts.items():
        layers[base] = [None if any(p is None for p in e) else Stacked(tuple(e)) for e in per_layer]
    if "e_gate" in layers:  # [E, F, d] each, joined as [E, 2F, d] (as read_params joins them)
        layers["e_gu"] = [None if g is None else Joined((g, u), 1)
                          for g, u in zip(layers.pop("e_gate"), layers.pop("e_up"), strict=True)]
    flat["layers"] = tuple({k: v[i] for k, v in layers.items() if v[i] is not None} for i in range(cfg.L))
    return flat, stored


FORMS = ("float32", "stored", "bfloat16", "int8")  # the ways of keeping the matrices read by slices


def _forms(tree: dict, how: str, kept: str, dtype: str) -> dict:
    """Each parameter's form, as :func:`.linear.prepare` keeps it on the portable path: a dtype
    name, or ``"int8"`` for ``{"q", "scale"}``."""
    matrix = {"float32": dtype, "stored": kept, "bfloat16": "bfloat16", "int8": "int8"}[how]
    out = {k: dtype for k in tree if k != "layers"}
    if "head" in tree:
        out["head"] = matrix
    if how in ("stored", "bfloat16"):
        out["embed"] = matrix
    out["layers"] = tuple({k: matrix if k in MATRICES else dtype for k in layer} for layer in tree["layers"])
    return out


def _scale(absmax: np.ndarray) -> np.ndarray:
    """Per-column int8 scales from the columns' largest magnitudes (as :func:`.linear.quantize`)."""
    scale = absmax / 127.0
    return np.where(scale > 0, scale, 1.0).astype(np.float32)


def _int8(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8)


class Reader:
    """Reads and checks each device's slice of a parameter, in the parameter's form."""

    def __init__(self, files: Files, dtype: str, ways: int):
        import jax.numpy as jnp

        self.files, self.ways = files, ways
        self.limit = float(jnp.finfo(dtype).max)
        self.dtype = dtype
        self.scales: dict = {}

    def values(self, src, index: tuple) -> np.ndarray:
        """Float32 values of ``src`` at ``index``, refused if not finite or beyond the load's dtype."""
        try:
            a = src.read(self.files, index)
        except WeightsError:
            raise
        except READ_ERRORS as e:
            raise WeightsError(f"{_where(src)}: corrupt or truncated safetensors file ({short_error(e)})") from None
        bad = ~np.isfinite(a)
        if bad.any():
            raise WeightsError(f"{_where(src)}: tensor {_name(src)!r} holds NaN or infinite values "
                               f"({int(bad.sum())} of the {a.size} read for one device)")
        top = float(np.abs(a).max(initial=0.0))
        if top > self.limit:
            raise WeightsError(f"{_where(src)}: tensor {_name(src)!r} holds values up to {top:.4g}, beyond the "
                               f"range of {self.dtype} (load it as float32 or bfloat16)")
        return a

    def scale(self, src, cols: slice) -> np.ndarray:
        """The int8 scales of columns ``cols`` of matrix ``src``, from the whole of those columns,
        read in row blocks of one device's share."""
        a, b = _range(cols, src.shape[1])
        key = (id(src), a, b)
        if key not in self.scales:
            K = src.shape[0]
            step = max(1, -(-K // self.ways))
            top = np.zeros(b - a, np.float32)
            for r in range(0, K, step):
                block = self.values(src, (slice(r, min(K, r + step)), slice(a, b)))
                top = np.maximum(top, np.abs(block).max(axis=0))
            self.scales[key] = _scale(top)
        return self.scales[key]

    def q(self, src, index: tuple) -> np.ndarray:
        w = self.values(src, index)
        if _range(index[0], src.shape[0]) == (0, src.shape[0]):  # every row: the scales from the slice
            scale = _scale(np.abs(w).max(axis=0))
            self.scales.setdefault((id(src), *_range(index[1], src.shape[1])), scale)
        else:
            scale = self.scale(src, index[1])
        return _int8(w, scale)


def _first(src):
    while not isinstance(src, Piece):
        src = src.parts[0]
    return src


def _where(src) -> Path:
    return _first(src).path


def _name(src) -> str:
    return _first(src).name


def _struct(src, form: str):
    if form == "int8":
        return {"q": jax.ShapeDtypeStruct(src.shape, np.int8), "scale": jax.ShapeDtypeStruct(src.shape[-1:], np.float32)}
    return jax.ShapeDtypeStruct(src.shape, np.dtype(jax.numpy.dtype(form)))


def read_sliced(folder: Path, cfg, dtype: str, how: str, mesh, embedding: str = "vocab") -> tuple[dict, str]:
    """The parameter tree of ``folder`` placed on ``mesh`` by the partition rules, each device's
    slice read from the files (``dtype``: the compute dtype; ``how``: how the matrices are kept,
    as :func:`.linear.prepare` on the portable path); and the dtype the folder stores its
    matrices in (for ``weights="stored"``)."""
    import jax.numpy as jnp

    ways = sharding.check_mesh(mesh)
    if how not in FORMS:
        raise sharding.ShardingError(f"weights={how!r} runs on one device: a model on a mesh keeps its matrices "
                                     f"as one of {', '.join(FORMS)}")
    files = Files()
    try:
        tree, stored = _sources(Path(folder), cfg, files)
        kept = STORED.get(next(iter(stored)), "float32") if len(stored) == 1 else "float32"
        if "head" not in tree and how == "int8":  # a tied output layer gets an int8 matrix of its own
            tree["head"] = tree["embed"].flipped()
        forms = _forms(tree, how, kept, dtype)
        is_src = lambda x: isinstance(x, (Piece, Stacked, Joined))
        structs = jax.tree_util.tree_map(_struct, tree, forms, is_leaf=is_src)
        shards = sharding.shardings(structs, cfg, mesh, embedding)
        reader = Reader(files, dtype, ways)

        def place(src, form, where):
            try:
                if form == "int8":
                    q = jax.make_array_from_callback(src.shape, where["q"], lambda i: reader.q(src, i))
                    s = jax.make_array_from_callback(src.shape[-1:], where["scale"],
                                                     lambda i: reader.scale(src, i[0]))
                    return {"q": q, "scale": s}
                return jax.make_array_from_callback(
                    src.shape, where, lambda i: reader.values(src, i).astype(jnp.dtype(form)))
            finally:
                files.close()
                reader.scales.clear()

        params = jax.tree_util.tree_map(place, tree, forms, shards, is_leaf=is_src)
    finally:
        files.close()
    return params, kept


__all__ = ["Files", "Joined", "Piece", "Stacked", "pieces", "read_sliced"]
