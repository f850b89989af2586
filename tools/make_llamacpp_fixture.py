"""Writes tests/fixtures/gguf/: the shipped draft model (checkpoints/shakespeare-bpe-draft, 1.0M
parameters) as a Q4_0 GGUF file made by llama.cpp itself (its ``convert_hf_to_gguf.py`` to F32,
then its quantizer), and what llama.cpp computes from that file: the ids its tokenizer gives a
held-out text, and the most probable next token at every position of that text (teacher-forced,
windows of 256 tokens, the model's context), with the lead of the top logit over the second.
tests/models/test_gguf.py holds jaxdecode's loading of the file to both.

    JAXDECODE_DATA=tinyshakespeare.txt python -m tools.make_llamacpp_fixture

It needs what benchmarks/bench_int4.py needs: the torch environment (``.venv-torch``, for the
converter) and the llama.cpp one (made on the first run). About 0.65 MB are written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from benchmarks import bench_int4 as B
from benchmarks.bench_llamacpp import SDIST, LlamaCpp
from jaxdecode.io import data

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "checkpoints" / "shakespeare-bpe-draft"
OUT = ROOT / "tests" / "fixtures" / "gguf"
WINDOWS, LENGTH = 4, 256


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-python", default=str(B.TORCH_PYTHON))
    ap.add_argument("--llamacpp-venv", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.sdist = SDIST
    python = B.llama_env(args)
    files = B.gguf_files(args, python, MODEL, ("Q4_0",))
    held = data.split(data.read_corpus())[1]
    text = held[: 6 * WINDOWS * LENGTH]
    peer = LlamaCpp(python, {"Q4_0": files["Q4_0"]}, os.cpu_count() or 1, LENGTH, "f32", "unset", 10000, "off")
    try:
        ids = peer.ask(op="tokenize", arm="Q4_0", text=text)["tokens"]
        if len(ids) < WINDOWS * LENGTH:
            raise SystemExit(f"the text gives {len(ids)} tokens, fewer than {WINDOWS * LENGTH}")
        windows = [ids[i * LENGTH:(i + 1) * LENGTH] for i in range(WINDOWS)]
        answers = [peer.ask(op="argmax", arm="Q4_0", tokens=w) for w in windows]
    finally:
        peer.close()
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = args.out / "shakespeare-bpe-draft-q4_0.gguf"
    shutil.copyfile(files["Q4_0"]["path"], gguf)
    doc = {"file": gguf.name, "made_by": f"llama-cpp-python {peer.info['llama_cpp']}: convert_hf_to_gguf.py "
                                          "--outtype f32, then llama_model_quantize to Q4_0",
           "tensor_types": B.tensor_types(str(gguf)),
           "text": text, "tokens": ids,
           "windows": windows, "argmax": [a["argmax"] for a in answers],
           "lead": [[round(g, 5) for g in a["gap"]] for a in answers]}
    (args.out / "shakespeare-bpe-draft-q4_0.llamacpp.json").write_text(json.dumps(doc) + "\n")
    print(f"wrote {gguf} ({gguf.stat().st_size} bytes) and what llama.cpp computes from it")


if __name__ == "__main__":
    main()
