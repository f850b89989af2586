"""Decoding your own model: the loops on models other than the reference transformer.

A Markov chain (a FunctionModel around a transition matrix) is checked against what numpy
computes from the matrix by hand; the multi-character TinyTransformer (jaxdecode/models/toy.py),
whose cache is laid out unlike the reference model's, is run through every loop both cached and
as a FunctionModel of its forward, which must agree; the documented example (docs/own-model.md) runs as written.
"""

import itertools
import re
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode.decoding import beam as BS
from jaxdecode.eval import exact
from jaxdecode import rules
from jaxdecode.decoding import sampling as S
from jaxdecode.models import DecodingModel, FunctionModel, TinyTransformer, multichar_lm
from jaxdecode.decoding.score import token_logprobs
from jaxdecode.io.vocab import TokenVocab, UncoveredTextError, UnknownCharacterError, Vocab

ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- a Markov chain

V = 5
A = np.random.default_rng(3).dirichlet(np.full(V, 0.7), size=V)  # A[i, j] = p(next j | last i)
LOG_A = np.log(A)


def chain_logits(params, tokens):  # [B, t] -> [B, t, V]: the next token depends on the last only
    return jnp.log(params)[tokens]


CHAIN = FunctionModel(chain_logits, V=V, T=8)
A32 = jnp.asarray(A, jnp.float32)


def path_logprob(prompt, cont):
    seq = [int(prompt[-1])] + list(cont)
    return float(sum(LOG_A[a, b] for a, b in zip(seq, seq[1:])))


def book_beam(next_logprobs, prompt, n, k):
    """The book's beam: per hypothesis its top k next tokens, all candidates sorted, best k kept."""
    beams = [(0.0, list(prompt))]
    for _ in range(n):
        cand = []
        for score, seq in beams:
            lp = next_logprobs(seq)
            cand += [(score + lp[i], seq + [int(i)]) for i in np.argsort(-lp, kind="stable")[:k]]
        beams = sorted(cand, key=lambda c: -c[0])[:k]
    return beams[0][1][len(prompt):], beams[0][0]


@pytest.mark.quick
def test_chain_greedy_is_the_argmax_walk():
    prompts = [np.array([0]), np.array([1, 2]), np.array([4, 4, 3])]
    n = 12  # past T = 8 for every prompt: the loop switches to the window mode
    res = S.sample_tokens(CHAIN, A32, prompts, n, jax.random.PRNGKey(0), greedy=True)
    for i, p in enumerate(prompts):
        walk, last = [], int(p[-1])
        for _ in range(n):
            last = int(np.argmax(A[last]))
            walk.append(last)
        assert res.tokens[i].tolist() == walk
        np.testing.assert_allclose(res.model_logprobs[i].sum(), path_logprob(p, walk), atol=1e-4)
    assert (res.counts == n).all() and not res.stopped.any()


@pytest.mark.quick
def test_chain_beam_and_mode_are_exhaustive():
    prompt = np.array([2])
    # k = V over two steps sees every continuation: the most probable one
    seqs = list(itertools.product(range(V), repeat=2))
    best = max(seqs, key=lambda s: path_logprob(prompt, s))
    res = BS.beam_search(CHAIN, A32, [prompt], 2, V, n_best=V)
    assert tuple(res.best().tokens.tolist()) == best
    assert res.best().logprob == pytest.approx(path_logprob(prompt, best), abs=1e-5)
    ranked = sorted(seqs, key=lambda s: -path_logprob(prompt, s))[:V]
    assert [tuple(h.tokens.tolist()) for h in res.hypotheses[0]] == ranked
    # longer: the book's beam, and exact search for the mode of all V**4 continuations
    for k in (2, V):
        tokens, score = book_beam(lambda seq: LOG_A[seq[-1]], list(prompt), 4, k)
        h = BS.beam_search(CHAIN, A32, [prompt], 4, k).best()
        assert h.tokens.tolist() == tokens and h.score == pytest.approx(score, abs=1e-5)
    mode = max(itertools.product(range(V), repeat=4), key=lambda s: path_logprob(prompt, s))
    tokens, logprob, _ = BS.mode_search(CHAIN, A32, prompt, 4)
    assert tuple(tokens.tolist()) == mode
    assert logprob == pytest.approx(path_logprob(prompt, mode), abs=1e-5)


