"""Reading a Hugging Face folder's safetensors into the decoder's parameter tree.

Loading is a table from checkpoint tensor names to parameter paths (:func:`tensor_table`, from the
names of the family's entry, :class:`~.families.Tensors`), checked both ways: a missing tensor, a
tensor of the wrong shape or an integer dtype, a shard the index names but the folder lacks (or
that lacks a tensor the index puts in it), a weight the table does not know, a corrupt file, NaN
or infinite values, is one :class:`WeightsError` line naming the file and the tensor. Buffers that
are not weights (GPT-2's ``attn.bias``/``attn.masked_bias`` masks, rotary ``inv_freq``) and an
output matrix stored beside a tied embedding are skipped.

The parameter tree (``layers`` a tuple of ``L`` dicts: each layer's matrices are separate buffers,
which a decode step reads in place)::

    embed [V, d]; pos [T, d] (learned positions only); norm_w [d], norm_b [d] (LayerNorm only);
    head [d, V] (untied only)
    layers: norm1_w, norm1_b?, wq [d, H*hd], wk/wv [d, KV*hd], bq?, bk?, bv?, wo [H*hd, d], bo?,
            norm2_w, norm2_b?, w_gate [d, F] (gated MLP only), w_up [d, F], b_up?, w_down [F, d], b_down?,
            q_norm/k_norm [hd] or [H*hd]/[KV*hd] (q/k norms), norm_pa/norm_pf [d] (norms after
            attention and after the MLP), or for a mixture of experts the MLP of :mod:`.moe`

Every matrix is stored as ``x @ W`` wants it: ``nn.Linear`` weights ([out, in]) are transposed
here, GPT-2's ``Conv1D`` weights ([in, out]) are not. Phi-3's fused ``qkv_proj`` and
``gate_up_proj`` are split into the separate matrices; the experts' per-expert matrices are stacked
(``e_gate/3`` in the table is expert 3 of ``e_gate``; gate and up are then joined, :mod:`.moe`).
A Gemma 3 image-text folder's text decoder is read from its ``language_model`` tensors.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from jaxdecode.io.files import read_json
from jaxdecode.models.hf.config import HFConfig
from jaxdecode.models.hf.families import family


class WeightsError(ValueError):
    """The weights of a folder are missing, corrupt or do not match its config."""


IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")
FLOAT_DTYPES = ("F32", "BF16", "F16")


def tensor_table(cfg: HFConfig) -> dict[str, tuple[str, int | None, str | None, tuple[int, ...]]]:
    """Checkpoint name -> ``(parameter, layer or None, how, shape)``, from the names of the config's
    family (:class:`~.families.Tensors`); ``how`` is ``"T"`` (transpose an ``nn.Linear`` weight),
    ``"qkv"`` (a fused ``Conv1D`` q/k/v, split in three), ``"Tqkv"``/``"Tgu"`` (a fused
    ``nn.Linear`` q/k/v or gate/up, transposed and split) or None."""
    names = family(cfg).tensors
    d, F, hd = cfg.d, cfg.ffn, cfg.head_dim
    q, kv = cfg.heads * hd, cfg.kv_heads * hd

    def mat(name: str, param: str, layer, n_in: int, n_out: int, fused: str = "") -> dict:
        """A matrix ``x @ W`` ``[n_in, n_out]`` (``nn.Linear`` stores it ``[n_out, n_in]``)."""
        if names.linear:
            return {name + ".weight": (param, layer, "T" + fused, (n_out, n_in))}
        return {name + ".weight": (param, layer, fused or None, (n_in, n_out))}

    def norm(name: str, param: str, layer, n: int = d) -> dict:
        out = {name + ".weight": (param, layer, None, (n,))}
        if cfg.norm == "layer":
            out[name + ".bias"] = (param.removesuffix("_w") + "_b", layer, None, (n,))
        return out

    table: dict = {names.embed + ".weight": ("embed", None, None, (cfg.V, d))}
    if cfg.positions == "learned":
        table[names.positions + ".weight"] = ("pos", None, None, (cfg.T, d))
    table |= norm(names.norm, "norm_w", None)
    if not cfg.tied:
        table |= mat(names.head, "head", None, d, cfg.V)
    for i in range(cfg.L):
        h = names.layer.format(i=i)
        for name, param in names.norms:
            table |= norm(h + name, param, i)
        if names.qkv:
            table |= mat(h + names.qkv, "wqkv", i, d, q + 2 * kv, "qkv")
        else:
            table |= (mat(h + names.q, "wq", i, d, q) | mat(h + names.k, "wk", i, d, kv)
                      | mat(h + names.v, "wv", i, d, kv))
        table |= mat(h + names.o, "wo", i, q, d)
        if cfg.qk_norm:
            qn, kn = (hd, hd) if cfg.qk_norm == "head" else (q, kv)
            table |= norm(h + names.q_norm, "q_norm", i, qn) | norm(h + names.k_norm, "k_norm", i, kn)
        if cfg.qkv_bias and names.qkv:
            table[h + names.qkv + ".bias"] = ("bqkv", i, "qkv", (q + 2 * kv,))
        elif cfg.qkv_bias:
            table |= {h + names.q + ".bias": ("bq", i, None, (q,)), h + names.k + ".bias": ("bk", i, None, (kv,)),
                      h + names.v + ".bias": ("bv", i, None, (kv,))}
        if cfg.o_bias:
            table[h + names.o + ".bias"] = ("bo", i, None, (d,))
        if cfg.is_moe(i):
            table |= _expert_table(cfg, i)
            continue
        if names.gate_up:
            table |= mat(h + names.gate_up, "w_gate_up", i, d, 2 * F, "gu")
        else:
            table |= mat(h + names.gate, "w_gate", i, d, F) if cfg.mlp == "gated" else {}
            table |= mat(h + names.up, "w_up", i, d, F)
        table |= mat(h + names.down, "w_down", i, F, d)
        if cfg.mlp_bias:
            if cfg.mlp == "gated":
                table[h + names.gate + ".bias"] = ("b_gate", i, None, (F,))
            table |= {h + names.up + ".bias": ("b_up", i, None, (F,)),
                      h + names.down + ".bias": ("b_down", i, None, (d,))}
    return table


def _expert_table(cfg: HFConfig, i: int) -> dict:
    """Layer ``i``'s router, experts (stacked: ``e_gate/j`` is expert ``j``) and shared expert."""
    d, F, Fs = cfg.d, cfg.moe_ffn, cfg.shared_ffn
    spec = family(cfg)
    mlp, names = spec.tensors.layer.format(i=i) + spec.moe.prefix, spec.moe.names
    table = {mlp + "gate.weight": ("router", i, "T", (cfg.experts, d))}
    for j in range(cfg.experts):
        e = f"{mlp}experts.{j}."
        table |= {e + names[0] + ".weight": (f"e_gate/{j}", i, None, (F, d)),
                  e + names[1] + ".weight": (f"e_up/{j}", i, None, (F, d)),
                  e + names[2] + ".weight": (f"e_down/{j}", i, "T", (d, F))}
    if Fs:
        s = mlp + "shared_expert."
        table |= {s + "gate_proj.weight": ("s_gate", i, "T", (Fs, d)),
                  s + "up_proj.weight": ("s_up", i, "T", (Fs, d)),
                  s + "down_proj.weight": ("s_down", i, "T", (d, Fs)),
                  mlp + "shared_expert_gate.weight": ("s_router", i, "T", (1, d))}
    return table


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def shard_files(folder: Path) -> tuple[dict[str, Path], Path]:
    """Tensor name -> the file holding it, for ``model.safetensors`` or a sharded index; and the
    file that lists the tensors (the index, or the single file)."""
    single = folder / SINGLE_FILE
    index = folder / INDEX_FILE
    if index.is_file():
        raw = read_json(index, WeightsError, object_only=False)
        if not isinstance(raw, dict) or "weight_map" not in raw:
            raise WeightsError(f"{index}: has no weight_map (the map from tensor names to shard files)")
        weight_map = raw["weight_map"]
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise WeightsError(f"{index}: the weight_map must map tensor names to shard file names")
        files = {}
        for name, file in weight_map.items():
            path = folder / file
            if Path(file).name != file or not path.is_file():
                raise WeightsError(f"{index} names the shard {file}, which the folder does not have")
            files[name] = path
        return files, index
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="numpy") as f:
                return {name: single for name in f.keys()}, single
        except Exception as e:  # safetensors raises several types for a corrupt header
            raise WeightsError(f"{single}: corrupt or truncated safetensors file ({short_error(e)})") from None
    raise WeightsError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} "
                       "(only safetensors weights are read; convert .bin files first)")


