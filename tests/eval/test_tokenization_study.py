"""The tokenization study on the tiny trained BPE Llama (tests/fixtures/bpe/llama): its string
probabilities (plain and healed) against a brute force over every spelling scored by plain
forwards, its canonical check against the tokenizer, its interval against scipy's, its refusal of
a character model, a language too large to enumerate, and one seed writing the same JSON twice."""

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxdecode.eval import studies
from jaxdecode.eval.studies import tokenization as T

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bpe" / "llama"
# The study's enumeration and the brute force run the float32 model through two different programs
# (batched rows padded to a power-of-two width, against one plain forward per spelling): their
# log-probabilities differ by float32 rounding, about 1e-7 a token, a few 1e-6 over a string of
# 15 tokens. The faults these tests are there to catch (a spelling left out of P, the end token's
# probability forgotten, the end step counted in the removed nats) move them by 1e-2 or more.
REL = 1e-5


@pytest.fixture(scope="module")
def bpe():
    import jaxdecode

    return jaxdecode.load(FIXTURE)


@pytest.fixture(scope="module")
def char_lm(tiny_model):
    from jaxdecode.models.checkpoint import LanguageModel

    cfg, params, vocab = tiny_model
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={})


def _spellings(lm, text: str) -> list[list[int]]:
    """Every way to cut ``text``'s bytes into plain tokens of the vocabulary."""
    plain: dict[bytes, list[int]] = {}
    for i in range(len(lm.vocab)):
        b = lm.vocab.token_bytes(i)
        if b and i not in lm.eos_ids and i not in lm.vocab.special:
            plain.setdefault(b, []).append(i)
    data = text.encode("utf-8")

    def cut(at):
        if at == len(data):
            yield []
            return
        for j in range(at + 1, len(data) + 1):
            for i in plain.get(data[at:j], ()):
                for rest in cut(j):
                    yield [i, *rest]

    return list(cut(0))


def _brute_force(lm, prompt_ids, strings, ends_speech: bool, tail: str = ""):
    """P and Q by string, log P(language) over every spelling and over canonical ones, and
    E_Q of the nats removed before the end token, from one plain forward per spelling. A token is
    allowed where the bytes so far followed by its bytes begin a string (``tail`` + one of
    ``strings``, a prefix-free set); an end token, where they are one. ``P``: the product of the
    model's probabilities (times the end token's at the end of a speech); ``Q``: of each
    probability over the allowed tokens' sum."""
    eos = lm.eos_ids[0]
    forward = jax.jit(lm.decoder.forward)  # compiled once per padded width
    full = [tail + s for s in strings]
    tokens_bytes = [lm.vocab.token_bytes(i) for i in range(len(lm.vocab))]
    special = set(lm.eos_ids) | set(lm.vocab.special)
    plain = [i for i in range(len(lm.vocab)) if tokens_bytes[i] and i not in special]
    p_raw, q, removed, canonical_p = {}, {}, 0.0, 0.0
    for s, text in zip(strings, full):
        for sp in _spellings(lm, text):
            ids = np.array([*prompt_ids, *sp, *([eos] if ends_speech else [])], np.int32)
            # padded at the end to a power of two (the model is causal: the positions read below
            # do not see the padding), so that one compiled forward serves many spellings
            width = 1 << max(0, len(ids) - 1).bit_length()
            padded = np.pad(ids, (0, width - len(ids)))[None]
            logits = np.asarray(forward(lm.params, padded)[0][0, :len(ids)], np.float64)
            logp = logits - logits.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            at = len(prompt_ids) - 1
            done, lp, lq, nats = b"", 0.0, 0.0, 0.0
            for t, tok in enumerate(sp + ([eos] if ends_speech else [])):
                row = logp[at + t]
                if tok == eos:
                    allowed = [eos] if done.decode() in full else []
                else:
                    allowed = [v for v in plain
                               if any(f.encode().startswith(done + tokens_bytes[v]) for f in full)]
                log_z = np.log(np.exp(row[allowed]).sum())
                lp += row[tok]
                lq += row[tok] - log_z
                if tok != eos:
                    nats -= log_z
                    done += tokens_bytes[tok]
            p_raw[s] = p_raw.get(s, 0.0) + math.exp(lp)
            q[s] = q.get(s, 0.0) + math.exp(lq)
            removed += math.exp(lq) * nats
            if lm.vocab.encode_piece(text).tolist() == sp:
                canonical_p += math.exp(lp)
    total = sum(p_raw.values())
    return ({s: v / total for s, v in p_raw.items()}, q, math.log(total), math.log(canonical_p), removed)


