"""The engine tests' shared requests and references: a mix of requests every engine test runs,
what :func:`jaxdecode.generate` gives each alone, and the checks that an engine's report equals it
(tests/serving/)."""

import jax
import numpy as np

import jaxdecode
from jaxdecode import rules
from jaxdecode.io.vocab import Vocab
from jaxdecode.models.charlm.transformer import ModelConfig, init_params
from jaxdecode.models.checkpoint import LanguageModel
from jaxdecode.serving.engine import Request

HEAD = "abc dabc.gig hhe fa "  # 20 tokens of long_window_lm: a shared instruction, longer than REUSE_MIN


def long_window_lm(backend="portable"):
    """A random model with a window of 64 (V=12, the vocabulary `` abcdefghi.\\n``): room for prompts
    past the dense cache's prefix reuse minimum."""
    cfg = ModelConfig(V=12, T=64, d=32, L=2, heads=4)
    params = jax.tree_util.tree_map(lambda a: a * 3.0, init_params(cfg, jax.random.PRNGKey(42)))
    return LanguageModel(params=params, cfg=cfg, vocab=Vocab(" abcdefghi.\n"), meta={}, backend=backend)


def mixed_requests():
    """Six requests (T = 16): mixed samples, seeds, n, a stop string, greedy, per-sample settings,
    several settings of one chain, a part of it alone, and no rule. Prompts longer than the prefill
    chunk of the tests (4) are read in pieces. (The native backend is checked against generate by
    the serve-bench test, whose checkpoint loads on it.)"""
    chain = lambda theta, p: rules.chain(rules.repetition_penalty(theta), rules.top_p(p))
    return [
        Request("abc da", 9, seed=3, num_samples=2, rule=chain(1.3, 0.9)),
        Request("hi", 12, seed=1, greedy=True),
        Request("bad caf", 9, seed=7, num_samples=2, rule=chain(1.1, np.array([0.5, 1.0], np.float32))),
        Request("e", 12, seed=2, num_samples=2, stop="a"),
        Request("ga.", 10, seed=5, num_samples=2, rule=chain(1.5, 0.7)),
        Request("ccc dd", 10, seed=11, rule=rules.top_p(0.8)),
    ]


def generated_alone(lm, reqs):
    return [jaxdecode.generate(lm, r.prompt, r.n, seed=r.seed, num_samples=r.num_samples, rule=r.rule,
                               greedy=r.greedy, stop=r.stop) for r in reqs]


def assert_same(report, refs):
    assert len(report.results) == len(refs)
    for res, ref in zip(report.results, refs):
        assert len(res.outputs) == len(ref)
        for got, want in zip(res.outputs, ref):
            np.testing.assert_array_equal(got.tokens, want.tokens)
            assert got.text == want.text and got.finish_reason == want.finish_reason
            # the logits come from batches of other shapes: equal up to the last float32 unit
            np.testing.assert_allclose(got.model_logprobs, want.model_logprobs, rtol=0, atol=2e-6)
            np.testing.assert_allclose(got.sample_logprobs, want.sample_logprobs, rtol=0, atol=2e-6)


def assert_bench_texts_are_generates(doc, ckpt):
    """Every request of a serve-bench JSON report has the text and finish reason that
    ``jaxdecode.generate`` gives it alone (its rule rebuilt from the report's settings)."""
    lm = jaxdecode.load(ckpt)
    for r in doc["requests"]:
        rule = None if r["greedy"] else rules.chain(rules.temperature(r["rule"]["Temperature"]),
                                                     rules.top_p(r["rule"]["TopP"]))
        want = jaxdecode.generate(lm, r["prompt"], r["n"], seed=r["seed"], rule=rule, greedy=r["greedy"],
                                  stop=r["stop"])[0]
        assert r["text"] == want.text and r["finish_reason"] == want.finish_reason


def assert_pool_empty(engine):
    a = engine.allocator
    a.check()
    assert a.num_free == a.num_blocks and not a.sequences()
    assert all(a.refcount(b) == 0 for b in range(a.num_blocks))


def shared_prefix_requests():
    """Requests whose prompts start with one 8-token instruction (two full blocks), arriving after
    the first has written it, with several samples (the partly filled last prompt block is shared
    and copied on write) and rules with state (repetition penalty)."""
    head = "abc dabc"
    chain = rules.chain(rules.repetition_penalty(1.4), rules.top_p(0.9))
    return [
        Request(head + "e", 6, seed=4, num_samples=3, rule=chain),
        Request(head + "fg", 5, seed=9, num_samples=2, arrival=6.0),
        Request(head + "a.h", 4, seed=1, greedy=True, arrival=7.0),
        Request(head + "e", 6, seed=4, num_samples=2, rule=chain, arrival=8.0, stop="d"),
        Request("hi", 7, seed=2, arrival=8.0),
    ]
