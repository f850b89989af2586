"""A Hugging Face folder quantized to int8 or int4 once, saved, and loaded back exactly
(``jaxdecode quantize [--weights int4]``).

The folder keeps the source's ``config.json`` (with a ``"jaxdecode_weights"`` record added, whose
``"format"`` is ``"int8"`` or ``"int4"``), tokenizer and generation files, and one
``model.safetensors`` holding jaxdecode's parameter tree as it is after
:func:`jaxdecode.models.hf.linear.prepare` with ``weights="int8"`` or ``"int4"``: every int8
matrix as ``<path>.q`` (int8 ``[K, N]``) and ``<path>.scale`` (float32 ``[N]``), every int4
matrix as ``<path>.q4`` (uint8 ``[K / 2, N]``, two weights a byte: row ``k`` even in the low
four bits, ``k + 1`` in the high four, each stored as ``q + 8``) and ``<path>.scale`` (float16
``[K / 32, N]``), every other parameter as loaded. Loading it reads those tensors back as they were written, so its outputs
equal those of the model it was saved from, on either path. It is jaxdecode's own layout:
transformers cannot read it (there is no transformers format for weight-only int8 without a
quantization library).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

MARK = "jaxdecode_weights"
RECORD = {"format": "int8", "scheme": "symmetric, one float32 scale per output column",
          "layout": "jaxdecode parameter tree (not readable by transformers)"}
RECORD4 = {"format": "int4", "scheme": "symmetric, one float16 scale per output column and group of 32 "
                                       "input rows (matrices whose input is not a multiple of 32: int8)",
           "layout": "jaxdecode parameter tree (not readable by transformers)"}
FORMATS = ("int8", "int4")
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
          "special_tokens_map.json")


class QuantizedError(ValueError):
    """A quantized folder that cannot be written or read (one line naming the problem)."""


def _flatten(params) -> dict[str, np.ndarray]:
    from jaxdecode.native import kernels

    flat: dict[str, np.ndarray] = {}

    def put(prefix, value):
        if isinstance(value, dict) and ("q4" in value or "packed" in value and value["packed"].dtype == np.uint8):
            if "q4" in value:  # int4, portable or packed: two weights a byte
                u = np.asarray(value["q4"]).astype(np.int8) + 8
                scale = np.asarray(value["scale"], np.float16)
            else:
                u, scale = kernels.unpack4(value["packed"], value["scale"])
            u = u.astype(np.uint8)
            flat[prefix + ".q4"] = u[0::2] | (u[1::2] << 4)
            flat[prefix + ".scale"] = np.asarray(scale, np.float16)
        elif isinstance(value, dict) and "scale" in value:  # an int8 matrix, portable or packed
            q = value["q"] if "q" in value else kernels.unpack(value["packed"])
            flat[prefix + ".q"] = np.asarray(q)
            flat[prefix + ".scale"] = np.asarray(value["scale"], np.float32)
        elif isinstance(value, dict):
            raise QuantizedError(f"parameter {prefix} is not quantized (load the model with weights='int8' or "
                                 f"'int4')")
        else:
            flat[prefix] = np.asarray(value)

    for name, value in params.items():
        if name == "layers":
            for i, layer in enumerate(value):
                for k, v in layer.items():
                    put(f"layers.{i}.{k}", v)
        else:
            put(name, value)
    return flat


def save_int8(lm, dst) -> Path:
    """Write ``lm`` (a Hugging Face model loaded with ``weights="int8"`` or ``"int4"``) as a
    quantized folder of that format."""
    from safetensors.numpy import save_file

    from jaxdecode.io.files import atomic_folder

    kind = lm.meta.get("weights")
    if lm.meta.get("format") != "huggingface" or kind not in FORMATS:
        raise QuantizedError("quantize: the model must be a Hugging Face folder loaded with weights='int8' or "
                             "'int4'")
    src = Path(lm.path)
    flat = _flatten(lm.params)
    with atomic_folder(dst, error=QuantizedError) as tmp:
        config = json.loads((src / "config.json").read_text(encoding="utf-8"))
        config[MARK] = dict(RECORD if kind == "int8" else RECORD4, source=str(src))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for name in COPIED:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        save_file(flat, str(tmp / "model.safetensors"), metadata={"format": f"jaxdecode-{kind}"})
    return Path(dst)


save = save_int8


def is_quantized(raw: dict) -> bool:
    return MARK in raw


def kind(raw: dict) -> str:
    """The format of a quantized folder's config (``"int8"``, ``"int4"``); one line if unknown."""
    record = raw.get(MARK)
    found = record.get("format", "int8") if isinstance(record, dict) else "int8"
    if found not in FORMATS:
        raise QuantizedError(f"the folder's {MARK} record names format {found!r}, not one of {', '.join(FORMATS)}")
    return found