@pytest.mark.quick
def test_chain_sampling_matches_the_matrix():
    prompt = np.array([2])
    probs = {s: float(np.exp(path_logprob(prompt, s))) for s in itertools.product(range(V), repeat=3)}
    # the oracle on the model agrees with the matrix
    oracle = exact.exact_distribution(exact.next_logits_for(CHAIN, A32), prompt, 3)
    assert oracle.keys() == probs.keys()
    np.testing.assert_allclose([oracle[s] for s in probs], list(probs.values()), rtol=1e-4)
    res = S.sample_tokens(CHAIN, A32, [prompt] * 4096, 3, jax.random.PRNGKey(11))
    counts = Counter(map(tuple, res.tokens.tolist()))
    assert exact.chisquare_pvalue(counts, probs) > 1e-3
    # power: the same samples reject a wrong matrix
    wrong = A ** 1.5 / (A ** 1.5).sum(axis=1, keepdims=True)
    seq_p = lambda s: wrong[2, s[0]] * wrong[s[0], s[1]] * wrong[s[1], s[2]]
    assert exact.chisquare_pvalue(counts, {s: float(seq_p(s)) for s in probs}) < 1e-3
    np.testing.assert_allclose(res.model_logprobs.sum(axis=1),
                               [path_logprob(prompt, s) for s in res.tokens.tolist()], atol=1e-4)


def test_chain_scoring_sums_log_matrix_entries():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, V, size=m) for m in (2, 5, 8, 9, 14)]  # past T = 8 too
    starts = [1, 2, 1, 4, 3]
    got = token_logprobs(CHAIN, A32, seqs, starts)
    for s, st, lp in zip(seqs, starts, got):
        np.testing.assert_allclose(lp, [LOG_A[s[t - 1], s[t]] for t in range(st, len(s))], atol=1e-5)


# ----------------------------------------------------------------------------- past the window

# next-token logits from the last token and the first token the model sees: past T the window
# slides, so the first token seen changes and the window semantics show in every result
LA = np.random.default_rng(5).normal(size=(V, V)) * 2.0
LB = np.random.default_rng(6).normal(size=(V, V)) * 2.0
WT = 6
WINDOWED = FunctionModel(lambda p, t: p[0][t] + p[1][t[:, :1]], V=V, T=WT)
W_PARAMS = (jnp.asarray(LA, jnp.float32), jnp.asarray(LB, jnp.float32))


def windowed_logprobs(seq):
    """Next-token log-probabilities after ``seq`` by hand: the model sees its last WT tokens."""
    z = LA[seq[-1]] + LB[seq[max(0, len(seq) - WT)]]
    return z - np.log(np.sum(np.exp(z - z.max()))) - z.max()


def test_function_model_past_its_window():
    prompts = [np.array([3]), np.array([0, 1, 2, 3]), np.array([4, 0, 2, 2, 1, 3, 0, 4])]  # the last past T
    n = 10
    res = S.sample_tokens(WINDOWED, W_PARAMS, prompts, n, jax.random.PRNGKey(0), greedy=True)
    for i, p in enumerate(prompts):
        seq = list(p)
        for _ in range(n):
            seq.append(int(np.argmax(windowed_logprobs(seq))))
        assert res.tokens[i].tolist() == seq[len(p):]
        lp = sum(windowed_logprobs(seq[:t])[seq[t]] for t in range(len(p), len(seq)))
        np.testing.assert_allclose(res.model_logprobs[i].sum(), lp, atol=1e-4)
    # scoring past T: every token from the WT tokens before it
    seqs = [np.array(s) for s in ([1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2], [4, 4, 1])]
    for s, lp in zip(seqs, token_logprobs(WINDOWED, W_PARAMS, seqs, [1, 1])):
        np.testing.assert_allclose(lp, [windowed_logprobs(list(s[:t]))[s[t]] for t in range(1, len(s))],
                                   atol=1e-5)
    # beam search past T
    for _i, p in enumerate(prompts):
        tokens, score = book_beam(windowed_logprobs, list(p), 8, 3)
        h = BS.beam_search(WINDOWED, W_PARAMS, [p], 8, 3).best()
        assert h.tokens.tolist() == tokens and h.score == pytest.approx(score, abs=1e-4)


