import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.compiled import optimized_jit
from jaxdecode.decoding import beam as BS
from jaxdecode.eval import exact
from jaxdecode.models.charlm import transformer as M
from jaxdecode.decoding import sampling as S
from jaxdecode.models import FunctionModel, decoder_for


@functools.partial(jax.jit, static_argnums=1)
def _forward(params, cfg, tokens):
    return M.forward(params, cfg, tokens)


def _next_logprobs(params, cfg, seqs, width, forward=None):
    """Next-token log-probabilities [len(seqs), V] after each sequence (all of one length).

    A full forward over each whole sequence, as the book's ``model(x)[:, -1]`` (which keeps the
    last T tokens). Up to ``width`` (<= T) tokens the rows are right-padded to ``width`` and read
    at their last real position: the causal mask keeps the padding out, and a fixed width
    compiles once.
    """
    L = len(seqs[0])
    if L > width:
        x = np.array([s[-cfg.T:] for s in seqs], np.int32)
        at = x.shape[1] - 1
    else:
        x = np.zeros((len(seqs), width), np.int32)
        x[:, :L] = seqs
        at = L - 1
    logits = (forward or _forward)(params, cfg, jnp.asarray(x))[:, at]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)


def _plain_beam(params, cfg, prompt, n, k, width=None, forward=None):
    """The book's beam: per hypothesis the top k next tokens, all candidates sorted, the best k kept."""
    width = cfg.T if width is None else width
    beams = [(0.0, [int(t) for t in prompt])]  # (log-probability, sequence)
    for _ in range(n):
        lps = _next_logprobs(params, cfg, [seq for _, seq in beams], width, forward)  # one call for all beams
        cand = []
        for (score, seq), lp in zip(beams, lps):
            top = np.argsort(-lp, kind="stable")[:k]
            cand += [(score + lp[i], seq + [int(i)]) for i in top]
        beams = sorted(cand, key=lambda c: -c[0])[:k]
    score, seq = beams[0]
    return seq[len(prompt):], score


# ----------------------------------------------------------------------------- against the book's beam


# ragged prompts, all shorter than T = 16; the tests share one batch bucket (4) and chunk (8) so
# that they share compiled programs
PROMPTS = [np.array([1, 2, 3]), np.array([4]), np.arange(10) % 12, np.array([7, 7, 0, 11, 5])]


@pytest.mark.quick_ids('native-5', 'portable-2')
@pytest.mark.parametrize("k", [1, 2, 5])
def test_beam_equals_plain_beam(tiny_lm, k):
    cfg, params, model = tiny_lm.cfg, tiny_lm.params, tiny_lm.decoder
    for n in (6, 22):  # 6 stays in the cache; 22 runs past T=16 for every prompt: the window mode
        res = BS.beam_search(model, params, PROMPTS, n, k, chunk=8)
        for i, p in enumerate(PROMPTS):
            tokens, score = _plain_beam(params, cfg, p, n, k)
            h = res.best(i)
            assert h.tokens.tolist() == tokens, (k, n, i)
            assert h.score == pytest.approx(score, abs=1e-4)
            assert h.logprob == pytest.approx(score, abs=1e-4)  # no rule: the model's log-probability
            assert not h.finished


def test_prompt_longer_than_T(tiny_lm):
    cfg, params, model = tiny_lm.cfg, tiny_lm.params, tiny_lm.decoder
    prompts = [np.arange(20) % cfg.V, np.array([3, 1]), np.array([9])]  # all in the window mode
    res = BS.beam_search(model, params, prompts, 5, 2, chunk=8)
    for i, p in enumerate(prompts):
        tokens, score = _plain_beam(params, cfg, p, 5, 2)
        assert res.best(i).tokens.tolist() == tokens
        assert res.best(i).score == pytest.approx(score, abs=1e-4)


def test_k1_is_greedy(tiny_lm):
    params, model = tiny_lm.params, tiny_lm.decoder
    n = 22  # past T
    res = BS.beam_search(model, params, PROMPTS, n, 1, chunk=8)
    greedy = S.sample_tokens(model, params, PROMPTS, n, jax.random.PRNGKey(0), greedy=True, chunk=8)
    for i in range(len(PROMPTS)):
        assert res.best(i).tokens.tolist() == greedy.tokens[i].tolist()
        assert res.best(i).logprob == pytest.approx(float(greedy.model_logprobs[i].sum()), abs=1e-4)


