"""The serving engine (continuous batching), its scheduler simulator and ``jaxdecode serve-bench``.

The engine must give every request the tokens and text ``jaxdecode.generate`` gives it alone (and
its log-probabilities up to the last float32 unit), whatever the arrival order, the slot count and
the requests it shares the batch with."""

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode import rules
from jaxdecode.models.checkpoint import LanguageModel
from jaxdecode.serving.engine import Engine, Request, neutral_rule
from jaxdecode.serving.simulator import (
    ReplayExecutor,
    StepTimeModel,
    VirtualClock,
    poisson_arrivals,
    simulate,
    with_arrivals,
)

from support.engine import assert_bench_texts_are_generates, assert_same, generated_alone, mixed_requests


@pytest.fixture(scope="module")
def lm_portable(tiny_model):
    cfg, params, vocab = tiny_model
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend="portable")


@pytest.mark.quick
def test_engine_matches_generate_any_order_and_slots(lm_portable):
    lm = lm_portable
    reqs = mixed_requests()
    refs = generated_alone(lm, reqs)
    assert any(g.finish_reason == "stop" for g in refs[3])  # the stop string is exercised
    rng = np.random.default_rng(0)
    for slots, orders in ((2, 2), (3, 1)):
        for _ in range(orders):
            # arrivals in a random order, on a virtual clock: the schedule differs run to run
            perm = rng.permutation(len(reqs))
            arrivals = np.empty(len(reqs))
            arrivals[perm] = np.cumsum(rng.exponential(2.0, len(reqs)))
            engine = Engine(lm, slots, prefill_chunk=4, clock=VirtualClock(StepTimeModel(1.0, 0.0, 0.0)))
            report = engine.run(with_arrivals(reqs, arrivals))
            assert_same(report, refs)
            assert engine.occupied == 0 and engine.idle
            assert max(s.active for s in report.steps) <= slots
            assert any(s.active == slots for s in report.steps)  # rows really shared the batch
            for res in report.results:
                assert res.arrival == pytest.approx(arrivals[res.index])
                assert res.first_token > res.arrival and res.finish >= res.first_token
    # on the wall clock: the engine sleeps until each arrival
    engine = Engine(lm, 2, prefill_chunk=4)
    report = engine.run(with_arrivals(reqs, np.linspace(0.0, 0.25, len(reqs))))
    assert_same(report, refs)
    for res in report.results:
        assert res.first_token > res.arrival >= 0.0 and res.finish >= res.first_token
    assert report.results[-1].first_token > 0.25 and engine.idle


@pytest.mark.parametrize("backend", ["portable", "native"])
def test_multi_step_decoding_keeps_every_text(tiny_model, backend):
    """Up to 8 decode steps per device call: the same texts and log-probabilities as generate, with
    rows that stop inside a call; several calls really ran more than one step."""
    cfg, params, vocab = tiny_model
    lm = LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend=backend)
    reqs = mixed_requests()
    refs = generated_alone(lm, reqs)
    engine = Engine(lm, 3, prefill_chunk=4, decode_steps=8, clock=VirtualClock(StepTimeModel(1.0, 0.0, 0.0)))
    calls, single = [], []
    many, one = engine.executor.decode_many, engine.executor.decode
    engine.executor.decode_many = lambda *a: calls.append(a[3]) or many(*a)
    engine.executor.decode = lambda *a: single.append(1) or one(*a)
    report = engine.run(reqs)
    assert_same(report, refs)
    assert calls and max(calls) == 8 and single and engine.idle
    # the steps of a multi-step call are recorded one by one
    assert len([s for s in report.steps if s.active]) == sum(calls) + len(single)