# ----------------------------------------------------------------------------- the vocabulary


@pytest.mark.quick
def test_token_vocab():
    vocab = TokenVocab(["t", "h", "e", " ", "th", "the", "he"])
    ids = vocab.encode("the hethe th")
    assert [vocab.tokens[i] for i in ids] == ["the", " ", "he", "the", " ", "th"]
    assert ids.dtype == np.int32 and vocab.decode(ids) == "the hethe th"
    assert vocab.decode([0, 1]) == "th" and vocab.encode("th").tolist() == [4]  # text round-trips, ids not
    assert len(vocab) == 7 and vocab.chars == vocab.tokens and vocab.chars[5] == "the"
    assert vocab.encode("").tolist() == []
    with pytest.raises(UncoveredTextError, match=r"'xy' at position 4, 'z' at position 8") as e:
        vocab.encode("the xyhez")
    assert isinstance(e.value, UnknownCharacterError)  # callers catching the Vocab error catch this too
    assert e.value.uncovered == [(4, "xy"), (8, "z")]
    assert e.value.unknown == [(4, "x"), (5, "y"), (8, "z")]
    with pytest.raises(ValueError, match="repeats tokens"):
        TokenVocab(["a", "b", "a"])
    with pytest.raises(ValueError, match="non-empty string"):
        TokenVocab(["a", ""])
    with pytest.raises(TypeError, match="Vocab"):
        TokenVocab("abc")
    with pytest.raises(ValueError, match=r"\[0, 7\)"):
        vocab.decode([7])
    assert Vocab("ab").chars == "ab"  # unchanged


# ----------------------------------------------------------------------------- a multi-character transformer


@pytest.fixture(scope="module")
def mc():
    """The multi-character model with a small window, cached and through the function adapter."""
    lm = multichar_lm(seed=0, T=16)
    model = lm.decoder
    return lm, model, FunctionModel(model.forward, model.V, model.T)


# ragged prompts (1 to 7 tokens) in one batch bucket; 8 new tokens stay inside T = 16, 20 run past
# it for every prompt (the tests share compiled programs: keep these few sizes)
MC_PROMPTS = ["the", "and a th", "s", "he ran in."]
MC_N, MC_LONG = 8, 20


