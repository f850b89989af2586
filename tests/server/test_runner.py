"""The engine's loop as the server drives it (jaxdecode/server/runner.py): every request's deltas,
handed out one turn at a time, add up to what the engine gives the request alone, for requests in
line, running, stopped, aborted, and with several samples."""

import numpy as np
import pytest

from jaxdecode.models.checkpoint import LanguageModel
from jaxdecode.server.runner import FINISHED, EngineLoop
from jaxdecode.serving.engine import Engine, Request
from support.engine import generated_alone, mixed_requests


@pytest.fixture(scope="module")
def lm(tiny_model):
    cfg, params, vocab = tiny_model
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend="portable")


def drive(engine, requests, abort_at=None, turns=400):
    """Submit ``requests`` (keys 0..), turn until the loop is idle (at most ``turns``); returns
    each key's items. ``abort_at``: ``(key, turn)``, that request aborted before that turn."""
    loop = EngineLoop(engine)
    items = {k: [] for k in range(len(requests))}
    for k, r in enumerate(requests):
        for key, item in loop.submit(k, r, include_stop=False):
            items[key].append(item)
    for turn in range(turns):
        if not loop.busy:
            return items
        if abort_at is not None and turn == abort_at[1]:
            loop.abort(abort_at[0])
        for key, item in loop.turn():
            items[key].append(item)
    raise AssertionError(f"the loop was still busy after {turns} turns: a request never finished")


def samples(items, count):
    """Per sample: (text, tokens, finish reason) from a key's items, checking their order."""
    assert items[0][0] == "accepted" and items[-1] == FINISHED
    assert FINISHED not in items[:-1]
    text, tokens, finish = [""] * count, [[] for _ in range(count)], [None] * count
    for deltas in items[1:-1]:
        for d in deltas:
            assert finish[d.sample] is None, "a sample handed out more after it finished"
            text[d.sample] += d.text
            tokens[d.sample] += d.tokens
            finish[d.sample] = d.finish_reason
    return text, tokens, finish


@pytest.mark.quick
def test_deltas_add_up_to_generate_for_rows_in_line_and_running(lm):
    reqs = mixed_requests()
    refs = generated_alone(lm, reqs)
    engine = Engine(lm, 2, prefill_chunk=4)  # two slots: most requests wait in line for several turns
    items = drive(engine, reqs)
    for k, (r, ref) in enumerate(zip(reqs, refs)):
        text, tokens, finish = samples(items[k], r.num_samples)
        for j, want in enumerate(ref):
            stop = r.stop if want.finish_reason == "stop" else ""
            assert text[j] + stop == want.text  # (a server's stream leaves the stop string out)
            assert tokens[j] == np.asarray(want.tokens).tolist()[:len(tokens[j])]
            assert finish[j] == want.finish_reason


@pytest.mark.quick
def test_an_aborted_request_finishes_and_the_others_are_whole(lm):
    reqs = [Request("abc da", 9, seed=1), Request("hi", 12, seed=2), Request("bad", 12, seed=3, num_samples=2)]
    refs = generated_alone(lm, reqs)
    for turn in (0, 3):  # in line (one slot: request 1 waits), then while it runs
        items = drive(Engine(lm, 1, prefill_chunk=4), reqs, abort_at=(1, turn))
        _, _, finish = samples(items[1], 1)
        assert finish == ["abort"]
        for k in (0, 2):
            text, _, finish = samples(items[k], reqs[k].num_samples)
            assert text == [g.text for g in refs[k]] and finish == [g.finish_reason for g in refs[k]]


def test_a_request_of_no_tokens_finishes(lm):
    items = drive(Engine(lm, 2), [Request("abc", 0, seed=1), Request("hi", 3, seed=2)])
    assert samples(items[0], 1)[2] == ["length"]
    assert samples(items[1], 1)[2] == ["length"]
