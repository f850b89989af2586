"""Speculative sampling: the acceptance rule, exactness against enumerated distributions,
greedy equivalence, batch invariance and the errors it raises."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from support.compiled import assert_same_draws
from jaxdecode.models.charlm import transformer as M
from jaxdecode import rules
from jaxdecode.decoding import sampling as S
from jaxdecode import speculative as SP
from jaxdecode.speculative import acceptance as SA
from jaxdecode.speculative import loop as SPL
from jaxdecode.eval.exact import chisquare_pvalue, exact_distribution, model_next_logits
from jaxdecode.models.charlm.transformer import ModelConfig, init_params
from jaxdecode.models import decoder_for

P_MIN = 1e-3  # chi-square p-value below which a fixed-seed sample counts as a mismatch


def random_params(cfg: ModelConfig, seed: int, scale: float):
    """Random weights without compiling Flax's init: normal(scale), LayerNorm scales 1."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        if getattr(path[-1], "key", None) == "scale":
            return jnp.ones(leaf.shape, jnp.float32)
        return jnp.asarray(rng.normal(0.0, scale, leaf.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(fill, shapes)


# a small target for the exactness tests (cheap enough for 1e5 rows per case) and its draft
EXACT_CFG = ModelConfig(V=8, T=12, d=8, L=1, heads=1)
# Weights of scale 0.5 keep the target spread out: its first 3 tokens take 426 of the 512
# sequences at 5 or more expected draws in 1e5 (entropy 4.5 nats), 33 sequences under top-p 0.8.
# (At scale 1 one sequence had 97% of the mass and top-p 0.8 kept only it, so that a sampler
# that resamples from the target after a rejection, or draws the extra token from the residual,
# passed every top-p 0.8 case.)
EXACT_SCALE = 0.5
EXACT_PROMPT = np.array([1, 2, 3, 1], np.int32)  # "1" recurs, so prompt lookup finds matches
DRAWS = 50_000  # rows per case (the power each test states is at this many)


TOP_P = (1.0, 0.8)  # top-p 1 keeps every token: plain sampling, with the same compiled program


@pytest.fixture(scope="module")
def exact_want():
    params = random_params(EXACT_CFG, 0, EXACT_SCALE)
    next_logits = model_next_logits(params, EXACT_CFG)
    return {p: exact_distribution(next_logits, EXACT_PROMPT, 3, rule=rules.top_p(p), V=EXACT_CFG.V)
            for p in TOP_P}


@pytest.fixture(scope="module")
def exact_params():
    """The exactness target's parameters and shape (backend-free: for the distillation tests)."""
    return random_params(EXACT_CFG, 0, EXACT_SCALE), EXACT_CFG


@pytest.fixture(scope="module")
def exact_model(exact_want, backend):
    return random_params(EXACT_CFG, 0, EXACT_SCALE), EXACT_CFG, exact_want, decoder_for(EXACT_CFG, backend)


def make_drafts(params, cfg: ModelConfig, seed: int = 1, backend: str = "portable"):
    V = cfg.V
    rng = np.random.default_rng(seed)
    text = rng.integers(0, V, 3000)
    dcfg = ModelConfig(V=V, T=cfg.T, d=4, L=1, heads=1)
    return {
        "ngram": SP.NGramDraft.from_tokens(text, V, n=3),
        "backoff": SP.NGramDraft.from_tokens(text, V, n=4, backoff=2.0),
        "distilled": SP.NGramDraft.distill(decoder_for(cfg, "portable"), params, text[:1000], n=4),
        "model": SP.ModelDraft(random_params(dcfg, seed, 0.5), decoder_for(dcfg, backend)),
        "lookup": SP.PromptLookupDraft(2),
    }


@pytest.fixture(scope="module")
def exact_drafts(exact_model, backend):
    params, cfg, _, _ = exact_model
    return make_drafts(params, cfg, backend=backend)


@pytest.fixture(scope="module")
def small_lm(backend):
    """A random model shaped like conftest's ``tiny_lm`` (V=12, T=16), with one layer."""
    from jaxdecode.models.checkpoint import LanguageModel
    from jaxdecode.io.vocab import Vocab

    cfg = ModelConfig(V=12, T=16, d=16, L=1, heads=2)
    return LanguageModel(params=random_params(cfg, 3, 1.0), cfg=cfg, vocab=Vocab(" abcdefghi.\n"), meta={},
                         backend=backend)


@pytest.fixture(scope="module")
def small_drafts(small_lm):
    return make_drafts(small_lm.params, small_lm.cfg, seed=2, backend=small_lm.decoder.backend)


# ----------------------------------------------------------------------------- the acceptance rule


@pytest.mark.quick
def test_toy_acceptance_and_frequencies():
    """The chapter's check: p = [.5, .2, .2, .1] against a uniform draft."""
    n, V = 200_000, 4
    p = np.array([0.5, 0.2, 0.2, 0.1], np.float32)
    q = np.full(V, 0.25, np.float32)
    draft = np.random.default_rng(0).integers(0, V, (n, 1)).astype(np.int32)
    P = jnp.broadcast_to(jnp.asarray(p), (n, 2, V))
    Q = jnp.broadcast_to(jnp.asarray(q), (n, 1, V))
    n_acc, nxt = SP.accept(P, Q, draft, jax.random.PRNGKey(0))
    n_acc, nxt = np.asarray(n_acc), np.asarray(nxt)
    assert abs(n_acc.mean() - 0.75) < 0.005  # sum_i min(p_i, q_i)
    first = np.where(n_acc == 1, draft[:, 0], nxt)
    counts = np.bincount(first, minlength=V)
    assert stats.chisquare(counts, p * n).pvalue > P_MIN
    # a rejected proposal is replaced from the residual max(p - q, 0) = [.25, 0, 0, 0]
    assert set(np.unique(nxt[n_acc == 0])) <= {0}
    assert np.all(nxt[n_acc == 0] != draft[n_acc == 0, 0])


@pytest.mark.quick
def test_inverse_cdf_draws():
    """draw_token follows the normalized weights, never picks a zero weight (also at the extreme
    uniforms), and pick_token draws from softmax(logits) with -inf entries removed."""
    w = jnp.asarray([[0.0, 3.0, 0.0, 1.0, 0.0, 4.0, 0.0]])
    edges = jnp.asarray([jnp.finfo(jnp.float32).tiny, 0.375, 0.3751, 0.5, 0.5001, 1 - 2**-24])
    got = SA.draw_token(jnp.broadcast_to(w, (6, 7)), edges).tolist()
    assert got == [1, 1, 3, 3, 5, 5]  # cumulative weights 3, 4, 8 of 8: 0.375, 0.5, 1
    n = 200_000
    u = jax.random.uniform(jax.random.PRNGKey(3), (n,), minval=jnp.finfo(jnp.float32).tiny)
    counts = np.bincount(np.asarray(SA.draw_token(jnp.broadcast_to(w, (n, 7)), u)), minlength=7)
    assert counts[[0, 2, 4, 6]].sum() == 0
    assert stats.chisquare(counts[[1, 3, 5]], np.array([3, 1, 4]) / 8 * n).pvalue > P_MIN
    logits = jnp.log(jnp.broadcast_to(w, (n, 7)))  # -inf where the weight is 0
    counts = np.bincount(np.asarray(SA.pick_token(logits, u)), minlength=7)
    assert counts[[0, 2, 4, 6]].sum() == 0
    assert stats.chisquare(counts[[1, 3, 5]], np.array([3, 1, 4]) / 8 * n).pvalue > P_MIN
    assert SA.pick_token(logits[:2], None).tolist() == [5, 5]


@pytest.mark.quick
def test_accept_all_and_greedy():
    V = 5
    p = jnp.asarray(np.eye(V, dtype=np.float32)[[1, 2, 3]])[None]  # point masses at 1, 2, 3
    q = p[:, :2]
    n_acc, nxt = SP.accept(p, q, np.array([[1, 2]]), jax.random.PRNGKey(0))
    assert int(n_acc[0]) == 2 and int(nxt[0]) == 3  # everything kept, one more from p[:, 2]
    n_acc, nxt = SP.accept(p, q, np.array([[1, 4]]), jax.random.PRNGKey(0))
    assert int(n_acc[0]) == 1 and int(nxt[0]) == 2
    logits = jnp.log(p + 0.01)
    n_acc, nxt = SP.accept(logits, None, np.array([[1, 0]]), jax.random.PRNGKey(0), greedy=True)
    assert int(n_acc[0]) == 1 and int(nxt[0]) == 2


def test_predicted_chars_per_pass():
    assert SP.predicted_chars_per_pass(0.0, 4) == 1.0
    assert SP.predicted_chars_per_pass(1.0, 4) == 5.0
    assert SP.predicted_chars_per_pass(0.6, 1) == pytest.approx(1.6)


# ----------------------------------------------------------------------------- drafts


def test_ngram_table_matches_counts():
    V, alpha = 3, 0.01
    tokens = np.array([0, 1, 2, 0, 1, 0, 0, 1, 2])
    d = SP.NGramDraft.from_tokens(tokens, V, n=3, alpha=alpha)
    counts = np.full((V, V, V), alpha)
    np.add.at(counts, (tokens[:-2], tokens[1:-1], tokens[2:]), 1)
    want = counts / counts.sum(-1, keepdims=True)
    ctx = jnp.asarray([[a, b] for a in range(V) for b in range(V)], jnp.int32)
    got = np.exp(np.asarray(d._next_logits(ctx))).reshape(V, V, V)
    seen = counts.sum(-1) > V * alpha + 0.5
    np.testing.assert_allclose(got[seen], want[seen], rtol=1e-5)
    np.testing.assert_allclose(got[~seen], 1.0 / V, rtol=1e-5)  # unseen context: uniform
    # without the direct index (large tables), the hash table
    sparse = hashed(lambda: SP.NGramDraft.from_tokens(tokens, V, n=3, alpha=alpha))
    assert sparse.index is None and sparse.probes >= 1
    np.testing.assert_array_equal(np.asarray(sparse._next_logits(ctx)), np.asarray(d._next_logits(ctx)))
    # an incomplete context (prompt shorter than n - 1) is unseen as well
    state = d.init(jnp.asarray([[2, 0]]), jnp.asarray([1]), 8)
    assert state.context.tolist() == [[V, 2]]


def hashed(build):
    """``build()`` with the direct index turned off: lookups go through the hash table."""
    old = SP.NGramDraft.MAX_INDEX
    SP.NGramDraft.MAX_INDEX = 0
    try:
        return build()
    finally:
        SP.NGramDraft.MAX_INDEX = old


def backoff_reference(tokens, V, n, beta, context, soft=None):
    """The interpolated estimate written plainly: from the empty context up, each order mixes
    its counts with the order below, q_k = (count + beta * q_(k-1)) / (total + beta). With
    ``soft``, position j adds the distribution soft[j] instead of counting tokens[j]."""
    real = [t for t in context if t != V]
    q = np.full(V, 1.0 / V)
    for k in range(len(real) + 1):
        h = tuple(real[len(real) - k:])
        counts, seen = np.zeros(V), False
        for j in range(k, len(tokens)):
            if tuple(tokens[j - k:j]) == h:
                seen = True
                if soft is None:
                    counts[tokens[j]] += 1
                else:
                    counts += soft[j]
        if not seen:  # unseen: the longest seen context decides
            break
        q = (counts + beta * q) / (counts.sum() + beta)
    return q


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_ngram_backoff_matches_reference(n, soft):
    V, beta = 4, 2.0
    rng = np.random.default_rng(n)
    tokens = rng.integers(0, V, 300)
    tokens[:40] = 1  # a skewed stretch: some long contexts are frequent, others unseen
    weights = rng.dirichlet(np.full(V, 0.5), len(tokens)) if soft else None
    # every context of n-1 digits whose padding (V) comes first, as init() builds them
    contexts = [c for c in np.ndindex(*(V + 1,) * (n - 1))
                if all(a == V for a in c[:sum(1 for x in c if x == V)])]
    ctx = jnp.asarray(np.array(contexts, np.int32).reshape(len(contexts), n - 1))
    want = np.array([backoff_reference(tokens, V, n, beta, c, weights) for c in contexts])
    for d in (SP.NGramDraft.from_tokens(tokens, V, n=n, backoff=beta, soft=weights),
              hashed(lambda: SP.NGramDraft.from_tokens(tokens, V, n=n, backoff=beta, soft=weights))):
        got = np.exp(np.asarray(d._next_logits(ctx)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_backoff_transitions_match_the_context_lookup(n):
    """The one-gather walk over ``goto`` proposes exactly what looking the context up at every
    order does: same tokens, same q, through proposals, partial acceptances and short prompts."""
    import dataclasses

    V, B, gamma = 4, 6, 3
    rng = np.random.default_rng(n)
    tokens = rng.integers(0, V, 400)
    tokens[:50] = 2  # frequent long contexts next to unseen ones
    walk = SP.NGramDraft.from_tokens(tokens, V, n=n, backoff=1.0)
    assert walk.goto is not None
    look = dataclasses.replace(walk, goto=None)
    prompt = jnp.asarray(rng.integers(0, V, (B, 8)), jnp.int32)
    lengths = jnp.asarray([1, 2, 8, 5, 3, 8])
    states = [d.init(prompt, lengths, 64) for d in (walk, look)]
    for _it in range(12):
        noise = jnp.asarray(rng.uniform(size=(B, gamma)), jnp.float32)
        out = [d.propose(st, noise, gamma, lambda x: x, 64) for d, st in zip((walk, look), states)]
        np.testing.assert_array_equal(np.asarray(out[0][0]), np.asarray(out[1][0]))
        np.testing.assert_allclose(np.asarray(out[0][1]), np.asarray(out[1][1]), rtol=1e-6)
        n_acc = jnp.asarray(rng.integers(0, gamma + 1, B), jnp.int32)
        nxt = jnp.asarray(rng.integers(0, V, B), jnp.int32)
        active = jnp.asarray(rng.random(B) < 0.8)
        states = [d.commit(o[2], o[0], n_acc, nxt, active) for d, o in zip((walk, look), out)]


def test_backoff_table_needs_the_empty_context():
    with pytest.raises(ValueError, match="empty context"):
        SP.NGramDraft.from_table(np.array([0, 1]), np.zeros((3, 2)), n=2, backoff=True)
    d = SP.NGramDraft.from_tokens(np.arange(20) % 3, 3, n=2, backoff=1.0)
    with pytest.raises(ValueError, match="transition table"):
        SP.NGramDraft.from_table(d.keys, d.logits, n=2, backoff=True, goto=np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="transition table"):
        SP.NGramDraft.from_table(d.keys, d.logits, n=2, backoff=True, goto=np.asarray(d.goto) + 9)


@pytest.mark.parametrize("backoff", [None, 1.5])
def test_one_hot_soft_counts_are_counting(backoff):
    V = 5
    tokens = np.random.default_rng(0).integers(0, V, 200)
    counted = SP.NGramDraft.from_tokens(tokens, V, n=3, backoff=backoff)
    soft = SP.NGramDraft.from_tokens(tokens, V, n=3, backoff=backoff, soft=np.eye(V)[tokens])
    np.testing.assert_array_equal(np.asarray(soft.keys), np.asarray(counted.keys))
    np.testing.assert_allclose(np.asarray(soft.logits), np.asarray(counted.logits), rtol=1e-6)


@pytest.mark.parametrize("soft, message", [
    (np.ones((10, 2)), "shape"),
    (np.full((10, 3), -1.0), "non-negative"),
    (np.full((10, 3), np.nan), "finite"),
])
def test_bad_soft_counts(soft, message):
    with pytest.raises(ValueError, match=message):
        SP.NGramDraft.from_tokens(np.arange(10) % 3, 3, soft=soft)


@pytest.mark.parametrize("N, stride", [(1, None), (2, None), (12, None), (13, None), (14, 5),
                                       (60, 7), (60, 12), (40, 1)])
@pytest.mark.slow
def test_target_predictions_match_the_forward_pass(exact_params, N, stride):
    """Row i is the forward pass over the window the docstring names, ending at token i - 1."""
    params, cfg = exact_params
    T = cfg.T
    tokens = np.random.default_rng(N).integers(0, cfg.V, N)
    got = SP.target_predictions(decoder_for(cfg, "portable"), params, tokens, stride=stride, batch=3)
    step = 3 * T // 4 if stride is None else stride
    want = np.zeros((N, cfg.V), np.float32)
    want[0, tokens[0]] = 1.0
    forward = jax.jit(lambda p, x: M.forward(p, cfg, x))  # one program: every window padded to T
    for i in range(1, N):
        s = 0 if i - 1 < T else ((i - 1 - T) // step + 1) * step
        assert min(i, T - step) <= i - s <= T  # the context it promises
        window = np.zeros((1, T), np.int32)
        window[0, :i - s] = tokens[s:i]  # causal: the padding after position i - s - 1 is unseen
        logits = forward(params, jnp.asarray(window))[0, i - s - 1]
        want[i] = np.asarray(jax.nn.softmax(logits))
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_target_predictions_bad_settings(exact_params):
    params, cfg = exact_params
    with pytest.raises(ValueError, match="stride"):
        SP.target_predictions(decoder_for(cfg, "portable"), params, np.arange(5), stride=cfg.T + 1)
    with pytest.raises(ValueError, match="token ids"):
        SP.target_predictions(decoder_for(cfg, "portable"), params, np.array([0, cfg.V]))


def test_distilled_table_averages_the_targets_predictions(exact_params):
    """A context's row is the mean prediction after it (nearly no backoff); with backoff, the
    table overlaps the target's predictions on new text more than counting does."""
    params, cfg = exact_params
    tokens = np.random.default_rng(5).integers(0, cfg.V, 2000)
    d = SP.NGramDraft.distill(decoder_for(cfg, "portable"), params, tokens, n=2, backoff=1e-6)
    pred = SP.target_predictions(decoder_for(cfg, "portable"), params, tokens)
    for c in range(cfg.V):
        after = np.flatnonzero(tokens[:-1] == c) + 1
        got = np.exp(np.asarray(d._next_logits(jnp.asarray([[c]], jnp.int32))))[0]
        np.testing.assert_allclose(got, pred[after].mean(axis=0), rtol=1e-4, atol=1e-6)
    # held-out text: the distilled 3-gram overlaps the target's predictions more than the counted
    held = np.random.default_rng(6).integers(0, cfg.V, 600)
    p_held = SP.target_predictions(decoder_for(cfg, "portable"), params, held)[2:]
    ctx = jnp.asarray(np.stack([held[:-2], held[1:-1]], axis=1), jnp.int32)
    overlap = {}
    for name, draft in (("distilled", SP.NGramDraft.distill(decoder_for(cfg, "portable"), params, tokens, n=3, backoff=2.0)),
                        ("counted", SP.NGramDraft.from_tokens(tokens, cfg.V, n=3, backoff=2.0))):
        q = np.exp(np.asarray(draft._next_logits(ctx)))
        overlap[name] = np.minimum(p_held, q).sum(axis=1).mean()  # the acceptance rate
    assert overlap["distilled"] > overlap["counted"] + 0.02, overlap


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, "n must be an integer"),
    ({"backoff": 0.0}, "backoff"),
    ({"backoff": float("nan")}, "backoff"),
    ({"alpha": -1.0}, "alpha"),
])
def test_ngram_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SP.NGramDraft.from_tokens(np.arange(10) % 3, 3, **kwargs)


def test_ngram_from_corpus_uses_the_training_split():
    from jaxdecode.io.vocab import Vocab

    vocab = Vocab("ab")
    d = SP.NGramDraft.from_corpus(vocab, "ab" * 45 + "bbbbbbbbbb", n=2)
    # "bb" occurs only in the last 10%: after "b" the table has seen only "a"
    p = np.exp(np.asarray(d._next_logits(jnp.asarray([[1]]))))[0]
    assert p[0] > 0.99


def test_prompt_lookup_proposals():
    d = SP.PromptLookupDraft(2)
    # context 5 6 7 5 6: "5 6" occurred before, followed by 7 5 6 7 ...
    state = d.init(jnp.asarray([[5, 6, 7, 5, 6], [1, 2, 3, 4, 0]]), jnp.asarray([5, 4]), 16)
    tokens, q, _ = d.propose(state, None, 4, lambda x: x, 16)
    assert q is None
    assert tokens[0].tolist() == [7, 5, 6, 7]
    assert tokens[1].tolist() == [4, 4, 4, 4]  # no occurrence: repeat the last token
    # commit two accepted proposals and a correction, then propose again
    state = d.commit(state, tokens, jnp.asarray([2, 0]), jnp.asarray([9, 2]), jnp.asarray([True, True]))
    assert state.length.tolist() == [8, 5]
    assert state.history[0, :8].tolist() == [5, 6, 7, 5, 6, 7, 5, 9]
    # accept the first proposal (7) and add 5 in row 0; row 1 is finished (not active)
    state = d.commit(state, tokens, jnp.asarray([1, 4]), jnp.asarray([5, 1]), jnp.asarray([True, False]))
    assert state.length.tolist() == [10, 5]  # the inactive row keeps its context
    tokens, _, _ = d.propose(state, None, 3, lambda x: x, 16)
    # context 5 6 7 5 6 7 5 9 7 5: "7 5" last occurred at positions 5-6, followed by 9 7 5
    assert tokens[0].tolist() == [9, 7, 5]
    assert tokens[1].tolist() == [2, 2, 2]  # context 1 2 3 4 2: "4 2" is new, repeat the last


@pytest.mark.slow
def test_distilled_draft_is_cached(small_lm, tmp_path, monkeypatch):
    """Built once per (weights, text, settings), written atomically, read back identical; a
    damaged file is rebuilt with a warning; with caching off, built without any file."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abc de.\nfghi a " * 680)  # 10,200 characters, the least a corpus may have
    monkeypatch.setenv("JAXDECODE_CACHE", str(tmp_path / "cache"))
    first = SP.make_draft("distilled", small_lm, corpus, n=3)
    files = list((tmp_path / "cache" / "drafts").glob("distilled-*.npz"))
    assert len(files) == 1 and not list((tmp_path / "cache" / "drafts").glob("*.tmp"))

    def refuse(*args, **kwargs):
        raise AssertionError("rebuilt although cached")

    with monkeypatch.context() as m:
        m.setattr(SP.NGramDraft, "distill", refuse)
        again = SP.make_draft("distilled", small_lm, corpus, n=3)
    for a, b in ((first.keys, again.keys), (first.logits, again.logits), (first.goto, again.goto)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (again.n, again.backoff) == (3, True)
    # other settings or other weights: another table
    SP.make_draft("distilled", small_lm, corpus, n=3, backoff=1.0)
    assert len(list((tmp_path / "cache" / "drafts").glob("distilled-*.npz"))) == 2
    files[0].write_bytes(b"not a table")
    with pytest.warns(UserWarning, match="rebuilding"):
        rebuilt = SP.make_draft("distilled", small_lm, corpus, n=3)
    np.testing.assert_array_equal(np.asarray(rebuilt.logits), np.asarray(first.logits))
    # caching off ($JAXDECODE_CACHE empty): the same table, and no file written anywhere
    monkeypatch.setenv("JAXDECODE_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    before = sorted(tmp_path.rglob("*"))
    off = SP.make_draft("distilled", small_lm, corpus, n=3)
    assert sorted(tmp_path.rglob("*")) == before
    np.testing.assert_array_equal(np.asarray(off.logits), np.asarray(first.logits))


# ----------------------------------------------------------------------------- exactness


@pytest.mark.slow
@pytest.mark.optimized
# gamma 4 proposes past the 3 tokens checked; gamma 1 and 2 also check the extra token drawn from
# the target after every proposal is accepted (at position 2 or 3)
@pytest.mark.parametrize("backend, gamma", [("native", 1), ("native", 4), ("portable", 2)], scope="module")
@pytest.mark.parametrize("kind", ["ngram", "distilled", "model", "lookup"])
def test_exact_distribution_of_first_three_tokens(exact_model, exact_drafts, kind, gamma):
    """Each row of a big batch is one draw; the first 3 tokens follow the processed target.

    Power at level 1e-3 with 5e4 draws (the sampler run with a wrong acceptance step, the
    noncentrality from its chi-square statistic, measured at 1e5 draws and halved): 1.0 in every
    case against acceptance with min(1, q/p), and against drawing from the target instead of the
    residual after a rejection (noncentrality 6.5e3 or more). Against drawing the extra token (after
    all proposals are accepted) from the residual: 0.9994 or more for every draft at gamma 1 and for
    the n-gram, distilled and model drafts at gamma 2 (the least noncentrality: 87.5 on 32 degrees
    of freedom, the model draft at gamma 2 under top-p 0.8); prompt lookup rarely has both of its
    proposals accepted here, and at gamma 4 the extra token comes after the 3 checked."""
    params, cfg, want, model = exact_model
    # a spread-out target (see EXACT_SCALE): the power above depends on it
    assert len(want[TOP_P[1]]) >= 30 and max(want[TOP_P[0]].values()) < 0.2
    prompts = np.broadcast_to(EXACT_PROMPT, (DRAWS, len(EXACT_PROMPT)))
    for p in TOP_P:
        res = SP.speculative_tokens(model, params, prompts, 3, jax.random.PRNGKey(11), draft=exact_drafts[kind],
                                    gamma=gamma, rule=rules.top_p(p))
        codes, counts = np.unique(res.tokens, axis=0, return_counts=True)
        counts = {tuple(c): k for c, k in zip(codes.tolist(), counts.tolist())}
        pvalue = chisquare_pvalue(counts, want[p])
        total = SP.SpeculativeStats.total(res.stats)
        assert pvalue > P_MIN, (kind, gamma, p, pvalue)
        assert total.generated >= 3 * DRAWS and total.passes >= DRAWS
        assert 0 < total.accepted <= total.examined <= total.proposed == gamma * total.passes


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native"], scope="module")
def test_exact_distribution_with_backoff_draft(exact_model, exact_drafts):
    """The interpolated n-gram draft (a table walked through its transitions) is exact too. Power
    with 5e4 draws against drawing from the target instead of the residual after a rejection: 1.0
    (noncentrality 1.6e4 on 32 degrees of freedom); against acceptance with min(1, q/p): 1.0.
    The draws run on the native backend; the portable one draws the same first 2,000 rows."""
    params, cfg, want, model = exact_model
    prompts = np.broadcast_to(EXACT_PROMPT, (DRAWS, len(EXACT_PROMPT)))
    p = TOP_P[1]
    res = SP.speculative_tokens(model, params, prompts, 3, jax.random.PRNGKey(12), draft=exact_drafts["backoff"],
                                gamma=4, rule=rules.top_p(p))
    codes, counts = np.unique(res.tokens, axis=0, return_counts=True)
    counts = {tuple(c): k for c, k in zip(codes.tolist(), counts.tolist())}
    assert chisquare_pvalue(counts, want[p]) > P_MIN
    portable = SP.speculative_tokens(decoder_for(cfg, "portable"), params, prompts[:2000], 3,
                                     jax.random.PRNGKey(12), draft=exact_drafts["backoff"], gamma=4,
                                     rule=rules.top_p(p))
    assert_same_draws(res.tokens, portable.tokens, "backoff")


@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_backends_agree_at_every_gamma(exact_params, gamma):
    """The exactness tests above draw each gamma on one backend; here every gamma from 1 to 4 runs
    on both backends with the same keys, prompts and draft (a model draft, on the target's backend):
    the native and portable samplers return the same first 3 tokens in every row (2,000 rows of the
    exactness target under top-p 0.8), so what is shown on one backend holds on the other. Float
    rounding between the backends may move a uniform across p / q in a rare row: at most 1 in 500
    rows may differ (none did when this was written)."""
    params, cfg = exact_params
    rows = 2000
    prompts = np.broadcast_to(EXACT_PROMPT, (rows, len(EXACT_PROMPT)))
    dcfg = ModelConfig(V=cfg.V, T=cfg.T, d=4, L=1, heads=1)
    out = {}
    for b in ("native", "portable"):
        draft = SP.ModelDraft(random_params(dcfg, 1, 0.5), decoder_for(dcfg, b))
        res = SP.speculative_tokens(decoder_for(cfg, b), params, prompts, 3, jax.random.PRNGKey(13), draft=draft,
                                    gamma=gamma, rule=rules.top_p(0.8))
        out[b] = np.asarray(res.tokens)
        total = SP.SpeculativeStats.total(res.stats)
        assert total.proposed == gamma * total.passes and total.accepted > 0
    assert_same_draws(out["native"], out["portable"], f"gamma {gamma}")
    assert len(np.unique(out["native"], axis=0)) >= 20  # really sampled, not one sequence


# ----------------------------------------------------------------------------- greedy, batches


def ragged_prompts(V, sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=s).astype(np.int32) for s in sizes]


@pytest.mark.quick_ids('native-model', 'portable-lookup')
@pytest.mark.parametrize("kind", ["ngram", "backoff", "distilled", "model", "lookup"])
def test_greedy_speculative_equals_greedy(small_lm, small_drafts, kind):
    cfg, params, model = small_lm.cfg, small_lm.params, small_lm.decoder
    prompts = ragged_prompts(cfg.V, [1, 6, 3, 2, 5])
    prompts[2] = np.array([3, 4, 3], np.int32)
    n, gamma = 6, 3
    want = S.sample_tokens(model, params, prompts, n, jax.random.PRNGKey(0), greedy=True)
    got = SP.speculative_tokens(model, params, prompts, n, jax.random.PRNGKey(5), draft=small_drafts[kind],
                                gamma=gamma, greedy=True)
    assert got.tokens.tolist() == want.tokens.tolist()
    np.testing.assert_allclose(got.model_logprobs, want.model_logprobs, atol=1e-4)
    for s in got.stats:
        assert s.generated >= n and s.passes >= 1


@pytest.mark.quick_ids('native')
def test_generate_api(small_lm, small_drafts):
    # the shapes of the greedy test above, so that its programs are reused
    prompts = ["a", "hi. ab", "cdc", "e\n", "f.ghi"]
    greedy = S.generate(small_lm, prompts, 6, greedy=True)
    gens = SP.speculative_generate(small_lm, prompts, 6, draft=small_drafts["lookup"], gamma=3, greedy=True)
    assert [g.text for g in gens] == [g.text for g in greedy]
    for g in gens:
        assert len(g.tokens) == 6 and np.isfinite(g.mean_logprob)
        assert g.stats.passes >= 2 and g.stats.proposed == 3 * g.stats.passes
    total = SP.SpeculativeStats.total([g.stats for g in gens])
    assert total.passes == sum(g.stats.passes for g in gens)


def test_batch_invariance(small_lm, small_drafts):
    cfg, params, model = small_lm.cfg, small_lm.params, small_lm.decoder
    prompts = ragged_prompts(cfg.V, [2, 5, 1, 4, 3, 5, 2], seed=3)
    key = jax.random.PRNGKey(7)
    kw = {"draft": small_drafts["ngram"], "gamma": 2, "rule": rules.top_k(5)}
    together = SP.speculative_tokens(model, params, prompts, 8, key, **kw)
    for i in [0, 4, 6]:
        alone = SP.speculative_tokens(model, params, [prompts[i]], 8, key, row_ids=[i], **kw)
        assert alone.tokens[0].tolist() == together.tokens[i].tolist()
        assert alone.stats[0] == together.stats[i]
    # the high-level API: sample j of a prompt is row j, with the prompt's seed
    gens = SP.speculative_generate(small_lm, small_lm.vocab.decode(prompts[0]), 8, key=key, **kw)
    assert gens[0].tokens.tolist() == together.tokens[0].tolist()
    assert gens[0].text == small_lm.vocab.decode(together.tokens[0])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native"], scope="module")  # the test picks each segment's backend itself
@pytest.mark.parametrize("segments", ["one", "many"])
def test_noise_drawn_up_front_is_the_same_noise(small_drafts, monkeypatch, segments):
    """A segment draws its iterations' noise in one call when that is small (NOISE_TABLE_MAX):
    the text must be the one the per-iteration draws give, also when a request runs as several
    segments (without the native attention the attended span grows in steps of SPAN_BUCKET), whose
    tables start at a later iteration."""
    cfg = ModelConfig(V=12, T=2 * S.SPAN_BUCKET, d=16, L=1, heads=2)
    params = random_params(cfg, 5, 1.0)
    model = decoder_for(cfg, "native" if segments == "one" else "portable")  # portable: growing spans
    lens = [S.SPAN_BUCKET - 6, S.SPAN_BUCKET - 12, S.SPAN_BUCKET - 3]  # every row crosses the bucket
    prompts = ragged_prompts(cfg.V, lens, seed=4)
    kw = {"draft": small_drafts["ngram"], "gamma": 2, "rule": rules.top_k(6)}
    segment, calls = SPL._segment, []
    monkeypatch.setattr(SPL, "_segment", lambda *a, **k: calls.append(k["span"]) or segment(*a, **k))
    runs = []
    for table_max in (SPL.NOISE_TABLE_MAX, 0):
        monkeypatch.setattr(SPL, "NOISE_TABLE_MAX", table_max)
        segment.clear_cache()  # the table is chosen when the loop is traced
        calls.clear()
        runs.append(SP.speculative_tokens(model, params, prompts, 20, jax.random.PRNGKey(11), **kw))
    segment.clear_cache()
    assert len(calls) == (1 if segments == "one" else 2), calls
    (a, b) = runs
    np.testing.assert_array_equal(a.tokens, b.tokens)
    # the same noise, so the same tokens; the log-probabilities come from two programs that XLA
    # fuses differently (a table input against draws in the loop): equal up to a float32 unit or two
    np.testing.assert_allclose(a.sample_logprobs, b.sample_logprobs, rtol=0, atol=2e-6)
    assert a.stats == b.stats
    assert sum(s.passes for s in a.stats) > len(prompts)  # several iterations per row


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("rule", [rules.repetition_penalty(1.3), rules.no_repeat_ngram(2),
                                  rules.chain(rules.top_p(0.9), rules.presence_penalty(0.5))])
def test_stateful_rules_are_refused(small_lm, small_drafts, rule):
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        SP.speculative_tokens(small_lm.decoder, small_lm.params, [np.array([1, 2])], 3, jax.random.PRNGKey(0),
                              draft=small_drafts["ngram"], rule=rule)


def test_requests_past_the_window_are_refused(small_lm, small_drafts):
    cfg = small_lm.cfg  # T = 16
    with pytest.raises(ValueError, match="model window T=16"):
        SP.speculative_tokens(small_lm.decoder, small_lm.params, [np.arange(5) % cfg.V], 8, jax.random.PRNGKey(0),
                              draft=small_drafts["lookup"], gamma=4)  # 5 + 8 + 5 = 18 > 16
    with pytest.raises(ValueError, match="gamma"):
        SP.speculative_tokens(small_lm.decoder, small_lm.params, [np.array([1])], 3, jax.random.PRNGKey(0),
                              draft=small_drafts["lookup"], gamma=0)
    with pytest.raises(ValueError, match="draft kind"):
        SP.make_draft("nope", small_lm)


# ----------------------------------------------------------------------------- the package


@pytest.mark.quick
def test_draft_registry():
    """make_draft knows exactly the registered drafts; an unknown name is refused, naming them."""
    assert list(SP.DRAFTS) == ["ngram", "distilled", "draft", "lookup"]
    assert all(isinstance(d.about, str) and d.about for d in SP.DRAFTS.values())
    with pytest.raises(ValueError, match="unknown draft kind 'nope'") as e:
        SP.make_draft("nope", None)
    for name in SP.DRAFTS:
        assert repr(name) in str(e.value)
    with pytest.raises(ValueError, match="already registered"):
        SP.register_draft("lookup", "again")(lambda lm, data_path=None, **kw: None)
    assert isinstance(SP.make_draft("lookup", None, n=2), SP.PromptLookupDraft)
    with pytest.raises(ValueError, match="backoff applies to the n-gram drafts only"):
        SP.make_draft("lookup", None, backoff=2.0)


@pytest.mark.quick
def test_the_loop_reads_no_files():
    """The loop module computes only: it opens no file and imports neither the corpus reader,
    the checkpoint loader, the cache paths nor pathlib."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(SPL.__file__).read_text(encoding="utf-8"))
    banned = {"pathlib", "jaxdecode.io.data", "jaxdecode.models.checkpoint", "jaxdecode.io.paths", "io", "os", "shutil",
              "tempfile"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            # resolve relative imports: loop.py is jaxdecode.speculative.loop
            base = ["jaxdecode", "speculative"][:max(0, 2 - (node.level - 1))] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = {module} | {f"{module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Name) and node.id == "open":
            raise AssertionError(f"loop.py uses open() at line {node.lineno}")
        else:
            continue
        for name in names:
            assert not any(name == b or name.startswith(b + ".") for b in banned), (name, node.lineno)


# ----------------------------------------------------------------------------- stop strings, streaming


@pytest.mark.quick_ids('native')
def test_stop_strings_and_streaming(small_lm, small_drafts, backend):
    """A row ends after its first stop string (also one that straddles two host round trips),
    with the tokens of the run without stops; streamed pieces add up to the outputs."""
    from jaxdecode.models.checkpoint import LanguageModel

    cfg = ModelConfig(V=12, T=64, d=16, L=1, heads=2)
    lm = LanguageModel(params=random_params(cfg, 3, 1.0), cfg=cfg, vocab=small_lm.vocab, meta={}, backend=backend)
    params, model = lm.params, lm.decoder
    prompts = ragged_prompts(model.V, [2, 5, 1, 4], seed=5)
    kw = {"draft": small_drafts["ngram"], "gamma": 2, "rule": rules.top_k(6)}
    key = jax.random.PRNGKey(21)
    free = SP.speculative_tokens(model, params, prompts, 40, key, **kw)
    assert free.counts.tolist() == [40] * 4 and not free.stopped.any()
    stop = free.tokens[0, 30:32]  # row 0 produces it late: after at least one round trip
    first = lambda row: next((e for e in range(2, 41) if row[e - 2:e].tolist() == stop.tolist()), None)
    pieces = [[] for _ in prompts]

    def on_chunk(tokens, emitted):
        for r in range(len(prompts)):
            pieces[r] += tokens[r][emitted[r]].tolist()

    res = SP.speculative_tokens(model, params, prompts, 40, key, stops=[stop], on_chunk=on_chunk, **kw)
    for r in range(len(prompts)):
        end = first(free.tokens[r])
        assert res.counts[r] == (end if end else 40) and res.stopped[r] == (end is not None)
        assert res.tokens[r, :res.counts[r]].tolist() == free.tokens[r, :res.counts[r]].tolist()
        assert pieces[r] == res.tokens[r, :res.counts[r]].tolist()
    assert res.stopped[0] and res.counts[0] <= 32
    # the text level
    text = lm.vocab.decode(prompts[0])
    gens = SP.speculative_generate(lm, text, 40, key=key, stop=lm.vocab.decode(stop), **kw)
    assert gens[0].finish_reason == "stop" and gens[0].tokens.tolist() == res.tokens[0, :res.counts[0]].tolist()
