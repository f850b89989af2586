"""Prefix reuse on the dense cache (``jaxdecode.serving.reuse``): a prompt that starts with what a
slot holds (an earlier turn's prompt and text, a concurrent request, another sample) reads only
the rest, and every text stays what ``jaxdecode.generate`` gives the request alone."""

import pytest

import jaxdecode
from jaxdecode import constraints as C
from jaxdecode import rules
from jaxdecode.serving.engine import Engine, Request
from jaxdecode.serving.reuse import REUSE_MIN, next_piece, piece_width, resume_at
from jaxdecode.serving.simulator import StepTimeModel, VirtualClock
from jaxdecode.serving.warmup import count_compiles

from support.engine import HEAD, assert_same, long_window_lm

CHAIN = rules.chain(rules.repetition_penalty(1.4), rules.top_p(0.9))  # its state sees the whole prompt
UNIT = StepTimeModel(1.0, 0.0, 0.0)


@pytest.fixture(scope="module")
def lm():
    """A random model with a window of 64 (V=12) on the portable backend."""
    return long_window_lm()


def generated_alone(lm, reqs):
    return [jaxdecode.generate(lm, r.prompt, r.n, seed=r.seed, num_samples=r.num_samples, rule=r.rule,
                               greedy=r.greedy, stop=r.stop, constraint=r.constraint) for r in reqs]


def _served(engine, lm, reqs):
    """Run ``reqs`` on ``engine``; check every text against generate; the prompt tokens found."""
    before = engine.prefix_counts()
    report = engine.run(reqs)
    assert_same(report, generated_alone(lm, reqs))
    after = engine.prefix_counts()
    return report, after[1] - before[1]


def _chat(engine, lm, turns=3):
    """Turns of a conversation: each prompt is the last prompt, its text and a new line."""
    prompt, found = HEAD + "a", []
    for t in range(turns):
        req = Request(prompt, 8, seed=t, rule=CHAIN)
        report, hit = _served(engine, lm, [req])
        found.append((len(prompt), hit, sum(s.prefill_tokens for s in report.steps)))
        prompt = prompt + report.results[0].outputs[0].text + " bi"
    return found


@pytest.mark.quick
def test_piece_sizes_and_the_window():
    assert [next_piece(40, s, 8) for s in (0, 8, 20, 39)] == [8, 8, 4, 1]
    assert [piece_width(n, 128) for n in (1, 16, 17, 50, 128)] == [16, 16, 32, 64, 128]
    assert piece_width(5, 8) == 8  # never wider than a chunk
    assert resume_at(40, 30, 8, 64) == 30 and resume_at(40, 50, 8, 64) == 39  # the last token is run
    assert resume_at(40, REUSE_MIN - 1, 8, 64) == 0
    # near the window's end the first piece's width must fit: the start moves back
    assert resume_at(56, 55, 8, 64) == 55  # a piece of 1 token, padded to 8
    start = resume_at(56, 55, 16, 64)  # padded to 16: past the window
    assert start == 48 and start + piece_width(next_piece(56, start, 16), 16) <= 64
    assert resume_at(60, 59, 128, 30) == 0  # no start of at least REUSE_MIN leaves room for a piece


@pytest.mark.quick
def test_a_chat_reads_only_its_new_tokens(lm):
    """Each turn's prompt is the history so far: the slot the last turn left holds it (prompt and
    text but the last token), so only the rest is read; the texts are generate's."""
    engine = Engine(lm, 2, prefill_chunk=8, decode_steps=2, clock=VirtualClock(UNIT))
    found = _chat(engine, lm)
    assert found[0][1] == 0
    for (P, hit, run), (before, _, _) in zip(found[1:], found):
        assert hit >= before and run == P - hit  # at least the last prompt; nothing else read
    queried, hits, evictions = engine.prefix_counts()
    assert queried == sum(P - 1 for P, _, _ in found) and hits == sum(h for _, h, _ in found)
    assert evictions == 0


def test_no_prefix_caching_reads_every_prompt_and_keeps_the_texts(lm):
    engine = Engine(lm, 2, prefill_chunk=8, prefix_caching=False, clock=VirtualClock(UNIT))
    assert engine.prefix_counts() is None
    reqs = [Request(HEAD + "a", 6, seed=1, rule=CHAIN), Request(HEAD + "a bad", 6, seed=2, rule=CHAIN)]
    for r in reqs:
        report = engine.run([r])
        assert_same(report, generated_alone(lm, [r]))
        assert sum(s.prefill_tokens for s in report.steps) == len(r.prompt)
    # the int8 dense cache (a pool of one block a slot) recomputes every prompt as well
    assert Engine(lm, 2, kv_dtype="int8").prefix_counts() is None


