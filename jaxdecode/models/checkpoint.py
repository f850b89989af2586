"""Checkpoint folders (config.json + model.safetensors) and safe conversion of the book's .pt.

A checkpoint folder holds the tensors under the PyTorch ``state_dict`` names of the book's
``CharLM`` (``tok.weight``, ``blocks.layers.{i}.self_attn.in_proj_weight``, ...), so the same file
loads into PyTorch with ``load_state_dict(strict=False)``; the Flax layout is derived here at
load time. ``out.weight`` (tied to ``tok.weight``) and the ``mask`` buffer are left out.

:func:`read_torch_checkpoint` reads a ``torch.save`` zip archive without executing anything from
it: its pickle is interpreted by an unpickler that resolves only an allow-list of globals, each to
a harmless local function, and rejects every other one by name before anything is called.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import sys
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.models.charlm.transformer import ModelConfig
from jaxdecode.models.lm import LanguageModel
from jaxdecode.io.vocab import same_vocabulary  # noqa: F401 (a draft shares its target's tokens)
from jaxdecode.io import files
from jaxdecode.io.vocab import Vocab

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DEFAULT_NAME = "shakespeare-char"
DRAFT_NAME = "shakespeare-char-draft"
BPE_NAME = "shakespeare-bpe"  # the Llama with a byte-level BPE vocabulary (jaxdecode train --arch llama)
BPE_DRAFT_NAME = "shakespeare-bpe-draft"
SHIPPED = (DEFAULT_NAME, DRAFT_NAME, BPE_NAME, BPE_DRAFT_NAME)


class CheckpointError(ValueError):
    """A checkpoint folder or file is missing, corrupt, or does not match its config."""


class UnsafePickleError(CheckpointError):
    """A .pt file's pickle refers to a global outside the allow-list."""


# ----------------------------------------------------------------------------- name mapping

def _layer_map(i: int) -> dict[str, tuple[tuple[str, ...], bool]]:
    """torch name -> (flax path, transpose?) for layer ``i``."""
    t = f"blocks.layers.{i}."
    b = f"block_{i}"
    return {
        t + "self_attn.in_proj_weight": ((b, "attn", "qkv", "kernel"), True),
        t + "self_attn.in_proj_bias": ((b, "attn", "qkv", "bias"), False),
        t + "self_attn.out_proj.weight": ((b, "attn", "proj", "kernel"), True),
        t + "self_attn.out_proj.bias": ((b, "attn", "proj", "bias"), False),
        t + "linear1.weight": ((b, "ff1", "kernel"), True),
        t + "linear1.bias": ((b, "ff1", "bias"), False),
        t + "linear2.weight": ((b, "ff2", "kernel"), True),
        t + "linear2.bias": ((b, "ff2", "bias"), False),
        t + "norm1.weight": ((b, "ln1", "scale"), False),
        t + "norm1.bias": ((b, "ln1", "bias"), False),
        t + "norm2.weight": ((b, "ln2", "scale"), False),
        t + "norm2.bias": ((b, "ln2", "bias"), False),
    }


