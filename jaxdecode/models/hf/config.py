"""A Hugging Face ``config.json`` read into one frozen, hashable shape.

Llama, Mistral, Qwen2 and GPT-2 are one decoder here whose variants are fields: the norm
(RMSNorm or LayerNorm), the positions (rotary or learned), the MLP (SwiGLU or a GELU MLP), which
projections carry biases, a sliding attention window, tied or untied output. Anything the
decoder does not implement is refused in one line by :func:`read_config` rather than decoded
into silent garbage.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

SUPPORTED = ("llama", "mistral", "qwen2", "gpt2")
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu")


class ConfigError(ValueError):
    """A config.json this package cannot decode (unsupported, or inconsistent)."""


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """The shape and variant of a decoder-only transformer (every field static under jit)."""

    model_type: str
    V: int  # vocabulary (embedding rows; may exceed the tokenizer's, as padded checkpoints do)
    T: int  # positions: max_position_embeddings (past it the loops re-read the last T tokens)
    d: int
    L: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    norm: str  # "rms" or "layer"
    positions: str  # "rope" or "learned"
    mlp: str  # "gated" (down(act(gate x) * up x)) or "plain" (proj(act(fc x)))
    act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tied: bool
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()  # sorted (key, value) pairs of the rope_scaling dict, () for none
    sliding_window: int | None = None

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @property
    def scaling(self) -> dict:
        return dict(self.rope_scaling)

    def num_params(self) -> int:
        att = self.d * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.mlp == "gated" else 2) * self.d * self.ffn
        emb = self.V * self.d * (1 if self.tied else 2)
        emb += self.T * self.d if self.positions == "learned" else 0
        return self.L * (att + mlp) + emb


def _int(cfg: dict, name: str, where: str, default=None) -> int:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31:
        raise ConfigError(f"{where}: {name} must be a positive integer below 2**31 (ids and positions are "
                          f"int32), got {value!r}")
    return value


def _float(cfg: dict, name: str, where: str, default: float) -> float:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{where}: {name} must be a positive number, got {value!r}")
    return float(value)


def _rope(cfg: dict, where: str) -> tuple[float, tuple]:
    """``(theta, scaling)`` from the legacy ``rope_theta``/``rope_scaling`` fields or the newer
    ``rope_parameters`` dict."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ConfigError(f"{where}: rope_scaling must be an object or null, got {scaling!r}")
        scaling = dict(scaling)
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise ConfigError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    if kind == "default":
        return float(theta), ()
    if kind == "linear":
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or not factor > 0:
            raise ConfigError(f"{where}: linear rope scaling needs a positive factor, got {factor!r}")
        return float(theta), (("factor", float(factor)), ("rope_type", "linear"))
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if not isinstance(scaling.get(k), (int, float))]
        if missing:
            raise ConfigError(f"{where}: llama3 rope scaling needs numbers for {', '.join(missing)}")
        if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
            raise ConfigError(f"{where}: llama3 rope scaling needs high_freq_factor > low_freq_factor")
        return float(theta), tuple(sorted((k, float(scaling[k])) for k in keys)) + (("rope_type", "llama3"),)
    raise ConfigError(f"{where}: rope scaling of type {kind!r} is not supported "
                      "(supported: default, linear, llama3)")


def _llama_family(cfg: dict, where: str) -> HFConfig:
    mt = cfg["model_type"]
    d = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv = _int(cfg, "num_key_value_heads", where, heads)
    if heads % kv:
        raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv}")
    head_dim = cfg.get("head_dim") or d // heads
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ConfigError(f"{where}: head_dim must be an even positive integer, got {head_dim!r}")
    act = cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"{where}: activation {act!r} is not supported "
                          f"(supported: {', '.join(ACTIVATIONS)})")
    theta, scaling = _rope(cfg, where)
    window = None
    if mt == "mistral":
        window = cfg.get("sliding_window")
    elif mt == "qwen2" and cfg.get("use_sliding_window"):
        raise ConfigError(f"{where}: Qwen2 with use_sliding_window=true (a window on some layers only) "
                          "is not supported")
    if window is not None:
        window = _int(cfg, "sliding_window", where)
    attention_bias = bool(cfg.get("attention_bias", False))
    return HFConfig(
        model_type=mt, V=_int(cfg, "vocab_size", where), T=_int(cfg, "max_position_embeddings", where, 2048),
        d=d, L=_int(cfg, "num_hidden_layers", where), heads=heads, kv_heads=kv, head_dim=head_dim,
        ffn=_int(cfg, "intermediate_size", where), eps=_float(cfg, "rms_norm_eps", where, 1e-6), norm="rms",
        positions="rope", mlp="gated", act=act, qkv_bias=attention_bias or mt == "qwen2",
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)), tied=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=theta, rope_scaling=scaling, sliding_window=window)


