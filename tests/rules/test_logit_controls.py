"""The logit controls (``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``min_tokens``) against
plain NumPy references: each rule on random logits, vLLM's bad-word loop written out; then
:func:`jaxdecode.generate`'s samples walked step by step against the model's own logits with the
controls applied in NumPy (each token must be allowed, and drawn with the probability the reference
gives it); the words' encoding; and their settings checked."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode import rules
from jaxdecode.decoding.common import next_logits_for
from jaxdecode.decoding.params import DecodeParams, ParamsError
from jaxdecode.models.checkpoint import LanguageModel

B, V = 4, 12


@pytest.fixture(scope="module")
def lm(tiny_model):
    cfg, params, vocab = tiny_model  # V = 12: " abcdefghi.\n"
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend="portable")


# ----------------------------------------------------------------------------- NumPy references


def np_ban(logits, banned):
    """-inf where banned; a row left with no finite logit keeps its first argmax."""
    out = np.where(banned, -np.inf, logits)
    for b in range(len(out)):
        if not np.isfinite(out[b]).any():
            out[b, np.argmax(logits[b])] = logits[b, np.argmax(logits[b])]
    return out


def np_bad_words(logits_row, words, generated):
    """vLLM's ``_apply_bad_words_single_batch``: for each word whose all-but-last tokens are the
    last generated ones (only generated tokens count), its last token is banned."""
    banned = np.zeros(logits_row.shape, bool)
    for w in words:
        if len(w) > len(generated) + 1:
            continue
        prefix = list(generated[len(generated) - (len(w) - 1):]) if len(w) > 1 else []
        if prefix == list(w[:-1]):
            banned[w[-1]] = True
    return banned


def np_controls(logits, generated, p: DecodeParams, words, eos=()):
    """One row's logits [V] (float64) after ``p``'s controls, in vLLM's order, the row having
    generated ``generated``; ``words``: the bad words' token sequences."""
    x = logits[None].astype(np.float64)
    if p.allowed_token_ids is not None:
        allowed = np.zeros(x.shape, bool)
        allowed[:, list(p.allowed_token_ids)] = True
        x = np_ban(x, ~allowed)
    if words:
        x = np_ban(x, np_bad_words(x[0], words, generated)[None])
    if p.min_tokens and len(generated) < p.min_tokens:
        ends = np.zeros(x.shape, bool)
        ends[:, list(p.stop_token_ids) + list(eos)] = True
        x = np_ban(x, ends)
    if p.logit_bias:
        for t, b in p.logit_bias.items():
            x[:, t] += b
    return x[0]


def log_softmax(x):
    m = np.max(x[np.isfinite(x)])
    z = np.log(np.sum(np.exp(x[np.isfinite(x)] - m)))
    return np.where(np.isfinite(x), x - m - z, -np.inf)


# ----------------------------------------------------------------------------- the rules


@jax.jit
def _after(rule, logits, generated):
    """The rule applied to logits [B, V] after rows generated ``generated`` [G, B] (one-token prompts)."""
    state = rule.init(jnp.zeros((logits.shape[0], 1), jnp.int32), jnp.ones((logits.shape[0],), jnp.int32),
                      logits.shape[-1], generated.shape[0])
    for g in generated:
        state = rule.update(state, g)
    return rule.apply(logits, state)


def _logits(rng):
    x = rng.normal(size=(B, V)).astype(np.float32) * 2
    x[1, [0, 5]] = -np.inf  # removed by an earlier rule
    x[3, :] = -np.inf
    x[3, [2, 7]] = [0.5, 1.5]  # only two tokens in play
    return x


