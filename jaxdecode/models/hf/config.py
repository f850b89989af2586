"""A Hugging Face ``config.json`` read into one frozen, hashable shape.

Every family is one decoder here whose variants are fields: the norm (RMSNorm, with Gemma's
``1 + w`` offset, or LayerNorm) and where the norms sit (before, around or after each block), the
positions (rotary, partial or with a local base on sliding layers, or learned), q/k norms, the
MLP (gated, plain, or a mixture of experts with an optional shared expert), which projections
carry biases, soft-capping, a sliding attention window per layer, tied or untied output.
Anything the decoder does not implement is refused in one line by :func:`read_config` rather than
decoded into silent garbage. Which family sets which field is the table of :mod:`.families`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

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
    sliding_window: int | None = None  # every layer's window, unless ``windows`` says per layer
    windows: tuple = ()  # per layer: its window or None (full attention); () for sliding_window
    norm_offset: bool = False  # Gemma: RMSNorm times (1 + w)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(d)
    layout: str = "pre"  # "pre" (norm before each block), "sandwich" (before and after: Gemma 2/3),
    #                      "post" (after only: OLMo 2)
    qk_norm: str = ""  # "head" (per head: Qwen3, Gemma 3) or "all" (the whole projection: OLMo 2)
    attn_scalar: float | None = None  # scores scaled by attn_scalar ** -0.5 (default head_dim)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    local_rope_theta: float | None = None  # the rope base of sliding layers (Gemma 3)
    rotary_dim: int | None = None  # rotate only the first rotary_dim of each head (Phi-3's partial)
    rotate: tuple = ()  # per layer: whether it rotates (SmolLM3's layers without); () every layer
    embed_multiplier: float = 1.0  # Granite: embeddings times this
    residual_multiplier: float = 1.0  # Granite: each block's output times this before the residual sum
    attn_multiplier: float | None = None  # Granite: the scores' scale (for attn_scalar ** -0.5)
    logits_scaling: float = 1.0  # Granite: logits divided by this
    clip_qkv: float | None = None  # OLMoE: q, k, v clipped to [-c, c]
    experts: int = 0  # a mixture of experts: how many, top_k chosen per token, renormalized or not
    top_k: int = 0
    norm_topk: bool = False
    moe_ffn: int = 0
    shared_ffn: int = 0  # Qwen2-MoE's shared expert (sigmoid-gated), 0 for none
    moe_layers: tuple = ()  # per layer: whether its MLP is the mixture
    multimodal: bool = False  # Gemma 3's image-text folders: the text decoder's weights only
    native_layer: bool = True  # the family's layers may run as one native call (where they fit)

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @property
    def scaling(self) -> dict:
        return dict(self.rope_scaling)

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (a query at ``i`` sees keys ``i - W < j <= i``), or None."""
        return self.windows[layer] if self.windows else self.sliding_window

    def rotates(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates its queries and keys."""
        return self.positions == "rope" and (not self.rotate or self.rotate[layer])

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        if self.attn_multiplier is not None:
            return self.attn_multiplier
        return 1 / math.sqrt(self.attn_scalar or self.head_dim)

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def num_params(self) -> int:
        att = self.d * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        dense = (3 if self.mlp == "gated" else 2) * self.d * self.ffn
        moe = self.experts * (3 * self.d * self.moe_ffn + self.d) + 3 * self.d * self.shared_ffn
        emb = self.V * self.d * (1 if self.tied else 2)
        emb += self.T * self.d if self.positions == "learned" else 0
        return sum(att + (moe if self.is_moe(i) else dense) for i in range(self.L)) + emb


def config_int(cfg: dict, name: str, where: str, default=None) -> int:
    """``cfg[name]`` (or ``default``) as a positive int32, or a ConfigError naming ``where``."""
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31:
        raise ConfigError(f"{where}: {name} must be a positive integer below 2**31 (ids and positions are "
                          f"int32), got {value!r}")
    return value


def config_float(cfg: dict, name: str, where: str, default: float) -> float:
    """``cfg[name]`` (or ``default``) as a positive finite float, or a ConfigError naming ``where``."""
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{where}: {name} must be a positive number, got {value!r}")
    return float(value)


def rope_settings(cfg: dict, where: str, default_theta: float = 10000.0) -> tuple[float, tuple]:
    """``(theta, scaling)`` from the legacy ``rope_theta``/``rope_scaling`` fields or the newer
    ``rope_parameters`` dict."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]
        theta = params.get("rope_theta", cfg.get("rope_theta", default_theta))
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    else:
        theta = cfg.get("rope_theta", default_theta)
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
    raise ConfigError(f"{where}: rope_scaling: rope scaling of type {kind!r} is not supported "
                      "(supported: default, linear, llama3)")


GENERATION_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")


def generation_defaults(folder: Path) -> dict:
    """The decoding defaults of ``generation_config.json`` as settings of
    :func:`jaxdecode.rules.make_rule` plus ``greedy``: what transformers and vLLM apply when the
    user sets none. Only the fields the file holds count (vLLM's reading; transformers adds its
    own ``top_k=50`` when sampling without one): ``do_sample: false`` is greedy decoding (with its
    ``repetition_penalty``); otherwise ``temperature``, ``top_k``, ``top_p`` and
    ``repetition_penalty`` where they change anything (``temperature`` 0 is greedy). A bad value
    is refused in one line naming the file and the field."""
    from jaxdecode.rules import RuleError, make_rule

    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        g = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(g, dict):
        return {}
    out: dict = {}
    penalty = g.get("repetition_penalty")
    if penalty is not None and penalty != 1.0:
        out["repetition_penalty"] = penalty
    if g.get("do_sample") is False or g.get("temperature") == 0:
        out["greedy"] = True
    else:
        for name, neutral in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0)):
            if g.get(name) is not None and g[name] != neutral:
                out[name] = g[name]
    try:
        make_rule(**{k: v for k, v in out.items() if k != "greedy"})
    except (RuleError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None
    return out


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
