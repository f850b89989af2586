"""The serving engine over the paged KV cache (``Engine(..., cache="paged")``).

Every request must get the tokens and text ``jaxdecode.generate`` gives it alone, whether its
prompt's leading blocks were found in the pool (prefix hits), its samples share the prompt's
blocks (fork, copy on write), or it waited for blocks in a pool too small for the whole load; and
when the run is over every block is back in the pool."""

import json

import numpy as np
import pytest

from jaxdecode import rules
from jaxdecode.models.checkpoint import LanguageModel
from jaxdecode.serving.engine import Engine, Request
from jaxdecode.serving.simulator import StepTimeModel, VirtualClock, simulate, with_arrivals

from support.engine import (
    assert_bench_texts_are_generates,
    assert_pool_empty,
    assert_same,
    generated_alone,
    mixed_requests,
    shared_prefix_requests,
)

UNIT = StepTimeModel(1.0, 0.0, 0.0)
BS = 4  # block size of the tests: the tiny model's window (16) is 4 blocks


@pytest.fixture(scope="module")
def lm_portable(tiny_model):
    cfg, params, vocab = tiny_model
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend="portable")


def _paged(lm, slots, num_blocks, **kw):
    return Engine(lm, slots, cache="paged", num_blocks=num_blocks, block_size=BS, clock=VirtualClock(UNIT),
                  **kw)


def test_paged_engine_matches_generate_with_prefix_hits_and_a_small_pool(lm_portable):
    lm = lm_portable
    reqs = mixed_requests() + with_arrivals(shared_prefix_requests(), [20.0, 26.0, 27.0, 28.0, 28.0])
    refs = generated_alone(lm, reqs)
    # a pool of 9 blocks for 3 slots: the load needs up to 3 x 4 blocks at once, so rows queue
    engine = _paged(lm, 3, 9, prefill_chunk=4)
    report = engine.run(reqs)
    assert_same(report, refs)
    cache = report.cache
    assert cache["block_waits"] > 0  # admissions really waited for blocks
    assert 0 < cache["peak_blocks"] <= 9
    # the later shared-prefix requests found the 8-token instruction in the pool (2 blocks each),
    # and ran only the rest of their prompts
    assert cache["prefix_hit_tokens"] >= 3 * 8
    prompt_tokens = sum(len(r.prompt) * r.num_samples for r in reqs)
    assert sum(s.prefill_tokens for s in report.steps) < prompt_tokens - cache["prefix_hit_tokens"] + 1
    assert_pool_empty(engine)
    assert engine.idle and engine.occupied == 0


@pytest.mark.parametrize("backend", ["portable", "native"])
def test_paged_multi_step_decoding_keeps_every_text(tiny_model, backend):
    """Up to 8 decode steps per device call on the paged cache, with prefix hits, samples that copy
    a shared block on write (at the reservation before a call), a pool too small for the whole load
    and rows that stop inside a call: the texts and log-probabilities are generate's, several calls
    ran more than one step, and every block comes back."""
    cfg, params, vocab = tiny_model
    lm = LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend=backend)
    reqs = mixed_requests() + with_arrivals(shared_prefix_requests(), [20.0, 26.0, 27.0, 28.0, 28.0])
    refs = generated_alone(lm, reqs)
    engine = _paged(lm, 3, 9, prefill_chunk=4, decode_steps=8)
    calls = []
    many = engine.executor.decode_many
    engine.executor.decode_many = lambda *a: calls.append(a[3]) or many(*a)
    report = engine.run(reqs)
    assert_same(report, refs)
    assert calls and max(calls) >= 4 and len(calls) >= 3
    assert report.cache["block_waits"] > 0 and report.cache["prefix_hit_tokens"] >= 3 * 8
    assert len([s for s in report.steps if s.active]) > len(calls)
    assert_pool_empty(engine)
    # the same load one step per call takes more engine steps and device calls, same outputs
    one = _paged(lm, 3, 9, prefill_chunk=4)
    assert_same(one.run(reqs), refs)
    assert_pool_empty(one)


