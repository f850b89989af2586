"""``jaxdecode serve`` under an evaluation harness's two kinds of request, on the shipped character
model (one server for the module, the harness of ``tests/server/test_server.py``):

- ``loglikelihood``: a multiple-choice set of 12 questions of 4 choices (48 context/continuation
  pairs, ``tests/fixtures/server_mc.json``), each pair one prompt of token ids with ``echo``,
  ``logprobs: 1``, ``temperature: 0`` and ``max_tokens`` 0 or 1, as lm-evaluation-harness's
  ``local-completions`` model sends them in batches. Every continuation's summed log-probability
  must equal :func:`jaxdecode.score` within 1e-4, and a plain forward of the model over the
  whole sequence (float64 log-softmax, no cache, no scoring code of the library), so a bug that
  the server's scoring shares with ``score`` still shows; the chosen answer of every question and
  the harness's ``is_greedy`` flag must agree too.
- ``generate_until``: greedy completions with a stop list and ``max_tokens``, the questions with
  the same settings batched in one request as the harness groups them; each text and finish
  reason must equal :func:`jaxdecode.generate` with the same settings.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import jaxdecode  # noqa: E402
from jaxdecode.models.charlm import transformer as M  # noqa: E402
from support.servers import serving  # noqa: E402
from support.servers import client  # noqa: E402

FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "server_mc.json").read_text(encoding="utf-8"))
QUESTIONS = FIXTURE["questions"]
ATOL = 1e-4  # the server's sums against score's and the plain forward's: float32 rounding only
BATCH = 16  # pairs per request, as the harness's batch_size


@pytest.fixture(scope="module")
def char():
    with serving(char=("--slots", "4")) as procs:
        yield procs["char"].ready()


@pytest.fixture(scope="module")
def lm():
    return jaxdecode.load()


def _pairs(lm) -> list[tuple[list[int], int]]:
    """The harness's requests: ``(context tokens + continuation tokens, len(context tokens))`` per
    choice, question by question."""
    out = []
    for q in QUESTIONS:
        ctx = [int(t) for t in lm.vocab.encode(q["context"])]
        for choice in q["choices"]:
            out.append((ctx + [int(t) for t in lm.vocab.encode(choice)], len(ctx)))
    return out


@pytest.mark.quick
def test_the_fixture_is_a_multiple_choice_set_the_model_can_encode(lm):
    assert len(QUESTIONS) == 12 and all(len(q["choices"]) == 4 for q in QUESTIONS)
    pairs = _pairs(lm)
    assert len(pairs) == 48
    for q in QUESTIONS:
        assert len(set(q["choices"])) == 4 and 0 <= q["gold"] < 4
        assert q["until"] and all(q["until"]) and 0 < q["max_tokens"] <= 32
    assert max(len(p) for p, _ in pairs) < lm.decoder.T


def _loglikelihoods(server, pairs, max_tokens: int) -> list[tuple[float, bool]]:
    """What lm-evaluation-harness reads back from its requests, sent ``BATCH`` at a time:
    ``(sum of the continuation's token_logprobs, is_greedy)`` per pair."""
    out = []
    for start in range(0, len(pairs), BATCH):
        part = pairs[start:start + BATCH]
        r = client(server).completions.create(model=server.name, prompt=[p for p, _ in part], temperature=0,
                                              max_tokens=max_tokens, logprobs=1, seed=1234, echo=True)
        choices = sorted(r.choices, key=lambda c: c.index)
        assert [c.index for c in choices] == list(range(len(part)))
        for choice, (p, ctxlen) in zip(choices, part):
            lp = choice.logprobs
            assert len(lp.token_logprobs) == len(p) + max_tokens and lp.token_logprobs[0] is None
            assert choice.finish_reason == "length"
            cont = lp.token_logprobs[ctxlen:len(p)]
            is_greedy = all(v == max(top.values()) for v, top in zip(cont, lp.top_logprobs[ctxlen:len(p)]))
            out.append((float(sum(cont)), is_greedy))
    return out


@functools.partial(jax.jit, static_argnums=1)
def _forward(params, cfg, tokens):
    return M.forward(params, cfg, tokens)


def _plain(lm, pairs) -> tuple[np.ndarray, list[bool]]:
    """Each continuation's summed log-probability from one forward of the model over the whole
    sequence (padded at the end: the model is causal), log-softmax in float64; and whether each of
    its tokens is the most probable one."""
    width = max(len(p) for p, _ in pairs)
    x = np.zeros((len(pairs), width), np.int32)
    for r, (p, _) in enumerate(pairs):
        x[r, :len(p)] = p
    logits = np.asarray(_forward(lm.params, lm.cfg, jnp.asarray(x)), np.float64)
    sums, greedy = [], []
    for r, (p, ctxlen) in enumerate(pairs):
        z = logits[r, ctxlen - 1:len(p) - 1]  # the logits that predict the continuation's tokens
        m = z.max(-1, keepdims=True)
        lsm = z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))
        target = np.asarray(p[ctxlen:])
        sums.append(lsm[np.arange(len(target)), target].sum())
        greedy.append(bool((z.argmax(-1) == target).all()))
    return np.asarray(sums), greedy


