"""What a constraint costs: per-step time with and without one, at batch 1 and 64, on both
backends, and each pattern's compile time and table size.

    python -m benchmarks.bench_constraints [--n 256] [--rounds 3] [--out FILE]

The per-step rows time ``sample_tokens`` (top-p 0.9) for ``n`` characters after the KATHARINA
prompt, unconstrained and under ``[every character of the vocabulary]{n}`` (every token allowed at
every step and the only final state at ``n``, so no row stops early: the whole cost of the
mask, the stop rule and the automaton step, with the same number of steps). The rows are timed
in turn, in the same rounds, and each is the fastest of its rounds.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

from benchmarks import harness as H
from jaxdecode import constraints as C
from jaxdecode import rules
from jaxdecode.decoding.sampling import sample_tokens
from jaxdecode.io.vocab import Vocab
from jaxdecode.models import checkpoint

PROMPT = "KATHARINA:\nMoved! in good time: "
PATTERNS = {
    "speaker heading": "[A-Z]+( [A-Z]+)?:\n",
    "verse line, 6-10 words": "([A-Za-z]+ ){5,9}[A-Za-z]+[.,;!?]?\n",
    "choice of 7 names": "(PETRUCHIO|KATHARINA|BAPTISTA|HORTENSIO|GREMIO|TRANIO|BIANCA):",
    "bounded repetition [a-z ]{1,200}": "[a-z ]{1,200}",
    "a sonnet's 14 lines": "(([A-Za-z',;:.!?-]+ ){3,9}[A-Za-z',;:.!?-]+\n){14}",
}
JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                "age": {"type": "integer"}, "lines": {"type": "array",
                                                "items": {"type": "string"}, "maxItems": 3}},
               "required": ["name", "age"]}


def compile_rows(vocab, rounds: int) -> list[dict]:
    rows = []
    cases = [(name, lambda p=p: C.compile_regex(p, vocab)) for name, p in PATTERNS.items()]
    # the shipped vocabulary has no braces or quotes: the schema is compiled over a JSON-capable one
    json_vocab = Vocab(sorted(set(''.join(vocab.chars)) | set('{}[]"0123456789,:')))
    cases.append(("JSON schema (3 fields; 78-token vocabulary)", lambda: C.compile_json_schema(JSON_SCHEMA, json_vocab)))
    for name, make in cases:
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            c = make()
            best = min(best, time.perf_counter() - start)
        rows.append({"pattern": name, "regex": c.pattern[:120], "compile_ms": round(best * 1e3, 2),
                     "states": c.states, "V": c.V, "table_kib": round(c.nbytes / 1024, 1),
                     "min_tokens": c.min_tokens})
    return rows


def step_rows(n: int, batches, rounds: int) -> list[dict]:
    rule = rules.top_p(0.9)
    out = []
    lms = {b: checkpoint.load(backend=b) for b in ("native", "portable")}
    jobs = []
    for backend, lm in lms.items():
        # every character of the vocabulary, named (a [\s\S] class would make outlines-core build
        # the automaton over all of Unicode: gigabytes at n = 256)
        every = "[" + "".join("\\" + c if c in "\\]^-[" else c for c in lm.vocab.chars) + "]"
        free_c = C.compile_regex(f"{every}{{{n}}}", lm.vocab)
        prompt = lm.vocab.encode(PROMPT)
        for B in batches:
            for label, c in (("none", None), ("[every character]{n}", free_c)):
                jobs.append((backend, B, label, lm, [prompt] * B, c))
    # warm up (compile) every job, then time them in turn
    arms = H.Arms()
    for i, (_backend, _B, _label, lm, prompts, c) in enumerate(jobs):
        def run(lm=lm, prompts=prompts, c=c):
            res = sample_tokens(lm.decoder, lm.params, prompts, n, jax.random.PRNGKey(0), rule=rule, constraint=c)
            assert int(res.counts.min()) == n
            return res.tokens
        run()
        arms.add(i, run)
    arms.run(rounds, log=lambda m: print(m, file=sys.stderr))
    for i, (backend, B, label, _lm, _prompts, _c) in enumerate(jobs):
        t = arms.best(i)
        out.append({"backend": backend, "batch": B, "constraint": label, "seconds": round(t, 4),
                    "ms_per_step": round(t / n * 1e3, 3), "chars_per_s": round(B * n / t, 1),
                    "runs": arms.record(i)})
    for row in out:
        if row["constraint"] != "none":
            base = next(r for r in out if r["backend"] == row["backend"] and r["batch"] == row["batch"]
                        and r["constraint"] == "none")
            row["overhead"] = round(row["seconds"] / base["seconds"] - 1, 4)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=H.default_out("bench_constraints"), help="the result file ('' for none)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    start = time.perf_counter()
    lm = checkpoint.load(backend="portable")
    comp = compile_rows(lm.vocab, args.rounds)
    steps = step_rows(args.n, batches, args.rounds)
    doc = H.result("benchmarks.bench_constraints", argv, n=args.n, prompt=PROMPT, rule="top-p 0.9",
                   rounds=args.rounds, compile=comp, steps=steps, wall_s=round(time.perf_counter() - start, 1))
    print("| pattern | states | table | compile |")
    print("|---|---:|---:|---:|")
    for r in comp:
        print(f"| {r['pattern']} | {r['states']} | {r['table_kib']} KiB | {r['compile_ms']} ms |")
    print()
    print("| backend | batch | constraint | ms per step | chars/s | overhead |")
    print("|---|---:|---|---:|---:|---:|")
    for r in steps:
        oh = f"{100 * r['overhead']:+.1f}%" if "overhead" in r else ""
        print(f"| {r['backend']} | {r['batch']} | {r['constraint']} | {r['ms_per_step']} | {r['chars_per_s']:,.0f} | {oh} |")
    if args.out:
        H.write_json(args.out, doc)


if __name__ == "__main__":
    main()
