"""Every Hugging Face family as data: one :class:`FamilySpec` entry per ``model_type``.

An entry says what sets a family apart from the decoder's defaults: transformers' defaults for
``config.json`` fields a folder leaves out, which fields it reads (biases, windows, multipliers),
its norms and where they sit, which layers rotate, its safetensors names (:class:`Tensors`: fused
tensors and how they split), its mixture of experts (:class:`MoESpec`), and whether the fused
native layer runs its layers. :func:`read_config` turns an entry and a ``config.json`` into one
:class:`~.config.HFConfig`; :mod:`.weights` reads the entry's names; the decoder reads the
config. Nothing else in the package tests a ``model_type``.

As in transformers' modular files, a family is written as its differences from another:
``MISTRAL = replace(LLAMA, model_type="mistral", windows="all")``. Adding a family is adding an
entry here and its fixture (docs/huggingface.md, "Adding a family").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from jaxdecode.io.files import read_json
from jaxdecode.models.hf.config import (
    ACTIVATIONS,
    ConfigError,
    HFConfig,
    config_float,
    config_int,
    rope_settings,
)


@dataclasses.dataclass(frozen=True)
class Tensors:
    """A family's safetensors names. Layer names are relative to ``layer`` (``{i}`` the layer);
    weights are ``<name>.weight`` and biases ``<name>.bias``. ``linear``: matrices stored as
    ``nn.Linear`` keeps them (``[out, in]``, transposed on reading), else as GPT-2's ``Conv1D``
    (``[in, out]``). A fused ``qkv`` is split into q, k and v (``heads * hd``, then
    ``kv_heads * hd`` twice), a fused ``gate_up`` into gate then up."""

    embed: str = "model.embed_tokens"
    positions: str | None = None  # learned positions
    norm: str = "model.norm"
    head: str = "lm_head"  # absent from a folder when the output is tied
    layer: str = "model.layers.{i}."
    # (name, parameter) of each norm of a layer: "norm1" before attention, "norm2" before the MLP,
    # "norm_pa" after attention, "norm_pf" after the MLP
    norms: tuple = (("input_layernorm", "norm1_w"), ("post_attention_layernorm", "norm2_w"))
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    qkv: str | None = None  # q, k and v in one tensor instead
    o: str = "self_attn.o_proj"
    gate: str | None = "mlp.gate_proj"  # None: a plain MLP (up, then down)
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    gate_up: str | None = None  # gate and up in one tensor instead
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    linear: bool = True
    renames: tuple = ()  # (prefix, replacement) of names some folders store
    skipped: str | None = None  # a regular expression of tensors that are not the decoder's


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """A mixture of experts: transformers' default counts, the config field of the experts'
    width, how the mixture's layers are chosen, and the experts' names."""

    experts: int  # num_experts (or num_local_experts) when absent
    top_k: int  # num_experts_per_tok when absent
    ffn_field: str = "moe_intermediate_size"
    sparse_step: bool = True  # decoder_sparse_step and mlp_only_layers choose the layers (else all)
    shared: bool = False  # a sigmoid-gated shared expert (shared_expert_intermediate_size)
    norm_topk: bool | None = None  # renormalize the chosen weights; None: config's norm_topk_prob
    prefix: str = "mlp."  # under the layer
    names: tuple = ("gate_proj", "up_proj", "down_proj")  # of each expert


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """One family. The defaults are Llama's."""

    model_type: str
    # config.json: transformers' defaults where a field is absent
    eps: float = 1e-6
    rope_theta: float = 10000.0
    tied: bool = False
    act: str = "silu"
    act_field: str = "hidden_act"
    layers_field: str = "num_hidden_layers"
    refused: tuple = ()  # fields this package does not implement: refused when true
    text_defaults: tuple | None = None  # image-text folder: the decoder's config is text_config,
    #                                     with these (field, default) pairs
    # norms: "rms" or "layer"; RMSNorm times (1 + w); embeddings times sqrt(d); where the norms sit
    # ("pre", "sandwich": before and after each block, "post": after only); q/k norms per "head"
    # or over "all" the projection
    norm: str = "rms"
    norm_offset: bool = False
    embed_scale: bool = False
    layout: str = "pre"
    qk_norm: str = ""
    # biases: the field that turns them on (None: never), and its default
    qkv_bias: str | None = "attention_bias"
    qkv_bias_default: bool = False
    o_bias: str | None = "attention_bias"
    mlp_bias: str | None = None
    # rotation: "rope" or "learned" positions; partial_rotary_factor honoured; layers without it
    # (no_rope_layers / no_rope_layer_interval); a rope base of its own on sliding layers
    positions: str = "rope"
    partial_rotary: bool = False
    nope_layers: bool = False
    local_rope: bool = False
    # sliding windows: "" none; "all": sliding_window on every layer; "from": with
    # use_sliding_window, from layer max_window_layers on; "nope": with use_sliding_window, on the
    # layers without rotation; "every": all but every window_every-th layer (or the field's value)
    windows: str = ""
    window_every: int = 0
    window_every_field: str | None = None
    # attention and logits: query_pre_attn_scalar's default (read where not None); the soft-caps'
    # defaults (read where not None); clip_qkv read; embedding, residual and attention multipliers
    # and logits_scaling read
    attn_scalar: float | None = None
    softcaps: tuple | None = None
    clip_qkv: bool = False
    multipliers: bool = False
    mlp: str = "gated"
    moe: MoESpec | None = None
    tensors: Tensors = Tensors()
    native_layer: bool = True  # its layers may run as one native call (HFDecoder._fusable)
    reader: Callable | None = None  # a config of other field names read by a function of its own

    @property
    def multimodal(self) -> bool:
        return self.text_defaults is not None


