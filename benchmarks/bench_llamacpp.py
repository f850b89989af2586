"""Prompt processing and greedy decoding of a SmolLM-135M-shaped Llama on the CPU: jaxdecode
(native backend; float32, bfloat16 and int8 weights) against llama.cpp (llama-cpp-python; F32, BF16
and Q8_0 GGUF files of the same weights), in one run.

    python -m benchmarks.bench_llamacpp                               # 128 new tokens, 3 rounds
    python -m benchmarks.bench_llamacpp -n 16 --rounds 1 --json /tmp/llamacpp.json

The model is ``benchmarks/bench_hf_llama.py``'s (run that once to write ``--folder``, default
``~/.cache/jaxdecode-bench/llama106m``): SmolLM-135M's shape (30 layers, hidden 576, 9 query and
3 key/value heads, MLP 1536, vocabulary 49152, tied embeddings) with random float32 weights and a
400-token BPE tokenizer. Token ids go in and come out as ids on both sides; no text is tokenized.

GGUF files. The folder is converted once, into ``~/.cache/jaxdecode-bench/gguf/``, by llama.cpp's
own ``convert_hf_to_gguf.py --outtype f32|bf16|q8_0`` from the llama.cpp vendored in the sdist of
llama-cpp-python (``--sdist``, extracted once to ``~/.cache/jaxdecode-bench/llama-cpp-src/``), run
by the torch environment (``--torch-python``, default ``.venv-torch/bin/python``) with the sdist's
``gguf-py`` first on PYTHONPATH. Two things in the converter do not fit this folder; a small
wrapper (``benchmarks/peers/gguf_convert.py``) runs the unchanged converter with both worked around, weights untouched:

- the tokenizer is a GPT-2 byte-level BPE whose pre-tokenizer hash is in no known model's list, so
  the converter refuses it ("BPE pre-tokenizer was not recognized"). The wrapper answers
  ``"gpt-2"`` for an unknown hash when ``tokenizer.json``'s pre-tokenizer is ``ByteLevel`` with
  GPT-2's regex (which is what "gpt-2" means in llama.cpp) and re-raises otherwise;
- the converter imports ``sentencepiece`` before it looks for a ``tokenizer.model`` (the folder has
  none, so it goes on to the BPE path). Where the torch environment lacks sentencepiece, the
  wrapper makes that step look for the file first (and so fail as it would have, without the
  import).

The vocabulary size mismatch (400 tokens, 49152 rows) needs nothing: the converter pads the token
list with unused ``[PAD<i>]`` entries. Q8_0 and BF16 quantize every matrix, the tied embedding
(``token_embd``, which is also the output layer) included; norms stay F32.

llama.cpp runs in its own environment (``--llamacpp-venv``, default ``.venv-llamacpp``, made on
the first run: ``pip install llama-cpp-python==0.3.36 gguf numpy``, which builds llama.cpp from
source where no wheel fits, on a CPU with AMX without it (``LLAMA_CMAKE``: llama.cpp's AMX path
faults on the Intel VM); the sdist, for the converter, is downloaded once into the cache) and
its own process, which answers one measurement per request line, timed there, through the low-level ``llama_cpp``
API: one context per file with ``n_threads = n_threads_batch = --threads`` (default: every core),
``n_seq_max = 8`` with a KV stream per sequence (``kv_unified = false``), room for ``32 + n``
positions per sequence, ``n_batch = n_ubatch = 512``, logits of the last position of each sequence
only (as ``logits_all=False``), flash attention off (``--flash-attn``; off is llama-cpp-python's
``Llama`` default, "auto" llama.cpp's, which turns it on here), the KV cache ``--kv-type``
(default f32, as jaxdecode's float32 cache; ``Llama``'s default is f16), OpenMP's spin before a
waiting thread sleeps ``GOMP_SPINCOUNT`` (``--gomp-spincount``, default 10000; below), llama.cpp's
defaults otherwise (weights mmapped).

llama.cpp's CPU flash attention is less exact: with it ("auto"), llama.cpp F32's last logits after
the 128-token prompt were 8e-4 from a float64 Hugging Face reference (their std is 0.48); without
it 9e-7, as close as jaxdecode float32 (2e-6) and Hugging Face float32 (2e-6).

OpenMP. The wheel's ggml is built with OpenMP (libgomp), and every barrier of its graph (hundreds
per token) is an ``omp barrier``, where libgomp lets a waiting thread spin 300000 times by default
before it sleeps. On a machine whose cores other work also uses, the thread it waits for is then
often descheduled: on a loaded 2-core machine llama.cpp F32 ran 2 to 30 times slower than with the
remedies below (prompt 30-130 tok/s against ~280, batch-1 decode 1-15 tok/s against ~28), and
erratically. Sleeping at once (``OMP_WAIT_POLICY=PASSIVE``, ``--omp-wait passive``) cures that but
costs a wake-up per barrier, which capped Q8_0's batch-1 decode at ~33 tok/s on the quiet machine
(against ~110 with the default). A short spin,
``GOMP_SPINCOUNT=10000`` (this script's default), was as fast as the default on the quiet machine
(Q8_0: 104-124 tok/s at batch 1) and as robust as passive on the loaded one (~50 tok/s, both cores
busy with other work). ``--gomp-spincount 0 --omp-wait unset`` gives llama.cpp's own setting;
``--threads 1`` has no barriers at all.

What is measured, every arm alike:

- prompt 128: one forward over the same 128 random token ids at batch 1 into an empty cache;
  llama.cpp: ``llama_memory_clear`` then one ``llama_decode`` of the 128 tokens (timed to
  ``llama_synchronize``); jaxdecode: ``jax.jit(decoder.prefill)(params, tokens, lengths, capacity=256)``
  (what the loops run first: the cache, and the logits of the last position only, as llama.cpp's),
  after ``block_until_ready``. Rate: 128 / seconds.
- batch-1 and batch-8 greedy decoding: ``-n`` new tokens after the 32-token prompts of
  ``bench_hf_llama.py`` (row b: 32 random ids from [4, 400), seed 0; rows 0-7), no end token stops
  a row. jaxdecode: ``sample_tokens(decoder, params, prompts, n, PRNGKey(0), greedy=True)``.
  llama.cpp: the B prompts in one ``llama_decode`` (one sequence id each), then ``n - 1`` steps of
  one ``llama_decode`` with B tokens (one per sequence), the next tokens the argmax of each row's
  logits (numpy, in the timed loop). Rate: B * n / seconds, the 32-token prefill included on both
  sides (llama.cpp's decode-only rate, B * (n - 1) / the steps' seconds, is in the JSON and in a
  note under the table).

Each arm is run once to compile / warm up (llama.cpp: to load the mmapped GGUF pages; its batch-8
warm-up makes 16 new tokens), then ``--rounds`` (3) timed rounds; a round runs each measurement
for every arm in turn, llama.cpp and jaxdecode alternating (F32, float32, BF16, bfloat16, Q8_0,
int8), so that a slow phase of a shared machine hits all alike; the median counts.

Greedy agreement, checked first: llama.cpp's F32 tokens after row 0's prompt must equal jaxdecode's
float32 tokens for the first ``--agree`` (16) new tokens; the first position where they differ is
reported (random weights have near-ties; a different summation order may flip one, after which
the texts diverge). The same comparison for BF16 / bfloat16 and Q8_0 / int8 (different roundings,
expected to part sooner) and the rows identical at batch 8 are printed too. With these random
weights a greedy row soon repeats one token (1-3 distinct tokens in 16), so the tokens are a weak
check; the stronger one, also printed, compares the last position's logits after the 128-token
prompt of each pair (largest absolute difference against their standard deviation, argmax, top 5).

Bandwidth bound: the read bandwidth is measured in the same run with ``bench_hf_llama.py``'s
``read_bandwidth`` (1 GiB of float32, numpy and jitted ``jnp.sum``, best of 3 each) and with
jaxdecode's native one-row product over a 1 GiB float32 matrix on huge pages, where jaxdecode keeps
its weights (``product_bandwidth``: it reads faster than both sums here, several streams per core),
at the end and just before and after every batch-1 run; the largest counts. This VM's read rate
swings by up to 2x within seconds, so each batch-1 run's decoding alone (its time less that of the
prefill and first token) is also set against the mean of the two rates measured around it (the
median over the rounds is reported). Bytes read per decode step: jaxdecode, every parameter leaf
but the embedding lookup table (the 30 layers' matrices in their kept dtype with their scales and
norms, the final norm and the 49152 x 576 output layer once); llama.cpp, the GGUF file's size (an
approximation: its ``token_embd`` is the output layer, counted once). Bound at batch 1 = bandwidth
/ bytes per step.

Options: ``-n``, ``--rounds``, ``--folder``, ``--json FILE`` (every number, the machine, the
versions, the agreement), ``--skip-llamacpp`` / ``--skip-jaxdecode`` (debugging). This is a script,
never imported by the tests.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import harness as H
from benchmarks.bench_hf_llama import DEFAULT_FOLDER, TOKEN_RANGE, first_difference
from benchmarks.harness import read_bandwidth

ROOT = H.ROOT
PEERS = Path(__file__).resolve().parent / "peers"
CACHE = Path.home() / ".cache" / "jaxdecode-bench"
LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python release measured
SDIST = CACHE / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
TORCH_PYTHON = ROOT / ".venv-torch" / "bin" / "python"
LLAMA_VENV = ROOT / ".venv-llamacpp"
# llama.cpp built for this CPU with every vector extension but AMX: on the Intel VM its AMX path for
# the quantized types faults at its first tile load (ldtilecfg, SIGSEGV)
LLAMA_CMAKE = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
               "-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON "
               "-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF")
PROMPT_LEN, PP_LEN, BATCH = 32, 128, 8
# (llama.cpp GGUF type, converter --outtype, jaxdecode weights), in the order the arms run
PAIRS = (("F32", "f32", "float32"), ("BF16", "bf16", "bfloat16"), ("Q8_0", "q8_0", "int8"))

CONVERT = PEERS / "gguf_convert.py"  # run by the torch environment
LLAMA_PEER = PEERS / "llamacpp_server.py"  # run by the llama.cpp environment


@functools.cache
def _probe(nbytes: int):
    """A packed float32 matrix of about ``nbytes`` on huge pages, where jaxdecode keeps its
    weights (jaxdecode.native.memory), and a row of ones for it."""
    import jax.numpy as jnp

    from jaxdecode.native import memory

    n = int((nbytes // 4) ** 0.5) // 16 * 16
    return memory.place(np.ones((n // 16, n, 16), np.float32)), jnp.ones((1, n), jnp.float32)


def product_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes per second of jaxdecode's native one-row product over a float32 matrix of ``nbytes``
    (2 FLOPs per weight: bound by reading it), best of ``repeats``: on this machine it reads memory
    faster than a numpy or XLA sum (several streams per core), so the bound must count it."""
    from jaxdecode.native import kernels

    wp, x = _probe(nbytes)
    run = jax.jit(kernels.linear)
    run(x, wp).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run(x, wp).block_until_ready()
        times.append(time.perf_counter() - t)
    return wp.nbytes / min(times)