@pytest.mark.quick
def test_n_best_sorted_and_distinct(tiny_lm):
    cfg, params, model = tiny_lm.cfg, tiny_lm.params, tiny_lm.decoder
    res = BS.beam_search(model, params, PROMPTS, 6, 5, n_best=4, chunk=8)
    for i, hyps in enumerate(res.hypotheses):
        assert len(hyps) == 4
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens.tolist()) for h in hyps}) == 4
        assert hyps[0].tokens.tolist() == _plain_beam(params, cfg, PROMPTS[i], 6, 5)[0]


def test_rule_scores_processed_distribution(tiny_lm):
    """With top-k 1 as the rule, every beam but the greedy path is removed: score 0, greedy text."""
    from jaxdecode import rules

    params, model = tiny_lm.params, tiny_lm.decoder
    res = BS.beam_search(model, params, PROMPTS, 6, 2, n_best=2, rule=rules.top_k(1), chunk=8)
    greedy = BS.beam_search(model, params, PROMPTS, 6, 1, chunk=8)  # k = 1 is greedy (above)
    for i in range(len(PROMPTS)):
        assert len(res.hypotheses[i]) == 1  # the other beam has probability 0
        h = res.best(i)
        assert h.tokens.tolist() == greedy.best(i).tokens.tolist()
        assert h.score == 0.0
        assert h.logprob == pytest.approx(greedy.best(i).logprob, abs=1e-5)


# ----------------------------------------------------------------------------- a stateful rule

THETA, FREQ, PRES = 1.8, 0.9, 0.5  # repetition (prompt and output), frequency and presence penalties


def _penalized(z, prompt, generated, theta=THETA, f=FREQ, p=PRES):
    """The three penalties on raw logits ``z`` [V] (float64) of one hypothesis, from its own
    history: repetition for every token in prompt + generated (positive logits / theta, negative
    * theta), then count * f and [count > 0] * p for the generated tokens."""
    z = np.array(z, np.float64)
    for v in set(prompt) | set(generated):
        z[v] = z[v] / theta if z[v] > 0 else z[v] * theta
    counts = np.bincount(np.asarray(generated, np.int64), minlength=len(z)).astype(np.float64)
    return z - counts * f - (counts > 0) * p


def _log_softmax64(z):
    m = z.max()
    return z - (m + np.log(np.exp(z - m).sum()))


def _plain_beam_with_penalties(params, cfg, prompt, n, k, penalties=(THETA, FREQ, PRES)):
    """The book's beam with a rule: each hypothesis penalizes from its own history; candidates
    score the sum of the penalized log-probabilities; every beam's top k, all sorted, best k kept.
    Returns [(tokens, score, model log-probability)] best first."""
    prompt = [int(t) for t in prompt]
    beams = [(0.0, 0.0, [])]  # (score, model log-probability, generated)
    for _ in range(n):
        seqs = [prompt + g for _, _, g in beams]
        L = len(seqs[0])
        x = np.zeros((len(seqs), cfg.T), np.int32)
        for r, q in enumerate(seqs):
            x[r, :min(L, cfg.T)] = q[-cfg.T:]
        raw = np.asarray(_forward(params, cfg, jnp.asarray(x)), np.float64)[:, min(L, cfg.T) - 1]
        cand = []
        for (score, lp, g), z in zip(beams, raw):
            proc = _log_softmax64(_penalized(z, prompt, g, *penalties))
            model = _log_softmax64(z)
            for i in np.argsort(-proc, kind="stable")[:k]:
                cand.append((score + proc[i], lp + model[i], g + [int(i)]))
        beams = sorted(cand, key=lambda c: -c[0])[:k]
    return [(g, score, lp) for score, lp, g in beams]


