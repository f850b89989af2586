"""Before/after speed of the public API, for comparing two versions of the library in one run.

Run it once per version, alternating, each with ``PYTHONPATH`` set to that version's source tree
(the corpus through ``$JAXDECODE_DATA``)::

    PYTHONPATH=/path/to/other/tree python -m benchmarks.bench_ab

It prints one JSON line: the machine (with its load) and the rows: sampling at batch 1
and 64 (greedy and top-p 0.9, 300 characters), beam search (k = 5) at 64 prompts, contrastive
search (k = 4) of 10 prompts, constrained exact mode search (seconds), and the continuous engine
with 32 slots serving 128 requests at once. Prompts are held-out text. Each row is the fastest of
its rounds, after one untimed call."""
import json
import os

import numpy as np

import jaxdecode
from benchmarks import harness as H
from jaxdecode import rules
from jaxdecode.serving.engine import Engine, Request

lm = jaxdecode.load()
text = open(os.environ["JAXDECODE_DATA"]).read()
held = text[int(len(text) * 0.9):]
rng = np.random.default_rng(0)
prompts = [held[s:s + 32] for s in rng.integers(0, len(held) - 40, 128)]

loads = {}


def t(fn, rounds):
    """The fastest of ``rounds`` calls after an untimed one, and the last call's result."""
    out = [fn()]
    arms = H.Arms()
    arms.add("arm", lambda: out.__setitem__(0, fn()))
    arms.run(rounds, log=lambda m: None)
    loads[len(loads)] = arms.record("arm")
    return arms.best("arm"), out[0]


rows = {}
for B in (1, 64):
    for name, kw in (("greedy", {"greedy": True}), ("top-p 0.9", {"rule": rules.top_p(0.9)})):
        secs, _ = t(lambda B=B, kw=kw: jaxdecode.generate(lm, prompts[:B], 300, seed=0, **kw), 3)
        rows[f"sampling batch {B} {name}"] = round(B * 300 / secs, 1)
secs, _ = t(lambda: jaxdecode.beam_generate(lm, prompts[:64], 120, 5), 2)
rows["beam k=5, 64 prompts"] = round(64 * 120 / secs, 1)
secs, _ = t(lambda: jaxdecode.contrastive_generate(lm, prompts[:10], 150, k=4, alpha=0.6), 2)
rows["contrastive k=4, 10 prompts"] = round(10 * 150 / secs, 1)
from jaxdecode import constraints as C
from jaxdecode.decoding.search import mode_search

con = C.compile_regex("(ROMEO|JULIET|KING HENRY)", lm.vocab)
def ms():
    for p in ("ROMEO:\n", "KATHARINA:\nMoved! in good time: "):
        mode_search(lm.decoder, lm.params, lm.vocab.encode(p), 80, constraint=con)
secs, _ = t(ms, 2)
rows["constrained mode search, 2 prompts (s)"] = round(secs, 3)
reqs = [Request(p, int(n), seed=i, rule=rules.chain(rules.temperature(0.9), rules.top_k(40)))
        for i, (p, n) in enumerate(zip(prompts, rng.integers(32, 129, 128)))]
def serve():
    return Engine(lm, 32).run(reqs)
secs, rep = t(serve, 2)
rows["engine continuous, 32 slots, 128 requests"] = round(sum(len(g.text) for r in rep.results for g in r.outputs) / secs, 1)
print(json.dumps({"machine": H.machine(), "rows": rows, "runs": list(loads.values())}))