def llama_cmake() -> str | None:
    """CMAKE_ARGS for building llama.cpp here: LLAMA_CMAKE on a CPU with AMX (whose path faults on
    the Intel VM), else None (llama.cpp's own native build)."""
    try:
        with open("/proc/cpuinfo") as f:
            return LLAMA_CMAKE if any(line.startswith("flags") and " amx_int8" in line for line in f) else None
    except OSError:
        return None


def ensure_llama_env(venv: Path, sdist: Path, log, cmake_args: str | None = None) -> str:
    """The benchmark's own llama.cpp environment: ``venv`` with llama-cpp-python (built from source
    by pip where no wheel fits, with ``cmake_args`` as CMAKE_ARGS when given) and ``gguf``, made
    once; and the sdist (for its converter), downloaded once. Returns the environment's python."""
    python = venv / "bin" / "python"
    if not python.exists():
        log(f"# creating {venv} with llama-cpp-python {LLAMA_CPP_PYTHON} (builds llama.cpp: minutes)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = dict(os.environ, CMAKE_ARGS=cmake_args) if cmake_args else None
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-cache-dir",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "gguf", "numpy"], check=True, env=env)
    if not sdist.exists():
        log(f"# downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (its convert_hf_to_gguf.py)")
        subprocess.run([str(python), "-m", "pip", "download", "-q", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                        "--no-binary", ":all:", "--no-deps", "-d", str(sdist.parent)], check=True)
    return str(python)


def llama_source(sdist: Path) -> Path:
    """The vendored llama.cpp of the llama-cpp-python sdist, extracted once."""
    src = CACHE / "llama-cpp-src"
    converter = src / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    if not converter.exists():
        src.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                m.name = m.name.split("/", 1)[1] if "/" in m.name else ""
            tar.extractall(src, members=[m for m in tar.getmembers() if m.name], filter="data")
    return converter.parent


def convert(folder: Path, torch_python: str, sdist: Path, log, kinds=None) -> dict[str, dict]:
    """The folder's GGUF files (``kinds``: (name, converter --outtype) pairs, default F32, BF16,
    Q8_0), converted once; {name: {path, bytes, command}}."""
    out_dir = CACHE / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    src, files = None, {}
    weights_time = (folder / "model.safetensors").stat().st_mtime
    for name, outtype in kinds or [(name, outtype) for name, outtype, _ in PAIRS]:
        path = out_dir / f"{folder.name}-{outtype}.gguf"
        where = CACHE / "llama-cpp-src" / "vendor" / "llama.cpp"
        cmd = [f"PYTHONPATH={where}:{where / 'gguf-py'}", torch_python, str(CONVERT),
               str(where / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
               "--outfile", str(path)]
        if not path.exists() or path.stat().st_mtime < weights_time:  # absent, or older than the weights
            src = src or llama_source(sdist)
            tmp = path.with_suffix(".tmp")
            path_env = os.pathsep.join([str(src), str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")])
            env = dict(os.environ, PYTHONPATH=path_env)
            t = time.perf_counter()
            run = subprocess.run([torch_python, str(CONVERT), str(src / "convert_hf_to_gguf.py"),
                                  str(folder), "--outtype", outtype, "--outfile", str(tmp)],
                                 capture_output=True, text=True, cwd=src, env=env, check=False)
            if run.returncode != 0 or not tmp.exists():
                tmp.unlink(missing_ok=True)
                raise RuntimeError(f"converting {folder} to {outtype} failed:\n{run.stderr[-3000:]}")
            tmp.rename(path)
            log(f"# converted to {path} in {time.perf_counter() - t:.0f} s")
        files[name] = {"path": str(path), "bytes": path.stat().st_size, "command": " ".join(cmd)}
    return files


class LlamaCpp(H.Peer):
    """llama.cpp, in its own process (started in ``/``, away from this tree's modules)."""

    def __init__(self, python: str, files: dict, threads: int, ctx_per_seq: int, kv: str, omp_wait: str,
                 spincount: int, flash_attn: str):
        cfg = {"files": {k: v["path"] for k, v in files.items()}, "threads": threads, "seqs": BATCH,
               "ctx_per_seq": -(-ctx_per_seq // 256) * 256, "n_batch": 512, "kv": kv,
               "flash_attn": flash_attn}
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        if omp_wait != "unset":
            env["OMP_WAIT_POLICY"] = omp_wait.upper()
        if spincount > 0:
            env["GOMP_SPINCOUNT"] = str(spincount)
        super().__init__([python, str(LLAMA_PEER), json.dumps(cfg)], "the llama.cpp process", env=env, cwd="/")

    def ask(self, **request) -> dict:
        return json.loads(super().ask(json.dumps(request)))


class Jax:
    """One jaxdecode arm: the folder loaded with ``weights`` on the native backend."""

    def __init__(self, folder: Path, weights: str):
        from jaxdecode.models import checkpoint

        self.lm = checkpoint.load(folder, backend="native", weights=weights)
        dec = self.lm.decoder
        self.prefill = jax.jit(dec.prefill, static_argnames="capacity")
        params = self.lm.params
        read = {k: v for k, v in params.items() if k != "embed"} if "head" in params else params
        self.bytes = sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(read))

    def pp(self, tokens: np.ndarray) -> float:
        t = time.perf_counter()
        jax.block_until_ready(self._prefill(tokens))
        return time.perf_counter() - t

    def _prefill(self, tokens: np.ndarray):
        lengths = np.full((tokens.shape[0],), tokens.shape[1], np.int32)
        return self.prefill(self.lm.params, tokens, lengths, capacity=256)

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """The last position's logits after ``tokens`` [1, S]."""
        return np.asarray(self._prefill(tokens)[0][0], np.float32)

    def gen(self, prompts, n: int) -> tuple[float, np.ndarray]:
        from jaxdecode.decoding import sampling as S

        t = time.perf_counter()
        res = S.sample_tokens(self.lm.decoder, self.lm.params, prompts, n, jax.random.PRNGKey(0), greedy=True)
        tokens = np.asarray(res.tokens)
        return time.perf_counter() - t, tokens


def agreement(a, b, agree: int) -> dict:
    d = first_difference(list(a), list(b))
    return {"first_difference": d, "agrees_first": d is None or d >= min(agree, len(a))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", type=Path, default=DEFAULT_FOLDER,
                    help="the model folder (written by benchmarks/bench_hf_llama.py)")
    ap.add_argument("-n", type=int, default=128, help="new tokens per row")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (the median counts)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads")
    ap.add_argument("--kv-type", choices=("f32", "f16"), default="f32", help="llama.cpp's KV cache")
    ap.add_argument("--flash-attn", choices=("off", "on", "auto"), default="off",
                    help="llama.cpp's flash attention (off: llama-cpp-python's default)")
    ap.add_argument("--gomp-spincount", type=int, default=10000,
                    help="GOMP_SPINCOUNT of the llama.cpp process (0: unset, libgomp's default)")
    ap.add_argument("--omp-wait", choices=("passive", "active", "unset"), default="unset",
                    help="OMP_WAIT_POLICY of the llama.cpp process (unset: libgomp's default)")
    ap.add_argument("--agree", type=int, default=16, help="row 0's first tokens that must agree")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write every number to FILE")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--skip-jaxdecode", action="store_true")
    ap.add_argument("--torch-python", default=str(TORCH_PYTHON), help="runs the GGUF converter")
    ap.add_argument("--llamacpp-venv", type=Path, default=LLAMA_VENV,
                    help="the llama.cpp environment (made here if absent)")
    ap.add_argument("--sdist", type=Path, default=SDIST, help="llama-cpp-python's sdist (the converter)")
    args = ap.parse_args()
    if args.skip_llamacpp and args.skip_jaxdecode:
        ap.error("nothing to run")
    if args.rounds < 1 or args.n < 1:
        ap.error("-n and --rounds must be at least 1")
    if not (args.folder / "model.safetensors").exists():
        ap.error(f"{args.folder} has no model.safetensors: run python -m benchmarks.bench_hf_llama once to write it")
    n = args.n
    omp = (f"{args.threads} threads, GOMP_SPINCOUNT {args.gomp_spincount or 'unset'}, "
           f"OMP_WAIT_POLICY {args.omp_wait}")
    log = lambda *a: print(*a, file=sys.stderr, flush=True)
    started = time.perf_counter()
    load_start = H.load()[0]

    rng = np.random.default_rng(0)  # bench_hf_llama.py's prompt rows
    rows = rng.integers(*TOKEN_RANGE, size=(BATCH, PROMPT_LEN)).astype(np.int32)
    pp_tokens = np.random.default_rng(1).integers(*TOKEN_RANGE, size=(1, PP_LEN)).astype(np.int32)
    prompts = {1: [rows[0]], BATCH: [rows[b] for b in range(BATCH)]}
    machine = H.machine()

    arms = []  # (label, side, name), in the order they run
    for name, _, weights in PAIRS:
        if not args.skip_llamacpp:
            arms.append((f"llama.cpp {name}", "llama.cpp", name))
        if not args.skip_jaxdecode:
            arms.append((f"jaxdecode {weights}", "jaxdecode", weights))
    files, llama, jx = {}, None, {}
    times = {a[0]: {k: [] for k in ("pp", "b1", "b8", "b1_decode", "b8_decode", "pp_load", "b1_load", "b8_load")}
             for a in arms}
    tokens, first_call, agree = {}, {}, {}
    adjacent_bw = {a[0]: [] for a in arms}  # the read rate around each batch-1 run, per arm

    def measure(arm, kind, n=n):
        _, side, name = arm
        if side == "jaxdecode":
            if kind == "pp":
                return jx[name].pp(pp_tokens), None, None
            rows_ = prompts[1 if kind == "b1" else BATCH]
            s, toks = jx[name].gen(rows_, n)
            first, _ = jx[name].gen(rows_, 1)  # the prefill and the first token: what is not decoding
            return s, s - first, toks
        if kind == "pp":
            return llama.ask(op="pp", arm=name, tokens=pp_tokens[0].tolist())["seconds"], None, None
        rows_ = [r.tolist() for r in prompts[1 if kind == "b1" else BATCH]]
        out = llama.ask(op="gen", arm=name, prompts=rows_, n=n)
        return out["prefill_s"] + out["decode_s"], out["decode_s"], np.asarray(out["tokens"], np.int32)

    def warm(arm):
        for kind in ("pp", "b1", "b8"):
            t = time.perf_counter()  # llama.cpp compiles nothing: a short batch-8 run loads its pages
            _, _, toks = measure(arm, kind, min(n, 16) if arm[1] == "llama.cpp" and kind == "b8" else n)
            first_call[arm[0], kind] = time.perf_counter() - t
            if toks is not None:
                tokens[arm[0], kind] = toks

    try:
        if not args.skip_llamacpp:
            llama_python = ensure_llama_env(args.llamacpp_venv, args.sdist, log, llama_cmake())
            files = convert(args.folder, args.torch_python, args.sdist, log)
            llama = LlamaCpp(llama_python, files, args.threads, max(PP_LEN, PROMPT_LEN + n),
                             args.kv_type, args.omp_wait, args.gomp_spincount, args.flash_attn)
            machine["llama_cpp"] = llama.info["llama_cpp"]
            machine["llama_cpp_system_info"] = llama.info["system_info"]
            log(f"# llama.cpp {llama.info['llama_cpp']} ({omp}, KV {args.kv_type}, "
                f"flash attention {args.flash_attn}): "
                f"{llama.info['system_info']}")
        log(f"# {machine['cpu']}, {machine['cores']} cores; jax {jax.__version__} ({jax.default_backend()})")
        # the greedy agreement first: llama.cpp F32 against jaxdecode float32 (also their warm-up)
        for arm in arms:
            if arm[2] in ("F32", "float32"):
                if arm[1] == "jaxdecode":
                    jx["float32"] = Jax(args.folder, "float32")
                warm(arm)
        if not (args.skip_llamacpp or args.skip_jaxdecode):
            a, b = tokens["llama.cpp F32", "b1"][0], tokens["jaxdecode float32", "b1"][0]
            agree["F32/float32"] = agreement(a, b, args.agree)
            d = agree["F32/float32"]["first_difference"]
            log("# greedy agreement llama.cpp F32 / jaxdecode float32, row 0: "
                + ("identical" if d is None else f"first difference at new token {d}")
                + f" over {n} ({'OK' if agree['F32/float32']['agrees_first'] else 'DISAGREE'})")
            log(f"#   llama.cpp: {a[:16].tolist()}\n#   jaxdecode: {b[:16].tolist()}")
        for arm in arms:
            if arm[2] not in ("F32", "float32"):
                if arm[1] == "jaxdecode":
                    jx[arm[2]] = Jax(args.folder, arm[2])
                warm(arm)
        if not (args.skip_llamacpp or args.skip_jaxdecode):  # the logits after the 128-token prompt
            for name, _, weights in PAIRS:
                a = np.asarray(llama.ask(op="logits", arm=name, tokens=pp_tokens[0].tolist())["logits"])
                b = jx[weights].logits(pp_tokens)
                agree.setdefault(f"{name}/{weights}", {})["prompt128_logits"] = {
                    "max_abs_diff": float(np.abs(a - b).max()), "std": float(b.std()),
                    "argmax_equal": bool(a.argmax() == b.argmax()),
                    "top5_common": len(set(np.argsort(a)[-5:]) & set(np.argsort(b)[-5:]))}
        log(f"# warm: {', '.join(f'{a[0]} {first_call[a[0], k]:.1f}s' for a in arms for k in ('b1',))} "
            "(first batch-1 call)")
        for r in range(args.rounds):
            for kind in ("pp", "b1", "b8"):
                for arm in arms:
                    if kind == "b1":  # the read rate just before and after each batch-1 run
                        before = product_bandwidth()
                    load_before = H.load()[0]
                    s, decode_s, toks = measure(arm, kind)
                    times[arm[0]][kind + "_load"].append([load_before, H.load()[0]])
                    if kind == "b1":
                        adjacent_bw[arm[0]].append((before + product_bandwidth()) / 2)
                    times[arm[0]][kind].append(s)
                    if decode_s is not None:
                        times[arm[0]][kind + "_decode"].append(decode_s)
                    if toks is not None:
                        tokens[arm[0], kind] = toks
            log(f"# round {r + 1}/{args.rounds} done ({time.perf_counter() - started:.0f} s)")
    finally:
        if llama is not None:
            llama.close()
    bandwidth = read_bandwidth()
    bandwidth["native product"] = max([product_bandwidth(), *(b for v in adjacent_bw.values() for b in v)])
    bw = max(bandwidth.values())

    if not (args.skip_llamacpp or args.skip_jaxdecode):
        for name, _, weights in PAIRS:
            agree[f"{name}/{weights}"].update(agreement(tokens[f"llama.cpp {name}", "b1"][0],
                                                        tokens[f"jaxdecode {weights}", "b1"][0], args.agree))
        for name, _, weights in PAIRS:
            a, b = tokens[f"llama.cpp {name}", "b8"], tokens[f"jaxdecode {weights}", "b8"]
            pair = agree[f"{name}/{weights}"]
            pair["batch8_rows_identical"] = int(sum(np.array_equal(a[i], b[i]) for i in range(BATCH)))
            pair["batch8_first_differences"] = [first_difference(a[i].tolist(), b[i].tolist())
                                                for i in range(BATCH)]
            pair["batch8_distinct_tokens_per_row"] = [len(set(a[i].tolist())) for i in range(BATCH)]
    results = []
    for label, side, name in arms:
        t = times[label]
        nbytes = files[name]["bytes"] if side == "llama.cpp" else jx[name].bytes
        res = {"arm": label, "side": side, "weights": name, "bytes_per_step": nbytes,
               "pp_tok_s": PP_LEN / statistics.median(t["pp"]),
               "b1_tok_s": n / statistics.median(t["b1"]),
               "b8_tok_s": BATCH * n / statistics.median(t["b8"]),
               "bound_b1_tok_s": bw / nbytes, "seconds": t,
               "first_call_s": {k: first_call[label, k] for k in ("pp", "b1", "b8")},
               "row0_tokens": tokens[label, "b1"][0].tolist()}
        res["b1_of_bound"] = res["b1_tok_s"] / res["bound_b1_tok_s"]
        if n > 1:
            res["b1_decode_only_tok_s"] = (n - 1) / statistics.median(t["b1_decode"])
            res["b8_decode_only_tok_s"] = BATCH * (n - 1) / statistics.median(t["b8_decode"])
            res["b1_decode_of_bound"] = res["b1_decode_only_tok_s"] * nbytes / bw
            # each batch-1 run's decoding against the read rate measured around it
            res["adjacent_read_bandwidth"] = adjacent_bw[label]
            res["b1_decode_of_adjacent_bound"] = statistics.median(
                (n - 1) / d * nbytes / b for d, b in zip(t["b1_decode"], adjacent_bw[label]))
        results.append(res)
    elapsed = time.perf_counter() - started
    doc = {"machine": machine, "folder": str(args.folder), "gguf": files, "read_bandwidth": bandwidth,

           "n": n, "prompt_len": PROMPT_LEN, "pp_len": PP_LEN, "batch": BATCH, "rounds": args.rounds,
           "llamacpp_threads": args.threads, "llamacpp_kv_type": args.kv_type,
           "llamacpp_omp_wait_policy": args.omp_wait, "llamacpp_gomp_spincount": args.gomp_spincount,
           "llamacpp_flash_attn": args.flash_attn,
           "agree": args.agree,
           "greedy_agreement": agree if not (args.skip_llamacpp or args.skip_jaxdecode) else None,
           "results": results, "wall_s": elapsed,
           "load_average": {"start": load_start, "end": H.load()[0]},
           "command": H.command("benchmarks.bench_llamacpp")}
    if args.json:
        H.write_json(args.json, doc)

    print(f"# {machine['cpu']}, {machine['cores']} cores; read bandwidth (1 GiB float32): "
          + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bandwidth.items()))
    print(f"# prompt: {PP_LEN} tokens at batch 1; decode: {n} new tokens after {PROMPT_LEN}-token prompts, "
          f"greedy, prefill included; median of {args.rounds}")
    if not args.skip_llamacpp:
        print(f"# llama.cpp {machine['llama_cpp']}: {omp}, "
              f"KV cache {args.kv_type}, flash attention {args.flash_attn}; jaxdecode "
              f"{jax.default_backend()}, native backend")
    print("| arm | prompt 128 tok/s | batch-1 decode tok/s | batch-8 decode tok/s (total) "
          "| MB read per step | % of bw bound, batch 1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['arm']} | {r['pp_tok_s']:.0f} | {r['b1_tok_s']:.1f} | {r['b8_tok_s']:.1f} "
              f"| {r['bytes_per_step'] / 1e6:.0f} | {r['b1_of_bound']:.0%} |")
    only = [r for r in results if "b1_decode_only_tok_s" in r]
    if only:
        print(f"# decoding alone (the {n - 1} steps after the prefill and first token), tok/s at batch 1 / "
              "batch 8, and batch 1 as a share of the bound (the run's best read rate; the rate around "
              "each run):")
        for r in only:
            print(f"#   {r['arm']}: {r['b1_decode_only_tok_s']:.1f} / {r['b8_decode_only_tok_s']:.1f}; "
                  f"{r['b1_decode_of_bound']:.0%}; {r['b1_decode_of_adjacent_bound']:.0%} (read rate "
                  + ", ".join(f"{b / 1e9:.1f}" for b in r["adjacent_read_bandwidth"]) + " GB/s)")
    for pair, a in (agree.items() if doc["greedy_agreement"] else ()):
        d = a["first_difference"]
        check = pair == "F32/float32"
        same = "identical" if d is None else f"first difference at {d}"
        print(f"# greedy agreement {pair}: row 0 {same}"
              + f" over {n} new tokens" + (" (the check)" if check else "")
              + ("" if a["agrees_first"] or not check else f": DISAGREE within the first {args.agree}")
              + f"; batch 8: {a['batch8_rows_identical']}/{BATCH} rows identical")
        lg = a["prompt128_logits"]
        print(f"#   logits after the 128-token prompt: max |difference| {lg['max_abs_diff']:.2e} "
              f"(their std {lg['std']:.2f}), argmax {'equal' if lg['argmax_equal'] else 'DIFFERENT'}, "
              f"{lg['top5_common']}/5 of the top 5 in common")
    print(f"# the run took {elapsed:.0f} s; load average {load_start:.2f} at start, "
          f"{H.load()[0]:.2f} at end")


if __name__ == "__main__":
    main()