def test_samples_concurrent_requests_and_constraints_share_a_prefix(lm):
    """Three slots: two samples, a request with the same start arriving while they decode (read
    from a slot a sample holds), two samples admitted one at a time (the second read from the
    first's slot), a constrained request, a greedy one and a miss; then all at once with several
    decode steps a call and overlap (wall clock), twice (the second time every prompt finds its
    start in a free slot)."""
    words = C.compile_regex(r"[a-i]+ [a-i]+\.", lm.vocab)
    reqs = [Request(HEAD + "e", 10, seed=4, num_samples=2, rule=CHAIN),
            Request(HEAD + "ddd", 6, seed=9, rule=CHAIN, arrival=3.0),
            Request(HEAD + "e", 8, seed=6, num_samples=2, rule=CHAIN, arrival=4.0),
            Request(HEAD + "ab", 12, seed=5, constraint=words, arrival=9.0),
            Request(HEAD + "gh", 6, greedy=True, arrival=10.0),
            Request("ggg fff eee ddd ccc b", 5, seed=3, arrival=11.0)]
    engine = Engine(lm, 3, prefill_chunk=8, clock=VirtualClock(UNIT))
    busy, seat = [], engine._seat

    def spy(row, free, group):  # whether each reused prefix is read from a slot another row holds
        slot = seat(row, free, group)
        if slot is not None and row.source is not None:
            busy.append(engine._slots[row.source] is not None)
        return slot

    engine._seat = spy
    report, hit = _served(engine, lm, reqs)
    assert True in busy and False in busy
    assert hit >= 4 * REUSE_MIN  # the third sample, and the three later requests with the head
    assert sum(s.prefill_tokens for s in report.steps) < sum(len(r.prompt) * r.num_samples for r in reqs) - hit + 1
    at_once = [Request(r.prompt, r.n, seed=r.seed, num_samples=r.num_samples, rule=r.rule, greedy=r.greedy,
                       constraint=r.constraint) for r in reqs]
    wall = Engine(lm, 3, prefill_chunk=8, decode_steps=4)
    assert wall.overlap
    _served(wall, lm, at_once)
    _served(wall, lm, at_once)  # again: now every prompt finds its start in a free slot


def test_a_slot_whose_piece_read_another_source_is_not_written_again_while_it_decodes(lm):
    """Four slots. V leaves its history in slot 3, whose first position decode calls then spoil.
    W1 and W2 arrive together with V's prompt: W1 takes slot 3 (a free source wins a tie), W2 reads
    from U's busy slot, and one piece serves both, read from U's slot (W2 sits in a lower slot), so
    slot 3 is written whole. Z then continues W1's text and reads from slot 3 while W1 decodes: a
    mark left on slot 3 would have Z write its first positions again there, W1's next-token logits
    with them, and W1's text would leave generate's."""
    prompt, w1 = HEAD + "a", dict(seed=21, greedy=True)
    said = jaxdecode.generate(lm, prompt, 12, **w1)[0].text
    reqs = [Request("bbc dabc.gig hhe f", 2, seed=1), Request(prompt, 40, seed=2),
            Request("cbc dabc.gig hhe f", 2, seed=3), Request(prompt, 3, seed=4),
            Request(prompt, 20, arrival=5.5, **w1), Request(prompt, 20, seed=5, arrival=5.5),
            Request(prompt + said[:8], 6, seed=6, arrival=18.5)]
    engine = Engine(lm, 4, prefill_chunk=8, clock=VirtualClock(UNIT))
    sources, seat = {}, engine._seat

    def spy(row, free, group):
        slot = seat(row, free, group)
        sources[row.req] = (slot, row.source)
        return slot

    engine._seat = spy
    _served(engine, lm, reqs)
    assert sources[4] == (3, 3) and sources[5][1] == 1 and sources[5][0] < 3  # W1 own slot 3, W2 from U's
    assert sources[6][1] == 3  # Z reads W1's slot


