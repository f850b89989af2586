"""Wall-clock characters per second: speculative decoding against plain sampling.

For each batch size (default 1 and 32), plain ancestral sampling
(:func:`jaxdecode.decoding.sampling.sample_tokens`) and speculative sampling with each draft (trigram
table, interpolated 5-gram, distilled 6-gram, small draft model, prompt lookup) and each gamma
(default 1, 2, 4, 8), all with the same
target and no rule. Every configuration runs once to compile (its wall time is reported as the
warm-up; compile time is warm-up minus the fastest timed run), then ``--repeats`` rounds time
every configuration once each (the fastest round counts), so that a slow phase of the machine
hits every row alike. Rows of a batch continue the same prompt with different row ids; with
``--seeds N`` every configuration generates from N keys in turn (each timed on its own, the times
summed), since the acceptance path of one text is a noisy sample.

    python -m benchmarks.bench_speculative
    python -m benchmarks.bench_speculative --ckpt path/to/checkpoint --drafts ngram,lookup --batches 1

Prints a markdown table and writes the numbers as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from benchmarks import harness as H
from jaxdecode import speculative as SP
from jaxdecode.decoding import sampling
from jaxdecode.models import checkpoint

PROMPT = "KATHARINA:\nMoved! in good time: "


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=None, help="target checkpoint folder (default: the shipped model)")
    ap.add_argument("--draft-ckpt", default=checkpoint.DRAFT_NAME, help="draft model checkpoint")
    ap.add_argument("--data", default=None, help="corpus for the trigram draft")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--n", type=int, default=256, help="characters generated per row")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--gammas", default="1,2,4,8")
    ap.add_argument("--drafts", default="ngram,ngram:5:6,distilled,draft,lookup",
                    help="ngram (the chapter's trigram), ngram:N[:BETA] (order N, interpolated "
                         "backoff BETA), distilled (the target's predictions as a 6-gram table, "
                         "built once and cached), draft, lookup")
    ap.add_argument("--repeats", type=int, default=5, help="timing rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=4,
                    help="generate from this many keys (seed, seed + 1, ...), each timed on its own "
                         "and summed: one text's acceptance path is a noisy sample")
    ap.add_argument("--out", default=H.default_out("bench_speculative"), help="the result file ('' for none)")
    args = ap.parse_args(argv)

    lm = checkpoint.load(args.ckpt)
    batches = [int(b) for b in args.batches.split(",")]
    gammas = [int(g) for g in args.gammas.split(",")]
    kinds = [k for k in args.drafts.split(",") if k]
    prompt = lm.vocab.encode(args.prompt)
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    keys = [jax.random.PRNGKey(args.seed + i) for i in range(args.seeds)]

    drafts, skipped = {}, {}
    for kind in kinds:
        try:
            if kind == "draft":
                small = checkpoint.load(args.draft_ckpt)
                if small.vocab.chars != lm.vocab.chars:
                    raise ValueError("the draft model's vocabulary differs from the target's")
                drafts[kind] = SP.ModelDraft.from_lm(small)
            elif kind.startswith("ngram:"):  # ngram:N or ngram:N:BETA (interpolated backoff)
                parts = kind.split(":")
                drafts[kind] = SP.make_draft("ngram", lm, args.data, n=int(parts[1]),
                                             backoff=float(parts[2]) if len(parts) > 2 else None)
            else:
                drafts[kind] = SP.make_draft(kind, lm, args.data, progress=True)
        except Exception as e:  # noqa: BLE001 - report and bench the others
            skipped[kind] = f"{type(e).__name__}: {e}"
            print(f"skipping draft {kind!r}: {skipped[kind]}", file=sys.stderr)

    rows = []
    for B in batches:
        prompts = [prompt] * B
        configs = {("plain", None, None): lambda key, prompts=prompts: sampling.sample_tokens(
            lm.decoder, lm.params, prompts, args.n, key)}
        for kind, draft in drafts.items():
            for gamma in gammas:
                configs[("speculative", kind, gamma)] = (
                    lambda key, draft=draft, gamma=gamma, prompts=prompts: SP.speculative_tokens(
                        lm.decoder, lm.params, prompts, args.n, key, draft=draft, gamma=gamma))
        # Compile everything first, then time in rounds (every configuration and key once per
        # round, the fastest round of each counts): a slow phase of a shared machine then hits
        # all rows alike.
        warm, results, arms = {}, {}, H.Arms()
        for name, fn in configs.items():
            t0 = time.perf_counter()
            results[name] = [fn(keys[0])]
            warm[name] = time.perf_counter() - t0
            results[name] += [fn(k) for k in keys[1:]]
            for i, k in enumerate(keys):
                arms.add((name, i), lambda fn=fn, k=k: fn(k).tokens)
        arms.run(args.repeats, log=lambda m: print(m, file=sys.stderr))
        chars = B * args.n * len(keys)
        seconds = {name: sum(arms.best((name, i)) for i in range(len(keys))) for name in configs}
        plain_cps = chars / seconds[("plain", None, None)]
        for (method, kind, gamma), res in results.items():
            t = seconds[(method, kind, gamma)]
            cps = chars / t
            row = {"method": method, "draft": kind, "gamma": gamma, "batch": B, "seconds": t,
                   "warmup_seconds": warm[(method, kind, gamma)],
                   "compile_seconds": max(warm[(method, kind, gamma)] - t / len(keys), 0.0),
                   "chars_per_second": cps, "speedup": cps / plain_cps,
                   "mean_logprob": float(np.mean([r.model_logprobs for r in res])),
                   "load_before_first_and_after_last": [arms.runs[(method, kind, gamma), 0][0]["load_before"],
                                                        arms.runs[(method, kind, gamma), len(keys) - 1][-1]["load_after"]]}
            if method == "speculative":
                total = SP.SpeculativeStats.total([s for r in res for s in r.stats])
                row.update(acceptance_rate=total.acceptance_rate, chars_per_pass=total.chars_per_pass,
                           predicted_chars_per_pass=total.predicted_chars_per_pass)
            rows.append(row)
            print(f"{method} {kind or ''} gamma={gamma} B={B}: {cps:,.0f} chars/s ({cps / plain_cps:.2f}x)",
                  file=sys.stderr)

    lines = ["| method | draft | gamma | batch | chars/s | vs plain | compile s | alpha | chars/pass |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        spec = r["method"] == "speculative"
        lines.append("| {} | {} | {} | {} | {:,.0f} | {:.2f}x | {:.1f} | {} | {} |".format(
            r["method"], r["draft"] or "", r["gamma"] or "", r["batch"], r["chars_per_second"],
            r["speedup"], r["compile_seconds"],
            f"{r['acceptance_rate']:.2f}" if spec else "",
            f"{r['chars_per_pass']:.2f}" if spec else ""))
    print("\n".join(lines))
    if args.out:
        meta = {"checkpoint": str(lm.path), "n": args.n, "prompt": args.prompt, "repeats": args.repeats,
                "seed": args.seed, "seeds": args.seeds, "skipped_drafts": skipped}
        H.write_json(args.out, H.result("benchmarks.bench_speculative", argv, meta=meta, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