@pytest.mark.parametrize("ends_speech, prompt, strings", [
    (True, "{end}ROMEO:\n", ["Yes.", "Yes!", "Nay."]),
    (False, "{end}", ["First Watchman:", "NURSE:"]),
])
def test_string_probabilities_match_a_brute_force_over_every_spelling(bpe, ends_speech, prompt, strings):
    import re

    prompt_ids = bpe.vocab.encode(T._text(bpe, prompt))
    pattern = "|".join(f"(?:{re.escape(s)})" for s in strings)
    c = T.language_constraint(bpe, pattern, ends_speech)
    n = T.longest_output(c) + ends_speech
    assert n - ends_speech == max(len(s.encode()) for s in strings)  # single bytes: the longest spelling
    ex = T.exact_language(bpe, prompt_ids, c, n)
    P, Q, lz, lz_canon, removed = _brute_force(bpe, prompt_ids, strings, ends_speech)
    assert any(len(_spellings(bpe, s)) > 1 for s in strings)  # more than one spelling to sum
    assert ex["token_sequences"] == sum(len(_spellings(bpe, s)) for s in strings)
    assert set(ex["_P"]) == set(P) == set(strings)
    for s in strings:
        assert ex["_P"][s] == pytest.approx(P[s], rel=REL)
        assert ex["_Q"][s] == pytest.approx(Q[s], rel=REL)
    assert sum(Q.values()) == pytest.approx(1.0, rel=1e-9)
    assert ex["log_p_language"] == pytest.approx(lz, rel=REL)
    assert ex["log_p_language_canonical"] == pytest.approx(lz_canon, rel=REL)
    assert ex["removed_nats"] == pytest.approx(removed, rel=REL)
    tv = 0.5 * sum(abs(P[s] - Q[s]) for s in strings)
    assert ex["tv"] == pytest.approx(tv, rel=REL)


def test_healing_cuts_the_tail_and_matches_a_brute_force(bpe):
    lang = next(lang for lang in T.LANGUAGES if lang.name == "after-space")
    prompt_ids = bpe.vocab.encode(T._text(bpe, lang.prompt))
    tail = T.heal_tail(bpe, prompt_ids)
    assert tail == " "  # the prompt ends in a space, a prefix of " the", " and", ...
    # ":" begins no other token
    assert T.heal_tail(bpe, bpe.vocab.encode(T._text(bpe, "{end}ROMEO:"))) is None
    strings = ["night.", "friar!"]
    c = T.language_constraint(bpe, " (?:night\\.|friar!)", False)
    ex = T.exact_language(bpe, prompt_ids[:-1], c, T.longest_output(c), tail=tail)
    P, Q, lz, _, _ = _brute_force(bpe, prompt_ids[:-1], strings, False, tail=tail)
    assert set(ex["_P"]) == set(strings)
    for s in strings:
        assert ex["_P"][s] == pytest.approx(P[s], rel=REL)
        assert ex["_Q"][s] == pytest.approx(Q[s], rel=REL)
    assert ex["log_p_language"] == pytest.approx(lz, rel=REL)


@pytest.mark.quick
def test_canonical_check_against_the_tokenizer(bpe):
    v = bpe.vocab
    canonical = T.Canonical(v, bpe.eos_ids)
    text = "Watchman and the lovers"
    ids = v.encode_piece(text).tolist()
    assert canonical(ids) and canonical(ids + [bpe.eos_ids[0]])  # the end token is not text
    at = next(i for i, t in enumerate(ids) if len(v.token_bytes(t)) > 1)
    split = ids[:at] + [v.encode_piece(ch).tolist()[0] for ch in v.decode([ids[at]])] + ids[at + 1:]
    assert v.decode(split) == text and split != ids
    assert not canonical(split)
    assert T.share([True, False, False, True]) == {"count": 2, "of": 4, "share": 0.5,
                                                    "ci95": list(T.wilson(2, 4))}


