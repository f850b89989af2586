"""``POST /v1/completions`` and ``POST /v1/chat/completions``: a request's fields turned into engine
requests (:mod:`jaxdecode.server.handlers`), their outputs as OpenAI's response or its stream of
chunks. A client that leaves, streaming or not, has its requests aborted in the engine."""

from __future__ import annotations

import json

import anyio
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

from jaxdecode.serving.engine import Request
from jaxdecode.server import handlers as H
from jaxdecode.server import parsing as P
from jaxdecode.server.chat import ChatTemplateError
from jaxdecode.server.protocol import APIError, ChatRequest, CompletionRequest


async def _requests(server, body, prompts, n_new, top, stop, field, forced=None) -> list[Request]:
    settings = H.sampling(body, server.V, server.defaults)
    constraint = await H.constraint(body, server.vocab, forced)  # (a new pattern compiles in a worker thread)
    stop = H.writable_stops(stop, server.vocab)
    out = []
    for tokens in prompts:
        n = server.T - len(tokens) if n_new is None else n_new
        H.check_window(len(tokens), n, server.T, field)
        extra = {} if constraint is None else {"constraint": constraint}
        out.append(Request(list(map(int, tokens)), n, num_samples=body.n, stop=stop or None, top_logprobs=top,
                           ignore_eos=body.ignore_eos, **settings, **extra))
    return out


def _special(server, body) -> tuple:
    """The special tokens' strings to leave out of the text (``skip_special_tokens``, on by default)."""
    return H.special_strings(server.vocab) if body.skip_special_tokens else ()


class _Choice:
    """One choice's text, tokens, log-probabilities and finish reason as deltas arrive."""

    def __init__(self):
        self.text, self.tokens, self.logprobs, self.top, self.finish, self.generated = "", [], [], [], None, 0

    def add(self, d):
        self.text += d.text
        self.tokens += d.tokens
        self.logprobs += d.logprobs
        self.top += d.top_logprobs or []
        self.generated = d.generated
        if d.finish_reason is not None:
            self.finish = H.FINISH[d.finish_reason]