@pytest.mark.parametrize("cache", ["dense", "paged"])
@pytest.mark.parametrize("backend", ["portable", "native"])
def test_rows_reach_the_window_inside_a_multi_step_call(tiny_model, backend, cache):
    """A call of 8 steps runs past the end of rows with fewer tokens left (each stops at its own
    n inside the call), among them rows whose prompt and n fill the window T = 16 exactly: every
    text, and every neighbour's, is still generate's."""
    cfg, params, vocab = tiny_model
    lm = LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend=backend)
    reqs = [Request("abcd", 12, seed=4, num_samples=2),  # 4 + 12 = T
            Request("hi", 5, seed=1, greedy=True),
            Request("e", 15, seed=2, num_samples=2),  # 1 + 15 = T
            Request("ccc dd", 3, seed=11, rule=rules.top_p(0.8)),
            Request("gab", 13, seed=6, greedy=True)]  # 3 + 13 = T
    refs = generated_alone(lm, reqs)
    kw = {"cache": "paged", "block_size": 4} if cache == "paged" else {}
    engine = Engine(lm, 3, decode_steps=8, clock=VirtualClock(StepTimeModel(1.0, 0.0, 0.0)), **kw)
    calls = []
    many = engine.executor.decode_many
    engine.executor.decode_many = lambda *a, **k: calls.append(a[3]) or many(*a, **k)
    assert_same(engine.run(reqs), refs)
    assert max(calls) == 8


@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_prefill_budget_bounds_the_prompt_tokens_of_a_step(lm_portable, cache):
    """With a prefill budget of 5 tokens (pieces of up to 4) every step reads at most 5 prompt
    tokens; rows past it wait for a later step (some first token comes later), and every text is
    still generate's. Without the budget the first step reads more than 5 prompt tokens."""
    lm = lm_portable
    reqs = mixed_requests()
    refs = generated_alone(lm, reqs)
    kw = {"cache": "paged", "num_blocks": 12, "block_size": 4} if cache == "paged" else {}
    free = Engine(lm, 4, prefill_chunk=4, clock=VirtualClock(StepTimeModel(1.0, 0.0, 0.0)), **kw)
    rep_free = free.run(reqs)
    assert_same(rep_free, refs)
    assert rep_free.steps[0].prefill_tokens > 5
    engine = Engine(lm, 4, prefill_chunk=4, prefill_budget=5, clock=VirtualClock(StepTimeModel(1.0, 0.0, 0.0)),
                    **kw)
    report = engine.run(reqs)
    assert_same(report, refs)
    assert all(s.prefill_tokens <= 5 for s in report.steps)
    assert engine.idle
    # a row past the budget waited: some request saw its first token later than without the budget
    ttft = lambda rep: [r.first_token for r in rep.results]
    assert any(a > b for a, b in zip(ttft(report), ttft(rep_free)))
    with pytest.raises(ValueError, match="prefill_budget"):
        Engine(lm, 4, prefill_budget=0)


@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_admit_batch_lets_rows_in_line_join_together(lm_portable, cache):
    """With ``admit_batch=2`` (3 slots, 8 requests of different lengths), once rows run, the rows in
    line join two at a time (or all of them when fewer wait), where ``admit_batch=1`` lets one join
    alone; every text is still generate's."""
    lm = lm_portable
    lengths = [("abc", 3), ("hi", 5), ("e", 8), ("ga.", 4), ("bad", 6), ("cc", 7), ("d", 3), ("fig", 5)]
    reqs = [Request(p, n, seed=i, rule=rules.top_p(0.9) if i % 2 else None)
            for i, (p, n) in enumerate(lengths)]
    refs = generated_alone(lm, reqs)
    kw = {"cache": "paged", "block_size": 4} if cache == "paged" else {}
    joins = {}
    for m in (1, 2):
        engine = Engine(lm, 3, prefill_chunk=4, decode_steps=4, admit_batch=m,
                        clock=VirtualClock(StepTimeModel(1.0, 0.0, 0.0)), **kw)
        admit, seen = engine.executor.admit, []
        # (rows joining, rows in line before, rows running before): joins while others run
        engine.executor.admit = lambda entries, e=engine, a=admit, seen=seen: seen.append(
            (len(entries), len(e._waiting) + len(entries), e.occupied - len(entries))) or a(entries)
        assert_same(engine.run(reqs), refs)
        assert engine.idle and (not engine.paged or engine.block_waits == 0)
        joins[m] = [(k, line) for k, line, running in seen if running]
    assert any(k == 1 and line > 1 for k, line in joins[1])  # one joined alone, another waiting
    assert joins[2] and all(k >= min(2, line) for k, line in joins[2])
    for bad, message in ((0, "admit_batch must be an integer >= 1"),
                         (4, r"admit_batch must be at most the slots \(3\)")):
        with pytest.raises(ValueError, match=message):
            Engine(lm, 3, admit_batch=bad)