def test_wilson_interval_matches_scipy():
    from scipy import stats

    for k, n in ((0, 10), (3, 256), (128, 256), (256, 256)):
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert T.wilson(k, n) == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_a_character_model_is_refused_in_one_line_and_all_skips_it(char_lm, tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError) as err:
        T.run(char_lm, tmp_path / "t", progress=False)
    msg = str(err.value)
    assert "\n" not in msg and "subword vocabulary" in msg and "--ckpt shakespeare-bpe" in msg
    assert not (tmp_path / "t").exists()
    monkeypatch.setattr(studies, "STUDIES", {"tokenization": studies.STUDIES["tokenization"]})
    assert studies.run_command("all", char_lm, str(tmp_path), progress=False, echo=lambda s: None) == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxdecode: skipping tokenization: ") and "subword" in err[0]


@pytest.mark.slow
def test_one_seed_writes_the_same_json_twice(bpe, tmp_path):
    small = dict(samples=16, plain_tokens=8, particles=(16,), line_tokens=12)
    res = T.run(bpe, tmp_path / "a", progress=False, **small)
    T.run(bpe, tmp_path / "b", progress=False, **small)
    for name in ("tokenization.json", "tokenization.png", "tokenization.md"):
        assert (tmp_path / "a" / name).stat().st_size > 0
    a = (tmp_path / "a" / "tokenization.json").read_bytes()
    assert a == (tmp_path / "b" / "tokenization.json").read_bytes()
    doc = json.loads(a)
    assert doc["seed"] == 0 and doc["model"]["path"] == str(FIXTURE) and doc["settings"]["samples"] == 16
    assert doc["languages"] == res["languages"] and "_P" not in json.dumps(doc)
    langs = {lang["name"]: lang for lang in doc["languages"]}
    assert not langs["line"]["enumerated"] and langs["heading"]["enumerated"]
    assert langs["after-space"]["healing"]["applies"] and not langs["heading"]["healing"]["applies"]
    for lang in doc["languages"]:
        if lang["enumerated"]:
            assert sum(r["p"] for r in lang["exact"]["rows"]) == pytest.approx(1.0, abs=1e-4)
            assert 0.0 <= lang["exact"]["noncanonical_q"] <= 1.0
    md = (tmp_path / "a" / "tokenization.md").read_text()
    assert "(tokenization.png)" in md and "## What the numbers show" in md


def test_a_language_past_max_outputs_gets_sampled_numbers(bpe):
    heading = next(lang for lang in T.LANGUAGES if lang.name == "heading")
    ticks = []
    out = T.study_language(bpe, heading, samples=8, particles=(8,), seed=0, max_outputs=5, line_tokens=12,
                           tick=ticks.append)
    assert not out["enumerated"] and out["why_not"] == "more than 5 token sequences" and sum(ticks) == 2
    sampled = out["sampled"]
    assert sampled["masked_samples"]["noncanonical"]["of"] == 8 and sampled["particles"] == 8
    assert sum(sampled["words"]["smc"].values()) == pytest.approx(1.0)



def test_the_study_command_defaults_to_the_shipped_subword_model(char_lm, tmp_path, monkeypatch):
    """``jaxdecode study tokenization`` with no --ckpt runs on shakespeare-bpe (the one shipped model
    it applies to); ``all`` gives the other studies the caller's model."""
    import jaxdecode
    from jaxdecode.cli.app import main

    ran = []

    def fake_run(n, lm, folder, **kw):
        ran.append((n, bool(getattr(lm.vocab, "subword", False))))
        Path(folder).mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(studies, "run_study", fake_run)
    monkeypatch.setattr("jaxdecode.io.reports.require_matplotlib", lambda: None)
    assert main(["study", "tokenization", "--out", str(tmp_path / "t"), "--quiet"]) in (0, None)
    assert ran == [("tokenization", True)]
    ran.clear()
    monkeypatch.setattr(studies, "STUDIES", {k: studies.STUDIES[k] for k in ("truncation", "tokenization")})
    studies.run_command("all", lambda: char_lm, str(tmp_path / "all"), progress=False, echo=lambda s: None,
                        load_default=jaxdecode.load)
    assert ran == [("truncation", False), ("tokenization", True)]
