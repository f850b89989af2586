"""Build the Hugging Face reference fixtures under ``tests/fixtures/hf/``.

Five tiny randomly initialised causal language models are written with transformers'
``save_pretrained``, each next to a byte-level BPE ``tokenizer.json`` trained here on a small
embedded text (English prose plus multi-byte UTF-8 lines, so that some characters are split over
several byte-level tokens)::

    tests/fixtures/hf/llama/        LlamaForCausalLM, GQA (4 q heads, 2 kv heads), llama3 rope
                                    scaling, untied lm_head, float32, BOS-prepending tokenizer,
                                    two EOS ids
    tests/fixtures/hf/qwen2/        Qwen2ForCausalLM, qkv biases, tied embeddings, float32,
                                    sharded safetensors (model.safetensors.index.json)
    tests/fixtures/hf/mistral/      MistralForCausalLM, sliding_window=12, bfloat16 storage
    tests/fixtures/hf/gpt2/         GPT2LMHeadModel, gelu_new, tied embeddings, float16 storage
    tests/fixtures/hf/llama-draft/  a smaller Llama sharing the tokenizer and vocabulary of
                                    ``llama`` (a draft model for speculative decoding)

Every folder holds config.json, generation_config.json, the weights, tokenizer.json,
tokenizer_config.json (informational) and the reference outputs HF computes in float32 (from the
storage-dtype-rounded weights, eager attention, ``torch.no_grad``):

- ``expected.json``: prompts, their token ids (``add_special_tokens=True``), greedy
  continuations of 80 new tokens (``greedy_<i>``, with EOS handling, from ``model.generate``;
  ``greedy_eos_<i>`` says whether it stopped at EOS; ``greedy_no_eos_<i>`` is the same run with
  EOS ignored), a fixed continuation of prompt 0 with the per-token log-probabilities HF assigns
  to it, the smallest top-1/top-2 logit gap along the greedy runs, and the library versions used;
- ``logits_<i>.npy``: float32 logits ``[len(prompt_ids[i]), vocab_size]`` of one forward over
  prompt ``i``;
- ``long_logits.npy`` (llama and mistral): float32 logits of one forward over the 60 ids in
  ``expected.json["long_ids"]``, which reach well past mistral's sliding window.

The vocabulary size of each model is the tokenizer's rounded up to a multiple of 64 (padded
vocabulary, as in real checkpoints); the padding rows of the embeddings hold small noise so that
they never win an argmax. Norm weights and biases are random (not ones/zeros), and weights use a
larger-than-default scale so that greedy decoding has clear winners (at least 3e-3 logit gap at
every step, checked). For each main model an EOS id is chosen so that greedy decoding of prompt 0
stops between new-token 30 and 70.

torch and transformers are never dependencies of the library or its tests; run this script in a
separate virtual environment (the committed fixtures were made with torch 2.13.0 CPU and
transformers 5.24.0; output is deterministic for given versions)::

    python3 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch transformers tokenizers safetensors numpy
    /tmp/hfvenv/bin/python tools/make_hf_fixtures.py
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import shutil
from pathlib import Path

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"

SPECIAL_TOKENS = ["<|endoftext|>", "<s>", "</s>", "<pad>"]
TOKENIZER_VOCAB = 400
PROMPTS = ["ROMEO:\nWhat light", "The café is", "日本語 and 🙂 "]
CONTINUATION = " so soft, and fair"
MAX_NEW_TOKENS = 80
EOS_WINDOW = (30, 70)  # greedy decoding of prompt 0 must stop at a new token in this range
EOS_TARGET = 50  # among candidate EOS ids, prefer the one first generated closest to this step
LONG_LEN = 60
MIN_GAP = 3e-3
WEIGHT_STD = 0.2
MAX_SEED_TRIES = 200

TRAINING_TEXT = """\
ROMEO:
What light is this that wakes me at the window? The night was long, and I
have walked the orchard twice, counting the stars as a miser counts his coin.

JULIET:
Who speaks below? The wall is high, the garden wet with rain, and my
father's men are sleeping by the gate. Speak softly, or they will hear you.

ROMEO:
I speak as softly as the wind that moves the leaves. I came to say that I
am yours, and that the morning cannot come too late for me.

JULIET:
Then stay a while, and tell me what you see. Is the moon still bright upon
the river, and are the boats still tied along the shore?

NURSE:
Madam! Your mother calls for you. Come in, come in, the hour is late and the
candles are burning low.

JULIET:
I come, I come. Good night, good night! Parting is a sorrow, and yet I would
say good night until the morning found us here.

The old town stood on a hill above the river. In the summer the market was
full of fruit and bread, and the children ran between the stalls while their
parents talked about the weather, the harvest, and the price of salt. In the
winter the streets were quiet, and the only sound at night was the bell of the
church, which rang the hours whether anyone listened or not.

