"""What the two generation endpoints share: a request's fields turned into engine requests, the
engine's deltas gathered or streamed back, and the response bodies of completions and chat in
OpenAI's schema."""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import math
import re
import secrets
import threading
import time
import uuid
import weakref

from jaxdecode.constraints import ConstraintError, compile_choices, compile_json_schema, compile_regex
from jaxdecode.decoding.common import default_settings
from jaxdecode.decoding.params import DEFAULTS, DecodeParams, neutral_controls
from jaxdecode.rules import NEUTRAL, chain, make_rule
from jaxdecode.server.protocol import APIError
from jaxdecode.server.runner import FINISHED, Handle
from jaxdecode.serving.engine import Request

FINISH = {"stop": "stop", "eos": "stop", "length": "length", "abort": "abort"}
# the server's rule layout: every kind a request may set, each with the setting that leaves the logits
# exactly unchanged: the logit controls (allowed_token_ids, bad_words, min_tokens, logit_bias), then
# these in make_rule's order. A request's own chain is this one with parts left out, so every request
# fits every batch (no batch waits to drain for a request with other settings)
LAYOUT = ("repetition_penalty", "frequency_penalty", "presence_penalty", "temperature", "top_k", "top_p",
          "min_p")


def server_layout(V: int):
    return chain(*neutral_controls(V), *make_rule(**_neutral(V)).rules)


def decode_params(body, V: int, defaults: dict | None = None) -> DecodeParams:
    """The :class:`~jaxdecode.decoding.params.DecodeParams` of a request's sampling fields (rule
    settings, greedy, seed, ``n`` samples, stop token ids, ``ignore_eos``, the logit controls); the
    new-token count, stop strings and log-probabilities are each endpoint's. ``defaults``: the model folder's
    ``generation_config.json`` settings (:func:`~jaxdecode.decoding.common.default_settings`),
    which apply to the fields the request leaves out (as vLLM applies them)."""
    top_k = body.top_k
    if top_k is not None and (top_k in (-1, 0) or top_k >= V):
        top_k = V  # "no top-k", set: it wins over a folder's top_k
    asked = {name: getattr(body, name) for name in LAYOUT} | {"top_k": top_k}
    greedy = body.temperature == 0.0
    if greedy:
        asked["temperature"] = None
    settings, greedy = default_settings(_Defaults(defaults), asked, greedy)
    # each setting at its neutral value leaves the logits unchanged: left out of the chain
    neutral = _neutral(V)
    settings = {k: v for k, v in settings.items()
                if k in neutral and v != neutral[k] and not (greedy and k == "temperature")}
    seed = secrets.randbelow(2**31) if body.seed is None else body.seed
    try:
        return DecodeParams(**settings, greedy=greedy, seed=seed, num_samples=body.n,
                            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                            **_controls(body, V))
    except ValueError as e:
        raise APIError(400, str(e), param=_field_named(str(e))) from None