@pytest.mark.quick
def test_neutral_settings_leave_logits_exactly_unchanged():
    V = 12
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, V)) * 3.0
    logits = logits.at[1, 3].set(-jnp.inf).at[2, :5].set(-jnp.inf).at[3].set(1.5)  # removed tokens, a flat row
    prompt = jnp.array([[1, 2, 2, 0], [3, 3, 3, 3], [4, 5, 0, 0], [7, 0, 0, 0]], jnp.int32)
    lengths = jnp.array([3, 4, 2, 1])
    kinds = [rules.temperature(0.5), rules.top_k(3), rules.top_p(0.5), rules.min_p(0.2), rules.typical(0.5),
             rules.epsilon(0.1), rules.eta(0.1), rules.repetition_penalty(1.5), rules.frequency_penalty(0.7),
             rules.presence_penalty(0.7),
             # the logit controls, whose settings hold a value per token
             rules.logit_bias(np.linspace(-3, 3, V, dtype=np.float32)),
             rules.allowed_tokens(np.arange(V) % 3 != 0), rules.bad_words([[3], [1, 4]]),
             rules.min_tokens(2, np.arange(V) >= 8)]
    @jax.jit
    def applied(rule, logits):
        state = rule.init(prompt, lengths, V, 4)
        state = rule.update(state, jnp.array([1, 3, 4, 7]))  # seen and counted tokens
        return rule.apply(logits, state)

    for part in kinds:
        out = applied(neutral_rule(part, V), logits)
        assert np.asarray(out).tobytes() == np.asarray(logits).tobytes(), type(part).__name__
        assert not np.array_equal(np.asarray(applied(part, logits)), np.asarray(logits)), type(part).__name__
    assert neutral_rule(rules.top_n_sigma(1.0), V) is None and neutral_rule(rules.no_repeat_ngram(2), V) is None


def test_rule_state_width_does_not_change_ngram_blocking():
    """The engine keeps every slot's rule state at one width (the prompt padded to T, no room past
    it), generate sizes it per request: n-gram blocking, the one rule whose state has that width,
    bans the same tokens either way."""
    V, T = 12, 16
    prompt = jnp.array([[1, 2, 1, 3, 0], [4, 4, 5, 0, 0]], jnp.int32)
    lengths = jnp.array([4, 3])
    logits = jax.random.normal(jax.random.PRNGKey(1), (2, V))

    @functools.partial(jax.jit, static_argnames=("width", "max_new"))
    def run(rule, *, width, max_new):
        state = rule.init(jnp.pad(prompt, ((0, 0), (0, width - prompt.shape[1]))), lengths, V, max_new)
        outs = []
        for tok in ([2, 5], [1, 4], [2, 5]):
            outs.append(rule.apply(logits, state))
            state = rule.update(state, jnp.array(tok))
        return jnp.stack(outs)

    rule = rules.no_repeat_ngram(2)
    engine_like, generate_like = run(rule, width=T, max_new=0), run(rule, width=5, max_new=256)
    assert np.asarray(engine_like).tobytes() == np.asarray(generate_like).tobytes()
    assert np.isinf(np.asarray(engine_like)).any()  # something was banned


def test_chains_without_a_neutral_setting_never_share_the_batch(lm_portable):
    """A request whose chain does not fit the running layout waits for the engine to drain; the
    scheduler (here with replayed outputs) never runs the two kinds together."""
    sigma = rules.top_n_sigma(1.0)
    reqs = [Request("ab", 5, rule=rules.top_p(0.9), arrival=0.0), Request("cd", 5, rule=sigma, arrival=0.0),
            Request("ef", 5, rule=rules.top_p(0.5), arrival=0.0), Request("gh", 5, rule=sigma, arrival=1.0)]
    report = simulate(lm_portable, reqs, slots=2, policy="continuous", step_model=StepTimeModel(1.0, 0.0, 0.0))
    span = {r.index: (r.first_token, r.finish) for r in report.results}
    by_kind = lambda k: [span[i] for i, r in enumerate(reqs) if isinstance(r.rule, k)]
    for a0, a1 in by_kind(rules.TopP):
        for b0, b1 in by_kind(rules.TopNSigma):
            assert a1 < b0 or b1 < a0
    # first in, first out: the top-p request behind the first top-n-sigma one waits for it
    assert span[2][0] > span[1][0]