def test_beam_with_stateful_rule_equals_plain_beam(tiny_lm):
    """The rule state follows the parent beam: a beam that continues another beam's hypothesis
    must penalize that hypothesis's tokens (a state left in its slot would penalize others)."""
    from jaxdecode import rules

    cfg, params, model = tiny_lm.cfg, tiny_lm.params, tiny_lm.decoder
    rule = rules.chain(rules.repetition_penalty(THETA), rules.frequency_penalty(FREQ),
                       rules.presence_penalty(PRES))
    n, k = 8, 3  # the third prompt (10 tokens) runs past T = 16: the window mode too
    res = BS.beam_search(model, params, PROMPTS, n, k, n_best=k, rule=rule, chunk=8)
    differs = 0
    for i, p in enumerate(PROMPTS):
        want = _plain_beam_with_penalties(params, cfg, p, n, k)
        got = res.hypotheses[i]
        assert len(got) == k
        for h, (tokens, score, lp) in zip(got, want):
            assert h.tokens.tolist() == tokens, i
            assert h.score == pytest.approx(score, abs=1e-4)
            assert h.logprob == pytest.approx(lp, abs=1e-4)
        unpenalized = _plain_beam_with_penalties(params, cfg, p, n, k, penalties=(1.0, 0.0, 0.0))
        differs += [t for t, _, _ in want] != [t for t, _, _ in unpenalized]
    assert differs >= 3  # the penalties change the search's outcome: the comparison is not vacuous


# ----------------------------------------------------------------------------- exhaustive search


@pytest.fixture(scope="module")
def v4_model(backend):
    cfg = M.ModelConfig(V=4, T=16, d=16, L=1, heads=2)
    params = jax.jit(M.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(4))
    return cfg, jax.tree_util.tree_map(lambda a: a * 6.0, params), decoder_for(cfg, backend)  # far from uniform


# native only: the portable beam is checked by test_beam_equals_plain_beam and on the shipped model
@pytest.mark.parametrize("backend", ["native"], scope="session")
def test_full_width_beam_is_exact_search(v4_model):
    cfg, params, model = v4_model
    prompt, n = np.array([1, 3, 0]), 6
    # every one of the 4**6 continuations, scored with one forward each
    seqs = np.array(list(itertools.product(range(cfg.V), repeat=n)), np.int32)  # [4096, 6]
    full = np.concatenate([np.broadcast_to(prompt, (len(seqs), len(prompt))), seqs], axis=1)
    lp = np.asarray(jax.nn.log_softmax(_forward(params, cfg, jnp.asarray(full)), axis=-1), np.float64)
    pos = len(prompt) - 1 + np.arange(n)
    total = lp[:, pos, :][np.arange(len(seqs))[:, None], np.arange(n)[None, :], seqs].sum(axis=1)
    best = int(np.argmax(total))
    assert np.sort(total)[-1] - np.sort(total)[-2] > 1e-3  # a unique mode
    mode, mode_lp = seqs[best].tolist(), total[best]
    # the mode is not greedy's here (greedy read off the table): the search has something to find
    greedy = []
    for t in range(n):
        row = next(i for i, s in enumerate(seqs) if s[:t].tolist() == greedy)
        greedy.append(int(np.argmax(lp[row, pos[t]])))
    assert greedy != mode

    res = BS.beam_search(model, params, [prompt], n, cfg.V ** n, chunk=8)
    assert res.best().tokens.tolist() == mode
    assert res.best().score == pytest.approx(mode_lp, abs=1e-4)

    tokens, logprob, nodes = BS.mode_search(model, params, prompt, n, batch=8)  # bound: greedy
    assert tokens.tolist() == mode
    assert logprob == pytest.approx(mode_lp, abs=1e-4)
    assert 0 < nodes < sum(cfg.V ** d for d in range(n))  # fewer than all prefixes

    small = BS.beam_search(model, params, [prompt], n, 2, chunk=8).best()
    assert small.logprob <= mode_lp + 1e-5
    assert BS.mode_search(model, params, prompt, n, batch=8, lower_bound=small.logprob)[0].tolist() == mode


def test_mode_search_budget(v4_model):
    cfg, params, model = v4_model
    with pytest.raises(BS.SearchBudgetExceeded, match="node budget of 2 "):
        BS.mode_search(model, params, np.array([1, 3, 0]), 6, node_budget=2, batch=1)