def test_toy_cache_matches_forward(mc):
    lm, model, _ = mc
    params = lm.params
    assert isinstance(model, DecodingModel) and model == TinyTransformer(40, 16)
    assert hash(model) == hash(TinyTransformer(40, 16))
    fwd = jax.jit(model.forward)
    prefill = jax.jit(model.prefill, static_argnames=("capacity",))
    extend = jax.jit(model.extend, static_argnames=("span",))
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(0, model.V, (4, 16)), jnp.int32)  # every forward here is [4, 16]
    full, hidden = fwd(params, toks)
    lengths = np.array([5, 9, 1, 12])
    logits, h, cache = prefill(params, toks[:, :12], jnp.asarray(lengths), capacity=16)
    last = lengths - 1
    np.testing.assert_allclose(logits, full[np.arange(4), last], atol=1e-5)
    np.testing.assert_allclose(h, hidden[np.arange(4), last], atol=1e-5)
    assert model.capacity(cache) == 16 and cache.kv.shape == (2, 2, 4, 16, 32)
    # three tokens per row at each row's own length, attending within a span
    new = jnp.stack([toks[i, lengths[i]:lengths[i] + 3] for i in range(4)])
    lg, hd, cache3 = extend(params, cache, new, span=16)
    for i in range(4):
        np.testing.assert_allclose(lg[i], full[i, lengths[i]:lengths[i] + 3], atol=1e-5)
        np.testing.assert_allclose(hd[i], hidden[i, lengths[i]:lengths[i] + 3], atol=1e-5)
    assert model.lengths(cache3).tolist() == (lengths + 3).tolist()
    # reorder (beams), then three more tokens per row
    rows = jnp.array([2, 0, 0, 1])
    moved = model.reorder(cache3, rows)
    assert model.lengths(moved).tolist() == [4, 8, 8, 12]
    more = jnp.asarray(rng.integers(0, model.V, (4, 3)), jnp.int32)
    lg4, _, _ = extend(params, moved, more, span=16)
    seqs = np.zeros((4, 16), np.int32)  # each row's text, right-padded (causal: padding unseen)
    for j, r in enumerate(rows.tolist()):
        seq = np.concatenate([np.asarray(toks[r, :lengths[r]]), np.asarray(new[r]), np.asarray(more[j])])
        seqs[j, :len(seq)] = seq
    ref = fwd(params, jnp.asarray(seqs))[0]
    for j, r in enumerate(rows.tolist()):
        np.testing.assert_allclose(lg4[j], ref[j, lengths[r] + 3:lengths[r] + 6], atol=1e-5)
    # grow: more room, the same contents
    grown = model.grow(moved, 32)
    assert model.capacity(grown) == 32 and model.capacity(model.grow(moved, 16)) == 16
    np.testing.assert_array_equal(grown.kv[:, :, :, :16], moved.kv)
    np.testing.assert_array_equal(model.lengths(grown), model.lengths(moved))
    # truncate (rollback): forgetting the three tokens and extending again gives the same
    lg5, _, _ = extend(params, model.truncate(cache3, jnp.asarray(lengths)), new, span=16)
    np.testing.assert_allclose(lg5, lg, atol=1e-5)
    with pytest.raises(ValueError, match="below"):
        model.grow(cache, 8)
    # the window: each row's last T tokens, numbered from 0
    hist = jnp.asarray(rng.integers(0, model.V, (4, 24)), jnp.int32)
    ends = np.array([24, 10, 17, 16])
    wl, wh = jax.jit(model.window)(params, hist, jnp.asarray(ends))
    starts = np.maximum(ends - 16, 0)
    ref, ref_h = fwd(params, jnp.stack([hist[i, s:s + 16] for i, s in enumerate(starts)]))
    at = ends - starts - 1
    np.testing.assert_allclose(wl, ref[np.arange(4), at], atol=1e-5)
    np.testing.assert_allclose(wh, ref_h[np.arange(4), at], atol=1e-5)


@pytest.mark.slow
def test_multichar_loops_agree_cached_and_function(mc):
    """Every loop on the cached model (through the text-level functions) and on the function
    adapter of its forward (through the token-level loops); greedy and scoring past the window."""
    lm, model, fm = mc
    params = lm.params
    prompts = [lm.vocab.encode(p) for p in MC_PROMPTS]
    key = jax.random.PRNGKey(3)
    for greedy, n in ((True, MC_LONG), (False, MC_N)):
        gens = jaxdecode.generate(lm, MC_PROMPTS, n=n, key=key, greedy=greedy)
        ref = S.sample_tokens(fm, params, prompts, n, key, greedy=greedy, row_ids=[0] * len(prompts))  # per-prompt seeds
        for i, g in enumerate(gens):
            assert g.tokens.tolist() == ref.tokens[i].tolist()
            assert g.text == lm.vocab.decode(g.tokens)
            np.testing.assert_allclose(g.model_logprobs, ref.model_logprobs[i], atol=1e-4)
    beams = jaxdecode.beam_generate(lm, MC_PROMPTS, n=MC_N, k=3, n_best=2)
    ref = BS.beam_search(fm, params, prompts, MC_N, 3, n_best=2)
    for i in range(len(prompts)):
        assert len(beams[i]) == 2
        for a, b in zip(beams[i], ref.hypotheses[i]):
            assert a.tokens.tolist() == b.tokens.tolist() and a.text == lm.vocab.decode(a.tokens)
            assert a.score == pytest.approx(b.score, abs=1e-4)
        assert beams[i][0].logprob == pytest.approx(ref.best(i).logprob, abs=1e-4)
    # scoring: the two agree inside T; past T the cached model's scores are checked by hand
    seqs = [np.concatenate([p, p, p, p]) for p in prompts]  # the last has 28 tokens
    a, b = token_logprobs(model, params, seqs, [1] * 4), token_logprobs(fm, params, seqs[:3], [1] * 3)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=1e-4)
    seq = seqs[3]  # by hand: a forward over each token's (up to) 16 predecessors
    windows = np.zeros((len(seq) - 1, 16), np.int32)
    for t in range(1, len(seq)):
        w = seq[max(0, t - 16):t]
        windows[t - 1, :len(w)] = w
    lp = jax.nn.log_softmax(jax.jit(model.forward)(params, jnp.asarray(windows))[0], axis=-1)
    np.testing.assert_allclose(a[3], [float(lp[t - 1, min(t, 16) - 1, seq[t]]) for t in range(1, len(seq))],
                               atol=1e-4)


