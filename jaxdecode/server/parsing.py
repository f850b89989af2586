"""What a chat answer's text holds besides its content: the reasoning a thinking model writes
between ``<think>`` and ``</think>``, the tool calls a model writes in its template's format, and
special tokens' text (left out unless ``skip_special_tokens`` is false).

:class:`Reader` takes a choice's whole text so far, each time it grows, and says what is new in
each part; a streamed answer sends those parts as deltas, a whole one reads them once at the end.
Text that could still turn into a marker (``"<tool_"`` before ``"call>"``) is held back until it
is known not to, so the parts it hands out never change afterwards.

Tool-call formats (:data:`PARSERS`), chosen from the chat template (:func:`tool_format`):

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, content before the first block;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``;
- ``llama3``: the whole answer one JSON object ``{"name", "parameters"}`` (or several separated by
  ``;``), optionally after ``<|python_tag|>``.

A call whose JSON does not parse is not a call: the text stays content, as vLLM's parsers do.
"""

from __future__ import annotations

import json
import secrets

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
PARSERS = ("hermes", "mistral", "llama3")


def tool_format(template_source: str | None) -> str:
    """The tool-call format a chat template's model writes: ``mistral`` if the template writes
    ``[TOOL_CALLS]``, ``llama3`` if it speaks of ``<|python_tag|>`` or the ``ipython`` role,
    else ``hermes``."""
    src = template_source or ""
    if MISTRAL_MARK in src:
        return "mistral"
    if PYTHON_TAG in src or "ipython" in src:
        return "llama3"
    return "hermes"


def thinks(template_source: str | None) -> bool:
    """Whether the template's model writes its reasoning between ``<think>`` and ``</think>``."""
    return THINK_CLOSE in (template_source or "")


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call(name, arguments) -> dict | None:
    """One call in OpenAI's shape, or None if it is not a call (no name, arguments not an object)."""
    if not isinstance(name, str) or not name:
        return None
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_calls(text: str, fmt: str) -> tuple[str, list[dict]] | None:
    """``(content before the calls, calls)`` of a whole answer in format ``fmt``, or None when
    it holds no well-formed call."""
    if fmt == "hermes":
        start = text.find(HERMES_OPEN)
        if start < 0:
            return None
        calls, at = [], start
        while True:
            at = text.find(HERMES_OPEN, at)
            if at < 0:
                break
            end = text.find(HERMES_CLOSE, at)
            body = text[at + len(HERMES_OPEN):] if end < 0 else text[at + len(HERMES_OPEN):end]
            try:
                obj = json.loads(body)
            except ValueError:
                return None
            call = _call(obj.get("name"), obj.get("arguments")) if isinstance(obj, dict) else None
            if call is None:
                return None
            calls.append(call)
            if end < 0:
                break
            at = end + len(HERMES_CLOSE)
        return text[:start], calls
    if fmt == "mistral":
        start = text.find(MISTRAL_MARK)
        if start < 0:
            return None
        try:
            objs = json.loads(text[start + len(MISTRAL_MARK):])
        except ValueError:
            return None
        objs = objs if isinstance(objs, list) else [objs]
        calls = [_call(o.get("name"), o.get("arguments")) if isinstance(o, dict) else None for o in objs]
        return (text[:start], calls) if calls and None not in calls else None
    if fmt == "llama3":
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].strip()
        if not body.startswith("{"):
            return None
        calls = []
        for piece in body.split(";"):
            try:
                obj = json.loads(piece)
            except ValueError:
                return None
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            call = _call(obj.get("name"), args) if isinstance(obj, dict) else None
            if call is None:
                return None
            calls.append(call)
        return "", calls
    raise ValueError(f"unknown tool-call format {fmt!r}: use one of {', '.join(PARSERS)}")


