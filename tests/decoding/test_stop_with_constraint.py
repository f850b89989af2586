"""A stop string inside a constrained text: every loop that takes both ends the text at the stop
string, as sampling does, never with an empty result.

The constraint is one choice, so its text is known: with a stop string taken from each position of
it, every loop must return that text up to and including the first occurrence of the stop string
(cut there with ``include_stop=False``), finished by the stop. The subword model's tokens join
several characters, and the choice holds multi-byte characters, so stops fall inside tokens and
inside the bytes of one character's token pieces."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode import constraints as C
from jaxdecode.decoding.beam import BeamSearchError, beam_search
from jaxdecode.io.vocab import Vocab
from jaxdecode.models import FunctionModel
from jaxdecode.serving.engine import Engine, Request
from jaxdecode.speculative import make_draft, speculative_generate

TEXT = "Roméo ❤ Juliet — adieu"
PROMPT = "ROMEO:\n"
N = 40


@pytest.fixture(scope="module")
def bpe():
    return jaxdecode.load("shakespeare-bpe", backend="portable")


@pytest.fixture(scope="module")
def choice(bpe):
    return C.compile_choices([TEXT], bpe.vocab)


def _stops():
    """A one-character stop at every position of TEXT (a repeated character stops at its first
    occurrence), stops across the multi-byte characters and the spaces, and the whole text."""
    out = [TEXT[i] for i in range(len(TEXT))] + ["é", "éo", "o ❤", "❤ J", "t —", "— a", TEXT]
    return list(dict.fromkeys(out))


def _expected(stop: str) -> str:
    return TEXT[:TEXT.index(stop) + len(stop)]


def _loops(bpe, choice, stop):
    """Each loop's first text and whether it finished by the stop, for ``stop``."""
    out = {}
    g = jaxdecode.generate(bpe, PROMPT, N, greedy=True, stop=stop, constraint=choice)[0]
    out["greedy"] = (g.text, g.finish_reason)
    g = jaxdecode.generate(bpe, PROMPT, N, seed=3, stop=stop, constraint=choice)[0]
    out["sampled"] = (g.text, g.finish_reason)
    b = jaxdecode.beam_generate(bpe, PROMPT, N, 3, n_best=3, stop=stop, constraint=choice)[0]
    assert b, "beam search returned no hypothesis"
    out["beam"] = (b[0].text, "stop" if b[0].finished else "length")
    out["beam-all"] = ({h.text for h in b}, None)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stop", _stops())
def test_every_loop_ends_at_a_stop_inside_the_constrained_text(bpe, choice, stop):
    want = _expected(stop)
    for loop, (text, reason) in _loops(bpe, choice, stop).items():
        if loop == "beam-all":  # every hypothesis is the text cut at the stop (one text, however tokenized)
            assert text == {want}, (stop, text)
        else:
            assert (text, reason) == (want, "stop"), (loop, stop)


def test_speculative_and_the_engine_end_at_the_stop(bpe, choice):
    """Speculative sampling (a prompt-lookup draft) and the engine, at a sample of the stops."""
    draft = make_draft("lookup", bpe)
    stops = ["R", "é", "❤", " J", "t —", "—", "u", TEXT]
    engine = Engine(bpe, 2, prefill_chunk=16)
    report = engine.run([Request(PROMPT, N, seed=i, stop=s, constraint=choice) for i, s in enumerate(stops)])
    for i, stop in enumerate(stops):
        want = _expected(stop)
        g = speculative_generate(bpe, PROMPT, N, draft=draft, gamma=3, seed=1, stop=stop, constraint=choice)[0]
        assert (g.text, g.finish_reason) == (want, "stop"), ("speculative", stop)
        cut = speculative_generate(bpe, PROMPT, N, draft=draft, gamma=3, seed=1, stop=stop, constraint=choice,
                                   include_stop=False)[0]
        assert cut.text == want[:-len(stop)]
        out = report.results[i].outputs[0]
        assert (out.text, out.finish_reason) == (want, "stop"), ("engine", stop)


@pytest.mark.quick
def test_include_stop_false_cuts_the_stop_in_every_loop(bpe, choice):
    stop = "❤ J"
    want = _expected(stop)[:-len(stop)]
    assert jaxdecode.generate(bpe, PROMPT, N, greedy=True, stop=stop, constraint=choice,
                              include_stop=False)[0].text == want
    assert jaxdecode.beam_generate(bpe, PROMPT, N, 2, stop=stop, constraint=choice,
                                   include_stop=False)[0][0].text == want


def _only_token_two(params, tokens):
    """A model that puts all its mass on token 2 at every position (the others: -inf)."""
    B, t = tokens.shape
    return jnp.broadcast_to(jnp.where(jnp.arange(3) == 2, 0.0, -jnp.inf), (B, t, 3))


@pytest.mark.quick
def test_no_hypothesis_is_an_error_not_an_empty_list():
    """A row whose every allowed token has probability zero has no hypothesis: one clear error."""
    model = FunctionModel(_only_token_two, V=3, T=16)
    only_a = C.compile_regex("a+", Vocab("abc"))  # token 0 only: probability zero under the model
    with pytest.raises(BeamSearchError, match="no continuation of prompt 0 has a finite score"):
        beam_search(model, {}, [np.array([1])], 4, 2, constraint=only_a)
    assert beam_search(model, {}, [np.array([1])], 4, 2).hypotheses[0]  # free: token 2 every step