def test_mode_search_takes_decode_params(v4_model):
    """The settings as a DecodeParams, keywords overriding it, as generate takes them; a setting
    the search does not honour is refused by name."""
    from jaxdecode import DecodeParams, ParamsError

    cfg, params, model = v4_model
    prompt = np.array([1, 3, 0])
    plain = BS.mode_search(model, params, prompt, 4, batch=8)
    got = BS.mode_search(model, params, prompt, DecodeParams(n=6, seed=0), batch=8, n=4)
    assert got[0].tolist() == plain[0].tolist() and got[1] == pytest.approx(plain[1])
    # the mode's second token as an end token: the mode's first two tokens are then a complete
    # output at least as probable as every 4-token one, so the mode ends with the end token
    end = int(plain[0][1])
    short = BS.mode_search(model, params, prompt, DecodeParams(n=4, stop_token_ids=(end,)), batch=8)
    assert len(short[0]) < 4 and short[0][-1] == end and end not in short[0][:-1].tolist()
    assert short[1] >= plain[1] - 1e-5
    assert BS.mode_search(model, params, prompt, 4, batch=8, end_tokens=(end,))[0].tolist() == short[0].tolist()
    with pytest.raises(ParamsError, match="^mode_search does not take top_p$"):
        BS.mode_search(model, params, prompt, 4, top_p=0.9)


# ----------------------------------------------------------------------------- end tokens and length penalty

# A Markov chain over a, b and END (token 2) whose next token depends on the last one only.
CHAIN = np.log(np.array([
    [0.05, 0.45, 0.50],  # after a
    [0.04, 0.06, 0.90],  # after b
    [0.50, 0.30, 0.20],  # after END (matters only when END does not end)
]))


def _chain_logits(params, tokens):  # [B, t] -> [B, t, V]: each position's next token
    return jnp.asarray(CHAIN, jnp.float32)[tokens]


CHAIN_MODEL = FunctionModel(_chain_logits, V=3, T=16)


def _chain(n, k, **kw):
    return BS.beam_search(CHAIN_MODEL, None, [np.array([0])], n, k, chunk=4, **kw)


@pytest.mark.quick
def test_end_token_and_length_penalty_change_the_winner():
    a, b, END = 0, 1, 2
    ln = np.log
    # After the prompt "a", 3 steps, k = 2. The candidates that matter:
    #   END        p = .5                 ln = -0.6931
    #   b END      p = .45 * .9 = .405    ln = -0.9039
    #   b END a    p = .405 * .5 = .2025  ln = -1.5970   (END is an ordinary token here)
    #   END a END  p = .5 * .5 * .5       ln = -2.0794
    # 1. No end token: every hypothesis has 3 tokens. Step 1 keeps END (-.693), b (-.799);
    #    step 2 keeps b END (-.904), END a (-1.386); step 3: b END a (-1.597) beats
    #    END a END (-2.079) and every other extension.
    r = _chain(3, 2)
    assert r.best().tokens.tolist() == [b, END, a] and not r.best().finished
    assert r.best().score == pytest.approx(ln(.45 * .9 * .5), abs=1e-5)
    # 2. END ends a hypothesis, alpha = 0: END (-.693) is finished at step 1 and beats b END
    #    (-.904); the best live beam after step 2, b b (-3.61), cannot catch up.
    r = _chain(3, 2, end_tokens=[[END]], n_best=2)
    assert [h.tokens.tolist() for h in r.hypotheses[0]] == [[END], [b, END]]
    assert all(h.finished for h in r.hypotheses[0])
    assert r.best().score == pytest.approx(ln(.5), abs=1e-5)
    # 3. alpha = 2: scores are divided by ((5 + |y|) / 6) ** 2: END stays -.693 / 1 = -.693,
    #    b END becomes -.904 / (7/6)**2 = -.664 and wins.
    r = _chain(3, 2, end_tokens=[[END]], length_penalty=2.0, n_best=2)
    assert [h.tokens.tolist() for h in r.hypotheses[0]] == [[b, END], [END]]
    assert r.best().score == pytest.approx(ln(.405) / (7 / 6) ** 2, abs=1e-5)
    assert r.best().logprob == pytest.approx(ln(.405), abs=1e-5)
    # ... and with alpha = 1 it does not: -.904 / (7/6) = -.775 < -.693
    assert _chain(3, 2, end_tokens=[[END]], length_penalty=1.0).best().tokens.tolist() == [END]
    # alpha is traced: one value per row in one batch
    r = BS.beam_search(CHAIN_MODEL, None, [np.array([0])] * 3, 3, 2, end_tokens=[[END]],
                       length_penalty=[0.0, 2.0, 1.0], chunk=4)
    assert [h[0].tokens.tolist() for h in r.hypotheses] == [[END], [b, END], [END]]