A traveller who came to the town in the spring would find the inn by the bridge
open and warm. The keeper was a patient man who remembered every face. He
served soup and cheese and a dark wine from the valley, and he asked no
questions of those who did not wish to answer them. When the rain came, as it
often did, the common room filled with people who had nowhere else to go, and
the talk went on late into the evening.

The library at the top of the hill kept books in many languages. Some were
written by hand, and some were printed on paper so thin that the light came
through it. The librarian said that every book was a window, and that a town
with many windows could never be entirely dark.

In the café by the square, the waiter wrote the menu in chalk: café, crème
brûlée, croissant, and a soup of the day. A naïve visitor once asked for the
résumé of the cook, and the whole room laughed. Façade, fiancée, déjà vu, and
señor are words that travel well; Straße and Ärger and Übung do not.

日本語のテキストも少し入れておきます。今日は天気がいいですね。
東京と京都の間を新幹線で移動しました。
Ελληνικά: καλημέρα, ευχαριστώ, θάλασσα και ήλιος.
Русский текст: доброе утро, спасибо, море и солнце.
Emoji: 🙂 🚀 🌙 ✨ 🙂🚀 — and a few symbols: € £ ¥ © ° ± × ÷ → ∞.
한국어 문장도 조금 있습니다. 中文也有一点。 العربية قليلا.
"""

MAIN_MODELS = ("llama", "qwen2", "mistral", "gpt2")
ALL_MODELS = ("llama", "qwen2", "mistral", "gpt2", "llama-draft")
SEED_BASE = {"llama": 1000, "qwen2": 2000, "mistral": 3000, "gpt2": 4000, "llama-draft": 5000}
STORAGE_DTYPE = {
    "llama": torch.float32,
    "qwen2": torch.float32,
    "mistral": torch.bfloat16,
    "gpt2": torch.float16,
    "llama-draft": torch.float32,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


# --------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    return tok


def tokenizer_for(name: str, base: Tokenizer) -> Tokenizer:
    tok = Tokenizer.from_str(base.to_str())
    if name in ("llama", "llama-draft"):
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", bos)]
        )
    return tok


def tokenizer_config(name: str) -> dict:
    if name in ("gpt2", "qwen2"):
        bos, eos = "<|endoftext|>", "<|endoftext|>"
    else:
        bos, eos = "<s>", "</s>"
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": "<pad>",
        "add_bos_token": name in ("llama", "llama-draft"),
        "model_max_length": 256,
    }


# --------------------------------------------------------------------------------------------
# models


def make_config(name: str, vocab: int, ids: dict):
    common = dict(vocab_size=vocab, pad_token_id=ids["<pad>"], initializer_range=WEIGHT_STD)
    llama_sizes = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
    )
    if name == "llama":
        return LlamaConfig(
            **llama_sizes, **common, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False,
            bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
        )
    if name == "llama-draft":
        return LlamaConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, intermediate_size=64, rms_norm_eps=1e-5, max_position_embeddings=256,
            **common, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False,
            bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
        )
    if name == "qwen2":
        return Qwen2Config(
            **llama_sizes, **common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True, use_sliding_window=False,
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"],
        )
    if name == "mistral":
        return MistralConfig(
            **llama_sizes, **common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            sliding_window=12, tie_word_embeddings=False,
            bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
        )
    if name == "gpt2":
        return GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=256, activation_function="gelu_new",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
            tie_word_embeddings=True, **common,
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"],
        )
    raise ValueError(name)


def build_model(config, seed: int, tok_vocab: int, dtype: torch.dtype):
    """A model with random weights (rounded to the storage dtype and back to float32)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    emb_names = ("embed_tokens.weight", "wte.weight", "lm_head.weight")
    with torch.no_grad():
        for pname, p in model.named_parameters():  # tied parameters are listed once
            leaf = pname.rsplit(".", 1)[-1]
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if leaf == "bias":
                value = 0.1 * noise
            elif p.ndim == 1:  # RMSNorm / LayerNorm scale
                value = 1.0 + 0.1 * noise
            else:
                value = WEIGHT_STD * noise
                if pname.endswith(emb_names):
                    value[tok_vocab:] *= 0.05  # padding rows: never an argmax
            p.copy_(value.to(dtype).to(torch.float32))
    return model.eval()


def forward_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


def greedy_no_cache(model, ids: list[int], steps: int) -> tuple[list[int], float]:
    """Greedy tokens from a full forward at every step (no cache, no EOS) and the smallest gap."""
    seq = list(ids)
    new, min_gap = [], float("inf")
    for _ in range(steps):
        last = forward_logits(model, seq)[-1]
        top = torch.topk(last, 2).values
        min_gap = min(min_gap, float(top[0] - top[1]))
        t = int(torch.argmax(last))
        new.append(t)
        seq.append(t)
    return new, min_gap