def _gpt2(cfg: dict, where: str) -> HFConfig:
    d = _int(cfg, "n_embd", where)
    heads = _int(cfg, "n_head", where)
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
        model_type="gpt2", V=_int(cfg, "vocab_size", where), T=_int(cfg, "n_positions", where, 1024), d=d,
        L=_int(cfg, "n_layer", where), heads=heads, kv_heads=heads, head_dim=d // heads,
        ffn=_int({"n_inner": cfg.get("n_inner") or 4 * d}, "n_inner", where),
        eps=_float(cfg, "layer_norm_epsilon", where, 1e-5), norm="layer",
        positions="learned", mlp="plain", act=act, qkv_bias=True, o_bias=True, mlp_bias=True, tied=True)


def no_model_type(path) -> str:
    """The error for a ``config.json`` that is neither a Hugging Face nor a character model's."""
    return (f"{path} has no model_type (supported: {', '.join(SUPPORTED)}; a jaxdecode character "
            "model's config.json has V, T, d, L, heads and chars instead)")


def read_config(folder: Path) -> tuple[HFConfig, dict]:
    """The decoder shape of a Hugging Face folder and the raw ``config.json``."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    mt = raw.get("model_type")
    if mt is None:
        raise ConfigError(no_model_type(path))
    if mt not in SUPPORTED:
        raise ConfigError(f"{path}: model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED)})")
    where = str(path)
    try:
        cfg = _gpt2(raw, where) if mt == "gpt2" else _llama_family(raw, where)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type
        raise ConfigError(f"{where}: a field has a value of the wrong type ({e})") from None
    if not math.isfinite(cfg.eps) or cfg.eps <= 0:
        raise ConfigError(f"{where}: the norm epsilon must be a positive number, got {cfg.eps!r}")
    return cfg, raw


def end_tokens(folder: Path, raw: dict, V: int | None = None, known: int | None = None) -> tuple[int, ...]:
    """The end-of-sequence ids: ``eos_token_id`` (an int or a list) of ``generation_config.json``
    when it has one, else of ``config.json``; () when neither does. Each id must lie in the
    model's vocabulary of ``V`` ids and, when ``known`` is given, among the tokenizer's ``known``
    tokens; a bad one is refused naming the file it came from."""
    gen = Path(folder) / "generation_config.json"
    ids, source = None, Path(folder) / "config.json"
    if gen.is_file():
        try:
            g = json.loads(gen.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
            raise ConfigError(f"{gen}: not valid JSON ({e})") from None
        if isinstance(g, dict) and g.get("eos_token_id") is not None:
            ids, source = g["eos_token_id"], gen
    if ids is None:
        ids = raw.get("eos_token_id")
    if ids is None:
        return ()
    ids = [ids] if isinstance(ids, int) else ids
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{source}: eos_token_id must be an integer or a list of integers, got {ids!r}")
    for i in ids:
        if V is not None and not 0 <= i < V:
            raise ConfigError(f"{source}: eos_token_id {i} lies outside the vocabulary: the model has "
                              f"{V} token ids (vocab_size in config.json), 0 to {V - 1}")
        if known is not None and i >= known:
            raise ConfigError(f"{source}: eos_token_id {i} is not a token of tokenizer.json, which has "
                              f"{known} tokens (ids 0 to {known - 1})")
    return tuple(dict.fromkeys(ids))
