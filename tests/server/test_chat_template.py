"""Chat templates (jaxdecode.server.chat): the prompt a server builds from chat messages must be the
one transformers' apply_chat_template builds, byte for byte, on real models' templates; a model
folder's template is found where transformers looks; every failure is one ChatTemplateError; and
the sandbox holds against a template that reaches for Python internals.

The reference renders are in tests/fixtures/chat_templates/expected.json, written with transformers
by tools/make_chat_template_fixtures.py (see the README in that folder).
"""

import copy
import datetime
import json
from pathlib import Path

import jinja2.exceptions
import pytest

from jaxdecode.server.chat import (NO_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError, load_chat_template,
                                   require_chat_template, special_tokens_from_config)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ROOT = FIXTURES.parent.parent
HF_LLAMA = FIXTURES / "hf" / "llama"
EXPECTED = json.loads((FIXTURES / "chat_templates" / "expected.json").read_text(encoding="utf-8"))
CASES = EXPECTED["cases"]
_compiled = {}


def template_for(name: str, content_format: str) -> ChatTemplate:
    """The fixture template ``name``, with the special tokens transformers rendered it with."""
    key = (name, content_format)
    if key not in _compiled:
        spec = EXPECTED["templates"][name]
        source = (ROOT / spec["file"]).read_text(encoding="utf-8")
        _compiled[key] = ChatTemplate(source, spec["special_tokens"], origin=name, content_format=content_format)
    return _compiled[key]


def render_case(case: dict) -> str:
    t = template_for(case["template"], case["content_format"])
    return t.render(case["messages"], add_generation_prompt=case["add_generation_prompt"], tools=case["tools"],
                    documents=case["documents"], **case["extra"])


@pytest.mark.quick
def test_the_fixture_covers_every_template_and_some_refusals():
    names = {c["template"] for c in CASES}
    assert {"meta-llama-Llama-3.1-8B-Instruct", "Qwen-Qwen2.5-7B-Instruct", "mistralai-Mistral-Nemo-Instruct-2407",
            "google-gemma-2-2b-it", "HuggingFaceTB-SmolLM2-135M-Instruct", "microsoft-Phi-3.5-mini-instruct",
            "features", "hf-llama-fixture", "google-gemma-3-it", "Qwen-Qwen2-VL-7B-Instruct"} == names
    raised = {c["template"] for c in CASES if c.get("error", {}).get("kind") == "raise_exception"}
    assert {"google-gemma-2-2b-it", "mistralai-Mistral-Nemo-Instruct-2407", "features"} <= raised
    assert sum("rendered" in c for c in CASES) >= 150


@pytest.mark.quick
@pytest.mark.parametrize("case", CASES, ids=[f"{c['template']}-{c['case']}" for c in CASES])
def test_renders_like_transformers(case):
    before = copy.deepcopy(case["messages"])
    if "rendered" in case:
        assert render_case(case) == case["rendered"]
    else:
        with pytest.raises(ChatTemplateError) as info:
            render_case(case)
        if case["error"]["kind"] == "raise_exception":  # the template's own words, unchanged
            assert str(info.value) == case["error"]["message"]
        else:  # another failure (an undefined key, a type error), named in one sentence
            assert case["error"]["message"] in str(info.value)
            assert str(info.value).startswith(f"the {case['template']} failed")
    assert case["messages"] == before, "the caller's messages were changed"


def test_the_templates_that_loop_over_content_parts():
    """Gemma 3's and Qwen2-VL's templates loop over a message's parts (detected as "openai", and
    rendered with the parts unchanged in every case above); every other committed one reads a
    string."""
    from jaxdecode.server.chat import detect_content_format

    found = {name: detect_content_format((ROOT / spec["file"]).read_text(encoding="utf-8"))
             for name, spec in EXPECTED["templates"].items()}
    assert {name for name, fmt in found.items() if fmt == "openai"} == {"google-gemma-3-it",
                                                                         "Qwen-Qwen2-VL-7B-Instruct"}
    assert {c["content_format"] for c in CASES if c["template"] == "Qwen-Qwen2-VL-7B-Instruct"} == {"auto"}
    qwen = template_for("Qwen-Qwen2-VL-7B-Instruct", "auto")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert qwen.render(parts, add_vision_id=True).endswith("<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ChatTemplateError, match="content part 2, is of type 'image'"):
        qwen.render([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "image": "x.png"}]}])


def test_text_parts_are_joined_with_newlines_by_default():
    t = ChatTemplate("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert t.render([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]) \
        == "[a\nb]"
    loops = ChatTemplate("{% for m in messages %}{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endfor %}",
                         content_format="openai")
    assert loops.render([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]}]) == "<a><b>"
    assert loops.render([{"role": "user", "content": "ab"}]) == "<><>"  # a string passes unchanged


