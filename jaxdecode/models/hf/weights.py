"""Reading a Hugging Face folder's safetensors into the decoder's parameter tree.

Loading is a table from checkpoint tensor names to parameter paths (:func:`tensor_table`), checked
both ways: a missing tensor, a tensor of the wrong shape, a shard the index names but the folder
lacks, or a weight the table does not know is one :class:`WeightsError` line naming it. Buffers
that are not weights (GPT-2's ``attn.bias``/``attn.masked_bias`` masks, rotary ``inv_freq``) and
an output matrix stored beside a tied embedding are skipped.

The parameter tree (``layers`` a tuple of ``L`` dicts: each layer's matrices are separate buffers, which
a decode step reads in place)::

    embed [V, d]; pos [T, d] (learned positions only); norm_w [d], norm_b [d] (LayerNorm only);
    head [d, V] (untied only)
    layers: norm1_w, norm1_b?, wq [d, H*hd], wk/wv [d, KV*hd], bq?, bk?, bv?, wo [H*hd, d], bo?,
            norm2_w, norm2_b?, w_gate [d, F] (gated MLP only), w_up [d, F], b_up?, w_down [F, d], b_down?

Every matrix is stored as ``x @ W`` wants it: ``nn.Linear`` weights ([out, in]) are transposed
here, GPT-2's ``Conv1D`` weights ([in, out]) are not.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from jaxdecode.models.hf.config import HFConfig


class WeightsError(ValueError):
    """The weights of a folder are missing, corrupt or do not match its config."""


IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")
FLOAT_DTYPES = ("F32", "BF16", "F16")


def tensor_table(cfg: HFConfig) -> dict[str, tuple[str, int | None, str | None, tuple[int, ...]]]:
    """Checkpoint name -> ``(parameter, layer or None, how, shape)``; ``how`` is ``"T"`` (transpose
    an ``nn.Linear`` weight), ``"qkv"`` (GPT-2's fused ``c_attn``, split into three) or None."""
    d, F, hd = cfg.d, cfg.ffn, cfg.head_dim
    q, kv = cfg.heads * hd, cfg.kv_heads * hd
    table: dict = {}
    if cfg.model_type == "gpt2":
        table["wte.weight"] = ("embed", None, None, (cfg.V, d))
        table["wpe.weight"] = ("pos", None, None, (cfg.T, d))
        table["ln_f.weight"] = ("norm_w", None, None, (d,))
        table["ln_f.bias"] = ("norm_b", None, None, (d,))
        for i in range(cfg.L):
            h = f"h.{i}."
            table |= {
                h + "ln_1.weight": ("norm1_w", i, None, (d,)), h + "ln_1.bias": ("norm1_b", i, None, (d,)),
                h + "attn.c_attn.weight": ("wqkv", i, "qkv", (d, 3 * d)),
                h + "attn.c_attn.bias": ("bqkv", i, "qkv", (3 * d,)),
                h + "attn.c_proj.weight": ("wo", i, None, (d, d)), h + "attn.c_proj.bias": ("bo", i, None, (d,)),
                h + "ln_2.weight": ("norm2_w", i, None, (d,)), h + "ln_2.bias": ("norm2_b", i, None, (d,)),
                h + "mlp.c_fc.weight": ("w_up", i, None, (d, F)), h + "mlp.c_fc.bias": ("b_up", i, None, (F,)),
                h + "mlp.c_proj.weight": ("w_down", i, None, (F, d)), h + "mlp.c_proj.bias": ("b_down", i, None, (d,)),
            }
        return table
    table["model.embed_tokens.weight"] = ("embed", None, None, (cfg.V, d))
    table["model.norm.weight"] = ("norm_w", None, None, (d,))
    if not cfg.tied:
        table["lm_head.weight"] = ("head", None, "T", (cfg.V, d))
    for i in range(cfg.L):
        h = f"model.layers.{i}."
        table |= {
            h + "input_layernorm.weight": ("norm1_w", i, None, (d,)),
            h + "post_attention_layernorm.weight": ("norm2_w", i, None, (d,)),
            h + "self_attn.q_proj.weight": ("wq", i, "T", (q, d)),
            h + "self_attn.k_proj.weight": ("wk", i, "T", (kv, d)),
            h + "self_attn.v_proj.weight": ("wv", i, "T", (kv, d)),
            h + "self_attn.o_proj.weight": ("wo", i, "T", (d, q)),
            h + "mlp.gate_proj.weight": ("w_gate", i, "T", (F, d)),
            h + "mlp.up_proj.weight": ("w_up", i, "T", (F, d)),
            h + "mlp.down_proj.weight": ("w_down", i, "T", (d, F)),
        }
        if cfg.qkv_bias:
            table |= {h + "self_attn.q_proj.bias": ("bq", i, None, (q,)),
                      h + "self_attn.k_proj.bias": ("bk", i, None, (kv,)),
                      h + "self_attn.v_proj.bias": ("bv", i, None, (kv,))}
        if cfg.o_bias:
            table[h + "self_attn.o_proj.bias"] = ("bo", i, None, (d,))
        if cfg.mlp_bias:
            table |= {h + "mlp.gate_proj.bias": ("b_gate", i, None, (F,)),
                      h + "mlp.up_proj.bias": ("b_up", i, None, (F,)),
                      h + "mlp.down_proj.bias": ("b_down", i, None, (d,))}
    return table


def shard_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it, for ``model.safetensors`` or a sharded index."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, OSError) as e:
            raise WeightsError(f"{index}: not a safetensors index with a weight_map ({e})") from None
        files = {}
        for name, file in weight_map.items():
            path = folder / file
            if not path.is_file():
                raise WeightsError(f"{index} names the shard {file}, which the folder does not have")
            files[name] = path
        return files
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="numpy") as f:
                return {name: single for name in f.keys()}
        except Exception as e:  # safetensors raises several types for a corrupt header
            raise WeightsError(f"{single}: corrupt or truncated safetensors file ({e})") from None
    raise WeightsError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                       "(only safetensors weights are read; convert .bin files first)")