@pytest.mark.slow
def test_multichar_mode_search(mc):
    lm, model, fm = mc
    params = lm.params
    next_logits = exact.next_logits_for(model, params)
    for text in ("the", "the ran and a cat sat"):  # 1 token; 16 = T tokens (the search's window mode)
        prompt = lm.vocab.encode(text)
        probs = exact.exact_distribution(next_logits, prompt, 2)
        mode = max(probs, key=probs.get)
        for m in (model, fm) if len(prompt) < 8 else (model,):
            tokens, logprob, _ = BS.mode_search(m, params, prompt, 2)
            assert tuple(tokens.tolist()) == mode
            assert logprob == pytest.approx(np.log(probs[mode]), abs=1e-4)


def test_multichar_sampling_matches_exact_distribution(mc):
    lm, model, _ = mc
    params = lm.params
    prompt = lm.vocab.encode("and the")
    rule = rules.top_k(4)
    next_logits = exact.next_logits_for(model, params)
    probs = exact.exact_distribution(next_logits, prompt, 2, rule=rule)
    assert len(probs) == 16
    res = S.sample_tokens(model, params, [prompt] * 2048, 2, jax.random.PRNGKey(1), rule=rule)
    counts = Counter(map(tuple, res.tokens.tolist()))
    assert exact.chisquare_pvalue(counts, probs) > 1e-3
    # power: the same 16 continuations at another temperature are rejected
    hotter = rules.chain(rules.temperature(1.5), rules.top_k(4))
    wrong = exact.exact_distribution(next_logits, prompt, 2, rule=hotter)
    assert wrong.keys() == probs.keys()
    assert exact.chisquare_pvalue(counts, wrong) < 1e-3
    np.testing.assert_allclose(res.sample_logprobs[0].sum(), np.log(probs[tuple(res.tokens[0].tolist())]),
                               atol=1e-4)


def test_multichar_compiles_once_per_bucket(mc):
    lm, model, _ = mc
    rng = np.random.default_rng(1)
    # warm the bucket: batch 4, prompt width 16, the cache and (15 + 8 > T) the window mode
    S.sample_tokens(model, lm.params, [np.array([1]), np.arange(15) % model.V, np.array([2, 3])], MC_N,
                    jax.random.PRNGKey(0))
    sizes = lambda: (S.cache_chunk._cache_size(), S.prefill._cache_size(), S.window_chunk._cache_size())
    before = sizes()
    for _ in range(4):
        B = int(rng.integers(3, 5))  # batch bucket 4, prompts of 1 to 15 tokens (width bucket 16)
        prompts = [rng.integers(0, model.V, size=rng.integers(1, 16)) for _ in range(B)]
        S.sample_tokens(model, lm.params, prompts, MC_N, jax.random.PRNGKey(int(rng.integers(100))))
    assert sizes() == before


def test_generate_with_multichar_vocab():
    lm = multichar_lm()
    assert isinstance(lm.vocab, TokenVocab) and len(lm.vocab) == 40
    assert {len(t) for t in lm.vocab.tokens} == {1, 2, 3}
    g = jaxdecode.generate(lm, "the", n=20)[0]
    assert len(g.tokens) == 20 and g.finish_reason == "length"
    assert g.text == lm.vocab.decode(g.tokens) and len(g.text) >= 20
    assert lm.vocab.decode(lm.vocab.encode(g.text)) == g.text  # the text re-encodes
    assert lm.vocab.decode(lm.vocab.encode("the" + g.text)) == "the" + g.text
    with pytest.raises(UnknownCharacterError, match="'Z' at position 3"):
        jaxdecode.generate(lm, "theZ", n=2)


