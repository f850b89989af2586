"""int4 beside llama.cpp's 4-bit files on the 106M Llama, each side timed alone; and llama.cpp's
own GGUF files (Q8_0, Q4_0) loaded by jaxdecode, their top-1 tokens against llama.cpp's.

    python -m benchmarks.bench_int4                      # 5 rounds; writes benchmarks/results/bench_int4.json
    python -m benchmarks.bench_int4 --rounds 1 -n 16 --out /tmp/int4.json   # a smoke run

The model is ``benchmarks/bench_hf_llama.py``'s (SmolLM-135M's shape, random float32 weights, the
400-token BPE of the test fixtures), written once into ``--folder`` by the torch environment
(``--torch-python``, default ``.venv-torch/bin/python``), which also runs llama.cpp's converter.

Arms: jaxdecode ``load(folder, backend="native", weights="int8")`` (one float32 scale per column)
and ``weights="int4"`` (groups of 32 with a float16 scale: Q4_0's layout, rounded from the
float32 weights), the output layer included, the embedding lookup in float32; llama.cpp Q4_0 and
Q4_K_M, quantized by llama.cpp's ``llama_model_quantize`` (what ``llama-quantize`` runs) from the
F32 file that its ``convert_hf_to_gguf.py`` writes (``benchmarks/bench_llamacpp.py`` says how the
converter is run; its output layer is the tied embedding, which the quantizer keeps at more bits,
Q8_0 here, and a matrix whose rows are not a multiple of 256 falls back from Q4_K to another
type, Q5_0 here). llama.cpp runs as in ``bench_llamacpp.py`` (its ``LlamaCpp`` peer: KV cache f32, flash
attention off, ``GOMP_SPINCOUNT=10000``), at the faster of ``--threads`` (default: every core,
and one) for each arm and measurement, chosen in each of its processes by one timed call of each
after the warm-up.

Measured, each arm alike:

- prompt 128: one forward over 128 random token ids at batch 1 into an empty cache, the logits
  of the last position only (``bench_llamacpp.py``'s "pp");
- batch 1: 128 (``-n``) greedy tokens after a 32-token prompt, the prefill included; and decoding
  alone (the steps after the prefill and the first token).

Each side alone: a round starts one llama.cpp process (every arm of that side loaded, warmed up,
its thread counts chosen, then each measurement once) and lets it end, then one jaxdecode process
(``--worker``: both arms loaded, compiled and warmed up, then each measurement once) and lets it
end; the next round starts with the other side. ``--rounds`` (5) rounds; the median counts. The
load average is recorded before and after every measurement.

The GGUF check (``--no-check`` leaves it out): llama.cpp's converter writes Q8_0 directly
(``--outtype q8_0``); Q4_0 is its quantizer's file, as above. jaxdecode loads each file
(``jaxdecode/models/gguf.py``: Q4_0 as int4 with the file's own nibbles and scales, Q6_K and Q8_0
rounded once to int8 per column; Q8_0 also widened to float32 with ``weights="float32"``, the
file's values exactly) and computes the logits of every position of a held-out text (the
corpus's last tenth from its start, by the model's tokenizer, teacher-forced); llama.cpp computes
the same positions from the same file. Two models: the 106M Llama (one window of 512 tokens) and
the shipped subword model, ``checkpoints/shakespeare-bpe`` (trained; 8 windows of 256, its
context), converted and quantized the same way. Reported: the share of positions whose most
probable next token is the same, and llama.cpp's lead of its top logit over its second at the
positions that differ. llama.cpp rounds the activations to 8 bits in every product with a
quantized matrix, jaxdecode keeps them in float32; where two logits are that close the top token
can differ, and random weights (logits of std ~0.5 over 49152 rows) have many such near-ties.

The llama.cpp environment (``--llamacpp-venv``, default ``~/.cache/jaxdecode-bench/venv-llamacpp``
or ``$JAXDECODE_LLAMACPP_VENV``) is made on the first run, llama.cpp built with every vector
extension of this CPU but AMX (``bench_llamacpp.LLAMA_CMAKE``, on a CPU with AMX: its AMX path
faults on this VM), which takes tens of minutes on 2 shared cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import harness as H

ROOT = H.ROOT
PEERS = Path(__file__).resolve().parent / "peers"
CACHE = Path.home() / ".cache" / "jaxdecode-bench"
FOLDER = CACHE / "llama106m"
TORCH_PYTHON = ROOT / ".venv-torch" / "bin" / "python"
# the llama.cpp environment (made there if absent; $JAXDECODE_LLAMACPP_VENV names another), built
# without AMX where the CPU has it (bench_llamacpp.llama_cmake)
LLAMA_VENV = Path(os.environ.get("JAXDECODE_LLAMACPP_VENV", CACHE / "venv-llamacpp"))
QUANTIZE = PEERS / "llamacpp_quantize.py"
SUBWORD = ROOT / "checkpoints" / "shakespeare-bpe"
PROMPT_LEN, PP_LEN, CHECK_LEN = 32, 128, 512
TOKEN_RANGE = (4, 400)
JAX_ARMS = ("int8", "int4")
LLAMA_ARMS = ("Q4_0", "Q4_K_M")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def inputs(n_pp=PP_LEN):
    """The 32-token prompt (bench_hf_llama.py's row 0) and the 128 prompt tokens."""
    rows = np.random.default_rng(0).integers(*TOKEN_RANGE, size=(8, PROMPT_LEN)).astype(np.int32)
    pp = np.random.default_rng(1).integers(*TOKEN_RANGE, size=(1, n_pp)).astype(np.int32)
    return rows[0], pp


# ----------------------------------------------------------------------------- jaxdecode's side


def worker(cfg: dict) -> dict:
    """One jaxdecode process's round: every arm loaded, compiled and warmed up, then each
    measurement once (the load around it recorded)."""
    import jax

    from benchmarks.bench_llamacpp import Jax

    prompt, pp = inputs()
    n, out = cfg["n"], {}
    arms = {name: Jax(Path(cfg["folder"]), name) for name in cfg["arms"]}
    for arm in arms.values():  # compile and warm up
        arm.gen([prompt], n), arm.gen([prompt], 1), arm.pp(pp), arm.pp(pp)
    for name, arm in arms.items():
        rec = {"bytes_per_step": arm.bytes}
        before = H.load()[0]
        rec["pp_s"] = arm.pp(pp)
        rec["pp_load"] = [before, H.load()[0]]
        before = H.load()[0]
        seconds, tokens = arm.gen([prompt], n)
        first, _ = arm.gen([prompt], 1)  # the prefill and the first token
        rec |= {"b1_s": seconds, "b1_decode_s": seconds - first, "b1_load": [before, H.load()[0]],
                "tokens": np.asarray(tokens)[0].tolist()}
        out[name] = rec
    return {"arms": out, "jax": jax.__version__}


def jax_round(args) -> dict:
    cfg = {"folder": str(args.folder), "n": args.n, "arms": list(JAX_ARMS)}
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench_int4", "--worker", json.dumps(cfg)],
                         capture_output=True, text=True, cwd=ROOT, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"the jaxdecode process failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- llama.cpp's side


def llama_env(args) -> str:
    from benchmarks.bench_llamacpp import ensure_llama_env, llama_cmake

    return ensure_llama_env(args.llamacpp_venv or LLAMA_VENV, args.sdist, log, llama_cmake())


def gguf_files(args, llama_python: str, folder: Path, quantized=LLAMA_ARMS) -> dict:
    """F32 and Q8_0 by llama.cpp's converter, ``quantized`` by its quantizer from the F32 file
    (each made once, again when older than the weights)."""
    from benchmarks.bench_llamacpp import convert

    files = convert(folder, os.path.abspath(args.torch_python), args.sdist, log,
                    kinds=[("F32", "f32"), ("Q8_0", "q8_0")])
    src = Path(files["F32"]["path"])
    for kind in quantized:
        path = src.with_name(f"{folder.name}-{kind.lower()}.gguf")
        cmd = [llama_python, str(QUANTIZE), str(src), str(path), kind, str(os.cpu_count() or 1)]
        if not path.exists() or path.stat().st_mtime < src.stat().st_mtime:
            tmp = path.with_suffix(".tmp")
            run = subprocess.run([*cmd[:3], str(tmp), *cmd[4:]], capture_output=True, text=True, cwd="/", check=False)
            if run.returncode != 0 or not tmp.exists():
                tmp.unlink(missing_ok=True)
                raise RuntimeError(f"quantizing {src} to {kind} failed:\n{run.stderr[-3000:]}")
            tmp.rename(path)
            log(f"# quantized to {path}")
        files[kind] = {"path": str(path), "bytes": path.stat().st_size, "command": " ".join(cmd)}
    return files


def tensor_types(path: str) -> dict:
    """How many tensors of each type a GGUF file holds."""
    import gguf

    counts: dict = {}
    for t in gguf.GGUFReader(path).tensors:
        name = gguf.GGMLQuantizationType(t.tensor_type).name
        counts[name] = counts.get(name, 0) + 1
    return counts


def llama_round(args, python: str, files: dict) -> dict:
    """One llama.cpp process's round: its arms warmed up, each arm's faster thread count chosen
    per measurement, then each measurement once."""
    from benchmarks.bench_llamacpp import LlamaCpp

    prompt, pp = inputs()
    n = args.n
    peer = LlamaCpp(python, {k: files[k] for k in LLAMA_ARMS}, max(H.thread_counts(args.threads)),
                    max(PP_LEN, PROMPT_LEN + n), "f32", "unset", 10000, "off")
    counts = H.thread_counts(args.threads)
    out = {"llama_cpp": peer.info["llama_cpp"], "system_info": peer.info["system_info"], "arms": {}}
    try:
        calls = {"pp": lambda arm: peer.ask(op="pp", arm=arm, tokens=pp[0].tolist())["seconds"],
                 "b1": lambda arm: peer.ask(op="gen", arm=arm, prompts=[prompt.tolist()], n=n)}
        chosen = {}
        for arm in LLAMA_ARMS:
            for kind, call in calls.items():
                def timer(k, arm=arm, call=call):
                    peer.ask(op="threads", arm=arm, threads=k)
                    res = call(arm)
                    return res if isinstance(res, float) else res["prefill_s"] + res["decode_s"]
                chosen[arm, kind] = H.best_threads(timer, counts)
        for arm in LLAMA_ARMS:
            rec = {"bytes_per_step": files[arm]["bytes"]}
            t = chosen[arm, "pp"]
            peer.ask(op="threads", arm=arm, threads=t["threads"])
            before = H.load()[0]
            rec |= {"pp_s": calls["pp"](arm), "pp_load": [before, H.load()[0]], "pp_threads": t}
            t = chosen[arm, "b1"]
            peer.ask(op="threads", arm=arm, threads=t["threads"])
            before = H.load()[0]
            res = calls["b1"](arm)
            rec |= {"b1_s": res["prefill_s"] + res["decode_s"], "b1_decode_s": res["decode_s"],
                    "b1_load": [before, H.load()[0]], "b1_threads": t, "tokens": res["tokens"][0]}
            out["arms"][arm] = rec
    finally:
        peer.close()
    return out


# ----------------------------------------------------------------------------- the GGUF check


def held_out_tokens(folder: Path, length: int) -> list[int]:
    """``length`` tokens of the corpus's held-out tenth, by the folder's tokenizer."""
    from tokenizers import Tokenizer

    from jaxdecode.io import data

    held = data.split(data.read_corpus())[1]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode(held[:20 * length]).ids
    if len(ids) < length:
        raise RuntimeError(f"the held-out text gives {len(ids)} tokens, fewer than {length}")
    return ids[:length]


def check(args, python: str, files: dict) -> dict:
    """Teacher-forced top-1 agreement between jaxdecode and llama.cpp on llama.cpp's own Q8_0 and
    Q4_0 files: of the 106M Llama (random weights: one window of 512 tokens) and of the shipped
    subword model (trained: 8 windows of 256, its context)."""
    import jax.numpy as jnp

    from benchmarks.bench_llamacpp import LlamaCpp
    from jaxdecode.models import checkpoint

    names = ("Q8_0", "Q4_0")
    models = [(args.folder, files, 1, CHECK_LEN)]
    if SUBWORD.exists():
        models.append((SUBWORD, gguf_files(args, python, SUBWORD, ("Q4_0",)), 8, 256))
    out = {}
    for folder, fs, windows, length in models:
        ids = np.asarray(held_out_tokens(folder, windows * length)).reshape(windows, length)
        peer = LlamaCpp(python, {k: fs[k] for k in names}, os.cpu_count() or 1, length, "f32", "unset", 10000, "off")
        try:
            theirs = {k: [peer.ask(op="argmax", arm=k, tokens=w.tolist()) for w in ids] for k in names}
        finally:
            peer.close()
        rec = {"positions": int(ids.size), "windows": windows,
               "text": "the corpus's held-out tenth from its start, in windows of consecutive tokens",
               "gguf_tensor_types": {k: tensor_types(fs[k]["path"]) for k in names}}
        for name in names:
            ref = np.concatenate([t["argmax"] for t in theirs[name]])
            gap = np.concatenate([t["gap"] for t in theirs[name]])
            for weights in (("auto", "float32") if name == "Q8_0" else ("auto",)):
                lm = checkpoint.load(fs[name]["path"], backend="native", weights=weights)
                logits, _ = lm.decoder.forward(lm.params, jnp.asarray(ids, jnp.int32))
                same = np.asarray(logits).argmax(-1).reshape(-1) == ref
                rec[f"{name}, kept as {lm.meta['weights']}"] = {
                    "weights": weights, "top1_agreement": float(same.mean()), "positions_differing": int((~same).sum()),
                    "llamacpp_lead_where_differing": gap[~same].tolist(), "llamacpp_lead_median": float(np.median(gap))}
                log(f"# {folder.name} {name} kept as {lm.meta['weights']}: top-1 agreement with llama.cpp "
                    f"{same.mean():.2%} over {ids.size} positions")
        out[folder.name] = rec
    return out


# ----------------------------------------------------------------------------- the run


def summary(rounds: list[dict], side: str, arm: str, n: int) -> dict:
    recs = [r[side]["arms"][arm] for r in rounds]
    med = lambda k: statistics.median(x[k] for x in recs)
    out = {"pp_tok_s": PP_LEN / med("pp_s"), "b1_tok_s": n / med("b1_s"),
           "b1_decode_only_tok_s": (n - 1) / med("b1_decode_s") if n > 1 else None,
           "bytes_per_step": recs[0]["bytes_per_step"],
           "runs": {k: [x[k] for x in recs] for k in ("pp_s", "b1_s", "b1_decode_s", "pp_load", "b1_load")},
           "row_tokens": recs[-1]["tokens"]}
    if side == "llama.cpp":
        out["threads"] = {k: [x[f"{k}_threads"]["threads"] for x in recs] for k in ("pp", "b1")}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", type=Path, default=FOLDER, help="the model folder (bench_hf_llama.py's)")
    ap.add_argument("-n", type=int, default=128, help="new tokens at batch 1")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (the median counts)")
    ap.add_argument("--threads", default=None, help="llama.cpp's thread counts to choose from (default: every core, and 1)")
    ap.add_argument("--out", default=H.default_out("bench_int4"), help="the result file")
    ap.add_argument("--no-check", action="store_true", help="leave out the GGUF agreement check")
    ap.add_argument("--torch-python", default=str(TORCH_PYTHON), help="writes the folder; runs the converter")
    ap.add_argument("--llamacpp-venv", type=Path, default=None, help="the llama.cpp environment")
    ap.add_argument("--sdist", type=Path, default=None, help="llama-cpp-python's sdist (the converter)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.rounds < 1 or args.n < 1:
        ap.error("-n and --rounds must be at least 1")
    from benchmarks.bench_hf_llama import build_folder
    from benchmarks.bench_llamacpp import SDIST

    args.sdist = args.sdist or SDIST
    if not Path(args.torch_python).exists():
        ap.error(f"{args.torch_python} does not exist: make the torch environment (docs/benchmarks.md) or give --torch-python")
    started, load_start = time.perf_counter(), H.load()
    build_folder(args.folder, os.path.abspath(args.torch_python))
    python = llama_env(args)
    files = gguf_files(args, python, args.folder)
    types = {k: tensor_types(v["path"]) for k, v in files.items() if k != "F32"}
    machine = H.machine()
    rounds = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        order = ("llama.cpp", "jaxdecode") if r % 2 == 0 else ("jaxdecode", "llama.cpp")
        rec = {"order": order}
        for side in order:
            rec[side] = llama_round(args, python, files) if side == "llama.cpp" else jax_round(args)
        rounds.append(rec)
        log(f"# round {r + 1}/{args.rounds}: {time.perf_counter() - t0:.0f} s, load {H.load()[0]:.2f}")
    results = {f"jaxdecode {a}": summary(rounds, "jaxdecode", a, args.n) for a in JAX_ARMS}
    results |= {f"llama.cpp {a}": summary(rounds, "llama.cpp", a, args.n) for a in LLAMA_ARMS}
    int4, int8 = results["jaxdecode int4"], results["jaxdecode int8"]
    ratios = {"int4 / int8, batch 1": int4["b1_tok_s"] / int8["b1_tok_s"]}
    for a in LLAMA_ARMS:
        ratios[f"int4 / {a}, batch 1"] = int4["b1_tok_s"] / results[f"llama.cpp {a}"]["b1_tok_s"]
        ratios[f"int4 / {a}, prompt 128"] = int4["pp_tok_s"] / results[f"llama.cpp {a}"]["pp_tok_s"]
    agreement = None if args.no_check else check(args, python, files)
    doc = H.result("benchmarks.bench_int4", folder=str(args.folder), n=args.n, prompt_len=PROMPT_LEN, pp_len=PP_LEN,
                   rounds_run=args.rounds, gguf=files, gguf_tensor_types=types,
                   llama_cpp=rounds[0]["llama.cpp"]["llama_cpp"],
                   llama_cpp_system_info=rounds[0]["llama.cpp"]["system_info"],
                   llamacpp_settings="KV cache f32, flash attention off, GOMP_SPINCOUNT 10000, n_batch 512",
                   results=results, ratios=ratios, gguf_agreement=agreement, rounds=rounds,
                   load_average={"start": load_start, "end": H.load()},
                   wall_s=time.perf_counter() - started)
    doc["machine"] = machine | {"load_average": load_start}
    H.write_json(args.out, doc)
    print(f"# {H.describe(machine)}; llama.cpp {doc['llama_cpp']}; median of {args.rounds} rounds, each side alone")
    print("| arm | prompt 128 (tok/s) | batch 1 (tok/s) | decoding alone (tok/s) | MB read per step |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['pp_tok_s']:.0f} | {r['b1_tok_s']:.1f} | {r['b1_decode_only_tok_s'] or 0:.1f} "
              f"| {r['bytes_per_step'] / 1e6:.0f} |")
    for k, v in ratios.items():
        print(f"# {k}: {v:.2f}x")
    print(f"# load average {load_start[0]:.2f} at the start, {H.load()[0]:.2f} at the end; "
          f"{time.perf_counter() - started:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
