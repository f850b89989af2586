"""Compiling an engine's programs before it serves (``Engine.warm_up``).

Which program shapes a run meets depends on timing (how many prompts start together, how long
the longest row is when a call runs, how many steps a call can take); after a warm-up no arrival
pattern may compile anything, and the warm-up itself changes nothing the engine serves."""

import pytest

from jaxdecode.models.checkpoint import LanguageModel
from jaxdecode.serving.engine import Engine, Request
from jaxdecode.serving.simulator import with_arrivals
from jaxdecode.serving import executors, warmup
from jaxdecode.serving.warmup import count_compiles

from support.engine import assert_pool_empty, assert_same, generated_alone, mixed_requests, shared_prefix_requests


@pytest.fixture(scope="module")
def lm_portable(tiny_model):
    cfg, params, vocab = tiny_model
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend="portable")


def _at_once(reqs):
    return [Request(r.prompt, r.n, seed=r.seed, num_samples=r.num_samples, rule=r.rule, greedy=r.greedy,
                    stop=r.stop) for r in reqs]


@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_after_a_warm_up_no_arrival_pattern_compiles(lm_portable, cache, monkeypatch):
    """Up to 2 decode steps a call (so calls of 1 and 2 steps)."""
    lm = lm_portable
    # dense steps attend over spans of 4 positions here (128 by default: one span in a window of 16),
    # so that the rows' lengths reach several spans
    for module in (executors, warmup):
        monkeypatch.setattr(module, "SPAN_BUCKET", 4)
    reqs = _at_once(shared_prefix_requests())  # two rule layouts, prefix hits, copies on write, stops
    refs = generated_alone(lm, reqs)
    kw = {"num_blocks": 9, "block_size": 4} if cache == "paged" else {}
    make = lambda: Engine(lm, 3, cache=cache, prefill_chunk=4, decode_steps=2, **kw)
    engine = make()
    assert engine.warm_up(reqs) > 0
    assert engine.idle and engine.warm_up(reqs) == 0  # everything is in jit's cache now
    # three arrival patterns on the wall clock: all at once (on the warmed engine itself, whose state
    # the warm-up left as it was), one at a time, and in pairs (fresh engines: programs are shared)
    spaced = with_arrivals(reqs, [0.004 * i for i in range(len(reqs))])
    pairs = with_arrivals(reqs, [0.01 * (i // 2) for i in range(len(reqs))])
    for run_on, stream in ((engine, reqs), (make(), spaced), (make(), pairs)):
        with count_compiles() as counted:
            report = run_on.run(stream)
        assert counted[0] == 0
        assert_same(report, refs)
        if cache == "paged":
            assert_pool_empty(run_on)


@pytest.mark.quick
def test_warm_up_keeps_a_pinned_layout_and_needs_an_idle_engine(lm_portable):
    from jaxdecode import rules

    lm = lm_portable
    reqs = _at_once(mixed_requests())
    pinned = rules.chain(rules.temperature(0.7), rules.top_k(5))
    fits = [r for r in reqs if r.rule is None or r.greedy]
    engine = Engine(lm, 2, layout=pinned)
    engine.warm_up(fits)
    assert_same(engine.run(fits), generated_alone(lm, fits))
    engine.submit(fits[0])
    with pytest.raises(ValueError, match="idle engine"):
        engine.warm_up(fits)
