"""transformers' outputs on folders that ``jaxdecode train --arch llama`` wrote, as test fixtures.

For each folder given, transformers loads it as any Hugging Face checkpoint (``AutoTokenizer``,
``AutoModelForCausalLM`` in float32 with eager attention) and this script writes, under
``--out`` as ``<name>.json`` and ``<name>.npz``:

- the token ids its tokenizer gives each prompt of ``PROMPTS``, and the float32 logits of one
  forward over each (``logits_<i>``);
- 40 greedy tokens after each prompt from ``model.generate`` (stopping at the folder's end token)
  and the smallest top-1/top-2 logit gap along them;
- ``apply_chat_template`` of each conversation of ``CONVERSATIONS``, with and without the
  generation prompt, as text and as token ids, and the error a refused conversation raises;
- the library versions used.

torch and transformers are never dependencies of the library or its tests: run this in a
separate virtual environment (the committed fixtures were made with torch 2.13.0 CPU and
transformers 5.25)::

    jaxdecode train tests/fixtures/bpe/llama --arch llama --data tests/fixtures/bpe/speeches.txt \\
        --d 32 --layers 2 --heads 4 --kv-heads 2 --T 64 --batch 4 --steps 200 --warmup 10 \\
        --vocab-size 300 --eval-every 100 --eval-windows 4 --lr 1e-2 --quiet
    rm tests/fixtures/bpe/llama/train_*
    .venv-torch/bin/python tools/make_bpe_fixtures.py tests/fixtures/bpe/llama --out tests/fixtures/bpe
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

PROMPTS = ["ROMEO:\n", "JULIET:\nThe night", "NURSE:\nGood morrow, friar; ", "Wherefore art thou"]
CONVERSATIONS = [
    [{"role": "user", "content": "What light through yonder window breaks?"}],
    [{"role": "user", "content": "Good night."}, {"role": "assistant", "content": "Parting is such sweet sorrow."},
     {"role": "user", "content": "Then stay."}],
    [{"role": "user", "content": "Who is there?", "name": "NURSE"}],
]
REFUSED = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Speak."}]
NEW_TOKENS = 40


def reference(folder: Path) -> tuple[dict, dict]:
    import tokenizers
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    eos = model.generation_config.eos_token_id
    meta = {"folder": folder.name, "prompts": PROMPTS, "prompt_ids": [], "greedy": [], "min_gap": [],
            "eos_token_id": eos, "chat": [], "versions": {
                "torch": torch.__version__, "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__}}
    arrays = {}
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ids = tok(prompt, add_special_tokens=True)["input_ids"]
            meta["prompt_ids"].append(ids)
            x = torch.tensor([ids])
            arrays[f"logits_{i}"] = model(x).logits[0].float().numpy()
            out = model.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos, output_scores=True, return_dict_in_generate=True)
            new = out.sequences[0, len(ids):].tolist()
            meta["greedy"].append(new)
            gaps = [float(np.diff(np.sort(s[0].numpy())[-2:])[0]) for s in out.scores]
            meta["min_gap"].append(min(gaps))
    for conv in CONVERSATIONS:
        row = {"messages": conv}
        for gen in (False, True):
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen, return_dict=False)
            row[f"text_{'gen' if gen else 'plain'}"] = text
            row[f"ids_{'gen' if gen else 'plain'}"] = list(ids)
        meta["chat"].append(row)
    try:
        tok.apply_chat_template(REFUSED, tokenize=False)
        meta["refused"] = None
    except Exception as e:  # jinja2's TemplateError from raise_exception
        meta["refused"] = {"messages": REFUSED, "error": str(e)}
    return meta, arrays


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for folder in args.folders:
        meta, arrays = reference(folder)
        (args.out / f"{folder.name}.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
        np.savez_compressed(args.out / f"{folder.name}.npz", **arrays)
        print(f"wrote {args.out / folder.name}.json/.npz: gaps {[round(g, 4) for g in meta['min_gap']]}")


if __name__ == "__main__":
    main()
