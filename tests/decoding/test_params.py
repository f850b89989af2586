"""DecodeParams: one request's settings as one checked object, the keywords of every loop as its
overrides, the table of which loop honours which setting (and the refusals it implies), the
engine's and the server's requests as the same object, and min_tokens and stop token ids
against a plain loop written here."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

import jaxdecode
from jaxdecode import rules
from jaxdecode.decoding import params as DP
from jaxdecode.decoding.common import next_logits_for
from jaxdecode.decoding.params import DecodeParams, ParamsError
from jaxdecode.models.checkpoint import LanguageModel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lm(tiny_model):
    cfg, params, vocab = tiny_model
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend="portable")


# ----------------------------------------------------------------------------- checking


@pytest.mark.quick
@pytest.mark.parametrize("bad, says", [
    ({"n": -1}, "the number of new tokens n must be an integer >= 0, got -1"),
    ({"n": 2.5}, "n must be an integer"),
    ({"greedy": 1}, "greedy must be True or False, got 1"),
    ({"num_samples": 0}, "num_samples must be an integer >= 1, got 0"),
    ({"seed": "x"}, "a seed must be an integer"),
    ({"seed": [1, 2.5]}, "a seed must be an integer"),
    ({"stop": ""}, "a stop string must not be empty"),
    ({"stop": ["a", 3]}, "a stop string must be a string"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be token ids"),
    ({"min_tokens": -2}, "min_tokens must be an integer >= 0"),
    ({"n": 3, "min_tokens": 4}, r"min_tokens \(4\) must be at most n \(3\)"),
    ({"top_logprobs": 21}, "top_logprobs must be at most 20, got 21"),
    ({"include_stop": "no"}, "include_stop must be True or False"),
    ({"chunk": 0}, "chunk must be an integer >= 1"),
    ({"max_rows": 0}, "max_rows must be an integer >= 1"),
    ({"chain": "top_p"}, "rule must be a jaxdecode rule"),
    ({"chain": rules.top_k(3), "top_p": 0.9}, r"either a rule \(chain\) or the named rule settings \(top_p\)"),
])
def test_a_bad_setting_is_one_error_naming_it(bad, says):
    with pytest.raises(ParamsError, match=says) as e:
        DecodeParams(**bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bad, says", [
    ({"top_p": 2.0}, r"top_p: p must lie in \(0, 1\], got 2"),
    ({"temperature": -1.0}, "temperature: "),
    ({"top_k": 0}, "top_k: "),
    ({"no_repeat_ngram": 0}, "no_repeat_ngram: "),
])
def test_a_bad_rule_setting_is_the_rules_error(bad, says):
    with pytest.raises(rules.RuleError, match=says):
        DecodeParams(**bad)


def test_settings_are_normalized_and_compared_by_value():
    p = DecodeParams(n=20, top_p=0.9, stop="x", seed=[1, 2], stop_token_ids=5)
    assert p.stop == ("x",) and p.seed == (1, 2) and p.stop_token_ids == (5,)
    assert p == DecodeParams(n=20, top_p=0.9, stop=["x"], seed=(1, 2), stop_token_ids=[5])
    assert p != DecodeParams(n=20, top_p=0.8, stop="x", seed=[1, 2], stop_token_ids=5)
    assert DecodeParams(stop=[]).stop is None
    assert isinstance(p.rule(), rules.TopP) and DecodeParams().rule() is None
    # a chain's per-row settings compare elementwise
    a = DecodeParams(chain=rules.top_p(np.array([0.5, 0.9])))
    assert a == DecodeParams(chain=rules.top_p(np.array([0.5, 0.9])))
    assert a != DecodeParams(chain=rules.top_p(np.array([0.5, 0.8])))
    assert repr(p).startswith("DecodeParams(n=20, top_p=0.9")
    with pytest.raises(dataclass_frozen_error()):
        p.n = 3


def dataclass_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_the_rule_chain_is_built_in_the_registrys_order():
    p = DecodeParams(top_p=0.9, temperature=0.7, repetition_penalty=1.2)
    assert [type(r) for r in p.rule().rules] == [rules.RepetitionPenalty, rules.Temperature, rules.TopP]


# ----------------------------------------------------------------------------- overrides


@pytest.mark.quick
def test_keywords_override_fields():
    base = DecodeParams(n=10, top_p=0.9, seed=3)
    p = base.replace(temperature=0.5, seed=4)
    assert (p.n, p.top_p, p.temperature, p.seed) == (10, 0.9, 0.5, 4) and base.seed == 3
    # rule= is the loops' keyword for an explicit chain: it replaces the named settings, and the other way round
    chained = base.replace(rule=rules.top_k(2))
    assert chained.top_p is None and isinstance(chained.rule(), rules.TopK)
    assert chained.replace(top_p=0.5).chain is None
    with pytest.raises(TypeError, match="unknown decoding setting.*top_q"):
        base.replace(top_q=0.5)
    with pytest.raises(ParamsError, match="num_samples must be"):
        base.replace(num_samples=0)


def test_the_third_argument_is_params_or_n():
    assert DP.resolve(7, {}, DP.GENERATE).n == 7
    assert DP.resolve(None, {"n": 5}, DP.GENERATE) == DecodeParams(n=5)
    assert DP.resolve(DecodeParams(n=4), {"top_p": 0.5}, DP.GENERATE) == DecodeParams(n=4, top_p=0.5)
    with pytest.raises(TypeError, match="n twice"):
        DP.resolve(7, {"n": 5}, DP.GENERATE)
    with pytest.raises(TypeError, match="params must be a DecodeParams"):
        DP.resolve("7", {}, DP.GENERATE)


def test_generate_with_params_equals_the_keyword_call(lm):
    p = DecodeParams(n=6, top_p=0.9, temperature=0.8, seed=[3, 4], num_samples=2, stop="a", include_stop=False)
    by_params = jaxdecode.generate(lm, ["ab", "c."], p)
    by_keywords = jaxdecode.generate(lm, ["ab", "c."], 6, top_p=0.9, temperature=0.8, seed=[3, 4], num_samples=2,
                                     stop="a", include_stop=False)
    by_rule = jaxdecode.generate(lm, ["ab", "c."], n=6, rule=rules.chain(rules.temperature(0.8), rules.top_p(0.9)),
                                 seed=[3, 4], num_samples=2, stop="a", include_stop=False)
    texts = lambda outs: [(g.text, g.tokens.tolist(), g.finish_reason) for g in outs]
    assert texts(by_params) == texts(by_keywords) == texts(by_rule)
    # an override changes what it names
    other = jaxdecode.generate(lm, ["ab", "c."], p, seed=[5, 6])
    assert texts(other) != texts(by_params)


def test_the_other_loops_take_params(lm):
    p = DecodeParams(n=5)
    assert [h.text for h in jaxdecode.beam_generate(lm, "ab", p, k=2)[0]] == \
        [h.text for h in jaxdecode.beam_generate(lm, "ab", 5, 2)[0]]
    assert jaxdecode.contrastive_generate(lm, "ab", p, 3, 0.5)[0].text == \
        jaxdecode.contrastive_generate(lm, "ab", n=5, k=3, alpha=0.5)[0].text
    a = jaxdecode.score(lm, ["abc"], ["a"], DecodeParams(max_rows=1))[0].logprobs
    np.testing.assert_array_equal(a, jaxdecode.score(lm, ["abc"], ["a"], max_rows=1)[0].logprobs)


# ----------------------------------------------------------------------------- the table


def _set_value(name: str):
    """A value other than the default for every field (valid for a 12-token vocabulary)."""
    return {"n": 4, "greedy": True, "no_repeat_ngram": 2, "top_k": 3, "chain": rules.top_p(0.5),
            "num_samples": 2, "seed": 7, "stop": ("a",), "stop_token_ids": (3,), "include_stop": False,
            "min_tokens": 1, "logit_bias": {1: 2.0}, "allowed_token_ids": (1,), "bad_words": ("a",),
            "constraint": object(), "top_logprobs": 2, "ignore_eos": True,
            "generation_config": False, "chunk": 8, "memory_budget": "1G", "max_rows": 4}.get(name, 0.5)


@pytest.mark.parametrize("loop", DP.LOOPS)
def test_every_loop_refuses_what_the_table_does_not_give_it(loop):
    for name in DP.FIELDS:
        p = DecodeParams(**{name: _set_value(name)})
        assert list(p.changed()) == [name]
        if loop in DP.HONOURED[name]:
            assert p.check_for(loop) is p
        else:
            with pytest.raises(ParamsError, match=f"^{loop} does not take {'rule' if name == 'chain' else name}$"):
                p.check_for(loop)


def test_the_loops_refuse_by_name(lm):
    with pytest.raises(ParamsError, match="beam_generate does not take greedy"):
        jaxdecode.beam_generate(lm, "ab", 4, 2, greedy=True)
    with pytest.raises(ParamsError, match="beam_generate does not take seed"):
        jaxdecode.beam_generate(lm, "ab", DecodeParams(n=4, seed=3), k=2)
    with pytest.raises(ParamsError, match="contrastive_generate does not take temperature"):
        jaxdecode.contrastive_generate(lm, "ab", 4, temperature=0.5)
    with pytest.raises(ParamsError, match="score does not take greedy"):
        jaxdecode.score(lm, ["abc"], greedy=True)
    with pytest.raises(ParamsError, match="generate does not take top_logprobs"):
        jaxdecode.generate(lm, "ab", 4, top_logprobs=2)
    from jaxdecode.speculative import speculative_generate

    with pytest.raises(ParamsError, match="speculative_generate does not take repetition_penalty"):
        speculative_generate(lm, "ab", 4, draft=None, repetition_penalty=1.2)


def test_docs_show_the_table():
    page = (ROOT / "docs" / "python.md").read_text()
    assert DP.table_markdown() in page


def test_every_public_loop_takes_at_most_six_other_parameters():
    from jaxdecode.speculative import speculative_generate

    for fn in (jaxdecode.generate, jaxdecode.beam_generate, jaxdecode.contrastive_generate, jaxdecode.score,
               jaxdecode.mode_search, speculative_generate):
        sig = inspect.signature(fn).parameters
        assert "params" in sig and "overrides" in sig, fn.__name__
        others = [n for n in sig if n not in ("params", "overrides")]
        assert len(others) <= 6, (fn.__name__, others)


# ----------------------------------------------------------------------------- engine and server


def test_the_engine_and_the_server_make_the_same_params():
    from jaxdecode.server import handlers as H
    from jaxdecode.server.protocol import CompletionRequest
    from jaxdecode.serving import Request

    V = 12
    body = CompletionRequest(prompt="ab", max_tokens=4, temperature=0.7, top_p=0.9, top_k=-1, min_p=0.0,
                             repetition_penalty=1.0, seed=5, n=2, stop_token_ids=[3])
    server = H.decode_params(body, V)
    assert server == DecodeParams(temperature=0.7, top_p=0.9, seed=5, num_samples=2, stop_token_ids=(3,))
    # the neutral settings (top_k -1, min_p 0, repetition_penalty 1) are left out of the chain
    assert [type(r) for r in server.rule().rules] == [rules.Temperature, rules.TopP]
    by_server = Request([1, 2], 4, **H.sampling(body, V))
    by_hand = Request([1, 2], 4, seed=5, num_samples=2,
                      params=DecodeParams(temperature=0.7, top_p=0.9, stop_token_ids=[3]))
    assert by_server.params == by_hand.params == server.replace(n=4)
    assert (by_server.seed, by_server.num_samples, by_server.n) == (5, 2, 4)
    # temperature 0: greedy, no temperature in the chain
    greedy = H.decode_params(CompletionRequest(prompt="ab", temperature=0, seed=1), V)
    assert greedy == DecodeParams(greedy=True, seed=1)


def test_the_server_uses_the_rules_neutral_settings():
    from jaxdecode.server import handlers as H

    neutral = H._neutral(50)
    assert neutral == {k: 50 if rules.NEUTRAL[k] == "V" else rules.NEUTRAL[k] for k in H.LAYOUT}
    source = inspect.getsource(H)
    assert "top_p=1.0" not in source and "min_p=0.0" not in source


def test_request_fields_override_its_params(lm):
    from jaxdecode.serving import Engine, Request

    r = Request("ab", params=DecodeParams(n=3, top_p=0.9, seed=2))
    assert (r.n, r.seed, r.num_samples, r.rule) == (3, 2, 1, None) and r.params.top_p == 0.9
    r = Request("ab", 5, seed=9, params=DecodeParams(n=3, seed=2))
    assert (r.n, r.seed) == (5, 9) and r.params == DecodeParams(n=5, seed=9)
    engine = Engine(lm, 2)
    with pytest.raises(ParamsError, match="request 0: the engine does not take include_stop"):
        engine.submit(Request("ab", 4, params=DecodeParams(include_stop=False)))
    with pytest.raises(ValueError, match="request 0: the stop token id 40 lies outside the vocabulary of 12"):
        engine.submit(Request("ab", 4, params=DecodeParams(stop_token_ids=[40])))


# ----------------------------------------------------------------------------- stop token ids and min_tokens


def _plain_greedy(lm, prompt: str, n: int, stop_ids=(), min_tokens: int = 0) -> list[int]:
    """Greedy decoding written out: the model's prediction after the whole text at every step,
    the end tokens and stop token ids masked before ``min_tokens`` new tokens, stopping after a
    stop token id."""
    next_logits = next_logits_for(lm.decoder, lm.params)
    ids = list(lm.vocab.encode(prompt))
    ends = set(stop_ids) | set(getattr(lm, "eos_ids", ()))
    out = []
    for step in range(n):
        logits = np.asarray(next_logits(np.asarray([ids], np.int32)))[0].astype(np.float64)
        if step < min_tokens:
            logits[list(ends)] = -np.inf
        t = int(np.argmax(logits))
        out.append(t)
        ids.append(t)
        if t in ends:
            break
    return out


def test_stop_token_ids_and_min_tokens_against_a_plain_loop(lm):
    free = _plain_greedy(lm, "ab", 10)
    assert jaxdecode.generate(lm, "ab", 10, greedy=True)[0].tokens.tolist() == free
    stop = free[1]  # the second token: without min_tokens the text stops there
    plain = _plain_greedy(lm, "ab", 10, [stop])
    g = jaxdecode.generate(lm, "ab", 10, greedy=True, stop_token_ids=[stop])[0]
    assert g.tokens.tolist() == plain and len(plain) <= 2 and g.finish_reason == "stop"
    assert g.text == lm.vocab.decode(plain)  # the stop token stays in the text
    for m in (1, 3, 6):
        plain = _plain_greedy(lm, "ab", 10, [stop], m)
        got = jaxdecode.generate(lm, "ab", DecodeParams(n=10, greedy=True, stop_token_ids=(stop,), min_tokens=m))[0]
        assert got.tokens.tolist() == plain, m
        assert stop not in plain[:m]
    with pytest.raises(ParamsError, match="min_tokens is not supported with stop strings"):
        jaxdecode.generate(lm, "ab", 10, min_tokens=2, stop="a")


def test_min_tokens_per_row_in_a_sampled_batch(lm):
    """A sampled batch: no row ends with its stop token before min_tokens tokens, and a row's
    tokens up to its end are those of a row alone."""
    stop = _plain_greedy(lm, "ab", 3)[0]
    p = DecodeParams(n=8, stop_token_ids=(stop,), min_tokens=4, seed=[1, 2, 3], temperature=1.5)
    outs = jaxdecode.generate(lm, ["ab", "ab", "c"], p)
    for i, g in enumerate(outs):
        assert stop not in g.tokens.tolist()[:4]
        alone = jaxdecode.generate(lm, [["ab", "ab", "c"][i]], p, seed=[p.seed[i]])[0]
        assert alone.tokens.tolist() == g.tokens.tolist()


def test_the_engine_ends_a_row_at_a_stop_token_as_generate_does(lm):
    from jaxdecode.serving import Engine, Request

    stop = _plain_greedy(lm, "ab", 10)[2]
    p = DecodeParams(n=10, seed=4, num_samples=3, temperature=1.3, stop_token_ids=(stop,))
    want = jaxdecode.generate(lm, "ab", p)
    report = Engine(lm, 4).run([Request("ab", params=p)])
    got = report.results[0].outputs
    assert [g.tokens.tolist() for g in got] == [g.tokens.tolist() for g in want]
    assert [g.finish_reason for g in got] == [g.finish_reason for g in want]
    assert any(g.finish_reason == "stop" for g in want)  # the case is tested


def test_a_request_with_bad_settings_is_refused_when_submitted(lm):
    from jaxdecode.serving import Engine, Request

    engine = Engine(lm, 2)
    bad = Request("ab", 4, params={"n": 4})  # kept as given until the engine takes it
    with pytest.raises(TypeError, match="request 0: params must be a DecodeParams, got dict"):
        engine.submit(bad)
    with pytest.raises(ParamsError, match="request 0: num_samples must be an integer >= 1, got 0"):
        engine.submit(Request("ab", 4, num_samples=0, params=DecodeParams(top_p=0.9)))