@pytest.mark.parametrize("backend", [pytest.param("portable", marks=pytest.mark.slow), "native"])
def test_int8_pool_serves_close_to_the_float_pool(tiny_model, backend):
    """The quantized pool (kv_dtype="int8"): its bytes per position are the int8 values plus a
    float32 scale per head and position; its outputs do not depend on the schedule (one slot or
    three, several decode steps a call); against the float32 pool the tokens agree until the first
    greedy flip and the log-probabilities of the agreeing tokens stay within 0.05 nats."""
    cfg, params, vocab = tiny_model
    lm = LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend=backend)
    reqs = mixed_requests() + with_arrivals(shared_prefix_requests(), [20.0, 26.0, 27.0, 28.0, 28.0])
    runs = {}
    for name, kw in (("float", {}), ("int8", {"kv_dtype": "int8"}),
                     ("int8, one slot", {"kv_dtype": "int8", "decode_steps": 4})):
        slots = 1 if "one slot" in name else 3
        engine = _paged(lm, slots, 12, prefill_chunk=4, **kw)
        runs[name] = engine.run(reqs)
        assert_pool_empty(engine)
        hd = cfg.d // cfg.heads
        per = 2 * cfg.L * cfg.heads * ((hd + 4) if "int8" in name else 4 * hd)
        assert runs[name].cache["bytes_per_position"] == per, name
        assert runs[name].cache["kv_dtype"] == ("int8" if "int8" in name else "float32")
    outs = {name: [g for r in rep.results for g in r.outputs] for name, rep in runs.items()}
    for a, b in zip(outs["int8"], outs["int8, one slot"]):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.model_logprobs, b.model_logprobs, rtol=0, atol=1e-5)
    agree = differ = 0
    for f, q in zip(outs["float"], outs["int8"]):
        ft, qt = np.asarray(f.tokens), np.asarray(q.tokens)
        m = min(len(ft), len(qt))
        same = int(np.argmax(ft[:m] != qt[:m])) if np.any(ft[:m] != qt[:m]) else m
        np.testing.assert_allclose(np.asarray(q.model_logprobs)[:same], np.asarray(f.model_logprobs)[:same],
                                   rtol=0, atol=0.05)
        agree += same
        differ += int(np.any(np.asarray(q.model_logprobs)[:same] != np.asarray(f.model_logprobs)[:same]))
    assert agree >= 0.5 * sum(len(g.tokens) for g in outs["float"])
    assert differ > 0  # the pools really differ
    # the int8 dense cache: a pool of one block of the window per slot (the dense layout), the same
    # quantization, so the same tokens as the int8 pool in blocks of 4
    dense = Engine(lm, 3, kv_dtype="int8", prefill_chunk=4, clock=VirtualClock(UNIT))
    rep = dense.run(reqs)
    assert_pool_empty(dense)
    assert rep.cache["layout"] == "dense" and rep.cache["block_size"] == cfg.T and rep.cache["num_blocks"] == 3
    assert rep.cache["pool_bytes"] == 3 * cfg.T * runs["int8"].cache["bytes_per_position"]
    # (head_dim + 4 bytes of scale) per head and position against 4 * head_dim for float32
    assert rep.cache["pool_bytes"] * 4 * hd == rep.cache["contiguous_bytes"] * (hd + 4)
    for a, b in zip(outs["int8"], [g for r in rep.results for g in r.outputs]):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.model_logprobs, b.model_logprobs, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        _paged(lm, 3, 12, kv_dtype="int4")
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        Engine(lm, 3, kv_dtype="int4")
    with pytest.raises(ValueError, match="is a setting of the paged cache"):
        Engine(lm, 3, kv_dtype="int8", num_blocks=3)


def test_samples_share_the_prompt_blocks_and_copy_the_last_on_write(lm_portable):
    """Three samples of a 9-token prompt (blocks of 4: two full, one partly filled) generating 3
    tokens each (at most 11 positions: still three blocks a row): the prompt's 3 blocks are shared
    and two samples copy the partly filled one (the last writes into it in place): 5 blocks at the
    peak, where three separate rows take 9."""
    lm = lm_portable
    req = Request("abcdefgha", 3, seed=5, num_samples=3, rule=rules.top_p(0.95))
    engine = _paged(lm, 3, 12, prefill_chunk=16)
    report = engine.run([req])
    assert_same(report, generated_alone(lm, [req]))
    assert report.cache["peak_blocks"] == 5
    assert sum(s.prefill_tokens for s in report.steps) == 9  # one prefill for the three samples
    assert len({g.text for g in report.results[0].outputs}) > 1  # the samples really differ
    assert_pool_empty(engine)
    # a pool of 4 blocks cannot hold the three forks (5 blocks): the first sample starts alone; once
    # its prompt is written the others find its two full prompt blocks in the pool and compute
    # only the last prompt token, in a block of their own (one at a time: 3 + 1 blocks)
    one = _paged(lm, 3, 4, prefill_chunk=16)
    rep1 = one.run([req])
    assert_same(rep1, generated_alone(lm, [req]))
    assert rep1.steps[0].active == 1 and max(s.active for s in rep1.steps) == 2
    assert rep1.cache["block_waits"] > 0 and rep1.cache["peak_blocks"] == 4
    assert rep1.cache["prefix_hit_tokens"] == 2 * 8
    assert sum(s.prefill_tokens for s in rep1.steps) == 9 + 1 + 1
    assert_pool_empty(one)