@pytest.mark.quick
@pytest.mark.parametrize("shared", [True, False], ids=["one-for-every-row", "one-per-row"])
def test_bias_and_allowed_tokens_match_numpy(shared):
    rng = np.random.default_rng(0)
    x = _logits(rng)
    bias = np.round(rng.normal(size=(B, V)), 1).astype(np.float32) * (rng.random((B, V)) < 0.5)
    allowed = rng.random((B, V)) < 0.4
    allowed[3] = False
    allowed[3, 4] = True  # row 3: the only allowed token is not in play: the row keeps its argmax
    if shared:
        bias, allowed = bias[0], allowed[0] | (np.arange(V) == 4)
    no_steps = np.zeros((0, B), np.int32)
    got = np.asarray(_after(rules.logit_bias(bias), x, no_steps))
    want = np.where(np.broadcast_to(bias, (B, V)) != 0, x + bias, x)
    assert got.tobytes() == want.tobytes()
    got = np.asarray(_after(rules.allowed_tokens(allowed), x, no_steps))
    want = np_ban(x, ~np.broadcast_to(allowed, (B, V)))
    np.testing.assert_array_equal(got, want)
    if not shared:
        assert np.isfinite(got[3]).sum() == 1 and got[3, 7] == 1.5  # the fallback was exercised


@pytest.mark.quick
def test_bad_words_match_vllms_loop():
    """Words over a four-token alphabet, histories of every length from 0 to 5: many matches,
    of every word length, and the prompt (token 0) never counts."""
    rng = np.random.default_rng(1)
    words = [[0, 1], [2], [1, 3], [3, 1, 1], [1, 1, 1, 1], [3, 3]]
    rule = rules.bad_words(words)
    for steps in range(6):
        x = _logits(rng)
        gen = rng.integers(0, 4, size=(steps, B)).astype(np.int32)
        got = np.asarray(_after(rule, x, gen))
        want = np_ban(x, np.stack([np_bad_words(x[b], words, gen[:, b].tolist()) for b in range(B)]))
        np.testing.assert_array_equal(got, want, err_msg=f"after {steps} steps")
    # per-row words: each row its own list (here row b has only the first b + 1 words)
    per_row = rules.per_row(rule, B)
    mine = np.asarray(per_row.words).copy()
    for b in range(B):
        mine[b, b + 1:] = -1
    rule_rows = rules.BadWords(mine, rule.shape)
    gen = rng.integers(0, 4, size=(4, B)).astype(np.int32)
    got = np.asarray(_after(rule_rows, x, gen))
    want = np_ban(x, np.stack([np_bad_words(x[b], words[:b + 1], gen[:, b].tolist()) for b in range(B)]))
    np.testing.assert_array_equal(got, want)


@pytest.mark.quick
def test_min_tokens_matches_numpy():
    rng = np.random.default_rng(2)
    x = _logits(rng)
    ends = np.zeros(V, bool)
    ends[[2, 9]] = True
    m = np.array([0, 1, 3, 2], np.int32)
    for steps in range(5):
        gen = rng.integers(0, V, size=(steps, B)).astype(np.int32)
        got = np.asarray(_after(rules.min_tokens(m, ends), x, gen))
        want = np_ban(x, ends[None] & (steps < m)[:, None])
        np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- generate


def _walk(lm, prompt: str, g, p: DecodeParams, words):
    """Check one sample of ``generate`` step by step against the model's logits after the whole
    text with ``p``'s controls applied in NumPy: every token allowed, and drawn with the
    probability the reference gives it. Returns the steps where a control removed a token that
    had a chance, or changed the probabilities."""
    next_logits = next_logits_for(lm.decoder, lm.params)
    ids = list(lm.vocab.encode(prompt))
    acted = 0
    for s, t in enumerate(g.tokens.tolist()):
        raw = np.asarray(next_logits(np.asarray([ids], np.int32)))[0].astype(np.float64)
        ref = np_controls(raw, g.tokens[:s].tolist(), p, words, getattr(lm, "eos_ids", ()))
        if p.temperature is not None:
            ref = ref / p.temperature
        lp = log_softmax(ref)
        assert np.isfinite(lp[t]), f"step {s}: token {t} was removed"
        np.testing.assert_allclose(g.sample_logprobs[s], lp[t], rtol=0, atol=1e-4, err_msg=f"step {s}")
        np.testing.assert_allclose(g.model_logprobs[s], log_softmax(raw)[t], rtol=0, atol=1e-4)
        acted += not np.allclose(lp, log_softmax(raw / (p.temperature or 1.0)), atol=1e-6)
        ids.append(t)
    return acted


