"""``jaxdecode serve`` against malformed requests, and forced tool calls at volume, on the byte-level
BPE fixture (one server for the module, the harness of ``tests/server/test_server.py``, with the tool
template :data:`TEMPLATE`; at the end it must stop cleanly, with no traceback on its stderr).

- The fuzzer: a few hundred requests from a fixed seed, to every endpoint (the two generation
  endpoints, the GET routes, the explorer's page and endpoints, unknown paths and wrong methods):
  valid bodies mutated (wrong types, huge and negative numbers, NaN and infinities, strings of
  every kind, lone surrogates, deep nesting, fields removed, unknown or misplaced fields, bad
  roles, bad tool schemas, bad structured outputs), and broken bodies (not UTF-8, not JSON,
  truncated, empty, the wrong content type, over the size limit). No answer may be a 5xx; every
  error must be OpenAI's error JSON; a stream must be well-formed events, any error among them not
  an internal one; the server counts no 500 in its metrics and still serves afterwards.
- ``tool_choice: "required"``: 100 calls (one request of n = 100) each parse and satisfy their
  tool's JSON schema (checked by :mod:`support.schema`), and the same request streamed, with the
  same seed, reassembles call by call to the same names and arguments.

The errors the fuzzer found when it was written, now fixed: a lone surrogate escape in any string
reached the tokenizer (a 500, TypeError); a deeply nested body sent to an explorer endpoint (a
500, RecursionError); ``tool_choice: {"type": "function", "function": "f"}`` (a 500,
AttributeError); and a JSON schema with ``"minItems": 1000000000`` expanded into an automaton of
a billion copies and ran the server out of memory (now refused before it is compiled, with any
pattern whose counted repetitions expand past ``jaxdecode.constraints.MAX_PATTERN_SIZE``).
"""

from __future__ import annotations

import copy
import json
import random
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from jaxdecode.constraints import ConstraintError, compile_json_schema, compile_regex  # noqa: E402
from jaxdecode.server.app import parse_body  # noqa: E402
from support import schema  # noqa: E402
from support.servers import serving  # noqa: E402
from support.servers import HF, client, metrics, still_serving  # noqa: E402
from test_server_clients import CLOCK, USER, WEATHER  # noqa: E402

# ChatML turns with the tools' names and the size of their parameters' JSON (the fixture's window is
# 256 tokens: a whole schema would not fit), content parts looped over, tool calls as JSON.
TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for t in tools %}"
    "{{- t['function']['name'] + ' ' + (t['function']['parameters'] | tojson | length | string) + '\\n' }}"
    "{%- endfor %}{{- eos_token + '\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string %}{{- m['content'] }}"
    "{%- elif m['content'] is iterable %}{%- for p in m['content'] %}{{- p['text'] }}{%- endfor %}{%- endif %}"
    "{%- if m['tool_calls'] is defined %}{%- for c in m['tool_calls'] %}"
    "{{- '<tool_call>' + (c['function'] | tojson) + '</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- eos_token + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