@pytest.mark.quick
def test_a_pool_for_one_row_serves_rows_one_at_a_time(lm_portable):
    """A pool of 4 blocks holds one row of the full window: with three slots the rows are served
    one after another (each waits for the blocks of the one before), with the same outputs."""
    lm = lm_portable
    reqs = [Request("abc da", 10, seed=3, num_samples=2, rule=rules.top_p(0.9)),
            Request("ccc dd", 10, seed=11, rule=rules.top_p(0.8)), Request("hi", 14, seed=1, greedy=True)]
    engine = _paged(lm, 3, 4, prefill_chunk=4)
    report = engine.run(reqs)
    assert_same(report, generated_alone(lm, reqs))
    assert max(s.active for s in report.steps) == 1 and report.cache["block_waits"] > 0
    assert report.cache["peak_blocks"] == 4
    res = report.results
    assert res[0].finish < res[1].first_token and res[1].finish < res[2].first_token
    assert_pool_empty(engine)
    # the same load with room for every row runs them side by side
    roomy = _paged(lm, 3, 12, prefill_chunk=4)
    rep2 = roomy.run(reqs)
    assert_same(rep2, generated_alone(lm, reqs))
    assert max(s.active for s in rep2.steps) == 3 and rep2.cache["block_waits"] == 0
    assert rep2.summary()["seconds"] < report.summary()["seconds"]


def test_a_request_larger_than_the_pool_is_refused_at_submit(lm_portable):
    engine = _paged(lm_portable, 3, 2)  # 8 positions in all
    with pytest.raises(ValueError, match=r"request 0: prompt \(6 tokens\) \+ n \(4\) needs 3 blocks of 4 "
                                         r"positions per sample, more than the whole pool of 2 blocks"):
        engine.submit(Request("abc da", 4))
    with pytest.raises(ValueError, match="request 1: .*more than the whole pool of 2 blocks"):
        engine.run([Request("ab", 2), Request("abcdefgh", 2)])
    assert engine.idle and not engine.requests  # nothing was queued
    # the largest request that fits (8 positions: prompt + n - 1, the last token is never written)
    report = engine.run([Request("abc da", 3, seed=2, num_samples=2)])
    assert_same(report, generated_alone(lm_portable, [Request("abc da", 3, seed=2, num_samples=2)]))
    assert_pool_empty(engine)


@pytest.mark.quick
def test_paged_settings_are_checked_and_dense_stays_the_default(lm_portable):
    assert not Engine(lm_portable, 2).paged and Engine(lm_portable, 2).allocator is None
    with pytest.raises(ValueError, match="unknown cache 'pages'"):
        Engine(lm_portable, 2, cache="pages")
    with pytest.raises(ValueError, match="num_blocks is a setting of the paged cache"):
        Engine(lm_portable, 2, num_blocks=8)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        Engine(lm_portable, 2, cache="paged", block_size=0)
    default = Engine(lm_portable, 3, cache="paged", block_size=BS)
    assert default.allocator.num_blocks == 3 * 4  # as much memory as the dense cache by default


def test_paged_scheduling_in_the_simulator(lm_portable):
    """The simulator runs the paged engine's admission (its block allocator) without a model: a
    pool for one row serialises the same load that runs side by side in a larger one."""
    reqs = [Request("abc da", 9, seed=k) for k in range(3)]
    small = simulate(lm_portable, reqs, slots=3, policy="continuous", step_model=UNIT, cache="paged",
                     num_blocks=4, block_size=BS)
    large = simulate(lm_portable, reqs, slots=3, policy="continuous", step_model=UNIT, cache="paged",
                     num_blocks=12, block_size=BS)
    assert max(s.active for s in small.steps) == 1 and max(s.active for s in large.steps) == 3
    assert small.cache["peak_blocks"] == 4 and small.summary()["seconds"] > large.summary()["seconds"]


