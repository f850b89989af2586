"""Generation throughput on both backends, beside Hugging Face ``generate`` and physical bounds,
measured in one run.

    python -m benchmarks.bench_backends [--ckpt DIR] [--batches 1,16,64,256] [--out FILE]
    python -m benchmarks.bench_backends --quick --out /tmp/quick.json   # a smoke run (n=40, batches 1,4): ~1 minute

Rows (characters per second, ``n`` = 300 new characters after a 32-character prompt, inside one
window), on each backend of the loaded model (``checkpoint.load(backend="native")``, the C++ CPU
layer, and ``lm.with_backend("portable")``, the ``jax.numpy`` path that GPU and TPU users run):

- ``book loop``: the chapter's loop, a full forward over the whole text for every new character
  (jitted, the text padded to a multiple of 64 so that it compiles a handful of times), batch 1;
  the training forward, the same on both backends;
- ``python loop``: a Python loop over a jitted cached step (full-capacity cache, one dispatch per
  character), the usual hand-written decode loop (``model.step(..., native=...)``; on the native
  backend with packed weights);
- ``jaxdecode``: :func:`jaxdecode.decoding.sampling.sample_tokens`, greedy and top-p 0.9;
- one row past the window (580 characters: the exact window mode after T), top-p;
- ``HF generate``: the same weights as a ``transformers`` model (``benchmarks/bench_hf.py``, run
  in its own environment, ``--hf-python``), ``generate`` greedy and ``do_sample=True, top_p=0.9,
  top_k=0``, the same number of new characters, with ``torch.set_num_threads(os.cpu_count())``
  and with one thread (``--hf-threads``: on a shared machine torch's threads wait for each other
  at every operation, and one thread can be faster). Before timing, its greedy text and
  next-token logits are checked against jaxdecode's (both backends, the CLI and the training
  forward).

Each row is compared with its physical bound on this machine, the larger of FLOPs / measured
matmul peak and bytes read per step (weights + the filled KV cache) / measured memory bandwidth,
and with the HF row of the same batch and the same decision rule (greedy or top-p). Compile time
is measured separately (the first call in a fresh bucket minus a warm call). Every row is
compiled (HF: warmed up) first, then all rows, HF's included, are timed in turn, ``--rounds``
times (the fastest counts), so that slow phases of a shared machine hit all rows alike. The peak
and the bandwidths are measured again in every round and the bounds use the best of them, so a
slow moment of the machine cannot lower a bound.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness as H
from jaxdecode import rules
from jaxdecode.decoding import sampling as S
from jaxdecode.models import checkpoint
from jaxdecode.models.charlm import transformer as M
from jaxdecode.native import kernels

PROMPT = "KATHARINA:\nMoved! in good time: "
DEFAULT_HF_PYTHON = H.ROOT / ".venv-hf" / "bin" / "python"
PROBE: H.Probe | None = None  # the machine's peak and bandwidths, measured in every round


def step_bytes(cfg: M.ModelConfig, B: int, context: float) -> float:
    weights = 4 * (cfg.L * 12 * cfg.d * cfg.d + cfg.V * cfg.d)
    return weights + B * cfg.L * 2 * context * cfg.d * 4


def bound(cfg: M.ModelConfig, B: int, mean_context: float, peak: float) -> float:
    """Characters per second at the physical limit for batch B at a mean context length."""
    d, L, V = cfg.d, cfg.L, cfg.V
    dense = L * 12 * d * d + V * d  # multiply-adds per token in the matmuls
    flops = B * (2 * dense + L * 4 * mean_context * d)  # + attention scores and weighted sum
    nbytes = step_bytes(cfg, B, mean_context)
    return B / max(flops / peak, nbytes / PROBE.bandwidth(int(nbytes)))


def window_bound(cfg: M.ModelConfig, P: int, n: int, peak: float) -> float:
    """Batch-1 bound for n characters after P when the text passes T: every step after the
    window fills is a forward over T tokens (the book's semantics), the steps before are cached."""
    cached = cfg.T - P
    t_cached = sum(1 / bound(cfg, 1, P + s, peak) for s in range(cached))
    dense = cfg.L * 12 * cfg.d ** 2 + cfg.V * cfg.d
    window_flops = cfg.T * (2 * dense + cfg.L * 2 * cfg.T * cfg.d)  # causal attention over T
    t_window = (n - cached) * max(window_flops / peak, 4 * dense / PROBE.bandwidth(4 * dense))
    return n / (t_cached + t_window)


def book_bound(cfg: M.ModelConfig, P: int, n: int, peak: float) -> float:
    """The book loop's own bound: every character costs a forward over the whole text so far."""
    dense = cfg.L * 12 * cfg.d ** 2 + cfg.V * cfg.d
    t = 0.0
    for s in range(n):
        t_len = min(cfg.T, P + s)
        flops = t_len * (2 * dense + cfg.L * 2 * t_len * cfg.d)
        t += max(flops / peak, 4 * dense / PROBE.bandwidth(4 * dense))
    return n / t


def book_loop(lm, prompt_ids, n):
    """The chapter's loop (compiled for every width it meets); returns a function that runs it."""
    cfg, params = lm.cfg, lm.params
    f = jax.jit(lambda p, x, i: jnp.argmax(M.forward(p, cfg, x)[0, i]))

    def run():
        ids = list(prompt_ids)
        for _ in range(n):
            W = min(cfg.T, -(-len(ids) // 64) * 64)
            ctx = ids[-cfg.T:]
            x = np.zeros((1, W), np.int32)
            x[0, :len(ctx)] = ctx
            ids.append(int(f(params, jnp.asarray(x), len(ctx) - 1)))
        return ids

    run()  # compile every width once
    return run


def python_loop(lm, prompt_ids, n, B):
    """A hand-written decode loop: one jitted cached step per character, dispatched from Python,
    on ``lm``'s backend (the native one with weights packed once, as its decoder does)."""
    cfg, params = lm.cfg, lm.params
    native = lm.decoder.backend == "native"
    packed = M.packed_params(params) if native and kernels.fuses_rows(B) else None
    tokens = jnp.asarray(np.tile(prompt_ids, (B, 1)))
    lengths = jnp.full((B,), len(prompt_ids), jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, token, packed):
        logits, cache = M.step(params, cfg, cache, token, packed=packed, native=native)
        return jnp.argmax(logits, -1).astype(jnp.int32), cache

    def run():
        logits, cache = M.prefill(params, cfg, tokens, lengths, packed=packed, native=native)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        for _ in range(n - 1):
            tok, cache = step(params, cache, tok, packed)
        return tok

    run()
    return run


def jaxdecode_loop(lm, prompt_ids, n, B, rule=None, greedy=False):
    """``sample_tokens`` on ``lm``'s backend; returns a function that runs it and the compile time
    of its bucket."""
    prompts = [prompt_ids] * B
    key = jax.random.PRNGKey(0)

    def run():
        return S.sample_tokens(lm.decoder, lm.params, prompts, n, key, rule=rule, greedy=greedy).tokens

    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    return run, max(0.0, first - H.best_of(run, 1))


class HF(H.Peer):
    """``benchmarks/bench_hf.py --serve`` in its own environment: one ``generate`` per request, timed
    there (the seconds of the call itself, without this process's round trip)."""

    def __init__(self, python: str, n: int, ckpt: str | None):
        cmd = [python, "-m", "benchmarks.bench_hf", "--serve", "-n", str(n)] + (["--ckpt", ckpt] if ckpt else [])
        super().__init__(cmd, "bench_hf.py --serve")

    def timer(self, B: int, mode: str, threads: int):
        return lambda: float(self.ask(f"{B} {mode} threads={threads}"))

    def check(self, reference: dict, atol: float = 1e-4) -> dict:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(reference, f)
        try:
            return json.loads(self.ask(f"check {f.name} {atol}"))
        finally:
            os.unlink(f.name)


def backends(lms: dict) -> dict:
    return {"native": {"available": kernels.available(), "why": lms["native"].decoder.why if "native" in lms else None},
            "portable": {"available": True, "why": lms["portable"].decoder.why}}


def reference(lms: dict, ids, n: int) -> dict:
    """jaxdecode's greedy text and next-token logits after the prompt, for checking the HF model:
    ``sample_tokens`` greedy and the prefill's logits on each backend, the training forward, and
    the CLI (``jaxdecode generate PROMPT -n N --greedy``, default backend)."""
    out = {"n": n, "greedy_text": {}, "logits": {}}
    any_lm = lms["portable"]
    for backend, lm in lms.items():
        toks = S.sample_tokens(lm.decoder, lm.params, [ids], n, jax.random.PRNGKey(0), greedy=True).tokens[0]
        out["greedy_text"][f"jaxdecode sample_tokens ({backend})"] = lm.vocab.decode(toks)
        prepared = lm.decoder.prepare(lm.params, 1)
        lengths = jnp.asarray([len(ids)], jnp.int32)
        logits = lm.decoder.prefill(prepared, jnp.asarray([ids]), lengths, lm.cfg.T)[0]
        out["logits"][f"jaxdecode prefill ({backend})"] = [float(v) for v in np.asarray(logits[0])]
    forward = M.forward(any_lm.params, any_lm.cfg, jnp.asarray([ids]))[0, -1]
    out["logits"]["jaxdecode forward"] = [float(v) for v in np.asarray(forward)]
    cli = Path(sys.executable).parent / "jaxdecode"
    if cli.exists():
        cmd = [str(cli), "generate", PROMPT.replace("\n", "\\n"), "-n", str(n), "--greedy", "--json"]
        if any_lm.path is not None:
            cmd += ["--ckpt", str(any_lm.path)]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=H.ROOT, check=False)
        if res.returncode == 0:
            out["greedy_text"]["jaxdecode CLI"] = json.loads(res.stdout)["outputs"][0]["text"]
        else:
            print(f"# jaxdecode CLI failed, left out of the check: {res.stderr.strip()[-200:]}", flush=True)
    return out


def describe_check(result: dict) -> list[str]:
    verdict = "PASS" if result["ok"] else "FAIL"
    lines = [f"# HF model check ({result['n']} greedy characters, logits atol {result['atol']:g}): {verdict}"]
    for name, g in result["greedy"].items():
        lines.append(f"#   greedy text vs {name}: "
                     + ("identical" if g["equal"] else f"DIFFERS from character {g['first_difference']}"))
    for name, v in result["logits"].items():
        lines.append(f"#   next-token logits vs {name}: max |diff| {v['max_abs_diff']:.1e}, "
                     f"same argmax: {v['same_argmax']}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--out", default=H.default_out("bench_backends"), help="the result file ('' for none)")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds (the fastest counts)")
    ap.add_argument("--hf-python", default=str(DEFAULT_HF_PYTHON) if DEFAULT_HF_PYTHON.exists() else None,
                    help="the Python of the environment that runs benchmarks/bench_hf.py (default: "
                         ".venv-hf/bin/python if it exists); 'none' leaves the HF rows out")
    ap.add_argument("--hf-threads", default=None,
                    help="torch thread counts to try; HF runs at the fastest for each batch and rule (default: "
                         "os.cpu_count() and 1; on a machine whose cores other work also uses, one thread can "
                         "be faster)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: n=40, batches 1,4, one round, no row past T")
    args = ap.parse_args()
    if args.quick:
        args.n, args.batches, args.rounds = 40, "1,4", 1
    hf_python = None if args.hf_python in (None, "", "none") else args.hf_python
    started = time.perf_counter()
    global PROBE
    PROBE = H.Probe()

    portable = checkpoint.load(args.ckpt, backend="portable")
    lms = {}
    if kernels.available():
        lms["native"] = portable.with_backend("native")
    lms["portable"] = portable
    cfg = portable.cfg
    ids = portable.vocab.encode(PROMPT)
    n = args.n
    info = H.machine(backends=backends(lms))
    print(f"# {H.describe(info)}; backends: " + ", ".join(f"{b}: {lm.decoder.why}" for b, lm in lms.items()),
          flush=True)
    if "native" not in lms:
        print("# the native layer is unavailable here: native rows left out", flush=True)
    dirty = " with uncommitted changes" if info["git"]["uncommitted_changes"] else ""
    print(f"# tree at {info['git']['commit']}{dirty}", flush=True)

    hf, check = None, None
    if hf_python:
        hf = HF(hf_python, n, args.ckpt)
        info["hf"] = {k: v for k, v in hf.info.items() if k != "ready"}
        print(f"# HF: torch {hf.info['torch']}, transformers {hf.info['transformers']}, "
              f"{hf.info['threads']} threads", flush=True)
        check = hf.check(reference(lms, ids, n))
        print("\n".join(describe_check(check)), flush=True)

    ctx = len(ids) + n / 2
    batches = [int(b) for b in args.batches.split(",")]
    long_n = cfg.T + 100 - len(ids)
    top_p = rules.top_p(0.9)
    # (row, backend, batch) -> {timer, chars, compile_s, bound (None: the cached-decode bound), mode}
    entries = {}

    arms = H.Arms()

    def entry(name, backend, B, timer, chars, mode, compile_s=None, bound_fn=None, threads=None, own=False):
        entries[(name, backend, B)] = {"chars": chars, "compile_s": compile_s, "bound": bound_fn, "mode": mode,
                                       "threads": threads}
        arms.add((name, backend, B), timer, timed_by_itself=own)

    t0 = time.perf_counter()
    entry("book loop (full forward)", "either", 1, book_loop(portable, ids, n), n, "greedy",
          bound_fn=lambda peak: book_bound(cfg, len(ids), n, peak))
    for B in batches:
        for backend, lm in lms.items():
            entry("python loop, cached step", backend, B, python_loop(lm, ids, n, B), B * n, "greedy")
            run, comp = jaxdecode_loop(lm, ids, n, B, greedy=True)
            entry("jaxdecode greedy", backend, B, run, B * n, "greedy", comp)
            run, comp = jaxdecode_loop(lm, ids, n, B, rule=top_p)
            entry("jaxdecode top-p 0.9", backend, B, run, B * n, "top-p", comp)
        if hf is not None:
            for mode, name in (("greedy", "HF generate greedy"), ("top-p", "HF generate top-p 0.9")):
                th = H.best_threads(lambda k, B=B, mode=mode: hf.timer(B, mode, k)(),
                                    H.thread_counts(args.hf_threads))
                print(f"# {name}, batch {B}: {th['threads']} torch thread(s) the fastest of "
                      f"{sorted(th['seconds_by_threads'])}", flush=True)
                entry(name, "torch", B, hf.timer(B, mode, th["threads"]), B * n, mode, threads=th["threads"],
                      own=True)
    if not args.quick:
        window = f"jaxdecode top-p, {long_n} chars (past T)"
        for backend, lm in lms.items():
            run, comp = jaxdecode_loop(lm, ids, long_n, 1, rule=top_p)
            entry(window, backend, 1, run, long_n, "top-p", comp,
                  lambda peak: window_bound(cfg, len(ids), long_n, peak))
    print(f"# compiled and warmed up in {time.perf_counter() - t0:.0f} s; timing {len(entries)} rows, "
          f"{args.rounds} round(s)", flush=True)
    arms.run(args.rounds, between=PROBE.measure, log=lambda m: print(m, flush=True))
    best = {k: arms.best(k) for k in entries}
    if hf is not None:
        hf.close()

    bws = {f"{mb} MB": PROBE.bandwidth(mb << 20) for mb in H.Probe.SIZES_MB}
    peak = PROBE.peak()
    rows = []
    for (name, backend, B), e in entries.items():
        rate = e["chars"] / best[(name, backend, B)]
        b = bound(cfg, B, ctx, peak) if e["bound"] is None else e["bound"](peak)
        rows.append({"row": name, "backend": backend, "batch": B, "mode": e["mode"], "threads": e["threads"],
                     "chars": e["chars"],
                     "seconds": best[(name, backend, B)], "chars_per_s": rate, "bound_chars_per_s": b,
                     "fraction_of_bound": rate / b, "compile_s": e["compile_s"],
                     "runs": arms.record((name, backend, B))})
    # the ratio to HF's row of the same batch and decision rule (HF at its best thread count)
    hf_rate = {(r["mode"], r["batch"]): r["chars_per_s"] for r in rows if r["backend"] == "torch"}
    for r in rows:
        same_work = r["chars"] == r["batch"] * n and r["backend"] != "torch"
        r["vs_hf"] = r["chars_per_s"] / hf_rate[r["mode"], r["batch"]] \
            if same_work and (r["mode"], r["batch"]) in hf_rate else None

    print(f"# best of {len(PROBE.peaks)} measurements: matmul peak {peak / 1e9:.0f} GFLOP/s; read "
          "bandwidth by working set: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bws.items()))
    print(f"# {n} characters after the prompt; fastest of {args.rounds} round(s)")
    print("| row | backend | batch | chars/s | bound | of bound | vs HF | compile s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        c = f"{r['compile_s']:.1f}" if r["compile_s"] is not None else ""
        v = f"{r['vs_hf']:.1f}x" if r["vs_hf"] else ""
        name = r["row"] + (f" ({r['threads']} thread{'s' if r['threads'] > 1 else ''})" if r["threads"] else "")
        print(f"| {name} | {r['backend']} | {r['batch']} | {r['chars_per_s']:,.0f} | "
              f"{r['bound_chars_per_s']:,.0f} | {r['fraction_of_bound']:.1%} | {v} | {c} |")
    book = next(r["chars_per_s"] for r in rows if r["row"].startswith("book loop"))
    for backend in lms:
        g1 = next((r["chars_per_s"] for r in rows
                   if r["row"] == "jaxdecode greedy" and r["backend"] == backend and r["batch"] == 1), None)
        if g1:
            print(f"# batch-1 greedy, {backend}: {g1 / book:.0f}x the book loop")
    if check is not None:
        print("\n".join(describe_check(check)))
    elapsed = time.perf_counter() - started
    print(f"# the whole run took {elapsed:.0f} s; load average at start {info['load_average'][0]:.2f}, "
          f"at end {H.load()[0]:.2f}")
    if args.out:
        H.write_json(args.out, {"command": H.command("benchmarks.bench_backends"), "machine": info,
                                "load_average_at_end": H.load(), "wall_s": elapsed, "matmul_peak_flops": peak,
                                "read_bandwidth": bws, "measurements": PROBE.record(),
                                "checkpoint": str(portable.path), "n": n, "prompt": PROMPT, "rounds": args.rounds,
                                "hf_check": check, "rows": rows})


if __name__ == "__main__":
    main()
