import functools
import itertools
import json

import numpy as np
import pytest

from jaxdecode.cli.app import main


# ----------------------------------------------------------------------------- plain references


@functools.cache
def _jit_forward(cfg):
    import jax

    from jaxdecode.models.charlm import transformer as M

    return jax.jit(lambda params, tokens: M.forward(params, cfg, tokens))


def _book_logprobs(tiny_model, seqs):
    """log p(seq[t] | seq[:t]) for every t >= 1 of each row of ``seqs`` [N, L] (L <= T), float64:
    one plain forward of the tiny model (no cache, no decoder, no checkpoint) per batch of rows."""
    cfg, params, _ = tiny_model
    seqs = np.asarray(seqs, np.int32)
    assert seqs.shape[1] <= cfg.T
    z = np.asarray(_jit_forward(cfg)(params, seqs), np.float64)[:, :-1]  # [N, L-1, V]
    z = z - z.max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return np.take_along_axis(lp, seqs[:, 1:, None], axis=-1)[..., 0]  # [N, L-1]


def _book_continuation_logprob(tiny_model, prompt: str, text: str) -> float:
    vocab = tiny_model[2]
    ids = np.concatenate([vocab.encode(prompt), vocab.encode(text)])[None]
    return float(_book_logprobs(tiny_model, ids)[0, len(prompt) - 1:].sum())


def _book_greedy(tiny_model, prompt: str, n: int) -> str:
    """Greedy decoding written plainly: per step a full forward over the last T tokens (right-
    padded to T, which the causal mask keeps out of sight), argmax at the last real position."""
    cfg, params, vocab = tiny_model
    ids = [int(t) for t in vocab.encode(prompt)]
    for _ in range(n):
        window = ids[-cfg.T:]
        x = np.zeros((1, cfg.T), np.int32)
        x[0, :len(window)] = window
        z = np.asarray(_jit_forward(cfg)(params, x))[0, len(window) - 1]
        ids.append(int(np.argmax(z)))
    return vocab.decode(np.asarray(ids[len(prompt):], np.int32))


def _load_tiny(tiny_ckpt):
    from jaxdecode.models import checkpoint

    return checkpoint.load(tiny_ckpt)


@pytest.mark.quick
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


def test_generate_json_is_the_library_with_the_flags_rule(tiny_ckpt, tiny_model, capsys):
    """The command line's samples are jaxdecode.generate's with the same seed and the rule its
    flags name, temperature before top-p (make_rule's order): another temperature or top-p, or
    the two in the other order, gives other samples, and a tiny --top-p makes every sample
    greedy's."""
    import jaxdecode
    from jaxdecode import rules

    prompt, n, seed = "ab\nc", 12, 3  # within the window T = 16 (test_generate_json goes past it)
    argv = ["generate", r"ab\nc", "-n", str(n), "--num-samples", "3", "--seed", str(seed), "--ckpt", tiny_ckpt,
            "--json", "--quiet"]
    assert main(argv + ["--temperature", "0.8", "--top-p", "0.9"]) == 0
    doc = json.loads(capsys.readouterr().out)
    texts = [o["text"] for o in doc["outputs"]]
    lm = _load_tiny(tiny_ckpt)

    def library(rule):
        return jaxdecode.generate(lm, prompt, n, seed=seed, rule=rule, num_samples=3)

    want = library(rules.chain(rules.temperature(0.8), rules.top_p(0.9)))
    assert texts == [g.text for g in want]
    assert [o["tokens"] for o in doc["outputs"]] == [g.tokens.tolist() for g in want]
    for o, g in zip(doc["outputs"], want):
        assert o["mean_logprob"] == pytest.approx(g.mean_logprob, abs=1e-6)
    # each flag matters: with temperature 1 or top-p 1 (each rule a no-op; the settings are traced,
    # so one compiled program), or the two rules in the other order, the samples differ
    for other in (rules.chain(rules.temperature(1.0), rules.top_p(0.9)),
                  rules.chain(rules.temperature(0.8), rules.top_p(1.0)),
                  rules.chain(rules.top_p(0.9), rules.temperature(0.8))):
        assert [g.text for g in library(other)] != texts, other
    # a tiny nucleus keeps only the most probable character: every sample is greedy's text
    assert main(argv + ["--temperature", "0.8", "--top-p", "0.001"]) == 0
    tiny_p = [o["text"] for o in json.loads(capsys.readouterr().out)["outputs"]]
    greedy = _book_greedy(tiny_model, prompt, n)
    assert tiny_p == [greedy] * 3
    assert texts != tiny_p  # top-p 0.9 samples: not all greedy's


