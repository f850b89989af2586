"""``jaxdecode serve`` tested from the outside: real server processes on 127.0.0.1
(``python -m jaxdecode.cli serve --port 0``), driven with the real ``openai`` client and with raw
``httpx``. Every generated text is checked against :func:`jaxdecode.generate` run in this process
with the same seed and settings, every log-probability against :func:`jaxdecode.score`.

Servers (started once each, shared by the tests; each is stopped with SIGTERM at the end and must
exit 0 without a traceback on its stderr):

- ``char``: the shipped character model with a small chat template of the test's own, 8 slots;
- ``llama``: the byte-level BPE Hugging Face fixture (an end token, the folder's chat template);
- ``small``: the character model with one slot, a queue of one, an API key and no chat template,
  its engine in a thread of the server's process (``--engine-thread``; the others run it in a
  process of its own);
- ``doomed``: one slot; its engine's process is killed;
- the SIGTERM test starts and stops one more of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import signal
import threading
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import jaxdecode  # noqa: E402
from jaxdecode.decoding.score import token_logprobs  # noqa: E402

from support.servers import (  # noqa: E402
    CHAR_CHAT_PROMPT,
    CHAR_TEMPLATE,
    CHAT,
    CHATML_TEMPLATE,
    HF,
    KEY,
    LOGPROB_ATOL,
    METRIC_SAMPLES,
    REQUEST_S,
    check_error,
    client,
    completion_texts,
    expect,
    metrics,
    post,
    serving,
    settle,
    sse_events,
    still_serving,
)

@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    folder = tmp_path_factory.mktemp("templates")
    (folder / "char.jinja").write_text(CHAR_TEMPLATE)
    (folder / "chatml.jinja").write_text(CHATML_TEMPLATE)
    return folder


def _llama_has_template() -> bool:
    config = json.loads((HF / "tokenizer_config.json").read_text())
    return (HF / "chat_template.jinja").exists() or "chat_template" in config


@pytest.fixture(scope="module")
def processes(templates):
    """The servers, started together (their starts overlap), stopped together at the end (the
    SIGTERM test stops "drain" itself)."""
    llama_template = [] if _llama_has_template() else ["--chat-template", str(templates / "chatml.jinja")]
    with serving(char=("--chat-template", str(templates / "char.jinja"), "--slots", "8"),
                 llama=("--ckpt", str(HF), "--slots", "8", *llama_template),
                 small=("--slots", "1", "--max-waiting", "1", "--api-key", KEY, "--served-model-name", "small",
                        "--engine-thread"),
                 doomed=("--slots", "1", "--served-model-name", "doomed"),
                 drain=("--slots", "1", "--log-level", "info", "--served-model-name", "drain")) as procs:
        yield procs


@pytest.fixture(scope="module")
def char(processes):
    return processes["char"].ready()


@pytest.fixture(scope="module")
def llama(processes):
    return processes["llama"].ready()


@pytest.fixture(scope="module")
def small(processes):
    return processes["small"].ready()


@pytest.fixture(scope="module")
def char_lm():
    return jaxdecode.load()


@pytest.fixture(scope="module")
def llama_lm():
    return jaxdecode.load(HF)


# ----------------------------------------------------------------------------- completions and chat


@pytest.mark.quick
def test_completions_n_samples_equal_generate(char, char_lm):
    resp = client(char).completions.create(model=char.name, prompt="ROMEO:", max_tokens=24, n=3, seed=11,
                                           temperature=0.8, extra_body={"top_k": 20})
    assert resp.object == "text_completion" and resp.model == "shakespeare-char"
    want = expect(char_lm, "ROMEO:", 24, 11, n=3, temperature=0.8, top_k=20)
    assert completion_texts(resp, 3) == [(t, f) for t, f, _ in want]
    assert all(f == "length" for _, f, _ in want)
    assert len({t for t, _, _ in want}) == 3  # three different samples
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (6, 72, 78)


def test_completions_stream_chunks(char, char_lm):
    """The raw stream: ``data: {...}`` events, ``data: [DONE]`` last, one finish reason per choice on
    its last chunk, ``usage: null`` on every chunk and a last chunk of usage alone."""
    # (long enough to stream in several chunks: a stream that falls behind the engine gets what
    # queued up merged into one chunk, and the engine can run a short request's steps faster than the
    # response starts)
    body = {"model": char.name, "prompt": "JULIET:", "max_tokens": 160, "n": 2, "seed": 5, "temperature": 0.9,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", char.url + "/completions", json=body, timeout=REQUEST_S) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" and c["model"] == char.name for c in chunks)
    *parts, last = chunks
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 7, "completion_tokens": 320,
                                                       "total_tokens": 327}
    assert all("usage" in c and c["usage"] is None for c in parts)
    texts, finishes = ["", ""], [[], []]
    for c in parts:
        for choice in c["choices"]:
            assert finishes[choice["index"]] == [], "a chunk after the choice's finish reason"
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"] is not None:
                finishes[choice["index"]].append(choice["finish_reason"])
    want = expect(char_lm, "JULIET:", 160, 5, n=2, temperature=0.9)
    assert texts == [t for t, _, _ in want]
    assert finishes == [["length"], ["length"]]
    assert len(parts) > 2  # streamed, not one chunk


def test_completions_stream_several_prompts_with_the_client(char, char_lm):
    """A list of prompts with n = 2: choice ``k * n + j`` is sample j of prompt k."""
    stream = client(char).completions.create(model=char.name, prompt=["ROMEO:", "KING HENRY:"], max_tokens=12,
                                             n=2, seed=9, stream=True, stream_options={"include_usage": True})
    texts, finish, usage = [""] * 4, [None] * 4, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    want = expect(char_lm, "ROMEO:", 12, 9, n=2) + expect(char_lm, "KING HENRY:", 12, 9, n=2)
    assert texts == [t for t, _, _ in want]
    assert finish == ["length"] * 4
    assert (usage.prompt_tokens, usage.completion_tokens) == (6 + 11, 48)


def test_chat_equals_generate_streamed_and_not(char, char_lm):
    c = client(char)
    want = expect(char_lm, CHAR_CHAT_PROMPT, 20, 7, n=2, temperature=0.7)
    resp = c.chat.completions.create(model=char.name, messages=CHAT, max_tokens=20, n=2, seed=7,
                                     temperature=0.7)
    assert resp.object == "chat.completion"
    assert [(ch.index, ch.message.role, ch.message.content, ch.finish_reason) for ch in resp.choices] == \
        [(j, "assistant", t, f) for j, (t, f, _) in enumerate(want)]
    # the template rendered as written: one token per character
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(CHAR_CHAT_PROMPT), 40)
    # the same conversation with a developer message and content as a text part
    same = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Speak, ROMEO."}]}]
    resp = c.chat.completions.create(model=char.name, messages=same, max_tokens=20, n=2, seed=7,
                                     temperature=0.7)
    assert [ch.message.content for ch in resp.choices] == [t for t, _, _ in want]

    stream = c.chat.completions.create(model=char.name, messages=CHAT, max_completion_tokens=20, n=2, seed=7,
                                       temperature=0.7, stream=True, stream_options={"include_usage": True})
    texts, finish, roles, usage, seen = ["", ""], [None, None], [[], []], None, [False, False]
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if not seen[ch.index]:  # the role comes in the first delta of each choice
                assert ch.delta.role == "assistant"
                seen[ch.index] = True
            if ch.delta.role is not None:
                roles[ch.index].append(ch.delta.role)
            texts[ch.index] += ch.delta.content or ""
            finish[ch.index] = ch.finish_reason or finish[ch.index]
    assert roles == [["assistant"], ["assistant"]]
    assert texts == [t for t, _, _ in want] and finish == ["length", "length"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(CHAR_CHAT_PROMPT), 40)


def test_stop_strings_and_max_tokens(char, char_lm):
    """A stop string that hits ends the text before it (or with it, vLLM's
    include_stop_str_in_output), streamed or not; one that never appears leaves max_tokens to end it."""
    base = expect(char_lm, "ROMEO:", 40, 3, temperature=0.8)[0][0]
    stop = base[12:14]  # it is in the 40 tokens: the text stops at or before them
    want_text, want_finish, g = expect(char_lm, "ROMEO:", 40, 3, stop=[stop, "#"], temperature=0.8)[0]
    assert want_finish == "stop" and len(want_text) <= 12
    c = client(char)
    resp = c.completions.create(model=char.name, prompt="ROMEO:", max_tokens=40, seed=3, temperature=0.8,
                                stop=[stop, "#"])
    assert completion_texts(resp, 1) == [(want_text, "stop")]
    assert resp.usage.completion_tokens == len(g.tokens)  # the tokens up to the stop string's end
    streamed, finish = "", None
    for chunk in c.completions.create(model=char.name, prompt="ROMEO:", max_tokens=40, seed=3,
                                      temperature=0.8, stop=[stop, "#"], stream=True):
        for ch in chunk.choices:
            streamed += ch.text
            finish = ch.finish_reason or finish
    assert (streamed, finish) == (want_text, "stop")  # no piece of the stop string slipped out
    kept = c.completions.create(model=char.name, prompt="ROMEO:", max_tokens=40, seed=3, temperature=0.8,
                                stop=[stop, "#"], extra_body={"include_stop_str_in_output": True})
    assert completion_texts(kept, 1) == [(g.text, "stop")] and g.text == want_text + stop
    # a stop string that is not hit: max_tokens ends it
    resp = c.completions.create(model=char.name, prompt="ROMEO:", max_tokens=5, seed=3, temperature=0.8,
                                stop="#")
    assert completion_texts(resp, 1) == [(base[:5], "length")] and resp.usage.completion_tokens == 5
    chat = c.chat.completions.create(model=char.name, messages=CHAT, max_tokens=3, seed=1)
    assert chat.choices[0].finish_reason == "length" and len(chat.choices[0].message.content) == 3


def test_llama_stop_string_spelled_with_other_tokens(llama, llama_lm):
    """The BPE model spells "brell" as two tokens that are not its encoding: the stop string is found
    in the text, not in the token ids; the other samples end at max_tokens or at an end token."""
    want = expect(llama_lm, "Hello world", 30, 1, n=3, stop="brell")
    text, finish, g = want[2]
    assert finish == "stop"
    canonical = [int(t) for t in llama_lm.vocab.encode_piece("brell")]
    toks = [int(t) for t in g.tokens]
    assert not any(toks[i:i + len(canonical)] == canonical for i in range(len(toks))), \
        "the fixture no longer spells the stop string non-canonically: choose another"
    c = client(llama)
    resp = c.completions.create(model="llama", prompt="Hello world", max_tokens=30, n=3, seed=1, stop="brell")
    assert completion_texts(resp, 3) == [(t, f) for t, f, _ in want]
    assert resp.usage.prompt_tokens == len(llama_lm.vocab.encode("Hello world"))
    assert resp.usage.completion_tokens == sum(len(g.tokens) for _, _, g in want)
    streamed, finishes = [""] * 3, [None] * 3
    for chunk in c.completions.create(model="llama", prompt="Hello world", max_tokens=30, n=3, seed=1,
                                      stop="brell", stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert list(zip(streamed, finishes)) == [(t, f) for t, f, _ in want]


def test_llama_end_token_finishes_with_stop(llama, llama_lm):
    want = expect(llama_lm, "The cat sat on", 30, 1, n=5)
    assert [g.finish_reason for _, _, g in want].count("eos") >= 1, "no sample ends with an end token: " \
        "choose another seed"
    resp = client(llama).completions.create(model="llama", prompt="The cat sat on", max_tokens=30, n=5,
                                            seed=1, extra_body={"skip_special_tokens": False})
    assert completion_texts(resp, 5) == [(t, f) for t, f, _ in want]
    assert "</s>" not in "".join(c.text for c in resp.choices)  # the end token is not text
    # usage counts the end token, as generate's tokens keep it
    assert resp.usage.completion_tokens == sum(len(g.tokens) for _, _, g in want)


def test_llama_chat_with_logprobs(llama, llama_lm):
    """The folder's template (BOS, ChatML turns, EOS), the text generate gives on the rendered
    prompt, and chat log-probabilities: each token's equal to score's, top_logprobs sorted, holding
    the chosen token when it is among them."""
    from jaxdecode.server.chat import load_chat_template

    template = load_chat_template(str(HF), None)
    rendered = template.render(CHAT, add_generation_prompt=True)
    assert rendered.startswith("<s>") and "Speak, ROMEO." in rendered
    tokens = [int(t) for t in llama_lm.vocab.encode(rendered, add_special_tokens=False)]
    # generate takes text and adds the BOS itself
    assert [int(t) for t in llama_lm.vocab.encode(rendered[len("<s>"):])] == tokens
    c = client(llama)
    for seed in (4, 5):
        want = expect(llama_lm, rendered[len("<s>"):], 24, seed)
        resp = c.chat.completions.create(model="llama", messages=CHAT, max_tokens=24, seed=seed,
                                         logprobs=True, top_logprobs=3)
        choice = resp.choices[0]
        assert (choice.message.content, choice.finish_reason) == want[0][:2]
        assert resp.usage.prompt_tokens == len(tokens)
        g = want[0][2]
        assert resp.usage.completion_tokens == len(g.tokens)
        body = [int(t) for t in g.tokens if int(t) not in llama_lm.eos_ids]  # end tokens are not content
        content = choice.logprobs.content
        assert [bytes(e.bytes) for e in content] == [bytes(llama_lm.vocab.token_bytes(t)) for t in body]
        assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == choice.message.content
        ref = token_logprobs(llama_lm.decoder, llama_lm.params, [np.asarray(tokens + body, np.int32)],
                             [len(tokens)])[0]
        np.testing.assert_allclose([e.logprob for e in content], ref, atol=LOGPROB_ATOL)
        for e in content:
            check_top([(bytes(t.bytes), t.logprob) for t in e.top_logprobs], bytes(e.bytes), e.logprob, 3)


def check_top(top: list, chosen, chosen_lp: float, k: int):
    """``top``: ``[(token, logprob)]`` as the server gave them: k of them, most probable first,
    holding the chosen token (with its log-probability) when it is among the k."""
    assert len(top) == k
    values = [lp for _, lp in top]
    assert values == sorted(values, reverse=True), top
    assert values[0] >= chosen_lp - LOGPROB_ATOL
    if chosen_lp > values[-1] + LOGPROB_ATOL:  # among the k (not on a tie with the k-th)
        assert chosen in dict(top), (chosen, top)
        assert abs(dict(top)[chosen] - chosen_lp) <= LOGPROB_ATOL


# ----------------------------------------------------------------------------- log-probabilities


def test_completion_logprobs_equal_score(char, char_lm):
    """``logprobs: 5``: the model's log-probability of each token (before the temperature), equal to
    score's; the top 5 sorted, real log-probabilities, holding the chosen token when it is among them."""
    c = client(char)
    want = expect(char_lm, "ROMEO:", 24, 13, temperature=0.7)[0][0]
    resp = c.completions.create(model=char.name, prompt="ROMEO:", max_tokens=24, seed=13, temperature=0.7,
                                logprobs=5)
    choice = resp.choices[0]
    assert choice.text == want
    lp = choice.logprobs
    assert lp.tokens == list(want)
    assert lp.text_offset == list(range(len(want)))
    ref = jaxdecode.score(char_lm, [want], ["ROMEO:"])[0].logprobs
    np.testing.assert_allclose(lp.token_logprobs, ref, atol=LOGPROB_ATOL)
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        check_top(list(top.items()), tok, tlp, 5)
    # the first two positions' top tokens: their log-probabilities as score gives them
    for pos in range(2):
        prefix = "ROMEO:" + want[:pos]
        cands = list(lp.top_logprobs[pos])
        scored = jaxdecode.score(char_lm, cands, [prefix] * len(cands))
        np.testing.assert_allclose([s.logprobs[0] for s in scored], list(lp.top_logprobs[pos].values()),
                                   atol=LOGPROB_ATOL)
    # streamed: the same tokens, log-probabilities and offsets, piece by piece
    tokens, lps, offsets = [], [], []
    for chunk in c.completions.create(model=char.name, prompt="ROMEO:", max_tokens=24, seed=13,
                                      temperature=0.7, logprobs=5, stream=True):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                lps += ch.logprobs.token_logprobs
                offsets += ch.logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset
    np.testing.assert_allclose(lps, ref, atol=LOGPROB_ATOL)


