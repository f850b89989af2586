"""What decoding costs on this machine: prefill against decode, throughput against batch size.

On each backend of the model (``native``, the C++ CPU layer, when :func:`jaxdecode.native.kernels.available`,
and ``portable``, the ``jax.numpy`` path; which ones ran is recorded):

1. **Prefill against decode, per token.** A prefill of a ``P``-token prompt (one jitted
   ``decoder.prefill``) divided by ``P``, against the per-token time of decode steps: greedy
   :func:`jaxdecode.decoding.sampling.sample_tokens` of ``n`` tokens after the same prompt at batch 1,
   minus the prefill, divided by ``n``. A prefill pass handles all ``P`` positions at once, so
   its time per token is far below a decode step's, which runs the whole model for one token.
2. **Throughput against batch size.** Characters per second of ``sample_tokens`` (sampling at
   temperature 1) for ``n`` tokens after ``B`` prompts of 32 tokens, ``B = 1, 2, 4, ..., 512``.
3. **Latency.** Time to first token (``sample_tokens`` of one token: the prefill and the first
   step) and time per output token (``(t(n) - t(1)) / (n - 1)``) at batch 1 and 64.

Prompts are random token ids drawn from the seed (the cost does not depend on the text). Every
configuration is run once to compile it, then timed up to ``repeats`` times (stopping once a
configuration has used ``budget_s`` seconds); the best time counts. The numbers are wall-clock
timings: a second run gives different ones (the JSON says so), unlike every other study.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.decoding.common import PROMPT_BUCKET, SPAN_BUCKET, round_up
from jaxdecode.decoding.sampling import sample_tokens
from jaxdecode.decoding.steps import prefill  # the sampling loop's own jitted prefill, timed here
from jaxdecode.io.reports import (
    fmt,
    md_table,
    new_figure,
    output_folder,
    progress_bar,
    save_figure,
    write_json,
    write_markdown,
)

NAME = "cost"
BATCH_SIZES = tuple(2 ** i for i in range(10))  # 1 .. 512
PROMPT_LENGTHS = (32, 128, 256)
THROUGHPUT_PROMPT = 32
LATENCY_BATCHES = (1, 64)
N = 64
NOTE = ("wall-clock timings on this machine (best of a few runs after a compiling run): "
        "a second run gives different numbers, unlike the other studies")



def best_time(fn, repeats: int = 3, budget_s: float = 1.0) -> float:
    """Call ``fn`` once (to compile), then time it up to ``repeats`` times, stopping once the
    timed calls have taken ``budget_s`` seconds; the best time in seconds. ``fn`` must block
    until its work is done."""
    fn()
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if sum(times) >= budget_s:
            break
    return min(times)


def machine() -> dict:
    """The machine and software the timings come from."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    import jaxlib

    return {"processor": platform.processor(), "cpu_model": cpu, "machine": platform.machine(),
            "system": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", ""),
            "jax_backend": jax.default_backend(), "device": jax.devices()[0].device_kind}


def backends(lm) -> tuple[list[tuple[str, object]], str]:
    """The models to time, ``[(backend, lm)]``, and why these: native (when available) and
    portable for the reference transformer, else the model as given."""
    from jaxdecode.native import kernels

    if getattr(lm, "cfg", None) is None:
        return [(lm.decoder.backend, lm)], "the model's own decoder (not the reference transformer)"
    if (lm.meta or {}).get("format") == "huggingface":
        return [(lm.decoder.backend, lm)], f"a Hugging Face folder: the path it was loaded on ({lm.decoder.backend})"
    if kernels.available():
        return ([("native", lm.with_backend("native")), ("portable", lm.with_backend("portable"))],
                "native and portable")
    return ([("portable", lm.with_backend("portable"))],
            f"portable only: the native CPU layer is unavailable (JAX on {jax.default_backend()})")


def _prompts(rng, V: int, B: int, P: int) -> list[np.ndarray]:
    return [rng.integers(0, V, size=P).astype(np.int32) for _ in range(B)]


def prefill_vs_decode(lm, lengths: Sequence[int], n: int, rng, key, timer, bar=None) -> list[dict]:
    """Per prompt length ``P``: prefill time per token and decode time per token (batch 1)."""
    model, rows = lm.decoder, []
    for P in lengths:
        prompt = _prompts(rng, model.V, 1, P)[0]
        width = min(round_up(P, PROMPT_BUCKET), model.T)
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :P] = prompt
        tokens, lens = jnp.asarray(tokens), jnp.asarray([P], jnp.int32)
        params = model.prepare(lm.params, 1)
        cap = round_up(min(model.T, P + n) + n, SPAN_BUCKET)
        t_pre = timer(lambda: jax.block_until_ready(
            prefill(params, tokens, lens, model=model, capacity=cap)))
        t_gen = timer(lambda: sample_tokens(model, lm.params, [prompt], n, key, greedy=True))
        rows.append({"prompt_length": P, "prefill_s": t_pre, "generate_s": t_gen,
                     "prefill_ms_per_token": 1e3 * t_pre / P,
                     "decode_ms_per_token": 1e3 * max(t_gen - t_pre, 0.0) / n})
        if bar is not None:
            bar.update(1)
    return rows


