"""``jaxdecode serve`` as today's clients use it, from the outside (real server processes on
127.0.0.1, the harness of ``tests/server/test_server.py``): vLLM's current request fields (honoured,
harmless or refused by name, never silently dropped), prompt log-likelihoods as an evaluation
harness asks for them (equal to :func:`jaxdecode.score`), tool calls, reasoning, chat prompts
with every message field, and the smaller fixes.

Servers (each started once, stopped with SIGTERM at the end, exiting 0 without a traceback):

- ``char``: the shipped character model with a plain "role: content" template;
- ``llama``: the byte-level BPE fixture with the template :data:`TOOL_TEMPLATE` (ChatML turns,
  tools listed Hermes-style, a reasoning trace in ``<think>``, content parts looped over).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import jaxdecode  # noqa: E402
from support.servers import serving  # noqa: E402
from support.servers import (HF, LOGPROB_ATOL, check_error, client, post,  # noqa: E402
                         sse_events)

CHAR_TEMPLATE = ("{%- for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{ 'assistant:' }}{%- endif %}")
# short enough for the fixture's 256-token window
TOOL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for t in tools %}{{- t['function']['name'] + '\\n' }}"
    "{%- endfor %}{{- eos_token + '\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['reasoning_content'] is defined %}{{- '<think>' + m['reasoning_content'] + '</think>' }}{%- endif %}"
    "{%- if m['content'] is string %}{{- m['content'] }}"
    "{%- elif m['content'] is defined %}{%- for p in m['content'] %}{{- p['text'] }}{%- endfor %}{%- endif %}"
    "{%- if m['tool_calls'] is defined %}{%- for c in m['tool_calls'] %}"
    "{{- '<tool_call>' + c['function']['name'] + '</tool_call>' }}{%- endfor %}{%- endif %}"
    "{%- if m['name'] is defined %}{{- '@' + m['name'] }}{%- endif %}"
    "{%- if m['tool_call_id'] is defined %}{{- '#' + m['tool_call_id'] }}{%- endif %}"
    "{{- eos_token + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
USER = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "enum": [1, 2, 3]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("templates")
    (folder / "char.jinja").write_text(CHAR_TEMPLATE)
    (folder / "tools.jinja").write_text(TOOL_TEMPLATE)
    with serving(char=("--chat-template", str(folder / "char.jinja"), "--slots", "4"),
                 llama=("--ckpt", str(HF), "--slots", "4", "--chat-template", str(folder / "tools.jinja"))) as procs:
        yield procs


@pytest.fixture(scope="module")
def char(processes):
    return processes["char"].ready()


@pytest.fixture(scope="module")
def llama(processes):
    return processes["llama"].ready()


@pytest.fixture(scope="module")
def char_lm():
    return jaxdecode.load()


@pytest.fixture(scope="module")
def llama_lm():
    return jaxdecode.load(HF)


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


# ----------------------------------------------------------------------------- fields


# vLLM's request fields that change the output and that this server cannot honour: each refused by
# name (value: one that would change the output)
REFUSED = [("best_of", 2), ("suffix", "x"),
           ("use_beam_search", True), ("length_penalty", 0.5), ("spaces_between_special_tokens", False),
           ("truncate_prompt_tokens", 3), ("logprob_token_ids", [1]), ("return_tokens_as_token_ids", True),
           ("return_token_ids", True), ("logits_processors", ["x"]), ("vllm_xargs", {"a": 1}),
           ("thinking_token_budget", 5), ("priority", 1), ("guided_grammar", "root ::= 'a'"),
           ("repetition_detection", {"max_pattern_size": 2}), ("a_field_nobody_knows", 1)]
# fields that cannot change the output: accepted
HARMLESS = [("user", "me"), ("metadata", {"a": "b"}), ("store", False), ("service_tier", "auto"),
            ("request_id", "r1"), ("cache_salt", "salt"), ("stream_options", None), ("min_tokens", 0),
            ("stop_token_ids", []), ("bad_words", []), ("best_of", 1), ("priority", 0)]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f for f, _ in REFUSED])
def test_fields_that_would_change_the_output_are_refused_by_name(char, field, value):
    r = post(char, "/completions", {"prompt": "ROMEO:", "max_tokens": 2, field: value})
    check_error(r, 400, param=field, code="unsupported_field", says=field)


def test_stop_token_ids_end_a_sample_as_generate_ends_it(char, char_lm):
    body = {"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0}
    free = jaxdecode.generate(char_lm, "ROMEO:", 12, greedy=True)[0]
    stop = int(free.tokens[3])  # the fourth token: the text ends there
    want = jaxdecode.generate(char_lm, "ROMEO:", 12, greedy=True, stop_token_ids=[stop])[0]
    got = ok(post(char, "/completions", dict(body, stop_token_ids=[stop])))["choices"][0]
    assert want.finish_reason == "stop" and len(want.tokens) <= 4
    assert (got["text"], got["finish_reason"]) == (want.text, "stop")


def test_harmless_fields_are_accepted(char):
    body = {"prompt": "ROMEO:", "max_tokens": 3, "seed": 5, "temperature": 0}
    want = ok(post(char, "/completions", body))["choices"][0]["text"]
    for field, value in HARMLESS:
        got = ok(post(char, "/completions", dict(body, **{field: value})))["choices"][0]["text"]
        assert got == want, field


def test_chat_only_fields_refused_or_honoured(char):
    base = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
    for field, value in (("chat_template", "{{ 'x' }}"), ("functions", [{"name": "f"}]), ("echo", True),
                         ("audio", {"voice": "x"}), ("modalities", ["audio"])):
        check_error(post(char, "/chat/completions", dict(base, **{field: value})), 400, param=field,
                    code="unsupported_field")
    check_error(post(char, "/chat/completions", dict(base, structured_outputs={"grammar": "root ::= 'a'"})),
                400, param="structured_outputs.grammar", says="grammar")


@pytest.mark.parametrize("so,alias", [({"regex": "(to|be)( (to|be)){3}"}, {"guided_regex": "(to|be)( (to|be)){3}"}),
                                      ({"choice": ["ROMEO", "JULIET"]}, {"guided_choice": ["ROMEO", "JULIET"]})],
                         ids=["regex", "choice"])
def test_structured_outputs_is_honoured_and_guided_names_are_its_aliases(char, so, alias):
    body = {"prompt": "ROMEO:", "max_tokens": 30, "seed": 3, "temperature": 1.0}
    a = ok(post(char, "/completions", dict(body, structured_outputs=so)))["choices"][0]["text"]
    b = ok(post(char, "/completions", dict(body, **alias)))["choices"][0]["text"]
    assert a == b
    if "regex" in so:
        assert re.fullmatch(so["regex"], a), a
    else:
        assert a in so["choice"]
    # with the openai client, as vLLM's docs show it
    c = client(char).completions.create(model=char.name, prompt="ROMEO:", max_tokens=30, seed=3,
                                        temperature=1.0, extra_body={"structured_outputs": so})
    assert c.choices[0].text == a
    check_error(post(char, "/completions", dict(body, structured_outputs=so, **alias)), 400, says="one")


def test_structured_outputs_json_on_chat(llama):
    schema = WEATHER["function"]["parameters"]
    r = client(llama).chat.completions.create(model=llama.name, messages=USER, max_tokens=60, seed=2,
                                              extra_body={"structured_outputs": {"json": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert obj["city"] in ("Paris", "Rome") and obj["days"] in (1, 2, 3)


def test_skip_special_tokens_honoured(llama, llama_lm):
    """A sample that writes special tokens (``<pad>``, ``<s>``...): their text is left out by
    default and kept with ``skip_special_tokens: false``."""
    special = {0, 1, 3}
    prompt = "The cat"
    for seed in range(40):
        g = jaxdecode.generate(llama_lm, prompt, n=40, seed=seed, rule=jaxdecode.make_rule(temperature=2.0))[0]
        toks = [int(t) for t in g.tokens]
        if special & set(toks) and g.finish_reason == "length":
            break
    else:
        pytest.skip("no sample writes a special token")
    body = {"prompt": prompt, "max_tokens": 40, "seed": seed, "temperature": 2.0}
    kept = ok(post(llama, "/completions", dict(body, skip_special_tokens=False)))["choices"][0]["text"]
    assert kept == g.text
    skipped = ok(post(llama, "/completions", body))["choices"][0]["text"]
    want = g.text
    for s in ("<|endoftext|>", "<s>", "<pad>", "</s>"):
        want = want.replace(s, "")
    assert skipped == want != kept
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in _stream(llama, "/completions", body)
                       if json.loads(e)["choices"])
    assert streamed == want


def _stream(server, path, body):
    with httpx.stream("POST", server.url + path, json=dict(body, stream=True), timeout=90) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_logprobs_zero_gives_one_entry_per_token(char):
    r = ok(post(char, "/completions", {"prompt": "ROMEO:", "max_tokens": 5, "logprobs": 0, "seed": 1}))
    lp = r["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == len(lp["tokens"]) == 5
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top == {tok: value}


def test_chat_template_kwargs_cannot_set_render_arguments(char):
    for name in ("add_generation_prompt", "messages", "tools"):
        check_error(post(char, "/chat/completions", {"messages": USER, "chat_template_kwargs": {name: False}}),
                    400, param="chat_template_kwargs", says=name)


# ----------------------------------------------------------------------------- log-likelihoods


def _encode(lm, contexts, continuations):
    """lm-evaluation-harness's token lists: the context encoded, then the continuation's tokens."""
    enc, piece = lm.vocab.encode, getattr(lm.vocab, "encode_piece", lm.vocab.encode)
    pairs = []
    for ctx, cont in zip(contexts, continuations):
        c = [int(t) for t in enc(ctx)]
        pairs.append((c + [int(t) for t in piece(cont)], len(c)))
    return pairs


def _lm_eval_request(server, pairs, max_tokens=1):
    """What lm-evaluation-harness's ``local-completions`` sends for loglikelihood requests (token
    lists, echo, logprobs 1, max_tokens 1, temperature 0, seed 1234) and what it reads back:
    ``[(sum of the continuation's token_logprobs, is_greedy)]``."""
    out = client(server).completions.create(model=server.name, prompt=[p for p, _ in pairs], temperature=0,
                                            max_tokens=max_tokens, logprobs=1, seed=1234, echo=True)
    res = []
    for choice, (p, ctxlen) in zip(sorted(out.choices, key=lambda c: c.index), pairs):
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.token_logprobs) == len(p) + max_tokens
        end = len(p)
        tokens_lp = lp.token_logprobs[ctxlen:end]
        is_greedy = all(t == max(top.values()) for t, top in zip(tokens_lp, lp.top_logprobs[ctxlen:end]))
        res.append((sum(tokens_lp), is_greedy))
    return res


@pytest.mark.parametrize("which", ["char", "llama"])
def test_loglikelihood_as_an_evaluation_harness_asks_equals_score(which, request):
    server = request.getfixturevalue(which)
    lm = request.getfixturevalue(f"{which}_lm")
    contexts = ["ROMEO:\nWhat say", "First Citizen:\nWe are", "The cat sat on the"]
    continuations = [" you", " accounted poor", " mat"]
    pairs = _encode(lm, contexts, continuations)
    for max_tokens in (1, 0):
        got = _lm_eval_request(server, pairs, max_tokens)
        want = jaxdecode.score(lm, continuations, contexts)
        for (total, _greedy), s in zip(got, want):
            assert abs(total - float(np.sum(s.logprobs))) <= 1e-4
    # is_greedy: the greedy continuation of a context is greedy, another one is not
    ctx = pairs[0][0][:pairs[0][1]]
    g = [int(t) for t in jaxdecode.generate(lm, contexts[0], n=4, greedy=True)[0].tokens]
    assert not set(g) & set(getattr(lm, "eos_ids", ()))
    (_, greedy), = _lm_eval_request(server, [(ctx + g, len(ctx))])
    assert greedy
    other = [(t + 1) % lm.decoder.V for t in g]
    (_, greedy), = _lm_eval_request(server, [(ctx + other, len(ctx))])
    assert not greedy


def test_prompt_logprobs_in_vllms_shape(llama, llama_lm):
    prompt = [int(t) for t in llama_lm.vocab.encode("The cat sat on the mat")]
    r = ok(post(llama, "/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3, "seed": 0}))
    pl = r["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(prompt)
    from jaxdecode.decoding.score import token_logprobs
    ref = token_logprobs(llama_lm.decoder, llama_lm.params, [np.asarray(prompt, np.int32)], [1])[0]
    for k, entry in enumerate(pl[1:]):
        mine = entry[str(prompt[k + 1])]
        assert abs(mine["logprob"] - ref[k]) <= LOGPROB_ATOL
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(prompt[k + 1]) or e["rank"] <= 3)
        assert ranks[:3] == [1, 2, 3]
    check_error(post(llama, "/completions", {"prompt": prompt, "prompt_logprobs": 2, "stream": True}), 400,
                param="prompt_logprobs")


# ----------------------------------------------------------------------------- tools


def test_named_tool_choice_always_gives_a_valid_call(llama):
    c = client(llama)
    for seed in range(8):
        r = c.chat.completions.create(model=llama.name, messages=USER, tools=[WEATHER, CLOCK], seed=seed,
                                      tool_choice={"type": "function", "function": {"name": "weather"}},
                                      max_tokens=60, temperature=1.0)
        choice = r.choices[0]
        assert choice.finish_reason == "stop"  # OpenAI's for a named function
        call, = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        assert args["city"] in ("Paris", "Rome") and args["days"] in (1, 2, 3)


def test_required_tool_choice_streamed_and_whole(llama):
    c = client(llama)
    body = dict(model=llama.name, messages=USER, tools=[WEATHER, CLOCK], tool_choice="required",
                parallel_tool_calls=False, max_tokens=80, temperature=1.0)
    for seed in range(6):
        r = c.chat.completions.create(seed=seed, **body)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        call, = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        if call.function.name == "weather":
            assert args["city"] in ("Paris", "Rome") and args["days"] in (1, 2, 3)
        else:
            assert call.function.name == "clock" and args["zone"] in ("UTC", "CET")
        streamed, finish = {}, None
        for chunk in c.chat.completions.create(seed=seed, stream=True, **body):
            for ch in chunk.choices:
                for tc in ch.delta.tool_calls or []:
                    entry = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
                finish = ch.finish_reason or finish
        assert finish == "tool_calls"
        assert streamed == {0: {"name": call.function.name, "arguments": call.function.arguments}}


HERMES_REGEX = r'Let me see\.<tool_call>\{"name": "clock", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'


def test_auto_tool_calls_parsed_from_hermes_text(llama):
    """The model's text in Hermes' format (forced here with a regex, which a fixture model would
    not write by itself) comes back as content and a parsed call, whole and streamed."""
    body = {"messages": USER, "tools": [WEATHER, CLOCK], "max_tokens": 80, "seed": 1,
            "structured_outputs": {"regex": HERMES_REGEX}}
    r = ok(post(llama, "/chat/completions", body))
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me see."
    call, = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "clock"
    assert json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")
    content, calls = "", []
    for e in _stream(llama, "/chat/completions", body):
        for ch in json.loads(e)["choices"]:
            content += ch["delta"].get("content") or ""
            calls += ch["delta"].get("tool_calls") or []
    assert content == "Let me see." and [c["function"] for c in calls] == [call["function"]]
    # tool_choice "none": the same text is content
    r = ok(post(llama, "/chat/completions", dict(body, tool_choice="none")))
    assert r["choices"][0]["message"]["content"].startswith("Let me see.<tool_call>")
    assert "tool_calls" not in r["choices"][0]["message"]


# ----------------------------------------------------------------------------- reasoning


def test_reasoning_split_from_the_answer(llama):
    body = {"messages": USER, "max_tokens": 60, "seed": 1,
            "structured_outputs": {"regex": "<think>(hm|ok){2}</think>(yes|no)"}}
    r = ok(post(llama, "/chat/completions", body))
    m = r["choices"][0]["message"]
    assert re.fullmatch("(hm|ok){2}", m["reasoning_content"]) and m["reasoning"] == m["reasoning_content"]
    assert m["content"] in ("yes", "no")
    reasoning, content = "", ""
    for e in _stream(llama, "/chat/completions", body):
        for ch in json.loads(e)["choices"]:
            reasoning += ch["delta"].get("reasoning_content") or ""
            content += ch["delta"].get("content") or ""
    assert (reasoning, content) == (m["reasoning_content"], m["content"])
    r = ok(post(llama, "/chat/completions", dict(body, include_reasoning=False)))
    assert "reasoning_content" not in r["choices"][0]["message"]


# ----------------------------------------------------------------------------- chat prompts


def _rendered(server, messages, **extra) -> str:
    """The prompt the server rendered, read back through vLLM's prompt_logprobs."""
    r = ok(post(server, "/chat/completions", dict({"messages": messages, "max_tokens": 1, "prompt_logprobs": 0},
                                                  **extra)))
    pl = r["prompt_logprobs"]
    first = r["usage"]["prompt_tokens"]
    assert len(pl) == first
    return "".join(next(iter(e.values()))["decoded_token"] for e in pl[1:])


def test_chat_prompts_carry_every_message_field(llama):
    messages = [{"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text",
                                                                                      "text": "part two"}],
                 "name": "ann"},
                {"role": "assistant", "content": None, "reasoning_content": "hm",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "clock",
                                                                             "arguments": "{}"}}]},
                {"role": "tool", "content": "12:00", "tool_call_id": "c1"}]
    text = _rendered(llama, messages)
    # (the first token, <s>, has no log-probability)
    assert text == ("<|im_start|>user\npart one part two@ann</s>\n"
                    "<|im_start|>assistant\n<think>hm</think><tool_call>clock</tool_call></s>\n"
                    "<|im_start|>tool\n12:00#c1</s>\n<|im_start|>assistant\n")


