"""OpenAI's request schema as pydantic models, with vLLM's extra fields under its current names,
and the one error type every handler raises (:class:`APIError`, rendered as OpenAI's error JSON).

No field is silently ignored. A field is either honoured, or harmless (metadata that cannot
change the output: :data:`HARMLESS`), or refused with a 400 naming it: the fields declared here
that the server cannot honour (:data:`UNSUPPORTED`, each with the values that mean "not used"),
and any field nobody declared (:func:`refuse_unsupported`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error answered in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # (vLLM's: usage on every chunk; accepted, not sent)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    """A chat message. Every field it carries reaches the chat template (as transformers passes a
    message's keys), so fields beyond OpenAI's are kept, not dropped."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)  # (description, name: metadata)
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of ``json``, ``regex``, ``choice``, ``json_object``
    (``grammar`` and ``structural_tag`` are refused: no engine here compiles them)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    structural_tag: Any = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # (a backend choice: no effect on what is generated here)
    backend: str | None = None  # (likewise)


def _published(schema: dict, cls) -> None:
    """A request's JSON schema as the server takes it: no field beyond the declared ones and
    :data:`HARMLESS` (any other is refused), and each field of :data:`NOT_USED` limited to the values
    that leave it unused."""
    props = schema.setdefault("properties", {})
    for name in sorted(HARMLESS):
        props[name] = {"description": "accepted and not used"}
    chat = cls.__name__ == "ChatRequest"
    for key, values in NOT_USED.items():
        name, _, only = key.partition("@")
        if name in props and (not only or chat):
            props[name] = {"enum": values, "description": "not supported: only the values that leave it unused"}
    schema["additionalProperties"] = False


class _Sampling(BaseModel):
    """The fields completions and chat share: OpenAI's, then vLLM's extras. Unknown fields are kept
    (``extra="allow"``) so that :func:`refuse_unsupported` can name them (the published schema
    forbids them: :func:`_published`)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_published)

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # a signed 64-bit integer, as vLLM's
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None  # end a sample (the token stays in its text, as vLLM)
    structured_outputs: StructuredOutputs | None = None
    guided_regex: str | None = None  # the older names of structured_outputs' regex, choice and json
    guided_choice: list[str] | None = None
    guided_json: dict | str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    add_special_tokens: bool | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict | None = None  # OpenAI's: {"token id": bias}, checked by handlers.decode_params
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    min_tokens: int = Field(default=0, ge=0)
    # declared so that setting them is refused by name (see refuse_unsupported)
    best_of: int | None = None
    suffix: str | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    logprob_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    priority: int = 0


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    prompt_embeds: Any = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")  # (e.g. "strict": reaches the template with the rest)
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: ToolFunction


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    documents: list[dict] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    echo: bool = False
    chat_template: str | None = None
    functions: list | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list | None = None
    prediction: Any = None
    mm_processor_kwargs: Any = None


# Fields that cannot change what is generated: accepted and not used. (A field nobody declared and
# not named here is refused: it may mean something this server does not do.)
HARMLESS = {"user", "metadata", "store", "service_tier", "request_id", "session_id", "cache_salt",
            "prompt_cache_key", "safety_identifier", "kv_transfer_params", "ec_transfer_params",
            "stream_interval", "routed_experts_prompt_start", "return_token_offsets", "return_mm_kwargs",
            "web_search_options"}

# the fields declared above only to be refused, each with the values that mean "not used" (the only
# ones accepted; the OpenAPI document lists them as the field's enum)
NOT_USED: dict[str, list] = {
    "best_of": [None, 1], "suffix": [None, ""], "guided_grammar": [None], "guided_decoding_backend": [None],
    "use_beam_search": [None, False], "length_penalty": [None, 1.0], "spaces_between_special_tokens": [True],
    "truncate_prompt_tokens": [None], "logprob_token_ids": [None], "return_tokens_as_token_ids": [None, False],
    "return_token_ids": [None, False], "logits_processors": [None, [], {}], "vllm_xargs": [None, [], {}],
    "thinking_token_budget": [None, -1], "repetition_detection": [None], "priority": [0],
    "prompt_embeds": [None], "functions": [None, []], "function_call": [None], "audio": [None],
    "modalities": [None, [], ["text"]], "prediction": [None], "mm_processor_kwargs": [None, [], {}],
    "chat_template": [None], "echo@chat": [False],
}


def _not_used(values: list):
    # (by type as well as value: 0 is not False here, nor 1.0 True)
    return lambda v: any(v == u and type(v) is type(u) or v is None is u for u in values)


UNSUPPORTED = {key: _not_used(values) for key, values in NOT_USED.items()}
WHY = {"chat_template": "a template given in the request is not run; start the server with --chat-template",
       "functions": "use tools", "function_call": "use tool_choice",
       "echo@chat": "echo on chat completions is not supported"}


def refuse_unsupported(request: _Sampling) -> None:
    """A 400 naming the first field set that the server does not implement: a declared one set to
    a value that would change the output, or one it does not know at all."""
    chat = isinstance(request, ChatRequest)
    for key, unused in UNSUPPORTED.items():
        name, _, only = key.partition("@")
        if only == "chat" and not chat or not hasattr(request, name):
            continue
        if not unused(getattr(request, name)):
            why = WHY.get(key, "")
            raise APIError(400, f"the field '{name}' is not supported by this server" + (f" ({why})" if why else ""),
                           param=name, code="unsupported_field")
    for name in (request.model_extra or {}):
        if name not in HARMLESS:
            raise APIError(400, f"the field '{name}' is not supported by this server (an unknown field is refused, "
                                f"not ignored: it could change the answer)", param=name, code="unsupported_field")
    so = request.structured_outputs
    if so is not None:
        for name in ("grammar", "structural_tag", "whitespace_pattern"):
            if getattr(so, name) is not None:
                raise APIError(400, f"structured_outputs.{name} is not supported by this server (json, regex, "
                                    f"choice and json_object are)", param=f"structured_outputs.{name}",
                               code="unsupported_field")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if getattr(so, name):
                raise APIError(400, f"structured_outputs.{name} is not supported by this server",
                               param=f"structured_outputs.{name}", code="unsupported_field")


# ----------------------------------------------------------------------------- the published answers
# The response bodies as the OpenAPI document at /openapi.json describes them (the routes build
# their bodies as plain dicts; these models are the schema they are checked against, by
# tests/server/test_openapi_fuzz.py). Fields a choice may leave out have defaults.


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error JSON: every 4xx and 5xx answer of every route."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: null for the first token, then {token id: its entry} per token
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: CompletionLogprobs | None
    prompt_logprobs: PromptLogprobs | None = None


class Completion(BaseModel):
    """``POST /v1/completions``' answer (``stream: true``: ``text/event-stream`` chunks instead)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    bytes: list[int]
    logprob: float


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    logprobs: ChatLogprobs | None


class ChatCompletion(BaseModel):
    """``POST /v1/chat/completions``' answer (``stream: true``: ``text/event-stream`` chunks instead)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


# a streamed answer's chunks (text/event-stream: each event's data one chunk's JSON, then [DONE])


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]  # (none in the usage chunk)
    usage: Usage | None = None


class ToolCallDelta(ToolCall):
    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ----------------------------------------------------------------------------- the routes' answers, documented

ERRORS = {400: "the request is invalid: one line names the problem", 401: "missing or wrong API key",
          404: "no such model", 413: "the body is larger than the server's limit", 429: "the queue is full",
          500: "an internal error", 501: "not offered by this server",
          503: "the server is shutting down, or its engine is not running"}


COMPONENTS: set = {ErrorResponse}  # the models the document names by reference, not through a route's model


def _ref(model) -> dict:
    COMPONENTS.add(model)
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def documented(ok, *errors: int, stream=None) -> dict:
    """A route's answers for the OpenAPI document: 200 with the model ``ok`` (None: the route's own
    response class says), and each error status of ``errors`` with OpenAI's error JSON. Every
    route may answer 500 (an unexpected error, caught) and 503 (while the server drains).
    ``stream``: the model of a chunk, where ``stream: true`` answers with server-sent events (each
    event's data a chunk's JSON, or an error's where the engine failed mid-stream, then [DONE])."""
    out: dict = {200: {"description": "the answer"}}
    if ok is not None:
        out[200]["model"] = ok
    if stream is not None:
        out[200]["content"] = {"text/event-stream": {"schema": {
            "type": "object", "required": ["data"], "description": "one server-sent event",
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, {
                "type": "string", "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [_ref(stream), _ref(ErrorResponse)]}}]}}}}}
    for status in sorted({*errors, 500, 503}):  # (JSON whatever the route's own response class: /metrics')
        out[status] = {"description": ERRORS[status], "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
    return out