def throughput(lm, batch_sizes: Sequence[int], n: int, P: int, rng, key, timer, bar=None) -> list[dict]:
    """Per batch size ``B``: characters per second of sampling ``n`` tokens after ``B`` prompts."""
    rows = []
    for B in batch_sizes:
        prompts = _prompts(rng, lm.decoder.V, B, P)
        t = timer(lambda: sample_tokens(lm.decoder, lm.params, prompts, n, key))
        rows.append({"batch": B, "seconds": t, "chars_per_s": B * n / t})
        if bar is not None:
            bar.update(1)
    return rows


def latency(lm, batches: Sequence[int], n: int, P: int, rng, key, timer, bar=None) -> list[dict]:
    """Per batch size: time to first token and time per output token, in milliseconds."""
    rows = []
    for B in batches:
        prompts = _prompts(rng, lm.decoder.V, B, P)
        t1 = timer(lambda: sample_tokens(lm.decoder, lm.params, prompts, 1, key))
        tn = timer(lambda: sample_tokens(lm.decoder, lm.params, prompts, n, key))
        rows.append({"batch": B, "prompt_length": P, "ttft_ms": 1e3 * t1,
                     "tpot_ms": 1e3 * max(tn - t1, 0.0) / (n - 1), "total_ms": 1e3 * tn})
        if bar is not None:
            bar.update(1)
    return rows


def _check(T: int, n: int, lengths, batch_sizes, latency_batches, P: int) -> None:
    if n < 2:
        raise ValueError(f"the cost study needs n >= 2 new tokens, got {n}")
    for name, values in (("prompt lengths", lengths), ("batch sizes", batch_sizes),
                         ("latency batch sizes", latency_batches)):
        if not values or any(int(v) < 1 for v in values):
            raise ValueError(f"the cost study needs positive {name}, got {list(values)}")
    longest = max([*lengths, P])
    if longest + n > T:
        raise ValueError(f"a prompt of {longest} tokens and n={n} new ones exceed the model's window "
                         f"T={T} (past it decoding switches to the window mode)")


def _plot_throughput(result: dict, path) -> None:
    from matplotlib.ticker import NullLocator

    fig, axes = new_figure(1, 1, figsize=(6, 4))
    ax = axes[0, 0]
    for name, res in result["backends"].items():
        rows = res["throughput"]
        ax.plot([r["batch"] for r in rows], [r["chars_per_s"] for r in rows], "o-", label=name)
    bs = result["settings"]["batch_sizes"]
    ax.set_ylim(bottom=0)
    unit = result.get("unit", "character")
    ax.set(xscale="log", xlabel="batch size (rows)", ylabel=f"{unit}s per second",
           title=f"sampling throughput, {result['settings']['n']} {unit}s per row")
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def _plot_tokens(result: dict, path) -> None:
    from matplotlib.ticker import NullLocator

    fig, axes = new_figure(1, 1, figsize=(6, 4))
    ax = axes[0, 0]
    for (name, res), color in zip(result["backends"].items(), ("tab:blue", "tab:orange", "tab:green")):
        rows = res["prefill_vs_decode"]
        P = [r["prompt_length"] for r in rows]
        ax.plot(P, [r["decode_ms_per_token"] for r in rows], "o-", color=color, label=f"{name}: decode step")
        ax.plot(P, [r["prefill_ms_per_token"] for r in rows], "s--", color=color, label=f"{name}: prefill")
    ax.set(xscale="log", yscale="log", xlabel="prompt length P (tokens)", ylabel="milliseconds per token",
           title="prefill against decode, batch 1")
    lengths = result["settings"]["prompt_lengths"]
    ax.set_xticks(lengths, [str(p) for p in lengths])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def _markdown(result: dict) -> str:
    m, s, unit = result["machine"], result["settings"], result.get("unit", "character")
    names = list(result["backends"])
    parts = ["# What decoding costs\n",
             f"**Timings, not reproducible numbers**: {NOTE}. Machine: {m['cpu_model'] or m['processor']} "
             f"({m['cpu_count']} cores), JAX {m['jax']} on {m['jax_backend']}; backends: "
             f"{result['backends_note']}. Model `{result['checkpoint']}` "
             f"({result['parameters']:,} parameters).\n",
             f"## Throughput ({s['n']} {unit}s after {s['throughput_prompt']}-token prompts, "
             "sampling)\n"]
    by_batch = {name: {r["batch"]: r for r in result["backends"][name]["throughput"]} for name in names}
    parts.append(md_table(["batch"] + [f"{n} {unit}s/s" for n in names],
                          [[b] + [fmt(by_batch[n][b]["chars_per_s"], ",.0f") for n in names]
                           for b in s["batch_sizes"]]) + "\n")
    parts.append(f"![throughput against batch size]({NAME}_throughput.png)\n")
    parts.append(f"## Prefill against decode (batch 1, greedy, {s['n']} decode steps)\n")
    by_len = {name: {r["prompt_length"]: r for r in result["backends"][name]["prefill_vs_decode"]}
              for name in names}
    heads = ["prompt length"] + [h for n in names for h in (f"{n} prefill ms/token", f"{n} decode ms/token")]
    parts.append(md_table(heads, [[P] + [c for n in names for c in (
        fmt(by_len[n][P]["prefill_ms_per_token"], ".3f"), fmt(by_len[n][P]["decode_ms_per_token"], ".3f"))]
        for P in s["prompt_lengths"]]) + "\n")
    parts.append(f"![prefill and decode time per token]({NAME}_tokens.png)\n")
    parts.append(f"## Latency ({s['throughput_prompt']}-token prompts, {s['n']} {unit}s)\n")
    parts.append(md_table(["backend", "batch", "time to first token (ms)", "time per output token (ms)"],
                          [[n, r["batch"], fmt(r["ttft_ms"]), fmt(r["tpot_ms"], ".3f")]
                           for n in names for r in result["backends"][n]["latency"]]))
    return "\n".join(parts)


