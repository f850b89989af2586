"""Greedy decoding of a SmolLM-135M-shaped Llama: jaxdecode against Hugging Face ``generate`` on
the same weights, in one run.

    python -m benchmarks.bench_hf_llama                              # batches 1,8; 128 new tokens
    python -m benchmarks.bench_hf_llama --batches 1 -n 64 --rounds 1 --json

The model has SmolLM-135M's shape: 30 layers, hidden 576, 9 query heads and 3 key/value heads
(head_dim 64), a SwiGLU MLP of 1536, vocabulary 49152, embeddings tied to the output layer,
rope_theta 10000, max_position_embeddings 2048, rms_norm_eps 1e-5: 106.2M parameters in the
layers plus 28.3M in the embedding (134.5M in all). Its weights are random (transformers'
initialisation, std 0.02; no checkpoint can be downloaded here), saved once in float32 with
``save_pretrained`` next to a copy of ``tests/fixtures/hf/llama/tokenizer.json`` (a 400-token BPE;
the model's vocabulary is larger, which jaxdecode allows) under ``--folder`` (default
``~/.cache/jaxdecode-bench/llama106m``). The folder is written by the Hugging Face environment
(``--hf-python``, default ``/work/hfvenv/bin/python`` or ``.venv-hf/bin/python``: torch and
transformers are never dependencies of jaxdecode).

Both sides decode greedily a fixed number of new tokens (``-n``, default 128) after the same
prompts: row ``b`` of a batch is ``--prompt-len`` (32) random token ids from [4, 400) (seed 0),
the same rows for every batch size, and no end token stops a row.

- jaxdecode: ``lm = jaxdecode.load(folder)``, then
  ``jaxdecode.decoding.sampling.sample_tokens(lm.decoder, lm.params, prompts, n, PRNGKey(0), greedy=True)``
  (prefill and the token-level loop, no stops), float32.
- Hugging Face: ``AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)`` (default
  attention, ``sdpa``), ``eval()``, under ``torch.no_grad()``,
  ``generate(input_ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)``
  with its default KV cache, at the fastest of the torch thread counts ``--threads`` (default:
  every core, and one) for each batch. It runs in its own process, which answers one
  ``generate`` per request and times it there. On a machine whose cores other work also uses,
  torch's threads wait for each other at every operation and one thread can be several times
  faster.

Every setting is run once to compile / warm up, then ``--rounds`` (3) timed rounds take one run of
each setting in turn (jaxdecode and HF alternate, so that a slow phase of a shared machine hits
both alike); the median counts. Rates are new tokens per second, the prefill included.

Greedy agreement: row 0's tokens of both sides must agree for at least the first
``--agree`` (16) tokens; the first position where they differ is reported (random weights have
near-ties, and a different float summation order may flip one, after which the texts diverge).

Bandwidth bound: the machine's read bandwidth is measured in the same run (a sum over a 1 GiB
float32 array, numpy and jitted ``jnp.sum``, best of 3 each, the larger counts). A decode step
reads every float32 parameter once: the 30 layers (attention, MLP and norm weights), the final
norm and the 49152 x 576 embedding matrix, counted once, as the output layer (the input lookup
reads only B of its rows). The KV cache is not counted (at most ~7 MB per row at this context).
The bound is ``B * bandwidth / bytes`` tokens per second (batch 1 is the meaningful row; larger
batches approach the compute bound first).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

import jaxdecode
from benchmarks import harness as H
from benchmarks.harness import cpu_name, read_bandwidth  # noqa: F401 (bench_llamacpp reads them here too)
from jaxdecode.decoding import sampling as S

ROOT = H.ROOT
PEERS = Path(__file__).resolve().parent / "peers"
TOKENIZER = ROOT / "tests" / "fixtures" / "hf" / "llama" / "tokenizer.json"
DEFAULT_FOLDER = Path.home() / ".cache" / "jaxdecode-bench" / "llama106m"
HF_PYTHONS = (Path("/work/hfvenv/bin/python"), ROOT / ".venv-hf" / "bin" / "python", ROOT / ".venv-torch" / "bin" / "python")
SHAPE = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
         "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
         "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "hidden_act": "silu", "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
         "pad_token_id": 3}
TOKEN_RANGE = (4, 400)  # ordinary tokens of the 400-token tokenizer

BUILD = PEERS / "hf_llama_build.py"  # run by the Hugging Face environment
HF_PEER = PEERS / "hf_llama_server.py"  # run by the Hugging Face environment


def build_folder(folder: Path, hf_python: str) -> None:
    """Write the model folder once (kept for later runs)."""
    if all((folder / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return
    folder.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    out = subprocess.run([hf_python, str(BUILD), str(folder), str(TOKENIZER), json.dumps(SHAPE)],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"building {folder} failed:\n{out.stderr[-2000:]}")
    print(f"# wrote {folder} ({out.stdout.strip()}) in {time.perf_counter() - t:.0f} s", file=sys.stderr)


class HF(H.Peer):
    """The Hugging Face side, in its own process."""

    def __init__(self, python: str, folder: Path, prompts_file: Path, n: int):
        super().__init__([python, str(HF_PEER), str(folder), str(prompts_file), str(n)], "the Hugging Face process")

    def generate(self, B: int, threads: int) -> dict:
        return json.loads(self.ask(f"{B} {threads}"))


def jax_generate(lm, prompts, n: int) -> tuple[float, np.ndarray]:
    t = time.perf_counter()
    res = S.sample_tokens(lm.decoder, lm.params, prompts, n, jax.random.PRNGKey(0), greedy=True)
    return time.perf_counter() - t, res.tokens


def step_bytes(params) -> tuple[int, int]:
    """Parameter bytes read per decode step (every parameter once; the tied embedding once, as
    the output layer: on the native path, which keeps a packed copy of it as ``head``, the lookup
    table is not counted), and the number of parameters."""
    leaves = jax.tree_util.tree_leaves({k: v for k, v in params.items() if k != "embed"} if "head" in params
                                       else params)
    return sum(int(a.size) * a.dtype.itemsize for a in leaves), sum(int(a.size) for a in leaves)


def first_difference(a, b) -> int | None:
    """The first position where two token lists differ (None: equal over the shorter)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", type=Path, default=DEFAULT_FOLDER, help="the model folder (built if absent)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("-n", type=int, default=128, help="new tokens per row")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (the median counts)")
    ap.add_argument("--threads", default=None,
                    help="torch thread counts to try; HF runs at the fastest for each batch (default: every "
                         "core, and 1)")
    ap.add_argument("--agree", type=int, default=16, help="row 0's first tokens that must agree")
    ap.add_argument("--hf-python", default=next((str(p) for p in HF_PYTHONS if p.exists()), None))
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    args = ap.parse_args()
    if not args.hf_python:
        ap.error("no Hugging Face environment found: give --hf-python")
    batches = [int(b) for b in args.batches.split(",")]
    n = args.n
    progress = sys.stderr if args.json else sys.stdout  # --json keeps stdout for the JSON
    log = lambda *a: print(*a, file=progress, flush=True)
    started = time.perf_counter()
    load_start = H.load()[0]

    build_folder(args.folder, args.hf_python)
    rng = np.random.default_rng(0)
    rows = rng.integers(*TOKEN_RANGE, size=(max(batches), args.prompt_len)).astype(np.int32)
    prompts_file = args.folder / f"prompts-{rows.shape[0]}x{rows.shape[1]}.json"
    prompts_file.write_text(json.dumps(rows.tolist()))

    lm = jaxdecode.load(args.folder)
    nbytes, nparams = step_bytes(lm.params)
    machine = H.machine()
    hf = HF(args.hf_python, args.folder, prompts_file, n)
    machine["hf"] = hf.info
    log(f"# {H.describe(machine)}; torch {hf.info['torch']}, transformers {hf.info['transformers']}, "
        f"attention {hf.info['attention']}")
    log(f"# {args.folder}: {nparams / 1e6:.1f}M float32 parameters, {nbytes / 1e6:.0f} MB read per step")

    prompts = {B: [rows[b] for b in range(B)] for B in batches}
    warm, threads, tokens = {}, {}, {}
    arms = H.Arms()
    try:
        for B in batches:  # compile / warm up; HF's fastest thread count
            t = time.perf_counter()
            jax_generate(lm, prompts[B], n)
            jax_first = time.perf_counter() - t
            threads[B] = H.best_threads(lambda k, B=B: hf.generate(B, k)["seconds"], H.thread_counts(args.threads))
            warm[B] = jax_first
            log(f"# batch {B}: jaxdecode first call (compiling) {jax_first:.1f} s; HF fastest on "
                f"{threads[B]['threads']} thread(s)")

            def ours(B=B):
                s, toks = jax_generate(lm, prompts[B], n)
                tokens.setdefault(B, [None, None])[0] = toks
                return s

            def theirs(B=B):
                out = hf.generate(B, threads[B]["threads"])
                tokens.setdefault(B, [None, None])[1] = np.asarray(out["tokens"], np.int32)
                return out["seconds"]

            arms.add((B, "jaxdecode"), ours, timed_by_itself=True)
            arms.add((B, "hf"), theirs, timed_by_itself=True)
        arms.run(args.rounds, log=log)
    finally:
        hf.close()
    times = {B: {side: arms.record((B, side))["seconds"] for side in ("jaxdecode", "hf")} for B in batches}
    bandwidth = read_bandwidth()
    bw = max(bandwidth.values())

    results = []
    for B in batches:
        jt, ht = statistics.median(times[B]["jaxdecode"]), statistics.median(times[B]["hf"])
        jr, hr = B * n / jt, B * n / ht
        bound = B * bw / nbytes
        jt_, ht_ = tokens[B]
        diff0 = first_difference(jt_[0].tolist(), ht_[0].tolist())
        rows_same = int(sum(np.array_equal(jt_[b], ht_[b]) for b in range(B)))
        results.append({"batch": B, "jaxdecode_tok_s": jr, "hf_tok_s": hr, "ratio": jr / hr,
                        "jaxdecode_ms_per_step": 1e3 * jt / n, "hf_ms_per_step": 1e3 * ht / n,
                        "bound_tok_s": bound, "jaxdecode_of_bound": jr / bound, "hf_of_bound": hr / bound,
                        "jaxdecode_seconds": times[B]["jaxdecode"], "hf_seconds": times[B]["hf"],
                        "jaxdecode_first_call_s": warm[B], "hf_threads": threads[B],
                        "runs": {side: arms.record((B, side)) for side in ("jaxdecode", "hf")},
                        "row0_first_difference": diff0,
                        "row0_agrees_first": diff0 is None or diff0 >= args.agree,
                        "rows_identical": rows_same})
    elapsed = time.perf_counter() - started
    doc = {"machine": machine, "folder": str(args.folder), "parameters": nparams, "bytes_per_step": nbytes,
           "read_bandwidth": bandwidth, "n": n, "prompt_len": args.prompt_len, "rounds": args.rounds,
           "agree": args.agree, "results": results, "wall_s": elapsed,
           "load_average": {"start": load_start, "end": H.load()[0]},
           "command": H.command("benchmarks.bench_hf_llama")}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print("# read bandwidth (1 GiB float32): "
          + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bandwidth.items())
          + f"; bound = batch x {bw / 1e9:.1f} GB/s / {nbytes / 1e6:.0f} MB per step")
    print(f"# {n} new tokens after {args.prompt_len}-token prompts, greedy, median of {args.rounds}; "
          "ms/step = seconds / n (prefill included)")
    print("| machine | batch | jaxdecode tok/s | HF tok/s | ratio | jaxdecode ms/step | HF ms/step "
          "| jaxdecode % of bw bound | HF % of bw bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    where = f"{machine['cpu']}, {machine['cores']} cores"
    for r in results:
        print(f"| {where} | {r['batch']} | {r['jaxdecode_tok_s']:.1f} | {r['hf_tok_s']:.1f} "
              f"| {r['ratio']:.2f}x "
              f"| {r['jaxdecode_ms_per_step']:.1f} | {r['hf_ms_per_step']:.1f} "
              f"| {r['jaxdecode_of_bound']:.0%} | {r['hf_of_bound']:.0%} |")
    for r in results:
        d = r["row0_first_difference"]
        same = "identical" if d is None else f"first difference at new token {d}"
        verdict = "OK" if r["row0_agrees_first"] else f"DISAGREE within the first {args.agree}"
        print(f"# greedy agreement, batch {r['batch']}: row 0 {same} ({verdict}); "
              f"{r['rows_identical']}/{r['batch']} rows identical over {n} tokens")
    print(f"# the run took {elapsed:.0f} s; load average {load_start:.2f} at start, "
          f"{H.load()[0]:.2f} at end")


if __name__ == "__main__":
    main()
