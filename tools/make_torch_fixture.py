"""Build the PyTorch reference fixtures used by ``tests/models/test_checkpoint.py``.

The book's character model is defined below in PyTorch with the same module layout (and hence
the same ``state_dict`` names) as the book's ``CharLM``, at a tiny size. The script writes:

- ``tests/fixtures/book_tiny.pt``: ``torch.save`` of ``{"config", "chars", "state_dict"}``, the
  dict layout of the book's checkpoint;
- ``tests/fixtures/book_tiny_logits.npz``: a few fixed token inputs (``input_<n>``, int64,
  shape ``[1, n]``) and the logits torch computes for them (``logits_<n>``, float32,
  ``[1, min(n, T), V]``). One input is longer than ``T`` to pin down the keep-the-last-T-tokens
  behaviour of the forward.

The tests themselves never import torch. To regenerate the fixtures (deterministic for a given
torch version; the committed ones were made with torch 2.13.0 on CPU)::

    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch==2.13.0 numpy
    /tmp/torchvenv/bin/python tools/make_torch_fixture.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

CHARS = " abcdefghi.\n"
CONFIG = {"V": len(CHARS), "T": 16, "d": 32, "L": 2, "heads": 4}
INPUT_LENGTHS = (1, 7, CONFIG["T"], CONFIG["T"] + 5)
SEED = 1234

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


class CharLM(nn.Module):
    """Character transformer laid out like the book's model (attribute names fix the state_dict keys)."""

    def __init__(self, V: int, T: int, d: int, L: int, heads: int):
        super().__init__()
        self.T = T
        self.tok = nn.Embedding(V, d)
        self.pos = nn.Embedding(T, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, L, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, V, bias=False)
        self.out.weight = self.tok.weight  # output projection shares the token embedding
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, -self.T:]  # the model only ever sees its last T tokens
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.out(self.ln(h))


def build_model() -> CharLM:
    torch.manual_seed(SEED)
    model = CharLM(**CONFIG)
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        # Default init leaves several tensors at exactly 0 or 1 (LayerNorm, attention biases),
        # which would hide a mix-up between them; move every tensor off its default. The
        # embeddings are scaled down so that logits stay of order one.
        for name, p in model.named_parameters():  # the tied weight is listed once, as tok.weight
            noise = torch.randn(p.shape, generator=gen)
            if name in ("tok.weight", "pos.weight"):
                p.copy_(0.25 * noise)
            elif p.ndim == 1 and name.endswith("weight"):  # LayerNorm gains
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.add_(0.1 * noise)
    assert model.out.weight is model.tok.weight
    return model.eval()


def fixed_inputs(V: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(SEED)
    return {n: rng.integers(0, V, size=(1, n), dtype=np.int64) for n in INPUT_LENGTHS}


def main() -> None:
    torch.use_deterministic_algorithms(True)
    model = build_model()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    torch.save({"config": dict(CONFIG), "chars": list(CHARS), "state_dict": model.state_dict()},
               OUT_DIR / "book_tiny.pt")

    arrays = {}
    with torch.no_grad():
        for n, tokens in fixed_inputs(CONFIG["V"]).items():
            logits = model(torch.from_numpy(tokens)).numpy().astype(np.float32)
            assert logits.shape == (1, min(n, CONFIG["T"]), CONFIG["V"])
            arrays[f"input_{n}"] = tokens
            arrays[f"logits_{n}"] = logits
            print(f"n={n:3d}  logits shape {logits.shape}  max |logit| {np.abs(logits).max():.2f}")
    np.savez(OUT_DIR / "book_tiny_logits.npz", **arrays)
    for f in ("book_tiny.pt", "book_tiny_logits.npz"):
        print(f"wrote {OUT_DIR / f} ({(OUT_DIR / f).stat().st_size} bytes)")


if __name__ == "__main__":
    main()