def run(lm, out_dir, *, seed: int = 0, data_path=None, progress: bool = True, n: int = N,
        batch_sizes: Sequence[int] = BATCH_SIZES, prompt_lengths: Sequence[int] = PROMPT_LENGTHS,
        latency_batches: Sequence[int] = LATENCY_BATCHES, throughput_prompt: int = THROUGHPUT_PROMPT,
        repeats: int = 3, budget_s: float = 1.0) -> dict:
    """All three measurements on every backend; writes ``cost.json``, ``cost_throughput.png``,
    ``cost_tokens.png`` and ``cost.md``. The default prompt lengths longer than the window allows
    (with ``n``) give way to the longest that fits. ``seed`` draws the prompts and the sampling key;
    ``data_path`` is accepted for a uniform interface (no corpus is read)."""
    if prompt_lengths is PROMPT_LENGTHS and max(PROMPT_LENGTHS) + n > lm.decoder.T:
        # a smaller window (a subword model's): the defaults that fit, and the longest prompt that does
        prompt_lengths = sorted({p for p in PROMPT_LENGTHS if p + n <= lm.decoder.T} | {lm.decoder.T - n})
    batch_sizes, prompt_lengths = [int(b) for b in batch_sizes], [int(p) for p in prompt_lengths]
    latency_batches = [int(b) for b in latency_batches]
    _check(lm.decoder.T, n, prompt_lengths, batch_sizes, latency_batches, throughput_prompt)
    out = output_folder(out_dir)
    models, why = backends(lm)
    timer = functools.partial(best_time, repeats=repeats, budget_s=budget_s)
    key = jax.random.PRNGKey(seed)
    per = {}
    steps = len(models) * (len(prompt_lengths) + len(batch_sizes) + len(latency_batches))
    with progress_bar(steps, NAME, progress) as bar:
        for name, m in models:
            bar.set_postfix_str(name)
            rng = np.random.default_rng(seed)  # the same prompts on every backend
            per[name] = {
                "prefill_vs_decode": prefill_vs_decode(m, prompt_lengths, n, rng, key, timer, bar),
                "throughput": throughput(m, batch_sizes, n, throughput_prompt, rng, key, timer, bar),
                "latency": latency(m, latency_batches, n, throughput_prompt, rng, key, timer, bar),
            }
    ckpt = getattr(lm, "path", None)
    doc = {"study": NAME, "deterministic": False, "note": NOTE, "seed": seed, "machine": machine(),
           "checkpoint": None if ckpt is None else ckpt.name,
           "parameters": int(sum(np.size(a) for a in jax.tree_util.tree_leaves(lm.params))),
           "backends_note": why, "unit": "token" if getattr(lm.vocab, "subword", False) else "character",
           "settings": {"n": n, "batch_sizes": batch_sizes, "prompt_lengths": prompt_lengths,
                        "latency_batches": latency_batches, "throughput_prompt": throughput_prompt,
                        "repeats": repeats, "budget_s": budget_s},
           "backends": per}
    result = write_json(out / f"{NAME}.json", doc)
    _plot_throughput(result, out / f"{NAME}_throughput.png")
    _plot_tokens(result, out / f"{NAME}_tokens.png")
    write_markdown(out / f"{NAME}.md", _markdown(result))
    result["files"] = [str(out / f) for f in (f"{NAME}.json", f"{NAME}_throughput.png", f"{NAME}_tokens.png",
                                              f"{NAME}.md")]
    return result
