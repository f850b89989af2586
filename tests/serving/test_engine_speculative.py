"""Speculative decoding in the engine (``Engine(..., speculative=...)``): seeded texts equal to
:func:`jaxdecode.speculative.speculative_generate`'s whatever the arrival order, the first two
tokens' distribution against the enumerated one (speculative passes, plain passes, and the two
mixed), the settings it refuses, its flags, and its compiled programs."""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode import rules
from jaxdecode import speculative as SP
from jaxdecode.constraints import compile_regex
from jaxdecode.eval.exact import chisquare_pvalue, exact_distribution, model_next_logits
from jaxdecode.io.vocab import Vocab
from jaxdecode.models import decoder_for
from jaxdecode.models.charlm.transformer import ModelConfig, init_params
from jaxdecode.models.checkpoint import LanguageModel
from jaxdecode.serving import speculative as SS
from jaxdecode.serving.config import EngineConfig
from jaxdecode.serving.engine import Engine, Request
from jaxdecode.serving.simulator import StepClock
from jaxdecode.serving.warmup import count_compiles

P_MIN = 1e-3  # chi-square p-value below which a fixed-seed sample counts as a mismatch
GAMMA = 3


def random_params(cfg: ModelConfig, seed: int, scale: float):
    """Random weights without compiling Flax's init: normal(scale), LayerNorm scales 1."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        if getattr(path[-1], "key", None) == "scale":
            return jnp.ones(leaf.shape, jnp.float32)
        return jnp.asarray(rng.normal(0.0, scale, leaf.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(fill, shapes)


@pytest.fixture(scope="module")
def lm():
    """A spread-out random target (V=12, T=48) on the portable backend."""
    cfg = ModelConfig(V=12, T=48, d=16, L=1, heads=2)
    return LanguageModel(params=random_params(cfg, 3, 0.5), cfg=cfg, vocab=Vocab(" abcdefghi.\n"), meta={},
                         backend="portable")


@pytest.fixture(scope="module")
def drafts(lm):
    """A draft model (the target's weights, perturbed: it accepts often but not always), an n-gram
    table and prompt lookup."""
    rng = np.random.default_rng(5)
    near = jax.tree_util.tree_map(lambda a: a + jnp.asarray(rng.normal(0, 0.15, a.shape), a.dtype), lm.params)
    return {"model": SP.ModelDraft(near, decoder_for(lm.cfg, "portable")),
            "ngram": SP.NGramDraft.from_tokens(rng.integers(0, 12, 2000), 12, n=3),
            "lookup": SP.PromptLookupDraft(2)}


def mixed_requests():
    """Greedy and sampled requests, several samples, rules, a stop string, arriving at steps 0-5
    (StepClock); prompts longer than the prefill chunk (4) are read in pieces."""
    return [Request("abc da", 20, seed=3, num_samples=2, rule=rules.top_p(0.9), arrival=0),
            Request("hi", 25, seed=1, greedy=True, arrival=0),
            Request("e", 30, seed=2, num_samples=2, stop="a", arrival=2),
            Request("ccc dd bb", 18, seed=11, rule=rules.temperature(0.7), arrival=3),
            Request("bad caf", 22, seed=7, arrival=5)]


def assert_speculative_generate(lm, draft, requests, report):
    for res, r in zip(report.results, requests):
        want = SP.speculative_generate(lm, r.prompt, r.n, draft=draft, gamma=GAMMA, seed=r.seed,
                                       num_samples=r.num_samples, rule=r.rule, greedy=r.greedy, stop=r.stop)
        assert len(res.outputs) == len(want)
        for got, w in zip(res.outputs, want):
            np.testing.assert_array_equal(got.tokens, w.tokens)
            assert got.text == w.text and got.finish_reason == w.finish_reason
            np.testing.assert_allclose(got.model_logprobs, w.model_logprobs, rtol=0, atol=2e-6)
            np.testing.assert_allclose(got.sample_logprobs, w.sample_logprobs, rtol=0, atol=2e-6)


@pytest.mark.parametrize("kind, steps", [("model", 1), pytest.param("ngram", 4, marks=pytest.mark.slow)])
def test_seeded_texts_equal_speculative_generate(lm, drafts, kind, steps):
    """Requests arriving at different steps, in 3 slots: each sample's tokens, text, finish reason
    and log-probabilities are speculative_generate's for its seed (one pass a call, and up to 4),
    while the engine never turns itself down."""
    reqs = mixed_requests()
    engine = Engine(lm, 3, speculative=drafts[kind], gamma=GAMMA, prefill_chunk=4, decode_steps=steps,
                    speculative_max_rows=3, clock=StepClock())
    report = engine.run(reqs)
    assert_speculative_generate(lm, drafts[kind], reqs, report)
    stats = engine.speculative_stats()
    assert stats["plain_passes"] == 0 and stats["speculative_passes"] > 0
    assert 0 < stats["accepted"] < stats["examined"] <= stats["proposed"]


@pytest.mark.slow
def test_prompt_lookup_and_every_slot_count(lm, drafts):
    """Prompt lookup (a deterministic draft), on 1 and 8 slots."""
    for slots in (1, 8):
        reqs = mixed_requests()
        report = Engine(lm, slots, speculative=drafts["lookup"], gamma=GAMMA, prefill_chunk=4,
                        speculative_max_rows=slots, clock=StepClock()).run(reqs)
        assert_speculative_generate(lm, drafts["lookup"], reqs, report)


@pytest.mark.quick
def test_turned_down_engine_runs_plain_passes(lm, drafts):
    """Above speculative_max_rows decoding slots a step is a plain pass: greedy texts stay
    greedy decoding's; a sampled row still gets a text of its length. A second run of the same
    requests compiles nothing."""
    reqs = mixed_requests()
    engine = Engine(lm, 3, speculative=drafts["model"], gamma=GAMMA, prefill_chunk=4, speculative_max_rows=1,
                    clock=StepClock())
    report = engine.run(reqs)
    stats = engine.speculative_stats()
    assert stats["plain_passes"] > 0 and stats["speculative_passes"] > 0
    greedy = SP.speculative_generate(lm, "hi", 25, draft=drafts["model"], gamma=GAMMA, greedy=True)[0]
    assert report.results[1].outputs[0].text == greedy.text
    assert [len(o.tokens) for o in report.results[4].outputs] == [22]
    engine.clock = StepClock()
    with count_compiles() as counted:
        again = engine.run(mixed_requests())
    assert counted[0] == 0
    assert [o.text for r in again.results for o in r.outputs] == [o.text for r in report.results for o in r.outputs]


def test_calls_overlap_and_texts_stay_exact(lm, drafts):
    """On a real clock the engine sends each call before it reads the tokens of the one before: a
    row goes on from where the call in flight leaves it, on the device. Every request at once,
    more rows than slots (rows join as others leave), one and 4 passes a call: every text is still
    speculative_generate's. Turned down above one row, the row left alone after plain passes needs
    its draft state built again from its text: the call in flight is read first then, and its
    greedy text stays greedy decoding's."""
    def watched(engine):
        assert engine.overlap
        sent, launch = [], engine._launch_passes
        engine._launch_passes = lambda start: sent.append(engine._inflight is not None) or launch(start)
        read_first, needs_text = [], engine._needs_text
        engine._needs_text = lambda *a: read_first.append(needs_text(*a)) or read_first[-1]
        return sent, read_first

    reqs = [Request(r.prompt, r.n, seed=r.seed, num_samples=r.num_samples, rule=r.rule, greedy=r.greedy,
                    stop=r.stop) for r in mixed_requests()]
    for steps in (1, 4):
        engine = Engine(lm, 3, speculative=drafts["model"], gamma=GAMMA, prefill_chunk=4, decode_steps=steps,
                        speculative_max_rows=3)
        sent, read_first = watched(engine)
        assert_speculative_generate(lm, drafts["model"], reqs, engine.run(reqs))
        assert sum(sent) >= len(sent) // 2  # most calls were sent while another was running
        assert not any(read_first) and engine.idle and engine._inflight is None
    engine = Engine(lm, 2, speculative=drafts["model"], gamma=GAMMA, decode_steps=4, speculative_max_rows=1)
    sent, read_first = watched(engine)
    rebuilt, sync = [], engine.executor.sync_drafts
    engine.executor.sync_drafts = lambda texts: rebuilt.extend(len(t) for _, t in texts) or sync(texts)
    report = engine.run([Request("hi", 25, greedy=True), Request("abc", 6, seed=1)])
    stats = engine.speculative_stats()
    assert max(rebuilt, default=0) > 3  # a draft state built again from a text longer than the prompts
    assert any(read_first) and stats["plain_passes"] > 0 and stats["speculative_passes"] > 0
    greedy = SP.speculative_generate(lm, "hi", 25, draft=drafts["model"], gamma=GAMMA, greedy=True)[0]
    assert report.results[0].outputs[0].text == greedy.text
    assert len(report.results[1].outputs[0].tokens) == 6


# ----------------------------------------------------------------------------- the distribution

EXACT_CFG = ModelConfig(V=8, T=12, d=8, L=1, heads=1)
EXACT_PROMPT = np.array([1, 2, 3, 1], np.int32)
DRAWS = 12_000  # samples of one request, each row one draw


@pytest.fixture(scope="module")
def exact():
    params = random_params(EXACT_CFG, 0, 0.5)
    lm = LanguageModel(params=params, cfg=EXACT_CFG, vocab=Vocab("abcdefgh"), meta={}, backend="portable")
    want = exact_distribution(model_next_logits(params, EXACT_CFG), EXACT_PROMPT, 2, rule=rules.top_p(0.9),
                              V=EXACT_CFG.V)
    dcfg = ModelConfig(V=8, T=12, d=4, L=1, heads=1)
    draft = SP.ModelDraft(random_params(dcfg, 1, 0.5), decoder_for(dcfg, "portable"))
    return lm, want, draft


def first_two_tokens(lm, draft, switch):
    """DRAWS samples of two tokens on a 512-slot engine, one pass a call; ``switch(step)`` gives
    the step's speculative_max_rows (0: a plain pass, 512: a speculative one)."""
    engine = Engine(lm, 512, speculative=draft, gamma=2, decode_steps=1, clock=StepClock())
    i = engine.submit(Request(EXACT_PROMPT, 2, seed=17, num_samples=DRAWS, rule=rules.top_p(0.9)))
    step = 0
    while not engine.idle:
        engine.speculative_max_rows = switch(step)
        engine.step()
        step += 1
    codes, counts = np.unique(np.array([r.tokens for r in engine.rows(i)]), axis=0, return_counts=True)
    return {tuple(c): k for c, k in zip(codes.tolist(), counts.tolist())}, engine.speculative_stats()


SWITCHES = {"speculative": lambda step: 512, "plain": lambda step: 0, "alternating": lambda step: 512 * (step % 2)}


@pytest.mark.parametrize("mode", ["speculative", pytest.param("plain", marks=pytest.mark.slow),
                                  pytest.param("alternating", marks=pytest.mark.slow)])
def test_first_two_tokens_follow_the_target(exact, mode):
    """Each sample is one draw of the first two tokens under top-p 0.9; their frequencies match
    the enumerated distribution, whether the passes are speculative, plain, or alternate (a row's
    second token then comes from the other kind of pass than its first).
    test_a_broken_acceptance_fails shows the test's power against a wrong acceptance rule."""
    lm, want, draft = exact
    counts, stats = first_two_tokens(lm, draft, SWITCHES[mode])
    assert sum(counts.values()) == DRAWS
    assert chisquare_pvalue(counts, want) > P_MIN, mode
    if mode != "plain":
        assert stats["speculative_passes"] > 0 and 0 < stats["accepted"] < stats["examined"]
    if mode != "speculative":
        assert stats["plain_passes"] > 0


@pytest.mark.slow
def test_a_broken_acceptance_fails(exact, monkeypatch):
    """The distribution test rejects an engine whose acceptance test keeps a proposal with
    probability min(1, q/p) instead of min(1, p/q) (the test's power against that bug)."""
    lm, want, draft = exact
    right = SS.accept_with_noise

    def broken(p, q, draft_tokens, noise, greedy):
        if greedy:
            return right(p, q, draft_tokens, noise, greedy)
        return right(q_padded(q, p), p[:, :-1], draft_tokens, noise, greedy)

    def q_padded(q, p):  # q as a [B, gamma+1, V] "target": the roles of p and q swapped
        return jnp.concatenate([q, p[:, -1:]], axis=1)

    monkeypatch.setattr(SS, "accept_with_noise", broken)
    jax.clear_caches()
    try:
        counts, _ = first_two_tokens(lm, draft, SWITCHES["speculative"])
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert chisquare_pvalue(counts, want) < P_MIN


# ----------------------------------------------------------------------------- what it refuses

@pytest.mark.quick
def test_refusals_name_the_setting(lm, drafts):
    draft = drafts["ngram"]
    for settings, message in [
        (dict(cache="paged"), "drop cache 'paged'"),
        (dict(kv_dtype="int8"), "drop kv_dtype 'int8'"),
        (dict(gamma=0), "gamma"),
    ]:
        with pytest.raises(ValueError, match=message):
            Engine(lm, 2, speculative=draft, **settings)
    with pytest.raises(ValueError, match="unknown speculative draft 'nope'"):
        EngineConfig(2, speculative="nope")
    with pytest.raises(ValueError, match="draft names the draft model's folder"):
        EngineConfig(2, speculative="ngram", draft="somewhere")
    with pytest.raises(ValueError, match="gamma is a setting of speculative decoding"):
        EngineConfig(2, gamma=2)
    engine = Engine(lm, 2, speculative=draft, gamma=GAMMA)
    for request, message in [
        (Request("ab", 5, constraint=compile_regex("a+", lm.vocab)), "does not take constraint"),
        (Request("ab", 5, top_logprobs=2), "does not return top_logprobs"),
        (Request("ab", 5, rule=rules.repetition_penalty(1.3)), "rules that keep state"),
        (Request("abc", 44, seed=1), r"gamma \+ 1 \(4\) = 51 exceeds the model window T = 48"),
    ]:
        with pytest.raises(ValueError, match=f"request 0: the engine decodes speculatively.*{message}"):
            engine.submit(request)


@pytest.mark.quick
def test_flags_make_the_config():
    p = argparse.ArgumentParser()
    EngineConfig.add_flags(p)
    args = p.parse_args(["--speculative", "model", "--draft", "folder", "--gamma", "2",
                         "--speculative-max-rows", "4"])
    config = EngineConfig.from_args(args)
    assert (config.speculative, config.draft, config.gamma, config.speculative_max_rows) == ("model", "folder", 2, 4)
    with pytest.raises(ValueError, match="--draft names the draft model's folder: it goes with --speculative model"):
        EngineConfig.from_args(p.parse_args(["--speculative", "ngram", "--draft", "x"]))
    with pytest.raises(ValueError, match="drop --cache 'paged'"):
        EngineConfig.from_args(p.parse_args(["--speculative", "lookup", "--cache", "paged"]))
    assert EngineConfig.from_args(p.parse_args([])).speculative is None


@pytest.mark.slow
def test_warm_up_compiles_every_program(lm, drafts):
    """After warm_up, serving the requests (any arrival steps, turned down or not) compiles
    nothing: the passes, their spans and the draft's rebuilds are all covered."""
    engine = Engine(lm, 3, speculative=drafts["model"], gamma=GAMMA, prefill_chunk=4, decode_steps=2,
                    speculative_max_rows=2, clock=StepClock())
    reqs = mixed_requests()
    assert engine.warm_up(reqs) > 0
    with count_compiles() as counted:
        engine.run(reqs)
        for r in reqs:
            r.arrival = 0
        engine.run(reqs)
    assert counted[0] == 0
