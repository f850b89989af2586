"""Chat templates: turn a list of chat messages into the prompt string a model was trained on.

A Hugging Face model folder ships its prompt format as a Jinja template (``chat_template.jinja``, or
the ``chat_template`` entry of ``tokenizer_config.json``). Clients of an OpenAI-compatible server
send messages, not prompts, so the server has to render that template, and render it exactly as
``transformers``' ``tokenizer.apply_chat_template(messages, tokenize=False)`` does: one stray
newline or missing space and the model sees a prompt it was never trained on.

This module reproduces the environment ``transformers`` (``utils/chat_template_utils.py``) renders
templates in, setting for setting: a sandboxed, immutable Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` block tag, its own
``tojson`` filter (no HTML escaping, non-ASCII kept), the globals ``raise_exception``,
``strftime_now``, a restricted ``dict`` and ``namespace``, and the same render arguments
(``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the special-token strings, then
any extra keyword). ``tests/server/test_chat_template.py`` holds it to byte equality with ``transformers``
on real templates.

Templates come from model repositories, so they are untrusted code: the sandbox refuses attribute
access that could reach Python internals, and every failure (a syntax error, the template's own
``raise_exception``, an unsafe operation, an undefined variable) comes out as one
:class:`ChatTemplateError` with a one-sentence message, which a server can return as a 400.

Imports only the standard library and jinja2.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "detect_content_format", "NO_CHAT_TEMPLATE", "ROLES", "SPECIAL_TOKEN_NAMES", "CONTENT_FORMATS",
           "load_chat_template", "require_chat_template", "special_tokens_from_config"]

ROLES = ("system", "user", "assistant", "tool")
"""The message roles :meth:`ChatTemplate.render` accepts."""

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
"""The named special tokens ``transformers`` always passes to a template when the tokenizer sets
them; any other ``*_token`` string of ``tokenizer_config.json`` is passed too (see
:func:`special_tokens_from_config`)."""

NO_CHAT_TEMPLATE = "the model has no chat template: give one with --chat-template FILE"

CONTENT_FORMATS = ("string", "openai", "auto")

# Older jinja2 releases have known sandbox escapes; transformers refuses them for the same reason.
_MIN_JINJA = (3, 1, 6)

# The names a reasoning trace may come under; transformers copies it to "thinking" and
# "reasoning_content" so that templates reading either one see it.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# what marks the end of the message to continue (continue_final_message), as transformers marks it
_CONTINUE = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A chat template that cannot be loaded or rendered, or messages it cannot take. The message
    is one sentence meant for the client or the command line (a template's own
    ``raise_exception`` text is passed through unchanged)."""


# ----------------------------------------------------------------------------- the environment


class _GenerationBlock(jinja2.ext.Extension):
    """The ``{% generation %} ... {% endgeneration %}`` tag of transformers' templates.

    transformers uses it to find the assistant's tokens for training masks; for rendering, the
    block is its body, unchanged. Without the extension a template using the tag would not parse.
    """

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message):
    """The ``raise_exception(message)`` global: the template refuses the conversation."""
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """The ``tojson`` filter as transformers defines it: plain ``json.dumps`` (Jinja's own filter
    escapes ``<``, ``>``, ``&`` and ``'`` for HTML, which would change the prompt), with its
    ``indent``, ``separators`` and ``sort_keys`` options and non-ASCII text kept as is."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    """The ``strftime_now(format)`` global: the local time now, as some templates date the prompt."""
    return datetime.now().strftime(format)


class _TemplateDict:
    """The ``dict`` global: builds dicts, but is not the ``dict`` type itself, so a template cannot
    reach the type's attributes through it."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """The ``namespace`` global: Jinja's namespace, refusing attribute names that start with an
    underscore, which could shadow Python internals."""

    def __init__(*args, **kwargs):
        # Namespace's own signature trick, so that namespace(self=...) still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not store the underscore-prefixed attribute {name!r} on a namespace")


def _check_jinja_version() -> None:
    parts = []
    for piece in jinja2.__version__.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    if tuple(parts) < _MIN_JINJA:
        need = ".".join(map(str, _MIN_JINJA))
        raise ChatTemplateError(f"jinja2 {jinja2.__version__} has known sandbox escapes: chat templates "
                                f"need jinja2>={need} (pip install -U jinja2)")


def _environment() -> ImmutableSandboxedEnvironment:
    """A fresh environment configured like transformers' ``_compile_jinja_template``."""
    _check_jinja_version()
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _file_names(origin: str) -> str:
    """``origin`` with each path in it cut to its file's name (``chat template chat_template.jinja``)."""
    return " ".join(Path(word).name if "/" in word or "\\" in word else word for word in origin.split(" "))