def test_chat_logprobs_equal_score(char, char_lm):
    want = expect(char_lm, CHAR_CHAT_PROMPT, 16, 2)[0][0]
    resp = client(char).chat.completions.create(model=char.name, messages=CHAT, max_tokens=16, seed=2,
                                                logprobs=True, top_logprobs=4)
    content = resp.choices[0].logprobs.content
    assert resp.choices[0].message.content == want
    assert [e.token for e in content] == list(want)
    assert [bytes(e.bytes) for e in content] == [ch.encode() for ch in want]
    ref = jaxdecode.score(char_lm, [want], [CHAR_CHAT_PROMPT])[0].logprobs
    np.testing.assert_allclose([e.logprob for e in content], ref, atol=LOGPROB_ATOL)
    for e in content:
        check_top([(t.token, t.logprob) for t in e.top_logprobs], e.token, e.logprob, 4)
    plain = client(char).chat.completions.create(model=char.name, messages=CHAT, max_tokens=4, seed=2)
    assert plain.choices[0].logprobs is None


# ----------------------------------------------------------------------------- concurrent load

# settings the load tests cycle through (few rule chains: each costs generate one compile here)
LOAD_SETTINGS = [dict(temperature=0.8), dict(temperature=0.9, top_k=12), dict(top_p=0.85),
                 dict(temperature=0), dict(temperature=1.1, top_p=0.9), dict(),
                 dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, min_p=0.05)]
