"""Constrained requests (regex, choice, JSON schema) in the continuous-batching engine.

Every constrained request's texts must be what ``jaxdecode.generate`` gives it alone with the same
settings and constraint, whatever else shares the batch, on the dense and the paged cache, both
backends, in multi-step calls and with the overlap of calls; every constrained text is in its
pattern's language. The references below call ``jaxdecode.generate`` request by request."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

import jaxdecode
from jaxdecode import constraints as C
from jaxdecode import rules
from jaxdecode.models.checkpoint import LanguageModel
from jaxdecode.serving.engine import Engine, Request
from jaxdecode.serving.simulator import StepClock, StepTimeModel, VirtualClock, with_arrivals
from jaxdecode.serving.warmup import count_compiles

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "llama"


def _virtual():
    return VirtualClock(StepTimeModel(1.0, 0.0, 0.0))


def _at_once(reqs):
    """The requests with every arrival at 0 (for the wall clock)."""
    return with_arrivals(reqs, [0.0] * len(reqs))


def _generate_each(lm, reqs):
    """The reference: each request through ``jaxdecode.generate`` alone."""
    return [jaxdecode.generate(lm, r.prompt, r.n, seed=r.seed, num_samples=r.num_samples, rule=r.rule,
                               greedy=r.greedy, stop=r.stop, constraint=r.constraint) for r in reqs]


def _assert_generates(report, reqs, refs, valid):
    """Tokens, text and finish reason of every sample equal generate's (log-probabilities to the
    last float32 units); every constrained text satisfies ``valid(constraint, text)``."""
    assert len(report.results) == len(refs)
    for r, res, ref in zip(reqs, report.results, refs):
        assert len(res.outputs) == len(ref)
        for got, want in zip(res.outputs, ref):
            assert got.tokens.tolist() == want.tokens.tolist(), (r.prompt, got.text, want.text)
            assert got.text == want.text and got.finish_reason == want.finish_reason
            np.testing.assert_allclose(got.model_logprobs, want.model_logprobs, rtol=0, atol=2e-5)
            np.testing.assert_allclose(got.sample_logprobs, want.sample_logprobs, rtol=0, atol=2e-5)
            if r.constraint is not None:
                assert valid(r.constraint, got.text), (r.constraint.pattern, got.text)


def _in_language(c, text):
    return re.fullmatch(c.pattern, text) is not None


def _spy_calls(engine):
    """Record each decode call's steps and whether it ran over a constraint table."""
    ex, calls = engine.executor, []
    many = ex.decode_many
    ex.decode_many = lambda *a, **kw: calls.append((a[3], ex._auto is not None)) or many(*a, **kw)
    if not engine.paged:
        one = ex.decode
        ex.decode = lambda *a, **kw: calls.append((1, ex._auto is not None)) or one(*a, **kw)
    return calls


# ----------------------------------------------------------------------------- the shipped model


@pytest.fixture(scope="module")
def shipped_case(backend):
    """The shipped character model on ``backend``, a mix of constrained and free requests with
    staggered arrivals, and each request's ``generate`` alone."""
    lm = jaxdecode.load(backend=backend)
    words = C.compile_regex(r"[a-z]+ [a-z]+", lm.vocab)
    who = C.compile_choices(["Romeo", "Juliet", "the Nurse"], lm.vocab)
    lords = C.compile_regex(r"(my|our) (lord|lady)(, (my|our) (lord|lady))*", lm.vocab)
    reqs = [
        Request("ROMEO:\nI", 10, seed=1, num_samples=2, constraint=words),
        Request("KING:\nI", 8, seed=2),
        Request("Who loves? ", 8, seed=3, greedy=True, constraint=who, arrival=1.0),
        Request("GLOUCESTER:\nGood ", 12, seed=7, num_samples=2, rule=rules.top_p(0.9), constraint=lords,
                stop=",", arrival=2.0),
        Request("Who? ", 8, seed=11, num_samples=2, constraint=who, arrival=2.0),
        Request("ROMEO:\nO", 4, seed=8, num_samples=2, constraint=words, arrival=5.0),
        Request("KING:\n", 4, seed=9, arrival=80.0),  # alone, after the others: no constraint table
    ]
    return lm, reqs, _generate_each(lm, reqs)


