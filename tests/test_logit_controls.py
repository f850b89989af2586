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


def test_bad_words_match_vllms_loop():
    """Words over a three-token alphabet, histories of every length from 0 to 5: many matches,
    of every word length, and the prompt never counts."""
    rng = np.random.default_rng(1)
    words = [[2], [1, 3], [3, 1, 1], [1, 1, 1, 1], [3, 3]]
    rule = rules.bad_words(words)
    for steps in range(6):
        x = _logits(rng)
        gen = rng.integers(1, 4, size=(steps, B)).astype(np.int32)
        got = np.asarray(_after(rule, x, gen))
        want = np_ban(x, np.stack([np_bad_words(x[b], words, gen[:, b].tolist()) for b in range(B)]))
        np.testing.assert_array_equal(got, want, err_msg=f"after {steps} steps")
    # per-row words: each row its own list (here row b has only the first b + 1 words)
    per_row = rules.per_row(rule, B)
    mine = np.asarray(per_row.words).copy()
    for b in range(B):
        mine[b, b + 1:] = -1
    rule_rows = rules.BadWords(mine, rule.shape)
    gen = rng.integers(1, 4, size=(4, B)).astype(np.int32)
    got = np.asarray(_after(rule_rows, x, gen))
    want = np_ban(x, np.stack([np_bad_words(x[b], words[:b + 1], gen[:, b].tolist()) for b in range(B)]))
    np.testing.assert_array_equal(got, want)


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


def test_the_engine_refuses_the_controls_by_name(lm):
    from jaxdecode.serving import Engine, Request

    engine = Engine(lm, 2)
    with pytest.raises(ParamsError, match="request 0: the engine does not take logit_bias"):
        engine.submit(Request("ab", 4, params=DecodeParams(logit_bias={1: 1.0})))
    with pytest.raises(ValueError, match=r"request 0: the engine does not take logit controls \(BadWords\)"):
        engine.submit(Request("ab", 4, rule=rules.chain(rules.bad_words([[1]]), rules.top_p(0.9))))
