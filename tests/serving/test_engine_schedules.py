"""The engine's texts do not depend on when requests arrive: time as a test input.

A :class:`~jaxdecode.serving.simulator.StepClock` counts engine steps instead of seconds, so a schedule (which request arrives
before which step) replays the same admissions, slot assignments and batch neighbours on any
machine, however loaded. Each schedule draws requests of every kind the engine serves (constrained
by a regex or a choice, greedy, penalized, stopped by a stop string, asking for top
log-probabilities, several samples), their arrival steps and the engine's settings (slots, decode
steps per call, prompt chunk, overlap, admission batch), and every sample's tokens must equal
:func:`jaxdecode.generate` of its request alone. The engines are kept between schedules, so every
schedule also starts on slots that held other kinds of rows before.

Speculative decoding does not run in the engine, so no schedule holds a speculative row.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

import jaxdecode
from jaxdecode import constraints as C
from jaxdecode import rules
from jaxdecode.models.checkpoint import LanguageModel
from jaxdecode.serving.engine import Engine, Request
from jaxdecode.serving.simulator import StepClock

CACHES = ("dense", "paged")
SCHEDULES = 1000  # per cache, in CHUNKS tests (so that the suite's workers share them); CI runs the
CHUNKS = 8  # first chunk of the dense cache (125 schedules), the full suite all of them
SLOTS = 3  # one slot count: every engine runs the same compiled programs


@pytest.fixture(scope="module")
def lm(tiny_model):
    cfg, params, vocab = tiny_model
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend="portable")


def _kinds(lm):
    """The kinds of request a schedule mixes (vocabulary `` abcdefghi.\\n``, window 16): a name and
    a request of that kind for a seed."""
    ab = C.compile_regex(r"(ab|ba)+ c", lm.vocab)
    three = C.compile_choices(["cafe", "bad", "dig"], lm.vocab)
    return {
        "regex": lambda s: Request("abc", 7, seed=s, num_samples=2, constraint=ab),
        "free": lambda s: Request("hi", 8, seed=s, rule=rules.top_p(0.9)),
        "choice-greedy": lambda s: Request("ga.", 6, seed=s, greedy=True, constraint=three),
        "choice-top-p": lambda s: Request("e", 6, seed=s, constraint=three, rule=rules.top_p(0.9)),
        "plain": lambda s: Request("bad caf", 5, seed=s),
        "penalized": lambda s: Request("aab", 9, seed=s, num_samples=2,
                                       rule=rules.chain(rules.repetition_penalty(1.5), rules.top_p(0.95))),
        "stop": lambda s: Request("dig ", 9, seed=s, stop=["c", "i."]),
        "top-logprobs": lambda s: Request("cab", 7, seed=s, top_logprobs=3, rule=rules.temperature(0.7)),
        "long-prompt": lambda s: Request("a big bad dice", 2, seed=s, stop="e"),
    }


SEEDS = (0, 1, 2)


class _References(dict):
    """Every kind and seed through ``generate`` alone, computed when first asked for."""

    def __init__(self, lm):
        super().__init__()
        self.kinds = _kinds(lm)
        self.lm = lm

    def __missing__(self, key):
        name, s = key
        r = self.kinds[name](s)
        gens = jaxdecode.generate(self.lm, r.prompt, r.n, seed=r.seed, num_samples=r.num_samples, rule=r.rule,
                                  greedy=r.greedy, stop=r.stop, constraint=r.constraint)
        self[key] = [(g.tokens.tolist(), g.finish_reason) for g in gens]
        return self[key]


@pytest.fixture(scope="module")
def references(lm):
    return _References(lm)


def _settings(rnd: random.Random, cache: str) -> tuple:
    """An engine's settings: those that change no program shape vary freely (decode steps per
    call are powers of two up to the setting, so 4 covers 1 and 2)."""
    return (SLOTS, rnd.choice((1, 2, 4)), rnd.choice((True, False)), rnd.choice((1, 2, SLOTS)), cache)


def _engine(lm, key, engines: dict) -> Engine:
    if key not in engines:
        slots, decode_steps, overlap, admit_batch, cache = key
        kw = {"num_blocks": 4 * slots + 2, "block_size": 4} if cache == "paged" else {}
        engine = Engine(lm, slots, cache=cache, decode_steps=decode_steps, prefill_chunk=4, overlap=overlap,
                        admit_batch=admit_batch, clock=StepClock(), **kw)
        engines[key] = engine
    return engines[key]


def run_schedules(lm, references, cache: str, seeds) -> int:
    """Run the schedules drawn from ``seeds``; returns how many requests were checked. A
    mismatch fails with the schedule that shows it (seed, settings, arrivals)."""
    kinds = _kinds(lm)
    names = sorted(kinds)
    engines: dict = {}
    checked = 0
    for seed in seeds:
        rnd = random.Random(seed)
        key = _settings(rnd, cache)
        engine = _engine(lm, key, engines)
        picks = [(rnd.choice(names), rnd.choice(SEEDS)) for _ in range(rnd.randint(2, 6))]
        arrivals = [rnd.choice((0, 0, 1, 2, 3, 5, 8, 13)) for _ in picks]
        reqs = [dataclasses.replace(kinds[name](s), arrival=float(a)) for (name, s), a in zip(picks, arrivals)]
        report = engine.run(reqs)
        assert engine.idle
        for (name, s), a, res in zip(picks, arrivals, report.results):
            got = [(g.tokens.tolist(), g.finish_reason) for g in res.outputs]
            assert got == references[name, s], (
                f"schedule {seed} (slots, decode_steps, overlap, admit_batch, cache = {key}): "
                f"{name} seed {s} arriving at step {a} of {list(zip(picks, arrivals))}")
            checked += 1
    return checked


# CI runs the first chunk on the dense cache (the default); the full suite every chunk on both caches
@pytest.mark.parametrize("cache, chunk", [("dense", 0)] + [pytest.param(cache, c, marks=pytest.mark.slow)
                                                         for cache in CACHES for c in range(CHUNKS)
                                                         if (cache, c) != ("dense", 0)])
def test_random_schedules_give_generates_texts(lm, references, cache, chunk):
    """SCHEDULES random schedules per cache (this test runs its share of them): every request's
    tokens and finish reason equal ``generate``'s alone."""
    per = SCHEDULES // CHUNKS
    seeds = range(chunk * per, (chunk + 1) * per)
    assert run_schedules(lm, references, cache, seeds) >= 2 * per


