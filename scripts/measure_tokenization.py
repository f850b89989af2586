"""How often an output's tokens are not the tokenizer's own (canonical) encoding of its text:
constrained sampling against unconstrained sampling on the same model, prompts and seeds.

    .venv/bin/python scripts/measure_tokenization.py [--ckpt FOLDER] [--samples 256] [-n 24]

A byte-level BPE tokenizer encodes a text one way; a sampler can spell the same text with other
tokens (``"th" + "e"`` instead of ``"the"``). Masking steers the model token by token, so it may
pick such spellings more often than the model does on its own. For each pattern, the share of
samples whose token sequence (end token removed) differs from ``encode(text)``, for masked sampling
under the pattern and for plain sampling (the model's own rate). Default model: the tiny random
Llama of ``tests/fixtures/hf/llama`` (random weights: a trained model's own rate is far lower,
run it with ``--ckpt`` on one).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import jaxdecode
from jaxdecode import constraints as C

ROOT = Path(__file__).resolve().parent.parent
PATTERNS = (r"(yes|no|maybe)", r"[a-z]+( [a-z]+){1,3}", r"[0-9]{1,4}(\.[0-9]{1,2})?", r"café|日本語|🙂+")


def noncanonical(lm, outs) -> float:
    ends = set(lm.eos_ids)
    bad = sum(lm.vocab.encode_piece(o.text).tolist() != [int(t) for t in o.tokens if int(t) not in ends]
              for o in outs)
    return bad / len(outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=str(ROOT / "tests" / "fixtures" / "hf" / "llama"))
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("-n", type=int, default=24)
    ap.add_argument("--prompt", default="ROMEO:")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lm = jaxdecode.load(args.ckpt)
    plain = jaxdecode.generate(lm, args.prompt, n=args.n, num_samples=args.samples, seed=0)
    rows = [{"pattern": "(none: plain sampling)", "noncanonical": noncanonical(lm, plain)}]
    for pattern in PATTERNS:
        c = C.compile_regex(pattern, lm.vocab)
        outs = jaxdecode.generate(lm, args.prompt, n=args.n, constraint=c, num_samples=args.samples, seed=0)
        rows.append({"pattern": pattern, "noncanonical": noncanonical(lm, outs),
                     "ended_by_eos": sum(o.finish_reason == "eos" for o in outs) / len(outs)})
    if args.json:
        print(json.dumps({"checkpoint": args.ckpt, "samples": args.samples, "n": args.n, "rows": rows}, indent=2))
        return
    print(f"{args.ckpt}: {args.samples} samples of {args.n} tokens after {args.prompt!r}")
    print("| pattern | non-canonical tokenization | ended by the end token |\n|---|---:|---:|")
    for r in rows:
        eos = f"{r['ended_by_eos']:.1%}" if "ended_by_eos" in r else "–"
        print(f"| `{r['pattern']}` | {r['noncanonical']:.1%} | {eos} |")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
