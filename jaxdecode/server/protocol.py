"""OpenAI's request schema as pydantic models, with vLLM's extra fields under its names, and the
one error type every handler raises (:class:`APIError`, rendered as OpenAI's error JSON).

Fields the server does not implement are declared too, so that a request that sets one is refused
with a 400 naming it (:func:`refuse_unsupported`) instead of being silently ignored; a field nobody
declared is ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any, Literal, Union

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


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _Sampling(BaseModel):
    """The fields completions and chat share: OpenAI's, then vLLM's extras."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # a signed 64-bit integer, as vLLM's
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_json: Union[dict, str, None] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # declared so that setting them is refused by name (see refuse_unsupported)
    logit_bias: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    guided_grammar: str | None = None
    audio: Any = None
    modalities: list | None = None
    prediction: Any = None
    use_beam_search: bool | None = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None


# the fields above that are declared only to be refused, with the value that means "not used"
UNSUPPORTED = {"logit_bias": None, "tools": None, "tool_choice": None, "functions": None, "function_call": None,
               "parallel_tool_calls": None, "best_of": None, "suffix": None, "guided_grammar": None,
               "audio": None, "modalities": None, "prediction": None, "use_beam_search": None}


def refuse_unsupported(request: _Sampling) -> None:
    """A 400 naming the first field set that the server does not implement."""
    for name, unused in UNSUPPORTED.items():
        value = getattr(request, name)
        if value is not None and value != unused and not (name == "best_of" and value == 1) \
                and not (name in ("tools", "functions", "modalities") and value == []) \
                and not (name == "tool_choice" and value == "none") \
                and not (name == "use_beam_search" and value is False):
            raise APIError(400, f"the field '{name}' is not supported by this server", param=name,
                           code="unsupported_field")