@pytest.mark.parametrize("cache", ["dense", pytest.param("paged", marks=pytest.mark.slow)])
def test_constrained_rows_match_generate_on_the_shipped_model(shipped_case, cache):
    """Regex and choice rows among free ones, arriving over time, in 3 slots (slots are reused by
    rows of other constraints): the engine's texts are generate's, in calls of up to 2 decode steps
    on a virtual clock, and with the overlap of calls on the wall clock."""
    lm, reqs, refs = shipped_case
    reasons = {g.finish_reason for r, ref in zip(reqs, refs) if r.constraint is not None for g in ref}
    assert {"stop", "length"} <= reasons  # rows the pattern ends, and rows that use all of n
    # some constrained row stops where the pattern lets it (no stop string): the stop decision
    assert any(g.finish_reason == "stop" and r.stop is None for r, ref in zip(reqs, refs) for g in ref
               if r.constraint is not None)
    kw = {"cache": "paged", "block_size": 8} if cache == "paged" else {}
    engine = Engine(lm, 3, prefill_chunk=4, decode_steps=2, clock=_virtual(), **kw)
    calls = _spy_calls(engine)
    _assert_generates(engine.run(reqs), reqs, refs, _in_language)
    assert engine.idle and any(k > 1 and constrained for k, constrained in calls)
    assert any(not constrained for _, constrained in calls)  # a stretch with no constrained row
    if cache == "paged":
        assert engine.allocator.num_free == engine.allocator.num_blocks
    engine = Engine(lm, 3, prefill_chunk=4, decode_steps=2, **kw)
    assert engine.overlap
    _assert_generates(engine.run(_at_once(reqs)), reqs, refs, _in_language)
    assert engine.idle


# ----------------------------------------------------------------------------- a Hugging Face model


def _json_valid(schema):
    def valid(c, text):
        if c.kind != "json-schema":
            return _in_language(c, text)
        doc = json.loads(text)
        return (set(doc) == {"name", "age"} and doc["name"] in schema["properties"]["name"]["enum"]
                and isinstance(doc["age"], int) and not isinstance(doc["age"], bool))
    return valid