ERROR_TYPES = {"invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    template = tmp_path_factory.mktemp("templates") / "tools.jinja"
    template.write_text(TEMPLATE)
    with serving(llama=("--ckpt", str(HF), "--slots", "8", "--chat-template", str(template))) as procs:
        yield procs["llama"].ready()


# ----------------------------------------------------------------------------- without a server


@pytest.mark.quick
def test_the_body_parser_names_what_is_wrong():
    assert parse_body(b'{"a": ["\\ud83d\\ude00", "\\\\ud800"]}') == {"a": ["\U0001F600", "\\ud800"]}
    assert parse_body('{"a": 1}'.encode("utf-16")) == {"a": 1}  # (json.loads detects the encoding)
    for body, says in [(b'{"a": "x\\ud800"}', "the lone surrogate \\ud800"),
                       (b'{"\\udfff": 1}', "the lone surrogate \\udfff"),
                       (b'[[{"b": ["\\ud800\\ud800"]}]]', "the lone surrogate \\ud800"),
                       (b"[" * 100_000, "nests arrays or objects too deeply"),
                       (b'{"a": "\xff"}', "not UTF-8 text"),
                       (b'{"a": ', "Expecting value")]:
        with pytest.raises(json.JSONDecodeError) as info:
            parse_body(body)
        assert says in info.value.msg


@pytest.mark.quick
def test_a_pattern_too_large_is_refused_before_it_is_compiled():
    """Counted repetitions are written out by the automaton's builder: past the limit the pattern
    is refused at once (a schema's minItems of a billion once ran the server out of memory)."""
    from jaxdecode.io.vocab import Vocab

    vocab = Vocab("ab{}[]\",: 0123456789")
    start = time.monotonic()
    for pattern in ("a{100000}", "(ab){30000,}", "(a{300}){300}"):
        with pytest.raises(ConstraintError, match="too large to compile"):
            compile_regex(pattern, vocab)
    for s in ({"type": "array", "minItems": 10**9}, {"type": "string", "maxLength": 10**9}):
        with pytest.raises(ConstraintError, match="too large to compile"):
            compile_json_schema(s, vocab)
    assert time.monotonic() - start < 5
    assert compile_regex("a{1000}b", vocab).accepts(vocab.encode("a" * 1000 + "b"))  # below the limit: compiled


# ----------------------------------------------------------------------------- what the fuzzer found

FOUND = [  # (path, body sent as is, what the 400's message says)
    ("/v1/completions", b'{"prompt": "ab\\ud800", "max_tokens": 1}', "lone surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 1}',
     "lone surrogate"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 1}', "lone surrogate"),
    ("/explore/next", b'{"prompt": "\\ud800"}', "not valid JSON"),
    ("/explore/next", b"[" * 100_000, "not valid JSON"),
    ("/v1/completions", b"[" * 100_000, "nests arrays or objects too deeply"),
    ("/v1/chat/completions", json.dumps({"messages": USER, "tools": [CLOCK], "max_tokens": 1, "tool_choice": {
        "type": "function", "function": "clock"}}).encode(), "tool_choice: give"),
    ("/v1/chat/completions", json.dumps({"messages": USER, "max_tokens": 1, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "array", "minItems": 10**9}}}}).encode(),
     "too large to compile"),
]