def test_generate_draws_from_the_controlled_distribution(lm):
    """Every control at once and each alone, sampled: the probability of every token drawn is the
    reference's, and a stop token ends a sample only after min_tokens tokens."""
    enc = lambda s: int(lm.vocab.encode(s)[0])
    stop = enc("e")
    settings = [
        {"logit_bias": {enc("a"): 2.0, enc("b"): -100.0, enc("."): 1.5}},
        {"allowed_token_ids": [enc(c) for c in "abcde ."]},
        {"bad_words": ["a", "bc", "hi ", " dd"]},
        {"min_tokens": 6, "stop_token_ids": [stop]},
        {"logit_bias": {enc("c"): 3.0}, "allowed_token_ids": [enc(c) for c in "abcdef."],
         "bad_words": ["ca", "ff"], "min_tokens": 4, "stop_token_ids": [stop]},
    ]
    for extra in settings:
        p = DecodeParams(n=10, temperature=1.3, seed=[5, 6], num_samples=3, **extra)
        words = rules.bad_word_ids(lm.vocab, p.bad_words or ())
        outs = jaxdecode.generate(lm, ["ab", "g."], p)
        acted = 0
        for i, g in enumerate(outs):
            acted += _walk(lm, ["ab", "g."][i // 3], g, p, words)
            if p.min_tokens and g.finish_reason == "stop":
                assert len(g.tokens) > p.min_tokens and g.tokens[-1] == stop
        assert acted, extra  # the controls changed the distribution somewhere


def test_greedy_with_controls_is_the_plain_loop(lm):
    """Greedy decoding with the controls: the argmax walk of the reference."""
    enc = lambda s: int(lm.vocab.encode(s)[0])
    free = jaxdecode.generate(lm, "ab", 12, greedy=True)[0]
    first, second = free.text[0], free.text[1]
    p = DecodeParams(n=12, greedy=True, bad_words=[first + second], logit_bias={enc(second): -1.0},
                     allowed_token_ids=sorted({enc(c) for c in " abcdefghi."}))
    words = rules.bad_word_ids(lm.vocab, p.bad_words)
    got = jaxdecode.generate(lm, "ab", p)[0]
    next_logits = next_logits_for(lm.decoder, lm.params)
    ids, out = list(lm.vocab.encode("ab")), []
    for _ in range(12):
        raw = np.asarray(next_logits(np.asarray([ids], np.int32)))[0].astype(np.float64)
        t = int(np.argmax(np_controls(raw, out, p, words)))
        out.append(t)
        ids.append(t)
    assert got.tokens.tolist() == out
    assert got.text != free.text  # the words changed the walk


# ----------------------------------------------------------------------------- words and settings


class _Vocab:
    """A vocabulary of whole strings: what a BPE tokenizer gives for the strings the test asks for."""

    PIECES: ClassVar[dict] = {"the": [5], " the": [7], "hello": [1, 2], " hello": [3, 2], "x y": [4, 0, 4],
                              " x y": [0, 4, 0, 4], "no": [6], " no": [6]}

    def encode_piece(self, text):
        if text not in self.PIECES:
            raise ValueError(f"cannot encode {text!r}")
        return np.asarray(self.PIECES[text], np.int32)


def test_words_are_encoded_as_vllm_encodes_them(lm):
    # with a space: added where it gives as many tokens and another first token
    assert rules.bad_word_ids(_Vocab(), ["the", "  hello", "x y", "no", "unknown"]) == \
        [[5], [7], [1, 2], [3, 2], [4, 0, 4], [6]]
    # a character vocabulary: the word alone (with a space it is one token longer); a character
    # the vocabulary lacks: the word can never be written
    enc = lambda s: lm.vocab.encode(s).tolist()
    assert rules.bad_word_ids(lm.vocab, [" ab", "c", "aZ"]) == [enc("ab"), enc("c")]


@pytest.mark.quick
@pytest.mark.parametrize("bad, says", [
    ({"logit_bias": [1, 2]}, "logit_bias must map token ids to biases"),
    ({"logit_bias": {"3": 1.0}}, r"logit_bias: a key must be a token id .* got '3'"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias: a key must be a token id"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias: the bias of token 3 must be a finite number"),
    ({"logit_bias": {3: "up"}}, "logit_bias: the bias of token 3 must be a finite number"),
    ({"allowed_token_ids": []}, "allowed_token_ids must hold at least one token id"),
    ({"allowed_token_ids": [1, -2]}, r"allowed_token_ids must be token ids \(integers >= 0\), got -2"),
    ({"bad_words": ["ok", ""]}, "bad_words: a word must not be empty"),
    ({"bad_words": ["ok", 3]}, "bad_words: a word must be a string, got 3"),
])
def test_a_bad_setting_is_one_error_naming_it(bad, says):
    with pytest.raises(ParamsError, match=says) as e:
        DecodeParams(**bad)
    assert "\n" not in str(e.value)


def test_settings_are_normalized(lm):
    p = DecodeParams(logit_bias={np.int64(3): 250, 4: -1e9, 5: 0.5, 6: 10**400}, allowed_token_ids=[4, 2, 4],
                     bad_words="ab")
    assert p.logit_bias == {3: 100.0, 4: -100.0, 5: 0.5, 6: 100.0}  # OpenAI's range
    assert p.allowed_token_ids == (2, 4) and p.bad_words == ("ab",)
    assert DecodeParams(logit_bias={}, bad_words=[]) == DecodeParams()
    with pytest.raises(ParamsError, match="logit_bias: the token id 12 lies outside the vocabulary of 12"):
        jaxdecode.generate(lm, "ab", 3, logit_bias={12: 1.0})
    with pytest.raises(ParamsError, match="allowed_token_ids: the token id 40 lies outside"):
        jaxdecode.generate(lm, "ab", 3, allowed_token_ids=[1, 40])
    with pytest.raises(ParamsError, match="bad_words: a word of 40 tokens, at most 32"):
        jaxdecode.generate(lm, "ab", 3, bad_words=["a" * 40])
    with pytest.raises(ParamsError, match="bad_words: 129 token sequences .* at most 128"):
        jaxdecode.generate(lm, "ab", 3, bad_words=[a + b for a in "abcdefghi" for b in "abcdefghi."] +
                           ["a" * k for k in range(3, 42)])
    with pytest.raises(ParamsError, match="beam_generate does not take bad_words"):
        jaxdecode.beam_generate(lm, "ab", 3, 2, bad_words=["a"])
    with pytest.raises(rules.RuleError, match="allowed_tokens: every row must allow at least one token"):
        rules.allowed_tokens(np.zeros((2, V), bool))
    with pytest.raises(rules.RuleError, match="logit_bias: bias must have 1 or 2 dimensions"):
        rules.logit_bias(np.zeros((1, 2, V)))



# ----------------------------------------------------------------------------- the engine


def _engine_requests(lm):
    """Rows with controls and rows without, sampled and greedy; per-sample biases in an explicit
    chain; a stop token held back by min_tokens."""
    from jaxdecode.serving import Request

    enc = lambda s: int(lm.vocab.encode(s)[0])
    per_sample = np.zeros((2, V), np.float32)
    per_sample[0, enc("a")], per_sample[1, enc("b")] = 3.0, 4.0
    return [
        Request("ab", params=DecodeParams(n=8, temperature=1.3, seed=3, num_samples=2,
                                          logit_bias={enc("c"): 2.5, enc("d"): -100})),
        Request("c.", params=DecodeParams(n=9, seed=4, top_p=0.9)),
        Request("hi", params=DecodeParams(n=8, seed=5, bad_words=["ab", "c", "ee"],
                                          allowed_token_ids=[enc(c) for c in "abcde."])),
        Request("e", params=DecodeParams(n=10, seed=6, temperature=1.5, min_tokens=5,
                                         stop_token_ids=[enc("a")], num_samples=2)),
        Request("ga", params=DecodeParams(n=7, greedy=True, logit_bias={enc("a"): 1.0}, bad_words=["aa"])),
        Request("d", params=DecodeParams(n=6, seed=7, num_samples=2, chain=rules.logit_bias(per_sample))),
        Request("f", params=DecodeParams(n=6, seed=8, temperature=0.8)),
    ]


@pytest.mark.parametrize("pinned", [True, False], ids=["one-layout", "layouts-by-request"])
def test_the_engine_gives_each_request_what_generate_gives_it(lm, pinned):
    """Three slots, seven requests: rows with and without controls share the batch (one pinned
    layout, as the server's) or follow the requests' layouts; every text, token and log-probability
    is generate's for the request alone."""
    from jaxdecode.decoding.params import neutral_controls
    from jaxdecode.serving import Engine

    reqs = _engine_requests(lm)
    layout = rules.chain(*neutral_controls(V), rules.temperature(1.0), rules.top_p(1.0)) if pinned else None
    report = Engine(lm, 3, layout=layout).run(reqs)
    stopped = 0
    for req, res in zip(reqs, report.results):
        want = jaxdecode.generate(lm, req.prompt, req.params)
        assert len(res.outputs) == len(want)
        for got, w in zip(res.outputs, want):
            assert (got.text, got.tokens.tolist(), got.finish_reason) == \
                (w.text, w.tokens.tolist(), w.finish_reason)
            np.testing.assert_allclose(got.sample_logprobs, w.sample_logprobs, rtol=0, atol=2e-6)
            stopped += w.finish_reason == "stop"
    assert stopped  # the stop token was reached after min_tokens
    # the controls acted: without them the texts differ
    for k in (0, 2, 3, 4, 5):
        free = jaxdecode.generate(lm, reqs[k].prompt, reqs[k].params.replace(
            logit_bias=None, bad_words=None, allowed_token_ids=None, min_tokens=0, chain=None))
        assert [g.text for g in free] != [o.text for o in report.results[k].outputs], k


def test_the_engine_checks_the_controls(lm):
    from jaxdecode.serving import Engine, Request

    engine = Engine(lm, 2)
    with pytest.raises(ValueError, match="request 0: logit_bias: the token id 12 lies outside"):
        engine.submit(Request("ab", 4, params=DecodeParams(logit_bias={12: 1.0})))
    with pytest.raises(ValueError, match="request 0: min_tokens is not supported with stop strings"):
        engine.submit(Request("ab", 4, stop="a", params=DecodeParams(min_tokens=2)))


# ----------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def char():
    """``jaxdecode serve`` on the shipped character model, 4 slots (the server of
    tests/server/test_server.py's harness, stopped at the end; it must exit cleanly)."""
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from support.servers import serving

    with serving(char=("--slots", "4")) as procs:
        yield procs["char"].ready()


@pytest.fixture(scope="module")
def char_lm():
    return jaxdecode.load()


def _server_cases(lm):
    enc = lambda s: int(lm.vocab.encode(s)[0])
    return [  # (the request's fields, the same settings for generate)
        ({"logit_bias": {str(enc("e")): -100, str(enc("z")): 6.5}},
         {"logit_bias": {enc("e"): -100, enc("z"): 6.5}}),
        ({"allowed_token_ids": [enc(c) for c in "ROMEA :\n"], "temperature": 0.7},
         {"allowed_token_ids": [enc(c) for c in "ROMEA :\n"], "temperature": 0.7}),
        ({"bad_words": ["he", " an", "I"], "top_p": 0.9}, {"bad_words": ["he", " an", "I"], "top_p": 0.9}),
        ({"min_tokens": 12, "stop_token_ids": [enc("\n")]}, {"min_tokens": 12,
                                                            "stop_token_ids": [enc("\n")]}),
        ({}, {}),  # a request without controls in the same batches
        ({"logit_bias": {str(enc(".")): 3}, "bad_words": ["e"], "min_tokens": 3, "stop_token_ids": [enc(".")],
          "temperature": 0}, {"logit_bias": {enc("."): 3}, "bad_words": ["e"], "min_tokens": 3,
                              "stop_token_ids": [enc(".")], "greedy": True}),
    ]


def test_the_server_honours_the_controls_as_generate_does(char, char_lm):
    """Six requests at once with the openai client (logit_bias as its own argument, vLLM's fields
    in extra_body), with and without controls, two samples each: every text is generate's."""
    import concurrent.futures

    from support.servers import client

    api = client(char)
    cases = _server_cases(char_lm)

    def ask(i):
        fields = dict(cases[i][0])
        bias = fields.pop("logit_bias", None)
        return api.completions.create(model=char.name, prompt="ROMEO:", max_tokens=24, n=2, seed=40 + i,
                                      **({} if bias is None else {"logit_bias": bias}), extra_body=fields)

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, range(len(cases))))
    stops = 0
    for i, (answer, (_, settings)) in enumerate(zip(answers, cases)):
        same = {"n": 24, "seed": 40 + i, "num_samples": 2}
        want = jaxdecode.generate(char_lm, "ROMEO:", DecodeParams(**same, **settings))
        got = sorted(answer.choices, key=lambda c: c.index)
        assert [c.text for c in got] == [g.text for g in want], settings
        assert [c.finish_reason for c in got] == [{"stop": "stop", "length": "length"}[g.finish_reason]
                                                  for g in want]
        stops += sum(g.finish_reason == "stop" for g in want)
        if settings:  # the controls acted: without them the texts differ
            free = {k: v for k, v in settings.items()
                    if k in ("temperature", "top_p", "greedy", "stop_token_ids")}
            free_texts = [g.text for g in jaxdecode.generate(char_lm, "ROMEO:", DecodeParams(**same, **free))]
            assert free_texts != [c.text for c in got]
    assert stops  # a stop token ended a sample, after min_tokens