def _gpt2(cfg: dict, where: str) -> HFConfig:
    d = config_int(cfg, "n_embd", where)
    heads = config_int(cfg, "n_head", where)
    if d % heads:
        raise ConfigError(f"{where}: n_embd={d} is not a multiple of n_head={heads}")
    act = cfg.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ConfigError(f"{where}: activation {act!r} is not supported "
                          f"(supported: {', '.join(ACTIVATIONS)})")
    if cfg.get("scale_attn_by_inverse_layer_idx"):
        raise ConfigError(f"{where}: scale_attn_by_inverse_layer_idx=true is not supported")
    if cfg.get("scale_attn_weights") is False:
        raise ConfigError(f"{where}: scale_attn_weights=false is not supported")
    if cfg.get("tie_word_embeddings") is False:
        raise ConfigError(f"{where}: a GPT-2 with an untied output layer is not supported")
    return HFConfig(
        model_type="gpt2", V=config_int(cfg, "vocab_size", where), T=config_int(cfg, "n_positions", where, 1024), d=d,
        L=config_int(cfg, "n_layer", where), heads=heads, kv_heads=heads, head_dim=d // heads,
        ffn=config_int({"n_inner": cfg.get("n_inner") or 4 * d}, "n_inner", where),
        eps=config_float(cfg, "layer_norm_epsilon", where, 1e-5), norm="layer",
        positions="learned", mlp="plain", act=act, qkv_bias=True, o_bias=True, mlp_bias=True, tied=True,
        native_layer=False)


# ----------------------------------------------------------------------------- the table

LLAMA = FamilySpec("llama", eps=1e-6, mlp_bias="mlp_bias")
MISTRAL = replace(LLAMA, model_type="mistral", mlp_bias=None, windows="all")
QWEN2 = replace(LLAMA, model_type="qwen2", mlp_bias=None, qkv_bias=None, qkv_bias_default=True, o_bias=None,
                windows="from")
QWEN3 = replace(QWEN2, model_type="qwen3", qkv_bias="attention_bias", qkv_bias_default=False,
                o_bias="attention_bias", qk_norm="head")
PHI3 = replace(LLAMA, model_type="phi3", eps=1e-5, mlp_bias=None, qkv_bias=None, o_bias=None, windows="all",
               partial_rotary=True,
               tensors=Tensors(qkv="self_attn.qkv_proj", gate_up="mlp.gate_up_proj"))
OLMO2 = replace(LLAMA, model_type="olmo2", eps=1e-5, mlp_bias=None, layout="post", qk_norm="all",
                tensors=Tensors(norms=(("post_attention_layernorm", "norm_pa"),
                                       ("post_feedforward_layernorm", "norm_pf"))))
GEMMA = replace(LLAMA, model_type="gemma", mlp_bias=None, tied=True, act="gelu_pytorch_tanh", norm_offset=True,
                embed_scale=True, softcaps=(None, None), refused=("use_bidirectional_attention",),
                native_layer=False)
SANDWICH = Tensors(norms=(("input_layernorm", "norm1_w"), ("post_attention_layernorm", "norm_pa"),
                          ("pre_feedforward_layernorm", "norm2_w"), ("post_feedforward_layernorm", "norm_pf")))
GEMMA2 = replace(GEMMA, model_type="gemma2", act_field="hidden_activation", layout="sandwich", attn_scalar=256,
                 softcaps=(50.0, 30.0), windows="every", window_every=2, tensors=SANDWICH)