def forced_calls(text: str, named: str | None) -> list[dict] | None:
    """The calls of an answer generated under a tool's schema: with ``named``, the arguments of
    that function; else (``tool_choice: required``) a JSON list of ``{"name", "parameters"}``.
    None if it does not parse (it ran out of tokens)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if named is not None:
        call = _call(named, obj)
        return None if call is None else [call]
    if not isinstance(obj, list) or not obj:
        return None
    calls = [_call(o.get("name"), o.get("parameters")) if isinstance(o, dict) else None for o in obj]
    return None if None in calls else calls


def required_schema(tools: list[dict], parallel: bool | None) -> dict:
    """The JSON schema of ``tool_choice: required``: a list of one call or more (one at most with
    ``parallel`` false), each ``{"name": one tool's name, "parameters": its parameters}``."""
    options = [{"type": "object",
                "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                               "parameters": t["function"].get("parameters") or {"type": "object"}},
                "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1,
              "items": options[0] if len(options) == 1 else {"anyOf": options}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def _pending(text: str, markers) -> int:
    """How many characters at the end of ``text`` could begin a marker (held back)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class Reader:
    """One choice's text, split as it grows (see the module docstring).

    ``reasoning``: the model writes ``<think>…</think>``; ``thinking``: the prompt already opened
    it (the answer starts inside the reasoning). ``tools``: the format to find calls in, or None.
    ``forced``: the answer is one call's JSON (``"required"``, or ``("named", name)``), sent
    whole at the end. ``special``: special tokens' strings to leave out of the text."""

    def __init__(self, *, reasoning=False, thinking=False, tools=None, forced=None, special=()):
        self.reasoning, self.tools, self.forced = reasoning, tools, forced
        self.special = tuple(s for s in special if s)
        self.sent = {"reasoning": 0, "content": 0}
        self.in_think = thinking
        self.calls: list[dict] = []
        self.content_raw = ""

    def _clean(self, text: str) -> str:
        for s in self.special:
            text = text.replace(s, "")
        return text

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """``(reasoning, answer)`` of the whole text so far, the answer not yet cut at tool calls."""
        if not self.reasoning:
            return "", text
        body = text
        if not self.in_think:
            lead = len(body) - len(body.lstrip())
            if body[lead:].startswith(THINK_OPEN):
                body = body[lead + len(THINK_OPEN):]
            elif not final and THINK_OPEN.startswith(body[lead:]) and body[lead:]:
                return "", ""  # may still open
            else:
                return "", text
        end = body.find(THINK_CLOSE)
        if end < 0:
            return body, ""
        return body[:end], body[end + len(THINK_CLOSE):]

    def feed(self, text: str, final: bool) -> dict:
        """What is new since the last call: ``{"reasoning": str, "content": str, "tool_calls":
        [calls]}`` (parts with nothing new left out). ``final``: the text is whole."""
        reasoning, answer = self.split(text, final)
        if self.reasoning and THINK_CLOSE not in text and reasoning and not final:
            reasoning = reasoning[:len(reasoning) - _pending(reasoning, (THINK_CLOSE, *self.special))]
        content, calls = answer, []
        if self.forced is not None:
            content = ""
            if final:
                named = self.forced[1] if isinstance(self.forced, tuple) else None
                calls = forced_calls(answer, named)
                if calls is None:  # not a whole call (it ran out of tokens): the text as content
                    content, calls = answer, []
        elif self.tools is not None:
            first = {"hermes": HERMES_OPEN, "mistral": MISTRAL_MARK, "llama3": None}[self.tools]
            if self.tools == "llama3":
                stripped = answer.lstrip()
                if stripped.startswith("{") or stripped.startswith(PYTHON_TAG) or (
                        not final and PYTHON_TAG.startswith(stripped)):
                    content = ""  # possibly a call: known at the end
                    if final:
                        parsed = parse_calls(answer, "llama3")
                        content, calls = (answer, []) if parsed is None else parsed
            elif first in answer:
                content = answer[:answer.find(first)]
                if final:
                    parsed = parse_calls(answer, self.tools)
                    content, calls = (answer, []) if parsed is None else parsed
            elif not final:
                content = answer[:len(answer) - _pending(answer, (first,))]
        if not final:
            content = content[:len(content) - _pending(content, self.special)]
        out = {}
        for part, value in (("reasoning", self._clean(reasoning)), ("content", self._clean(content))):
            if len(value) > self.sent[part]:
                out[part] = value[self.sent[part]:]
                self.sent[part] = len(value)
        if calls:
            self.calls = calls
            out["tool_calls"] = calls
        return out
