"""The OpenAI-compatible HTTP server: FastAPI routes over an :class:`EngineRunner` (``docs/server.md``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics``. Every error is OpenAI's error JSON (:class:`~jaxdecode.server.protocol.APIError`),
and the server keeps serving after it.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import HTTPException as FastAPIHTTPException, RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from jaxdecode.server.metrics import Metrics
from jaxdecode.server.protocol import (COMPONENTS, APIError, ChatCompletion, ChatCompletionChunk, Completion,
                                       CompletionChunk, Health, ModelList, documented, refuse_unsupported)
from jaxdecode.server.runner import EngineRunner, Stats

log = logging.getLogger("jaxdecode.server")
MAX_BODY = 4 << 20  # bytes
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def _endpoint(path: str) -> str:
    """The metrics' endpoint label: one of ENDPOINTS, or "other" (a label per unknown path would
    let any client grow the metrics without bound)."""
    return path if path in ENDPOINTS else "other"


class Server:
    """The state the routes share: the model's vocabulary, the engine's runner, the chat template,
    limits. ``engine``: an engine to drive from a thread of this process (:class:`EngineRunner`);
    or ``runner``: a launched runner of another kind (:class:`jaxdecode.server.core.ProcessRunner`)."""

    def __init__(self, vocab, engine=None, *, runner=None, model_name: str, api_key: str | None = None,
                 chat_template=None, max_waiting: int | None = None, defaults: dict | None = None):
        self.vocab, self.name = vocab, model_name
        # the folder's generation_config.json settings, for the fields a request leaves out
        self.defaults = dict(defaults or {})
        self.api_key, self.template, self.max_waiting = api_key, chat_template, max_waiting
        self.metrics = Metrics()
        if runner is None:
            runner = EngineRunner(engine, self.metrics)
        runner.metrics = self.metrics
        # the pool as the engine starts: /metrics shows it before the engine's first turn reports it
        self.metrics.add(Stats(blocks=getattr(runner, "blocks_at_start", (0, 0))), 0)
        self.runner = runner
        self.draining = False
        self.T, self.V = (engine.T, engine.V) if engine is not None else (runner.T, runner.V)

    # --- checks every generation request passes
    def admit(self, body):
        if body.model is not None and body.model != self.name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")
        refuse_unsupported(body)
        if not self.runner.alive:
            raise APIError(503, "the engine is not running; see the server's log")
        if self.max_waiting is not None and self.runner.waiting + self.runner.queued >= self.max_waiting:
            raise APIError(429, f"the server's queue is full ({self.max_waiting} waiting); retry shortly",
                           headers={"Retry-After": "1"})

    def encode(self, text: str, special: bool = True):
        vocab = self.vocab
        try:
            if not special and hasattr(vocab, "subword"):
                return vocab.encode(text, add_special_tokens=False)
            return vocab.encode(text)
        except ValueError as e:
            raise APIError(400, f"the prompt cannot be encoded: {e}", param="prompt") from None


def build_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.runner.start()
        yield
        server.runner.stop()

    # (not FastAPI's max_body_size: its 413 is plain text, and it replaces the app's own answer)
    app = FastAPI(title="jaxdecode", lifespan=lifespan)
    app.router.route_class = _Route  # (before any route is added: the request bodies every route reads)
    app.state.server = server
    # the gate outside the body limit: it counts the 413s too
    app.add_middleware(_BodyLimit, limit=MAX_BODY)
    app.add_middleware(_Gate, server=server)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        else:
            message = f"{'.'.join(loc) or 'body'}: {err.get('msg')}"
            if "input" in err and err.get("type") != "missing":
                message += f" (got {json.dumps(err['input'], default=str)[:100]})"
        param = None if err.get("type") == "json_invalid" else ".".join(loc) or None
        return _error(APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        status = e.status_code
        if status == 413:
            return _error(_too_large())
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed here"}.get(
            status, str(e.detail))
        return _error(APIError(status, message))

    @app.exception_handler(Exception)
    async def crashed(request, e: Exception):
        log.exception("unexpected error")
        server.metrics.requests.labels(_endpoint(request.url.path), "500").inc()
        return _error(APIError(500, f"internal error: {type(e).__name__}: {e}"))

    @app.get("/health", responses=documented(Health, 503))
    async def health():
        if not server.runner.alive:
            raise APIError(503, "the engine thread is not running")
        return {"status": "ok"}

    @app.get("/v1/models", responses=documented(ModelList, 401))
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": 0,
                                            "owned_by": "jaxdecode", "max_model_len": server.T}]}

    @app.get("/metrics", response_class=PlainTextResponse, responses=documented(None))
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    from jaxdecode.server.routes import chat_completions, completions  # the two generation endpoints

    generation = (400, 401, 404, 413, 429)  # (404: a model this server does not serve)
    app.post("/v1/completions", responses=documented(Completion, *generation, stream=CompletionChunk))(completions)
    app.post("/v1/chat/completions", responses=documented(ChatCompletion, *generation, stream=ChatCompletionChunk))(
        chat_completions)
    from jaxdecode.server.explore import add_explorer  # the explorer: its page at / and /explore/...

    add_explorer(app, getattr(server, "explorer", None), api_key=server.api_key)
    app.openapi = functools.partial(_openapi, app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's OpenAPI document without its 422 answers: a request that fails validation is
    answered 400 with OpenAI's error JSON (the handler of RequestValidationError), never 422."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        models = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            models.pop(name, None)
        for model in sorted(COMPONENTS, key=lambda m: m.__name__):
            published = model.model_json_schema(ref_template="#/components/schemas/{model}")
            models.update(published.pop("$defs", {}), **{model.__name__: published})
        app.openapi_schema = schema
    return app.openapi_schema


class _Gate:
    """In front of every route: 503 while the server drains, 401 without the API key; every answer
    counted by endpoint and status. Plain ASGI (Starlette's ``BaseHTTPMiddleware`` would pass each
    streamed chunk through a task and a memory stream of its own)."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        server, path = self.server, scope["path"]
        refused = None
        if server.draining:
            refused = APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        elif server.api_key and path.startswith("/v1/") and not hmac.compare_digest(
                Headers(scope=scope).get("authorization", "").encode(), f"Bearer {server.api_key}".encode()):
            refused = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        status = None

        async def counted(message):
            nonlocal status
            if status is None and message["type"] == "http.response.start":
                status = message["status"]
                server.metrics.requests.labels(_endpoint(path), str(status)).inc()
            await send(message)

        if refused is not None:
            return await _error(refused)(scope, receive, counted)
        await self.app(scope, receive, counted)