VLLM_FIELDS = ("top_k", "min_p", "repetition_penalty")  # in extra_body: the client has no such argument


def _split(settings: dict) -> tuple[dict, dict]:
    """A request's settings as the client's arguments and its extra_body."""
    return ({k: v for k, v in settings.items() if k not in VLLM_FIELDS},
            {k: v for k, v in settings.items() if k in VLLM_FIELDS})
PROMPTS = ["ROMEO:", "JULIET:\nO", "First Citizen:", "KING HENRY:\nNow", "MENENIUS:", "To be"]


def _load_case(i: int, base_seed: int, stops: bool = False):
    settings = LOAD_SETTINGS[i % len(LOAD_SETTINGS)]
    prompt = PROMPTS[i % len(PROMPTS)]
    stop = "e" if stops and i % 5 == 4 else None
    return prompt, base_seed + 7 * i, 12 + (i % 3) * 6, settings, stop


def test_concurrent_requests_equal_generate(char, char_lm):
    """16 requests at once with different prompts, seeds, lengths, settings and stop strings: each
    text is generate's for that request alone."""
    cases = [_load_case(i, 100, stops=True) for i in range(16)]
    c = client(char)

    def one(case):
        prompt, seed, n, settings, stop = case
        kw, extra = _split(settings)
        resp = c.completions.create(model=char.name, prompt=prompt, max_tokens=n, seed=seed, stop=stop,
                                    extra_body=extra, **kw)
        return resp.choices[0].text, resp.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, cases, timeout=REQUEST_S))
    for case, answer in zip(cases, got):
        prompt, seed, n, settings, stop = case
        want = expect(char_lm, prompt, n, seed, stop=stop, **settings)[0]
        assert answer == want[:2], case
    assert any(f == "stop" for _, f in got)  # a stop string hit under load