def test_generate_text_and_stream(tiny_ckpt, capsys):
    assert main(["generate", "abc", "-n", "40", "--greedy", "--ckpt", tiny_ckpt, "--stream"]) == 0
    streamed = capsys.readouterr().out
    assert main(["generate", "abc", "-n", "40", "--greedy", "--ckpt", tiny_ckpt, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert streamed == "abc" + doc["outputs"][0]["text"] + "\n"


def _plain_logprobs(lm, prompt, text):
    """Each character's log-probability after the prompt and the characters before it: one plain
    forward of the whole sequence (the tiny model's T is not exceeded)."""
    import jax
    from jaxdecode.models.charlm.transformer import forward

    ids = np.concatenate([lm.vocab.encode(prompt), lm.vocab.encode(text)]).astype(np.int32)
    assert len(ids) <= lm.cfg.T
    logits = np.asarray(forward(lm.params, lm.cfg, jax.numpy.asarray(ids[None]))[0], np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    k = len(prompt)
    return np.array([logp[k - 1 + i, ids[k + i]] for i in range(len(text))])


@pytest.mark.quick
def test_score(tiny_ckpt, capsys):
    """The printed log-probabilities are those of ``jaxdecode.score`` in process and of a plain
    forward of prompt + text."""
    import jaxdecode
    from jaxdecode.models import checkpoint

    assert main(["score", "abc", "--prompt", "ha", "--ckpt", tiny_ckpt, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    lm = checkpoint.load(tiny_ckpt)
    want = _plain_logprobs(lm, "ha", "abc")
    assert len(doc["logprobs"]) == 3
    np.testing.assert_allclose(doc["logprobs"], want, atol=1e-4)
    assert doc["mean_logprob"] == pytest.approx(want.mean(), abs=1e-4)
    inproc = jaxdecode.score(lm, ["abc"], ["ha"])[0]
    np.testing.assert_allclose(doc["logprobs"], inproc.logprobs, atol=1e-6)


@pytest.mark.quick
@pytest.mark.parametrize("argv, message", [
    (["generate", "abZ"], "'Z' at position 2"),
    (["generate", ""], "prompt is empty"),
    (["generate", "abc", "-n", "-1"], "-n must be in 0..10,000,000, got -1"),
    (["generate", "abc", "--top-p", "1.5"], "--top-p must lie in (0, 1], got 1.5"),
    (["generate", "abc", "--temperature", "-1"], "temperature"),
    (["generate", "abc", "--top-k", "0"], "--top-k must be an integer >= 1, got 0"),
    (["generate", "abc", "--min-p", "2"], "--min-p must"),
    (["generate", "abc", "--repetition-penalty", "0"], "--repetition-penalty must be > 0, got 0"),
    (["generate", "abc", "--top_p", "0.9"], "did you mean --top-p?"),
    (["generate", "abc", "--greedy", "--top-p", "0.9"], "--greedy takes the most probable token"),
    (["generate", "abc", "--greedy", "--num-samples", "2"], "--greedy gives one answer"),
    (["generate", "abc", "--dtype", "bfloat16", "-n", "2"], "--dtype bfloat16 applies to Hugging Face"),
    (["generate", "abc", "--num-samples", "1000000000"], "--num-samples must be in 1..1,000,000"),
    (["info", "a", "--ckpt", "b"], "two checkpoints given"),
    (["generate", "abc", "--num-samples", "0"], "num-samples"),
    (["score", "", "--prompt", "a"], "empty"),
])
def test_bad_input_is_one_line_exit_2(tiny_ckpt, capsys, argv, message):
    assert main(argv + ["--ckpt", tiny_ckpt]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdecode: error:") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.quick
def test_missing_checkpoint(capsys, tmp_path):
    assert main(["generate", "abc", "--ckpt", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.quick
def test_generate_beam_json(tiny_ckpt, tiny_model, capsys):
    import jaxdecode

    alpha, n = 0.6, 10
    assert main(["generate", "abc", "-n", str(n), "--beam", "4", "--n-best", "3", "--length-penalty", str(alpha),
                 "--ckpt", tiny_ckpt, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    scores = [o["score"] for o in doc["outputs"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    assert all(len(o["text"]) == n for o in doc["outputs"])
    assert doc["settings"]["length_penalty"] == alpha
    # the model's log-probability of each text (a plain forward), and its GNMT score: no stop
    # string, so every hypothesis has n characters and score = logprob / ((5 + n) / 6) ** alpha
    # (Wu et al. 2016; jaxdecode.decoding.beam.gnmt_length_penalty)
    penalty = ((5.0 + n) / 6.0) ** alpha
    assert penalty > 1.7  # far from 1: a score that ignored --length-penalty would fail below
    for o in doc["outputs"]:
        assert o["logprob"] == pytest.approx(_book_continuation_logprob(tiny_model, "abc", o["text"]), abs=1e-4)
        assert o["score"] == pytest.approx(o["logprob"] / penalty, rel=1e-5, abs=1e-5)
        assert not o["finished"]
    # the library with the same settings
    want = jaxdecode.beam_generate(_load_tiny(tiny_ckpt), "abc", n, 4, n_best=3, length_penalty=alpha)[0]
    assert [o["text"] for o in doc["outputs"]] == [h.text for h in want]
    assert scores == pytest.approx([h.score for h in want], abs=1e-6)
    assert [o["logprob"] for o in doc["outputs"]] == pytest.approx([h.logprob for h in want], abs=1e-6)


# The mode of 3 characters after "ghi", found by enumerating all 12**3 continuations: "fff",
# 0.63 nats above the runner-up; greedy decoding gives " ff", 0.63 nats below it (searched over
# a few prompts with the tiny model of tests/conftest.py; "ghi" is one where greedy misses the mode).
MODE_PROMPT, MODE_N, MODE_TEXT, GREEDY_TEXT = "ghi", 3, "fff", " ff"


def test_mode_command(tiny_ckpt, tiny_model, capsys):
    """`mode` returns the argmax over every continuation of n characters, scored by a plain
    forward of the model (brute force), with its log-probability; greedy does not find it here."""
    cfg, _, vocab = tiny_model
    ids = vocab.encode(MODE_PROMPT)
    conts = np.array(list(itertools.product(range(cfg.V), repeat=MODE_N)), np.int32)  # [V**n, n]
    seqs = np.concatenate([np.broadcast_to(ids, (len(conts), len(ids))), conts], axis=1)
    total = _book_logprobs(tiny_model, seqs)[:, len(ids) - 1:].sum(axis=1)
    order = np.argsort(-total)
    best, best_lp = vocab.decode(conts[order[0]]), float(total[order[0]])
    assert best == MODE_TEXT and total[order[0]] - total[order[1]] > 0.5  # a clear, unique mode

    assert main(["mode", MODE_PROMPT, "-n", str(MODE_N), "--ckpt", tiny_ckpt, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prompt"] == MODE_PROMPT and doc["text"] == best
    assert doc["tokens"] == conts[order[0]].tolist()
    assert doc["logprob"] == pytest.approx(best_lp, abs=1e-4)
    assert doc["finish_reason"] == "length" and doc["nodes_expanded"] >= MODE_N
    # greedy differs from the mode here, and is less probable
    assert main(["generate", MODE_PROMPT, "-n", str(MODE_N), "--beam", "1", "--ckpt", tiny_ckpt, "--json"]) == 0
    greedy = json.loads(capsys.readouterr().out)["outputs"][0]
    assert greedy["text"] == GREEDY_TEXT == _book_greedy(tiny_model, MODE_PROMPT, MODE_N) != doc["text"]
    assert doc["logprob"] > greedy["logprob"] + 0.5


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


@pytest.mark.quick
def test_generate_speculative_lookup_json(tiny_ckpt, tiny_model, capsys):
    # "ccc c", 8 characters, gamma 2: the lookup draft is sometimes right and sometimes wrong here
    # (rejections, and an overshoot past n), so the counts below are not trivially consistent
    prompt, n, gamma = "ccc c", 8, 2
    argv = ["generate", prompt, "-n", str(n), "--seed", "2", "--ckpt", tiny_ckpt, "--json"]
    assert main(argv + ["--greedy", "--speculative", "lookup", "--gamma", str(gamma)]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main(argv + ["--greedy"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["outputs"][0]["text"] == plain["outputs"][0]["text"]  # greedy speculative == greedy
    # ... and both are greedy decoding written plainly (a full forward per step)
    assert plain["outputs"][0]["text"] == _book_greedy(tiny_model, prompt, n)
    assert spec["outputs"][0]["tokens"] == plain["outputs"][0]["tokens"]
    assert len(spec["outputs"][0]["tokens"]) == n and spec["outputs"][0]["finish_reason"] == "length"
    # the counts agree with each other (jaxdecode.speculative.loop.SpeculativeStats): gamma
    # proposals per target pass; each pass examines the proposals up to and including the first
    # rejection and emits the accepted ones plus one token, until n are made (overshooting by at
    # most gamma); one row, so the total is the row's
    st = spec["stats"]
    assert st == spec["outputs"][0]["stats"] and st["gamma"] == gamma == spec["settings"]["gamma"]
    assert st["proposed"] == gamma * st["passes"]
    assert 0 < st["accepted"] < st["examined"] <= st["proposed"]  # this case: some accepted, some not
    assert st["examined"] - st["accepted"] <= st["passes"]  # at most one rejection a pass
    assert st["generated"] == st["accepted"] + st["passes"]
    assert n <= st["generated"] <= n + gamma
    assert -(-n // (gamma + 1)) <= st["passes"] <= n
    assert st["acceptance_rate"] == pytest.approx(st["accepted"] / st["examined"])
    assert st["chars_per_pass"] == pytest.approx(st["generated"] / st["passes"])
    a = st["accepted"] / st["examined"]
    assert st["predicted_chars_per_pass"] == pytest.approx((1 - a ** (gamma + 1)) / (1 - a))


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
    from jaxdecode.models import checkpoint
    from jaxdecode.eval.studies import decoders

    lm = checkpoint.load(tiny_ckpt)
    res = decoders.compare(lm, corpus.read_text(), prompt="ghi\nabc", n=8, k=3)
    by = {r["decoder"]: r for r in res["rows"]}
    assert by["human"]["text"] == " def. gh"
    assert all(len(r["text"]) == 8 for r in res["rows"])
    with pytest.raises(ValueError, match="does not occur"):
        decoders.compare(lm, corpus.read_text(), prompt="zzz", n=8)


# ----------------------------------------------------------------------------- rule flags, cache


# the flags of `generate` that are not rules
NON_RULE_FLAGS = {"-n", "--help", "--num-samples", "--memory-budget", "--max-rows", "--seed", "--ckpt", "--stop", "--greedy", "--json", "--stream", "--quiet",
                  "--beam", "--length-penalty", "--n-best", "--speculative", "--gamma", "--ngram-order",
                  "--ngram-backoff", "--data", "--contrastive", "--regex", "--choice", "--json-schema", "--smc",
                  "--dtype", "--weights", "--no-generation-config"}


def _generate_parser():
    from jaxdecode.cli.app import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["generate"]


@pytest.mark.quick
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
    from jaxdecode.cli import app as cli
    from jaxdecode import rules

    parser = _generate_parser()
    args = parser.parse_args(["abc", "--no-repeat-ngram", "3", "--top-k", "5", "--temperature", "0.5"])
    settings = cli.rule_settings(args)
    assert settings == {"no_repeat_ngram": 3, "temperature": 0.5, "top_k": 5}
    assert type(settings["no_repeat_ngram"]) is int and type(settings["top_k"]) is int
    assert [type(r) for r in rules.make_rule(**settings).rules] == [
        rules.NoRepeatNGram, rules.Temperature, rules.TopK]
    from jaxdecode.cli.app import UsageError

    with pytest.raises(UsageError, match="argument --top-k: invalid int value: '2.5'"):
        parser.parse_args(["abc", "--top-k", "2.5"])


# ----------------------------------------------------------------------------- bad input, one line


def _one_line_error(capsys, *needles):
    """The captured stderr: exactly one line, ``jaxdecode: error: ...``, containing every needle."""
    cap = capsys.readouterr()
    err = cap.err
    assert err.startswith("jaxdecode: error: ") and len(err.strip().splitlines()) == 1, err
    assert "usage:" not in err and "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    assert cap.out == ""
    return err.strip()


@pytest.mark.quick
@pytest.mark.parametrize("argv, needles", [
    (["generate", "abc", "-n", "abc"], ["argument -n: invalid int value: 'abc'", "jaxdecode generate --help"]),
    (["generate", "abc", "--seed", "x"], ["argument --seed", "0 to 4294967295", "'x'"]),
    (["generate", "abc", "--seed", "-1"], ["argument --seed", "'-1'"]),
    (["generate", "abc", "--seed", str(2**32)], ["argument --seed", "4294967296"]),  # would repeat seed 0
    (["generate"], ["required: prompt", "(see: jaxdecode generate --help)"]),
    (["generate", "-x"], ["required: prompt", "goes after '--', as in: jaxdecode generate -- '-x'"]),
    (["score", "-abc"], ["required: text", "jaxdecode score -- '-abc'"]),
    (["generate", "abc", "--speculative", "foo"], ["invalid choice: 'foo'", "lookup"]),
    (["generate", "abc", "--contrastive", "4"], ["expected K,ALPHA"]),
    (["generate", "abc", "--top-k", "2.5"], ["argument --top-k: invalid int value"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'", "(see: jaxdecode --help)"]),
    (["study", "nope"], ["invalid choice: 'nope'", "beam-curse"]),
    (["train", "out", "--seed", "1.5"], ["argument --seed"]),
])
def test_argparse_errors_are_one_line(capsys, argv, needles):
    assert main(argv) == 2
    _one_line_error(capsys, *needles)


@pytest.mark.quick
@pytest.mark.parametrize("argv, needles", [
    (["generate", "abc", "--json", "--stream"], ["--stream and --json do not combine"]),
    (["generate", "abc", "--stream", "--num-samples", "2"], ["--stream shows one sample", "--num-samples 2"]),
    (["generate", "abc", "--stream", "--beam", "2"], ["--stream does not apply to --beam"]),
    (["generate", "abc", "--stream", "--choice", "ab", "--smc", "8"], ["--stream does not apply to --smc"]),
    (["generate", "abc", "--greedy", "--beam", "2"], ["--greedy does not combine with --beam"]),
    (["generate", "abc", "--data", "corpus.txt"], ["--data", "needs --speculative ngram or distilled"]),
    (["generate", "abc", "--ngram-order", "3"], ["need --speculative ngram or distilled"]),
    (["generate", "abc", "--speculative", "lookup", "--n-best", "2"], ["--n-best needs --beam"]),
    (["generate", "abc", "--beam", "2", "--gamma", "2"], ["--gamma needs --speculative"]),
    (["generate", "abc", "--contrastive", "4,0.6", "--length-penalty", "1"], ["--length-penalty needs --beam"]),
    (["generate", "abc", "--temperature", "inf"], ["--temperature must be a finite number, got inf"]),
    (["generate", "abc", "--beam", "2", "--top-p", "nan"], ["--top-p must be a finite number, got nan"]),
    (["generate", "abc", "--stop", ""], ["stop string must not be empty"]),
    (["generate", "abc", "--stop", "Z"], ["the stop string 'Z'", "'Z' at position 0"]),
    (["generate", "abXc"], ["the prompt contains characters outside the model's vocabulary: 'X' at position 2",
                            "jaxdecode info"]),
    (["generate", "abc", "--beam", "2", "-n", "3", "--stop", "Z"], ["the stop string 'Z'"]),
    (["score", "aZ"], ["the text contains", "'Z' at position 1"]),
    (["mode", "abc", "--budget", "0"], ["--budget must be >= 1"]),
    (["mode", "abc", "-n", "3", "--budget", "2"], ["exceeded its node budget of 2", "raise --budget or lower -n"]),
    (["eval", "--prompt", "ab"], ["--prompt needs --text"]),
    (["eval", "--windows", "0"], ["--windows must be >= 1"]),
    (["eval", "--text", ""], ["the text to score is empty"]),
])
def test_conflicting_or_bad_flags_are_refused_by_name(tiny_ckpt, capsys, argv, needles):
    assert main(argv + ["--ckpt", tiny_ckpt] if argv[0] != "eval" else argv[:1] + [tiny_ckpt] + argv[1:]) == 2
    _one_line_error(capsys, *needles)


def test_json_is_strict_without_characters(tiny_ckpt, capsys):
    """No characters: no mean log-probability, written as null (JSON has no NaN)."""
    assert main(["generate", "abc", "-n", "0", "--ckpt", tiny_ckpt, "--json"]) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out and json.loads(out)["outputs"][0] == {
        "prompt": "abc", "text": "", "mean_logprob": None, "tokens": [], "finish_reason": "length"}


def test_a_multi_line_error_message_is_printed_on_one_line(tiny_ckpt, capsys, monkeypatch):
    from jaxdecode.decoding import sampling

    def fail(*args, **kwargs):
        raise RuntimeError("compiling failed:\nline one\nline two")

    monkeypatch.setattr(sampling, "generate", fail)
    assert main(["generate", "abc", "-n", "2", "--ckpt", tiny_ckpt]) == 2
    assert _one_line_error(capsys) == "jaxdecode: error: compiling failed: line one line two"


def test_beam_help_says_rules_apply_to_the_beam_scores(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "rule flags (--temperature, --top-p, the penalties, ...) apply to the beam scores" in text
    assert "not with --json, --beam or --smc" in text  # --stream


def test_beam_with_a_rule_ranks_by_the_processed_scores(tiny_ckpt, capsys):
    """--beam with --top-k 1 keeps one token per step, of processed log-probability 0: the score is
    0, while the reported log-probability stays the model's."""
    assert main(["generate", "abc", "-n", "6", "--ckpt", tiny_ckpt, "--json", "--beam", "3", "--top-k", "1"]) == 0
    beam = json.loads(capsys.readouterr().out)["outputs"][0]
    assert beam["score"] == pytest.approx(0.0, abs=1e-5) and beam["logprob"] < -0.1


# ----------------------------------------------------------------------------- notes and progress


def test_prompt_longer_than_the_window_gets_a_note_and_a_bar(tiny_ckpt, capsys):
    prompt = "abc def. ghi abc de"  # 19 characters, T = 16
    assert main(["generate", prompt, "-n", "5", "--ckpt", tiny_ckpt, "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["outputs"][0]["prompt"] == prompt  # stdout: the JSON only
    lines = [line for line in cap.err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[0] == ("jaxdecode: note: the prompt has 19 characters: the model sees only the last 16 (its "
                        "window T), and each character generated past T runs the exact window path (a "
                        "forward over the last 16 characters per step), much slower than within T")
    assert any(line.startswith("past the window:") and "/5 " in line for line in lines[1:])
    # --quiet: nothing on stderr
    assert main(["generate", prompt, "-n", "5", "--ckpt", tiny_ckpt, "--json", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_generation_past_the_window_counts_the_slow_characters(tiny_ckpt, capsys):
    # (the shapes of the test above: one row, chunks of 8 steps, so nothing new compiles)
    assert main(["generate", "abc def. gh", "-n", "8", "--ckpt", tiny_ckpt]) == 0
    cap = capsys.readouterr()
    assert cap.err.startswith("jaxdecode: note: 3 of the 8 characters lie past the model's window T=16: each runs "
                              "the exact window path")
    assert "past the window:   0%" in cap.err and "/3 " in cap.err  # the bar counts the 3 slow characters
    assert cap.out.startswith("abc def. gh") and len(cap.out) == 11 + 8 + 1
    # within the window: nothing on stderr
    assert main(["generate", "abc", "-n", "8", "--ckpt", tiny_ckpt]) == 0
    assert capsys.readouterr().err == ""
    # exact search: the note, no bar
    assert main(["mode", "abc def. ghi abc", "-n", "1", "--ckpt", tiny_ckpt, "--json"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("jaxdecode: note: 1 of the 1 characters lies past the model's window T=16") and "%|" not in err


def test_the_native_build_says_so_once(monkeypatch, tmp_path, capsys):
    import subprocess

    from jaxdecode.native import kernels

    monkeypatch.setenv("JAXDECODE_CACHE", str(tmp_path))
    calls = []

    def fake_compiler(cmd, **kwargs):  # "compiles" into the temporary file the build names
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(kernels.subprocess, "run", fake_compiler)
    first = kernels.build()
    err = capsys.readouterr().err
    assert err.startswith("jaxdecode: compiling the native CPU kernels (once") and err.count("\n") == 1
    from pathlib import Path

    sources = sorted(str(f) for f in (Path(kernels.__file__).parent / "csrc").glob("*.cc"))
    assert sorted(c[c.index("-c") + 1] for c in calls[:-1]) == sources  # a compile per source
    assert "-shared" in calls[-1]  # then the link
    n = len(calls)
    assert kernels.build() == first and len(calls) == n
    assert capsys.readouterr().err == ""  # built: nothing to say


# ----------------------------------------------------------------------------- studies


def test_study_without_matplotlib_fails_before_any_work(tiny_ckpt, tiny_corpus, tmp_path, capsys, monkeypatch):
    import sys

    from jaxdecode.io import reports as common

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    out = tmp_path / "out"
    assert main(["study", "beam-curse", "--ckpt", tiny_ckpt, "--data", tiny_corpus, "--out", str(out)]) == 2
    _one_line_error(capsys, "the studies' figures need matplotlib", "pip install")
    assert not out.exists()
    with pytest.raises(common.MissingMatplotlib, match="matplotlib"):
        common.new_figure()


def test_study_that_fails_leaves_no_empty_folder(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "results" / "bc"
    argv = ["study", "beam-curse", "--ckpt", tiny_ckpt, "--data", str(tmp_path / "missing.txt"), "--out", str(out)]
    assert main(argv) == 2
    _one_line_error(capsys, "corpus not found at")
    assert not (tmp_path / "results").exists()
    assert main(["study", "beam-curse", "--prompts", "0", "--out", str(out)]) == 2
    _one_line_error(capsys, "--prompts must be >= 1, got 0")
    assert not (tmp_path / "results").exists()


def test_study_beam_curse_defaults_are_the_published_run(capsys):
    """The defaults of `study beam-curse` (run(), and what --help says) are the settings of the run
    in studies/char, whose numbers the README quotes."""
    import inspect
    from pathlib import Path

    from jaxdecode.eval.studies import beam_curse

    root = Path(__file__).resolve().parents[2]
    published = json.loads((root / "studies" / "char" / "beam-curse" / "beam_curse.json").read_text())
    defaults = {k: p.default for k, p in inspect.signature(beam_curse.run).parameters.items()
                if p.default is not p.empty}
    assert (defaults["n_prompts"], defaults["n"], list(defaults["ks"]), defaults["node_budget"], defaults["seed"]) == (
        published["prompts_total"], published["n"], published["ks"], published["node_budget"], published["seed"])
    with pytest.raises(SystemExit):
        main(["study", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"beam-curse: held-out prompts (default {defaults['n_prompts']})" in help_text
    assert f"beam-curse: characters searched (default {defaults['n']})" in help_text
    assert f"node budget (default {defaults['node_budget']:,})" in help_text
    # the README and docs/results.md quote exactly these numbers
    per_k = [published["per_k"][str(k)] for k in published["ks"]]
    rates = [f"{100 * p['mode_rate']:.0f}% (k = {k})" for k, p in zip(published["ks"], per_k)]
    gaps = [f"{p['mean_gap']:.2f}" for p in per_k]
    sentence = (f"exact mode of {published['n']} characters on {published['prompts_total']} held-out prompts: "
                f"beam search returns the mode for {', '.join(rates[:-1])} and {rates[-1]} of prompts, with mean "
                f"log-probability gaps of {', '.join(gaps[:-1])} and {gaps[-1]} nats")
    for page in ("README.md", "docs/results.md"):
        assert sentence in " ".join((root / page).read_text().split()), page


def test_study_speculative_from_the_command_line(tiny_ckpt, tiny_corpus, tmp_path, capsys, monkeypatch):
    """`study speculative` reads the draft's corpus from --data and writes its three files (a small
    sweep: the defaults run 8 x 400 characters on the shipped model)."""
    import functools

    from jaxdecode.eval.studies import speculative

    monkeypatch.setattr(speculative, "run", functools.partial(speculative.run, n=6, gammas=(2,), samples=1,
                                                              prompt="abc"))
    out = tmp_path / "spec"
    assert main(["study", "speculative", "--ckpt", tiny_ckpt, "--data", tiny_corpus, "--out", str(out),
                 "--quiet"]) == 0
    assert capsys.readouterr().out == f"wrote {out}: speculative.json, speculative.md, speculative.png\n"
    doc = json.loads((out / "speculative.json").read_text())
    assert list(doc["sweep"]["per_gamma"]) == ["2"] and doc["draft"] == "NGramDraft"
    assert doc["sweep"]["per_gamma"]["2"]["passes"] >= 1


# ----------------------------------------------------------------------------- info, the corpus


@pytest.mark.quick
def test_info_lists_each_field_once(capsys):
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    keys = [line.split()[0] for line in lines if line.strip()]
    assert len(keys) == len(set(keys)), keys
    assert keys.count("parameters") == 1 and "held_out_loss" in keys
    assert main(["info", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["parameters"] == 3_307_264 and "parameters" not in doc["provenance"]


class _Response:
    """What urlopen returns: ``body`` (bytes), or an exception raised while reading."""

    def __init__(self, body):
        self.body = body

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self):
        if isinstance(self.body, BaseException):
            raise self.body
        return self.body


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """A fresh working directory, no $JAXDECODE_DATA, and urlopen answering with ``offline.body``
    (default: no network)."""
    import urllib.error

    from jaxdecode.io import data as data_lib

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("JAXDECODE_DATA", raising=False)
    monkeypatch.delenv("JAXDECODE_OFFLINE", raising=False)  # the network is this fixture's fake
    state = {"body": urllib.error.URLError("[Errno -3] Temporary failure in name resolution")}

    def urlopen(url, timeout=None):
        assert url == data_lib.CORPUS_URL
        if isinstance(state["body"], OSError):
            raise state["body"]
        return _Response(state["body"])

    monkeypatch.setattr(data_lib.urllib.request, "urlopen", urlopen)
    return state


def test_jaxdecode_offline_never_downloads(offline, tmp_path, monkeypatch):
    """$JAXDECODE_OFFLINE=1 (what the tests set): a missing corpus is the corpus error, and the
    network is never asked, even when it would answer with the right file."""
    from jaxdecode.io import data as data_lib

    offline["body"] = ("First Citizen:\n" * 80_000)[:data_lib.CORPUS_CHARS].encode()
    monkeypatch.setenv("JAXDECODE_OFFLINE", "1")
    monkeypatch.setattr(data_lib, "_download", lambda dest: pytest.fail("downloaded"))
    with pytest.raises(data_lib.CorpusError, match="corpus not found"):
        data_lib.locate_corpus()
    assert not (tmp_path / "data").exists()


def test_offline_corpus_lookup_leaves_nothing_behind(offline, tmp_path, tiny_ckpt, capsys):
    import http.client

    from jaxdecode.io import data as data_lib

    for body, message in [(offline["body"], "the download failed (<urlopen error [Errno -3]"),
                          (http.client.IncompleteRead(b"First Citizen"), "the download failed (IncompleteRead"),
                          (b"<html>a captive portal</html>", "not the expected file (29 characters")]:
        offline["body"] = body
        with pytest.raises(data_lib.CorpusError, match="--data PATH") as e:
            data_lib.locate_corpus()
        assert message in str(e.value) and "\n" not in str(e.value)
        assert list(tmp_path.iterdir()) == []  # no data/ folder, no partial file
    capsys.readouterr()
    assert main(["eval", tiny_ckpt]) == 2  # the command line: one line, nothing left behind either
    err = capsys.readouterr().err
    assert err.count("jaxdecode: error: corpus not found and the download") == 1 and err.count("\n") == 2
    assert list(tmp_path.iterdir()) == []


def test_corpus_download_writes_the_file_or_nothing(offline, tmp_path, monkeypatch):
    from pathlib import Path

    from jaxdecode.io import data as data_lib

    text = ("First Citizen:\n" * 80_000)[:data_lib.CORPUS_CHARS]
    offline["body"] = text.encode()

    def disk_full(self, target):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(Path, "replace", disk_full)
        with pytest.raises(data_lib.CorpusError, match="could not be written .*No space left on device"):
            data_lib.locate_corpus()
    assert list(tmp_path.iterdir()) == []
    assert data_lib.locate_corpus() == data_lib.DEFAULT_PATH
    assert (tmp_path / "data" / "tinyshakespeare.txt").read_text() == text
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["tinyshakespeare.txt"]


def test_corpus_fixture_fails_on_a_missing_file_and_skips_when_unset(monkeypatch, tmp_path):
    import conftest
    from hypothesis import settings

    monkeypatch.setenv("JAXDECODE_DATA", str(tmp_path / "missing.txt"))
    with pytest.raises(pytest.fail.Exception, match="names .*missing.txt, which is not a file"):
        conftest.locate_test_corpus()
    monkeypatch.delenv("JAXDECODE_DATA")
    with pytest.raises(pytest.skip.Exception, match="set \\$JAXDECODE_DATA"):
        conftest.locate_test_corpus()
    # hypothesis draws the same examples on every run, unless a profile says otherwise
    import os

    if os.environ.get("HYPOTHESIS_PROFILE", "derandomized") == "derandomized":
        assert settings.default.derandomize and settings.default.database is None


# ----------------------------------------------------------------------------- eval, stop, escapes, train


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """A corpus in the tiny model's vocabulary, long enough for read_corpus (>= 10,000 characters)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("abc def. ghi\nabcab ba\n" * 600, encoding="utf-8")
    return str(path)


def test_eval_held_out_loss_and_text_score(tiny_ckpt, tiny_corpus, tmp_path, capsys):
    assert main(["eval", tiny_ckpt, "--data", tiny_corpus, "--windows", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["held_out_windows"] == 3 and 0 < doc["held_out_loss"] < 10
    # the loss by a plain loop: the held-out part of the corpus, 3 evenly spaced windows of T + 1
    # characters, each one forward, the mean negative log-likelihood of its T next characters
    import jax
    from jaxdecode.io import data as data_lib
    from jaxdecode.models import checkpoint
    from jaxdecode.models.charlm.transformer import forward

    lm = checkpoint.load(tiny_ckpt)
    T = lm.cfg.T
    _, val = data_lib.split(data_lib.read_corpus(tiny_corpus))
    held = lm.vocab.encode(val)
    nll = []
    for s in np.linspace(0, len(held) - T - 1, 3).astype(int):
        w = np.asarray(held[s:s + T + 1], np.int32)
        logits = np.asarray(forward(lm.params, lm.cfg, jax.numpy.asarray(w[None, :T]))[0], np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        nll += [-logp[t, w[t + 1]] for t in range(T)]
    assert doc["held_out_loss"] == pytest.approx(float(np.mean(nll)), abs=1e-4)
    assert main(["eval", tiny_ckpt, "--text", "abc", "--prompt", "ha", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mean_logprob"] == pytest.approx(
        _plain_logprobs(lm, "ha", "abc").mean(), abs=1e-4)
    assert main(["eval", tiny_ckpt, "--text", r"ab\nc", "--prompt", "ha", "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert set(scored) == {"checkpoint", "mean_logprob", "characters"} and scored["characters"] == 4
    assert main(["score", r"ab\nc", "--prompt", "ha", "--ckpt", tiny_ckpt, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mean_logprob"] == pytest.approx(scored["mean_logprob"], abs=1e-6)
    assert main(["eval", tiny_ckpt, "--text", "abc", "--held-out", "--data", tiny_corpus, "--windows", "3"]) == 0
    text = capsys.readouterr().out
    assert f"held_out_loss          {doc['held_out_loss']:.4f}" in text and "mean_logprob" in text
    # a corpus the checkpoint cannot read: named (capitals and punctuation, as in Tiny Shakespeare)
    foreign = tmp_path / "foreign.txt"
    foreign.write_text("KATHARINA:\nMoved! in good time: let him that moved you hither\n" * 400)
    assert main(["eval", tiny_ckpt, "--data", str(foreign), "--windows", "3"]) == 2
    _one_line_error(capsys, "the held-out part of the corpus", "outside the model's vocabulary")


@pytest.mark.quick
def test_stop_strings_and_finish_reason(tiny_ckpt, capsys):
    assert main(["generate", "abc", "-n", "12", "--stop", r"a\n", "--stop", "ab", "--num-samples", "8",
                 "--seed", "3", "--ckpt", tiny_ckpt, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["stop"] == ["a\n", "ab"]  # the escape unescaped
    reasons = [o["finish_reason"] for o in doc["outputs"]]
    assert "stop" in reasons and "length" in reasons, reasons
    for o in doc["outputs"]:
        first = min((o["text"].find(s) + len(s) for s in ("a\n", "ab") if s in o["text"]), default=None)
        if o["finish_reason"] == "stop":  # the text ends at the first stop string, which it keeps
            assert first == len(o["text"]) == len(o["tokens"])
        else:
            assert first is None and len(o["text"]) == 12


def test_escapes():
    from jaxdecode.cli.app import unescape

    assert unescape(r"a\tb\\n\nc\q\\") == "a\tb\\n\nc\\q\\"
    assert unescape("x\\") == "x\\"  # a trailing backslash stays


@pytest.mark.parametrize("text, shown", [(r"a\tb", r"'\t' at position 1"), (r"a\\nb", r"'\\' at position 1")])
def test_escapes_reach_the_model(tiny_ckpt, capsys, text, shown):
    """\\t becomes a tab and \\\\ one backslash (neither is in the tiny vocabulary: the error shows
    which character arrived)."""
    assert main(["score", text, "--ckpt", tiny_ckpt]) == 2
    _one_line_error(capsys, shown, "the text contains")


@pytest.mark.slow
def test_train_then_resume_then_eval(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    tiny = ["--data", tiny_corpus, "--d", "16", "--layers", "1", "--heads", "2", "--T", "32", "--batch", "2",
            "--warmup", "1", "--eval-every", "2", "--eval-windows", "2", "--quiet"]
    assert main(["train", str(out), "--steps", "2"] + tiny) == 0
    first = json.loads((out / "config.json").read_text())
    assert first["steps"] == 2 and len(first["loss_curve"]) == 1
    assert main(["train", str(out), "--steps", "4", "--resume"] + tiny) == 0
    assert f"resuming {out} at step 2" in capsys.readouterr().out
    meta = json.loads((out / "config.json").read_text())
    assert meta["steps"] == 4 and [s for s, _ in meta["loss_curve"]] == [2, 4]
    assert meta["loss_curve"][0] == first["loss_curve"][0]
    # the checkpoint loads, and eval reproduces the loss the run recorded
    assert main(["eval", str(out), "--data", tiny_corpus, "--windows", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recorded_held_out_loss"] == pytest.approx(doc["held_out_loss"], abs=1e-4)
    # resuming with other settings: refused by name, one line
    assert main(["train", str(out), "--steps", "6", "--resume", "--lr", "0.001"] + tiny) == 2
    _one_line_error(capsys, "cannot resume with different settings", "'lr'")


def test_speculative_with_the_shipped_draft_model(capsys):
    """--speculative draft: the shipped small model drafts for the shipped model; under --greedy
    the text is greedy decoding's."""
    argv = ["generate", r"KATHARINA:\nMoved! in good time: ", "-n", "24", "--greedy", "--json"]
    assert main(argv + ["--speculative", "draft"]) == 0
    cap = capsys.readouterr()
    spec = json.loads(cap.out)
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["outputs"][0]["text"] == plain["outputs"][0]["text"]
    assert spec["settings"]["speculative"] == "draft" and spec["settings"]["gamma"] == 2
    st = spec["stats"]
    assert st["accepted"] > 0 and st["passes"] < 24  # the draft is right often enough to save passes


# ----------------------------------------------------------------------------- serve-bench's engine flags

BENCH = ["serve-bench", "--requests", "4", "--rate", "50", "--slots", "2", "-n", "6", "--prefill-chunk", "4",
         "--sweep", "2", "--json", "--out", "", "--seed", "3", "--quiet"]


@pytest.fixture
def engines(monkeypatch):
    """Every serving engine a command builds, as the engine took its settings."""
    from jaxdecode.serving import engine as E

    made = []

    class Recorded(E.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(E, "Engine", Recorded)
    return made


def _plain_texts(lm, requests) -> list:
    """Each request of a serve-bench report generated alone (``jaxdecode.generate``, its rule
    rebuilt from the report's settings): (text, finish reason)."""
    import jaxdecode
    from jaxdecode import rules

    out = []
    for r in requests:
        rule = None if r["greedy"] else rules.chain(rules.temperature(r["rule"]["Temperature"]),
                                                     rules.top_p(r["rule"]["TopP"]))
        g = jaxdecode.generate(lm, r["prompt"], r["n"], seed=r["seed"], rule=rule, greedy=r["greedy"],
                               stop=r["stop"])[0]
        out.append((g.text, g.finish_reason))
    return out


def test_serve_bench_engine_flags_change_no_text(tiny_ckpt, tiny_corpus, tmp_path, capsys, engines):
    """``--admit-batch``, ``--prefill-budget`` and ``--step-model`` (simulated) and ``--no-overlap``
    (wall clock) each reach the engine or its clock, and each leaves every text as the defaults
    give it, which is what ``generate`` gives each request alone."""
    from jaxdecode.serving.engine import RealClock

    base = BENCH + ["--ckpt", tiny_ckpt, "--data", tiny_corpus]

    def run(*flags):
        engines.clear()
        assert main(base + list(flags)) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["identical_outputs"] is True and engines
        return doc, [(r["text"], r["finish_reason"]) for r in doc["requests"]]

    default, texts = run("--simulate")
    assert texts == _plain_texts(_load_tiny(tiny_ckpt), default["requests"])
    assert all(e.admit_batch == 1 and e.prefill_budget is None for e in engines)
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps({"a": 0.05, "b": 0.01, "c": 0.002}))
    for flags, took in ((["--admit-batch", "2"], lambda e: e.admit_batch == 2),
                        (["--prefill-budget", "3"], lambda e: e.prefill_budget == 3),
                        (["--step-model", str(steps)], lambda e: e.clock.step_model.a == 0.05)):
        doc, got = run("--simulate", *flags)
        assert all(took(e) for e in engines), flags
        assert got == texts, flags
        if flags[0] != "--admit-batch":  # a budget below the chunk and a slower clock: other schedules
            assert doc["runs"] != default["runs"], flags
    _, got = run("--no-overlap")
    assert all(not e.overlap for e in engines) and got == texts
    # without the flag an engine on the wall clock overlaps: the flag has something to turn off
    from jaxdecode.serving.engine import Engine

    assert Engine(_load_tiny(tiny_ckpt), 2, clock=RealClock()).overlap


@pytest.mark.quick
@pytest.mark.parametrize("flags, message", [
    (["--admit-batch", "0"], "--admit-batch must be an integer >= 1, got 0"),
    (["--admit-batch", "3"], "--admit-batch must be at most the --slots (2), got 3"),
    (["--prefill-budget", "0"], "--prefill-budget must be an integer >= 1, got 0"),
    (["--step-model", "missing.json"], "cannot read a step-time model from missing.json"),
    (["--admit-batch", "two"], "--admit-batch: invalid int value: 'two'"),
    (["--no-overlap=yes"], "--no-overlap: ignored explicit argument 'yes'"),
])
def test_serve_bench_bad_engine_flags_are_one_line(tiny_ckpt, tiny_corpus, capsys, flags, message):
    assert main(BENCH + ["--ckpt", tiny_ckpt, "--data", tiny_corpus, "--simulate"] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
