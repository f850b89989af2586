"""``jaxdecode serve`` fuzzed from its own OpenAPI document (``/openapi.json``) by schemathesis, on
the fixture Llama (one server for the module; at the end it must stop cleanly, with no traceback
on its stderr).

Every operation the document lists gets requests generated from its schema: valid bodies
(``positive``) and bodies that break the schema in one place (``negative``). Each answer is
checked by schemathesis: no 5xx, the status documented for the operation, the content type
documented, the body valid against the documented schema (so every error is OpenAI's error JSON,
:class:`jaxdecode.server.protocol.ErrorResponse`); and here: a stream is well-formed events that
end with ``[DONE]``, none an internal error.

Bounded for CI: a fixed number of examples per operation and mode, drawn from a fixed seed
(the suite's Hypothesis profile derandomizes), a deadline per request, one for the whole run, and generation kept short (``n`` and the
token counts a body asks for are capped before it is sent: the fixture's window is 256 tokens,
and a body of n = 128 samples of the whole window would take the fuzzer's whole budget). The
explorer's endpoints get only bodies that break their schema in CI (each valid run there
compiles programs of its own, seconds apiece); the slow test sends valid ones too, and more of
everything. ``OPENAPI_FUZZ_EXAMPLES=500 python -m pytest -n 0 tests/server/test_openapi_fuzz.py
-m slow`` runs it longer; ``HYPOTHESIS_PROFILE=explore`` draws new examples each run.

Valid bodies are also steered past what no static schema can say (:func:`_steered`: token ids
below the vocabulary size, non-empty prompts, content in every message the fixture's template
reads), so that most of them reach the engine instead of a 400.

What it found when it was written, now fixed: the document said every route answered 200 with
any JSON and a bad body 422 (it gets 400 with OpenAI's error JSON), with no error statuses,
``/metrics`` as JSON (it is Prometheus text), no request body for the explorer's endpoints, and
no schema for a stream's events; an unknown field was allowed by the schema and refused by the
server. Two 500s (:data:`FOUND`): an explorer setting given as a list reached the rule as an
array (a ``lax.cond`` of mismatched shapes), and one past float32's range made every logit NaN,
which the JSON encoder refused. And, not a finding of the fuzzer: a JSON schema that takes
seconds to compile was compiled on the event loop, so ``/health`` waited for it, and again in the
engine's loop, so every other request waited for it
(:func:`test_health_and_other_requests_answer_while_a_large_schema_compiles`).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,  # noqa: E402
                                               status_code_conformance)

from support.servers import HF, serving  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# every operation the document must list, and the modes CI runs on it; the slow test runs both
# modes everywhere (a GET without parameters has no negative case: it runs once)
OPERATIONS = {
    "GET /health": [POSITIVE], "GET /v1/models": [POSITIVE], "GET /metrics": [POSITIVE],
    "POST /v1/completions": [POSITIVE, NEGATIVE], "POST /v1/chat/completions": [POSITIVE, NEGATIVE],
    "GET /explore/info": [POSITIVE], "POST /explore/next": [NEGATIVE], "POST /explore/sample": [NEGATIVE],
    "POST /explore/compare": [NEGATIVE], "POST /explore/beam": [NEGATIVE], "POST /explore/constrained": [NEGATIVE],
    "POST /explore/speculative": [NEGATIVE],
}
EXAMPLES = {POSITIVE: 25, NEGATIVE: 12}  # per operation in CI (the explorer's: NEGATIVE only)
SLOW_EXAMPLES = int(os.environ.get("OPENAPI_FUZZ_EXAMPLES", "100"))
REQUEST_S = 60  # one request's deadline
# CI's run of every operation at most, the server's start apart, on a busy 2-core machine: a guard
# against a run that hangs (measured: 11 s at a load of 7, about 40 s at 10; most of it is
# Hypothesis drawing bodies from the two large request schemas)
BUDGET_S = 150
CAP = {"n": 2, "max_tokens": 8, "max_completion_tokens": 8, "min_tokens": 8, "top_logprobs": 5, "logprobs": 5,
       "prompt_logprobs": 5}


@pytest.fixture(scope="module")
def llama():
    with serving(llama=("--ckpt", str(HF), "--slots", "4")) as procs:
        server = procs["llama"].ready()
        # the engine's programs compiled before the clock starts (each example has a deadline)
        for path, body in (("/v1/completions", {"prompt": "The", "max_tokens": 2, "n": 2, "logprobs": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 2, "stream": True})):
            r = httpx.post(server.root + path, json=body, timeout=REQUEST_S * 3)
            assert r.status_code == 200, r.text
        yield server


@pytest.fixture(scope="module")
def api(llama):
    schema = schemathesis.openapi.from_url(llama.root + "/openapi.json")
    schema.config.max_stream_events = 10_000  # (streams read whole: by default, the first 20 events)
    return schema


@functools.cache
def _vocab_size(server) -> int:
    return httpx.get(server.root + "/explore/info", timeout=REQUEST_S).json()["vocab_size"]


@pytest.fixture(scope="module")
def clock():
    return {"spent": 0.0}


def _bounded(body):
    """A JSON body with its sample and token counts capped (:data:`CAP`), so that no valid request
    generates for long; values of the wrong type are left as they are."""
    if isinstance(body, dict):
        for name, cap in CAP.items():
            v = body.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > cap:  # (129.0: an integer too)
                body[name] = cap
        if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = CAP["max_tokens"]  # (else: the rest of the window)
    return body


def _steered(body, V: int):
    """A valid body (POSITIVE) made to pass what no static schema can say, so that more of them
    reach the engine: token ids taken modulo the model's vocabulary size ``V``, empty prompts
    given a character, and every message but the assistant's given content (the fixture's chat
    template requires it)."""
    ids = lambda xs: [abs(t) % V for t in xs] if isinstance(xs, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in xs) else xs
    p = body.get("prompt")
    if isinstance(p, str) and not p:
        body["prompt"] = "a"
    elif isinstance(p, list):
        p = [q or ("a" if isinstance(q, str) else [1]) for q in p] or ["a"]
        body["prompt"] = [ids(q) for q in p] if isinstance(p[0], list) else ids(p)
    for name in ("allowed_token_ids", "stop_token_ids"):
        body[name] = ids(body.get(name))
    for m in body.get("messages") or []:
        if isinstance(m, dict) and m.get("role") != "assistant" and not m.get("content"):
            m["content"] = "x"
    return body


def _stream_is_well_formed(response, label):
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return
    assert not response.stream_cut_short, label
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", (label, response.text[-500:])
    for e in events[:-1]:
        data = json.loads(e)
        assert "error" not in data or data["error"]["type"] != "internal_server_error", (label, data)


def _fuzz(api, llama, label: str, mode: GenerationMode, examples: int) -> dict:
    """``examples`` requests to the operation ``label`` in ``mode``; returns the count of each status."""
    method, path = label.split(" ", 1)
    operation = api[path][method]
    statuses: dict = {}
    V = _vocab_size(llama)

    # (derandomized by the suite's Hypothesis profile, tests/conftest.py; the deadline is REQUEST_S's)
    @settings(max_examples=examples, deadline=None, phases=[Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def run(case):
        if isinstance(case.body, dict):
            case.body = _bounded(_steered(case.body, V) if mode == POSITIVE else case.body)
        start = time.monotonic()
        response = case.call(base_url=llama.root, timeout=REQUEST_S)
        assert time.monotonic() - start < REQUEST_S, label
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=CHECKS)
        _stream_is_well_formed(response, label)

    run()
    return statuses


def test_the_document_lists_every_operation_and_documents_errors_as_openai_json(api, llama):
    listed = sorted(op.ok().label for op in api.get_all_operations())
    assert listed == sorted(OPERATIONS)
    doc = httpx.get(llama.root + "/openapi.json").json()
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            codes = set(op["responses"])
            assert "422" not in codes and {"200", "500", "503"} <= codes, (method, path, codes)
            for code, answer in op["responses"].items():
                if code != "200":
                    assert answer["content"]["application/json"]["schema"] == {
                        "$ref": "#/components/schemas/ErrorResponse"}, (method, path, code)
            if method == "post":
                assert {"400", "413"} <= codes and "requestBody" in op, (method, path)
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    # a field the server refuses is not in the published request schema
    for name in ("CompletionRequest", "ChatRequest"):
        schema = doc["components"]["schemas"][name]
        assert schema["additionalProperties"] is False and schema["properties"]["priority"]["enum"] == [0]


# ----------------------------------------------------------------------------- what the fuzzer found

FOUND = [  # (path, body, the status, what the answer says)
    ("/explore/next", {"prompt": "ab", "settings": {"repetition_penalty": [], "top_k": []}, "top": 1}, 400,
     "settings.repetition_penalty must be a number"),  # was a 500 (a cond of mismatched shapes in the rule)
    ("/explore/sample", {"prompt": "ab", "settings": {"frequency_penalty": 1.7976931348623157e308}, "n": 2}, 400,
     "must be a finite float32 number"),  # was a 500 (NaN log-probabilities, not JSON)
]


@pytest.mark.parametrize("path, body, status, says", FOUND, ids=[f"{p}-{k}" for k, (p, *_) in enumerate(FOUND)])
def test_what_the_fuzzer_found(api, llama, path, body, status, says):
    r = httpx.post(llama.root + path, json=body, timeout=REQUEST_S)
    assert r.status_code == status, r.text
    json.loads(r.text, parse_constant=lambda c: pytest.fail(f"{c} in {r.text[:300]}"))  # JSON, not Python's
    if says is not None:
        assert says in r.json()["error"]["message"]
    api[path]["POST"].validate_response(r)  # (the documented schema)


@pytest.mark.quick
def test_the_explorers_answers_hold_no_float_json_cannot():
    """What an explorer computation returns goes out with None for infinities and NaN (JSON has
    neither; Starlette's encoder refuses them: a 500)."""
    import asyncio

    from jaxdecode.server.explore import Explorer

    out = asyncio.run(Explorer(lambda: "lm").run(lambda lm: {"a": [float("-inf"), 1.5, (float("nan"), 2)], "b": lm}))
    assert out == {"a": [None, 1.5, [None, 2]], "b": "lm"}


@pytest.mark.quick
def test_an_unsupported_fields_published_values_are_the_ones_accepted():
    """Each field declared only to be refused takes exactly the values the published schema lists
    for it (NOT_USED), and no field beyond the declared and harmless ones is published."""
    from jaxdecode.server.protocol import (HARMLESS, NOT_USED, APIError, ChatRequest, CompletionRequest,
                                           refuse_unsupported)

    base = {CompletionRequest: {"prompt": "a"}, ChatRequest: {"messages": [{"role": "user", "content": "a"}]}}
    for model, body in base.items():
        schema = model.model_json_schema()
        assert schema["additionalProperties"] is False and HARMLESS <= set(schema["properties"])
        for key, values in NOT_USED.items():
            name, _, only = key.partition("@")
            if only == "chat" and model is not ChatRequest or name not in model.model_fields:
                continue
            assert schema["properties"][name]["enum"] == values, name
            for value in values:
                refuse_unsupported(model.model_validate(dict(body, **{name: value})))
            changed = {bool: lambda v: not v, int: lambda v: v + 7, float: lambda v: v + 0.5, str: lambda v: v + "x",
                       list: lambda v: [*v, "x"], dict: lambda v: {**v, "a": 1}}
            for value in [changed[type(v)](v) for v in values if v is not None]:
                try:
                    request = model.model_validate(dict(body, **{name: value}))
                except ValueError:
                    continue  # (not even of the field's type)
                with pytest.raises(APIError, match=f"'{name}' is not supported"):
                    refuse_unsupported(request)


@pytest.mark.parametrize("label, mode", [(label, mode) for label, modes in OPERATIONS.items() for mode in modes],
                         ids=[f"{label}-{mode.value}" for label, modes in OPERATIONS.items() for mode in modes])
def test_fuzzed_from_the_document_no_5xx_and_answers_as_documented(api, llama, clock, label, mode):
    start = time.monotonic()
    statuses = _fuzz(api, llama, label, mode, EXAMPLES[mode])
    clock["spent"] += time.monotonic() - start
    assert clock["spent"] < BUDGET_S, f"the fuzzer's requests took {clock['spent']:.0f} s, past {BUDGET_S} s"
    if label.startswith("POST /v1/"):  # it reached the engine, and refusals
        assert 400 in statuses and (mode == NEGATIVE or 200 in statuses), statuses


@pytest.mark.slow
@pytest.mark.parametrize("label", list(OPERATIONS))
def test_fuzzed_at_length_every_operation_both_modes(api, llama, label):
    for mode in (POSITIVE, NEGATIVE):
        if mode == NEGATIVE and label.startswith("GET"):
            continue  # (no parameters: nothing to break)
        _fuzz(api, llama, label, mode, SLOW_EXAMPLES)


def test_health_and_other_requests_answer_while_a_large_schema_compiles(llama):
    """A JSON schema that takes seconds to compile is compiled off the event loop: /health answers
    at once meanwhile. (The request is then refused, after its compile, for asking past the window:
    its time is the compile's.) Compiled on the event loop, as it once was, /health waited for it.
    Then the engine's process compiles it off its loop: other requests are served meanwhile."""
    schema = {"type": "string", "maxLength": 2000}  # (seconds to compile; not compiled before in this server)
    body = {"prompt": "a", "max_tokens": 100_000, "structured_outputs": {"json": schema}}
    out = {}

    def slow():
        out["response"] = httpx.post(llama.root + "/v1/completions", json=body, timeout=REQUEST_S * 2)
        out["done"] = time.monotonic()

    thread = threading.Thread(target=slow)
    start = time.monotonic()
    thread.start()
    time.sleep(0.5)  # (the request is in, compiling)
    waits = []
    while "done" not in out and len(waits) < 20:
        asked = time.monotonic()
        assert httpx.get(llama.root + "/health", timeout=REQUEST_S).status_code == 200
        waits.append(time.monotonic() - asked)
        time.sleep(0.1)
    thread.join(REQUEST_S * 2)
    r = out["response"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    took = out["done"] - start
    assert took > 1.0, f"the compile took {took:.1f} s: too fast to show anything"
    # (on the event loop, /health waited for the compile: about the request's whole time)
    assert waits and max(waits) < max(0.5, took / 3), (waits, took)

    # the same schema again, within the window: the server has it compiled, the engine's process
    # compiles it now, in a worker thread; a plain request sent meanwhile is answered without waiting
    out.clear()
    body["max_tokens"] = 2
    thread = threading.Thread(target=slow)
    start = time.monotonic()
    thread.start()
    time.sleep(0.3)
    asked = time.monotonic()
    plain = httpx.post(llama.root + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=REQUEST_S)
    answered = time.monotonic() - asked
    assert plain.status_code == 200, plain.text
    thread.join(REQUEST_S * 2)
    assert out["response"].status_code == 200, out["response"].text
    took = out["done"] - start
    assert took > 1.0, f"the engine's compile took {took:.1f} s: too fast to show anything"
    # (compiled in the engine's loop, as it once was, the plain request waited for it)
    assert answered < max(0.5, took / 3), (answered, took)