def _completion_logprobs(vocab, tokens, logprobs, top, offset0, with_top):
    """OpenAI's legacy ``logprobs`` of generated tokens; ``text_offset`` counts from ``offset0``,
    each token's offset the sum of the token strings before it."""
    strings = [H.token_text(vocab, t)[0] for t in tokens]
    offsets, at = [], offset0
    for s in strings:
        offsets.append(at)
        at += len(s)
    tops = None
    if with_top:  # the top k of each token; with k = 0, the token itself (one entry per token, as vLLM)
        tops = [{H.token_text(vocab, i)[0]: lp for i, lp in top[k]} if k < len(top) and top[k] else {s: logprobs[k]}
                for k, s in enumerate(strings)]
    return {"tokens": strings, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _echo_logprobs(vocab, tokens, scored):
    """The prompt's part of ``logprobs`` with ``echo``: the first token has none (null), every
    other its log-probability and the top k (with k = 0, the token itself), all from one pass of
    the library's scoring."""
    lps, top_vals, top_ids, _ = scored
    strings = [H.token_text(vocab, t)[0] for t in tokens]
    offsets, at = [], 0
    for s in strings:
        offsets.append(at)
        at += len(s)
    tops = [None]
    for k, _t in enumerate(tokens[1:]):
        entry = {H.token_text(vocab, i)[0]: v for i, v in zip(top_ids[k], top_vals[k])}
        tops.append(entry or {strings[k + 1]: lps[k]})
    return {"tokens": strings, "token_logprobs": [None] + list(lps), "top_logprobs": tops, "text_offset": offsets}


def _vllm_prompt_logprobs(vocab, tokens, scored):
    """vLLM's ``prompt_logprobs``: null for the first token, then per token ``{id: {"logprob",
    "rank", "decoded_token"}}`` of the prompt's token and the top ones."""
    lps, top_vals, top_ids, ranks = scored
    out = [None]
    for k, t in enumerate(tokens[1:]):
        entry = {str(t): {"logprob": lps[k], "rank": ranks[k], "decoded_token": H.token_text(vocab, t)[0]}}
        for r, (i, v) in enumerate(zip(top_ids[k], top_vals[k]), 1):
            entry.setdefault(str(i), {"logprob": v, "rank": r, "decoded_token": H.token_text(vocab, i)[0]})
        out.append(entry)
    return out


def _chat_logprobs(vocab, tokens, logprobs, top, with_top):
    content = []
    for k, (t, lp) in enumerate(zip(tokens, logprobs)):
        s, b = H.token_text(vocab, t)
        entry = {"token": s, "logprob": lp, "bytes": b, "top_logprobs": []}
        if with_top and k < len(top):
            entry["top_logprobs"] = [dict(zip(("token", "bytes"), H.token_text(vocab, i)), logprob=v)
                                     for i, v in top[k]]
        content.append(entry)
    return {"content": content}


def _usage(prompt_tokens, choices):
    done = sum(c.generated for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}


def _prompts(server, body) -> tuple[list, list]:
    """A completion request's prompts as token lists, and their texts."""
    p = body.prompt
    special = True if body.add_special_tokens is None else body.add_special_tokens
    if isinstance(p, str) or (p and isinstance(p[0], str)):
        texts = [p] if isinstance(p, str) else list(p)
        if any(not t for t in texts):
            raise APIError(400, "prompt: a prompt must not be empty", param="prompt")
        prompts = [server.encode(t, special=special) for t in texts]
        if any(len(q) == 0 for q in prompts):
            raise APIError(400, "prompt: a prompt must hold at least one token", param="prompt")
        return prompts, texts
    prompts = [p] if p and isinstance(p[0], int) else list(p)
    if not prompts or any(len(q) == 0 for q in prompts):
        raise APIError(400, "prompt: a prompt must hold at least one token", param="prompt")
    for q in prompts:
        bad = [t for t in q if not 0 <= t < server.V]
        if bad:
            raise APIError(400, f"prompt: the token id {bad[0]} is outside the vocabulary [0, {server.V})",
                           param="prompt")
    return prompts, [server.vocab.decode(list(q)) for q in prompts]


async def completions(body: CompletionRequest, request: HTTPRequest):
    server = request.app.state.server
    server.admit(body)
    prompts, texts = _prompts(server, body)
    stop = H.stops(body)
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not available when streaming", param="prompt_logprobs")
    scoring = body.prompt_logprobs is not None or (body.echo and body.logprobs is not None)
    k = body.prompt_logprobs if body.prompt_logprobs is not None else (body.logprobs or 0)
    top = body.logprobs or 0
    n_new = body.max_tokens
    reqs = await _requests(server, body, prompts, n_new, top, stop, "max_tokens")  # (checks the window)
    scored = None
    if scoring:
        scored = await H.prompt_logprobs(server.runner, [list(map(int, q)) for q in prompts], k)
    job = None
    if n_new != 0:
        job = H.Job(server.runner, reqs, body.include_stop_str_in_output)
        await job.start()
    rid, created = H.ids("cmpl")
    prompt_tokens = sum(len(q) for q in prompts)
    head = {"id": rid, "object": "text_completion", "created": created, "model": server.name}
    N = body.n
    vocab = server.vocab
    special = _special(server, body)
    echo_lp = [_echo_logprobs(vocab, list(map(int, q)), s) for q, s in zip(prompts, scored)] \
        if body.echo and body.logprobs is not None else None

    def echo_text(i):
        return (texts[i // N] if body.echo else "")

    if not body.stream:
        choices = [_Choice() for _ in range(len(reqs) * N)]
        if job is not None:
            out = await H.gather(job, request)
            if out is None:
                return None
            for kq, deltas in out:
                for d in deltas:
                    choices[kq * N + d.sample].add(d)
        else:
            for c in choices:
                c.finish = "length"
        listed = []
        for i, c in enumerate(choices):
            text = P.Reader(special=special).feed(c.text, True).get("content", "")
            lp = None
            if body.logprobs is not None:
                start = echo_lp[i // N]["text_offset"][-1] + len(echo_lp[i // N]["tokens"][-1]) if echo_lp else 0
                lp = _completion_logprobs(vocab, c.tokens, c.logprobs, c.top, start, True)
                if echo_lp:
                    lp = {key: echo_lp[i // N][key] + lp[key] for key in lp}
            choice = {"index": i, "text": echo_text(i) + text, "finish_reason": c.finish, "logprobs": lp}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(vocab, list(map(int, prompts[i // N])),
                                                                  scored[i // N])
            listed.append(choice)
        return JSONResponse(dict(head, choices=listed, usage=_usage(prompt_tokens, choices)))

    choices = [_Choice() for _ in range(len(reqs) * N)]
    readers = [P.Reader(special=special) for _ in choices]
    offsets = [0] * len(choices)
    first = []
    if body.echo:
        chunk = []
        for i in range(len(choices)):
            lp = echo_lp[i // N] if echo_lp else None
            if lp:
                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            chunk.append({"index": i, "text": texts[i // N], "logprobs": lp, "finish_reason": None})
        first.append(chunk)
    if job is None:
        first.append([{"index": i, "text": "", "logprobs": None, "finish_reason": "length"}
                      for i in range(len(choices))])

    def parts(kq, deltas):
        out = []
        for d in deltas:
            i = kq * N + d.sample
            c = choices[i]
            c.add(d)
            lp = None
            if body.logprobs is not None:
                lp = _completion_logprobs(vocab, d.tokens, d.logprobs, d.top_logprobs or [], offsets[i], True)
                offsets[i] += sum(len(s) for s in lp["tokens"])
            text = readers[i].feed(c.text, d.finish_reason is not None).get("content", "")
            out.append({"index": i, "text": text, "logprobs": lp, "finish_reason": _finish(d)})
        return out

    return _event_stream(job, body, head, first, parts, lambda: _usage(prompt_tokens, choices))


def _finish(d):
    return None if d.finish_reason is None else H.FINISH[d.finish_reason]


class EventStream(StreamingResponse):
    """A stream of server-sent events (``data: ...`` lines), each event written as it comes. The
    stream ends, its generator closed, as soon as the client leaves (whatever ASGI version the
    server speaks: its disconnect is watched, not only seen at the next write)."""

    media_type = "text/event-stream"

    def __init__(self, events):
        super().__init__(events, headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send):
        async with anyio.create_task_group() as group:
            async def stream():
                await self.stream_response(send)
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


def _event(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


def _event_stream(job, body, head, first: list, parts, usage) -> EventStream:
    """A streamed answer: the ``first`` chunks, then one chunk per batch of deltas (``parts(k,
    deltas)`` gives its choices), a usage chunk if asked for (``usage()``), then ``[DONE]``. A
    client that leaves before the end aborts the job. ``job`` None: the first chunks are all."""
    with_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events():
        finished = False
        try:
            for chunk in first:
                yield _event(_chunk(head, chunk, with_usage))
            if job is not None:
                try:
                    async for k, deltas in job.deltas():
                        yield _event(_chunk(head, parts(k, deltas), with_usage))
                except APIError as e:  # the engine failed mid-stream: the error as the stream's last event
                    yield _event(json.dumps(e.body()))
                    yield _event("[DONE]")
                    finished = True
                    return
            if with_usage:
                yield _event(json.dumps(dict(head, choices=[], usage=usage())))
            yield _event("[DONE]")
            finished = True
        finally:
            if not finished and job is not None:
                job.abort()

    return EventStream(events())


def _chunk(head, parts, with_usage) -> str:
    body = dict(head, choices=parts)
    if with_usage:
        body["usage"] = None
    return json.dumps(body)


# the arguments the server gives a chat template itself: chat_template_kwargs cannot set them
RENDER_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")


def _messages(body: ChatRequest) -> list[dict]:
    """The messages as the template gets them: every field a message carries (OpenAI's and any
    other), None values dropped (as transformers drops them), ``developer`` taken as ``system``."""
    out = []
    for m in body.messages:
        message = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages: content part of type '{part.type}' is not supported; "
                                        f"this model takes text only", param="messages")
        if m.role == "developer":
            message["role"] = "system"
        out.append(message)
    return out


def _tools(body: ChatRequest):
    """``(tools for the template, forced)`` where ``forced`` is None (``auto``: calls parsed from
    the text), ``"none"``, ``"required"`` or ``("named", name)``."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise APIError(400, 'tool_choice: give "none", "auto", "required" or {"type": "function", "function": '
                                '{"name": ...}}', param="tool_choice")
        if not tools or name not in [t["function"]["name"] for t in tools]:
            raise APIError(400, f"tool_choice names the function '{name}', which is not among the tools",
                           param="tool_choice")
        return tools, ("named", name)
    if choice in ("auto", "required") and not tools:
        raise APIError(400, f"tool_choice '{choice}' needs tools", param="tool_choice")
    return tools, (None if choice == "auto" else choice)


def _forced_schema(tools, forced, body):
    if forced == "required":
        return ("tool_choice", P.required_schema(tools, body.parallel_tool_calls))
    if isinstance(forced, tuple):
        tool = next(t for t in tools if t["function"]["name"] == forced[1])
        return ("tool_choice", tool["function"].get("parameters") or {"type": "object"})
    return None


def _render(server, body: ChatRequest, tools) -> str:
    kwargs = dict(body.chat_template_kwargs or {})
    for name in RENDER_ARGUMENTS:
        if name in kwargs:
            raise APIError(400, f"chat_template_kwargs cannot set '{name}': give it as the request's own field",
                           param="chat_template_kwargs")
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false (the prompt ends inside "
                                "the last message, not at a new turn)", param="continue_final_message")
        if body.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message needs the last message to be the assistant's",
                           param="continue_final_message")
    try:
        return server.template.render(_messages(body), add_generation_prompt=body.add_generation_prompt,
                                      tools=tools, documents=body.documents,
                                      continue_final_message=body.continue_final_message, **kwargs)
    except ChatTemplateError as e:
        raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None


def _message_out(parts: dict, calls, with_reasoning: bool) -> dict:
    content = parts.get("content", "")
    out = {"role": "assistant", "content": (content or None) if calls else content}
    if with_reasoning and "reasoning" in parts:
        out["reasoning_content"] = out["reasoning"] = parts["reasoning"]
    if calls:
        out["tool_calls"] = calls
    return out


async def chat_completions(body: ChatRequest, request: HTTPRequest):
    server = request.app.state.server
    server.admit(body)
    if server.template is None:
        raise APIError(400, "this model has no chat template; start the server with --chat-template FILE to "
                            "give one, or use /v1/completions", param="messages", code="no_chat_template")
    tools, forced = _tools(body)
    text = _render(server, body, tools)
    # (the template writes the special tokens: none added unless asked for, as vLLM does)
    tokens = server.encode(text, special=bool(body.add_special_tokens))
    if len(tokens) == 0:
        raise APIError(400, "the rendered conversation is empty", param="messages")
    stop = H.stops(body)
    n_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    top = (body.top_logprobs or 0) if body.logprobs else 0
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not available when streaming", param="prompt_logprobs")
    reqs = await _requests(server, body, [tokens], n_new, top, stop, field, _forced_schema(tools, forced, body))
    scored = None
    if body.prompt_logprobs is not None:
        scored = (await H.prompt_logprobs(server.runner, [list(map(int, tokens))], body.prompt_logprobs))[0]
    source = server.template.source
    reasoning = P.thinks(source)
    opened = reasoning and text.rstrip().endswith(P.THINK_OPEN)
    fmt = P.tool_format(source) if tools and forced is None else None
    reader_kw = dict(reasoning=reasoning, thinking=opened, tools=fmt,
                     forced=forced if forced not in (None, "none") else None, special=_special(server, body))
    job = H.Job(server.runner, reqs, body.include_stop_str_in_output)
    await job.start()
    rid, created = H.ids("chatcmpl")
    head = {"id": rid, "object": "chat.completion", "created": created, "model": server.name}
    vocab, N = server.vocab, body.n

    def finish(reason, calls):
        return "tool_calls" if calls and not isinstance(forced, tuple) and reason == "stop" else reason

    if not body.stream:
        out = await H.gather(job, request)
        if out is None:
            return None
        choices = [_Choice() for _ in range(N)]
        for _, deltas in out:
            for d in deltas:
                choices[d.sample].add(d)
        listed = []
        for i, c in enumerate(choices):
            reader = P.Reader(**reader_kw)
            parts = reader.feed(c.text, True)
            calls = parts.get("tool_calls")
            listed.append({"index": i, "message": _message_out(parts, calls, body.include_reasoning),
                           "finish_reason": finish(c.finish, calls),
                           "logprobs": _chat_logprobs(vocab, c.tokens, c.logprobs, c.top, top > 0)
                           if body.logprobs else None})
        answer = dict(head, choices=listed, usage=_usage(len(tokens), choices))
        if scored is not None:
            answer["prompt_logprobs"] = _vllm_prompt_logprobs(vocab, list(map(int, tokens)), scored)
        return JSONResponse(answer)

    head = dict(head, object="chat.completion.chunk")
    choices = [_Choice() for _ in range(N)]
    readers = [P.Reader(**reader_kw) for _ in range(N)]
    role = [[{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for i in range(N)]]

    def parts(_, deltas):
        out = []
        for d in deltas:
            c = choices[d.sample]
            c.add(d)
            lp = _chat_logprobs(vocab, d.tokens, d.logprobs, d.top_logprobs or [], top > 0) if body.logprobs else None
            new = readers[d.sample].feed(c.text, d.finish_reason is not None)
            delta = {}
            if "reasoning" in new and body.include_reasoning:
                delta["reasoning_content"] = delta["reasoning"] = new["reasoning"]
            if "content" in new:
                delta["content"] = new["content"]
            if "tool_calls" in new:
                delta["tool_calls"] = [dict(call, index=j) for j, call in enumerate(new["tool_calls"])]
            reason = _finish(d)
            out.append({"index": d.sample, "delta": delta, "logprobs": lp,
                        "finish_reason": None if reason is None else finish(reason, readers[d.sample].calls)})
        return out

    return _event_stream(job, body, head, role, parts, lambda: _usage(len(tokens), choices))