@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_json_schema_and_end_tokens_on_the_llama(cache):
    """The Llama fixture (byte-level vocabulary, two end tokens: a constrained text ends with an
    end token in a final state): JSON-schema, regex and choice rows with free ones; every JSON text
    parses and satisfies the schema (checked by hand), and every text is generate's."""
    lm = jaxdecode.load(LLAMA)
    schema = {"type": "object", "properties": {"name": {"enum": ["Romeo", "Juliet", "Nurse"]},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    person = C.compile_json_schema(schema, lm.vocab)
    words = C.compile_regex(r"[a-z]+( [a-z]+){1,3}", lm.vocab)
    answer = C.compile_choices(["yes", "no", "maybe"], lm.vocab)
    reqs = [
        Request("The answer:", 30, seed=1, num_samples=3, constraint=person),
        Request("The café is", 12, seed=5, num_samples=2, rule=rules.top_k(8)),
        Request("ROMEO:", 10, seed=2, num_samples=2, constraint=words, arrival=1.0),
        Request("Is it?", 6, seed=3, greedy=True, constraint=answer, arrival=1.0),
        Request("The answer:", 30, greedy=True, constraint=person, arrival=2.0),
        Request("Hello", 10, seed=4, arrival=3.0),
        Request("Is it?", 6, seed=9, num_samples=3, constraint=answer, arrival=3.0),
    ]
    refs = _generate_each(lm, reqs)
    constrained = [g for r, ref in zip(reqs, refs) if r.constraint is not None for g in ref]
    assert {"eos", "length"} <= {g.finish_reason for g in constrained}  # (ended by an end token, or by n)
    kw = {"cache": "paged", "block_size": 8} if cache == "paged" else {}
    engine = Engine(lm, 4, prefill_chunk=8, decode_steps=4, clock=_virtual(), **kw)
    _assert_generates(engine.run(reqs), reqs, refs, _json_valid(schema))
    engine = Engine(lm, 3, prefill_chunk=8, **kw)  # overlap, one step a call
    _assert_generates(engine.run(_at_once(reqs)), reqs, refs, _json_valid(schema))
    assert engine.idle


# ----------------------------------------------------------------------------- checks, warm-up


@pytest.fixture(scope="module")
def tiny(tiny_model):
    cfg, params, vocab = tiny_model
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend="portable")


@pytest.mark.quick
def test_constrained_requests_are_checked_at_submit(tiny):
    lm = tiny
    engine = Engine(lm, 2)
    c = C.compile_regex(r"(abc ){2,}", lm.vocab)
    with pytest.raises(C.ConstraintError, match=r"request 0: .*too small .*shortest match takes 8"):
        engine.submit(Request("a", 5, constraint=c))
    with pytest.raises(C.ConstraintError, match="must be a compiled jaxdecode.constraints.Constraint"):
        engine.submit(Request("a", 9, constraint=r"(abc ){2,}"))
    other = C.compile_regex("ab", jaxdecode.load().vocab)
    with pytest.raises(C.ConstraintError, match="compiled for 65 tokens, the model has 12"):
        engine.submit(Request("a", 9, constraint=other))
    assert engine.idle and not engine.requests
    engine.submit(Request("a", 0, constraint=c))  # as generate: no tokens, no check against n
    assert engine.run().results[0].outputs[0].text == ""


@pytest.mark.quick
def test_ignore_eos_with_an_end_token_constraint_is_refused():
    lm = jaxdecode.load(LLAMA)
    c = C.compile_choices(["yes", "no"], lm.vocab)
    with pytest.raises(C.ConstraintError, match="ignore_eos"):
        Engine(lm, 1).submit(Request("Is it?", 4, constraint=c, ignore_eos=True))


@pytest.mark.parametrize("cache", ["dense", pytest.param("paged", marks=pytest.mark.slow)])
def test_warm_up_covers_the_constrained_programs(tiny, cache):
    """After a warm-up on constrained and free requests no arrival pattern compiles anything, and
    a pattern of the same table size compiled anew does not either (the table is an argument)."""
    lm = tiny
    ab = C.compile_regex(r"(ab|ba)+ c", lm.vocab)
    three = C.compile_choices(["cafe", "bad", "dig"], lm.vocab)
    reqs = [
        Request("abc", 7, seed=1, num_samples=2, constraint=ab),
        Request("hi", 8, seed=2, rule=rules.top_p(0.9)),
        Request("ga.", 6, seed=3, greedy=True, constraint=three),
        Request("e", 6, seed=4, num_samples=2, constraint=three, rule=rules.top_p(0.9)),
        Request("bad caf", 5, seed=5),
    ]
    refs = _generate_each(lm, reqs)
    kw = {"num_blocks": 12, "block_size": 4} if cache == "paged" else {}
    # arrivals spaced by engine steps, not seconds: the same admissions on any machine, however loaded
    make = lambda: Engine(lm, 3, cache=cache, prefill_chunk=4, decode_steps=2, clock=StepClock(), **kw)
    engine = make()
    assert engine.warm_up(reqs) > 0
    assert engine.idle and engine.warm_up(reqs) == 0
    spaced = with_arrivals(reqs, [float(i) for i in range(len(reqs))])
    for run_on, stream in ((engine, reqs), (make(), spaced)):
        with count_compiles() as counted:
            report = run_on.run(stream)
        assert counted[0] == 0
        _assert_generates(report, reqs, refs, _in_language)
    # a new pattern with as many states: the same table size, nothing compiled
    ba = C.compile_regex(r"(ba|ab)+ c", lm.vocab)
    assert ba is not ab and ba.states == ab.states
    again = [Request("abc", 7, seed=1, num_samples=2, constraint=ba)]
    with count_compiles() as counted:
        report = make().run(again)
    assert counted[0] == 0
    _assert_generates(report, again, _generate_each(lm, again), _in_language)
