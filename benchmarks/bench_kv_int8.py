"""The int8 KV cache: memory, and what it costs in log-probability on the shipped model.

Memory: the bytes one position of every layer takes in a float32 pool and in an int8 pool (int8
values and a float32 scale per head and position), and how many more slots the same memory holds.

Quality: the shipped model runs over text through its paged form (``pool_forward``: every
position attends over keys and values read back from the pool, as a decode step does), once with a
float32 pool and once with an int8 pool, and the mean log-probability per character is compared:

- ``held-out``: ``--windows`` windows of the window ``T`` characters from the held-out split;
- ``study prompts``: the 24 held-out prompts of the studies
  (:func:`jaxdecode.eval.studies.beam_curse.heldout_prompts`), each followed by the held-out text's
  own next ``--n`` characters (only those are scored), and by the model's greedy continuation of
  ``--n`` characters (decoded with the float32 cache).

    python -m benchmarks.bench_kv_int8
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecode
from benchmarks import harness as H
from jaxdecode.cli.bench import heldout_text
from jaxdecode.eval.studies.beam_curse import heldout_prompts

BLOCK = 16


def logprobs(lm, paged, pool_dtype, rows: list[np.ndarray]) -> list[np.ndarray]:
    """Per row (token ids), the log-probability of each token after the first, through a fresh
    pool of ``pool_dtype``."""
    T = paged.T
    W = max(len(r) for r in rows)
    assert W <= T
    B = len(rows)
    m = paged.blocks_for(T)
    tokens = np.zeros((B, W), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    counts = np.array([len(r) for r in rows], np.int32)
    tables = np.arange(B * m, dtype=np.int32).reshape(B, m)
    pool = paged.empty_pool(B * m, pool_dtype)
    fwd = jax.jit(lambda params, pool, tokens, counts: paged.pool_forward(
        params, pool, tables, jnp.zeros((B,), jnp.int32), tokens, counts)[0])
    logits = fwd(paged.prepare(lm.params, B), pool, tokens, counts)
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return [lp[b, np.arange(len(r) - 1), r[1:]] for b, r in enumerate(rows)]


def compare(lm, paged, rows, scored_from) -> dict:
    f = logprobs(lm, paged, jnp.float32, rows)
    q = logprobs(lm, paged, "int8", rows)
    fs = np.concatenate([a[s - 1:] for a, s in zip(f, scored_from)])
    qs = np.concatenate([a[s - 1:] for a, s in zip(q, scored_from)])
    return {"characters": int(fs.size), "float32_mean_logprob": round(float(fs.mean()), 5),
            "int8_mean_logprob": round(float(qs.mean()), 5),
            "change_per_char": round(float(qs.mean() - fs.mean()), 5),
            "mean_abs_change_per_char": round(float(np.abs(qs - fs).mean()), 5),
            "max_abs_change": round(float(np.abs(qs - fs).max()), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--out", default=H.default_out("bench_kv_int8"), help="the result file ('' for none)")
    args = ap.parse_args()

    lm = jaxdecode.load()
    dec = lm.decoder
    paged = dec.paged(BLOCK, "native" if dec.backend == "native" else "portable")
    c = dec.cfg
    f32, i8 = paged.empty_pool(1, jnp.float32), paged.empty_pool(1, "int8")
    per_f, per_q = f32.nbytes // BLOCK, i8.nbytes // BLOCK
    result = {**H.result("benchmarks.bench_kv_int8"), "backend": dec.backend, "model": {"d": c.d, "L": c.L, "heads": c.heads, "T": c.T},
              "memory": {"float32_bytes_per_position": per_f, "int8_bytes_per_position": per_q,
                         "slots_ratio": round(per_f / per_q, 3),
                         "float32_bytes_per_slot": per_f * c.T, "int8_bytes_per_slot": per_q * c.T}}

    held = heldout_text(lm)
    ids = np.asarray(lm.vocab.encode(held))
    starts = np.linspace(0, len(ids) - c.T - 1, args.windows).astype(int)
    windows = [ids[s:s + c.T] for s in starts]
    result["held_out"] = compare(lm, paged, windows, [1] * len(windows))

    prompts = heldout_prompts(held)
    human, greedy, cut = [], [], []
    gens = jaxdecode.generate(lm, prompts, args.n, greedy=True)
    for p, g in zip(prompts, gens):
        at = held.index(p) + len(p)
        pid = np.asarray(lm.vocab.encode(p))
        human.append(np.concatenate([pid, np.asarray(lm.vocab.encode(held[at:at + args.n]))]))
        greedy.append(np.concatenate([pid, np.asarray(g.tokens)]))
        cut.append(len(pid))
    result["study_prompts_human"] = compare(lm, paged, human, cut)
    result["study_prompts_greedy"] = compare(lm, paged, greedy, cut)
    print(json.dumps(result, indent=1))
    if args.out:
        H.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