@pytest.mark.quick
@pytest.mark.parametrize("messages, message", [
    ([], "the conversation is empty"),
    ("hello", "the messages must be a list"),
    ([{"role": "function", "content": "x"}], "message 1 has the role 'function': use one of system, user, assistant, tool"),
    ([{"content": "x"}], 'message 1 has no "role"'),
    ([{"role": "user", "content": "a"}, "b"], "message 2 is a str"),
    ([{"role": "user"}], 'message 1 (user) has no "content"'),
    ([{"role": "user", "content": 3}], 'message 1 (user) has "content" of type int'),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
     "message 1 (user), content part 1, is of type 'image_url': only text parts are supported"),
    ([{"role": "user", "content": [{"type": "text"}]}], 'message 1 (user), content part 1, has no "text" string'),
    ([{"role": "user", "content": ["plain"]}], "message 1 (user), content part 1, is not an object"),
    ([{"role": "user", "content": "x", "meta": object()}], "message 1 (user) holds a value of type object"),
])
def test_bad_messages_are_refused_in_one_sentence(messages, message):
    t = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ChatTemplateError) as info:
        t.render(messages)
    assert str(info.value).startswith(message), str(info.value)


def test_none_values_are_dropped_and_reasoning_is_aliased_like_transformers():
    t = ChatTemplate("{% for m in messages %}{{ m | tojson }};{% endfor %}")
    out = t.render([{"role": "user", "content": "q", "name": None},
                    {"role": "assistant", "content": None, "reasoning": "hmm"}], add_generation_prompt=False)
    assert out == ('{"role": "user", "content": "q"};'
                   '{"thinking": "hmm", "role": "assistant", "reasoning": "hmm", "reasoning_content": "hmm"};')


def test_strftime_now_and_a_missing_variable():
    t = ChatTemplate("{{ strftime_now('%Y') }}")
    years = {str(datetime.datetime.now().year)}
    assert t.render([{"role": "user", "content": "x"}]) in years | {str(int(min(years)) + 1)}
    with pytest.raises(ChatTemplateError, match="the chat template failed: 'nope' is undefined"):
        ChatTemplate("{{ nope.x }}").render([{"role": "user", "content": "x"}])


# ----------------------------------------------------------------------------- the sandbox

ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ().__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ messages.append({{}}) }}",
    "{% set ns = namespace(_hidden=1) %}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
    "{{ dict.__class__.__subclasses__() }}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_the_sandbox_refuses_python_internals(source, tmp_path):
    marker = tmp_path / "escaped"
    t = ChatTemplate(source.replace("{marker}", str(marker)).replace("{{}}", "{}"))
    with pytest.raises(ChatTemplateError) as info:
        t.render([{"role": "user", "content": "x"}])
    assert isinstance(info.value.__cause__, jinja2.exceptions.SecurityError)
    assert str(info.value).startswith("the chat template tried an operation the sandbox forbids: ")
    assert not marker.exists()


def test_a_template_that_does_not_parse_names_its_origin():
    with pytest.raises(ChatTemplateError, match=r"the mine does not parse: line 2: "):
        ChatTemplate("ok\n{% if %}", origin="mine")
    with pytest.raises(ChatTemplateError, match="unknown content format 'images'"):
        ChatTemplate("x", content_format="images")


# ----------------------------------------------------------------------------- model folders

MESSAGES = [{"role": "user", "content": "Hi."}]