def test_least_recently_left_slot_is_evicted(lm):
    """Two slots: X and Y leave histories; X again reuses its slot; a miss Z evicts Y's (left
    longest ago), so a later Y-turn misses while an X-turn still hits."""
    engine = Engine(lm, 2, prefill_chunk=8, clock=VirtualClock(UNIT))
    px, py = HEAD + "ia", "ihgf edcb aihg fedc"
    hits = []
    for prompt in (px, py, px + " b", "ccc ddd eee fff ggg", px + " c", py + " d"):
        hits.append(_served(engine, lm, [Request(prompt, 4, seed=1)])[1])
    assert hits[0] == hits[1] == hits[3] == hits[5] == 0
    assert hits[2] >= len(px) - 1 and hits[4] >= len(px) - 1
    assert engine.prefix_counts()[2] == 2  # Z evicted Y's history, the last Y-turn Z's


def test_a_history_that_reached_the_window_is_cut_where_it_is_valid(lm):
    """A row that filled the window (prompt + n = T): the next prompt, its history cut to 56
    tokens, starts where a piece still fits in the window."""
    engine = Engine(lm, 1, prefill_chunk=16, decode_steps=4, clock=VirtualClock(UNIT))
    first = Request(HEAD + "bad cafe hide bag be", 24, seed=2, rule=CHAIN)
    report, _ = _served(engine, lm, [first])
    assert len(first.prompt) + len(report.results[0].outputs[0].tokens) == 64
    history = (first.prompt + report.results[0].outputs[0].text)[:56]
    _, hit = _served(engine, lm, [Request(history, 8, seed=3, rule=CHAIN)])
    assert hit == 48


def test_warm_up_covers_the_pieces_after_a_reused_start(lm):
    """After a warm-up, requests that reuse a start (one at a time, then all at once) compile
    nothing: the widths of the first piece after a reused start, and the decode spans of free slots
    that keep a history."""
    reqs = [Request(HEAD + "a", 6, seed=1, rule=CHAIN), Request(HEAD + "a bad cab", 6, seed=2, rule=CHAIN),
            Request(HEAD + "a bad cab gig hide", 5, greedy=True)]
    refs = generated_alone(lm, reqs)
    engine = Engine(lm, 2, prefill_chunk=32, decode_steps=2)  # pieces after a reused start: 16 and 32 wide
    assert engine.warm_up(reqs) > 0
    with count_compiles() as counted:
        reports = [engine.run([r]) for r in reqs] + [engine.run(reqs)]
    assert counted[0] == 0 and engine.prefix_counts()[1] > 0
    for report, want in zip(reports, [[ref] for ref in refs] + [refs]):
        assert_same(report, want)


def test_prefix_counters_reach_the_metrics(lm):
    """The server's loop over a dense engine: ``/metrics``' prefix cache counters."""
    from jaxdecode.server.metrics import Metrics
    from jaxdecode.server.runner import EngineLoop

    engine = Engine(lm, 1, prefill_chunk=8, clock=VirtualClock(UNIT))
    loop, metrics = EngineLoop(engine), Metrics()

    def serve(key, prompt):
        loop.submit(key, Request(prompt, 2, seed=1), True)
        for _ in range(100):
            loop.turn()
            if engine.idle:
                break
        metrics.add(loop.take_stats())

    def value(name):
        text = metrics.render().decode()
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith(f"jaxdecode_prefix_cache_{name}_total ")))

    serve("a", HEAD + "a")
    serve("b", HEAD + "a")
    assert value("queries") == 2 * len(HEAD) and value("hits") == len(HEAD) and value("evictions") == 0
    serve("c", "ccc ddd eee fff ggg h")
    assert value("evictions") == 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "portable"])
def test_native_backend_and_speculative_engine_reuse(backend):
    """The native backend's attention over a reused slot, and a speculative engine (its passes write
    several positions in every slot): the texts are those with prefix caching off."""
    from jaxdecode import speculative as SP

    lm = long_window_lm(backend)
    engine = Engine(lm, 2, prefill_chunk=8, decode_steps=2)
    assert _chat(engine, lm)[-1][1] > 0
    prompts = [HEAD + "a", HEAD + "a bad", HEAD + "ccc", HEAD + "a bad cab"]
    draft = SP.PromptLookupDraft(2)
    texts = {}
    for caching in (True, False):
        spec = Engine(lm, 2, prefill_chunk=8, speculative=draft, gamma=3, prefix_caching=caching,
                      clock=VirtualClock(UNIT))
        texts[caching] = [spec.run([Request(p, 10, seed=i, rule=rules.top_p(0.9))]).results[0].outputs[0].text
                          for i, p in enumerate(prompts)]
        if caching:
            assert spec.prefix_counts()[1] > 0
    assert texts[True] == texts[False]
