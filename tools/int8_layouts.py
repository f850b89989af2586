"""Weight-only int8: one scale per output column (what ``--weights int8`` keeps) against one per
block of 32 weights along the sum (llama.cpp's Q8_0 layout), by held-out loss.

    JAXDECODE_DATA=tinyshakespeare.txt .venv/bin/python tools/int8_layouts.py [--ckpt shakespeare-bpe]

Every matrix of the layers and the output layer is quantized both ways and dequantized back to
float32, and the model runs on the portable path, so the two arms differ only in the rounding.
The loss is ``jaxdecode eval``'s (nats per character over the held-out windows).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np

import jaxdecode
from jaxdecode.io import data as data_lib
from jaxdecode.models.hf import linear
from jaxdecode.models.hf.train import held_out_loss


def per_column(w: np.ndarray) -> np.ndarray:
    q, s = linear.quantize(w)
    return q.astype(np.float32) * s


def per_block(w: np.ndarray, block: int = 32) -> np.ndarray:
    K, N = w.shape
    if K % block:
        raise SystemExit(f"a matrix has {K} input rows, not a multiple of {block}")
    b = w.reshape(K // block, block, N)
    s = np.abs(b).max(axis=1, keepdims=True) / 127.0
    s = np.where(s > 0, s, 1.0)
    return (np.clip(np.rint(b / s), -127, 127) * s).reshape(K, N).astype(np.float32)


def rounded(lm, fn):
    """``lm`` with every matrix through ``fn`` (the output layer made a matrix of its own)."""
    layers = []
    for p in lm.params["layers"]:
        p = dict(p)
        for k in linear.MATRICES:
            if k in p:
                p[k] = jnp.asarray(fn(np.asarray(p[k], np.float32)))
        layers.append(p)
    head = lm.params.get("head")
    head = np.asarray(lm.params["embed"], np.float32).T if head is None else np.asarray(head, np.float32)
    return dataclasses.replace(lm, params=dict(lm.params, layers=tuple(layers), head=jnp.asarray(fn(head))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default="shakespeare-bpe", help="a Hugging Face folder or shipped name")
    ap.add_argument("--windows", type=int, default=96)
    args = ap.parse_args()
    lm = jaxdecode.load(args.ckpt, backend="portable", weights="float32")
    if lm.meta.get("format") != "huggingface":
        raise SystemExit(f"{args.ckpt} is not a Hugging Face model (int8 weights are for those)")
    text = data_lib.read_corpus(None)
    for name, model in (("float32", lm), ("int8, a scale per column", rounded(lm, per_column)),
                        ("int8, a scale per block of 32", rounded(lm, per_block))):
        loss, n = held_out_loss(model, text, count=args.windows)
        print(f"{name}: {loss:.6f} nats per character ({n} windows)")


if __name__ == "__main__":
    main()