def _canonical(name: str, cfg: HFConfig) -> str:
    if cfg.model_type == "gpt2" and name.startswith("transformer."):
        return name[len("transformer."):]
    return name


def read_params(folder: Path, cfg: HFConfig, dtype) -> dict:
    """The parameter tree of ``folder``'s weights as ``dtype`` device arrays (float32 storage,
    bfloat16 or float16 are read alike)."""
    import jax.numpy as jnp
    from safetensors import safe_open

    files = shard_files(folder)
    table = tensor_table(cfg)
    found: dict[str, tuple[str, Path]] = {}
    for name, path in files.items():
        canon = _canonical(name, cfg)
        if canon in table:
            found[canon] = (name, path)
        elif IGNORED.search(canon) or canon == "lm_head.weight" and cfg.tied:
            continue
        else:
            raise WeightsError(f"{folder}: unexpected tensor {name!r} for a {cfg.model_type} of this config "
                               f"(is config.json from another model?)")
    missing = [n for n in table if n not in found]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightsError(f"{folder}: the weights lack {', '.join(missing[:3])}{more}")

    flat: dict[str, object] = {}
    layers: dict[str, list] = {}
    by_file: dict[Path, list[str]] = {}
    for canon, (name, path) in found.items():
        by_file.setdefault(path, []).append(canon)
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="numpy") as f:
                for canon in names:
                    param, layer, how, shape = table[canon]
                    sl = f.get_slice(found[canon][0])
                    if sl.get_dtype() not in FLOAT_DTYPES:
                        raise WeightsError(f"{path}: tensor {found[canon][0]!r} is stored as {sl.get_dtype()}; "
                                           f"expected one of {', '.join(FLOAT_DTYPES)}")
                    if tuple(sl.get_shape()) != shape:
                        raise WeightsError(f"{path}: tensor {found[canon][0]!r} has shape {tuple(sl.get_shape())}, "
                                           f"the config implies {shape}")
                    a = np.asarray(f.get_tensor(found[canon][0]), np.float32)
                    if how == "T":
                        a = a.T
                    parts = np.split(a, 3, axis=-1) if how == "qkv" else [a]
                    names_out = [param[0] + s + param[4:] for s in ("q", "k", "v")] if how == "qkv" else [param]
                    for pname, part in zip(names_out, parts):
                        if layer is None:
                            flat[pname] = jnp.asarray(part, dtype)
                        else:
                            layers.setdefault(pname, [None] * cfg.L)[layer] = part
        except WeightsError:
            raise
        except Exception as e:
            raise WeightsError(f"{path}: corrupt or truncated safetensors file ({e})") from None
    flat["layers"] = tuple({k: jnp.asarray(v[i], dtype) for k, v in layers.items()} for i in range(cfg.L))
    return flat
