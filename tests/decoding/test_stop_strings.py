"""Stop strings and end tokens, to the last byte, in every loop on a byte-level BPE Llama.

The rule: ``decode(tokens) == text`` (an end token kept in ``tokens`` aside); where a stop string
ends a row, the tokens are the fewest whose text contains it, ``text`` ends with it and is a
prefix of ``decode(tokens)``; ``len(model_logprobs) == len(tokens)``; a beam's ``score`` is the
model's log-probability of the tokens it returns. A property test checks it in every loop against
a plain re-implementation over the same loop's run without stop strings (whose tokens the
stopped run must repeat up to the stop: the row ends on the device, not after the fact), with
stop strings drawn from the text the model produces, multi-byte characters, emoji and combining
marks. Deterministic tests pin each of the four faults of issue 37 with a scripted model that
spells a stop string with other tokens than its own encoding.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxdecode
from jaxdecode import speculative
from jaxdecode.decoding import beam as BS
from jaxdecode.decoding import sampling as S
from jaxdecode.decoding.common import finish_text
from jaxdecode.decoding.score import token_logprobs
from jaxdecode.decoding.stops import StopAutomaton, aho_corasick, stop_automaton, token_stop_automaton
from jaxdecode.models import FunctionModel
from jaxdecode.models.lm import LanguageModel
from support.stop_rule import check_rule, reference, split_ends, substrings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
PROMPT, N = "ROMEO:", 24
EXTRA = ["é", "🙂", "e\u0301", "\u0301", "日本", "ñ", "Ω", "\n", " the"]  # multi-byte, emoji, combining
LOOPS = ("sampling", "greedy", "beam", "speculative", "contrastive")
ALPHA = 1.5  # beam search's length penalty


@pytest.fixture(scope="module")
def lm():
    return jaxdecode.load(FIXTURES / "llama")


@pytest.fixture(scope="module")
def draft():
    return speculative.ModelDraft.from_lm(jaxdecode.load(FIXTURES / "llama-draft"))


def run(lm, draft, loop, stop, on_text=None):
    """The loop's outputs for the prompt: Generations, or the beam's texts (three, best first)."""
    if loop == "sampling":
        return jaxdecode.generate(lm, PROMPT, n=N, seed=3, num_samples=4, stop=stop, on_text=on_text, chunk=4)
    if loop == "greedy":
        return jaxdecode.generate(lm, [PROMPT, "JULIET:\n"], n=N, greedy=True, stop=stop, on_text=on_text)
    if loop == "beam":
        # (a length penalty: without one the beams end at once with an end token on this model)
        return jaxdecode.beam_generate(lm, [PROMPT, "The café"], N, 3, n_best=3, length_penalty=ALPHA,
                                       stop=stop)
    if loop == "speculative":
        return speculative.speculative_generate(lm, PROMPT, N, draft=draft, gamma=3, seed=5, num_samples=3,
                                                stop=stop, on_text=on_text)
    return jaxdecode.contrastive_generate(lm, [PROMPT, "JULIET:\n"], N, k=3, alpha=0.6, stop=stop,
                                          on_text=on_text)


@pytest.fixture(scope="module")
def free(lm, draft):
    """Each loop's run without stop strings, and the stop strings drawn from its text."""
    runs, pools = {}, {}
    for loop in LOOPS:
        outs = run(lm, draft, loop, None)
        flat = [h for hyps in outs for h in hyps] if loop == "beam" else outs
        runs[loop] = outs
        text, inside = set(), set()
        for o in flat:
            text |= substrings(o.text)
            inside |= split_ends(lm, [t for t in o.tokens.tolist() if t not in lm.eos_ids])
        pools[loop] = sorted(text), sorted(inside)
    return runs, pools


def test_the_fixture_spells_multi_byte_characters_over_several_tokens(lm, free):
    """The property test below draws stop strings that end inside a token, and the runs hold
    characters of more than one byte."""
    runs, pools = free
    texts = [o.text for o in runs["sampling"] + runs["contrastive"]]
    assert any(len(c.encode("utf-8")) > 1 and c != "\ufffd" for t in texts for c in t)
    assert all(len(pools[loop][0]) > 50 for loop in LOOPS)
    assert sum(len(pools[loop][1]) > 0 for loop in LOOPS) >= 3


def _tokens(lm, prompt):
    return lm.vocab.encode(prompt)