GEMMA3_TEXT = replace(GEMMA2, model_type="gemma3_text", rope_theta=1e6, softcaps=(None, None), qk_norm="head",
                      local_rope=True, window_every=6, window_every_field="sliding_window_pattern")
# Gemma 3's image-text folders store only what differs from these in text_config
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                        "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                        "query_pre_attn_scalar": 256, "sliding_window": 4096}
GEMMA3 = replace(GEMMA3_TEXT, model_type="gemma3", text_defaults=tuple(GEMMA3_TEXT_DEFAULTS.items()),
                 tensors=replace(SANDWICH, skipped=r"^(model\.)?(vision_tower|multi_modal_projector)\.",
                                 renames=(("language_model.model.", "model."),
                                          ("model.language_model.", "model."),
                                          ("language_model.lm_head.", "lm_head."))))
MIXTRAL = replace(MISTRAL, model_type="mixtral", eps=1e-5, rope_theta=1e6, qkv_bias=None, o_bias=None,
                  moe=MoESpec(8, 2, ffn_field="intermediate_size", sparse_step=False, norm_topk=True,
                              prefix="block_sparse_moe.", names=("w1", "w3", "w2")))
QWEN2_MOE = replace(QWEN2, model_type="qwen2_moe", qkv_bias="qkv_bias", windows="", refused=("use_sliding_window",),
                    moe=MoESpec(60, 4, shared=True))
QWEN3_MOE = replace(QWEN3, model_type="qwen3_moe", windows="", refused=("use_sliding_window",),
                    moe=MoESpec(128, 8))
OLMOE = replace(LLAMA, model_type="olmoe", eps=1e-5, mlp_bias=None, qk_norm="all", clip_qkv=True,
                moe=MoESpec(64, 8, ffn_field="intermediate_size", sparse_step=False))
# SmolLM3: Llama with a layer without rotation every fourth (no_rope_layers), tied output
SMOLLM3 = replace(LLAMA, model_type="smollm3", rope_theta=2e6, tied=True, nope_layers=True, windows="nope")
# Granite: Llama with embeddings, residual branches and scores times multipliers, logits divided;
# the residual multiplier sits inside the layer, where the fused native layer does not scale
GRANITE = replace(LLAMA, model_type="granite", multipliers=True, native_layer=False)
GPT2 = FamilySpec(
    "gpt2", eps=1e-5, tied=True, act="gelu_new", layers_field="n_layer", norm="layer", positions="learned",
    mlp="plain", native_layer=False, reader=_gpt2,
    tensors=Tensors(embed="wte", positions="wpe", norm="ln_f", head=None, layer="h.{i}.",
                    norms=(("ln_1", "norm1_w"), ("ln_2", "norm2_w")), qkv="attn.c_attn", o="attn.c_proj", gate=None,
                    up="mlp.c_fc", down="mlp.c_proj", linear=False, renames=(("transformer.", ""),)))

FAMILIES: dict[str, FamilySpec] = {f.model_type: f for f in (
    LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GEMMA2, GEMMA3_TEXT, GEMMA3, PHI3, OLMO2, MIXTRAL, QWEN2_MOE, QWEN3_MOE,
    OLMOE, SMOLLM3, GRANITE, GPT2)}
SUPPORTED = tuple(FAMILIES)


def family(cfg: HFConfig) -> FamilySpec:
    """The entry of a config's family."""
    return FAMILIES[cfg.model_type]


# ----------------------------------------------------------------------------- reading config.json


def _text_config(raw: dict, spec: FamilySpec, where: str) -> dict:
    """An image-text config's language model, with transformers' defaults."""
    text = raw.get("text_config") or {}
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: text_config must be an object, got {text!r}")
    cfg = dict(spec.text_defaults) | text
    for key in ("tie_word_embeddings", "eos_token_id"):
        if key not in text and key in raw:
            cfg[key] = raw[key]
    return cfg


def _opt_float(cfg: dict, name: str, where: str, default=None) -> float | None:
    value = cfg.get(name, default)
    return None if value is None else config_float({name: value}, name, where, 1.0)


def _layer_types(cfg: dict, L: int, where: str, default: list[str]) -> list[str]:
    types = cfg.get("layer_types") or default
    if (not isinstance(types, list) or len(types) != L
            or any(t not in ("sliding_attention", "full_attention") for t in types)):
        raise ConfigError(f"{where}: layer_types must list 'sliding_attention' or 'full_attention' for each "
                          f"of the {L} layers, got {types!r}")
    return types