def parse_body(body: bytes):
    """A request body's JSON, or a :class:`json.JSONDecodeError` (a ValueError) naming the problem:
    bytes that are not text, nesting deeper than the parser's recursion allows, or a string with a
    lone surrogate (``"\\ud800"``: valid JSON syntax, but no character, and no tokenizer or
    library below takes it)."""
    try:
        value = json.loads(body)
    except UnicodeDecodeError as e:
        raise json.JSONDecodeError(f"the body is not UTF-8 text ({e.reason} at byte {e.start})", "", 0) from None
    except RecursionError:
        raise json.JSONDecodeError("the body nests arrays or objects too deeply", "", 0) from None
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise json.JSONDecodeError(f"a string holds the lone surrogate \\u{ord(v[e.start]):04x}, which is "
                                           f"not a character", "", 0) from None
        elif isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return value


class _Request(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            self._json = parse_body(await self.body())
        return self._json


class _Route(APIRoute):
    """Every route reads its JSON body through :func:`parse_body`."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request):
            return await handler(_Request(request.scope, request.receive))

        return route


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _TooLarge(FastAPIHTTPException):  # (FastAPI passes its own kind on from a body it reads)
    def __init__(self):
        super().__init__(413)


class _BodyLimit:
    """A 413 in OpenAI's error format for a request body over ``limit`` bytes: at once when its
    Content-Length says so, else (a chunked body) as soon as the bytes read pass the limit."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            return await _error(_too_large())(scope, receive, send)
        read = 0

        async def limited():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.limit:
                    raise _TooLarge()  # answered by the app's handler of HTTPException (413)
            return message

        await self.app(scope, limited, send)


def _too_large() -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {MAX_BODY} bytes")