def name_map(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], bool]]:
    m = {
        "tok.weight": (("tok", "embedding"), False),
        "pos.weight": (("pos", "embedding"), False),
        "ln.weight": (("ln", "scale"), False),
        "ln.bias": (("ln", "bias"), False),
    }
    for i in range(cfg.L):
        m.update(_layer_map(i))
    return m


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The torch-layout shape of every tensor a checkpoint of ``cfg`` must hold."""
    V, T, d = cfg.V, cfg.T, cfg.d
    shapes = {"tok.weight": (V, d), "pos.weight": (T, d), "ln.weight": (d,), "ln.bias": (d,)}
    for i in range(cfg.L):
        t = f"blocks.layers.{i}."
        shapes.update({
            t + "self_attn.in_proj_weight": (3 * d, d), t + "self_attn.in_proj_bias": (3 * d,),
            t + "self_attn.out_proj.weight": (d, d), t + "self_attn.out_proj.bias": (d,),
            t + "linear1.weight": (4 * d, d), t + "linear1.bias": (4 * d,),
            t + "linear2.weight": (d, 4 * d), t + "linear2.bias": (d,),
            t + "norm1.weight": (d,), t + "norm1.bias": (d,),
            t + "norm2.weight": (d,), t + "norm2.bias": (d,),
        })
    return shapes


IGNORED = ("mask",)  # buffers of the torch module that are not parameters


def state_dict_to_params(state: dict[str, np.ndarray], cfg: ModelConfig, where: str = "checkpoint"):
    """Validate a torch-named state dict against ``cfg`` and build the Flax params tree."""
    shapes = expected_shapes(cfg)
    state = dict(state)
    for name in IGNORED:
        state.pop(name, None)
    if "out.weight" in state and "tok.weight" in state:
        out, tok = np.asarray(state.pop("out.weight")), np.asarray(state["tok.weight"])
        if out.shape != tok.shape:
            raise CheckpointError(
                f"{where}: out.weight has shape {out.shape} but tok.weight {tok.shape}; the model ties "
                "the output layer to the token embedding, so they must be equal")
        if not np.array_equal(out, tok):
            with np.errstate(all="ignore"):
                gap = np.nanmax(np.abs(out.astype(np.float64) - tok.astype(np.float64)), initial=0.0)
            raise CheckpointError(
                f"{where}: out.weight differs from tok.weight (largest difference {gap:.3g}); the model "
                "ties the output layer to the token embedding, so they must be equal")
    missing = [n for n in shapes if n not in state]
    if missing:
        raise CheckpointError(f"{where}: missing tensor(s) {', '.join(missing)}")
    unexpected = sorted(n for n in state if n not in shapes)
    if unexpected:
        raise CheckpointError(
            f"{where}: unexpected tensor(s) {', '.join(unexpected)} for a model with L={cfg.L} layers")
    for n, shape in shapes.items():
        got = tuple(np.shape(state[n]))
        if got != shape:
            raise CheckpointError(
                f"{where}: tensor {n} has shape {got} but the config (V={cfg.V}, T={cfg.T}, d={cfg.d}, "
                f"L={cfg.L}, heads={cfg.heads}) requires {shape}")
    params: dict[str, Any] = {}
    for n, (path, transpose) in name_map(cfg).items():
        a = _float32(state[n], n, where)
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = a.T.copy() if transpose else a
    return params


def _float32(value, name: str, where: str) -> np.ndarray:
    """A weight as float32 (from float16, bfloat16, float32 or float64), refusing anything else,
    NaN and infinities, and values that float32 cannot hold."""
    a = np.asarray(value)
    if not jnp.issubdtype(a.dtype, jnp.floating):  # jnp's test also knows bfloat16
        raise CheckpointError(
            f"{where}: tensor {name} has dtype {a.dtype}, but the model's weights are floating point")
    bad = ~np.isfinite(a)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CheckpointError(
            f"{where}: tensor {name} contains NaN or infinite values ({int(bad.sum())} of {a.size}, "
            f"the first at index {first}: {a[first]})")
    with np.errstate(over="ignore"):
        out = a.astype(np.float32)
    if not np.all(np.isfinite(out)):
        raise CheckpointError(f"{where}: tensor {name} holds values beyond the range of float32")
    return out


def params_to_state_dict(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    out = {}
    for n, (path, transpose) in name_map(cfg).items():
        node = params
        for key in path:
            node = node[key]
        a = np.asarray(node, dtype=np.float32)
        out[n] = np.ascontiguousarray(a.T if transpose else a)
    return out


# ----------------------------------------------------------------------------- folders

def config_from_dict(d: dict, where: str) -> tuple[ModelConfig, Vocab]:
    try:
        cfg = ModelConfig(**{k: d[k] for k in ("V", "T", "d", "L", "heads")})
    except KeyError as e:
        raise CheckpointError(f"{where}: config lacks field {e.args[0]!r}") from None
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    chars = d.get("chars")
    if chars is None:
        raise CheckpointError(f"{where}: config lacks the vocabulary field 'chars'")
    try:
        vocab = Vocab(chars)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    if len(vocab) != cfg.V:
        raise CheckpointError(f"{where}: config says V={cfg.V} but 'chars' has {len(vocab)} characters")
    return cfg, vocab


def default_checkpoint(name: str = DEFAULT_NAME) -> Path:
    """The folder of a shipped checkpoint, whether installed or run from a source tree."""
    try:
        from importlib.resources import files

        p = Path(str(files("jaxdecode._checkpoints") / name))
        if (p / CONFIG_FILE).is_file():
            return p
    except (ModuleNotFoundError, TypeError):
        pass
    p = Path(__file__).resolve().parents[2] / "checkpoints" / name
    if (p / CONFIG_FILE).is_file():
        return p
    raise CheckpointError(f"the shipped checkpoint {name!r} is not installed (looked for {p})")


def resolve(path: str | os.PathLike | None) -> Path:
    if path is None:
        return default_checkpoint()
    p = Path(path)
    if not p.exists() and str(path) in SHIPPED:
        return default_checkpoint(str(path))
    return p


def load(path: str | os.PathLike | None = None, *, backend: str | None = None, dtype: str = "float32",
         max_length: int | None = None, weights: str = "auto", mesh=None) -> LanguageModel:
    """Load a checkpoint folder (default: the shipped ``shakespeare-char``) onto ``backend``
    (``"native"``, ``"portable"``, or ``None``/``"auto"``: see :func:`jaxdecode.native.kernels.select`).

    A Hugging Face folder (a ``config.json`` with ``model_type`` llama, mistral, qwen2 or gpt2,
    safetensors weights, ``tokenizer.json``) loads through :func:`jaxdecode.models.hf.load_hf`
    with ``dtype`` (``"float32"`` or ``"bfloat16"``), an optional smaller window ``max_length``,
    ``weights`` (how its matrices are kept: ``"auto"``, ``"float32"``, ``"stored"``,
    ``"bfloat16"``, ``"int8"`` or ``"int4"``, see :mod:`jaxdecode.models.hf.linear`) and ``backend``
    (the native CPU layer runs its products). A GGUF file (``model.gguf``) loads through
    :func:`jaxdecode.models.gguf.load_gguf`, its matrices in their types' nearest kept forms. A
    folder or file that cannot be loaded (a corrupt or mismatched file, NaN weights, a config.json
    that is neither kind's) is refused with one :class:`CheckpointError` sentence naming the file
    and the problem.

    ``mesh``: a :class:`jax.sharding.Mesh` with a ``"model"`` axis
    (:func:`jaxdecode.decoding.placement.make_mesh`): the parameters are split over it by their
    family's partition rules (:meth:`LanguageModel.shard`), a Hugging Face folder's read slice by
    slice from its safetensors files, and every loop runs the model there. A mesh is the portable
    path's: with ``backend`` left to choose, the portable one is taken; ``backend="native"`` with a
    mesh is refused."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    from jaxdecode.models.hf import HFError, load_hf
    from jaxdecode.models.hf.families import no_model_type

    path = resolve(path)
    if mesh is not None:
        if backend == "native":
            raise CheckpointError("the native CPU layer runs on one device: a model on a mesh needs "
                                  "backend='portable'")
        backend = "portable"
    if path.is_file() and (path.suffix.lower() == ".gguf" or _gguf().is_gguf(path)):  # llama.cpp's format
        try:
            return _gguf().load_gguf(path, dtype=dtype, max_length=max_length, weights=weights, backend=backend,
                                     mesh=mesh)
        except (_gguf().GGUFError, HFError) as e:
            raise CheckpointError(str(e)) from None
    if path.is_file():
        hint = ""
        if path.suffix == ".pt":
            hint = " (convert a torch .pt file first: jaxdecode convert FILE FOLDER)"
        raise CheckpointError(f"{path} is a file, not a checkpoint folder (a folder with {CONFIG_FILE} and "
                              f"{WEIGHTS_FILE}){hint}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    cfile, wfile = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfile.is_file():
        raise CheckpointError(f"{path}: not a checkpoint folder, it has no {CONFIG_FILE}")
    meta = files.read_json(cfile, CheckpointError)
    if "model_type" in meta and "chars" not in meta:  # a Hugging Face folder
        try:
            return load_hf(path, dtype=dtype, max_length=max_length, weights=weights, backend=backend,
                           mesh=mesh)
        except HFError as e:
            raise CheckpointError(str(e)) from None
    if weights != "auto":
        raise CheckpointError(f"weights={weights!r} applies to Hugging Face folders; {path} is a character "
                              f"model (float32)")
    if "chars" not in meta and "V" not in meta:  # neither a Hugging Face nor a character model's
        raise CheckpointError(no_model_type(cfile))
    if not wfile.is_file():
        raise CheckpointError(f"{path}: incomplete checkpoint folder, it has no {WEIGHTS_FILE}")
    cfg, vocab = config_from_dict(meta, str(cfile))
    try:
        state = load_file(str(wfile))
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError, KeyError) as e:
        raise CheckpointError(f"{wfile}: corrupt or truncated safetensors file ({e})") from None
    params = state_dict_to_params(state, cfg, where=str(wfile))
    # device arrays: immutable, so work derived from them (packed weights) can be reused
    params = jax.tree_util.tree_map(jnp.asarray, params)
    lm = LanguageModel(params=params, cfg=cfg, vocab=vocab, meta=meta, path=path, backend=backend)
    return lm if mesh is None else _on_mesh(lm, mesh)


def _gguf():
    from jaxdecode.models import gguf

    return gguf


def _on_mesh(lm: LanguageModel, mesh) -> LanguageModel:
    from jaxdecode.models.hf.sharding import ShardingError

    try:
        return lm.shard(mesh)
    except ShardingError as e:
        raise CheckpointError(str(e)) from None


def atomic_folder(target, overwrite: bool = True):
    """:func:`jaxdecode.io.files.atomic_folder`, with the checkpoint's error."""
    return files.atomic_folder(target, overwrite, error=CheckpointError)


def save(path, params, cfg: ModelConfig, vocab: Vocab, meta: dict | None = None,
         overwrite: bool = True, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write a checkpoint folder atomically (no half-written folder is ever left behind)."""
    from safetensors.numpy import save_file

    if len(vocab) != cfg.V:
        raise CheckpointError(f"vocabulary has {len(vocab)} characters but V={cfg.V}")
    config = {"V": cfg.V, "T": cfg.T, "d": cfg.d, "L": cfg.L, "heads": cfg.heads, "chars": vocab.chars}
    for k, v in (meta or {}).items():
        if k not in config:
            config[k] = v
    with atomic_folder(path, overwrite) as tmp:
        save_file(params_to_state_dict(params, cfg), str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                       encoding="utf-8")
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
    return Path(path)


# ----------------------------------------------------------------------------- safe .pt reader

_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
    "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
    "BFloat16Storage": "bfloat16",
}


@dataclasses.dataclass(frozen=True)
class _StorageType:
    dtype: Any


def _rebuild_tensor(storage, offset, size, stride, *_ignored):
    if not isinstance(storage, np.ndarray):
        raise CheckpointError(f"a tensor refers to {type(storage).__name__} instead of a storage")
    offset = int(offset)
    size, stride = tuple(int(n) for n in size), tuple(int(s) for s in stride)
    # as_strided does no bounds checking: make sure every element lies inside the storage
    if (len(size) != len(stride) or offset < 0 or any(n < 0 for n in size)
            or any(s < 0 for s in stride)):
        raise CheckpointError(
            f"a tensor of shape {size} has an invalid layout (offset {offset}, stride {stride}) "
            "in its storage")
    if 0 in size:
        return np.zeros(size, storage.dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= storage.shape[0]:
        raise CheckpointError(
            f"a tensor of shape {size} (offset {offset}, stride {stride}) reaches element {last} "
            f"of a storage of {storage.shape[0]} elements")
    if not size:
        return storage[offset].copy()
    itemsize = storage.dtype.itemsize
    return np.lib.stride_tricks.as_strided(
        storage[offset:], shape=size, strides=tuple(s * itemsize for s in stride)).copy()


def _rebuild_parameter(data, *_ignored):
    return data


def _ordered_dict(*args):
    return OrderedDict(*args)


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): _ordered_dict,
}


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storages):
        super().__init__(io.BytesIO(data))
        self._storages = storages

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise UnsafePickleError(
            f"refusing to load: the pickle refers to {module}.{name}, which is not on the allow-list "
            "of tensor-rebuilding functions (nothing from the file was executed)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            shown = repr(pid)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise UnsafePickleError(
                f"refusing to load: unknown persistent id {shown} (torch.save writes ('storage', ...))")
        _, stype, key, _location, numel = pid[:5]
        if not isinstance(stype, _StorageType):
            raise UnsafePickleError(f"refusing to load: storage of unknown type {stype!r}")
        if not isinstance(key, str) or isinstance(numel, bool) or not isinstance(numel, int):
            raise CheckpointError(f"a storage reference has key {key!r} and size {numel!r}; expected a "
                                  "string and an integer")
        return self._storages(key, stype.dtype, numel)


def _storage_dtype(dtype) -> np.dtype:
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def read_torch_checkpoint(path) -> Any:
    """Read a ``torch.save`` zip archive into plain Python objects with numpy arrays.

    Storages keep their dtype (float16, bfloat16 and float64 included) in native byte order; the
    archive's ``byteorder`` entry (``little`` when absent) says how they were written."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path}: not a torch.save zip archive (the legacy non-zip format is not supported; "
            "re-save it with torch>=1.6)")
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            pkl = [n for n in names if n == "data.pkl" or n.endswith("/data.pkl")]
            if len(pkl) != 1:
                found = f" ({', '.join(pkl)})" if pkl else ""
                raise CheckpointError(
                    f"{path}: expected one data.pkl in the archive, found {len(pkl)}{found}")
            prefix = pkl[0][: -len("data.pkl")]
            byteorder = "little"
            if prefix + "byteorder" in names:
                byteorder = z.read(prefix + "byteorder").decode("ascii", "replace").strip()
                if byteorder not in ("little", "big"):
                    raise CheckpointError(
                        f"{path}: the archive's byteorder entry says {byteorder[:40]!r}; "
                        "expected 'little' or 'big'")
            swap = byteorder != sys.byteorder
            cache: dict[str, np.ndarray] = {}

            def storage(key, dtype, numel):
                if key not in cache:
                    entry = f"{prefix}data/{key}"
                    if entry not in names:
                        raise CheckpointError(f"{path}: the archive lacks tensor storage {entry}")
                    if numel < 0:
                        raise CheckpointError(f"{path}: storage {entry} has a negative size ({numel})")
                    dt = _storage_dtype(dtype)
                    raw = z.read(entry)
                    need = numel * dt.itemsize
                    if len(raw) < need:
                        raise CheckpointError(
                            f"{path}: storage {entry} is truncated: it holds {len(raw)} bytes, but its "
                            f"{numel} {dt.name} elements need {need}")
                    a = np.frombuffer(raw, dtype=dt, count=numel)
                    if swap and dt.itemsize > 1:  # through unsigned integers: works for bfloat16 too
                        a = a.view(f"u{dt.itemsize}").byteswap().view(dt)
                    cache[key] = a
                return cache[key]

            return _SafeUnpickler(z.read(pkl[0]), storage).load()
    except CheckpointError as e:
        if str(e).startswith(str(path)):
            raise
        raise type(e)(f"{path}: {e}") from None  # name the file in errors raised while unpickling
    except (zipfile.BadZipFile, zlib.error, pickle.UnpicklingError, EOFError, ValueError, TypeError,
            IndexError, KeyError, AttributeError, OverflowError, RuntimeError, NotImplementedError,
            OSError) as e:
        raise CheckpointError(f"{path}: corrupt torch checkpoint ({type(e).__name__}: {e})") from None


def convert(pt_path, out_dir, overwrite: bool = False, meta: dict | None = None) -> Path:
    """Turn the book's ``{"config", "chars", "state_dict"}`` .pt into a checkpoint folder."""
    obj = read_torch_checkpoint(pt_path)
    where = str(pt_path)
    if not isinstance(obj, dict) or not {"config", "chars", "state_dict"} <= set(obj):
        keys = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(f"{where}: expected a dict with 'config', 'chars' and 'state_dict', got {keys}")
    if not isinstance(obj["config"], dict):
        raise CheckpointError(f"{where}: 'config' is a {type(obj['config']).__name__}, expected a dict")
    if not isinstance(obj["state_dict"], dict):
        raise CheckpointError(
            f"{where}: 'state_dict' is a {type(obj['state_dict']).__name__}, expected a dict")
    chars = obj["chars"]
    if isinstance(chars, (list, tuple)) and all(isinstance(c, str) for c in chars):
        chars = "".join(chars)
    if not isinstance(chars, str):
        raise CheckpointError(f"{where}: 'chars' must be a list of characters or a string")
    config = dict(obj["config"])
    config["chars"] = chars
    cfg, vocab = config_from_dict(config, where)
    params = state_dict_to_params(dict(obj["state_dict"]), cfg, where=where)
    provenance = {"converted_from": Path(pt_path).name}
    provenance.update(meta or {})
    return save(out_dir, params, cfg, vocab, meta=provenance, overwrite=overwrite)