def test_a_burst_of_submissions_waits_for_the_engine(char):
    """400 requests at once, more than the pipe to the engine's process holds at a time: every one
    is answered and the engine lives on. (The server's event loop, uvloop, would make a pipe it
    watched non-blocking: the submissions then failed with BlockingIOError and the engine was
    taken for dead.)"""
    import httpx

    async def main():
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(base_url=char.url, timeout=REQUEST_S, limits=limits) as http:
            body = lambda i: {"model": char.name, "prompt": PROMPTS[i % len(PROMPTS)] + " " * (i % 40),
                              "max_tokens": 2, "seed": i, "temperature": 0}
            return await asyncio.wait_for(asyncio.gather(*(http.post("/completions", json=body(i))
                                                           for i in range(400))), REQUEST_S)

    answers = asyncio.run(main())
    assert [r.status_code for r in answers] == [200] * 400, {r.status_code: r.text for r in answers}
    assert all(len(r.json()["choices"][0]["text"]) == 2 for r in answers)
    assert httpx.get(char.root + "/health", timeout=REQUEST_S).status_code == 200


def test_32_concurrent_streaming_clients(char, char_lm):
    """32 streaming clients at once (asyncio, the async client) over 8 slots, completions and chat:
    every text is generate's."""
    cases = [_load_case(i, 500) for i in range(32)]

    async def one(c, i, case):
        prompt, seed, n, settings, _ = case
        kw, extra = _split(settings)
        text, finish = "", None
        if i % 4 == 3:  # a chat request: its prompt is the rendered conversation
            stream = await c.chat.completions.create(
                model=char.name, messages=[{"role": "user", "content": prompt}], max_tokens=n, seed=seed,
                stream=True, extra_body=extra, **kw)
            async for chunk in stream:
                for ch in chunk.choices:
                    text += ch.delta.content or ""
                    finish = ch.finish_reason or finish
        else:
            stream = await c.completions.create(model=char.name, prompt=prompt, max_tokens=n, seed=seed,
                                                stream=True, extra_body=extra, **kw)
            async for chunk in stream:
                for ch in chunk.choices:
                    text += ch.text
                    finish = ch.finish_reason or finish
        return text, finish

    async def main():
        c = openai.AsyncOpenAI(base_url=char.url, api_key="unused", max_retries=0, timeout=REQUEST_S)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i, case) for i, case in enumerate(cases))),
                                          REQUEST_S)
        finally:
            await c.close()

    got = asyncio.run(main())
    for i, (case, answer) in enumerate(zip(cases, got)):
        prompt, seed, n, settings, _ = case
        p = f"user: {prompt}\nassistant:" if i % 4 == 3 else prompt
        assert answer == expect(char_lm, p, n, seed, **settings)[0][:2], (i, case)


# ----------------------------------------------------------------------------- clients that leave