@pytest.mark.parametrize("cache", ["dense", pytest.param("paged", marks=pytest.mark.slow)])
def test_a_slot_serves_every_kind_after_every_kind(lm, references, cache):
    """One slot, filled with a request of each kind and then one of every other kind (dense: with
    overlap and four decode steps a call; paged: neither): no state of the first row (automaton
    state, penalty counts, stop tails, keys, top log-probabilities, done flags) reaches the
    second."""
    kinds = _kinds(lm)
    # overlap and multi-step calls on the dense cache, neither on the paged one (the schedules mix both)
    for overlap, decode_steps in [((True, 4), (False, 1))[CACHES.index(cache)]]:
        kw = {"num_blocks": 6, "block_size": 4} if cache == "paged" else {}
        engine = Engine(lm, 1, cache=cache, decode_steps=decode_steps, prefill_chunk=4, overlap=overlap,
                        clock=StepClock(), **kw)
        for first, second in itertools.permutations(sorted(kinds), 2):
            a, b = kinds[first](1), kinds[second](2)
            # the second arrives while the first still runs: it takes the slot the moment it frees
            report = engine.run([a, dataclasses.replace(b, arrival=1.0)])
            for name, s, res in ((first, 1, report.results[0]), (second, 2, report.results[1])):
                got = [(g.tokens.tolist(), g.finish_reason) for g in res.outputs]
                assert got == references[name, s], (first, second, overlap, decode_steps, name)


@pytest.mark.quick
@pytest.mark.parametrize("cache", CACHES)
def test_a_free_row_in_a_slot_that_held_a_constrained_one(lm, references, cache):
    """The schedule that cut a request short: a free row takes the slot of a constrained row that
    has ended, runs while no constrained row does, and then a constrained request joins. The
    slot's automaton state, left from the earlier row, must not mask the free row's tokens or
    end it (it did: ``[4, 7]``, finish "stop", instead of eight tokens)."""
    kinds = _kinds(lm)
    kw = {"num_blocks": 10, "block_size": 4} if cache == "paged" else {}
    engine = Engine(lm, 2, cache=cache, decode_steps=1, prefill_chunk=4, overlap=False, clock=StepClock(), **kw)
    picks = [("choice-top-p", 0, 0), ("free", 1, 7), ("choice-greedy", 2, 8)]
    report = engine.run([dataclasses.replace(kinds[k](s), arrival=float(t)) for k, s, t in picks])
    for (k, s, _), res in zip(picks, report.results):
        assert [(g.tokens.tolist(), g.finish_reason) for g in res.outputs] == references[k, s], k