@pytest.mark.quick
def test_stop_string_and_early_end():
    b, END = 1, 2
    # the stop string "b END": "END" alone no longer ends, so the winner of case 1 above,
    # b END a, is now cut at b END (finished, ln .405) and beats every 3-token hypothesis
    r = _chain(3, 2, end_tokens=[[b, END]])
    assert r.best().tokens.tolist() == [b, END] and r.best().finished
    # rows finish early: two finished hypotheses after 2 steps and no live beam can catch up
    r = _chain(40, 2, end_tokens=[[END]])
    assert r.steps < 40 and r.best().tokens.tolist() == [END]


# ----------------------------------------------------------------------------- the shipped model


SHIPPED_PROMPT = "KATHARINA:\nMoved! in good time: "


@functools.cache
def _shipped_plain_beam(k: int):
    """The plain beam on the shipped model (computed once for both backends)."""
    from jaxdecode.models.checkpoint import load

    lm = load(backend="portable")
    ids = lm.vocab.encode(SHIPPED_PROMPT)
    # the plain loop pads to 96 positions instead of T = 512: the same logits, 5x cheaper
    return _plain_beam(lm.params, lm.cfg, ids, 60, k, width=len(ids) + 64, forward=_SHIPPED_FORWARD)


# the shipped model's reference runs 180 forwards: compiled as the library's users' programs are
_SHIPPED_FORWARD = optimized_jit(M.forward, static_argnums=1)


@pytest.mark.slow
@pytest.mark.xdist_group("shipped_plain_beam")  # both backends on one worker: one plain beam per k
def test_shipped_checkpoint_matches_plain_beam(backend):
    from jaxdecode.models.checkpoint import CheckpointError, default_checkpoint, load

    try:
        default_checkpoint()
    except CheckpointError as e:
        pytest.skip(f"no shipped checkpoint: {e}")
    lm = load(backend=backend)
    for k in (2, 5):  # k = 1 is greedy decoding (test_k1_is_greedy; the book's loop in test_sampling.py)
        got = BS.beam_generate(lm, SHIPPED_PROMPT, 60, k)[0][0]
        tokens, score = _shipped_plain_beam(k)
        assert got.text == lm.vocab.decode(tokens)
        assert got.score == pytest.approx(score, abs=1e-4)


# ----------------------------------------------------------------------------- compiling and errors


def test_compile_once_per_bucket(tiny_lm):
    params, model = tiny_lm.params, tiny_lm.decoder
    BS.beam_search(model, params, PROMPTS, 5, 2, chunk=8)
    before = (BS._beam_cache_chunk._cache_size(), BS._beam_prefill._cache_size())
    # other prompt lengths (one bucket of 16), batch sizes (bucket 4), n and alpha
    BS.beam_search(model, params, [np.array([5, 6, 7, 8, 9, 10, 11]), np.array([1, 1]), np.array([3])], 5, 2,
                   chunk=8)
    BS.beam_search(model, params, [np.array([2]), np.array([3] * 5)] * 2, 6, 2, chunk=8, length_penalty=0.6)
    after = (BS._beam_cache_chunk._cache_size(), BS._beam_prefill._cache_size())
    assert after == before


@pytest.mark.quick_ids('native')
def test_bad_input(tiny_lm):
    params, model = tiny_lm.params, tiny_lm.decoder
    p = [np.array([1])]
    with pytest.raises(ValueError, match="beam width k"):
        BS.beam_search(model, params, p, 3, 0)
    with pytest.raises(ValueError, match="n_best=3 exceeds the beam width k=2"):
        BS.beam_search(model, params, p, 3, 2, n_best=3)
    with pytest.raises(ValueError, match=">= 0"):
        BS.beam_search(model, params, p, -1, 2)
    with pytest.raises(ValueError, match="at least one token"):
        BS.beam_search(model, params, [np.array([], np.int32)], 3, 2)
    with pytest.raises(ValueError, match="no prompts"):
        BS.beam_search(model, params, [], 3, 2)
    with pytest.raises(ValueError, match="end token"):
        BS.beam_search(model, params, p, 3, 2, end_tokens=[[]])
    with pytest.raises(ValueError, match="empty"):
        BS.beam_generate(tiny_lm, "", 3, 2)
    with pytest.raises(ValueError, match="beam width k"):
        BS.beam_generate(tiny_lm, "ab", 3, 0)
    with pytest.raises(ValueError, match="'Z' at position 1"):
        BS.beam_generate(tiny_lm, "aZ", 3, 2)
    assert BS.beam_search(model, params, p, 0, 2).best().tokens.tolist() == []