def _int4(path: Path, name: str, v: dict) -> dict:
    """A matrix read as ``{"q4": uint8 [K / 2, N], "scale"}`` as the portable int4 matrix, checked."""
    import jax.numpy as jnp

    a, scale = np.asarray(v["q4"]), v["scale"]
    if set(v) != {"q4", "scale"} or a.dtype != np.uint8 or a.ndim != 2 or scale.dtype != jnp.float16 \
            or (2 * a.shape[0]) % 32 or tuple(scale.shape) != (2 * a.shape[0] // 32, a.shape[1]):
        raise QuantizedError(f"{path}: matrix {name!r} is not an int4 matrix with a float16 scale per column and "
                             f"group of 32")
    u = np.empty((2 * a.shape[0], a.shape[1]), np.int8)
    u[0::2], u[1::2] = a & 15, a >> 4
    return {"q4": jnp.asarray((u - 8).astype(jnp.int4)), "scale": jnp.asarray(scale)}


def read_int8(folder: Path, cfg, mesh=None) -> dict:
    """The parameter tree of an int8 folder (int8 matrices as ``{"q", "scale"}``), checked
    against its config: every layer present, shapes as the config implies for the matrices named.
    With ``mesh``: placed on it by the partition rules (:mod:`.sharding`), each device's slice
    read from the file (a scale with its columns)."""
    import jax.numpy as jnp
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import load_file

    path = folder / "model.safetensors"
    try:
        if mesh is None:
            state = {k: jnp.asarray(a) for k, a in load_file(str(path)).items()}
        else:  # shapes and dtypes only: the values are read per device below
            with safe_open(str(path), framework="numpy") as f:
                state = {k: _struct(f.get_slice(k)) for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise QuantizedError(f"{path}: corrupt or truncated safetensors file ({e})") from None
    params: dict = {}
    layers: list[dict] = [{} for _ in range(cfg.L)]
    for key, a in state.items():
        parts = key.split(".")
        if parts[0] == "layers":
            if len(parts) < 3 or not parts[1].isdigit() or int(parts[1]) >= cfg.L:
                raise QuantizedError(f"{path}: tensor {key!r} names no layer of this config ({cfg.L} layers)")
            target, name, rest = layers[int(parts[1])], parts[2], parts[3:]
        else:
            target, name, rest = params, parts[0], parts[1:]
        if rest:
            target.setdefault(name, {})[rest[0]] = a
        else:
            target[name] = a
    if any(not layer for layer in layers) or "embed" not in params:
        raise QuantizedError(f"{path}: the int8 folder lacks layers or the embedding its config implies")
    for where in (params, *layers):
        for name, v in where.items():
            if isinstance(v, dict) and "q4" in v:  # int4 (read whole: no mesh)
                if mesh is not None:
                    raise QuantizedError(f"{path}: an int4 folder is read on one device, not on a mesh")
                where[name] = _int4(path, name, v)
            elif isinstance(v, dict) and (set(v) != {"q", "scale"} or v["q"].dtype != jnp.int8
                                        or v["scale"].shape != (v["q"].shape[1],)):
                raise QuantizedError(f"{path}: matrix {name!r} is not an int8 matrix with one scale per column")
    if params["embed"].shape != (cfg.V, cfg.d):
        raise QuantizedError(f"{path}: the embedding has shape {tuple(params['embed'].shape)}, the config "
                             f"implies {(cfg.V, cfg.d)}")
    params["layers"] = tuple(layers)
    return params if mesh is None else _sliced(path, params, cfg, mesh)


def _struct(sl):
    import jax

    dtypes = {"I8": np.int8, "F32": np.float32, "BF16": "bfloat16", "F16": np.float16}
    if sl.get_dtype() not in dtypes:
        raise QuantizedError(f"tensor of dtype {sl.get_dtype()} in an int8 folder")
    return jax.ShapeDtypeStruct(tuple(sl.get_shape()), np.dtype(jax.numpy.dtype(dtypes[sl.get_dtype()])))


def _sliced(path: Path, structs: dict, cfg, mesh) -> dict:
    """``structs`` (the tree of the file's shapes) read onto ``mesh``, each device its slice."""
    import jax

    from jaxdecode.models.hf import sharding
    from jaxdecode.models.hf.sliced import Files

    where = sharding.shardings(structs, cfg, mesh)
    files = Files()  # the file mapped for one tensor at a time

    def place(key, s, at):
        try:
            return jax.make_array_from_callback(s.shape, at, lambda i: files.get(path).get_slice(key)[i])
        finally:
            files.close()

    flat = {k: place(k, s, at) for k, (s, at) in _by_name(structs, where).items()}
    return _unflatten(flat, cfg.L)


def _by_name(structs: dict, where: dict) -> dict:
    """Checkpoint name -> (shape stand-in, sharding), over the tree (the names of :func:`_flatten`)."""
    out = {}

    def put(prefix, s, at):
        if isinstance(s, dict):
            for k in s:
                out[f"{prefix}.{k}"] = (s[k], at[k])
        else:
            out[prefix] = (s, at)

    for name, s in structs.items():
        if name == "layers":
            for i, layer in enumerate(s):
                for k, v in layer.items():
                    put(f"layers.{i}.{k}", v, where["layers"][i][k])
        else:
            put(name, s, where[name])
    return out


def _unflatten(flat: dict, L: int) -> dict:
    params: dict = {}
    layers: list[dict] = [{} for _ in range(L)]
    for key, a in flat.items():
        parts = key.split(".")
        target, parts = (layers[int(parts[1])], parts[2:]) if parts[0] == "layers" else (params, parts)
        if len(parts) > 1:
            target.setdefault(parts[0], {})[parts[1]] = a
        else:
            target[parts[0]] = a
    params["layers"] = tuple(layers)
    return params


def packed(params: dict) -> dict:
    """A quantized tree's matrices packed for the native kernel (where their width allows it)."""
    from jaxdecode.models.hf.linear import packed_int4, packed_int8

    def pack(v):
        if isinstance(v, dict) and "q4" in v:
            if v["q4"].shape[1] % 16:
                return v
            return packed_int4(np.asarray(v["q4"]).astype(np.int8) + 8, np.asarray(v["scale"]))
        return packed_int8(v) if isinstance(v, dict) else v

    out = {k: pack(v) for k, v in params.items() if k != "layers"}
    out["layers"] = tuple({k: pack(v) for k, v in layer.items()} for layer in params["layers"])
    return out


__all__ = ["FORMATS", "MARK", "QuantizedError", "is_quantized", "kind", "packed", "read_int8", "save",
           "save_int8"]