def _controls(body, V: int) -> dict:
    """The logit controls' fields as DecodeParams settings, checked against the vocabulary (a 400
    naming the field). ``logit_bias``'s keys are token ids as strings (JSON's keys); biases beyond
    [-100, 100] are clamped, as vLLM clamps them."""
    out = {}
    if body.logit_bias:
        bias = {}
        for key, value in body.logit_bias.items():
            if not re.fullmatch(r"[0-9]+", str(key)):
                raise APIError(400, f"logit_bias: a key must be a token id, got {key!r}", param="logit_bias")
            if int(key) >= V:
                raise APIError(400, f"logit_bias: the token id {key} is outside the vocabulary [0, {V})",
                               param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or isinstance(value, float) and not math.isfinite(value):
                raise APIError(400, f"logit_bias: the bias of token {key} must be a number, got {value!r}",
                               param="logit_bias")
            bias[int(key)] = value
        out["logit_bias"] = bias
    if body.allowed_token_ids is not None:
        bad = [t for t in body.allowed_token_ids if not 0 <= t < V]
        if bad:
            raise APIError(400, f"allowed_token_ids: the token id {bad[0]} is outside the vocabulary "
                                f"[0, {V})", param="allowed_token_ids")
        out["allowed_token_ids"] = body.allowed_token_ids
    if body.bad_words:
        out["bad_words"] = body.bad_words
    if body.min_tokens:
        if body.stop:
            raise APIError(400, "min_tokens is not supported with stop strings (it holds back the end tokens "
                                "and stop_token_ids only)", param="min_tokens")
        n_new = getattr(body, "max_completion_tokens", None)
        n_new = body.max_tokens if n_new is None else n_new
        if n_new is not None and body.min_tokens > n_new:
            raise APIError(400, f"min_tokens ({body.min_tokens}) must be at most the completion's maximum "
                                f"length ({n_new})", param="min_tokens")
        # (the request's own n, its maximum length, replaces this one in the engine's Request)
        out |= {"min_tokens": body.min_tokens, "n": max(DEFAULTS.n, body.min_tokens)}
    return out


_FIELDS_CHECKED_HERE = ("logit_bias", "allowed_token_ids", "bad_words", "min_tokens", "stop_token_ids")


def _field_named(message: str) -> str | None:
    """The request field a DecodeParams error names first, if it is one of a request's fields."""
    first = re.match(r"[a-z_]+", message)
    return first.group(0) if first and first.group(0) in _FIELDS_CHECKED_HERE else None


def sampling(body, V: int, defaults: dict | None = None) -> dict:
    """The engine :class:`~jaxdecode.serving.Request` keywords of a request's sampling fields:
    ``params``, its :func:`decode_params`."""
    return {"params": decode_params(body, V, defaults)}


def _neutral(V: int) -> dict:
    """Each setting of :data:`LAYOUT` at its neutral value (:data:`jaxdecode.rules.NEUTRAL`)."""
    return {name: V if NEUTRAL[name] == "V" else NEUTRAL[name] for name in LAYOUT}


class _Defaults:  # what default_settings reads: a model's generation_defaults
    def __init__(self, defaults):
        self.generation_defaults = dict(defaults or {})


def stops(body) -> list[str]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "a stop string must not be empty", param="stop")
    return stop


def writable_stops(stops: list[str], vocab) -> list[str]:
    """The stop strings the model can write. One the vocabulary cannot encode (a character outside
    a character model's vocabulary) can never appear in a text: it is dropped, which changes no
    output, instead of refusing the request (OpenAI's API takes any stop string, and clients send
    their usual ones, such as ``"<|im_end|>"`` or ``"###"``)."""
    encode = getattr(vocab, "encode_piece", vocab.encode)
    out = []
    for s in stops:
        try:
            encode(s)
        except ValueError:
            continue
        out.append(s)
    return out


async def constraint(body, vocab, forced: tuple[str, object] | None = None):
    """The request's structured-output constraint, or None: vLLM's ``structured_outputs`` (``json``,
    ``regex``, ``choice``, ``json_object``), OpenAI's ``response_format``, or the older
    ``guided_json``, ``guided_regex`` and ``guided_choice``; at most one of them. ``forced``: a
    ``(field, JSON schema)`` the server itself imposes (a required tool call), which no other
    structured output may accompany. A pattern not compiled before is compiled in a worker thread
    (:func:`compiled`): a large schema takes seconds, and the event loop keeps serving meanwhile."""
    asked = [(name, kind, value) for name, kind, value in (("guided_regex", "regex", body.guided_regex),
                                                            ("guided_choice", "choice", body.guided_choice),
                                                            ("guided_json", "json", body.guided_json))
             if value is not None]
    so = body.structured_outputs
    if so is not None:
        for name, kind, value in (("json", "json", so.json_), ("regex", "regex", so.regex),
                                  ("choice", "choice", so.choice),
                                  ("json_object", "json", {"type": "object"} if so.json_object else None)):
            if value is not None:
                asked.append((f"structured_outputs.{name}", kind, value))
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", "json", {"type": "object"}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        asked.append(("response_format", "json", fmt.json_schema.schema_))
    if forced is not None:
        asked.insert(0, (forced[0], "json", forced[1]))
    if len(asked) > 1:
        raise APIError(400, f"give one structured-output field, got {', '.join(n for n, _, _ in asked)}",
                       param=asked[1][0])
    if not asked:
        return None
    name, kind, value = asked[0]
    if kind == "choice" and not value:
        raise APIError(400, f"{name} needs at least one choice", param=name)
    key = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    try:
        found = cached(kind, key, vocab)
        return found if found is not None else await asyncio.to_thread(compiled, kind, key, vocab)
    except (ConstraintError, ValueError) as e:
        raise APIError(400, f"{name}: {e}", param=name) from None