def test_client_leaving_mid_stream_gives_its_slots_back(char):
    """A streaming client that closes its connection after a few chunks: its rows leave the engine
    (metrics: nothing running, no KV block in use) long before max_tokens."""
    settle(char)
    before = metrics(char)["jaxdecode_generation_tokens_total"]
    body = {"model": char.name, "prompt": "ROMEO:", "max_tokens": 500, "n": 4, "seed": 1, "stream": True}
    with httpx.Client(timeout=REQUEST_S) as h:
        with h.stream("POST", char.url + "/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # (held: a generator of httpx's that is dropped closes the response)
            seen = 0
            for line in lines:
                seen += line.startswith("data: ")
                if seen == 3:
                    break
            m = metrics(char)
            assert m["jaxdecode_requests_running"] == 1 and m["jaxdecode_kv_blocks_used"] == 4, m
            r.close()  # the client leaves
    m = settle(char)
    generated = m["jaxdecode_generation_tokens_total"] - before
    assert generated < 4 * 500 / 2, f"{generated} tokens: the request ran on after its client left"
    still_serving(char)


def test_client_timing_out_gives_its_slots_back(char):
    """A non-streaming request whose client gives up (a short read timeout): aborted too (vLLM's
    non-streaming requests kept their KV blocks until max_tokens). 32 samples of 500 tokens on 8
    slots: four rounds of 500 steps, seconds on any machine, so the client leaves while it runs."""
    body = {"model": char.name, "prompt": "ROMEO:", "max_tokens": 1, "n": 32, "seed": 2}
    assert post(char, "/completions", body).status_code == 200  # its programs compiled: it starts at once
    settle(char)
    before = metrics(char)["jaxdecode_generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        post(char, "/completions", {"model": char.name, "prompt": "ROMEO:", "max_tokens": 500, "n": 32,
                                    "seed": 2}, timeout=httpx.Timeout(REQUEST_S, read=2.0))
    m = settle(char)
    generated = m["jaxdecode_generation_tokens_total"] - before
    assert 0 < generated < 32 * 500 / 2, f"{generated} tokens: the request ran on after its client left"
    still_serving(char)


# ----------------------------------------------------------------------------- errors

BIG = 5 << 20  # over the server's 4 MiB body limit


def _case(name, path, body, status, param="any", code="any", says=None):
    """An error case: ``body`` (bytes: sent as they are) to ``path``, answered with ``status``, the
    error's ``param`` and ``code`` ("any": not checked), and ``says`` in its message."""
    return name, path, body, status, param, code, says