@pytest.mark.quick
def test_requests_are_checked(lm_portable):
    engine = Engine(lm_portable, 2, clock=VirtualClock(StepTimeModel(1.0, 0.0, 0.0)))
    with pytest.raises(ValueError, match=r"request 0: prompt \(6 tokens\) \+ n \(11\) = 17 exceeds the model window T = 16"):
        engine.run([Request("abcdef", 11)])
    with pytest.raises(ValueError, match="request 1: .*outside the vocabulary"):
        engine.run([Request("ab", 2), Request("xyz", 2)])
    assert engine.idle and not engine.requests  # a bad request fails the run before any work
    with pytest.raises(ValueError, match=r"request 0: a rule setting has shape \(3,\).*\(2,\)"):
        engine.submit(Request("ab", 2, num_samples=2, rule=rules.top_p(np.array([0.5, 0.6, 0.7]))))
    with pytest.raises(ValueError, match="request 0: a stop string must not be empty"):
        engine.submit(Request("ab", 2, stop=""))
    with pytest.raises(ValueError, match="request 0: arrival must be"):
        engine.submit(Request("ab", 2, arrival=-1.0))
    with pytest.raises(ValueError, match="unknown scheduling policy 'fifo'"):
        Engine(lm_portable, 2, policy="fifo")
    with pytest.raises(ValueError, match="slots must be an integer >= 1"):
        Engine(lm_portable, 0)
    from jaxdecode.serving.config import EngineConfig

    # the settings as one object: the same engine as the keywords, never both, an unknown one named
    config = EngineConfig(3, prefill_chunk=5, decode_steps=2)
    by_keywords = Engine(lm_portable, 3, prefill_chunk=5, decode_steps=2)
    assert Engine(lm_portable, config=config).config == by_keywords.config and by_keywords.chunk == 5
    with pytest.raises(ValueError, match="either as config= or as keywords"):
        Engine(lm_portable, 3, config=config)
    with pytest.raises(TypeError, match="Engine.*prefil_chunk"):
        Engine(lm_portable, 3, prefil_chunk=5)
    with pytest.raises(ValueError, match="admit_batch must be at most the slots"):
        EngineConfig(2, admit_batch=3)
    pinned = Engine(lm_portable, 2, layout=rules.chain(rules.temperature(1.0), rules.top_p(1.0)),
                    executor=ReplayExecutor(2), clock=VirtualClock(StepTimeModel(1.0, 0.0, 0.0)))
    with pytest.raises(ValueError, match=r"request 0: its rule chain \(TopK\) does not fit the engine's layout "
                                         r"\(Temperature, TopP\)"):
        pinned.submit(Request("ab", 2, rule=rules.top_k(3)))
    # n = 0: done on arrival, nothing generated
    rep = pinned.run([Request("ab", 0, arrival=2.0), Request("ab", 3, rule=rules.top_p(0.5))])
    assert rep.results[0].outputs[0].text == "" and rep.results[0].ttft is None
    assert rep.results[0].latency == 0.0 and len(rep.results[1].outputs[0].tokens) == 3


# ----------------------------------------------------------------------------- the simulator


def test_continuous_beats_static_where_it_must(lm_portable):
    """Two slots, one long request and seven short ones, all at t = 0, steps of 1 s: continuous
    batching finishes in 8 steps, static in 8 + 3 (each later pair waits for the long one)."""
    reqs = [Request("ab", 8)] + [Request("cd", 1, seed=k) for k in range(7)]
    unit = StepTimeModel(1.0, 0.0, 0.0)
    cont = simulate(lm_portable, reqs, slots=2, policy="continuous", step_model=unit).summary()
    static = simulate(lm_portable, reqs, slots=2, policy="static", step_model=unit).summary()
    assert cont["seconds"] == 8.0 and static["seconds"] == 11.0
    assert cont["throughput"] == pytest.approx(15 / 8) and static["throughput"] == pytest.approx(15 / 11)
    assert cont["latency"]["p50"] == pytest.approx(4.5) and static["latency"]["p50"] == pytest.approx(9.5)
    # static batching waits for a full batch while more requests are on their way
    late = [Request("ab", 2, arrival=0.0), Request("cd", 2, arrival=5.0)]
    r = simulate(lm_portable, late, slots=2, policy="static", step_model=unit)
    assert [x.first_token for x in r.results] == [6.0, 6.0]
    r = simulate(lm_portable, late, slots=2, policy="continuous", step_model=unit)
    assert [x.first_token for x in r.results] == [1.0, 6.0]


