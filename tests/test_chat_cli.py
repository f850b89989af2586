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
