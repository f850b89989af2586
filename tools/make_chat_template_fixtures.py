"""Write tests/fixtures/chat_templates/expected.json: what transformers renders for each chat template
of that folder on a fixed set of conversations, the reference jaxdecode.server.chat must equal byte
for byte (tests/test_chat_template.py).

Run with the interpreter that has torch and transformers, from the repository root:

    .venv-torch/bin/python tools/make_chat_template_fixtures.py

The templates and their special tokens are listed in tests/fixtures/chat_templates/tokens.json. For
each one, a ``PreTrainedTokenizerFast`` is built from the tiny tokenizer of tests/fixtures/hf/llama
(the vocabulary plays no part when rendering to text) with that template and those bos/eos strings,
and ``tokenizer.apply_chat_template(messages, tokenize=False, ...)`` renders every conversation.

Content given as a list of text parts is joined with "\\n" before transformers sees it (vLLM's
"string" content format); the ``*_openai`` cases pass the list unchanged (the "openai" content
format). A template whose entry in tokens.json says ``"content_format": "openai"`` loops over the
parts itself: every case passes them unchanged and is recorded as ``"auto"``, the format a server
detects from the template (jaxdecode.server.chat.detect_content_format). A case whose render
raises records the exception: ``raise_exception`` when the template called ``raise_exception`` (jinja2's bare
TemplateError), else the exception's type, with its message either way.

Needs only transformers and jinja2; never imported by the tests.
"""

import copy
import json
import sys
from pathlib import Path

import jinja2
import transformers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "tests" / "fixtures" / "chat_templates"
TOKENIZER = ROOT / "tests" / "fixtures" / "hf" / "llama" / "tokenizer.json"


def msg(role, content, **more):
    return {"role": role, "content": content, **more}


def parts(*texts):
    return [{"type": "text", "text": t} for t in texts]


TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city — «quoted» & <tagged>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "Zürich"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}]
DOCUMENTS = [{"title": "Notes", "text": "  The sky is blue.  \n"}, {"title": "Ünïcode", "text": "日本語 ✓"}]

