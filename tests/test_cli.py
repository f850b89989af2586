import json

import pytest

from jaxdecode.cli import main


def test_generate_json(tiny_ckpt, capsys):
    assert main(["generate", r"ab\nc", "-n", "20", "--num-samples", "3", "--top-p", "0.9",
                 "--temperature", "0.8", "--seed", "3", "--ckpt", tiny_ckpt, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["outputs"]) == 3
    for o in doc["outputs"]:
        assert o["prompt"] == "ab\nc" and len(o["text"]) == 20 and len(o["tokens"]) == 20
        assert o["mean_logprob"] < 0
    assert doc["settings"]["top_p"] == 0.9 and doc["settings"]["seed"] == 3
    # the same seed gives the same text
    assert main(["generate", r"ab\nc", "-n", "20", "--num-samples", "3", "--top-p", "0.9",
                 "--temperature", "0.8", "--seed", "3", "--ckpt", tiny_ckpt, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == doc


def test_generate_text_and_stream(tiny_ckpt, capsys):
    assert main(["generate", "abc", "-n", "40", "--greedy", "--ckpt", tiny_ckpt, "--stream"]) == 0
    streamed = capsys.readouterr().out
    assert main(["generate", "abc", "-n", "40", "--greedy", "--ckpt", tiny_ckpt, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert streamed == "abc" + doc["outputs"][0]["text"] + "\n"


def test_score(tiny_ckpt, capsys):
    assert main(["score", "abc", "--prompt", "ha", "--ckpt", tiny_ckpt, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["logprobs"]) == 3 and doc["mean_logprob"] < 0


@pytest.mark.parametrize("argv, message", [
    (["generate", "abZ"], "'Z' at position 2"),
    (["generate", ""], "prompt is empty"),
    (["generate", "abc", "-n", "-1"], "-n must be >= 0"),
    (["generate", "abc", "--top-p", "1.5"], "top_p"),
    (["generate", "abc", "--temperature", "-1"], "temperature"),
    (["generate", "abc", "--top-k", "0"], "top_k"),
    (["generate", "abc", "--min-p", "2"], "min_p"),
    (["generate", "abc", "--repetition-penalty", "0"], "repetition_penalty"),
    (["generate", "abc", "--num-samples", "0"], "num-samples"),
    (["score", "", "--prompt", "a"], "empty"),
])
def test_bad_input_is_one_line_exit_2(tiny_ckpt, capsys, argv, message):
    assert main(argv + ["--ckpt", tiny_ckpt]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdecode: error:") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_missing_checkpoint(capsys, tmp_path):
    assert main(["generate", "abc", "--ckpt", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_generate_beam_json(tiny_ckpt, capsys):
    assert main(["generate", "abc", "-n", "10", "--beam", "4", "--n-best", "3", "--length-penalty", "0.6",
                 "--ckpt", tiny_ckpt, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    scores = [o["score"] for o in doc["outputs"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    assert all(len(o["text"]) == 10 for o in doc["outputs"])


def test_mode_command(tiny_ckpt, capsys):
    assert main(["mode", "abc", "-n", "3", "--ckpt", tiny_ckpt, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["text"]) == 3 and doc["logprob"] <= 0
    # the mode is at least as probable as the greedy continuation
    assert main(["generate", "abc", "-n", "3", "--beam", "1", "--ckpt", tiny_ckpt, "--json"]) == 0
    greedy = json.loads(capsys.readouterr().out)["outputs"][0]
    assert doc["logprob"] >= greedy["logprob"] - 1e-5


@pytest.mark.parametrize("argv, message", [
    (["generate", "abc", "--beam", "0"], "--beam must be >= 1"),
    (["generate", "abc", "--beam", "2", "--n-best", "3"], "--n-best"),
    (["generate", "abc", "--n-best", "2"], "needs --beam"),
    (["mode", "abc", "-n", "0"], "-n must be >= 1"),
])
def test_beam_bad_input(tiny_ckpt, capsys, argv, message):
    assert main(argv + ["--ckpt", tiny_ckpt]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdecode: error:") and message in err


def test_generate_speculative_lookup_json(tiny_ckpt, capsys):
    argv = ["generate", "abcab", "-n", "6", "--seed", "2", "--ckpt", tiny_ckpt, "--json"]
    assert main(argv + ["--greedy", "--speculative", "lookup", "--gamma", "2"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main(argv + ["--greedy"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["outputs"][0]["text"] == plain["outputs"][0]["text"]  # greedy speculative == greedy
    st = spec["stats"]
    assert st["passes"] >= 1 and 0 <= st["accepted"] <= st["proposed"]


@pytest.mark.parametrize("argv, message", [
    (["generate", "abc", "--speculative", "lookup", "--gamma", "0"], "--gamma must be >= 1"),
    (["generate", "abc", "--gamma", "2"], "needs --speculative"),
    (["generate", "abc", "--speculative", "lookup", "--beam", "2"], "cannot be combined"),
    (["generate", "abc", "--speculative", "lookup", "--repetition-penalty", "1.2"], "speculative"),
    (["generate", "abc", "--speculative", "lookup", "--ngram-order", "4"], "need --speculative ngram"),
    (["generate", "abc", "--speculative", "ngram", "--ngram-order", "9"], "--ngram-order must be"),
    (["generate", "abc", "--speculative", "ngram", "--ngram-backoff", "0"], "--ngram-backoff must be"),
])
def test_speculative_bad_input(tiny_ckpt, capsys, argv, message):
    assert main(argv + ["--ckpt", tiny_ckpt]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdecode: error:") and message in err


@pytest.mark.slow
def test_generate_speculative_distilled(tiny_ckpt, capsys, tmp_path, monkeypatch):
    """The distilled draft is built from --data with the model's vocabulary, cached, and greedy
    speculative decoding with it prints what greedy decoding prints."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abc def. ghi\nabcab ba\n" * 500)
    monkeypatch.setenv("JAXDECODE_CACHE", str(tmp_path / "cache"))
    argv = ["generate", "abcab", "-n", "7", "--ckpt", tiny_ckpt, "--json", "--greedy"]  # + gamma 3 + 1: T
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    for _ in range(2):  # built, then read from the cache
        assert main(argv + ["--speculative", "distilled", "--ngram-order", "4", "--data", str(corpus)]) == 0
        spec = json.loads(capsys.readouterr().out)
        assert spec["outputs"][0]["text"] == plain["outputs"][0]["text"]
        assert spec["settings"]["speculative"] == "distilled" and spec["stats"]["passes"] >= 1
        assert spec["settings"]["gamma"] == 3  # the distilled draft's default
    assert len(list((tmp_path / "cache" / "drafts").glob("distilled-*.npz"))) == 1


@pytest.mark.slow
def test_generate_speculative_ngram_backoff_json(tiny_ckpt, capsys, monkeypatch):
    from jaxdecode import speculative

    seen = {}

    def small_table(kind, lm, data_path=None, *, n=None, backoff=None, progress=False):  # the corpus is Shakespeare's
        seen.update(kind=kind, n=n, backoff=backoff)
        text = lm.vocab.encode("abc def. ghi\nabcab ba\n" * 50)
        return speculative.NGramDraft.from_tokens(text, lm.cfg.V, n=n, backoff=backoff)

    monkeypatch.setattr(speculative, "make_draft", small_table)
    argv = ["generate", "abcab", "-n", "6", "--ckpt", tiny_ckpt, "--json", "--greedy"]
    assert main(argv + ["--speculative", "ngram", "--ngram-order", "4", "--ngram-backoff", "2", "--gamma", "2"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert seen == {"kind": "ngram", "n": 4, "backoff": 2.0}
    assert spec["settings"]["ngram_order"] == 4 and spec["settings"]["ngram_backoff"] == 2.0
    assert main(argv) == 0
    assert spec["outputs"][0]["text"] == json.loads(capsys.readouterr().out)["outputs"][0]["text"]


@pytest.mark.slow
def test_study_decoders(tiny_ckpt, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abc def. ghi\n" * 2000, encoding="utf-8")
    from jaxdecode import checkpoint
    from jaxdecode.studies import decoders

    lm = checkpoint.load(tiny_ckpt)
    res = decoders.compare(lm, corpus.read_text(), prompt="ghi\nabc", n=8, k=3)
    by = {r["decoder"]: r for r in res["rows"]}
    assert by["human"]["text"] == " def. gh"
    assert all(len(r["text"]) == 8 for r in res["rows"])
    with pytest.raises(ValueError, match="does not occur"):
        decoders.compare(lm, corpus.read_text(), prompt="zzz", n=8)


# ----------------------------------------------------------------------------- rule flags, cache


# the flags of `generate` that are not rules
NON_RULE_FLAGS = {"-n", "--help", "--num-samples", "--seed", "--ckpt", "--stop", "--greedy", "--json", "--stream",
                  "--beam", "--length-penalty", "--n-best", "--speculative", "--gamma", "--ngram-order",
                  "--ngram-backoff", "--data", "--contrastive", "--regex", "--choice", "--json-schema", "--smc"}


def _generate_parser():
    from jaxdecode.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["generate"]


def test_every_rule_has_a_flag_and_every_flag_a_rule(capsys):
    import re

    from jaxdecode import rules

    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", help_text))
    assert flags - NON_RULE_FLAGS == {spec.flag for spec in rules.REGISTRY}
    by_dest = {a.dest: a for a in _generate_parser()._actions if a.option_strings}
    for spec in rules.REGISTRY:
        action = by_dest[spec.name]
        assert action.option_strings == [spec.flag]
        assert action.type is spec.type and action.default is None and action.help == spec.help
        assert " ".join(spec.help.split()) in " ".join(help_text.split())
    assert {d for d, a in by_dest.items() if not set(a.option_strings) & NON_RULE_FLAGS} == set(rules.RULES)


def test_rule_flags_convert_and_reach_make_rule():
    from jaxdecode import cli, rules

    parser = _generate_parser()
    args = parser.parse_args(["abc", "--no-repeat-ngram", "3", "--top-k", "5", "--temperature", "0.5"])
    settings = cli._settings(args)
    assert settings == {"no_repeat_ngram": 3, "temperature": 0.5, "top_k": 5}
    assert type(settings["no_repeat_ngram"]) is int and type(settings["top_k"]) is int
    assert [type(r) for r in rules.make_rule(**settings).rules] == [
        rules.NoRepeatNGram, rules.Temperature, rules.TopK]
    with pytest.raises(SystemExit):
        parser.parse_args(["abc", "--top-k", "2.5"])  # argparse: invalid int value


def _record_jax_config(monkeypatch):
    import jax

    calls = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: calls.append((name, value)))
    return calls


def test_empty_cache_variable_turns_the_compilation_cache_off(monkeypatch):
    from jaxdecode import cli, paths

    monkeypatch.setenv("JAXDECODE_CACHE", "")
    assert paths.cache_root() is None and paths.cache_dir("xla") is None
    calls = _record_jax_config(monkeypatch)
    cli._enable_compilation_cache()
    assert "jax_compilation_cache_dir" not in dict(calls)


def test_compilation_cache_lives_under_the_cache_root(monkeypatch, tmp_path):
    from jaxdecode import cli, paths

    monkeypatch.setenv("JAXDECODE_CACHE", str(tmp_path))
    assert paths.cache_dir("xla") == tmp_path / "xla"
    calls = _record_jax_config(monkeypatch)
    cli._enable_compilation_cache()
    assert dict(calls)["jax_compilation_cache_dir"] == str(tmp_path / "xla")
    assert (tmp_path / "xla").is_dir()
