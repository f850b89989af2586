"""Prefix reuse on the dense cache (on by default) under random schedules: texts do not depend on
which slot's history a prompt reads from, nor on when requests arrive.

As in test_engine_schedules.py, a :class:`~jaxdecode.serving.simulator.StepClock` counts engine
steps, so a schedule replays the same admissions on any machine. Here every prompt is long enough
to reuse (past ``REUSE_MIN``): most share one head, several repeat exactly (concurrent requests,
samples), some continue another request's text (a chat's next turn), and one shares nothing. The
engines are kept between schedules, so free slots hold the histories of earlier schedules, and
decode calls spoil their first positions while they are free. Every sample's tokens and finish
reason must equal :func:`jaxdecode.generate` of its request alone.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

import jaxdecode
from jaxdecode import rules
from jaxdecode.serving.engine import Engine, Request
from jaxdecode.serving.simulator import StepClock
from support.engine import HEAD, long_window_lm

SCHEDULES = 400  # in CHUNKS tests; CI runs the first (50)
CHUNKS = 8
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def lm():
    return long_window_lm()


def _kinds(lm):
    """Request kinds by name: a request for a seed."""
    said = jaxdecode.generate(lm, HEAD + "a", 8, greedy=True)[0].text  # what the greedy kind says
    chain = rules.chain(rules.repetition_penalty(1.4), rules.top_p(0.9))
    return {
        "head": lambda s: Request(HEAD + "a", 10, seed=s),
        "head-greedy": lambda s: Request(HEAD + "a", 16, seed=s, greedy=True),
        "head-samples": lambda s: Request(HEAD + "a", 6, seed=s, num_samples=2),
        "head-penalized": lambda s: Request(HEAD + "bb", 9, seed=s, rule=chain),
        "head-stop": lambda s: Request(HEAD + "c", 12, seed=s, stop="e"),
        "next-turn": lambda s: Request(HEAD + "a" + said[:3], 6, seed=s),
        "later-turn": lambda s: Request(HEAD + "a" + said[:7] + " b", 7, seed=s, num_samples=2),
        "elsewhere": lambda s: Request("ihgf edcb aihg fedc", 6, seed=s),
    }


class _References(dict):
    """Every kind and seed through ``generate`` alone, computed when first asked for."""

    def __init__(self, lm):
        super().__init__()
        self.kinds, self.lm = _kinds(lm), lm

    def __missing__(self, key):
        r = self.kinds[key[0]](key[1])
        gens = jaxdecode.generate(self.lm, r.prompt, r.n, seed=r.seed, num_samples=r.num_samples, rule=r.rule,
                                  greedy=r.greedy, stop=r.stop)
        self[key] = [(g.tokens.tolist(), g.finish_reason) for g in gens]
        return self[key]


@pytest.fixture(scope="module")
def references(lm):
    return _References(lm)


def run_schedules(lm, references, seeds, key=None) -> int:
    """Run the schedules drawn from ``seeds`` (on engines of the settings each draws, or all on
    ``key``'s); returns the requests checked. A mismatch fails with the schedule that shows it."""
    kinds = references.kinds
    names = sorted(kinds)
    engines: dict = {}
    fixed = key
    checked = 0
    for seed in seeds:
        rnd = random.Random(seed)
        drawn = (rnd.choice((3, 4, 4)), rnd.choice((1, 2)), rnd.choice((True, False)), rnd.choice((1, 2)))
        key = drawn if fixed is None else fixed
        if key not in engines:
            slots, decode_steps, overlap, admit_batch = key
            engines[key] = Engine(lm, slots, decode_steps=decode_steps, prefill_chunk=8, overlap=overlap,
                                  admit_batch=admit_batch, clock=StepClock())
        engine = engines[key]
        picks = [(rnd.choice(names), rnd.choice(SEEDS)) for _ in range(rnd.randint(3, 8))]
        arrivals = [rnd.choice((0, 0, 1, 2, 3, 4, 5, 6, 8, 10, 13)) for _ in picks]
        reqs = [dataclasses.replace(kinds[name](s), arrival=float(a)) for (name, s), a in zip(picks, arrivals)]
        report = engine.run(reqs)
        for (name, s), a, res in zip(picks, arrivals, report.results):
            got = [(g.tokens.tolist(), g.finish_reason) for g in res.outputs]
            assert got == references[name, s], (
                f"schedule {seed} (slots, decode_steps, overlap, admit_batch = {key}): {name} seed {s} "
                f"arriving at step {a} of {list(zip(picks, arrivals))}")
            checked += 1
    hits = sum(e.prefix_counts()[1] for e in engines.values())
    assert hits > 0  # (reuse took place)
    return checked


@pytest.mark.parametrize("chunk", [0] + [pytest.param(c, marks=pytest.mark.slow) for c in range(1, CHUNKS)])
def test_random_schedules_with_reuse_give_generates_texts(lm, references, chunk):
    per = SCHEDULES // CHUNKS
    assert run_schedules(lm, references, range(chunk * per, (chunk + 1) * per)) >= 2 * per


@pytest.mark.quick
def test_a_few_schedules_on_one_engine(lm, references):
    """The quick subset's share: schedules of one engine's settings (one set of programs)."""
    assert run_schedules(lm, references, range(12), key=(4, 1, True, 1)) >= 24