@pytest.mark.parametrize("fields, param, says", [
    ({"logit_bias": {"e": 1}}, "logit_bias", "a key must be a token id"),
    ({"logit_bias": {"65": 1}}, "logit_bias", "the token id 65 is outside the vocabulary [0, 65)"),
    ({"logit_bias": {"5": "high"}}, "logit_bias", "the bias of token 5 must be a number"),
    ({"allowed_token_ids": [3, 99]}, "allowed_token_ids", "the token id 99 is outside the vocabulary"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "at least one token id"),
    ({"bad_words": ["ok", " "]}, "bad_words", "a word must not be empty"),
    ({"min_tokens": 3, "stop": "\n"}, "min_tokens", "not supported with stop strings"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "min_tokens (9) must be at most"),
])
def test_bad_controls_are_openai_errors_naming_the_field(char, fields, param, says):
    from support.servers import check_error, post

    r = post(char, "/completions", {"prompt": "ROMEO:", "max_tokens": 8, **fields})
    check_error(r, 400, param=param, says=says)


def test_the_openai_client_sees_a_bad_bias_as_a_400(char):
    import openai
    from support.servers import client

    with pytest.raises(openai.BadRequestError) as e:
        client(char).completions.create(model=char.name, prompt="ROMEO:", max_tokens=4, logit_bias={"-3": 5})
    assert e.value.status_code == 400 and e.value.body["param"] == "logit_bias"
