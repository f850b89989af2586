"""Build the fixtures of the newer Hugging Face families under ``tests/fixtures/hf/<family>/``.

One tiny randomly initialised model per family (hidden size 32, 2-3 layers, the 448-id vocabulary
of the existing fixtures, whose ``tokenizer.json`` is copied: the BOS-prepending one of ``llama``
for the Gemmas, the plain one of ``qwen2`` for the others), saved with transformers'
``save_pretrained`` in float32, each exercising what its family adds::

    qwen3        q/k norms per head; use_sliding_window with a window of 8 from layer 1 on;
                 generation_config.json with sampling defaults (as Qwen3 ships them)
    gemma        (1 + w) norms, sqrt(d) embeddings, GeLU-tanh, head_dim 16 with d 32, one kv head
    gemma2       norms around both blocks, soft-capping (attention 3, logits 5, small enough to
                 matter here), query_pre_attn_scalar 24, window 8 on alternate layers
    gemma3_text  q/k norms, sliding layers (window 8, base 1e4) and a global one (base 1e6 with
                 linear rope scaling 8), the sliding_window_pattern of 3
    gemma3       the same text model inside Gemma3ForConditionalGeneration with a tiny vision tower
    phi3         fused qkv_proj/gate_up_proj, partial_rotary_factor 0.5, sliding_window 10
    olmo2        norms after attention and MLP only, q/k norms over the whole projection
    mixtral      4 experts, top 2 renormalized (block_sparse_moe.experts.j.w1/w2/w3)
    qwen3_moe    4 experts, top 2 not renormalized, q/k norms, layer 1 dense (mlp_only_layers)
    qwen2_moe    4 experts, top 2, the sigmoid-gated shared expert, q/k/v biases
    olmoe        4 experts, top 2 renormalized, clip_qkv 3, q/k norms over the projection
    smollm3      4 layers, the last without rotation (no_rope_layer_interval 4), rope base by
                 default (2e6), tied output by default
    granite      embedding multiplier 6, residual multiplier 0.5, attention multiplier 0.25 (for
                 1/sqrt(8)), logits divided by 4, q/k/v/o biases, untied output

Each folder holds what ``tools/make_hf_fixtures.py`` writes for the first four families
(config.json, generation_config.json, model.safetensors, tokenizer files, expected.json with
greedy runs of 80 tokens stopping at an end token chosen as there, continuation log-probs, and
``logits_<i>.npy``), plus ``long_logits.npy``: logits of one forward over the 32 ids in
``expected.json["long_ids"]``, four times the sliding windows. Run it in the torch/transformers
environment (torch and transformers are never dependencies of the library or its tests)::

    /work/main/.venv-torch/bin/python tools/make_hf_family_fixtures.py [family ...]

It only writes the folders of its own families (never the four of make_hf_fixtures.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers
from make_hf_fixtures import (
    CONTINUATION,
    EOS_WINDOW,
    MAX_NEW_TOKENS,
    MAX_SEED_TRIES,
    MIN_GAP,
    PROMPTS,
    build_model,
    choose_eos,
    forward_logits,
    greedy_no_cache,
    tokenizer_config,
)
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, GenerationConfig

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
VOCAB = 448
LONG_LEN = 32
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=48, num_hidden_layers=2, rms_norm_eps=1e-5, max_position_embeddings=256,
            initializer_range=0.2)
GEMMA3_TEXT = dict(BASE, num_hidden_layers=3, intermediate_size=32, query_pre_attn_scalar=20,
                   sliding_window=8, sliding_window_pattern=3, tie_word_embeddings=True,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
MOE = dict(num_experts=4, num_experts_per_tok=2)
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(BASE, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                  tie_word_embeddings=True)),
    "gemma": ("GemmaConfig", dict(BASE, head_dim=16, num_key_value_heads=1, hidden_act="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", dict(BASE, num_hidden_layers=3, intermediate_size=32, query_pre_attn_scalar=24,
                                    sliding_window=8, attn_logit_softcapping=3.0,
                                    final_logit_softcapping=5.0)),
    "gemma3_text": ("Gemma3TextConfig", GEMMA3_TEXT),
    "gemma3": ("Gemma3Config", {}),
    "phi3": ("Phi3Config", dict(BASE, head_dim=None, sliding_window=10, tie_word_embeddings=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5})),
    "olmo2": ("Olmo2Config", dict(BASE, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", dict(BASE, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                      tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(BASE, **MOE, num_hidden_layers=3, moe_intermediate_size=24,
                                         mlp_only_layers=[1], norm_topk_prob=False,
                                         tie_word_embeddings=True)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(BASE, **MOE, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=40,
                                         norm_topk_prob=False, tie_word_embeddings=True)),
    "olmoe": ("OlmoeConfig", dict(BASE, **MOE, intermediate_size=24, norm_topk_prob=True, clip_qkv=3.0,
                                  tie_word_embeddings=True)),
    "smollm3": ("SmolLM3Config", dict(BASE, num_hidden_layers=4, intermediate_size=32)),
    "granite": ("GraniteConfig", dict(BASE, embedding_multiplier=6.0, residual_multiplier=0.5,
                                      attention_multiplier=0.25, logits_scaling=4.0, attention_bias=True)),
}
SEED_BASE = 7000
# Qwen3's own folders ship sampling defaults; the generate calls here pass do_sample=False
QWEN3_SAMPLING = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)


def make_config(name: str, ids: dict):
    cls, kw = FAMILIES[name]
    specials = dict(pad_token_id=ids["<pad>"], bos_token_id=ids["<s>"], eos_token_id=ids["</s>"])
    kw = {k: v for k, v in kw.items() if v is not None}
    if name == "gemma3":
        text = dict(GEMMA3_TEXT, **specials)
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                         image_token_index=ids["<pad>"], boi_token_index=ids["<s>"],
                                         eoi_token_index=ids["</s>"], **specials)
    return getattr(transformers, cls)(**kw, **specials)


def model_class(name: str):
    return transformers.Gemma3ForConditionalGeneration if name == "gemma3" else AutoModelForCausalLM


def build(name, config, seed, tok_vocab):
    """A random model; Gemma 3's image-text one holds the text model of the same seed."""
    if name != "gemma3":
        return build_model(config, seed, tok_vocab, torch.float32)
    text = build_model(config.text_config, seed, tok_vocab, torch.float32)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    return model.eval()