def short_error(e: Exception) -> str:
    """A library's error without its boilerplate prefix."""
    return str(e).removeprefix("Error while deserializing header: ")


def _canonical(name: str, cfg: HFConfig) -> str:
    """A stored name as the family's table names it (a prefix some folders add, renamed)."""
    for old, new in family(cfg).tensors.renames:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def check_layers(files: dict[str, Path], source: Path, cfg: HFConfig) -> None:
    """Refuse a config with more layers than the weights hold before building a table per layer
    (a ``num_hidden_layers`` of a billion would otherwise take minutes to be refused)."""
    held = {int(m.group(1)) for name in files if (m := LAYER.search(name))}
    if cfg.L > len(held):
        raise WeightsError(f"{source}: the weights hold {len(held)} layers, "
                           f"but config.json's {family(cfg).layers_field} is {cfg.L}")


def match_table(files: dict[str, Path], source: Path, cfg: HFConfig, table: dict) -> dict:
    """Checkpoint name (canonical) -> ``(stored name, file)``, every table entry found once."""
    found: dict[str, tuple[str, Path]] = {}
    skipped = family(cfg).tensors.skipped
    for name, path in files.items():
        canon = _canonical(name, cfg)
        if canon in table:
            found[canon] = (name, path)
        elif (IGNORED.search(canon) or canon == "lm_head.weight" and cfg.tied
              or skipped and re.search(skipped, canon)):
            continue
        else:
            raise WeightsError(f"{path}: unexpected tensor {name!r} for a {cfg.model_type} of this "
                               "config.json (is config.json from another model?)")
    missing = [n for n in table if n not in found]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightsError(f"{source}: the weights lack {', '.join(missing[:3])}{more}, which a "
                           f"{cfg.model_type} of this config.json needs")
    return found