def test_score_texts_with_multichar_vocab(mc):
    lm = mc[0]
    texts, prompts = ["a cat", "the", "s and", "in."], MC_PROMPTS  # four rows, as in the loops test
    scores = jaxdecode.score(lm, texts, prompts=prompts)
    seqs = [np.concatenate([lm.vocab.encode(p), lm.vocab.encode(t)]) for p, t in zip(prompts, texts)]
    for t, s, lp in zip(texts, scores, token_logprobs(lm.decoder, lm.params, seqs, [1] * 4)):
        n = len(lm.vocab.encode(t))
        assert len(s.logprobs) == n  # one per token of the text
        np.testing.assert_allclose(s.logprobs, lp[-n:], atol=1e-5)


# ----------------------------------------------------------------------------- the documented example


@pytest.mark.quick
def test_documented_own_model_example():
    text = (ROOT / "docs" / "own-model.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code, "docs/own-model.md has no python code block"
    exec(compile(code.group(1), "docs/own-model.md", "exec"), {"__name__": "documented_example"})


# ----------------------------------------------------------------------------- speculative decoding


def test_chain_speculative_is_exact():
    """The Markov chain as the target of speculative sampling (an n-gram draft counted from text
    the chain did not generate): its first 3 tokens follow the chain's matrix; and a function
    model as the draft (ModelDraft of a FunctionModel) gives greedy decoding under greedy."""
    from jaxdecode import speculative as SP

    prompt = np.array([2])
    probs = {s: float(np.exp(path_logprob(prompt, s))) for s in itertools.product(range(V), repeat=3)}
    text = np.random.default_rng(0).integers(0, V, 2000)
    draft = SP.NGramDraft.from_tokens(text, V, n=2)
    res = SP.speculative_tokens(CHAIN, A32, np.broadcast_to(prompt, (4096, 1)), 3, jax.random.PRNGKey(5),
                                draft=draft, gamma=2)
    counts = Counter(map(tuple, res.tokens.tolist()))
    assert exact.chisquare_pvalue(counts, probs) > 1e-3
    total = SP.SpeculativeStats.total(res.stats)
    assert 0 < total.accepted < total.examined  # the draft is neither useless nor perfect
    # a function model as the draft: a flatter chain
    flat = jnp.asarray(np.log(A ** 0.5 / (A ** 0.5).sum(axis=1, keepdims=True)), jnp.float32)
    model_draft = SP.ModelDraft(flat, CHAIN)
    prompts = [np.array([1]), np.array([4, 0])]  # within T = 8: prompt + n + gamma + 1
    want = S.sample_tokens(CHAIN, A32, prompts, 3, jax.random.PRNGKey(0), greedy=True)
    got = SP.speculative_tokens(CHAIN, A32, prompts, 3, jax.random.PRNGKey(1), draft=model_draft, gamma=2,
                                greedy=True)
    assert got.tokens.tolist() == want.tokens.tolist()


def test_multichar_speculative_greedy_and_batch_invariance(mc):
    """The multi-character model as target (prompt lookup as draft): greedy speculative decoding
    is greedy decoding, and a row's sample does not depend on its batch."""
    from jaxdecode import speculative as SP

    lm, model, _ = mc
    prompts = [lm.vocab.encode(p) for p in MC_PROMPTS[:3]]
    draft = SP.PromptLookupDraft(2)
    want = S.sample_tokens(model, lm.params, prompts, 4, jax.random.PRNGKey(0), greedy=True)
    got = SP.speculative_tokens(model, lm.params, prompts, 4, jax.random.PRNGKey(0), draft=draft, gamma=2,
                                greedy=True)
    assert got.tokens.tolist() == want.tokens.tolist()
    key = jax.random.PRNGKey(9)
    together = SP.speculative_tokens(model, lm.params, prompts, 4, key, draft=draft, gamma=2, rule=rules.top_k(5))
    alone = SP.speculative_tokens(model, lm.params, prompts[1:2], 4, key, draft=draft, gamma=2,
                                  rule=rules.top_k(5), row_ids=[1])
    assert alone.tokens[0].tolist() == together.tokens[1].tolist()
    gens = SP.speculative_generate(lm, MC_PROMPTS[:1], 4, draft=draft, gamma=2, greedy=True)
    assert gens[0].text == lm.vocab.decode(want.tokens[0])