def _failure(exc: BaseException, origin: str) -> ChatTemplateError:
    """One sentence for an exception raised while rendering the template from ``origin``."""
    if isinstance(exc, jinja2.exceptions.SecurityError):
        return ChatTemplateError(f"the {origin} tried an operation the sandbox forbids: {exc}")
    if isinstance(exc, jinja2.exceptions.TemplateError):
        return ChatTemplateError(f"the {origin} failed: {exc}")
    return ChatTemplateError(f"the {origin} failed on these messages: {type(exc).__name__}: {exc}")


# ----------------------------------------------------------------------------- messages


def _plain(value: Any, where: str) -> Any:
    """A fresh copy of ``value`` made of JSON types only (dict, list, tuple, str, int, float, bool,
    None); subclasses of str, int or float are reduced to the base type, so that a template sees
    no method beyond those of plain data. Anything else is refused."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v, where) for v in value)
    raise ChatTemplateError(f"{where} holds a value of type {type(value).__name__}: only JSON data "
                            "(objects, arrays, strings, numbers, booleans, null) can go to a chat template")


def _text_parts(parts: Sequence, where: str) -> list[str]:
    """The texts of a list of OpenAI content parts, refusing anything but ``{"type": "text"}``."""
    texts = []
    for j, part in enumerate(parts, 1):
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"{where}, content part {j}, is not an object: content parts look like "
                                    '{"type": "text", "text": "..."}')
        kind = part.get("type")
        if kind != "text":
            raise ChatTemplateError(f"{where}, content part {j}, is of type {kind!r}: only text parts are "
                                    "supported")
        if not isinstance(part.get("text"), str):
            raise ChatTemplateError(f'{where}, content part {j}, has no "text" string')
        texts.append(part["text"])
    return texts


def _message(message: Any, i: int, content_format: str) -> dict:
    """One message as the template will see it (see :meth:`ChatTemplate.render`)."""
    where = f"message {i}"
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"{where} is a {type(message).__name__}, not an object with a role and "
                                "content")
    role = message.get("role")
    if role not in ROLES:
        if role is None:
            raise ChatTemplateError(f'{where} has no "role": use one of {", ".join(ROLES)}')
        raise ChatTemplateError(f"{where} has the role {role!r}: use one of {', '.join(ROLES)}")
    where = f"message {i} ({role})"
    # like transformers, keys set to None are dropped: many templates treat a missing key well and
    # a None one badly (e.g. rendering the word "None")
    out = {k: v for k, v in message.items() if v is not None}
    content = out.get("content")
    if content is None:
        if role != "assistant":
            raise ChatTemplateError(f'{where} has no "content"')
    elif isinstance(content, list):
        texts = _text_parts(content, where)
        if content_format == "string":
            out["content"] = "\n".join(texts)
        else:
            out["content"] = [{"type": "text", "text": t} for t in texts]
    elif not isinstance(content, str):
        raise ChatTemplateError(f'{where} has "content" of type {type(content).__name__}: give a string or '
                                "a list of text parts")
    out = _plain(out, where)
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        # transformers' aliasing, key order included (a template may iterate over the keys)
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


# ----------------------------------------------------------------------------- content format


def _content_of(node, names: set) -> bool:
    """Whether ``node`` is a message's content: ``x['content']`` or ``x.content``, or a variable
    set from one (in ``names``), possibly through filters and tests."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name in names


def detect_content_format(source: str) -> str:
    """``"openai"`` if the template loops over a message's content (``{% for part in
    message['content'] %}``, directly, through a filter, or through a variable set from it),
    else ``"string"``: the detection vLLM makes to decide what a template gets for content given
    as parts. A template that does not parse is ``"string"`` (its own error comes when it is
    compiled)."""
    try:
        ast = _environment().parse(source)
    except jinja2.exceptions.TemplateError:
        return "string"
    names: set = set()
    for node in ast.find_all(jinja2.nodes.Assign):
        if isinstance(node.target, jinja2.nodes.Name) and _content_of(node.node, set()):
            names.add(node.target.name)
    for node in ast.find_all(jinja2.nodes.For):
        if _content_of(node.iter, names):
            return "openai"
    return "string"


# ----------------------------------------------------------------------------- the template