@pytest.mark.parametrize("path, body, says", FOUND, ids=[f"{p}-{k}" for k, (p, _, _) in enumerate(FOUND)])
def test_what_the_fuzzer_found_is_refused_in_one_line(llama, path, body, says):
    start = time.monotonic()
    r = httpx.post(llama.root + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert _check(r, "POST", path, body) == "400"
    assert says in r.json()["error"]["message"]
    assert time.monotonic() - start < 30


# ----------------------------------------------------------------------------- required tool calls


def _valid_call(call) -> dict:
    """A call's name and parsed arguments, which must satisfy its tool's schema."""
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    name = call["function"]["name"]
    args = json.loads(call["function"]["arguments"])
    assert name in tools, name
    problems = schema.errors(args, tools[name])
    assert not problems, (name, args, problems)
    return {"name": name, "arguments": call["function"]["arguments"]}


@pytest.mark.slow
def test_required_tool_calls_all_parse_and_stream_the_same(llama):
    """100 samples of one request with ``tool_choice: "required"``: every one a single call that
    parses and satisfies its tool's schema; streamed with the same seed, each sample's deltas put
    back together are the same call."""
    start = time.monotonic()
    body = {"model": llama.name, "messages": USER, "tools": [WEATHER, CLOCK], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 80, "temperature": 1.0, "seed": 3, "n": 100}
    r = httpx.post(llama.url + "/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(100))
    whole = []
    for c in choices:
        assert c["finish_reason"] == "tool_calls", c
        call, = c["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        whole.append(_valid_call(call))
    assert {w["name"] for w in whole} == {"weather", "clock"}  # samples, not one answer 100 times
    assert len({w["arguments"] for w in whole}) >= 4
    streamed = [{"name": "", "arguments": ""} for _ in range(100)]
    finish = [None] * 100
    for chunk in client(llama).chat.completions.create(stream=True, **body):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                assert tc.index == 0  # one call per sample
                streamed[ch.index]["name"] += tc.function.name or ""
                streamed[ch.index]["arguments"] += tc.function.arguments or ""
            if ch.finish_reason is not None:
                assert finish[ch.index] is None
                finish[ch.index] = ch.finish_reason
    assert finish == ["tool_calls"] * 100
    assert streamed == whole
    assert time.monotonic() - start < 120


# ----------------------------------------------------------------------------- the fuzzer

SEED = 20_240_611
BUDGET_S = 300  # one run's wall time at most, on a busy 2-core machine

BASES = {
    "/v1/completions": [
        {"prompt": "The cat sat", "max_tokens": 3, "seed": 1},
        {"prompt": [1, 5, 9, 40], "max_tokens": 2, "logprobs": 2, "echo": True},
        {"prompt": ["a b", "The"], "max_tokens": 2, "n": 2, "stream": True,
         "stream_options": {"include_usage": True}},
        {"prompt": "The mat", "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0},
        {"prompt": "The", "max_tokens": 4, "structured_outputs": {"regex": "(yes|no)"}, "top_k": 5},
        {"prompt": [[1, 2], [3]], "max_tokens": 2, "prompt_logprobs": 1, "stop": ["x", "y"]},
        {"prompt": "Once", "max_tokens": 3, "guided_choice": ["up", "down"], "top_p": 0.5, "min_p": 0.1,
         "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5},
    ],
    "/v1/chat/completions": [
        {"messages": USER, "max_tokens": 3},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}],
                       "name": "ann"}], "max_tokens": 3, "stream": True, "logprobs": True, "top_logprobs": 2},
        {"messages": USER, "tools": [WEATHER, CLOCK], "tool_choice": "required", "max_tokens": 60, "seed": 2},
        {"messages": USER, "tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "clock"}},
         "max_tokens": 40, "stream": True},
        {"messages": [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "call_1", "type": "function", "function": {"name": "clock",
                                                                            "arguments": "{\"zone\": \"UTC\"}"}}]},
                      {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}],
         "tools": [CLOCK], "max_tokens": 3},
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
            "name": "z", "schema": CLOCK["function"]["parameters"]}}, "max_tokens": 30},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}],
         "continue_final_message": True, "add_generation_prompt": False, "max_completion_tokens": 2,
         "chat_template_kwargs": {"x": 1}, "stop": "\n"},
    ],
    "/explore/next": [{"prompt": "The cat", "top": 5, "settings": {"temperature": 0.8}, "path": [5]}],
    "/explore/sample": [{"prompt": "The", "n": 2, "seed": 1, "greedy": False}],
    "/explore/constrained": [{"prompt": "The", "choices": ["yes", "no"], "n": 4, "top": 3}],
    "/explore/beam": [{"prompt": "The", "n": 2, "k": 2, "pruned": 1}],
    "/explore/compare": [{"prompt": "The", "n": 2, "k": 2, "seeds": [0], "exact_budget": 50}],
    "/explore/speculative": [{"prompt": "The cat", "n": 3, "gamma": 2, "draft": "lookup"}],
}
GETS = ["/v1/models", "/health", "/metrics", "/", "/explore", "/explore/info", "/static/index.html",
        "/static/..%2F..%2Fpyproject.toml", "/static/.hidden", "/static/nope.js", "/v1/nope", "/nope",
        "/v1/completions", "/v1/chat/completions", "/v1/models/x"]
# fields a request may name: the declared ones, misplaced ones, and unknown ones
FIELDS = ["model", "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "stream",
          "stream_options", "response_format", "top_k", "min_p", "repetition_penalty", "ignore_eos",
          "stop_token_ids", "structured_outputs", "guided_regex", "guided_choice", "guided_json",
          "skip_special_tokens", "include_stop_str_in_output", "add_special_tokens", "prompt_logprobs",
          "logit_bias", "min_tokens", "best_of", "suffix", "use_beam_search", "priority", "max_tokens",
          "max_completion_tokens", "logprobs", "top_logprobs", "echo", "prompt", "messages", "tools", "tool_choice",
          "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
          "documents", "reasoning_effort", "include_reasoning", "functions", "user", "metadata", "settings",
          "path", "top", "greedy", "seeds", "regex", "choices", "draft", "gamma", "pruned", "k", "exact_budget",
          "__proto__", "constructor", "", "nöt a field", "a" * 300]