def test_serve_bench_paged_reports_cache_memory(tiny_ckpt, corpus_path, tmp_path, capsys):
    from jaxdecode.cli.app import main

    argv = ["serve-bench", "--ckpt", tiny_ckpt, "--data", corpus_path, "--requests", "4", "--rate", "2",
            "--slots", "3", "--n", "5", "--shared-prefix", "8", "--simulate", "--sweep", "2",
            "--prefill-chunk", "4", "--cache", "paged", "--block-size", "4", "--out", "", "--seed", "1"]
    assert main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["identical_outputs"] is True
    for run in doc["runs"]:
        cache = run["cache"]
        per = 2 * 2 * 32 * 4  # keys and values of one position: 2 layers of width 32, float32
        assert cache["contiguous_bytes"] == 3 * 16 * per  # slots x T
        assert cache["peak_bytes"] == cache["peak_blocks"] * 4 * per
        assert 0 < cache["peak_blocks"] <= cache["num_blocks"] == 3 * 4
    assert doc["runs"][1]["cache"]["prefix_hit_tokens"] >= 8  # the shared prefix, found in the pool
    assert_bench_texts_are_generates(doc, tiny_ckpt)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "paged KV cache" in out and "contiguous" in out and "prefix hits" in out
    np.testing.assert_equal(main(argv + ["--num-blocks", "1"]), 2)
    assert "more than the whole pool" in capsys.readouterr().err


def test_overlapped_calls_keep_every_text_and_return_every_block(lm_portable):
    """On a real clock the engine sends each device call before it reads the tokens of the one
    before (``overlap``): a row that meets a stop string is seen one call late (the token computed
    for it meanwhile is dropped), and a row leaves its slot and blocks as soon as the call that
    chooses its last token is sent. Texts and log-probabilities are still generate's, on both
    caches, one and several steps a call, with prefix hits, copies on write and a pool too small
    for the whole load; every block comes back."""
    lm = lm_portable
    reqs = [Request(r.prompt, r.n, seed=r.seed, num_samples=r.num_samples, rule=r.rule, greedy=r.greedy,
                    stop=r.stop) for r in mixed_requests() + shared_prefix_requests()]  # all arrive at once
    refs = generated_alone(lm, reqs)
    for cache, k in (("paged", 1), ("paged", 4), ("dense", 1), ("dense", 4)):
        kw = {"num_blocks": 9, "block_size": BS} if cache == "paged" else {}
        engine = Engine(lm, 3, cache=cache, prefill_chunk=4, decode_steps=k, **kw)
        assert engine.overlap
        in_flight, launch = [], engine._launch
        engine._launch = lambda start: in_flight.append(engine._inflight is not None) or launch(start)
        assert_same(engine.run(reqs), refs)
        assert sum(in_flight) >= len(in_flight) // 2  # most calls were sent while another was running
        assert engine.idle and engine._inflight is None
        if cache == "paged":
            assert_pool_empty(engine)
    assert not Engine(lm, 3, overlap=False).overlap and not _paged(lm, 3, 9).overlap  # virtual clock: off


def test_prefix_cache_counters_reach_the_metrics(lm_portable):
    """The server's loop over a paged engine: a prompt served twice is found in the prefix cache the
    second time, and ``/metrics``' counters say so (tokens looked up and found), with an eviction
    once other prompts need the cached blocks."""
    from jaxdecode.server.metrics import Metrics
    from jaxdecode.server.runner import EngineLoop

    def counters(m):
        text = m.render().decode()
        value = lambda name: float(next(line.split()[-1] for line in text.splitlines()
                                        if line.startswith(f"jaxdecode_prefix_cache_{name}_total ")))
        return value("queries"), value("hits"), value("evictions")

    engine = _paged(lm_portable, 2, 4)  # 4 blocks of 4: one window
    loop, metrics = EngineLoop(engine), Metrics()

    def serve(key, prompt):
        loop.submit(key, Request(prompt, 2, seed=1), True)
        for _ in range(100):
            loop.turn()
            metrics.add(loop.take_stats())
            if not loop.busy:
                return
        raise AssertionError("the request did not finish in 100 turns")

    serve("a", "abcdefghi")  # 9 tokens: two full blocks before the last token
    assert counters(metrics) == (8, 0, 0)
    serve("b", "abcdefghi")
    assert counters(metrics) == (16, 8, 0)
    serve("c", "ihgfedcbaihg")  # 12 tokens and 2 more: every block of the pool, the cached ones too
    queries, hits, evictions = counters(metrics)
    assert (queries, hits) == (24, 8) and evictions == 2