@settings(max_examples=10, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
@pytest.mark.parametrize("loop", LOOPS)
def test_every_loop_ends_rows_at_the_first_stop_string_to_the_byte(lm, draft, free, loop, data):
    runs, pools = free
    text, inside = pools[loop]
    drawn = st.one_of(st.sampled_from(text), st.sampled_from(inside)) if inside else st.sampled_from(text)
    stops = data.draw(st.lists(drawn, min_size=1, max_size=2), label="stops")
    stops += data.draw(st.lists(st.sampled_from(EXTRA), max_size=1), label="extra")
    streamed = {}
    outs = run(lm, draft, loop, stops, on_text=lambda r, t: streamed.setdefault(r, []).append(t))
    if loop != "beam":
        for r, (o, f) in enumerate(zip(outs, runs[loop], strict=True)):
            tokens, text, reason = reference(lm, f.tokens.tolist(), stops)
            assert (o.tokens.tolist(), o.text, o.finish_reason) == (tokens, text, reason)
            check_rule(lm, o.tokens, o.text, o.finish_reason, stops)
            assert len(o.model_logprobs) == len(o.sample_logprobs) == len(o.tokens)
            np.testing.assert_array_equal(o.model_logprobs, f.model_logprobs[:len(o.tokens)])
            # the row ended on the device: nothing past its last token was generated and streamed
            body = [t for t in o.tokens.tolist() if t not in lm.eos_ids]
            assert "".join(streamed.get(r, [])) == lm.vocab.decode(body).rstrip("\ufffd")
        return
    for prompt, hyps in zip((PROMPT, "The café"), outs, strict=True):
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        ids = _tokens(lm, prompt)
        for h in hyps:
            toks = h.tokens.tolist()
            eos = bool(toks) and toks[-1] in lm.eos_ids
            reason = "eos" if eos else "stop" if any(s in h.text for s in stops) else "length"
            check_rule(lm, toks, h.text, reason, stops)
            assert h.finished == (reason != "length") and (reason != "length" or len(toks) == N)
            seq = np.concatenate([ids, h.tokens])
            want = float(token_logprobs(lm.decoder, lm.params, [seq], [len(ids)])[0].sum())
            assert h.logprob == pytest.approx(want, abs=2e-4)
            assert h.score == pytest.approx(want / ((5 + len(toks)) / 6) ** ALPHA, abs=2e-4)


def test_streamed_text_never_passes_the_stop(lm):
    """Streaming stops with the row: what is streamed is whole characters of the returned tokens."""
    free = jaxdecode.generate(lm, PROMPT, n=N, seed=3)[0]
    stop = next(s for s in sorted(substrings(free.text[6:])) if len(s) == 2)
    pieces = []
    out = jaxdecode.generate(lm, PROMPT, n=N, seed=3, stop=stop, chunk=4,
                             on_text=lambda r, t: pieces.append(t))[0]
    assert out.finish_reason == "stop" and len(out.tokens) < N
    assert "".join(pieces) == lm.vocab.decode(out.tokens).rstrip("\ufffd")


# ----------------------------------------------------------------------------- a scripted model


def byte_token(lm, b: bytes) -> int:
    return next(i for i in range(len(lm.vocab)) if lm.vocab.token_bytes(i) == b and i not in lm.vocab.special)


def spelled(lm, text: str) -> list[int]:
    """``text`` one byte per token: not how the tokenizer encodes it."""
    return [byte_token(lm, bytes([c])) for c in text.encode("utf-8")]


def scripted(lm, script, prompt_len: int):
    """A model over ``lm``'s vocabulary that generates ``script`` after a prompt of ``prompt_len``
    tokens: at each position the next token of the script has logit 12, the others small random
    ones (so beams have alternatives, far behind)."""
    V, T = lm.decoder.V, 64
    rng = np.random.default_rng(0)
    table = rng.normal(0.0, 1.0, (T, V)).astype(np.float32)
    for i, t in enumerate(script):
        table[prompt_len - 1 + i, t] = 12.0
    emb = rng.normal(0.0, 1.0, (V, 8)).astype(np.float32)

    def logits_fn(params, tokens):
        table, emb = params
        B, t = tokens.shape
        return jnp.broadcast_to(table[None, :t], (B, t, V)), emb[tokens]

    model = FunctionModel(logits_fn, V=V, T=T)
    return LanguageModel(params=(jnp.asarray(table), jnp.asarray(emb)), cfg=None, vocab=lm.vocab, meta={},
                         decoder=model, eos_ids=lm.eos_ids)


@pytest.mark.quick
def test_issue_37_1_a_stop_string_ending_in_a_split_character_keeps_its_last_byte(lm):
    """"é" spelled as its two bytes, one token each: the tokens kept end with the second byte (a
    count of characters found the first, whose prefix decodes to U+FFFD, one token early)."""
    script = lm.vocab.encode_piece("ab").tolist() + spelled(lm, "é") + lm.vocab.encode_piece("cd").tolist()
    tokens, text, reason = finish_text(lm, np.asarray(script), False, "bé")
    assert (tokens.tolist(), text, reason) == (script[:-len(lm.vocab.encode_piece("cd"))], "abé", "stop")
    prompt = lm.vocab.encode("x")
    slm = scripted(lm, script, len(prompt))
    out = jaxdecode.generate(slm, "x", n=10, greedy=True, stop="bé")[0]
    assert out.text == "abé" and lm.vocab.decode(out.tokens) == "abé" and out.finish_reason == "stop"
    assert len(out.model_logprobs) == len(out.tokens) == len(tokens)


NIGHT = " night"  # one token of the vocabulary, spelled here with six


@pytest.fixture(scope="module")
def night(lm):
    assert len(lm.vocab.encode_piece(NIGHT)) == 1
    prompt = lm.vocab.encode("x")
    head = lm.vocab.encode_piece("Good").tolist()
    script = head + spelled(lm, NIGHT) + lm.vocab.encode_piece(" sweet").tolist() + [2]  # then an end token
    return scripted(lm, script, len(prompt)), script, len(head) + len(NIGHT)


def test_issue_37_2a_the_stop_string_comes_before_a_later_end_token(lm, night):
    _, script, at = night
    tokens, text, reason = finish_text(lm, np.asarray(script), True, NIGHT)
    assert (tokens.tolist(), text, reason) == (script[:at], "Good night", "stop")


@pytest.mark.parametrize("loop", ["sampling", "greedy", "speculative", "contrastive"])
def test_issue_37_2b_a_stop_string_spelled_otherwise_ends_the_row_on_the_device(night, loop):
    slm, script, at = night
    if loop == "contrastive":
        outs = jaxdecode.contrastive_generate(slm, "x", 20, k=2, alpha=0.0, stop=NIGHT)
    elif loop == "speculative":
        draft = speculative.ModelDraft.from_lm(slm)
        outs = speculative.speculative_generate(slm, "x", 20, draft=draft, gamma=3, greedy=True, stop=NIGHT)
    else:
        outs = jaxdecode.generate(slm, "x", n=20, greedy=loop == "greedy", seed=1, stop=NIGHT)
    o = outs[0]
    assert (o.tokens.tolist(), o.text, o.finish_reason) == (script[:at], "Good night", "stop")
    # on the device: the token loop's own count ends at the stop, and nothing is streamed past it
    stops = stop_automaton(slm, NIGHT)
    res = S.sample_tokens(slm.decoder, slm.params, [slm.vocab.encode("x")], 20, jax.random.PRNGKey(0),
                          greedy=True, stops=stops)
    assert res.counts[0] == at and res.stopped[0]


def test_issue_37_3_a_beam_ends_at_the_stop_with_the_score_of_its_tokens(lm, night):
    slm, script, at = night
    prompt = slm.vocab.encode("x")
    hyps = jaxdecode.beam_generate(slm, "x", 20, 3, n_best=3, stop=NIGHT)[0]
    best = hyps[0]
    assert best.tokens.tolist() == script[:at] and best.text == "Good night" and best.finished
    for h in hyps:
        want = token_logprobs(slm.decoder, slm.params, [np.concatenate([prompt, h.tokens])], [len(prompt)])[0]
        assert h.score == pytest.approx(float(want.sum()), abs=1e-4) == h.logprob
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    # the fallback for a vocabulary whose text ends a hypothesis before its bytes do: scored again
    score, logprob = BS._rescore(slm, prompt, np.asarray(script[:3]), 1.0, None, None)
    want = token_logprobs(slm.decoder, slm.params, [np.concatenate([prompt, script[:3]])], [len(prompt)])[0]
    assert logprob == pytest.approx(float(want.sum()), abs=1e-5) and score == pytest.approx(logprob / (8 / 6))


@pytest.mark.quick
def test_issue_37_4_extend_past_the_capacity_raises_naming_it(lm):
    dec = lm.decoder
    cache = dec.empty_cache(1, 16)
    _, _, cache = dec.extend(lm.params, cache, jnp.ones((1, 10), jnp.int32))
    with pytest.raises(ValueError, match="capacity of 16"):
        dec.extend(lm.params, cache, jnp.ones((1, 7), jnp.int32))  # known lengths: 10 + 7 > 16
    with pytest.raises(ValueError, match="capacity of 16"):
        jax.jit(dec.extend)(lm.params, cache, jnp.ones((1, 17), jnp.int32))  # the static shapes
    logits, _, cache = dec.extend(lm.params, cache, jnp.ones((1, 6), jnp.int32))  # exactly full
    assert logits.shape == (1, 6, dec.V) and int(cache.length[0]) == 16


# ----------------------------------------------------------------------------- the automaton


@pytest.mark.quick
def test_aho_corasick_matches_a_plain_search():
    rng = np.random.default_rng(0)
    for _ in range(200):
        pats = [rng.integers(0, 3, rng.integers(1, 4)).tolist() for _ in range(rng.integers(1, 4))]
        seq = rng.integers(0, 3, 12).tolist()
        table, done = aho_corasick(pats, 3)
        s, hit = 0, None
        for i, c in enumerate(seq):
            s = table[s, c]
            if s == done:
                hit = i + 1
                break
        want = next((k for k in range(1, 13) if any(seq[k - len(p):k] == p for p in pats if len(p) <= k)),
                    None)
        assert hit == want, (pats, seq)


def test_the_byte_automaton_agrees_with_the_text_on_random_tokens(lm):
    """Random token sequences (broken characters included) and pieces of their text: the step
    at which the automaton accepts is where the decoded text first holds the stop string."""
    rng = np.random.default_rng(1)
    tried = 0
    for _ in range(400):
        toks = [t for t in rng.integers(4, lm.decoder.V, rng.integers(1, 12)).tolist() if t not in lm.eos_ids]
        text = lm.vocab.decode(toks)
        pieces = sorted(substrings(text) | split_ends(lm, toks))
        if not pieces:
            continue
        stop = pieces[rng.integers(len(pieces))]
        found = reference(lm, toks, [stop])
        hit = stop_automaton(lm, stop).first_hit(toks)
        assert hit == (len(found[0]) if found[2] == "stop" else -1), (toks, stop)
        tried += 1
    assert tried > 300


def test_automaton_shapes_are_bucketed_and_checked(lm):
    a, b = stop_automaton(lm, "ab"), stop_automaton(lm, ["x", "yz"])
    assert a.table.shape == b.table.shape == (8, lm.decoder.V)  # one program for both
    assert stop_automaton(lm, "a" * 12).table.shape[0] == 16
    assert all(a.hit(a.step(0, e)) for e in lm.eos_ids)
    tok = token_stop_automaton([[5, 6], [7]], 10)
    assert isinstance(tok, StopAutomaton) and tok.first_hit([1, 5, 6, 7]) == 3 and tok.first_hit([7]) == 1
    for bad in ("", "a\ufffd", "\ud800"):
        with pytest.raises(ValueError):
            stop_automaton(lm, bad)


def test_include_stop_false_cuts_the_stop_string_that_ends_first():
    """``include_stop=False`` (OpenAI's convention) drops exactly the stop string that ended the
    sample, the longest of those ending at that point; the tokens still hold it."""
    from jaxdecode.decoding.common import finish_text

    lm = jaxdecode.load()
    kept = jaxdecode.generate(lm, "ROMEO:\n", n=80, seed=0, stop=["\n\n", "the"])[0]
    cut = jaxdecode.generate(lm, "ROMEO:\n", n=80, seed=0, stop=["\n\n", "the"], include_stop=False)[0]
    assert kept.finish_reason == cut.finish_reason == "stop"
    assert kept.text == cut.text + "the" and list(kept.tokens) == list(cut.tokens)
    tokens = lm.vocab.encode("a cab")
    assert finish_text(lm, tokens, True, ["ab", "b"], include_stop=False)[1] == "a c"
    assert finish_text(lm, tokens, True, ["ab", "b"])[1] == "a cab"