class ChatTemplate:
    """A compiled chat template and the special-token strings it is rendered with.

    ``source`` is the template text. ``special_tokens`` maps names like ``bos_token`` and
    ``eos_token`` to their strings, as ``transformers`` passes ``tokenizer.special_tokens_map``
    (names with a None value are left out, so the template sees them undefined, as there).
    ``origin`` names the template in error messages (a file path, for one read from disk).

    ``content_format`` says what a template gets for a message whose content is a list of OpenAI
    content parts (``[{"type": "text", "text": ...}, ...]``):

    - ``"string"`` (default): the texts joined with ``"\\n"`` into one string. This is vLLM's
      "string" content format, the one it uses for templates that read ``message['content']`` as
      a string, which is every text-only template this module is tested on; a template written
      for strings would otherwise print the list's Python repr or fail on ``'...' + content``.
    - ``"openai"``: the list of text parts itself (rebuilt as ``{"type": "text", "text": ...}``),
      for templates that loop over the parts, like multimodal ones (vLLM's "openai" format).
    - ``"auto"``: whichever of the two the template reads (:func:`detect_content_format`): a
      template that loops over a message's content gets the parts.

    A string content is passed unchanged either way. The template is compiled once, here: a
    syntax error raises :class:`ChatTemplateError` naming ``origin`` and the line.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, *,
                 origin: str = "chat template", content_format: str = "string"):
        if not isinstance(source, str):
            raise ChatTemplateError(f"the {origin} is a {type(source).__name__}, not the template's text")
        if content_format not in CONTENT_FORMATS:
            raise ChatTemplateError(f"unknown content format {content_format!r}: use one of "
                                    f"{', '.join(CONTENT_FORMATS)}")
        tokens = {}
        for name, value in (special_tokens or {}).items():
            if value is None:
                continue
            if not isinstance(name, str) or not isinstance(value, str):
                raise ChatTemplateError(f"the special token {name!r} of the {origin} is {value!r}, not a "
                                        "string")
            tokens[name] = value
        self.source = source
        self.special_tokens = tokens
        self.origin = origin
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the {origin} does not parse: line {e.lineno}: {e.message}") from e
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the {origin} does not compile: {e}") from e
        self.content_format = detect_content_format(source) if content_format == "auto" else content_format

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, special_tokens={self.special_tokens!r})"

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, continue_final_message: bool = False,
               **extra: Any) -> str:
        """The prompt for ``messages``, as ``transformers``' ``apply_chat_template(messages,
        tokenize=False, add_generation_prompt=..., tools=..., documents=..., **extra)`` renders it.

        Each message is a mapping with a ``role`` in :data:`ROLES` and a ``content`` that is a
        string or a list of text parts (see the class docstring for how the parts reach the
        template); an assistant message may leave content out or None. Other keys of a message pass
        through to the template; keys whose value is None are dropped, as transformers does.
        ``add_generation_prompt`` (True by default, as a server wants) asks the template to end
        with the header of an assistant turn. ``tools`` (OpenAI tool schemas) and ``documents``
        stay None when not given, which is what transformers passes then; ``extra`` keywords reach
        the template as variables (e.g. ``date_string`` for Llama 3.1) and override a special
        token of the same name. ``continue_final_message``: the prompt ends inside the last
        message, so that the model continues its text (transformers' way: the text is marked, the
        conversation rendered, and the prompt cut at the mark). Every failure raises
        :class:`ChatTemplateError`.
        """
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ChatTemplateError("the messages must be a list of objects with a role and content")
        if len(messages) == 0:
            raise ChatTemplateError("the conversation is empty: give at least one message")
        chat = [_message(m, i, self.content_format) for i, m in enumerate(messages, 1)]
        final = None
        if continue_final_message:
            final = chat[-1].get("content")
            if final is None:
                raise ChatTemplateError('continue_final_message: the final message has no "content" to continue')
            if "content" not in self.source:
                raise ChatTemplateError("continue_final_message: the chat template does not read a message's "
                                        "content")
            if isinstance(final, list):
                if not final:
                    raise ChatTemplateError("continue_final_message: the final message has no text to continue")
                final = final[-1]["text"]
                chat[-1]["content"][-1]["text"] = final + _CONTINUE
            else:
                chat[-1]["content"] = final + _CONTINUE
        if tools is not None:
            if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence) \
                    or not all(isinstance(t, Mapping) for t in tools):
                raise ChatTemplateError("the tools must be a list of JSON schema objects")
            tools = _plain(list(tools), "the tools")
        if documents is not None:
            if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Sequence) \
                    or not all(isinstance(d, Mapping) for d in documents):
                raise ChatTemplateError("the documents must be a list of objects with 'title' and 'text'")
            documents = _plain(list(documents), "the documents")
        variables = _plain({**self.special_tokens, **extra}, "an extra template variable")
        try:
            text = self._template.render(messages=chat, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:  # the template's own raise_exception, message unchanged
            raise
        except Exception as e:  # a template is code from the model's authors: any failure is theirs
            raise _failure(e, _file_names(self.origin)) from e  # (a client reads it: no server paths)
        if final is not None:
            mark = _CONTINUE.strip()
            if final.strip() not in text or mark not in text:
                raise ChatTemplateError("continue_final_message: the final message does not appear in the "
                                        "rendered prompt (the chat template changes it)")
            at = text.rindex(mark)
            text = text[:at] if text[at:at + len(_CONTINUE)] == _CONTINUE else text[:at].rstrip()
        return text


# ----------------------------------------------------------------------------- model folders


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"cannot read the chat template file {path}: {e}") from e


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"cannot read {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def _token_string(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an added-token object whose
    ``content`` is the string; anything else (null, a list) is not a token string."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_tokens_from_config(config: Mapping[str, Any], legacy_map: Mapping[str, Any] | None = None
                               ) -> dict[str, str]:
    """The special-token strings transformers would hand a template for this tokenizer config.

    These are the named tokens of :data:`SPECIAL_TOKEN_NAMES`, any other key ending in ``_token``
    whose value is a token (a model's own, like ``image_token``), and the named entries of an
    ``extra_special_tokens`` object. ``legacy_map`` is a ``special_tokens_map.json``: as in
    transformers, it is read only when the config has no ``added_tokens_decoder``, and its entries
    override the config's.
    """
    merged = dict(config)
    if legacy_map is not None and "added_tokens_decoder" not in config:
        merged.update(legacy_map)
    tokens = {}
    for key, value in merged.items():
        if key in SPECIAL_TOKEN_NAMES or key.endswith("_token"):
            token = _token_string(value)
            if token is not None:
                tokens[key] = token
    extra = merged.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            token = _token_string(value)
            if isinstance(key, str) and token is not None:
                tokens[key] = token
    return tokens


def _config_template(config: Mapping[str, Any], path: Path) -> str | None:
    """The ``chat_template`` entry of a tokenizer config: a string, or a list of
    ``{"name", "template"}`` of which "default" is the one used; None when there is none."""
    entry = config.get("chat_template")
    if entry is None:
        return None
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        named = {}
        for item in entry:
            if not (isinstance(item, Mapping) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise ChatTemplateError(f'{path}: each entry of "chat_template" must be an object with a '
                                        '"name" and a "template" string')
            named[item["name"]] = item["template"]
        if "default" not in named:
            have = ", ".join(sorted(named)) or "none"
            raise ChatTemplateError(f"{path} names no 'default' chat template (it has {have}): give one with "
                                    "--chat-template FILE")
        return named["default"]
    raise ChatTemplateError(f'{path}: "chat_template" is a {type(entry).__name__}, not a string or a list '
                            "of named templates")


def load_chat_template(folder: str | Path | None, override: str | Path | None = None, *,
                       content_format: str = "auto") -> ChatTemplate | None:
    """The chat template of a model folder, or None when it has none.

    The template is, in this order of precedence: the file ``override`` (a ``.jinja`` file given on
    the command line), ``chat_template.jinja`` in ``folder``, or the ``chat_template`` entry of
    ``folder/tokenizer_config.json`` (a string, or a list of named templates of which "default" is
    used) -- the same precedence transformers gives the two files. The special tokens come from
    ``tokenizer_config.json`` (and a legacy ``special_tokens_map.json``) when the folder has one;
    a folder that is not a Hugging Face folder (no such files, like a character model's) has no
    template unless ``override`` gives one. ``folder`` may be None when only ``override`` is used.

    Raises :class:`ChatTemplateError` naming the file when a file cannot be read, a JSON file is
    not valid, or the template does not parse.
    """
    folder = Path(folder) if folder is not None else None
    config: dict = {}
    config_path = folder / "tokenizer_config.json" if folder is not None else None
    if config_path is not None and config_path.is_file():
        config = _read_json(config_path)
    legacy = None
    legacy_path = folder / "special_tokens_map.json" if folder is not None else None
    if legacy_path is not None and legacy_path.is_file():
        legacy = _read_json(legacy_path)
    tokens = special_tokens_from_config(config, legacy)

    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise ChatTemplateError(f"the chat template file {path} does not exist")
        source, origin = _read_text(path), f"chat template {path}"
    elif folder is not None and (folder / "chat_template.jinja").is_file():
        path = folder / "chat_template.jinja"
        source, origin = _read_text(path), f"chat template {path}"
    else:
        source = _config_template(config, config_path) if config else None
        if source is None:
            return None
        origin = f"chat template in {config_path}"
    return ChatTemplate(source, tokens, origin=origin, content_format=content_format)


def require_chat_template(folder: str | Path | None, override: str | Path | None = None, *,
                          content_format: str = "auto") -> ChatTemplate:
    """:func:`load_chat_template`, raising :class:`ChatTemplateError` (:data:`NO_CHAT_TEMPLATE`)
    instead of returning None, for a server that must answer chat requests."""
    template = load_chat_template(folder, override, content_format=content_format)
    if template is None:
        raise ChatTemplateError(NO_CHAT_TEMPLATE)
    return template