def test_beam_generate_text(tiny_lm):
    texts = ["ab", "c d", "hi.\n", "e"]
    out = BS.beam_generate(tiny_lm, texts, 6, 5, n_best=2, chunk=8)
    res = BS.beam_search(tiny_lm.decoder, tiny_lm.params, [tiny_lm.vocab.encode(t) for t in texts], 6, 5,
                         n_best=2, chunk=8)
    assert len(out) == 4 and all(len(hyps) == 2 for hyps in out)
    for prompt, hyps, want in zip(texts, out, res.hypotheses):
        for h, r in zip(hyps, want):
            assert h.prompt == prompt and h.text == tiny_lm.vocab.decode(r.tokens)
            assert h.score == pytest.approx(r.score, abs=1e-5) and not h.finished


# ----------------------------------------------------------------------------- the study


# native only: this checks the study's bookkeeping; its beams are checked on both backends above
@pytest.mark.parametrize("backend", ["native"], scope="session")
@pytest.mark.slow
def test_beam_curse_study(tiny_lm, tmp_path):
    from jaxdecode.eval.studies import beam_curse

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghi"), size=rng.integers(1, 7))) for _ in range(4000)]
    lines = [" ".join(words[i:i + 8]) + "." for i in range(0, len(words), 8)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = beam_curse.run(tiny_lm, tmp_path / "out", n_prompts=4, n=4, data_path=corpus, ks=(1, 2))
    assert json.loads((tmp_path / "out" / "beam_curse.json").read_text())["per_k"] == out["per_k"]
    assert out["prompts_solved"] == 4 and len(out["prompts"]) == 4
    found = {"1": 0, "2": 0}
    gaps = {"1": [], "2": []}
    next_logits = exact.model_next_logits(tiny_lm.params, tiny_lm.cfg)  # a forward over the last T tokens
    for row in out["prompts"]:
        assert 32 <= len(row["prompt"]) <= 64 and row["prompt"][-1] in " \n"
        assert row["prompt"] in corpus.read_text()
        ids = tiny_lm.vocab.encode(row["prompt"])
        # the mode by brute force: all 12**4 continuations, each with its exact probability
        probs = exact.exact_distribution(next_logits, ids, 4, V=tiny_lm.cfg.V)
        assert len(probs) == tiny_lm.cfg.V ** 4
        ranked = sorted(probs, key=probs.get, reverse=True)
        assert np.log(probs[ranked[0]]) - np.log(probs[ranked[1]]) > 1e-4  # a unique mode
        assert row["mode"] == tiny_lm.vocab.decode(ranked[0])
        assert row["mode_logprob"] == pytest.approx(np.log(probs[ranked[0]]), abs=1e-4)
        # beam k=1 is the greedy continuation
        greedy = S.sample_tokens(tiny_lm.decoder, tiny_lm.params, [ids], 4, jax.random.PRNGKey(0),
                                 greedy=True)
        assert row["beams"]["1"]["text"] == tiny_lm.vocab.decode(greedy.tokens[0])
        for k, b in row["beams"].items():
            tokens = tuple(tiny_lm.vocab.encode(b["text"]).tolist())
            assert b["logprob"] == pytest.approx(np.log(probs[tokens]), abs=1e-4)
            assert b["is_mode"] == (tokens == ranked[0])
            found[k] += tokens == ranked[0]
            gaps[k].append(np.log(probs[ranked[0]]) - np.log(probs[tokens]))
            assert b["gap"] == pytest.approx(gaps[k][-1], abs=1e-4)
    for k in ("1", "2"):
        s = out["per_k"][k]
        assert s["found_mode"] == found[k] and s["solved"] == 4
        assert s["mean_gap"] == pytest.approx(np.mean(gaps[k]), abs=1e-4)
        assert s["max_gap"] == pytest.approx(np.max(gaps[k]), abs=1e-4)