# (case id, messages, add_generation_prompt, keyword arguments for apply_chat_template / render)
CASES = [
    ("system_user", [msg("system", "You are a terse assistant."), msg("user", "What is 2+2?")], True, {}),
    ("user_only", [msg("user", "Hello!")], True, {}),
    ("user_only_no_prompt", [msg("user", "Hello!")], False, {}),
    ("multi_turn", [msg("user", "Hi."), msg("assistant", "Hello, how can I help?"),
                    msg("user", "Tell me a joke.")], True, {}),
    ("multi_turn_system", [msg("system", "Be kind."), msg("user", "Hi."), msg("assistant", "Hello!"),
                           msg("user", "Bye.")], True, {}),
    ("ends_with_assistant_no_prompt", [msg("user", "Name a colour."), msg("assistant", "Blue.")], False, {}),
    ("text_parts", [msg("system", parts("Rule one.", "Rule two.")),
                    msg("user", parts("First part.", "Second part."))], True, {}),
    ("text_parts_no_system", [msg("user", parts("Only", "parts", "here"))], True, {}),
    ("text_parts_openai", [msg("user", parts("First part.", "Second part."))], True,
     {"content_format": "openai"}),
    ("unicode", [msg("system", "Réponds en français ✓"),
                 msg("user", "Grüße aus Zürich — 日本語のテキスト, emoji 👋🏽🚀, ÿ and \u00a0nbsp")], True, {}),
    ("unicode_no_system", [msg("user", "Привет 😀"), msg("assistant", "Здравствуйте! 🎉"),
                           msg("user", "中文 ok?")], True, {}),
    ("whitespace", [msg("user", "  leading and trailing spaces  \n\n"),
                    msg("assistant", "\nan answer between newlines\n"), msg("user", "\tTabbed.\t")],
     True, {}),
    ("empty_contents", [msg("system", ""), msg("user", "")], True, {}),
    ("roles_not_alternating", [msg("user", "One."), msg("user", "Two.")], True, {}),
    ("assistant_first", [msg("assistant", "I speak first."), msg("user", "OK.")], True, {}),
    ("system_not_first", [msg("user", "Hi."), msg("system", "Late rule."), msg("user", "Again.")], True, {}),
    ("assistant_without_content", [msg("user", "Hi."), {"role": "assistant", "content": None}], False,
     {}),
    ("tools", [msg("user", "Weather in Paris?")], True, {"tools": TOOLS}),
    ("tools_with_system", [msg("system", "Use tools."), msg("user", "Weather in Oslo?")], True,
     {"tools": TOOLS}),
    ("documents", [msg("user", "Summarise the documents.")], True, {"documents": DOCUMENTS}),
    ("extra_variables", [msg("user", "What day is it?")], True,
     {"extra": {"date_string": "01 Jan 2025", "greeting": "hello there"}}),
    ("extra_overrides_eos", [msg("user", "Hi."), msg("assistant", "Hey.")], False,
     {"extra": {"eos_token": "<custom_eos>"}}),
    ("message_fields", [msg("user", "Weather?", name="ann"),
                        msg("assistant", None, reasoning_content="Look it up.", tool_calls=[
                            {"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]),
                        msg("tool", "Sunny", tool_call_id="call_1", name="get_weather")], True,
     {"tools": TOOLS}),
    ("text_parts_multi_turn", [msg("user", parts("part one ", "part two")), msg("assistant", parts("an ", "answer")),
                               msg("user", parts("again"))], True, {}),
    ("loop_controls", [msg("user", "skip me"), msg("user", "kept"), msg("assistant", " reply "),
                       msg("user", "stop here"), msg("user", "never shown")], True, {}),
]


def for_transformers(messages, content_format):
    """The messages as transformers gets them: text-part lists joined with "\\n" in the default
    "string" content format, left as lists in the "openai" one."""
    out = copy.deepcopy(messages)
    if content_format == "string":
        for m in out:
            if isinstance(m.get("content"), list):
                m["content"] = "\n".join(p["text"] for p in m["content"])
    return out


def tokenizer_for(spec: dict, template: str) -> PreTrainedTokenizerFast:
    tokens = {k: spec[k] for k in ("bos_token", "eos_token") if spec.get(k) is not None}
    return PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), chat_template=template, **tokens)


def main() -> int:
    specs = json.loads((FOLDER / "tokens.json").read_text(encoding="utf-8"))
    out = {
        "about": "Written by tools/make_chat_template_fixtures.py: what transformers' apply_chat_template "
                 "(tokenize=False) renders for each template and conversation. Do not edit by hand.",
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
        "templates": {},
        "cases": [],
    }
    for name, spec in specs.items():
        file = (FOLDER / spec.get("file", f"{name}.jinja")).resolve()
        template = file.read_text(encoding="utf-8")  # as transformers reads chat_template.jinja
        tok = tokenizer_for(spec, template)
        out["templates"][name] = {"file": str(file.relative_to(ROOT)),
                                  "special_tokens": dict(tok.special_tokens_map)}
        for case, messages, prompt, kwargs in CASES:
            kwargs = dict(kwargs)
            content_format = kwargs.pop("content_format", "string")
            if spec.get("content_format") == "openai":  # the template loops over the parts
                content_format = "auto"
            extra = kwargs.pop("extra", {})
            record = {"template": name, "case": case, "messages": messages, "add_generation_prompt": prompt,
                      "content_format": content_format, "tools": kwargs.get("tools"),
                      "documents": kwargs.get("documents"), "extra": extra}
            try:
                text = tok.apply_chat_template(for_transformers(messages, content_format), tokenize=False,
                                               add_generation_prompt=prompt, **kwargs, **extra)
            except Exception as e:  # recorded: the test expects the same refusal
                kind = "raise_exception" if type(e) is jinja2.exceptions.TemplateError else type(e).__name__
                record["error"] = {"kind": kind, "message": str(e)}
            else:
                assert isinstance(text, str), type(text)
                record["rendered"] = text
            out["cases"].append(record)
    path = FOLDER / "expected.json"
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    errors = sum("error" in c for c in out["cases"])
    print(f"wrote {path.relative_to(ROOT)}: {len(out['cases'])} cases over {len(specs)} templates, "
          f"{errors} of them refused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