@pytest.mark.quick
def test_simulator_is_deterministic_and_counts_prefill(lm_portable):
    # distinct prompts (rows of one prompt admitted together would share their prefill)
    letters = "abcdefghi"
    prompts = [letters[k % 9] * 9 if k % 2 else letters[k % 9] + "a" for k in range(12)]
    reqs = with_arrivals([Request(p, 3 + k % 4, seed=k, stop="a") for k, p in enumerate(prompts)],
                         poisson_arrivals(12, 2.0, seed=1))
    model = StepTimeModel(0.01, 0.002, 0.001)
    runs = [simulate(lm_portable, reqs, slots=3, policy=p, step_model=model, prefill_chunk=4)
            for p in ("continuous", "continuous", "static")]
    key = lambda rep: [(r.first_token, r.finish) for r in rep.results]
    assert key(runs[0]) == key(runs[1]) and runs[0].summary() == runs[1].summary()
    assert key(runs[0]) != key(runs[2])
    steps = runs[0].steps
    # prompts of 9 tokens with chunks of 4: pieces of 1, 4, 4; the others 2
    assert sum(s.prefill_tokens for s in steps) == 6 * 9 + 6 * 2
    assert max(s.prefill_tokens for s in steps) <= 3 * 4
    for s in steps:
        assert s.seconds == pytest.approx(model(s.rows, s.prefill_tokens))