def search(name, config, prompt_ids, tok_vocab):
    for seed in range(SEED_BASE, SEED_BASE + MAX_SEED_TRIES):
        model = build(name, config, seed, tok_vocab)
        runs, gaps = [], []
        for ids in prompt_ids:
            new, gap = greedy_no_cache(model, ids, MAX_NEW_TOKENS)
            runs.append(new)
            gaps.append(gap)
        if min(gaps) < MIN_GAP or any(t >= tok_vocab for r in runs for t in r):
            continue
        pick = choose_eos(runs[0], [], tok_vocab)
        if pick is not None:
            return seed, model, runs, min(gaps), [pick[0]]
    raise RuntimeError(f"{name}: no seed in {MAX_SEED_TRIES} tries met the conditions")


def write(name: str) -> None:
    bos_tok = name.startswith("gemma")
    source = OUT_DIR / ("llama" if bos_tok else "qwen2") / "tokenizer.json"
    tok = Tokenizer.from_file(str(source))
    tok_vocab = tok.get_vocab_size()
    ids = {s: tok.token_to_id(s) for s in ("<|endoftext|>", "<s>", "</s>", "<pad>")}
    folder = OUT_DIR / name
    if folder.exists():
        shutil.rmtree(folder)
    prompt_ids = [tok.encode(p, add_special_tokens=True).ids for p in PROMPTS]
    cont_ids = tok.encode(CONTINUATION, add_special_tokens=False).ids
    config = make_config(name, ids)
    seed, model, runs, min_gap, eos = search(name, config, prompt_ids, tok_vocab)
    model.config.eos_token_id = eos[0]
    if name == "gemma3":
        model.config.text_config.eos_token_id = eos[0]
    extra = QWEN3_SAMPLING if name == "qwen3" else {}
    model.generation_config = GenerationConfig(bos_token_id=ids["<s>"], eos_token_id=eos[0],
                                               pad_token_id=ids["<pad>"], **extra)
    model.save_pretrained(folder)
    shutil.copy(source, folder / "tokenizer.json")
    cfg = tokenizer_config("llama" if bos_tok else "qwen2")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    ref = model_class(name).from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    expected = {"model": name, "seed": seed, "storage_dtype": "float32", "vocab_size": VOCAB,
                "tokenizer_vocab_size": tok_vocab, "eos_token_id": eos, "pad_token_id": ids["<pad>"],
                "max_new_tokens": MAX_NEW_TOKENS, "prompts": PROMPTS, "prompt_ids": prompt_ids,
                "min_top2_gap": min_gap,
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                             "tokenizers": tokenizers.__version__}}
    for i, p_ids in enumerate(prompt_ids):
        np.save(folder / f"logits_{i}.npy", forward_logits(ref, p_ids).numpy().astype(np.float32))
        with torch.no_grad():
            mask = torch.ones(1, len(p_ids), dtype=torch.long)
            out = ref.generate(torch.tensor([p_ids]), attention_mask=mask,
                               max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        new = out[0, len(p_ids):].tolist()
        cut = next((k + 1 for k, t in enumerate(runs[i]) if t in eos), MAX_NEW_TOKENS)
        assert new == runs[i][:cut], (name, i, new, runs[i])
        expected[f"greedy_{i}"] = new
        expected[f"greedy_eos_{i}"] = new[-1] in eos
    stop = len(expected["greedy_0"])
    assert expected["greedy_eos_0"] and EOS_WINDOW[0] <= stop - 1 <= EOS_WINDOW[1], stop
    full = prompt_ids[0] + cont_ids
    logp = torch.log_softmax(forward_logits(ref, full), dim=-1)
    P = len(prompt_ids[0])
    expected["continuation"] = CONTINUATION
    expected["continuation_ids"] = cont_ids
    expected["continuation_logprobs"] = [float(logp[P - 1 + j, t]) for j, t in enumerate(cont_ids)]
    long_ids = (prompt_ids[0] + runs[0])[:LONG_LEN]
    np.save(folder / "long_logits.npy", forward_logits(ref, long_ids).numpy().astype(np.float32))
    expected["long_ids"] = long_ids
    (folder / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{name}: seed {seed}, eos {eos}, stops at {stop}, min gap {min_gap:.4f}, {size / 1e3:.0f} KB")


def main(names) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    for name in names or FAMILIES:
        write(name)


if __name__ == "__main__":
    main(sys.argv[1:])
