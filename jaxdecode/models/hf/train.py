"""Train a Llama over a byte-level BPE vocabulary on the corpus, written as a Hugging Face folder.

The recipe of the shared loop (:func:`jaxdecode.models.training.fit`) for ``arch="llama"``:

- **The tokenizer**: a byte-level BPE of ``vocab_size`` tokens trained with the ``tokenizers``
  library on the training split (the first 90%), with one special token, ``<|endoftext|>``
  (id 0), which ends every speech: the corpus's speeches are separated by a blank line, and the
  token stream is each speech's tokens followed by the end token in place of that blank line.
- **The model**: RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP, output tied to
  the embedding, ``max_position_embeddings`` the training window ``T``. Matrices start from
  N(0, 0.02), the projections into the residual stream from N(0, 0.02 / sqrt(2 L)).
- **The held-out loss** is in nats per character: the nats of every target token of the fixed
  windows over the last 10%, divided by the characters those tokens stand for (a token's UTF-8
  bytes, one per character on the ASCII corpus; the end token stands for the blank line it
  replaced, two characters), so that it compares with the character model's.
- **The folder** is what transformers loads: ``config.json`` (``LlamaForCausalLM``, with the
  training record under ``"training"``), ``model.safetensors`` (float32 while training; a shipped
  copy may be bfloat16), ``tokenizer.json``, ``tokenizer_config.json`` (the end token and a chat
  template) and ``generation_config.json``.

The chat template renders each message as one character's speech: the user's as ROMEO's and the
assistant's as JULIET's (a message's ``name`` overrides the speaker), each ended by the end
token, and the generation prompt is ``JULIET:`` and a line break.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.io import data as data_lib
from jaxdecode.models.hf.families import decoder_config
from jaxdecode.models.hf.transformer import HFDecoder
from jaxdecode.models.hf.weights import tensor_table
from jaxdecode.models.training import Recipe, TrainConfig

EOS = "<|endoftext|>"
SPEECH_BREAK = "\n\n"  # what the end token replaces in the corpus
CHAT_TEMPLATE = (
    "{%- set speakers = {'user': 'ROMEO', 'assistant': 'JULIET'} -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] not in speakers -%}\n"
    "{{- raise_exception('this model speaks in speeches: user (ROMEO) and assistant (JULIET) messages "
    "only, not ' ~ message['role']) -}}\n"
    "{%- endif -%}\n"
    "{{- (message['name'] if message['name'] is defined and message['name'] else speakers[message['role']]) "
    "~ ':\\n' ~ message['content'] ~ eos_token -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- 'JULIET:\\n' -}}{%- endif -%}\n"
)
DECAYED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class _Logits:
    """The decoder's logits as a hashable function of ``(params, x)``."""

    decoder: HFDecoder

    def __call__(self, params, x):
        return self.decoder.forward(params, x)[0]