def test_multiple_choice_loglikelihoods_equal_score_and_a_plain_forward(char, lm):
    pairs = _pairs(lm)
    prompts = [q["context"] for q in QUESTIONS for _ in q["choices"]]
    texts = [c for q in QUESTIONS for c in q["choices"]]
    want = np.asarray([float(np.sum(s.logprobs)) for s in jaxdecode.score(lm, texts, prompts)])
    plain, plain_greedy = _plain(lm, pairs)
    np.testing.assert_allclose(want, plain, rtol=0, atol=ATOL)  # the two references agree
    for max_tokens in (0, 1):  # the brief's 0 (no token generated) and the harness's own 1
        got = _loglikelihoods(char, pairs, max_tokens)
        sums = np.asarray([s for s, _ in got])
        bad = [(k, texts[k], sums[k], want[k]) for k in range(48) if not abs(sums[k] - want[k]) <= ATOL]
        assert not bad, f"max_tokens={max_tokens}: pairs whose sum differs from score's: {bad}"
        np.testing.assert_allclose(sums, plain, rtol=0, atol=ATOL)
        assert [g for _, g in got] == plain_greedy
        np.testing.assert_array_equal(sums.reshape(12, 4).argmax(1), want.reshape(12, 4).argmax(1))
    # the set is not degenerate: the chosen answers differ between questions, some choices are
    # greedy continuations and most are not, and no question's best two choices tie
    chosen = want.reshape(12, 4).argmax(1)
    assert len(set(chosen.tolist())) > 1
    assert 0 < sum(plain_greedy) < 48
    top2 = np.sort(want.reshape(12, 4), axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 100 * ATOL


def test_generate_until_equals_generate(char, lm):
    """Greedy requests with a stop list and max_tokens, the questions that share their settings in
    one request (prompt strings, as the harness sends them without tokenizing), each text and
    finish reason equal to generate's with the same settings (the stop string cut, as OpenAI's API
    does)."""
    groups: dict = {}
    for q in QUESTIONS:
        groups.setdefault((tuple(q["until"]), q["max_tokens"]), []).append(q["context"])
    finishes, texts = [], []
    for (until, max_tokens), contexts in groups.items():
        r = client(char).completions.create(model=char.name, prompt=contexts, max_tokens=max_tokens,
                                            temperature=0, stop=list(until), seed=1234)
        got = [(c.text, c.finish_reason) for c in sorted(r.choices, key=lambda c: c.index)]
        gens = jaxdecode.generate(lm, contexts, n=max_tokens, greedy=True, stop=list(until), include_stop=False)
        want = [(g.text, {"stop": "stop", "eos": "stop", "length": "length"}[g.finish_reason]) for g in gens]
        assert got == want, (until, max_tokens)
        finishes += [f for _, f in got]
        texts += [t for t, _ in got]
        for (text, finish), g in zip(got, gens):
            assert not any(s in text for s in until)
            if finish == "length":
                assert len(g.tokens) == max_tokens
    # both ends occur: stopped by a stop string (one before any text) and cut at max_tokens
    assert "stop" in finishes and "length" in finishes and "" in texts
