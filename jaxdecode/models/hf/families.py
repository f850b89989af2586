"""The rotary decoder families of ``config.json`` as flags of one :class:`~.config.HFConfig`.

Each family differs from Llama by a few fields (transformers' defaults apply where a field is
absent, as transformers' own config classes apply them):

- Mistral, Phi-3, Mixtral: one sliding window on every layer (``sliding_window``);
- Qwen2, Qwen3: q/k/v biases (Qwen2) or q/k norms per head (Qwen3); with ``use_sliding_window``, a
  window on the layers ``layer_types`` names (by default those from ``max_window_layers`` on);
- Gemma: RMSNorm times ``1 + w``, embeddings times ``sqrt(d)``, a GeLU-tanh MLP, ``head_dim``
  apart from ``d / heads``, tied output; Gemma 2 adds norms after attention and after the MLP,
  soft-capped scores and logits, ``query_pre_attn_scalar``, and sliding layers alternating with
  global ones; Gemma 3 adds q/k norms, a local rope base on sliding layers
  (``rope_local_base_freq``) and the ``sliding_window_pattern``; its image-text ``gemma3`` folders
  decode with the language model's weights (``text_config``);
- Phi-3: fused ``qkv_proj`` and ``gate_up_proj`` (split on loading), partial rotary dimensions;
- OLMo 2: norms after attention and after the MLP only, q/k norms over the whole projection;
- Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: a router choosing ``num_experts_per_tok`` experts,
  renormalized (Mixtral, or ``norm_topk_prob``) or not; Qwen2-MoE's sigmoid-gated shared expert;
  dense layers where ``mlp_only_layers``/``decoder_sparse_step`` say; OLMoE's ``clip_qkv``.
"""

from __future__ import annotations

import math
from pathlib import Path

from jaxdecode.io.files import read_json
from jaxdecode.models.hf.config import (
    ACTIVATIONS,
    DEFAULT_THETA,
    GEMMAS,
    MOES,
    SUPPORTED,
    ConfigError,
    HFConfig,
    _float,
    _gpt2,
    _int,
    _rope,
    no_model_type,
)

# Gemma 3's image-text folders store only what differs from these in text_config
GEMMA3_TEXT = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
               "max_position_embeddings": 131072, "query_pre_attn_scalar": 256, "sliding_window": 4096}
EPS_1E5 = ("phi3", "olmo2", "mixtral", "olmoe")
QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "gemma3": "head", "olmo2": "all",
           "olmoe": "all"}
LAYOUT = {"gemma2": "sandwich", "gemma3_text": "sandwich", "gemma3": "sandwich", "olmo2": "post"}


def _text_config(raw: dict, where: str) -> dict:
    """A ``gemma3`` image-text config's language model, with transformers' defaults."""
    text = raw.get("text_config") or {}
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: text_config must be an object, got {text!r}")
    cfg = dict(GEMMA3_TEXT) | text
    cfg["model_type"] = "gemma3"
    for key in ("tie_word_embeddings", "eos_token_id"):
        if key not in text and key in raw:
            cfg[key] = raw[key]
    return cfg


def _opt_float(cfg: dict, name: str, where: str, default=None) -> float | None:
    value = cfg.get(name, default)
    return None if value is None else _float({name: value}, name, where, 1.0)


def _layer_types(cfg: dict, L: int, where: str, default: list[str]) -> list[str]:
    types = cfg.get("layer_types") or default
    if (not isinstance(types, list) or len(types) != L
            or any(t not in ("sliding_attention", "full_attention") for t in types)):
        raise ConfigError(f"{where}: layer_types must list 'sliding_attention' or 'full_attention' for each "
                          f"of the {L} layers, got {types!r}")
    return types


def _windows(cfg: dict, mt: str, L: int, where: str) -> tuple[int | None, tuple]:
    """``(sliding_window, windows)``: one window for every layer, or one per layer."""
    if mt in ("mistral", "phi3", "mixtral"):
        return (None if cfg.get("sliding_window") is None else _int(cfg, "sliding_window", where)), ()
    if mt in ("qwen2_moe", "qwen3_moe") and cfg.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true is not supported for {mt}")
    if mt in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
            return None, ()
        first = cfg.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int):
            raise ConfigError(f"{where}: max_window_layers must be an integer, got {first!r}")
        default = ["sliding_attention" if i >= first else "full_attention" for i in range(L)]
    elif mt == "gemma2":
        default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    elif mt in ("gemma3_text", "gemma3"):
        every = cfg.get("sliding_window_pattern", 6)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"{where}: sliding_window_pattern must be a positive integer, got {every!r}")
        default = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(L)]
    else:
        return None, ()
    types = _layer_types(cfg, L, where, default)
    window = _int(cfg, "sliding_window", where, 4096)
    return None, tuple(window if t == "sliding_attention" else None for t in types)


def _local_theta(cfg: dict, where: str) -> float:
    """Gemma 3's rope base on sliding layers."""
    params = cfg.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict):
        kind = local.get("rope_type", "default")
        if kind != "default":
            raise ConfigError(f"{where}: rope_parameters.sliding_attention: rope scaling of type {kind!r} "
                              "is not supported on sliding layers (supported: default)")
        return _float(local, "rope_theta", where, cfg.get("rope_local_base_freq", 10000.0))
    return _float(cfg, "rope_local_base_freq", where, 10000.0)


def _rotary_dim(cfg: dict, mt: str, head_dim: int, where: str) -> int | None:
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor == 1.0:
        return None
    if mt != "phi3":
        raise ConfigError(f"{where}: partial_rotary_factor={factor!r} is not supported for {mt}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"{where}: partial_rotary_factor must be in (0, 1], got {factor!r}")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ConfigError(f"{where}: partial_rotary_factor={factor} gives {dim} rotary dimensions, not an "
                          "even positive number")
    return dim