def test_step_time_model_fit_and_json(tmp_path):
    from jaxdecode.serving.engine import StepRecord

    true = StepTimeModel(0.003, 0.0005, 0.00002)
    rng = np.random.default_rng(0)
    recs, t = [], 0.0
    for _ in range(40):
        rows, tok = int(rng.choice([0, 1, 2, 4, 8])), int(rng.integers(0, 200))
        recs.append(StepRecord(t, t + true(rows, tok), rows, rows, tok))
        t += 1.0
    fit = StepTimeModel.fit(recs)
    assert (fit.a, fit.b, fit.c) == pytest.approx((true.a, true.b, true.c), rel=1e-6)
    assert fit.residual(recs) < 1e-9
    # steps paused by another process are left out of the fit (and skew a plain least squares)
    noisy = [dataclasses.replace(r, end=r.end + rng.normal(0, 1e-5) + (0.05 if k % 10 == 3 else 0.0))
             for k, r in enumerate(recs)]
    robust, plain = StepTimeModel.fit(noisy), StepTimeModel.fit(noisy, trim=None)
    assert robust.a == pytest.approx(true.a, abs=2e-5) and robust.b == pytest.approx(true.b, abs=5e-6)
    assert abs(plain.a - true.a) > 1e-3
    fit.save(tmp_path / "fit.json")  # 6 significant digits, as every JSON the package writes
    back = StepTimeModel.load(tmp_path / "fit.json")
    assert (back.a, back.b, back.c) == pytest.approx((fit.a, fit.b, fit.c), rel=1e-5)
    (tmp_path / "bad.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="coefficients a, b and c"):
        StepTimeModel.load(tmp_path / "bad.json")
    # one slot count: the rows column never varies and is left out, not guessed
    same = [StepRecord(0.0, 0.01 + 0.001 * k, 4, 4, k) for k in range(5)]
    assert StepTimeModel.fit(same).b == 0.0


@pytest.mark.quick
def test_poisson_arrivals():
    a = poisson_arrivals(20000, 4.0, seed=3)
    assert np.all(np.diff(a) > 0) and a[0] > 0
    # the mean gap: 3% is 4.2 standard errors (a false alarm with probability 2e-5)
    assert np.mean(np.diff(a)) == pytest.approx(0.25, rel=0.03)
    # and the gaps' distribution (the mean alone passes evenly spaced arrivals, or gaps uniform on
    # (0, 2 / rate)): the Kolmogorov-Smirnov distance from exponential(mean 1 / rate) stays below
    # its level-1e-3 value sqrt(log(2 / 1e-3) / 2n) = 0.0138 (0.0054 here, p = 0.59); those two
    # are at 0.63 and 0.15: power 1.0
    gaps = np.sort(np.diff(a, prepend=0.0))
    cdf = 1.0 - np.exp(-gaps / 0.25)
    k = np.arange(1, len(gaps) + 1) / len(gaps)
    distance = max(np.max(k - cdf), np.max(cdf - (k - 1.0 / len(gaps))))
    assert distance < math.sqrt(math.log(2 / 1e-3) / (2 * len(gaps)))
    assert np.array_equal(a, poisson_arrivals(20000, 4.0, seed=3))
    with pytest.raises(ValueError, match="rate must be a finite number > 0"):
        poisson_arrivals(3, 0.0)


# ----------------------------------------------------------------------------- serve-bench


def test_serve_bench_simulate_json(tiny_ckpt, corpus_path, tmp_path, capsys):
    from jaxdecode.cli.app import main

    fig = tmp_path / "serve.png"
    argv = ["serve-bench", "--ckpt", tiny_ckpt, "--data", corpus_path, "--requests", "5", "--rate", "2",
            "--slots", "2", "--n", "6", "--shared-prefix", "3", "--simulate", "--json", "--sweep", "1,2,4",
            "--prefill-chunk", "4", "--out", str(fig), "--seed", "1"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["identical_outputs"] is True
    assert [r["policy"] for r in doc["runs"]] == ["static", "continuous"]
    assert {(r["policy"], r["slots"]) for r in doc["sweep"]} == {(p, s) for p in ("static", "continuous")
                                                                 for s in (1, 2, 4)}
    reqs = doc["requests"]
    assert len(reqs) == 5 and fig.is_file() and fig.stat().st_size > 0
    prefix = reqs[0]["prompt"][:3]
    for r in reqs:
        assert r["prompt"].startswith(prefix) and len(r["text"]) <= r["n"] <= 6
        assert {"seed", "greedy", "rule", "stop", "arrival", "ttft", "latency"} <= set(r)
    # the simulated run at 2 slots is the sweep's, replayed: the same schedule
    cont = doc["runs"][1]
    swept = next(r for r in doc["sweep"] if r["policy"] == "continuous" and r["slots"] == 2)
    assert cont["latency"] == swept["latency"] and cont["throughput"] == swept["throughput"]
    # every request's text is what generate gives it alone (on the backend the checkpoint loads
    # on in the tests: the native one, or the portable one with JAXDECODE_KERNELS=0)
    lm = jaxdecode.load(tiny_ckpt)
    assert lm.decoder.backend == ("portable" if os.environ.get("JAXDECODE_KERNELS") == "0" else "native")
    for r in reqs:
        rule = None if r["greedy"] else rules.chain(rules.temperature(r["rule"]["Temperature"]),
                                                     rules.top_p(r["rule"]["TopP"]))
        want = jaxdecode.generate(lm, r["prompt"], r["n"], seed=r["seed"], rule=rule, greedy=r["greedy"],
                                  stop=r["stop"])[0]
        assert r["text"] == want.text and r["finish_reason"] == want.finish_reason

    assert main(argv[:-2] + ["--shared-prefix", "20", "--out", str(fig)]) == 2
    assert "exceed the model window T = 16" in capsys.readouterr().err


def test_serve_bench_measured_compiles_nothing_in_the_timed_runs(tiny_ckpt, corpus_path, capsys):
    """On the wall clock, with every request at once and several decode steps a call: the timed
    runs compile no program (the warm-up did), and every text is generate's."""
    from jaxdecode.cli.app import main

    argv = ["serve-bench", "--ckpt", tiny_ckpt, "--data", corpus_path, "--requests", "6", "--rate", "1e6",
            "--slots", "2", "--n", "8", "--decode-steps", "4", "--json", "--out", "", "--seed", "2", "--sweep", "2"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["decode_steps"] == 4 and doc["identical_outputs"] is True
    assert [(r["kind"], r["compiles"]) for r in doc["runs"]] == [("measured", 0), ("measured", 0)]
    assert_bench_texts_are_generates(doc, tiny_ckpt)
