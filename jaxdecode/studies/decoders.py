"""The chapter's decoder comparison: the human continuation, greedy, beam search and sampling
after the KATHARINA prompt, each scored by the model's mean log-probability per character."""

from __future__ import annotations

import json
from pathlib import Path

from .. import data as data_lib
from ..beam import beam_generate
from ..sampling import generate
from ..score import score_texts

PROMPT = "KATHARINA:\nMoved! in good time: "


def compare(lm, text: str, prompt: str = PROMPT, n: int = 120, k: int = 5, seed: int = 0) -> dict:
    """Four continuations of ``prompt`` of ``n`` characters; ``text`` is the corpus that holds
    the human continuation (the prompt must occur in it)."""
    at = text.find(prompt)
    if at < 0:
        raise ValueError(f"the prompt {prompt!r} does not occur in the corpus")
    human = text[at + len(prompt):at + len(prompt) + n]
    outputs = {
        "human": human,
        "greedy": generate(lm, prompt, n, greedy=True)[0].text,
        f"beam, k={k}": beam_generate(lm, prompt, n, k)[0][0].text,
        "sampling": generate(lm, prompt, n, seed=seed)[0].text,
    }
    scores = score_texts(lm, list(outputs.values()), [prompt] * len(outputs))
    return {"prompt": prompt, "n": n, "seed": seed,
            "rows": [{"decoder": name, "mean_logprob": s.mean_logprob, "text": t}
                     for (name, t), s in zip(outputs.items(), scores)]}


def run(lm, out_dir, data_path=None, n: int = 120, k: int = 5, seed: int = 0) -> dict:
    """Writes ``decoders.json`` into ``out_dir``."""
    result = compare(lm, data_lib.read_corpus(data_path), n=n, k=k, seed=seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decoders.json").write_text(json.dumps(result, indent=2, ensure_ascii=False), encoding="utf-8")
    return result