# Compiled constraints, the most recently used COMPILED_KEEP kept for the requests that ask for the
# same pattern: compiling is the slow part (outlines-core's index over the vocabulary), and the
# engine stacks one table per distinct constraint object, so equal patterns share one. Compiles run
# one at a time (_COMPILING: two would share the machine's cores with the engine, and two requests
# for one new pattern compile it once); the cache's own lock is held only to read or write it, so a
# request whose pattern is cached never waits for another's compile.
COMPILED_KEEP = 64
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()
_COMPILING = threading.Lock()


def cached(kind: str, key: str, vocab):
    """The constraint :func:`compiled` made of ``(kind, key)`` over ``vocab``, if it is kept; else None."""
    with _CACHE_LOCK:
        found = _COMPILED.get((kind, key, vocab))
        if found is not None:
            _COMPILED.move_to_end((kind, key, vocab))
        return found


def compiled(kind: str, key: str, vocab):
    """A compiled constraint of ``kind`` ("regex", "choice" or "json") from ``key`` (the pattern,
    the choices' or the schema's JSON), kept (see above); thread-safe. :func:`spec_of` gives back
    ``(kind, key)``."""
    found = cached(kind, key, vocab)
    if found is not None:
        return found
    with _COMPILING:
        found = cached(kind, key, vocab)  # (compiled while this call waited)
        if found is not None:
            return found
        if kind == "regex":
            c = compile_regex(key, vocab)
        elif kind == "choice":
            c = compile_choices(json.loads(key), vocab)
        else:
            c = compile_json_schema(key, vocab)
        with _CACHE_LOCK:
            _SPECS[c] = (kind, key)
            _COMPILED[(kind, key, vocab)] = c
            while len(_COMPILED) > COMPILED_KEEP:
                _COMPILED.popitem(last=False)
        return c


def spec_of(constraint) -> tuple[str, str]:
    """The ``(kind, key)`` a constraint was :func:`compiled` from."""
    with _CACHE_LOCK:
        return _SPECS[constraint]


def check_window(prompt_len: int, n: int, T: int, field: str):
    if prompt_len + n > T:
        raise APIError(400, f"this model's context window is {T} tokens, but {prompt_len + n} were asked for: "
                            f"{prompt_len} in the prompt and {n} for the completion ({field}); lower {field} "
                            f"or shorten the prompt", param=field, code="context_length_exceeded")