def _moe(cfg: dict, mt: str, L: int, where: str) -> dict:
    """The mixture-of-experts fields (none for a dense family)."""
    if mt not in MOES:
        return {}
    experts = _int(cfg, "num_local_experts" if "num_local_experts" in cfg else "num_experts", where,
                   {"mixtral": 8, "qwen2_moe": 60, "qwen3_moe": 128, "olmoe": 64}[mt])
    top_k = _int(cfg, "num_experts_per_tok", where, {"mixtral": 2, "qwen2_moe": 4}.get(mt, 8))
    if top_k > experts:
        raise ConfigError(f"{where}: num_experts_per_tok={top_k} exceeds the {experts} experts")
    if mt in ("mixtral", "olmoe"):
        moe_ffn, layers = _int(cfg, "intermediate_size", where), (True,) * L
    else:
        moe_ffn = _int(cfg, "moe_intermediate_size", where)
        step = _int(cfg, "decoder_sparse_step", where, 1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
            raise ConfigError(f"{where}: mlp_only_layers must be a list of layer numbers, got {only!r}")
        layers = tuple(i not in only and (i + 1) % step == 0 for i in range(L))
    shared = _int(cfg, "shared_expert_intermediate_size", where) if mt == "qwen2_moe" else 0
    norm = True if mt == "mixtral" else bool(cfg.get("norm_topk_prob", False))
    return dict(experts=experts, top_k=top_k, norm_topk=norm, moe_ffn=moe_ffn, shared_ffn=shared,
                moe_layers=layers)


def decoder_config(raw: dict, where: str) -> HFConfig:
    """The :class:`HFConfig` of a rotary decoder folder (every family but GPT-2)."""
    mt = raw["model_type"]
    cfg = _text_config(raw, where) if mt == "gemma3" else raw
    gemma = mt in GEMMAS
    if gemma and cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention=true is not supported "
                          "(a causal decoder only)")
    d = _int(cfg, "hidden_size", where)
    L = _int(cfg, "num_hidden_layers", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv = _int(cfg, "num_key_value_heads", where, heads)
    if heads % kv:
        raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv}")
    head_dim = cfg.get("head_dim") or d // heads
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ConfigError(f"{where}: head_dim must be an even positive integer, got {head_dim!r}")
    act_key = "hidden_activation" if mt in GEMMAS[1:] else "hidden_act"
    act = cfg.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"{where}: activation {act!r} is not supported "
                          f"(supported: {', '.join(ACTIVATIONS)})")
    theta, scaling = _rope(cfg, where, DEFAULT_THETA.get(mt, 10000.0))
    window, windows = _windows(cfg, mt, L, where)
    attention_bias = bool(cfg.get("attention_bias", False))
    qkv_bias = {"qwen2": True, "qwen2_moe": bool(cfg.get("qkv_bias", True)), "phi3": False,
                "mixtral": False}.get(mt, attention_bias)
    softcaps = (50.0, 30.0) if mt == "gemma2" else (None, None)
    clip = _opt_float(cfg, "clip_qkv", where) if mt == "olmoe" else None
    return HFConfig(
        model_type=mt, V=_int(cfg, "vocab_size", where), T=_int(cfg, "max_position_embeddings", where, 2048),
        d=d, L=L, heads=heads, kv_heads=kv, head_dim=head_dim,
        ffn=_int(cfg, "intermediate_size", where),
        eps=_float(cfg, "rms_norm_eps", where, 1e-5 if mt in EPS_1E5 else 1e-6), norm="rms",
        positions="rope", mlp="gated", act=act, qkv_bias=qkv_bias,
        o_bias=attention_bias and mt not in ("qwen2", "qwen2_moe", "phi3", "mixtral"),
        mlp_bias=mt == "llama" and bool(cfg.get("mlp_bias", False)),
        tied=bool(cfg.get("tie_word_embeddings", gemma)), rope_theta=theta, rope_scaling=scaling,
        sliding_window=window, windows=windows, norm_offset=gemma, embed_scale=gemma,
        layout=LAYOUT.get(mt, "pre"), qk_norm=QK_NORM.get(mt, ""),
        attn_scalar=_opt_float(cfg, "query_pre_attn_scalar", where, 256) if mt in GEMMAS[1:] else None,
        attn_softcap=_opt_float(cfg, "attn_logit_softcapping", where, softcaps[0]) if gemma else None,
        final_softcap=_opt_float(cfg, "final_logit_softcapping", where, softcaps[1]) if gemma else None,
        local_rope_theta=_local_theta(cfg, where) if mt in ("gemma3_text", "gemma3") else None,
        rotary_dim=_rotary_dim(cfg, mt, head_dim, where), clip_qkv=clip, multimodal=mt == "gemma3",
        **_moe(cfg, mt, L, where))


def read_config(folder: Path) -> tuple[HFConfig, dict]:
    """The decoder shape of a Hugging Face folder and the raw ``config.json``."""
    path = Path(folder) / "config.json"
    raw = read_json(path, ConfigError)
    mt = raw.get("model_type")
    if mt is None:
        raise ConfigError(no_model_type(path))
    if mt not in SUPPORTED:
        raise ConfigError(f"{path}: model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED)})")
    where = str(path)
    try:
        cfg = _gpt2(raw, where) if mt == "gpt2" else decoder_config(raw, where)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type
        raise ConfigError(f"{where}: a field has a value of the wrong type ({e})") from None
    if not math.isfinite(cfg.eps) or cfg.eps <= 0:
        raise ConfigError(f"{where}: the norm epsilon must be a positive number, got {cfg.eps!r}")
    return cfg, raw