BAD_SCHEMAS = [{"type": "nonsense"}, {"$ref": "#/nope"}, {"type": "string", "pattern": "("}, {"enum": []},
               {"type": "array", "minItems": 10**9}, {"type": "string", "maxLength": 10**12},
               {"type": "object", "properties": 5}, {"type": ["string", 3]}, {"anyOf": []}, {"allOf": [{"not": {}}]},
               {"type": "integer", "minimum": 5, "maximum": 1}, {"required": ["x"], "additionalProperties": False},
               {"properties": {"a": {"$ref": "#"}}}, {"type": "string", "format": "no-such-format"}, [], "x", None]


def _deep(depth: int):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


def _weird(rng: random.Random):
    return rng.choice([
        None, True, False, 0, -1, 1.5, -0.0, 1e308, -1e308, 2**63, -(2**63) - 1, 10**30, float("nan"),
        float("inf"), float("-inf"), "", "x", "NaN", "Infinity", "-1", "1e999", "\u0000", "\ufffd", "🚀" * 3,
        "\u202e\u200b", "<|im_end|>", "<s>", "</s>", "{{ 7 * 7 }}", "{% for x in y %}", "a" * 5000, [], {},
        [None], [1, "a", None], {"a": 1}, {"type": "text", "text": 5}, _deep(rng.choice([3, 60, 400])),
        rng.choice(BAD_SCHEMAS)])


def _paths(value, at=()):
    """Every place in a JSON value: ``(path, value)``."""
    yield at, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, at + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, at + (i,))


def _mutate(body, rng: random.Random):
    """One to three changes at random places of a copy of ``body``."""
    body = copy.deepcopy(body)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        places = list(_paths(body))
        path, value = rng.choice(places)
        parent = body
        for p in path[:-1]:
            parent = parent[p]
        op = rng.random()
        if not path:  # the whole body: a field added
            if isinstance(body, dict):
                body[rng.choice(FIELDS)] = _weird(rng)
            continue
        key = path[-1]
        if op < 0.45:
            parent[key] = _weird(rng)
        elif op < 0.6 and isinstance(parent, dict):
            del parent[key]
        elif op < 0.7 and isinstance(parent, dict):
            parent[rng.choice(FIELDS)] = _weird(rng)
        elif op < 0.8:
            parent[key] = [value] if rng.random() < 0.5 else {"value": value}
        elif op < 0.9 and isinstance(value, list):
            parent[key] = value * rng.choice([0, 2, 40])
        elif isinstance(value, str):
            parent[key] = rng.choice([value * 200, value[:1], value + "\u0000", value.upper(), value + "\ud800"])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            parent[key] = rng.choice([-value, value * 10**6, value + 0.5, str(value), -1, 0])
        else:
            parent[key] = _weird(rng)
    return body


def _dumps(value) -> bytes:
    """JSON with NaN and infinities written as Python does, and lone surrogates as escapes."""
    return json.dumps(value, allow_nan=True).encode("utf-8")


def _raw(rng: random.Random, body: bytes, valid: bool = True) -> tuple[bytes, dict]:
    """A broken rendering of ``body`` and the headers to send it with; ``valid`` False: none that
    could still parse as the body it was (a JSON object)."""
    headers = {"content-type": "application/json"}
    kind = rng.randrange(11) if valid else rng.choice([0, 1, 2, 3, 4, 10])
    if kind == 0:
        body = body[:rng.randrange(len(body))]
    elif kind == 1:
        at = rng.randrange(len(body) + 1)
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        body = body[:at] + (junk if valid else b"\xff" + junk) + body[at:]
    elif kind == 2:
        body = rng.choice([b"", b"null", b"[]", b"42", b'"text"', b"true", b"{}", b"{,}", b"\xef\xbb\xbf{}",
                           b"{'single': 'quotes'}", b'{"a": 1, "a": 2}', b'{"prompt": "\\ud800", "max_tokens": 1}',
                           b'{"messages": [{"role": "user", "content": "\\udc00"}]}'])
    elif kind == 3:
        body = b"[" * rng.choice([1000, 100_000]) + b"]" * rng.choice([0, 1000])
    elif kind == 4:
        body = b'{"prompt": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001
    elif kind == 5:
        headers = {"content-type": rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                               "application/json; charset=latin-1", "application/vnd.api+json"])}
    elif kind == 6:
        headers = {}
    elif kind == 7:
        body = body.replace(b'"', b"'", 1)
    elif kind == 8:
        body = body.decode("utf-8").encode("utf-16")
    elif kind == 9:
        body = body[:-1] + b", " + b'"pad": "' + b"x" * rng.choice([10_000, (4 << 20) + 10]) + b'"}'
    else:
        body = body + rng.choice([b"garbage", b"}", b"\x00", b"\n\n{}"])
    return body, headers