def choose_eos(tokens: list[int], forbidden: list[int], tok_vocab: int) -> tuple[int, int] | None:
    """An id first generated at a step in EOS_WINDOW, with no forbidden id generated before it."""
    first = {}
    for step, t in enumerate(tokens):
        first.setdefault(t, step)
    lo, hi = EOS_WINDOW
    best = None
    for t, step in first.items():
        if not lo <= step <= hi or t >= tok_vocab or t in forbidden:
            continue
        if any(f in tokens[:step] for f in forbidden):
            continue
        if best is None or abs(step - EOS_TARGET) < abs(best[1] - EOS_TARGET):
            best = (t, step)
    return best


def search_seed(name: str, config, prompt_ids: list[list[int]], tok_vocab: int, fixed_eos, forbidden):
    dtype = STORAGE_DTYPE[name]
    for seed in range(SEED_BASE[name], SEED_BASE[name] + MAX_SEED_TRIES):
        model = build_model(config, seed, tok_vocab, dtype)
        runs, gaps = [], []
        for ids in prompt_ids:
            new, gap = greedy_no_cache(model, ids, MAX_NEW_TOKENS)
            runs.append(new)
            gaps.append(gap)
        if min(gaps) < MIN_GAP or any(t >= tok_vocab for r in runs for t in r):
            continue
        if fixed_eos is None:
            pick = choose_eos(runs[0], forbidden, tok_vocab)
            if pick is None:
                continue
            eos = [pick[0]] + list(forbidden)
        else:
            eos = list(fixed_eos)
        return seed, model, runs, min(gaps), eos
    raise RuntimeError(f"{name}: no seed in {MAX_SEED_TRIES} tries met the conditions")