def speeches(text: str) -> list[str]:
    """The corpus's speeches: the pieces between blank lines."""
    return [s for s in text.split(SPEECH_BREAK) if s]


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` tokens (``EOS`` is id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(speeches(text), trainer)
    return tok


def token_stream(tok, text: str) -> np.ndarray:
    """Each speech's tokens followed by the end token."""
    eos = tok.token_to_id(EOS)
    out = []
    for enc in tok.encode_batch(speeches(text)):
        out.extend(enc.ids)
        out.append(eos)
    return np.asarray(out, np.int32)


def char_lengths(tok) -> np.ndarray:
    """Per token id: the characters of the corpus it stands for: a byte-level token's pieces are
    one character per byte (one corpus character on ASCII text); ``EOS`` stands for the blank line."""
    lengths = np.zeros(tok.get_vocab_size(), np.int64)
    for piece, i in tok.get_vocab().items():
        lengths[i] = len(SPEECH_BREAK) if piece == EOS else len(piece)
    return lengths


def llama_config(tc: TrainConfig, V: int, eos: int) -> dict:
    """The ``config.json`` of the run's model."""
    ffn = tc.ffn or 32 * math.ceil(8 * tc.d / 3 / 32)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V,
        "hidden_size": tc.d, "intermediate_size": ffn, "num_hidden_layers": tc.L,
        "num_attention_heads": tc.heads, "num_key_value_heads": tc.kv_heads or tc.heads,
        "head_dim": tc.d // tc.heads, "max_position_embeddings": tc.T, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "rope_scaling": None, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": True,
        "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos, "initializer_range": 0.02,
        "pretraining_tp": 1, "use_cache": True, "torch_dtype": "float32",
    }


def init_params(cfg, key) -> dict:
    """Parameters in the decoder's layout: norms at one, matrices N(0, 0.02) (residual outputs
    N(0, 0.02 / sqrt(2 L)))."""
    flat: dict = {}
    layers = [dict() for _ in range(cfg.L)]
    for n, (name, (param, layer, how, shape)) in enumerate(sorted(tensor_table(cfg).items())):
        if how not in (None, "T"):
            raise ValueError(f"init_params: {name} is stored fused ({how}), which training does not write")
        shape = shape[::-1] if how == "T" else shape
        if param.startswith("norm"):
            a = jnp.ones(shape, jnp.float32)
        else:
            std = 0.02 / math.sqrt(2 * cfg.L) if param in ("wo", "w_down") else 0.02
            a = std * jax.random.normal(jax.random.fold_in(key, n), shape, jnp.float32)
        (flat if layer is None else layers[layer])[param] = a
    flat["layers"] = tuple(layers)
    return flat


def state_dict(cfg, params) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (transformers' names and layouts) of decoder parameters."""
    out = {}
    for name, (param, layer, how, shape) in tensor_table(cfg).items():
        a = np.asarray(params[param] if layer is None else params["layers"][layer][param], np.float32)
        if how not in (None, "T"):
            raise ValueError(f"state_dict: {name} is stored fused ({how}), which is not written")
        out[name] = np.ascontiguousarray(a.T if how == "T" else a)
        assert out[name].shape == shape, (name, out[name].shape, shape)
    return out


def tokenizer_config(T: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
        "bos_token": None, "unk_token": None, "model_max_length": T, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {"0": {"content": EOS, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False, "special": True}},
        "chat_template": CHAT_TEMPLATE,
    }


def write_folder(tmp: Path, raw: dict, cfg, params, tokenizer_json: str, meta: dict | None = None) -> None:
    """Write an HF folder's files into ``tmp`` (an atomic folder's staging directory)."""
    from safetensors.numpy import save_file

    eos = raw["eos_token_id"]
    save_file(state_dict(cfg, params), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = dict(raw) | ({"training": meta} if meta else {})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(raw["max_position_embeddings"]),
                                                          indent=2) + "\n", encoding="utf-8")
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}, indent=2) + "\n", encoding="utf-8")


def recipe(text: str, tc: TrainConfig, out_dir: Path | None = None, resume: bool = False) -> Recipe:
    """The Llama run of ``tc`` on corpus ``text`` (on resume, the tokenizer saved in ``out_dir``)."""
    from tokenizers import Tokenizer

    from jaxdecode.models.checkpoint import atomic_folder
    from jaxdecode.models.hf.weights import read_params

    train_text, val_text = data_lib.split(text)
    saved = out_dir / "tokenizer.json" if out_dir is not None else None
    if resume and saved is not None and saved.is_file():
        tok = Tokenizer.from_file(str(saved))
    elif tc.tokenizer is not None:  # another model's vocabulary (a draft shares its target's)
        given = Path(tc.tokenizer) / "tokenizer.json"
        if not given.is_file():
            raise ValueError(f"train: {tc.tokenizer} has no tokenizer.json to share")
        tok = Tokenizer.from_file(str(given))
        if tok.token_to_id(EOS) is None:
            raise ValueError(f"train: the tokenizer of {tc.tokenizer} has no {EOS} token to end speeches with")
    else:
        tok = train_tokenizer(train_text, tc.vocab_size)
    V = tok.get_vocab_size()
    eos = tok.token_to_id(EOS)
    raw = llama_config(tc, V, eos)
    cfg = decoder_config(raw, "the training run's config")
    decoder = HFDecoder(cfg)
    train_tokens = token_stream(tok, train_text)
    windows = data_lib.eval_windows(token_stream(tok, val_text), tc.eval_T or tc.T, tc.eval_windows)
    window_chars = float(char_lengths(tok)[windows[:, 1:]].sum())
    tokenizer_json = tok.to_str()

    def save(folder, params, meta, extra_files):
        with atomic_folder(folder) as tmp:
            write_folder(tmp, raw, cfg, params, tokenizer_json, meta)
            for name, data in extra_files.items():
                (tmp / name).write_bytes(data)

    return Recipe(
        logits=_Logits(decoder), params=init_params(cfg, jax.random.fold_in(jax.random.PRNGKey(tc.seed), 0)),
        train_tokens=train_tokens, windows=windows, window_chars=window_chars,
        corpus_sha=data_lib.sha256(text), num_params=cfg.num_params(), decayed=DECAYED, save=save,
        load_params=lambda folder: read_params(Path(folder), cfg, jnp.float32))


def export(src, dst, dtype: str = "bfloat16") -> Path:
    """Copy the model folder ``src`` (no training state) to ``dst`` with its weights stored as
    ``dtype`` (``"bfloat16"`` halves the file; loading widens them back to float32)."""
    import shutil

    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    from jaxdecode.models.checkpoint import atomic_folder

    kinds = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
    if dtype not in kinds:
        raise ValueError(f"export: dtype must be one of {', '.join(kinds)}, got {dtype!r}")
    src = Path(src)
    with atomic_folder(dst) as tmp:
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copyfile(src / name, tmp / name)
        tensors = {k: v.astype(kinds[dtype]) for k, v in load_file(str(src / "model.safetensors")).items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((tmp / "config.json").read_text())
        config["torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return Path(dst)


def training_record(lm) -> dict:
    """The ``"training"`` record of the folder ``lm`` was loaded from (empty if it has none, or
    was loaded from a file)."""
    if lm.path is None or not Path(lm.path).is_dir():
        return {}
    return json.loads((Path(lm.path) / "config.json").read_text(encoding="utf-8")).get("training") or {}


def held_out_loss(lm, text: str, T: int | None = None, count: int = 32) -> tuple[float, int]:
    """The held-out loss of an HF model in nats per character, and the number of windows: over
    ``count`` fixed windows of ``T`` tokens (default: the model's window) of the last 10% of
    ``text``, tokenized as training does (speeches ended by the end token) for a model this
    module trained (its ``config.json`` has a ``"training"`` record), else as plain text."""
    from jaxdecode.models.training import window_nats

    _, val = data_lib.split(text)
    tok = lm.vocab.tok
    if training_record(lm) and tok.token_to_id(EOS) is not None:
        stream = token_stream(tok, val)
        lengths = char_lengths(tok)
    else:
        stream = np.asarray(lm.vocab.encode(val), np.int32)
        lengths = np.asarray([len(lm.vocab.decode([i])) for i in range(lm.decoder.V)], np.int64)
    T = min(T or lm.decoder.T, len(stream) - 1)
    windows = data_lib.eval_windows(stream, T, count)
    chars = float(lengths[windows[:, 1:]].sum())
    return window_nats(lm.params, _Logits(lm.decoder), windows) / chars, int(windows.shape[0])