def _checked(f, held: set, name: str, path: Path, shape: tuple, index: Path | None, dtype) -> np.ndarray:
    """Tensor ``name`` of the open file ``f`` as float32, refused in one line when the index lists
    it but the shard lacks it, or its dtype, shape or values are wrong."""
    import jax.numpy as jnp

    if index is not None and name not in held:
        raise WeightsError(f"{index} puts tensor {name!r} in {path.name}, which does not hold it")
    sl = f.get_slice(name)
    if sl.get_dtype() not in FLOAT_DTYPES:
        raise WeightsError(f"{path}: tensor {name!r} is stored as {sl.get_dtype()}; "
                           f"expected one of {', '.join(FLOAT_DTYPES)}")
    if tuple(sl.get_shape()) != shape:
        raise WeightsError(f"{path}: tensor {name!r} has shape {tuple(sl.get_shape())}, "
                           f"the config implies {shape}")
    a = np.asarray(f.get_tensor(name), np.float32)
    bad = ~np.isfinite(a)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise WeightsError(f"{path}: tensor {name!r} holds NaN or infinite values ({int(bad.sum())} of "
                           f"{a.size}, the first at index {first}: {a[first]})")
    top = float(np.abs(a).max(initial=0.0))
    limit = float(jnp.finfo(dtype).max)
    if top > limit:
        raise WeightsError(f"{path}: tensor {name!r} holds values up to {top:.4g}, beyond the range of "
                           f"{np.dtype(dtype).name} (load it as float32 or bfloat16)")
    return a


def read_params(folder: Path, cfg: HFConfig, dtype, stored: set | None = None) -> dict:
    """The parameter tree of ``folder``'s weights as ``dtype`` device arrays (float32 storage,
    bfloat16 or float16 are read alike; ``stored``, a set, collects the storage dtypes met, as
    safetensors names them). Every tensor is checked before use: its dtype, shape, and values (NaN,
    infinities, and values that ``dtype`` cannot hold are refused, naming the tensor)."""
    import jax.numpy as jnp
    from safetensors import safe_open

    files, source = shard_files(folder)
    index = source if source.name == INDEX_FILE else None
    check_layers(files, source, cfg)
    table = tensor_table(cfg)
    found = match_table(files, source, cfg, table)

    flat: dict[str, object] = {}
    layers: dict[str, list] = {}
    by_file: dict[Path, list[str]] = {}
    for canon, (_name, path) in found.items():
        by_file.setdefault(path, []).append(canon)
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="numpy") as f:
                held = set(f.keys())
                for canon in names:
                    param, layer, how, shape = table[canon]
                    a = _checked(f, held, found[canon][0], path, shape, index, dtype)
                    if stored is not None:
                        stored.add(f.get_slice(found[canon][0]).get_dtype())
                    for pname, part in split_tensor(cfg, param, how, a):
                        if layer is None:
                            flat[pname] = jnp.asarray(part, dtype)
                        else:
                            layers.setdefault(pname, [None] * cfg.L)[layer] = part
        except WeightsError:
            raise
        except Exception as e:
            raise WeightsError(f"{path}: corrupt or truncated safetensors file ({short_error(e)})") from None
    stacked: dict = {}
    for k, v in layers.items():  # experts: e_gate/j -> e_gate [E, ...]
        if "/" in k:
            base, j = k.split("/")
            for i, a in enumerate(v):
                stacked.setdefault(base, [[None] * cfg.experts for _ in range(cfg.L)])[i][int(j)] = a
    layers = {k: v for k, v in layers.items() if "/" not in k}
    for base, per_layer in stacked.items():
        layers[base] = [None if any(a is None for a in e) else np.stack(e) for e in per_layer]
    if "e_gate" in layers:  # [E, F, d] each: one [E, 2F, d] read per chosen expert
        layers["e_gu"] = [None if g is None else np.concatenate([g, u], axis=1)
                          for g, u in zip(layers.pop("e_gate"), layers.pop("e_up"))]
    flat["layers"] = tuple({k: jnp.asarray(v[i], dtype) for k, v in layers.items() if v[i] is not None}
                           for i in range(cfg.L))
    return flat


def split_tensor(cfg: HFConfig, param: str, how: str | None, a: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A checkpoint tensor as ``(parameter, array)`` pieces: transposed, and split where fused."""
    if how in ("T", "Tqkv", "Tgu"):
        a = a.T
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    if how in ("qkv", "Tqkv"):  # fused q/k/v (GPT-2's c_attn, Phi-3's qkv_proj): H*hd, KV*hd, KV*hd
        return list(zip([param[0] + s + param[4:] for s in "qkv"], np.split(a, [q, q + kv], axis=-1)))
    if how == "Tgu":  # fused gate and up (Phi-3's gate_up_proj): gate, then up
        return list(zip(("w_gate", "w_up"), np.split(a, 2, axis=-1)))
    return [(param, a)]
