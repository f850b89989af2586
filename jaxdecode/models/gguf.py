"""GGUF files (llama.cpp's format): ``load("model.gguf")`` and ``--ckpt model.gguf``.

The file is read with the reader llama.cpp publishes (the ``gguf`` package). What it holds
becomes what a Hugging Face folder of the same model would load as (:mod:`jaxdecode.models.hf`):
the configuration from the metadata (architectures ``llama``, Mistral's where the file records a
sliding window, ``qwen2`` and ``qwen3``); the tokenizer from ``tokenizer.ggml.*`` as a
``tokenizers`` tokenizer (byte-level BPE with its pre-tokenizer, or SentencePiece's pieces as a
BPE ranked by their scores); and each matrix in the form nearest its type (``weights="auto"``):
F32/F16/BF16 as stored, Q4_0 as int4 bit for bit, Q8_0 as int8 re-rounded per column, the other
4-bit types as int4 and the 5- to 8-bit ones as int8, from their widened values.

llama.cpp stores a Llama's q and k rows permuted for its rotation of adjacent pairs; they are put
back in the rotate-half order the decoder uses, and Llama 3's rope scaling (``rope_freqs.weight``)
is read back as the scaling's parameters. An architecture, a tensor type or a tokenizer that is
not one of these is refused in one sentence. The table of types, what each costs and how it is
checked: ``docs/huggingface.md`` (Precisions and GGUF files).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np

from jaxdecode.models.hf import linear

ARCHITECTURES = ("llama", "qwen2", "qwen3")
FORMS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "Q4_0": "int4", "Q4_1": "int4",
         "Q4_K": "int4", "Q3_K": "int4", "Q2_K": "int4", "Q8_0": "int8", "Q5_0": "int8", "Q5_1": "int8",
         "Q5_K": "int8", "Q6_K": "int8"}
RANK = {"int4": 0, "int8": 1, "float16": 2, "bfloat16": 2, "float32": 3}
# tokenizer.ggml.pre -> the regular expression that splits text before byte-level BPE (None: GPT-2's)
GPT2 = None
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE = {"default": GPT2, "gpt-2": GPT2, "gpt2": GPT2, "llama-bpe": LLAMA3, "llama3": LLAMA3,
       "smaug-bpe": LLAMA3, "qwen2": QWEN2, "deepseek-r1-qwen": QWEN2}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded (one line naming the problem)."""


def is_gguf(path) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _reader(path: Path):
    try:
        import gguf
    except ImportError:  # pragma: no cover - a dependency
        raise GGUFError("reading a GGUF file needs the gguf package: pip install gguf") from None
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError, struct errors, IndexError...
        raise GGUFError(f"{path}: not a GGUF file the gguf package can read ({type(e).__name__}: {e})") from None


class _Meta:
    """The metadata of a reader, by key."""

    def __init__(self, reader, path: Path):
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: the metadata lacks {key}")
        return value


def _llama3(path: Path, factors: np.ndarray, theta: float, dim: int) -> dict | None:
    """Llama 3's rope scaling from llama.cpp's ``rope_freqs`` (each frequency's divisor): the
    scaled band's divisors ``1 / ((1 - s) / factor + s)`` with ``s`` linear in one over the
    wavelength give ``factor`` and the band's bounds (``low_freq_factor`` taken as 1)."""
    f = np.asarray(factors, np.float64)
    if f.shape != (dim // 2,) or not (f >= 1 - 1e-6).all():
        raise GGUFError(f"{path}: rope_freqs.weight is not {dim // 2} factors of at least 1")
    if np.allclose(f, 1):
        return None
    factor = float(f.max())
    x = 1 / (2 * np.pi * theta ** (np.arange(0, dim, 2) / dim))  # one over each wavelength
    s = (1 / f - 1 / factor) / (1 - 1 / factor)  # 1: unscaled; 0: divided by factor
    inside = (s > 1e-6) & (s < 1 - 1e-6)
    # the line s = slope * x + at0 through the band's points; with fewer than two, through them
    # and the nearest frequency left whole (s = 1) or divided by the whole factor (s = 0)
    points = [(x[i], s[i]) for i in np.flatnonzero(inside)]
    ones, fulls = x[s >= 1 - 1e-6], x[s <= 1e-6]
    edges = ([(ones.min(), 1.0)] if ones.size else []) + ([(fulls.max(), 0.0)] if fulls.size else [])
    lines = [tuple(np.polyfit(x[inside], s[inside], 1))] if len(points) >= 2 else []
    for (xa, sa), (xb, sb) in [(a, b) for a in points + edges for b in edges if a != b and a[0] != b[0]]:
        lines.append(((sb - sa) / (xb - xa), sa - xa * (sb - sa) / (xb - xa)))
    for slope, at0 in lines:
        if not (slope > 0 and at0 < 0):
            continue
        band = np.clip(slope * x + at0, 0, 1)
        if np.abs(1 / ((1 - band) / factor + band) - f).max() <= 1e-4 * factor:
            high = 1 - 1 / at0
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                    "high_freq_factor": float(high), "original_max_position_embeddings": float(slope * (high - 1))}
    raise GGUFError(f"{path}: rope_freqs.weight does not follow Llama 3's rope scaling")