def _folder(tmp_path, config=None, jinja=None, name="m"):
    folder = tmp_path / name
    folder.mkdir()
    if config is not None:
        (folder / "tokenizer_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


@pytest.mark.quick
def test_a_folder_with_chat_template_jinja():
    t = load_chat_template(HF_LLAMA)
    assert t.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    assert t.origin == f"chat template {HF_LLAMA / 'chat_template.jinja'}"
    case = next(c for c in CASES if c["template"] == "hf-llama-fixture" and c["case"] == "multi_turn")
    assert t.render(case["messages"]) == case["rendered"]
    assert t.render(MESSAGES) == "<s><|im_start|>user\nHi.</s>\n<|im_start|>assistant\n"


def test_a_failure_at_render_names_the_template_file_but_not_the_servers_folders(tmp_path):
    """A render error reaches the client: it names the file, not where the server keeps it (a
    load error, which the operator reads, keeps the whole path)."""
    for f in (_folder(tmp_path, jinja="{{ 1 / 0 }}"), _folder(tmp_path, {"chat_template": "{{ 1 / 0 }}"}, name="c")):
        t = load_chat_template(f)
        assert str(f) in t.origin
        with pytest.raises(ChatTemplateError) as info:
            t.render(MESSAGES)
        message = str(info.value)
        assert message.startswith("the chat template") and "failed" in message
        assert str(tmp_path) not in message and (f.name + "/") not in message
        assert ("chat_template.jinja" in message) or ("tokenizer_config.json" in message)


def test_a_string_template_in_tokenizer_config(tmp_path):
    f = _folder(tmp_path, {"bos_token": {"content": "<B>", "lstrip": False, "__type": "AddedToken"},
                           "eos_token": "<E>", "unk_token": None, "chat_template": "{{ bos_token }}{{ eos_token }}"})
    t = load_chat_template(f)
    assert t.special_tokens == {"bos_token": "<B>", "eos_token": "<E>"}
    assert t.render(MESSAGES) == "<B><E>"


def test_named_templates_in_tokenizer_config(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    assert load_chat_template(_folder(tmp_path, {"chat_template": named})).render(MESSAGES) == "plain"
    g = _folder(tmp_path, {"chat_template": named[:1]}, name="g")
    with pytest.raises(ChatTemplateError, match=f"{g / 'tokenizer_config.json'} names no 'default' chat template "
                                                r"\(it has tool_use\)"):
        load_chat_template(g)
    h = _folder(tmp_path, {"chat_template": [{"name": "default"}]}, name="h")
    with pytest.raises(ChatTemplateError, match='each entry of "chat_template" must be an object'):
        load_chat_template(h)


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    f = _folder(tmp_path, {"eos_token": "<E>", "chat_template": "from config"}, jinja="from file {{ eos_token }}")
    assert load_chat_template(f).render(MESSAGES) == "from file <E>"


def test_folders_without_a_template_give_none(tmp_path):
    assert load_chat_template(_folder(tmp_path)) is None
    assert load_chat_template(_folder(tmp_path, {"eos_token": "</s>"}, name="n")) is None
    char = ROOT / "checkpoints" / "shakespeare-char"
    if char.is_dir():  # the character model's folder: not a Hugging Face folder
        assert load_chat_template(char) is None
    with pytest.raises(ChatTemplateError, match=f"^{NO_CHAT_TEMPLATE}$"):
        require_chat_template(tmp_path / "m")


def test_broken_files_are_named(tmp_path):
    f = _folder(tmp_path, '{"chat_template": "x",')
    with pytest.raises(ChatTemplateError, match=f"{f / 'tokenizer_config.json'} is not valid JSON"):
        load_chat_template(f)
    g = _folder(tmp_path, {"eos_token": "</s>"}, jinja="{% for m in messages %}{{ m.content }", name="g")
    with pytest.raises(ChatTemplateError, match=f"the chat template {g / 'chat_template.jinja'} does not parse: "
                                                "line 1: "):
        load_chat_template(g)
    h = _folder(tmp_path, {"chat_template": "{% endif %}"}, name="h")
    with pytest.raises(ChatTemplateError, match=f"the chat template in {h / 'tokenizer_config.json'} does not "
                                                "parse: line 1: "):
        load_chat_template(h)
    i = _folder(tmp_path, "[1, 2]", name="i")
    with pytest.raises(ChatTemplateError, match="holds a JSON list, not an object"):
        load_chat_template(i)
    j = _folder(tmp_path, {}, name="j")
    (j / "chat_template.jinja").write_bytes(b"\xff\xfe bad utf-8")
    with pytest.raises(ChatTemplateError, match=f"cannot read the chat template file {j / 'chat_template.jinja'}"):
        load_chat_template(j)


def test_the_override_file(tmp_path):
    override = tmp_path / "mine.jinja"
    override.write_text("mine {{ bos_token }}")
    assert load_chat_template(HF_LLAMA, override).render(MESSAGES) == "mine <s>"  # the folder's tokens
    assert load_chat_template(None, override).render(MESSAGES) == "mine "
    char = _folder(tmp_path, name="char")
    (char / "config.json").write_text("{}")
    assert load_chat_template(char, str(override)).render(MESSAGES) == "mine "
    with pytest.raises(ChatTemplateError, match=f"the chat template file {tmp_path / 'absent.jinja'} does not exist"):
        load_chat_template(HF_LLAMA, tmp_path / "absent.jinja")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ ")
    with pytest.raises(ChatTemplateError, match=f"the chat template {broken} does not parse"):
        load_chat_template(HF_LLAMA, broken)


def test_special_tokens_as_transformers_collects_them(tmp_path):
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": None, "image_token": "<img>",
              "add_bos_token": True, "extra_special_tokens": {"audio_token": "<aud>"}, "model_max_length": 9}
    assert special_tokens_from_config(config) == {"bos_token": "<s>", "eos_token": "</s>", "image_token": "<img>",
                                                  "audio_token": "<aud>"}
    # special_tokens_map.json counts only without added_tokens_decoder, and then overrides the config
    assert special_tokens_from_config({"eos_token": "a"}, {"eos_token": "b"}) == {"eos_token": "b"}
    assert special_tokens_from_config({"eos_token": "a", "added_tokens_decoder": {}}, {"eos_token": "b"}) \
        == {"eos_token": "a"}
    f = _folder(tmp_path, {"eos_token": "a"}, jinja="{{ eos_token }}")
    (f / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "b", "special": True}}))
    assert load_chat_template(f).render(MESSAGES) == "b"