# --------------------------------------------------------------------------------------------
# main


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    base_tok = train_tokenizer()
    tok_vocab = base_tok.get_vocab_size()
    vocab = -(-tok_vocab // 64) * 64
    ids = {s: base_tok.token_to_id(s) for s in SPECIAL_TOKENS}
    print(f"tokenizer: {tok_vocab} tokens (model vocab {vocab}), specials {ids}")

    if OUT_DIR.exists():
        shutil.rmtree(OUT_DIR)
    OUT_DIR.mkdir(parents=True)

    rows, llama_eos = [], None
    for name in ALL_MODELS:
        folder = OUT_DIR / name
        tok = tokenizer_for(name, base_tok)
        prompt_ids = [tok.encode(p, add_special_tokens=True).ids for p in PROMPTS]
        cont_ids = tok.encode(CONTINUATION, add_special_tokens=False).ids
        config = make_config(name, vocab, ids)
        dtype = STORAGE_DTYPE[name]

        if name == "llama-draft":
            fixed, forbidden = llama_eos, []
        elif name == "llama":
            fixed, forbidden = None, [ids["</s>"]]
        else:
            fixed, forbidden = None, []
        seed, model, runs, min_gap, eos = search_seed(name, config, prompt_ids, tok_vocab, fixed, forbidden)
        if name == "llama":
            llama_eos = eos
        eos_cfg = eos if len(eos) > 1 else eos[0]

        # save in the storage dtype
        model.config.eos_token_id = eos_cfg
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=eos_cfg, pad_token_id=ids["<pad>"]
        )
        shard = {"max_shard_size": "200KB"} if name == "qwen2" else {}
        model.to(dtype).save_pretrained(folder, **shard)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(name), indent=2) + "\n")

        # reference outputs from the reloaded folder, in float32
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
        ref.eval()
        assert ref.generation_config.eos_token_id == eos_cfg, ref.generation_config.eos_token_id
        expected = {
            "model": name,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__},
            "seed": seed,
            "storage_dtype": str(dtype).replace("torch.", ""),
            "vocab_size": vocab,
            "tokenizer_vocab_size": tok_vocab,
            "eos_token_id": eos,
            "pad_token_id": ids["<pad>"],
            "max_new_tokens": MAX_NEW_TOKENS,
            "prompts": PROMPTS,
            "prompt_ids": prompt_ids,
            "min_top2_gap": min_gap,
        }
        stop_step = None
        for i, p_ids in enumerate(prompt_ids):
            logits = forward_logits(ref, p_ids)
            np.save(folder / f"logits_{i}.npy", logits.numpy().astype(np.float32))
            with torch.no_grad():
                out = ref.generate(
                    torch.tensor([p_ids]), attention_mask=torch.ones(1, len(p_ids), dtype=torch.long),
                    max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                )
            new = out[0, len(p_ids):].tolist()
            hit = new[-1] in eos
            assert all(t not in eos for t in new[:-1]), (name, i, new)
            # the cached HF decode must agree with the no-cache greedy run, cut at the first EOS
            cut = next((k + 1 for k, t in enumerate(runs[i]) if t in eos), MAX_NEW_TOKENS)
            assert new == runs[i][:cut], (name, i, new, runs[i])
            expected[f"greedy_{i}"] = new
            expected[f"greedy_eos_{i}"] = hit
            expected[f"greedy_no_eos_{i}"] = runs[i]
            if i == 0:
                stop_step = len(new) if hit else None
        if name in MAIN_MODELS:
            assert stop_step is not None and EOS_WINDOW[0] <= stop_step - 1 <= EOS_WINDOW[1], stop_step

        full = prompt_ids[0] + cont_ids
        logp = torch.log_softmax(forward_logits(ref, full), dim=-1)
        P = len(prompt_ids[0])
        expected["continuation"] = CONTINUATION
        expected["continuation_ids"] = cont_ids
        expected["continuation_logprobs"] = [float(logp[P - 1 + j, t]) for j, t in enumerate(cont_ids)]

        notes = []
        if name in ("llama", "mistral"):
            long_ids = (prompt_ids[0] + runs[0])[:LONG_LEN]
            long_logits = forward_logits(ref, long_ids)
            np.save(folder / "long_logits.npy", long_logits.numpy().astype(np.float32))
            expected["long_ids"] = long_ids
            if name == "llama":
                cfg2 = make_config(name, vocab, ids)
                cfg2.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
                plain = AutoModelForCausalLM.from_config(cfg2, attn_implementation="eager").eval()
                plain.load_state_dict(ref.state_dict())
                d = float((forward_logits(plain, long_ids) - long_logits).abs().max())
                assert d > 1e-2, d
                notes.append(f"llama3 rope scaling changes logits by up to {d:.3g}")
            else:
                cfg2 = make_config(name, vocab, ids)
                cfg2.sliding_window = None
                full_attn = AutoModelForCausalLM.from_config(cfg2, attn_implementation="eager").eval()
                full_attn.load_state_dict(ref.state_dict())
                diff = (forward_logits(full_attn, long_ids) - long_logits).abs().amax(dim=-1)
                w = config.sliding_window
                inside, past = float(diff[:w].max()), float(diff[w:].max())
                assert inside < 1e-4 and past > 1e-2, (inside, past)
                notes.append(f"sliding window: |dlogits| vs no window: {inside:.2g} at positions < {w}, "
                             f"up to {past:.3g} past it (first differing position "
                             f"{int(torch.nonzero(diff > 1e-4)[0])})")

        (folder / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")

        files = sorted(p.name for p in folder.iterdir())
        with safetensors.safe_open(next(folder.glob("*.safetensors")), "pt") as f:
            some_keys = list(f.keys())[:2]
        n_params = sum(p.numel() for p in ref.parameters())
        rows.append((name, n_params, expected["storage_dtype"], len(files), eos, stop_step, min_gap))
        for n in notes:
            print(f"{name}: {n}")
        print(f"{name}: seed {seed}, tensor names e.g. {some_keys}")

    verify()

    total = sum(p.stat().st_size for p in OUT_DIR.rglob("*") if p.is_file())
    print(f"\nwrote {OUT_DIR} ({total / 1e6:.2f} MB)")
    header = ("model", "params", "dtype", "files", "eos ids", "stop", "min gap")
    print("{:<12} {:>7} {:<9} {:>5}  {:<12} {:>4} {:>8}".format(*header))
    for name, n, dt, nf, eos, stop, gap in rows:
        print(f"{name:<12} {n:>7} {dt:<9} {nf:>5}  {str(eos):<12} {str(stop):>4} {gap:>8.4f}")


def verify() -> None:
    """Reload every folder from disk and compare with what was stored."""
    for name in ALL_MODELS:
        folder = OUT_DIR / name
        exp = json.loads((folder / "expected.json").read_text())
        fast = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        for p, want in zip(exp["prompts"], exp["prompt_ids"]):
            assert fast(p)["input_ids"] == want, (name, p)
            assert fast.decode(want, skip_special_tokens=True) == p, (name, p)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        for i, ids in enumerate(exp["prompt_ids"]):
            d = np.abs(forward_logits(model, ids).numpy() - np.load(folder / f"logits_{i}.npy")).max()
            assert d == 0.0, (name, i, d)
        raw = AutoModelForCausalLM.from_pretrained(folder)
        assert next(raw.parameters()).dtype == STORAGE_DTYPE[name], (name, next(raw.parameters()).dtype)
    print("verify: tokenizers and reloaded logits match the stored fixtures")


if __name__ == "__main__":
    main()