CMPL, CHATP = "/completions", "/chat/completions"
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
ERRORS = [
    _case("malformed JSON", CMPL, b'{"prompt": "ROMEO:", "max_tokens": ', 400, param=None, says="JSON"),
    _case("not an object", CMPL, b"[1, 2]", 400),
    _case("wrong type", CMPL, {"prompt": "ROMEO:", "max_tokens": "many"}, 400, "max_tokens"),
    _case("prompt of a wrong type", CMPL, {"prompt": {"a": 1}}, 400, says="prompt"),
    _case("no prompt", CMPL, {"max_tokens": 3}, 400, "prompt", says="prompt"),
    _case("messages of a wrong type", CHATP, {"messages": "hi"}, 400, "messages"),
    _case("unknown role", CHATP, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, says="role"),
    _case("an image part", CHATP, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages", says="image_url"),
    _case("temperature 5", CMPL, {"prompt": "a", "temperature": 5}, 400, "temperature"),
    _case("top_p 0", CMPL, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    _case("n 0", CMPL, {"prompt": "a", "n": 0}, 400, "n"),
    _case("logprobs 30", CMPL, {"prompt": "a", "logprobs": 30}, 400, "logprobs"),
    _case("top_logprobs 30", CHATP, {"messages": CHAT, "logprobs": True, "top_logprobs": 30}, 400,
          "top_logprobs"),
    _case("top_logprobs without logprobs", CHATP, {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs",
          says="logprobs"),
    _case("negative max_tokens", CMPL, {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    _case("seed over 64 bits", CMPL, {"prompt": "a", "seed": 2**64 - 1}, 400, "seed"),
    _case("empty prompt", CMPL, {"prompt": ""}, 400, "prompt", says="empty"),
    _case("token id out of range", CMPL, {"prompt": [3, 70000]}, 400, says="70000"),
    _case("empty stop string", CMPL, {"prompt": "a", "stop": ["x", ""]}, 400, "stop", says="stop"),
    _case("streamed prompt_logprobs", CMPL, {"prompt": "ab", "prompt_logprobs": 2, "stream": True}, 400,
          "prompt_logprobs"),
    _case("beyond the window", CMPL, {"prompt": "ROMEO:", "max_tokens": 507}, 400, "max_tokens",
          "context_length_exceeded", "512"),
    _case("chat beyond the window", CHATP, {"messages": CHAT, "max_completion_tokens": 500}, 400,
          "max_completion_tokens", "context_length_exceeded", "512"),
    _case("unknown model", CMPL, {"model": "gpt-17", "prompt": "a"}, 404, "model", "model_not_found",
          "gpt-17"),
    _case("unknown model, chat", CHATP, {"model": "gpt-17", "messages": CHAT}, 404, "model",
          "model_not_found", "gpt-17"),
    _case("tool_choice without tools", CHATP, {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    _case("an unknown field", CMPL, {"prompt": "a", "frobnicate": 1}, 400, "frobnicate", "unsupported_field"),
    _case("logit_bias", CMPL, {"prompt": "a", "logit_bias": {"x": 10}}, 400, "logit_bias", says="logit_bias"),
    _case("suffix", CMPL, {"prompt": "a", "suffix": "end"}, 400, "suffix", "unsupported_field", "suffix"),
    _case("invalid regex", CMPL, {"prompt": "a", "guided_regex": "(ab"}, 400, "guided_regex"),
    _case("invalid schema", CHATP, {"messages": CHAT, "response_format": SCHEMA_FORMAT}, 400,
          "response_format"),
    _case("json_schema without a schema", CHATP, {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
    _case("two constraints", CMPL, {"prompt": "a", "guided_regex": "a+", "guided_choice": ["a"]}, 400),

]


@pytest.mark.parametrize("case", ERRORS, ids=[e[0] for e in ERRORS])
def test_error(char, case):
    _, path, body, status, param, code, says = case
    if isinstance(body, bytes):
        r = post(char, path, content=body)
    else:
        body = dict(body, model=body.get("model", char.name), max_tokens=body.get("max_tokens", 4))
        r = post(char, path, body)
    check_error(r, status, param=param, code=code, says=says)
    still_serving(char)


def test_token_id_prompts_echo_and_seed_edges(char, char_lm):
    """A prompt as token ids (one list, or a list of them) is the prompt of those tokens; echo puts
    the prompt before the text; seeds at the ends of the signed 64-bit range are generate's."""
    ids = [int(t) for t in char_lm.vocab.encode("ROMEO:")]
    c = client(char)
    text = expect(char_lm, "ROMEO:", 8, 3)[0][0]
    one = c.completions.create(model=char.name, prompt=ids, max_tokens=8, seed=3)
    juliet = [int(t) for t in char_lm.vocab.encode("JULIET:")]
    two = c.completions.create(model=char.name, prompt=[ids, juliet], max_tokens=8, seed=3)
    assert one.choices[0].text == text and one.usage.prompt_tokens == 6
    assert completion_texts(two, 2) == [(text, "length"), (expect(char_lm, "JULIET:", 8, 3)[0][0], "length")]
    echo = c.completions.create(model=char.name, prompt="ROMEO:", max_tokens=8, seed=3, echo=True)
    assert echo.choices[0].text == "ROMEO:" + text
    for seed in (2**63 - 1, -(2**63), -5):
        resp = c.completions.create(model=char.name, prompt="ROMEO:", max_tokens=8, seed=seed)
        assert resp.choices[0].text == expect(char_lm, "ROMEO:", 8, seed)[0][0], seed


def test_runner_survives_an_engine_that_fails():
    """An engine that raises something other than a ValueError on a request answers that request
    with the error; the engine's thread lives on (a dead one would hang every later request)."""
    from jaxdecode.server.runner import EngineRunner, Handle
    from jaxdecode.serving.engine import Request

    class Failing:
        queued = 0

        def submit(self, request):
            raise OverflowError("a seed too large")

        def rows_in_slots(self):
            return []

        def kv_blocks(self):
            return 0, 0

    async def main():
        runner = EngineRunner(Failing())
        runner.start()
        try:
            h = Handle(asyncio.get_running_loop())
            runner.submit(Request("a", 2), h)
            kind, error = await asyncio.wait_for(h.queue.get(), 10)
            assert kind == "error" and isinstance(error, OverflowError)
            await asyncio.sleep(0.05)
            assert runner.alive and runner.waiting == 0
        finally:
            runner.stop(10)
        assert not runner.alive

    asyncio.run(main())


@pytest.mark.quick
@pytest.mark.parametrize("order", ["others_first", "one_finishes_before_the_other_is_accepted"])
def test_a_request_that_streams_before_its_siblings_are_accepted(order):
    """A completion of two prompts: what the first streams, even to its end, while the second still
    waits to be accepted is kept for the response, in order (it once broke start() with a 500)."""
    from jaxdecode.server.handlers import Job
    from jaxdecode.server.runner import FINISHED
    from jaxdecode.serving.stream import Delta

    def delta(text, finish=None):
        return [Delta(0, text, [1], [-0.5], None, finish, 1)]

    script = {  # what the engine delivers, in order, as (request k, item)
        "others_first": [(0, ("accepted", 0)), (1, ("accepted", 1)), (0, delta("ab", "length")),
                         (0, FINISHED), (1, delta("cd", "length")), (1, FINISHED)],
        "one_finishes_before_the_other_is_accepted": [
            (0, ("accepted", 0)), (0, delta("a")), (0, delta("b", "length")), (0, FINISHED),
            (1, ("accepted", 1)), (1, delta("cd", "length")), (1, FINISHED)],
    }[order]

    class Runner:
        def submit(self, request, handle, include_stop):
            if handle.tag == 1:  # both are submitted: now the engine runs
                for k, item in script:
                    job.handles[k].deliver(item)

        def abort(self, handle):
            raise AssertionError("nothing is aborted")

    async def main():
        nonlocal job
        job = Job(Runner(), [object(), object()], include_stop=False)
        await asyncio.wait_for(job.start(), 5)
        got = {}
        async for k, ds in job.deltas():
            for d in ds:
                got[k] = got.get(k, "") + d.text
                assert d.finish_reason in (None, "length")
        return got

    job = None
    assert asyncio.run(main()) == {0: "ab", 1: "cd"}


def test_error_through_the_client(char):
    with pytest.raises(openai.BadRequestError) as e:
        client(char).completions.create(model=char.name, prompt="a", temperature=5)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client(char).chat.completions.create(model="nope", messages=CHAT)
    assert e.value.code == "model_not_found"


def test_routes_and_methods_that_do_not_exist(char):
    check_error(httpx.get(char.url + "/nothing", timeout=REQUEST_S), 404)
    check_error(httpx.get(char.url + "/completions", timeout=REQUEST_S), 405)
    still_serving(char)


def test_metadata_fields_are_accepted(char, char_lm):
    r = post(char, "/completions", {"model": char.name, "prompt": "ROMEO:", "max_tokens": 6, "seed": 4,
                                    "metadata": {"x": "1"}, "user": "someone", "best_of": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expect(char_lm, "ROMEO:", 6, 4)[0][0]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_the_size_limit(char, chunked):
    body = json.dumps({"model": char.name, "prompt": "a" * BIG}).encode()
    content = (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)) if chunked else body
    check_error(post(char, "/completions", content=content), 413, says="limit")
    still_serving(char)


def test_constrained_requests(char, char_lm, llama, llama_lm):
    """Regex, choice and JSON-schema requests: each text matches its pattern and equals
    ``generate`` with the same constraint and seed. (The schema on the BPE model: the character
    model's vocabulary has no braces or quotes.)"""
    from jaxdecode import constraints as C

    cases = [("guided_regex", "[ab]+( [ab]+)?", C.compile_regex("[ab]+( [ab]+)?", char_lm.vocab)),
             ("guided_choice", ["ROMEO", "JULIET"], C.compile_choices(["ROMEO", "JULIET"], char_lm.vocab))]
    for field, value, constraint in cases:
        r = post(char, "/completions", {"model": char.name, "prompt": "ROMEO:", "max_tokens": 8, "seed": 1,
                                        "n": 2, field: value})
        assert r.status_code == 200, r.text
        want = jaxdecode.generate(char_lm, "ROMEO:", n=8, seed=1, num_samples=2, constraint=constraint)
        assert [c["text"] for c in r.json()["choices"]] == [g.text for g in want]
        for c in r.json()["choices"]:
            assert re.fullmatch(constraint.pattern, c["text"]), c
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}  # (its texts are short: they end within max_tokens)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    r = post(llama, "/chat/completions", {"model": "llama", "messages": CHAT, "max_tokens": 40, "seed": 1,
                                          "response_format": fmt})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    value = json.loads(text)
    assert set(value) == {"a"} and isinstance(value["a"], bool)
    still_serving(char)
    still_serving(llama)


def test_chat_without_a_template(small):
    r = post(small, "/chat/completions", {"model": "small", "messages": CHAT},
             headers={"authorization": f"Bearer {KEY}"})
    check_error(r, 400, param="messages", code="no_chat_template", says="--chat-template")
    r = post(small, "/completions", {"model": "small", "prompt": "ROMEO:", "max_tokens": 2},
             headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text


def test_api_key(small):
    body = {"model": "small", "prompt": "ROMEO:", "max_tokens": 2}
    check_error(post(small, "/completions", body), 401, code="invalid_api_key")
    check_error(post(small, "/completions", body, headers={"authorization": "Bearer wrong"}), 401)
    check_error(post(small, "/completions", body, headers={"authorization": KEY}), 401)  # not "Bearer KEY"
    check_error(httpx.get(small.url + "/models", timeout=REQUEST_S), 401)
    with pytest.raises(openai.AuthenticationError):
        client(small, key="wrong").completions.create(model="small", prompt="ROMEO:", max_tokens=2)
    resp = client(small, key=KEY).completions.create(model="small", prompt="ROMEO:", max_tokens=2)
    assert resp.usage.completion_tokens == 2
    assert [m.id for m in client(small, key=KEY).models.list().data] == ["small"]
    assert httpx.get(small.root + "/health", timeout=REQUEST_S).status_code == 200  # outside /v1: open
    assert httpx.get(small.root + "/metrics", timeout=REQUEST_S).status_code == 200


def test_full_queue_is_429_with_retry_after(small):
    """One slot and room for one waiting request: while one runs and one waits, a third is refused
    with 429 and Retry-After; once they leave, requests are served again."""
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"model": "small", "prompt": "ROMEO:", "max_tokens": 500, "stream": True}
    with httpx.Client(timeout=REQUEST_S, headers=auth) as h1, \
            httpx.Client(timeout=REQUEST_S, headers=auth) as h2:
        with h1.stream("POST", small.url + "/completions", json=body) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it has the slot
            with h2.stream("POST", small.url + "/completions", json=body) as waiting:
                assert waiting.status_code == 200  # accepted: waiting for the slot
                r = post(small, "/completions", dict(body, stream=False, max_tokens=2), headers=auth)
                check_error(r, 429, says="queue")
                assert float(r.headers["retry-after"]) > 0
                with pytest.raises(openai.RateLimitError):
                    client(small, key=KEY).chat.completions.create(model="small", messages=CHAT)
    settle(small)
    still_serving(small, headers=auth)


# ----------------------------------------------------------------------------- models, health, metrics


@pytest.mark.quick
def test_models_health_and_metrics(char):
    models = client(char).models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [("shakespeare-char", "model", "jaxdecode")]
    assert models[0].model_extra["max_model_len"] == 512
    r = httpx.get(char.root + "/health", timeout=REQUEST_S)
    assert (r.status_code, r.json()) == (200, {"status": "ok"})

    settle(char)
    before = metrics(char)
    for name in METRIC_SAMPLES:
        assert any(k == name or k.startswith(name + "{") for k in before), name
    assert before["jaxdecode_kv_blocks_free"] == 8  # the dense cache: a slot is one block
    resp = client(char).completions.create(model=char.name, prompt="ROMEO:", max_tokens=9, n=2, seed=3)
    after = settle(char)
    assert after["jaxdecode_prompt_tokens_total"] - before["jaxdecode_prompt_tokens_total"] == 6
    assert after["jaxdecode_generation_tokens_total"] - before["jaxdecode_generation_tokens_total"] == \
        resp.usage.completion_tokens == 18
    for h in ("time_to_first_token", "time_per_output_token"):
        count = f"jaxdecode_{h}_seconds_count"
        assert after[count] - before[count] == 1
        assert after[f"jaxdecode_{h}_seconds_sum"] > before[f"jaxdecode_{h}_seconds_sum"]
    # requests answered, by endpoint and status
    ok, bad, missing = (f'jaxdecode_requests_total{{endpoint="/v1/completions",status="{s}"}}'
                        for s in (200, 400, 404))
    assert after[ok] - before.get(ok, 0) == 1
    post(char, "/completions", {"model": char.name, "prompt": "a", "n": 0})
    post(char, "/completions", {"model": "nope", "prompt": "a"})
    httpx.get(char.url + "/no/such/route", timeout=REQUEST_S)
    m = metrics(char)
    assert (m[bad] - before.get(bad, 0), m[missing] - before.get(missing, 0)) == (1, 1), m
    assert not any("/no/such/route" in k for k in m)  # unknown paths share one label


# ----------------------------------------------------------------------------- shutting down


def _engine_process(pid: int) -> int:
    """The server ``pid``'s engine process (multiprocessing's resource tracker is a child too)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(x) for x in f.read().split()]
    engines = [c for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
    assert len(engines) == 1, children
    return engines[0]


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the engine's process through /proc")
def test_engine_process_dying(processes):
    """The engine's process killed while a stream runs: the stream ends with an error event and
    [DONE], /health and new requests answer 503 in OpenAI's format, and the server still stops
    cleanly on SIGTERM."""
    server = processes["doomed"].ready()
    try:
        body = {"model": "doomed", "prompt": "ROMEO:", "max_tokens": 480, "seed": 1, "stream": True}
        with httpx.stream("POST", server.url + "/completions", json=body, timeout=REQUEST_S) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            events = []
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    break
            os.kill(_engine_process(server.proc.pid), signal.SIGKILL)
            events += [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "internal_server_error" and "engine" in error["message"], error
        check_error(httpx.get(server.root + "/health", timeout=10), 503)
        r = post(server, "/completions", {"model": "doomed", "prompt": "ROMEO:", "max_tokens": 2}, timeout=10)
        assert "engine is not running" in check_error(r, 503)["message"]
        assert server.terminate() == 0, server.tail()
    finally:
        server.kill()


def test_sigterm_finishes_the_request_in_flight(processes, char_lm):
    """SIGTERM while a stream runs: new requests are refused (503, or the closed listener), the
    stream runs to its end with generate's text, and the process exits 0."""
    server = processes["drain"]
    try:
        server.ready()
        body = {"model": "drain", "prompt": "ROMEO:", "max_tokens": 480, "seed": 21, "temperature": 0.8,
                "stream": True}
        first, events, problems = threading.Event(), [], []

        def stream():
            try:
                with httpx.stream("POST", server.url + "/completions", json=body, timeout=REQUEST_S) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[len("data: "):])
                            first.set()
            except BaseException as e:  # reported below
                problems.append(e)
            finally:
                first.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert first.wait(REQUEST_S) and not problems, problems
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_stderr("Shutting down", 10), server.tail()
        assert not events or events[-1] != "[DONE]", "the stream ended before the signal: make it longer"
        try:
            r = post(server, "/completions", {"model": "drain", "prompt": "ROMEO:", "max_tokens": 2},
                     timeout=10)
        except httpx.TransportError:
            pass  # the listener is closed
        else:
            check_error(r, 503)
        t.join(REQUEST_S)
        assert not t.is_alive(), "the stream did not end"
        assert not problems, problems
        assert events and events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(ch["text"] for c in chunks for ch in c["choices"])
        assert [ch["finish_reason"] for ch in chunks[-1]["choices"]] == ["length"]
        assert text == expect(char_lm, "ROMEO:", 480, 21, temperature=0.8)[0][0]
        code = server.terminate()
        time.sleep(0.2)
        assert code == 0, server.tail()
        assert "Traceback" not in "".join(server.stderr), server.tail()
    finally:
        server.kill()


# ----------------------------------------------------------------------------- generation_config.json


@pytest.mark.quick
@pytest.mark.parametrize("fields, defaults, want_rule, want_greedy", [
    ({}, {}, {}, False),
    ({}, {"temperature": 0.6, "top_p": 0.95, "top_k": 20}, {"temperature": 0.6, "top_k": 20, "top_p": 0.95}, False),
    ({"temperature": 1.0}, {"temperature": 0.6, "top_k": 20}, {"top_k": 20}, False),  # the request's 1.0 wins
    ({"top_k": -1}, {"top_k": 20}, {}, False),  # vLLM's "no top-k", set: it wins
    ({"temperature": 0}, {"temperature": 0.6, "top_p": 0.9}, {}, True),  # greedy takes nothing from the folder
    ({}, {"greedy": True, "repetition_penalty": 1.1}, {"repetition_penalty": 1.1}, True),  # do_sample: false
    ({"top_p": 0.5}, {"greedy": True}, {"top_p": 0.5}, False),  # a sampling field turns it into sampling
    ({"presence_penalty": 0.5}, {"temperature": 0.7}, {"presence_penalty": 0.5, "temperature": 0.7}, False),
])
def test_generation_config_defaults_fill_the_fields_a_request_leaves_out(fields, defaults, want_rule, want_greedy):
    """The folder's generation_config.json settings apply where the request sets nothing, as vLLM
    applies them; a field the request sets wins, even at its neutral value."""
    from jaxdecode.rules import make_rule
    from jaxdecode.server.handlers import decode_params
    from jaxdecode.server.protocol import CompletionRequest

    got = decode_params(CompletionRequest(prompt="a", seed=1, **fields), 100, defaults)
    assert got.greedy == want_greedy
    assert repr(got.rule()) == repr(make_rule(**want_rule) if want_rule else None)