class Job:
    """The engine requests of one HTTP request, their deltas merged into one queue."""

    def __init__(self, runner, requests: list[Request], include_stop: bool):
        self.runner, self.loop = runner, asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handles = [_Tagged(self.loop, self.queue, k) for k in range(len(requests))]
        self.requests = requests
        self.include_stop = include_stop
        self.open = len(requests)
        self.early: list = []  # (k, item) that came while start() waited for the others

    async def start(self):
        """Submit every request and wait until the engine accepted them (an APIError if not). What a
        request streams before the others are accepted (a short one may finish) is kept, in order,
        for :meth:`deltas`."""
        for r, h in zip(self.requests, self.handles):
            self.runner.submit(r, h, self.include_stop)
        answered, error = set(), None
        while len(answered) < len(self.handles):
            k, item = await self.queue.get()
            if isinstance(item, tuple) and item[0] in ("accepted", "error") and k not in answered:
                answered.add(k)
                error = error or (item[1] if item[0] == "error" else None)
            else:
                self.early.append((k, item))
        if error is not None:
            self.abort()
            if isinstance(error, ValueError):  # the engine's message, without its internal request number
                raise APIError(400, re.sub(r"^request \d+: ", "", str(error)))
            raise APIError(500, f"the engine failed to take the request: {type(error).__name__}: {error}")

    async def deltas(self):
        """``(request k, [Delta])`` until every request finished. What has queued up since the last
        turn (the engine ran ahead of this stream) comes merged, one delta per sample: a busy server
        sends fewer, larger chunks instead of falling further behind."""
        while self.open:
            items, self.early = self.early, []
            if not items:
                items.append(await self.queue.get())
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            merged: dict = {}
            for k, item in items:
                if item == FINISHED:
                    self.open -= 1
                elif isinstance(item, tuple) and item[0] == "error":
                    raise APIError(500, f"generation failed: {item[1]}")
                else:
                    for d in item:
                        key = (k, d.sample)
                        merged[key] = d if key not in merged else _merge(merged[key], d)
            by_request: dict = {}
            for (k, _), d in merged.items():
                by_request.setdefault(k, []).append(d)
            for k, ds in by_request.items():
                yield k, ds

    def abort(self):
        for h in self.handles:
            self.runner.abort(h)


def _merge(a, b):
    """Two deltas of one sample, in order, as one."""
    top = None if a.top_logprobs is None and b.top_logprobs is None else \
        (a.top_logprobs or []) + (b.top_logprobs or [])
    return a._replace(text=a.text + b.text, tokens=a.tokens + b.tokens,
                      logprobs=a.logprobs + b.logprobs, top_logprobs=top,
                      finish_reason=b.finish_reason, generated=b.generated)


class _Tagged(Handle):
    def __init__(self, loop, queue, tag):
        self.loop, self.queue, self.tag = loop, queue, tag
        self.index, self.aborted = None, False
        self.key = None

    def deliver(self, item):
        self.queue.put_nowait((self.tag, item))


async def until_disconnected(request) -> None:
    """Returns when the client has gone (the ASGI server's ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def gather(job: Job, request) -> list:
    """Every delta of a non-streamed job, or None (and the job aborted) if the client left first."""
    out = []

    async def collect():
        async for k, deltas in job.deltas():
            out.append((k, deltas))

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        job.abort()
        return None
    work.result()
    return out


def ids(prefix: str) -> tuple[str, int]:
    return f"{prefix}-{uuid.uuid4().hex}", int(time.time())


def token_text(vocab, token: int) -> tuple[str, list[int]]:
    """A token's text alone and its bytes (a byte-level token holding part of a character shows
    U+FFFD in its text; its bytes are exact)."""
    if hasattr(vocab, "token_bytes"):
        b = vocab.token_bytes(token)
        return b.decode("utf-8", errors="replace"), list(b)
    s = vocab.decode([token])
    return s, list(s.encode("utf-8"))


@functools.lru_cache(maxsize=8)
def special_strings(vocab) -> tuple:
    """The strings of a vocabulary's special tokens (those a tokenizer marks special: ``<s>``,
    ``<|im_end|>``, ...), longest first; none for a vocabulary without them."""
    ids = getattr(vocab, "special", ()) or ()
    text = getattr(vocab, "token_text", None)
    if text is None:
        return ()
    return tuple(sorted({text(i) for i in ids} - {""}, key=len, reverse=True))


async def prompt_logprobs(runner, sequences: list, top: int) -> list:
    """The engine's scoring of token sequences (:meth:`~jaxdecode.server.runner.EngineLoop.score`):
    per sequence ``(logprobs, top_logprobs, top_ids, ranks)`` of every token after the first."""
    handle = Handle(asyncio.get_running_loop())
    runner.score(sequences, top, handle)
    item = await handle.queue.get()
    if item[0] == "error":
        e = item[1]
        if isinstance(e, ValueError):
            raise APIError(400, f"the prompt cannot be scored: {e}", param="prompt")
        raise APIError(500, f"scoring the prompt failed: {e}")
    return item[1]
