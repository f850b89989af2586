"""Weight-only int4 in groups of 32 along the input dimension: symmetric (one float16 scale per
group, llama.cpp's Q4_0 rounding) against a zero point (a float16 scale and least value per group,
llama.cpp's Q4_1), beside float32 and int8, by held-out loss.

    JAXDECODE_DATA=tinyshakespeare.txt .venv/bin/python tools/int4_layouts.py [--ckpt shakespeare-bpe]

As in tools/int8_layouts.py, every matrix of the layers and the output layer is quantized and
dequantized back to float32, and the model runs on the portable path, so the arms differ only in
the rounding. The loss is ``jaxdecode eval``'s (nats per character over the held-out windows).
"""

from __future__ import annotations

import argparse

import jaxdecode
from jaxdecode.io import data as data_lib
from jaxdecode.models.hf import linear
from jaxdecode.models.hf.train import held_out_loss
from tools.int8_layouts import per_column, rounded


def symmetric(w):
    return linear.dequantize4(*linear.quantize4(w))


def zero_point(w):
    return linear.dequantize4(*linear.quantize4(w, zero_point=True))


ARMS = (("int8, a scale per column (8 bits a weight)", per_column),
        ("int4 symmetric, a float16 scale per 32 (4.5 bits)", symmetric),
        ("int4 with a zero point, float16 scale and low per 32 (5 bits)", zero_point))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default="shakespeare-bpe", help="a Hugging Face folder or shipped name")
    ap.add_argument("--windows", type=int, default=96)
    args = ap.parse_args()
    lm = jaxdecode.load(args.ckpt, backend="portable", weights="float32")
    if lm.meta.get("format") != "huggingface":
        raise SystemExit(f"{args.ckpt} is not a Hugging Face model (int4 weights are for those)")
    text = data_lib.read_corpus(None)
    base, n = held_out_loss(lm, text, count=args.windows)
    print(f"float32: {base:.6f} nats per character ({n} windows)")
    for name, fn in ARMS:
        loss, _ = held_out_loss(rounded(lm, fn), text, count=args.windows)
        print(f"{name}: {loss:.6f} (+{loss - base:.6f})")


if __name__ == "__main__":
    main()