def test_continue_final_message(llama):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, "}]
    text = _rendered(llama, messages, continue_final_message=True, add_generation_prompt=False)
    assert text == "<|im_start|>user\nHi</s>\n<|im_start|>assistant\nWell, "
    check_error(post(llama, "/chat/completions", {"messages": messages, "continue_final_message": True}), 400,
                param="continue_final_message", says="add_generation_prompt")


@pytest.mark.quick
def test_content_format_detected_from_the_template():
    """Of the committed real templates, Gemma 3's loops over a message's parts; the others read
    content as a string (each rendered like transformers in test_chat_template.py)."""
    from pathlib import Path

    from jaxdecode.server.chat import detect_content_format

    folder = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
    found = {f.stem: detect_content_format(f.read_text()) for f in folder.glob("*.jinja")}
    assert {name for name, fmt in found.items() if fmt == "openai"} == {"google-gemma-3-it"}
    assert detect_content_format(TOOL_TEMPLATE) == "openai"
    assert detect_content_format("{% set c = messages[0].content %}{% for p in c | list %}{{ p }}{% endfor %}") \
        == "openai"
    assert detect_content_format(CHAR_TEMPLATE) == "string"


@pytest.mark.quick
def test_tool_call_formats_parse():
    from jaxdecode.server import parsing as P

    content, (call,) = P.parse_calls('Sure.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', "hermes")
    assert content == "Sure." and call["function"] == {"name": "f", "arguments": '{"a": 1}'}
    content, calls = P.parse_calls('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": '
                                   '{"b": "x"}}]', "mistral")
    assert content == "" and [c["function"]["name"] for c in calls] == ["f", "g"]
    _, (call,) = P.parse_calls('<|python_tag|>{"name": "f", "parameters": {"a": 2}}', "llama3")
    assert call["function"]["arguments"] == '{"a": 2}'
    assert P.parse_calls('<tool_call>{"name": "f", "arguments": ', "hermes") is None
    assert P.tool_format("... [TOOL_CALLS] ...") == "mistral" and P.tool_format("<tool_call>") == "hermes"