def _rotating(cfg: dict, spec: FamilySpec, L: int, where: str) -> tuple:
    """Per layer, whether it rotates (() when every layer does)."""
    if not spec.nope_layers:
        return ()
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = config_int(cfg, "no_rope_layer_interval", where, 4)
        flags = [int((i + 1) % every != 0) for i in range(L)]
    if not isinstance(flags, list) or len(flags) < L or any(f not in (0, 1) for f in flags):
        raise ConfigError(f"{where}: no_rope_layers must list 1 (rotary) or 0 (no rotation) for each of the "
                          f"{L} layers, got {flags!r}")
    rotate = tuple(bool(f) for f in flags[:L])
    return () if all(rotate) else rotate


def _windows(cfg: dict, spec: FamilySpec, L: int, rotate: tuple, where: str) -> tuple[int | None, tuple]:
    """``(sliding_window, windows)``: one window for every layer, or one per layer."""
    if spec.windows == "all":
        return (None if cfg.get("sliding_window") is None else config_int(cfg, "sliding_window", where)), ()
    if spec.windows in ("from", "nope"):
        if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
            return None, ()
        if spec.windows == "nope":
            default = ["full_attention" if not rotate or rotate[i] else "sliding_attention" for i in range(L)]
        else:
            first = cfg.get("max_window_layers", 28)
            if isinstance(first, bool) or not isinstance(first, int):
                raise ConfigError(f"{where}: max_window_layers must be an integer, got {first!r}")
            default = ["sliding_attention" if i >= first else "full_attention" for i in range(L)]
    elif spec.windows == "every":
        every = cfg.get(spec.window_every_field, spec.window_every) if spec.window_every_field else spec.window_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"{where}: {spec.window_every_field} must be a positive integer, got {every!r}")
        default = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(L)]
    else:
        return None, ()
    types = _layer_types(cfg, L, where, default)
    window = config_int(cfg, "sliding_window", where, 4096)
    return None, tuple(window if t == "sliding_attention" else None for t in types)


def _local_theta(cfg: dict, where: str) -> float:
    """The rope base on sliding layers (Gemma 3's)."""
    params = cfg.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict):
        kind = local.get("rope_type", "default")
        if kind != "default":
            raise ConfigError(f"{where}: rope_parameters.sliding_attention: rope scaling of type {kind!r} "
                              "is not supported on sliding layers (supported: default)")
        return config_float(local, "rope_theta", where, cfg.get("rope_local_base_freq", 10000.0))
    return config_float(cfg, "rope_local_base_freq", where, 10000.0)


def _rotary_dim(cfg: dict, spec: FamilySpec, head_dim: int, where: str) -> int | None:
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor == 1.0:
        return None
    if not spec.partial_rotary:
        raise ConfigError(f"{where}: partial_rotary_factor={factor!r} is not supported for {spec.model_type}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"{where}: partial_rotary_factor must be in (0, 1], got {factor!r}")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ConfigError(f"{where}: partial_rotary_factor={factor} gives {dim} rotary dimensions, not an "
                          "even positive number")
    return dim