def _config(meta: _Meta, arch: str, tensors: dict, rope_freqs=None) -> dict:
    """A Hugging Face ``config.json`` of the file's decoder, from its metadata."""
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFError(f"{meta.path}: the file has no token_embd.weight")
    scaling = a("rope.scaling.type", "none")
    if scaling not in ("none", "linear") or (rope_freqs is not None and scaling != "none"):
        raise GGUFError(f"{meta.path}: {scaling!r} rope scaling is not supported (none, linear, and Llama 3's "
                        f"rope_freqs are)")
    heads = int(meta.need(f"{arch}.attention.head_count"))
    d = int(meta.need(f"{arch}.embedding_length"))
    raw = {"model_type": arch, "architectures": [f"GGUF {arch}"],
           "hidden_size": d, "intermediate_size": int(meta.need(f"{arch}.feed_forward_length")),
           "num_hidden_layers": int(meta.need(f"{arch}.block_count")), "num_attention_heads": heads,
           "num_key_value_heads": int(a("attention.head_count_kv", heads)),
           "head_dim": int(a("attention.key_length", d // heads)),
           "max_position_embeddings": int(a("context_length", 2048)),
           "rms_norm_eps": float(meta.need(f"{arch}.attention.layer_norm_rms_epsilon")),
           "rope_theta": float(a("rope.freq_base", 10000.0)), "vocab_size": int(embed.shape[0]),
           "tie_word_embeddings": "output.weight" not in tensors, "hidden_act": "silu"}
    if scaling == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    if rope_freqs is not None:
        llama3 = _llama3(meta.path, rope_freqs, raw["rope_theta"], raw["head_dim"])
        if llama3 is not None:
            raw["rope_scaling"] = llama3
    window = a("attention.sliding_window")
    if window and arch == "llama":
        raw["model_type"], raw["sliding_window"] = "mistral", int(window)
    elif window:
        raw["sliding_window"], raw["use_sliding_window"] = int(window), True
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if meta.get(name) is not None:
            raw[key] = int(meta.get(name))
    return raw


def _decoder_config(raw: dict, where: str):
    from jaxdecode.models.hf import families
    from jaxdecode.models.hf.config import ConfigError

    spec = families.FAMILIES[raw["model_type"]]
    try:
        return (spec.reader or families.decoder_config)(raw, where)
    except ConfigError as e:
        raise GGUFError(str(e)) from None


def tokenizer(meta: _Meta):
    """The file's vocabulary as a ``tokenizers.Tokenizer`` (one GGUFError line if unsupported)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.need("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise GGUFError(f"{meta.path}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and "
                        f"SentencePiece 'llama' are)")
    if kind == "llama":
        return _sentencepiece(meta)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE:
        raise GGUFError(f"{meta.path}: pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE)})")
    tokens = [str(t) for t in meta.need("tokenizer.ggml.tokens")]
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(str(m).split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{meta.path}: tokenizer.ggml.tokens holds a token twice")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=PRE[pre] is LLAMA3))
    if PRE[pre] is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
             for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)]
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    first = [(tokens[int(bos)], int(bos))] if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None else []
    last = [(tokens[int(eos)], int(eos))] if meta.get("tokenizer.ggml.add_eos_token", False) and eos is not None else []
    if first or last:
        single = " ".join([*(t for t, _ in first), "$A", *(t for t, _ in last)])
        pair = " ".join([*(t for t, _ in first), "$A", *(t for t, _ in last), *(t for t, _ in first), "$B:1",
                         *(f"{t}:1" for t, _ in last)])
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=first + last)
    return tok


def _sentencepiece(meta: _Meta):
    """A SentencePiece vocabulary (``tokenizer.ggml.model`` ``"llama"``: pieces with scores, ``▁``
    for a space, ``<0xNN>`` byte pieces) as a ``tokenizers`` BPE that merges as SentencePiece does:
    each merge ranked by the score of the piece it makes (the merges are every split of a normal
    piece into two normal pieces), bytes outside the vocabulary through the byte pieces."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    tokens = [str(t) for t in meta.need("tokenizer.ggml.tokens")]
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    scores = [float(x) for x in (meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = lambda piece: piece in vocab and types[vocab[piece]] == 1
    ranked = sorted((-scores[i], vocab[p[:k]], vocab[p[k:]], p[:k], p[k:]) for p, i in vocab.items()
                    if types[i] == 1 for k in range(1, len(p)) if normal(p[:k]) and normal(p[k:]))
    unk = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked], unk_token=tokens[unk],
                               fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence([*([normalizers.Prepend("▁")] if prefix else []),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in range(len(tokens)) if types[i] == CONTROL])
    tok.add_tokens([AddedToken(tokens[i], normalized=False) for i in range(len(tokens)) if types[i] == USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", True) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[int(bos)]} $A", pair=f"{tokens[int(bos)]} $A {tokens[int(bos)]} $B:1",
            special_tokens=[(tokens[int(bos)], int(bos))])
    return tok


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows ``[heads * hd, ...]`` from llama.cpp's order (the two halves of each head interleaved,
    for its rotation of adjacent pairs) back to the rotate-half order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LAYER = {"attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv", "attn_output.weight": "wo",
         "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
         "attn_norm.weight": "norm1_w", "ffn_norm.weight": "norm2_w", "attn_q.bias": "bq", "attn_k.bias": "bk",
         "attn_v.bias": "bv", "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"}


def _read(path: Path, reader, cfg, arch: str) -> tuple[dict, list[dict], dict]:
    """``(params in float32, each layer's {matrix: type name}, {"embed"/"head": type name})``."""
    from gguf import GGMLQuantizationType, quants

    params: dict = {}
    layers: list[dict] = [{} for _ in range(cfg.L)]
    types: list[dict] = [{} for _ in range(cfg.L)]
    top: dict = {}
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type).name
        if qtype not in FORMS:
            raise GGUFError(f"{path}: tensor {t.name} has type {qtype}, which is not supported "
                            f"(supported: {', '.join(FORMS)})")
        try:
            a = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        except Exception as e:  # noqa: BLE001 - a truncated block
            raise GGUFError(f"{path}: tensor {t.name} cannot be read ({type(e).__name__}: {e})") from None
        a = a.reshape(tuple(int(n) for n in reversed(t.shape.tolist())))  # numpy order: [out, in]
        if not np.isfinite(a).all():
            raise GGUFError(f"{path}: tensor {t.name} holds NaN or infinite values")
        parts = t.name.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < cfg.L:
            i, name = int(parts[1]), LAYER.get(parts[2])
            if name is None:
                raise GGUFError(f"{path}: tensor {t.name} has no place in a {arch} decoder")
            if arch == "llama" and name in ("wq", "wk", "bq", "bk"):
                a = _unpermute(a, cfg.heads if name in ("wq", "bq") else cfg.kv_heads)
            if a.ndim == 2:
                a, types[i][name] = np.ascontiguousarray(a.T), qtype
            layers[i][name] = a
        elif t.name == "token_embd.weight":
            params["embed"], top["embed"] = a, qtype
        elif t.name == "output.weight":
            params["head"], top["head"] = np.ascontiguousarray(a.T), qtype
        elif t.name == "output_norm.weight":
            params["norm_w"] = a
        elif t.name == "rope_freqs.weight" and arch == "llama":  # read into the config
            continue
        else:
            raise GGUFError(f"{path}: tensor {t.name} has no place in a {arch} decoder of {cfg.L} layers")
    missing = [f"blk.{i}.{k}" for i, layer in enumerate(layers)
               for k, v in LAYER.items() if v in ("wq", "wk", "wv", "wo", "w_down", "norm1_w") and v not in layer]
    if missing or "norm_w" not in params:
        raise GGUFError(f"{path}: the file lacks {(missing or ['output_norm.weight'])[0]}")
    params["layers"] = layers
    return params, types, top


def _form(qtype: str, native: bool) -> tuple[str, str]:
    """``(how, stored)`` for linear's ``_kept``: a type's nearest kept form on this path."""
    form = FORMS[qtype]
    if form in ("int4", "int8"):
        return form, "float32"
    if form == "float32" or not native:
        return "float32", "float32"
    return "stored", form


def _widest(qtypes) -> str:
    forms = {FORMS[q] for q in qtypes}
    if len(forms) == 1:
        return next(iter(qtypes))
    if forms == {"float16", "bfloat16"} or "float32" in forms:
        return "F32"
    best = max(forms, key=RANK.__getitem__)
    return {"int4": "Q4_0", "int8": "Q8_0", "float16": "F16", "bfloat16": "BF16"}[best]


def _arrange(params: dict, types: list[dict], top: dict, cfg, native: bool, weights: str) -> tuple[dict, set]:
    """The parameter tree with each matrix in its kept form (and the forms used)."""
    import jax.numpy as jnp

    used: set = set()

    def kept(a, qtype):
        if weights == "auto":
            how, stored = _form(qtype, native)
        else:
            how, stored = linear.mode(weights, native), {"F16": "float16", "BF16": "bfloat16"}.get(qtype, "float32")
        if how == "stored" and stored == "float32":
            how = "float32"
        out = linear._kept(a, how, stored, native)
        used.add(how if how != "stored" else stored)
        return out

    layers = []
    for p, t in zip(params["layers"], types):
        p, t = dict(p), dict(t)
        if native:
            for fused, parts in linear.FUSED.items():
                if all(k in p for k in parts):
                    t[fused] = _widest([t.pop(k) for k in parts])
                    p[fused] = np.concatenate([p.pop(k) for k in parts], axis=1)
        for k in list(p):
            p[k] = kept(p[k], t[k]) if k in t else jnp.asarray(p[k])
        layers.append(p)
    out = {"layers": tuple(layers), "norm_w": jnp.asarray(params["norm_w"])}
    embed_type = top["embed"]
    embed_dtype = {"F16": "float16", "BF16": "bfloat16"}.get(embed_type) if weights in ("auto", "stored") else None
    out["embed"] = jnp.asarray(params["embed"], embed_dtype if native and embed_dtype else jnp.float32)
    if "head" in params:
        out["head"] = kept(params["head"], top["head"])
    elif native or FORMS[embed_type] in ("int4", "int8") or weights in ("int8", "int4"):
        out["head"] = kept(np.ascontiguousarray(params["embed"].T), embed_type)
    return out, used


def load_gguf(path, *, dtype: str = "float32", max_length: int | None = None, weights: str = "auto",
              backend: str | None = None, mesh=None):
    """A :class:`~jaxdecode.models.lm.LanguageModel` of GGUF file ``path`` (see the module's
    docstring for what is kept how). ``weights``: ``"auto"`` (each matrix in its type's nearest
    kept form) or any of :data:`jaxdecode.models.hf.linear.WEIGHTS` for every matrix; ``backend``
    as for a folder. One GGUFError line for anything that cannot be loaded."""
    from jaxdecode.models.hf import HFDecoder, HFTokenizer, choose_weights
    from jaxdecode.models.hf.tokenizer import TokenizerError
    from jaxdecode.models.lm import LanguageModel

    path = Path(path)
    if dtype != "float32":
        raise GGUFError(f"{path}: a GGUF file loads with dtype float32 (its matrices keep their own forms)")
    if mesh is not None:
        raise GGUFError(f"{path}: a GGUF file loads on one device, not on a mesh")
    native, _ = choose_weights(dtype, weights, backend)
    reader = _reader(path)
    meta = _Meta(reader, path)
    arch = meta.need("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    tensors = {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors}
    freqs = next((np.asarray(t.data, np.float32) for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    raw = _config(meta, arch, {k: _Shape(v) for k, v in tensors.items()}, freqs)
    cfg = _decoder_config(raw, str(path))
    tok = tokenizer(meta)
    params, types, top = _read(path, reader, cfg, arch)
    params, used = _arrange(params, types, top, cfg, native, weights)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
        try:
            vocab = HFTokenizer(Path(d) / "tokenizer.json", cfg.V)
        except TokenizerError as e:
            raise GGUFError(f"{path}: {e}") from None
    vocab.path = path
    eos = tuple(dict.fromkeys(int(meta.get(k)) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                       "tokenizer.ggml.eom_token_id") if meta.get(k) is not None))
    vocab.eos_ids = eos
    decoder = HFDecoder(cfg, dtype, max_length, "native" if native else "portable")
    kinds = sorted(used, key=lambda k: -RANK.get(k, 3))
    info = {"model_type": cfg.model_type, "format": "gguf", "dtype": dtype,
            "weights": kinds[0] if len(kinds) == 1 else "mixed: " + ", ".join(kinds),
            "architectures": raw["architectures"], "eos_token_id": list(eos),
            "gguf_types": sorted({*top.values(), *(q for t in types for q in t.values())})}
    reload = functools.partial(load_gguf, path, dtype=dtype, max_length=max_length, weights=weights)
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta=info, path=path, decoder=decoder,
                         eos_ids=eos, generation_defaults={}, reload=reload)


class _Shape:
    """A tensor's numpy-order shape, standing in for the tensor while the config is read."""

    def __init__(self, shape):
        self.shape = shape


__all__ = ["ARCHITECTURES", "FORMS", "GGUFError", "is_gguf", "load_gguf", "tokenizer"]