def _check(r, method: str, path: str, sent) -> str:
    """The checks on one answer; returns its kind for the tally."""
    where = f"{method} {path} {str(sent)[:300]!r}"
    assert r.status_code < 500, f"{r.status_code} for {where}: {r.text[:500]}"
    kind = r.headers.get("content-type", "")
    if r.status_code >= 400:
        assert kind.startswith("application/json"), where
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, (body, where)
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"], where
        assert err["type"] in ERROR_TYPES, (err, where)
        return f"{r.status_code}"
    if kind.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", where
        for e in events[:-1]:
            data = json.loads(e)
            if "error" in data:
                assert data["error"]["type"] != "internal_server_error", (data, where)
        return "stream"
    if kind.startswith("application/json"):
        r.json()
    return "200"


def _fuzz(server, seed: int, count: int, explorer_runs: bool) -> dict:
    """``count`` requests drawn from ``seed``; returns how many got each kind of answer. Without
    ``explorer_runs`` the explorer's endpoints get broken bodies only (each valid run there compiles
    programs of its own: seconds apiece)."""
    rng = random.Random(seed)
    explore = [p for p in BASES if p.startswith("/explore")]
    tally: dict = {}
    start = time.monotonic()
    with httpx.Client(timeout=120) as http:
        for i in range(count):
            choice = rng.random()
            if choice < 0.08:  # a GET route, or a wrong method
                path = rng.choice(GETS + list(BASES))
                method = rng.choice(["GET", "GET", "POST", "PUT", "DELETE", "PATCH"])
                r = http.request(method, server.root + path, content=rng.choice([b"", b"{}", b"\xff"]))
                kind = _check(r, method, path, None)
            else:  # a generation endpoint mostly; the explorer's, one request in six
                path = rng.choice(explore) if choice < 0.25 else rng.choice(["/v1/completions",
                                                                             "/v1/chat/completions"])
                body = _mutate(rng.choice(BASES[path]), rng)
                if choice > 0.88 or (path in explore and not explorer_runs):
                    content, headers = _raw(rng, _dumps(body), valid=False)
                    sent = content[:200]
                else:
                    content, headers, sent = _dumps(body), {"content-type": "application/json"}, body
                r = http.post(server.root + path, content=content, headers=headers)
                kind = _check(r, "POST", path, sent)
            tally[kind] = tally.get(kind, 0) + 1
            assert time.monotonic() - start < BUDGET_S, f"{i + 1} requests took more than {BUDGET_S} s"
    return tally


@pytest.mark.parametrize("seed, count, explorer_runs", [
    pytest.param(SEED, 200, False, id="generation"),
    pytest.param(SEED + 1, 400, True, id="every-endpoint", marks=pytest.mark.slow)])
def test_fuzzed_requests_get_no_5xx_and_the_server_keeps_serving(llama, seed, count, explorer_runs):
    tally = _fuzz(llama, seed, count, explorer_runs)
    assert sum(tally.values()) == count
    # the run reached every kind of answer: refusals, completions and streams
    assert tally.get("400", 0) > count // 3 and tally.get("200", 0) > count // 20 and tally.get("stream", 0) > 3, \
        tally
    still_serving(llama)
    r = client(llama).chat.completions.create(model=llama.name, messages=USER, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    counted = {k: v for k, v in metrics(llama).items() if k.startswith("jaxdecode_requests_total")}
    assert counted and not any('status="5' in k for k in counted), counted