def _moe(cfg: dict, moe: MoESpec | None, L: int, where: str) -> dict:
    """The mixture-of-experts fields (none for a dense family)."""
    if moe is None:
        return {}
    experts = config_int(cfg, "num_local_experts" if "num_local_experts" in cfg else "num_experts", where, moe.experts)
    top_k = config_int(cfg, "num_experts_per_tok", where, moe.top_k)
    if top_k > experts:
        raise ConfigError(f"{where}: num_experts_per_tok={top_k} exceeds the {experts} experts")
    moe_ffn = config_int(cfg, moe.ffn_field, where)
    if moe.sparse_step:
        step = config_int(cfg, "decoder_sparse_step", where, 1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
            raise ConfigError(f"{where}: mlp_only_layers must be a list of layer numbers, got {only!r}")
        layers = tuple(i not in only and (i + 1) % step == 0 for i in range(L))
    else:
        layers = (True,) * L
    shared = config_int(cfg, "shared_expert_intermediate_size", where) if moe.shared else 0
    norm = moe.norm_topk if moe.norm_topk is not None else bool(cfg.get("norm_topk_prob", False))
    return {"experts": experts, "top_k": top_k, "norm_topk": norm, "moe_ffn": moe_ffn, "shared_ffn": shared,
            "moe_layers": layers}


def _flag(cfg: dict, field: str | None, default: bool = False) -> bool:
    return bool(cfg.get(field, default)) if field else default


def _multipliers(cfg: dict, spec: FamilySpec, where: str) -> dict:
    if not spec.multipliers:
        return {}
    embed, residual, attention, logits = (
        config_float(cfg, name, where, 1.0)
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"))
    return {"embed_multiplier": embed, "residual_multiplier": residual, "attn_multiplier": attention,
            "logits_scaling": logits}


def decoder_config(raw: dict, where: str) -> HFConfig:
    """The :class:`HFConfig` of a rotary decoder's ``config.json`` (every family but GPT-2), as
    its family's entry reads it."""
    spec = FAMILIES[raw["model_type"]]
    cfg = _text_config(raw, spec, where) if spec.multimodal else raw
    for field in spec.refused:
        if cfg.get(field):
            raise ConfigError(f"{where}: {field}=true is not supported for {spec.model_type}")
    d = config_int(cfg, "hidden_size", where)
    L = config_int(cfg, "num_hidden_layers", where)
    heads = config_int(cfg, "num_attention_heads", where)
    kv = config_int(cfg, "num_key_value_heads", where, heads)
    if heads % kv:
        raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv}")
    head_dim = cfg.get("head_dim") or d // heads
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ConfigError(f"{where}: head_dim must be an even positive integer, got {head_dim!r}")
    act = cfg.get(spec.act_field) or spec.act
    if act not in ACTIVATIONS:
        raise ConfigError(f"{where}: activation {act!r} is not supported "
                          f"(supported: {', '.join(ACTIVATIONS)})")
    theta, scaling = rope_settings(cfg, where, spec.rope_theta)
    rotate = _rotating(cfg, spec, L, where)
    window, windows = _windows(cfg, spec, L, rotate, where)
    caps = spec.softcaps
    return HFConfig(
        model_type=spec.model_type, V=config_int(cfg, "vocab_size", where),
        T=config_int(cfg, "max_position_embeddings", where, 2048), d=d, L=L, heads=heads, kv_heads=kv,
        head_dim=head_dim, ffn=config_int(cfg, "intermediate_size", where),
        eps=config_float(cfg, "rms_norm_eps", where, spec.eps), norm=spec.norm, positions=spec.positions,
        mlp=spec.mlp, act=act, qkv_bias=_flag(cfg, spec.qkv_bias, spec.qkv_bias_default),
        o_bias=_flag(cfg, spec.o_bias), mlp_bias=_flag(cfg, spec.mlp_bias),
        tied=bool(cfg.get("tie_word_embeddings", spec.tied)), rope_theta=theta, rope_scaling=scaling,
        sliding_window=window, windows=windows, norm_offset=spec.norm_offset, embed_scale=spec.embed_scale,
        layout=spec.layout, qk_norm=spec.qk_norm,
        attn_scalar=(None if spec.attn_scalar is None
                     else _opt_float(cfg, "query_pre_attn_scalar", where, spec.attn_scalar)),
        attn_softcap=None if caps is None else _opt_float(cfg, "attn_logit_softcapping", where, caps[0]),
        final_softcap=None if caps is None else _opt_float(cfg, "final_logit_softcapping", where, caps[1]),
        local_rope_theta=_local_theta(cfg, where) if spec.local_rope else None,
        rotary_dim=_rotary_dim(cfg, spec, head_dim, where), rotate=rotate,
        clip_qkv=_opt_float(cfg, "clip_qkv", where) if spec.clip_qkv else None, multimodal=spec.multimodal,
        native_layer=spec.native_layer, **_multipliers(cfg, spec, where), **_moe(cfg, spec.moe, L, where))


def no_model_type(path) -> str:
    """The error for a ``config.json`` that is neither a Hugging Face nor a character model's."""
    return (f"{path} has no model_type (supported: {', '.join(SUPPORTED)}; a jaxdecode character "
            "model's config.json has V, T, d, L, heads and chars instead)")


def read_config(folder: Path) -> tuple[HFConfig, dict]:
    """The decoder shape of a Hugging Face folder and the raw ``config.json``."""
    path = Path(folder) / "config.json"
    raw = read_json(path, ConfigError)
    mt = raw.get("model_type")
    if mt is None:
        raise ConfigError(no_model_type(path))
    spec = FAMILIES.get(mt) if isinstance(mt, str) else None
    if spec is None:
        raise ConfigError(f"{path}: model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED)})")
    where = str(path)
    try:
        cfg = (spec.reader or decoder_config)(raw, where)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type
        raise ConfigError(f"{where}: a field has a value of the wrong type ({e})") from None
    if not math.isfinite(cfg.eps) or cfg.eps <= 0:
        raise ConfigError(f"{where}: the norm epsilon must be a positive number, got {cfg.eps!r}")
    return cfg, raw


__all__ = ["FAMILIES", "SUPPORTED", "FamilySpec", "MoESpec", "Tensors", "decoder_config", "family",
           "no_model_type", "read_config"]
