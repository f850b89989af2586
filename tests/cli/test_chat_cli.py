"""``jaxdecode chat``: each reply is the engine's continuation of the conversation rendered with
the chat template, equal to ``generate`` on that text with the turn's seed."""

import io

import pytest

import jaxdecode
from jaxdecode.cli.app import main

TEMPLATE = ("{% for m in messages %}{{ m.role | upper }}:\n{{ m.content }}\n\n{% endfor %}"
            "{% if add_generation_prompt %}ROMEO:\n{% endif %}")


@pytest.mark.quick
def test_each_reply_is_generate_on_the_rendered_conversation(tmp_path, monkeypatch, capsys):
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    monkeypatch.setattr("sys.stdin", io.StringIO("Who art thou?\nAnd whither?\n"))
    assert main(["chat", "--chat-template", str(template), "-n", "12", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    replies = [line.split("model> ", 1)[1] for line in out.split("you> ") if "model> " in line]
    lm = jaxdecode.load()
    rule = jaxdecode.make_rule(temperature=0.7, top_p=0.95)
    first = "USER:\nWho art thou?\n\nROMEO:\n"
    want1 = jaxdecode.generate(lm, first, n=12, seed=3, rule=rule)[0].text
    second = first[:-len("ROMEO:\n")] + f"ASSISTANT:\n{want1}\n\nUSER:\nAnd whither?\n\nROMEO:\n"
    want2 = jaxdecode.generate(lm, second, n=12, seed=4, rule=rule)[0].text
    assert [r.rstrip("\n") for r in replies] == [want1.rstrip("\n"), want2.rstrip("\n")]


def test_a_model_without_a_template_is_refused_in_one_line(capsys):
    assert main(["chat"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--chat-template" in err


def test_the_shipped_subword_model_by_name_uses_its_own_template(monkeypatch, capsys):
    """``--ckpt shakespeare-bpe`` (a name, not a path) finds the folder's template: the reply is
    ``generate`` on the conversation as that template renders it, ended by the end token."""
    from jaxdecode.server.chat import load_chat_template
    from jaxdecode.models.checkpoint import BPE_NAME, resolve

    monkeypatch.setattr("sys.stdin", io.StringIO("Who art thou?\n"))
    assert main(["chat", "--ckpt", BPE_NAME, "-n", "40", "--seed", "5"]) == 0
    reply = capsys.readouterr().out.split("model> ", 1)[1].split("\nyou> ")[0]
    lm = jaxdecode.load(BPE_NAME)
    prompt = load_chat_template(resolve(BPE_NAME)).render([{"role": "user", "content": "Who art thou?"}])
    assert prompt == "ROMEO:\nWho art thou?<|endoftext|>JULIET:\n"
    want = jaxdecode.generate(lm, prompt, n=40, seed=5, rule=jaxdecode.make_rule(temperature=0.7, top_p=0.95))[0]
    assert reply.rstrip("\n") == want.text.rstrip("\n")
