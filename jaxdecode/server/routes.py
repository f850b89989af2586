"""``POST /v1/completions`` and ``POST /v1/chat/completions``: a request's fields turned into engine
requests (:mod:`jaxdecode.server.handlers`), their outputs as OpenAI's response or its stream of
chunks. A client that leaves, streaming or not, has its requests aborted in the engine."""

from __future__ import annotations

import json

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from jaxdecode.serving.engine import Request
from jaxdecode.server import handlers as H
from jaxdecode.server.chat import ChatTemplateError
from jaxdecode.server.protocol import APIError, ChatRequest, CompletionRequest


def _requests(server, body, prompts, n_new, top, stop, field) -> list[Request]:
    settings = H.sampling(body, server.V, server.defaults)
    constraint = H.constraint(body, server.vocab)
    stop = H.writable_stops(stop, server.vocab)
    out = []
    for tokens in prompts:
        n = server.T - len(tokens) if n_new is None else n_new
        H.check_window(len(tokens), n, server.T, field)
        extra = {} if constraint is None else {"constraint": constraint}
        out.append(Request(list(map(int, tokens)), n, num_samples=body.n, stop=stop or None, top_logprobs=top,
                           ignore_eos=body.ignore_eos, **settings, **extra))
    return out


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
    strings = [H.token_text(vocab, t)[0] for t in tokens]
    offsets, at = [], offset0
    for s in strings:
        offsets.append(at)
        at += len(s)
    tops = None
    if with_top:
        tops = [{H.token_text(vocab, i)[0]: lp for i, lp in pairs} for pairs in top]
    return {"tokens": strings, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


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


async def completions(body: CompletionRequest, request: HTTPRequest):
    server = request.app.state.server
    server.admit(body)
    p = body.prompt
    if isinstance(p, str) or (p and isinstance(p[0], str)):
        texts = [p] if isinstance(p, str) else list(p)
        if any(not t for t in texts):
            raise APIError(400, "prompt: a prompt must not be empty", param="prompt")
        prompts = [server.encode(t) for t in texts]
    else:
        prompts = [p] if p and isinstance(p[0], int) else list(p)
        if not prompts or any(len(q) == 0 for q in prompts):
            raise APIError(400, "prompt: a prompt must hold at least one token", param="prompt")
        texts = [server.vocab.decode([t for t in q if 0 <= t < server.V]) for q in prompts]
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs (the prompt's log-probabilities) is not supported", param="echo")
    stop = H.stops(body)
    top = body.logprobs or 0
    reqs = _requests(server, body, prompts, body.max_tokens, top, stop, "max_tokens")
    job = H.Job(server.runner, reqs, body.include_stop_str_in_output)
    await job.start()
    rid, created = H.ids("cmpl")
    prompt_tokens = sum(len(q) for q in prompts)
    head = {"id": rid, "object": "text_completion", "created": created, "model": server.name}
    N = body.n
    vocab = server.vocab

    if not body.stream:
        out = await H.gather(job, request)
        if out is None:
            return None
        choices = [_Choice() for _ in range(len(reqs) * N)]
        for k, deltas in out:
            for d in deltas:
                choices[k * N + d.sample].add(d)
        body_out = dict(head, choices=[
            {"index": i, "text": (texts[i // N] if body.echo else "") + c.text, "finish_reason": c.finish,
             "logprobs": None if body.logprobs is None else _completion_logprobs(
                 vocab, c.tokens, c.logprobs, c.top, 0, True)}
            for i, c in enumerate(choices)], usage=_usage(prompt_tokens, choices))
        return JSONResponse(body_out)  # (a dict would go through FastAPI's jsonable_encoder first)

    choices = [_Choice() for _ in range(len(reqs) * N)]
    offsets = [0] * len(choices)
    echo = [[{"index": i, "text": texts[i // N], "logprobs": None, "finish_reason": None}]
            for i in range(len(choices))] if body.echo else []

    def parts(k, deltas):
        out = []
        for d in deltas:
            i = k * N + d.sample
            choices[i].add(d)
            lp = None
            if body.logprobs is not None:
                lp = _completion_logprobs(vocab, d.tokens, d.logprobs, d.top_logprobs or [], offsets[i], True)
                offsets[i] += len(d.text)
            out.append({"index": i, "text": d.text, "logprobs": lp, "finish_reason": _finish(d)})
        return out

    return _event_stream(job, body, head, echo, parts, lambda: _usage(prompt_tokens, choices))


def _finish(d):
    return None if d.finish_reason is None else H.FINISH[d.finish_reason]


def _event_stream(job, body, head, first: list, parts, usage) -> EventSourceResponse:
    """A streamed answer: the ``first`` chunks, then one chunk per batch of deltas (``parts(k,
    deltas)`` gives its choices), a usage chunk if asked for (``usage()``), then ``[DONE]``. A
    client that leaves before the end aborts the job."""
    with_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events():
        finished = False
        try:
            for chunk in first:
                yield _chunk(head, chunk, with_usage)
            try:
                async for k, deltas in job.deltas():
                    yield _chunk(head, parts(k, deltas), with_usage)
            except APIError as e:  # the engine failed mid-stream: the error as the stream's last event
                yield json.dumps(e.body())
                yield "[DONE]"
                finished = True
                return
            if with_usage:
                yield json.dumps(dict(head, choices=[], usage=usage()))
            yield "[DONE]"
            finished = True
        finally:
            if not finished:
                job.abort()

    return EventSourceResponse(events(), sep="\n")


def _chunk(head, parts, with_usage) -> str:
    body = dict(head, choices=parts)
    if with_usage:
        body["usage"] = None
    return json.dumps(body)


def _messages(body: ChatRequest) -> list[dict]:
    out = []
    for m in body.messages:
        content = m.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages: content part of type '{part.type}' is not supported; "
                                        f"this model takes text only", param="messages")
            content = [{"type": "text", "text": part.text} for part in content]
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": "" if content is None else content})
    return out


async def chat_completions(body: ChatRequest, request: HTTPRequest):
    server = request.app.state.server
    server.admit(body)
    if server.template is None:
        raise APIError(400, "this model has no chat template; start the server with --chat-template FILE to "
                            "give one, or use /v1/completions", param="messages", code="no_chat_template")
    try:
        text = server.template.render(_messages(body), add_generation_prompt=body.add_generation_prompt,
                                      **(body.chat_template_kwargs or {}))
    except ChatTemplateError as e:
        raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None
    tokens = server.encode(text, special=False)
    if len(tokens) == 0:
        raise APIError(400, "the rendered conversation is empty", param="messages")
    stop = H.stops(body)
    n_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    top = (body.top_logprobs or 0) if body.logprobs else 0
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    reqs = _requests(server, body, [tokens], n_new, top, stop, field)
    job = H.Job(server.runner, reqs, body.include_stop_str_in_output)
    await job.start()
    rid, created = H.ids("chatcmpl")
    head = {"id": rid, "object": "chat.completion", "created": created, "model": server.name}
    vocab, N = server.vocab, body.n

    if not body.stream:
        out = await H.gather(job, request)
        if out is None:
            return None
        choices = [_Choice() for _ in range(N)]
        for _, deltas in out:
            for d in deltas:
                choices[d.sample].add(d)
        return JSONResponse(dict(head, choices=[
            {"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish,
             "logprobs": _chat_logprobs(vocab, c.tokens, c.logprobs, c.top, top > 0) if body.logprobs else None}
            for i, c in enumerate(choices)], usage=_usage(len(tokens), choices)))

    head = dict(head, object="chat.completion.chunk")
    choices = [_Choice() for _ in range(N)]
    role = [[{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for i in range(N)]]

    def parts(_, deltas):
        out = []
        for d in deltas:
            choices[d.sample].add(d)
            lp = _chat_logprobs(vocab, d.tokens, d.logprobs, d.top_logprobs or [], top > 0) if body.logprobs else None
            out.append({"index": d.sample, "delta": {"content": d.text} if d.text else {}, "logprobs": lp,
                        "finish_reason": _finish(d)})
        return out

    return _event_stream(job, body, head, role, parts, lambda: _usage(len(tokens), choices))
