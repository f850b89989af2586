import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import compiled
from support.compiled import assert_same_draws
from jaxdecode.models.charlm import transformer as M
from jaxdecode.decoding import sampling as S


@functools.partial(jax.jit, static_argnums=1)
def _last_logits(params, cfg, window, idx):
    # causal attention: padding after idx does not change the logits at idx (one compile)
    return M.forward(params, cfg, window)[:, idx]


def _full_forward_next(params, cfg, ids):
    ctx = ids[-cfg.T:]
    window = np.zeros((1, cfg.T), np.int32)
    window[0, :len(ctx)] = ctx
    return _last_logits(params, cfg, jnp.asarray(window), len(ctx) - 1)


def _plain_loop(params, cfg, prompt, n, key=None, row_id=0, rule=None, greedy=False):
    """The book's loop: a full forward over the last T tokens at every step, nothing cached."""
    ids = list(prompt)
    state = None
    if rule is not None:
        state = rule.init(jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)], jnp.int32), cfg.V, n)
    out = []
    for s in range(n):
        logits = _full_forward_next(params, cfg, ids)
        if rule is not None:
            logits = rule.apply(logits, state)
        if greedy:
            tok = int(jnp.argmax(logits[0]))
        else:
            k = jax.random.fold_in(jax.random.fold_in(key, row_id), s)
            tok = int(jax.random.categorical(k, logits[0]))
        if rule is not None:
            state = rule.update(state, jnp.asarray([tok], jnp.int32))
        ids.append(tok)
        out.append(tok)
    return out


@pytest.mark.quick_ids('native-5', 'portable-40')
@pytest.mark.parametrize("n", [5, 40])  # 40 runs past T=16: the exact window mode
def test_greedy_equals_plain_loop(tiny_lm, n):
    cfg, params, model = tiny_lm.cfg, tiny_lm.params, tiny_lm.decoder
    prompts = [np.array([1, 2, 3]), np.array([4]), np.arange(10) % cfg.V]
    res = S.sample_tokens(model, params, prompts, n, jax.random.PRNGKey(0), greedy=True, chunk=8)
    for i, p in enumerate(prompts):
        assert res.tokens[i, :n].tolist() == _plain_loop(params, cfg, p, n, greedy=True)
    assert (res.counts == n).all()


@pytest.mark.quick
def test_sampling_equals_plain_loop_with_same_keys(tiny_lm):
    cfg, params, model = tiny_lm.cfg, tiny_lm.params, tiny_lm.decoder
    key = jax.random.PRNGKey(7)
    prompts = [np.array([1, 2, 3]), np.array([5, 5]), np.arange(20) % cfg.V]  # last is longer than T
    n = 24
    res = S.sample_tokens(model, params, prompts, n, key, chunk=8)
    for i, p in enumerate(prompts):
        assert res.tokens[i].tolist() == _plain_loop(params, cfg, p, n, key=key, row_id=i)


def test_logprobs_are_model_logprobs(tiny_lm):
    cfg, params, model = tiny_lm.cfg, tiny_lm.params, tiny_lm.decoder
    p = np.array([1, 2, 3])
    res = S.sample_tokens(model, params, [p], 10, jax.random.PRNGKey(1))
    ids = np.concatenate([p, res.tokens[0]])
    lp = jax.nn.log_softmax(M.forward(params, cfg, jnp.asarray(ids[None]))[0], axis=-1)
    want = np.asarray(lp)[np.arange(2, 12), ids[3:13]]
    np.testing.assert_allclose(res.model_logprobs[0], want, atol=1e-5)
    # without rules the sampled distribution is the model's
    np.testing.assert_allclose(res.sample_logprobs[0], want, atol=1e-5)


def test_batch_invariance(tiny_lm):
    cfg, params, model = tiny_lm.cfg, tiny_lm.params, tiny_lm.decoder
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.V, size=rng.integers(1, 14)) for _ in range(16)]
    key = jax.random.PRNGKey(3)
    together = S.sample_tokens(model, params, prompts, 20, key)
    for i in [0, 5, 11, 15]:
        alone = S.sample_tokens(model, params, [prompts[i]], 20, key, row_ids=[i])
        assert alone.tokens[0].tolist() == together.tokens[i].tolist()
    # a sub-batch in another order and batch bucket
    idx = [9, 2, 14]
    some = S.sample_tokens(model, params, [prompts[i] for i in idx], 20, key, row_ids=idx)
    for j, i in enumerate(idx):
        assert some.tokens[j].tolist() == together.tokens[i].tolist()


@pytest.mark.quick_ids('native')
def test_stop_sequences(tiny_lm):
    params, model = tiny_lm.params, tiny_lm.decoder
    key = jax.random.PRNGKey(0)
    prompts = [np.array([1, 2]), np.array([3])]
    free = S.sample_tokens(model, params, prompts, 30, key)
    stop = free.tokens[0, 5:7]  # a pair that row 0 produces at steps 5-6
    res = S.sample_tokens(model, params, prompts, 30, key, stops=[stop])
    first = next(t for t in range(1, 30) if free.tokens[0, t - 1:t + 1].tolist() == stop.tolist())
    assert res.counts[0] == first + 1 and res.stopped[0]
    assert res.tokens[0, :first + 1].tolist() == free.tokens[0, :first + 1].tolist()
    row1 = free.tokens[1]
    hits = [t for t in range(1, 30) if row1[t - 1:t + 1].tolist() == stop.tolist()]
    assert res.counts[1] == (hits[0] + 1 if hits else 30)


@pytest.mark.quick_ids('portable')
def test_compile_once_per_bucket(tiny_lm):
    cfg, params, model = tiny_lm.cfg, tiny_lm.params, tiny_lm.decoder
    rng = np.random.default_rng(1)
    key = jax.random.PRNGKey(0)
    # warm the (4, 16) bucket: three distinct prompts (identical ones are prefilled once, in a
    # smaller batch bucket, so the test must not depend on which buckets earlier tests compiled)
    S.sample_tokens(model, params, [np.array([1]), np.array([2, 3]), np.array([4, 5, 6])], 8, key, chunk=8)
    before = (S.cache_chunk._cache_size(), S.prefill._cache_size())
    for _ in range(4):
        B = int(rng.integers(3, 5))  # batch bucket 4
        # distinct prompts: lengths 1 to 7, each at most once
        prompts = [rng.integers(0, cfg.V, size=n) for n in rng.choice(np.arange(1, 8), size=B, replace=False)]
        S.sample_tokens(model, params, prompts, 8, jax.random.PRNGKey(int(rng.integers(100))), chunk=8)
    assert (S.cache_chunk._cache_size(), S.prefill._cache_size()) == before


def test_one_chunk_unless_streaming(monkeypatch, backend):
    """Without a streaming callback or stop strings a few rows run the request in one chunk (one
    host round trip instead of one per 64 steps) where the cache is allocated once; the text does
    not depend on the chunking."""
    from jaxdecode.models import decoder_for

    cfg = M.ModelConfig(V=9, T=256, d=16, L=1, heads=2)
    model = decoder_for(cfg, backend)
    params = M.init_params(cfg, jax.random.PRNGKey(2))
    prompts = [np.array([1, 2, 3]), np.array([4])]
    calls = []
    real = S.cache_chunk
    monkeypatch.setattr(S, "cache_chunk", lambda *a, **k: calls.append(k["chunk"]) or real(*a, **k))
    key = jax.random.PRNGKey(4)
    whole = S.sample_tokens(model, params, prompts, 150, key)
    assert calls == ([256] if backend == "native" else [64, 64, 64])
    calls.clear()
    streamed = []
    parts = S.sample_tokens(model, params, prompts, 150, key, on_chunk=lambda t, e: streamed.append(t.shape[1]))
    assert calls == [64, 64, 64] and streamed == [64, 64, 22]
    np.testing.assert_array_equal(whole.tokens, parts.tokens)
    np.testing.assert_allclose(whole.model_logprobs, parts.model_logprobs, rtol=1e-5, atol=1e-6)


@pytest.mark.quick_ids('native')
def test_bad_input(tiny_lm):
    params, model = tiny_lm.params, tiny_lm.decoder
    with pytest.raises(ValueError, match=">= 0"):
        S.sample_tokens(model, params, [np.array([1])], -1, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="at least one token"):
        S.sample_tokens(model, params, [np.array([], np.int32)], 3, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"prompt 0: token ids must lie in \[0, 12\), got min -3 max 15"):
        S.sample_tokens(model, params, [np.array([15, -3])], 3, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="row_ids must have one id per prompt"):
        S.sample_tokens(model, params, [np.array([1])], 3, jax.random.PRNGKey(0), row_ids=[0, 1])
    with pytest.raises(ValueError, match="empty"):
        S.generate(tiny_lm, "", 3)
    with pytest.raises(ValueError, match="'Z' at position 1"):
        S.generate(tiny_lm, "aZ", 3)


# ----------------------------------------------------------------------------- exactness

from collections import Counter

from jaxdecode.eval import exact
from jaxdecode import rules

def _penalties(f=0.7):
    return rules.chain(rules.repetition_penalty(1.5), rules.frequency_penalty(f),
                       rules.presence_penalty(0.4), rules.temperature(0.9))


# each case: (the rule, a named wrong implementation the test must be able to tell from it)
EXACT_CASES = {
    "plain": (lambda: None, lambda: rules.temperature(1.1)),
    "top_p": (lambda: rules.top_p(0.8), lambda: rules.top_p(0.7)),
    "min_p": (lambda: rules.min_p(0.1), lambda: rules.min_p(0.2)),
    "penalties": (_penalties, lambda: _penalties(f=0.5)),  # frequency penalty 0.7 taken as 0.5
}
EXACT_PROMPT = np.array([9, 9, 9], np.int32)  # the model repeats itself here: penalties matter
ALPHA = 1e-3


def _chi2_power(p_true: dict, p_wrong: dict, samples: int, alpha: float = ALPHA) -> float:
    """The power of ``exact.chisquare_pvalue(counts, p_true) <= alpha`` when ``samples`` draws come
    from ``p_wrong``: the noncentral chi-square approximation over the cells the test forms
    (pooled from the smallest expected count up, as it pools), combined with the chance that a
    draw falls outside the support of ``p_true`` (which rejects outright)."""
    from scipy import stats

    keys = sorted(p_true, key=p_true.get)
    expected = np.array([p_true[k] for k in keys]) * samples
    cut, pooled = 0, 0.0
    while cut < len(keys) and (expected[cut] < 5.0 or 0 < pooled < 5.0):
        pooled += expected[cut]
        cut += 1
    cells = ([keys[:cut]] if cut else []) + [[k] for k in keys[cut:]]
    p = np.array([sum(p_true[k] for k in c) for c in cells])
    q = np.array([sum(p_wrong.get(k, 0.0) for k in c) for c in cells])
    outside = max(0.0, 1.0 - q.sum())
    df = len(cells) - 1
    lam = samples * np.sum((q / max(q.sum(), 1e-300) - p) ** 2 / p)
    inside = float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, lam))
    return 1.0 - (1.0 - outside) ** samples * (1.0 - inside)


@pytest.mark.parametrize("backend", ["native"], scope="session")
@pytest.mark.parametrize("case", sorted(EXACT_CASES))
def test_sampling_matches_exact_distribution(tiny_lm, case):
    """Empirical frequencies of 3-token continuations against the enumerated distribution, with
    the test's power (at least 0.99) against a named wrong implementation of each rule. The draws
    run on the native backend; the portable one draws the same tokens for the first 1,024 rows of
    the first round (``compiled.assert_same_draws``), so what is shown holds for it too."""
    from jaxdecode.models import decoder_for

    cfg, params, model = tiny_lm.cfg, tiny_lm.params, tiny_lm.decoder
    make, make_wrong = EXACT_CASES[case]
    rule = make()
    prompt = EXACT_PROMPT
    next_logits = exact.model_next_logits(params, cfg)
    probs = exact.exact_distribution(next_logits, prompt, 3, rule=rule, V=cfg.V)
    rows, rounds = 2048, 8
    wrong = exact.exact_distribution(next_logits, prompt, 3, rule=make_wrong(), V=cfg.V)
    assert _chi2_power(probs, wrong, rows * rounds) > 0.99
    counts = Counter()
    for r in range(rounds):
        res = S.sample_tokens(model, params, [prompt] * rows, 3, jax.random.PRNGKey(11 + r), rule=rule)
        counts.update(map(tuple, res.tokens.tolist()))
        if r == 0:
            portable = S.sample_tokens(decoder_for(cfg, "portable"), params, [prompt] * 1024, 3,
                                       jax.random.PRNGKey(11), rule=rule)
            assert_same_draws(res.tokens, portable.tokens, case)
    assert sum(counts.values()) == rows * rounds
    assert exact.chisquare_pvalue(counts, probs) > ALPHA
    # the processed log-probability reported for each draw is the product the enumeration gives
    seq = tuple(res.tokens[0].tolist())
    np.testing.assert_allclose(res.sample_logprobs[0].sum(), np.log(probs[seq]), atol=1e-4)


def test_one_trace_whatever_the_rule_values(tiny_lm):
    params, model = tiny_lm.params, tiny_lm.decoder
    prompts = [np.array([1, 2]), np.array([3, 4, 5])]
    make = lambda t, p, f: rules.chain(rules.frequency_penalty(f), rules.temperature(t), rules.top_p(p))
    S.sample_tokens(model, params, prompts, 8, jax.random.PRNGKey(0), rule=make(1.0, 0.9, 0.1), chunk=8)
    before = S.cache_chunk._cache_size()
    for t, p, f in [(0.5, 0.3, 0.0), (2.0, 1.0, 1.5), (0.0, 0.7, 0.2)]:
        S.sample_tokens(model, params, prompts, 8, jax.random.PRNGKey(1), rule=make(t, p, f), chunk=8)
    # per-row settings: one value per prompt
    per_row = make(jnp.array([0.7, 1.3]), jnp.array([0.5, 0.95]), jnp.array([0.0, 0.3]))
    S.sample_tokens(model, params, prompts, 8, jax.random.PRNGKey(1), rule=per_row, chunk=8)
    assert S.cache_chunk._cache_size() == before


def test_per_row_settings_match_separate_runs(tiny_lm):
    params, model = tiny_lm.params, tiny_lm.decoder
    prompts = [np.array([1, 2]), np.array([3, 4, 5])]
    key = jax.random.PRNGKey(5)
    both = S.sample_tokens(model, params, prompts, 12, key, rule=rules.top_p(jnp.array([0.3, 0.9])))
    for i, p in enumerate([0.3, 0.9]):
        one = S.sample_tokens(model, params, [prompts[i]], 12, key, rule=rules.top_p(p), row_ids=[i])
        assert one.tokens[0].tolist() == both.tokens[i].tolist()


def test_temperature_zero_is_greedy(tiny_lm):
    params, model = tiny_lm.params, tiny_lm.decoder
    prompts = [np.array([1, 2]), np.array([7])]
    g = S.sample_tokens(model, params, prompts, 20, jax.random.PRNGKey(0), greedy=True)
    t0 = S.sample_tokens(model, params, prompts, 20, jax.random.PRNGKey(9), rule=rules.temperature(0.0))
    assert g.tokens.tolist() == t0.tokens.tolist()
    np.testing.assert_allclose(t0.sample_logprobs, 0.0, atol=1e-6)


def test_make_rule_order_and_errors():
    r = rules.make_rule(top_p=0.9, temperature=0.7, repetition_penalty=1.2)
    assert [type(x).__name__ for x in r.rules] == ["RepetitionPenalty", "Temperature", "TopP"]
    assert rules.make_rule() is None
    with pytest.raises(rules.RuleError, match="top_p"):
        rules.make_rule(top_p=1.5)
    with pytest.raises(rules.RuleError, match="unknown"):
        rules.make_rule(top_q=0.5)


# ----------------------------------------------------------------------------- penalties, chunks, past T

THETA, FREQ, PRES = 1.8, 0.9, 0.5  # repetition (prompt and output), frequency, presence penalties


@pytest.fixture(scope="module")
def window8(backend):
    """A random model with a window of only T = 8 (V = 12), far from uniform, on each backend."""
    from jaxdecode.models import decoder_for

    cfg = M.ModelConfig(V=12, T=8, d=16, L=2, heads=2)
    params = jax.tree_util.tree_map(lambda a: a * 3.0, M.init_params(cfg, jax.random.PRNGKey(8)))
    return cfg, params, decoder_for(cfg, backend)


def _penalize32(z, prompt, generated, theta, f, p):
    """The penalties in numpy, float32 like the rules: seen tokens (prompt and output) get
    positive logits / theta and negative ones * theta; then count * f and [count > 0] * p for
    the generated tokens."""
    z = np.array(z, np.float32)
    seen = np.zeros(len(z), bool)
    seen[list(prompt) + list(generated)] = True
    z = np.where(seen, np.where(z > 0, z / np.float32(theta), z * np.float32(theta)), z).astype(np.float32)
    counts = np.bincount(np.asarray(generated, np.int64), minlength=len(z)).astype(np.float32)
    z = (z - counts * np.float32(f)).astype(np.float32)
    return (z - (counts > 0).astype(np.float32) * np.float32(p)).astype(np.float32)


def _log_softmax64(z):
    z = np.asarray(z, np.float64)
    m = z.max()
    return z - (m + np.log(np.exp(z - m).sum()))


@jax.jit
def _draw(key, row_id, step, logits):
    return jax.random.categorical(jax.random.fold_in(jax.random.fold_in(key, row_id), step), logits)


def _numpy_penalty_loop(params, cfg, prompt, n, penalties, greedy, key=None, row_id=0):
    """A full forward over the last T tokens per step, the penalties in numpy, then the argmax or
    a draw with the loop's key for (row, step): fold_in(fold_in(key, row_id), step).
    Returns (tokens, model log-probabilities, processed log-probabilities)."""
    ids, out, mlp, slp = [int(t) for t in prompt], [], [], []
    for s in range(n):
        z = np.asarray(_full_forward_next(params, cfg, ids), np.float32)[0]
        proc = _penalize32(z, prompt, out, *penalties)
        if greedy:
            tok = int(np.argmax(proc))
        else:
            tok = int(_draw(key, row_id, s, jnp.asarray(proc)))
        mlp.append(_log_softmax64(z)[tok])
        slp.append(_log_softmax64(proc)[tok])
        ids.append(tok)
        out.append(tok)
    return out, np.array(mlp), np.array(slp)


# prompts within T (the longest has 4 tokens: 4 steps through the cache, then the window mode) and
# prompts longer than T = 8 (the window mode from the first step)
SHORT_PROMPTS = [np.array([1, 2, 3]), np.array([4]), np.array([5, 5, 0, 5])]
LONG_PROMPTS = [np.array([0, 5, 5, 7, 2, 9, 1, 3, 3, 4]), np.array([6, 6, 6, 1, 2, 6, 6, 8, 11])]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampling"])
def test_penalties_across_chunks_and_past_T_equal_numpy_loop(window8, greedy):
    """The rule state is carried across chunk boundaries, from the cache phase into the window
    mode, and in the window mode from the first step; every token equals the numpy loop's."""
    cfg, params, model = window8
    rule = rules.chain(rules.repetition_penalty(THETA), rules.frequency_penalty(FREQ),
                       rules.presence_penalty(PRES))
    n, key, chunk = 10, jax.random.PRNGKey(21), 3
    # chunks: 3, 1 through the cache then 3, 3 in the window mode (short prompts); 3, 3, 3, 1 (long)
    changed = 0
    for prompts in (SHORT_PROMPTS, LONG_PROMPTS):
        res = S.sample_tokens(model, params, prompts, n, key, rule=rule, greedy=greedy, chunk=chunk)
        assert (res.counts == n).all()
        for i, p in enumerate(prompts):
            tokens, mlp, slp = _numpy_penalty_loop(params, cfg, p, n, (THETA, FREQ, PRES), greedy, key, i)
            assert res.tokens[i].tolist() == tokens, (i, chunk)
            np.testing.assert_allclose(res.model_logprobs[i], mlp, atol=1e-5)
            np.testing.assert_allclose(res.sample_logprobs[i], slp, atol=1e-5)
            free = _numpy_penalty_loop(params, cfg, p, n, (1.0, 0.0, 0.0), greedy, key, i)[0]
            changed += free != tokens
    assert changed >= 4  # the penalties change most rows' tokens: the comparison is not vacuous


# ----------------------------------------------------------------------------- shipped checkpoint


@pytest.fixture(scope="module")
def shipped(backend):
    from jaxdecode.models import checkpoint

    try:
        return checkpoint.load(backend=backend)
    except checkpoint.CheckpointError as e:
        pytest.skip(str(e))


def _book_greedy_agrees(params, cfg, prompt, generated) -> None:
    """Asserts that ``generated`` is what the book's greedy loop (a full forward of the whole text
    per character, the argmax at its last position) gives after ``prompt``, in one forward.

    The model is causal, so the logits at position ``i`` of a forward over the whole text are the
    logits the book's loop computes at step ``i`` over the text up to ``i``. So if ``generated``
    first leaves the book's loop at character ``j``, the argmax at position ``len(prompt) + j - 1``
    is the book's character there, not ``generated[j]``, and the check fails; if it never leaves
    it, every position's argmax is the next character. (Padded to a multiple of 64, as the book's
    loop pads its inputs: padding after the text is invisible to a causal model.)"""
    ids = list(prompt) + list(generated)
    width = -(-len(ids) // 64) * 64
    x = np.zeros((1, width), np.int32)
    x[0, :len(ids)] = ids
    logits = np.asarray(compiled.forward(params, cfg, jnp.asarray(x)))[0]
    want = logits[len(prompt) - 1:len(ids) - 1].argmax(-1)
    first = next((j for j, (a, b) in enumerate(zip(want, generated)) if a != b), None)
    assert first is None, f"leaves the book's greedy loop at character {first}"


@pytest.mark.slow
def test_shipped_greedy_300_equals_book_loop(shipped):
    """300 greedy characters with the cache == the book's loop (a full forward per character,
    checked in one forward over the whole text: :func:`_book_greedy_agrees`)."""
    params, model = shipped.params, shipped.decoder
    prompt = shipped.vocab.encode("KATHARINA:\nMoved! in good time: ")
    res = S.sample_tokens(model, params, [prompt], 300, jax.random.PRNGKey(0), greedy=True)
    assert res.tokens.shape == (1, 300)
    _book_greedy_agrees(params, shipped.cfg, prompt, res.tokens[0].tolist())
    # the check is not vacuous: one character changed anywhere is caught
    changed = res.tokens[0].tolist()
    changed[150] = (changed[150] + 1) % shipped.cfg.V
    with pytest.raises(AssertionError, match="at character 150"):
        _book_greedy_agrees(params, shipped.cfg, prompt, changed)


def _loop_body_ops(hlo: str, shape: str) -> list[str]:
    """Instructions inside the compiled program's while-loop bodies (and what they call) that
    produce an array of ``shape`` other than by passing it along (parameter, tuple, bitcast)."""
    comps = {}
    for block in re.split(r"\n(?=\S)", hlo):
        m = re.match(r"(?:ENTRY )?%(\S+) ", block)
        if m:
            comps[m.group(1)] = block
    todo = [name for block in comps.values() for name in re.findall(r"while\(.*?body=%([\w.\-]+)", block)]
    seen, found = set(), []
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name].splitlines()[1:]:
            todo += re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", line)
            m = re.match(r"\s*(?:ROOT )?%\S+ = (\S+) (\S+?)\(", line)
            if m and m.group(1).startswith(shape) and m.group(2) not in (
                    "parameter", "get-tuple-element", "tuple", "bitcast"):
                found.append(line.strip()[:160])
    return found


# The tests compile with XLA's CPU fusion emitters off (tests/conftest.py); a test of the program's
# structure compiles it as the library's users get it.
LIBRARY_COMPILER = {"xla_cpu_use_fusion_emitters": True}  # the structure only: no need to optimize


def test_no_cache_copy_in_the_step_loop(backend):
    """The compiled decode loop never materializes a cache-sized array per step: the portable
    path only reads the cache inside the loop (new keys go to the chunk buffer); the native path
    writes into it in place (its custom call, aliased), nothing else."""
    from jaxdecode.models import decoder_for

    cfg = M.ModelConfig(V=11, T=256, d=32, L=2, heads=2)
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    model = decoder_for(cfg, backend)
    B, C = 4, 256
    p = model.prepare(params, B)
    batch = S.make_batch([np.array([1, 2, 3])] * B, 10, model.V, model.T)
    logits, cache = S.prefill(p, jnp.asarray(batch.prompt), jnp.asarray(batch.length), model=model, capacity=C)
    state = S.SamplingState(logits, jnp.asarray(batch.recent), jnp.asarray(batch.length), None,
                            jnp.zeros((B,), bool), jnp.zeros((B,), jnp.int32), jnp.int32(0))
    hlo = S.cache_chunk.lower(p, state, cache, None, jax.random.PRNGKey(0), jnp.zeros((B,), jnp.uint32), None,
                               np.int32(10), model=model, chunk=16, greedy=False).compile(
        compiler_options=LIBRARY_COMPILER).as_text()
    assert _loop_body_ops(hlo, f"f32[{B},{cfg.heads},{C},{cfg.head_dim}]") == []
    assert ("jaxdecode_decode_layer" in hlo) == (backend == "native")


@pytest.mark.quick
def test_sample_keys_are_prngkey_of_each_seed():
    """sample_keys builds the keys on the host; each must be jax.random.PRNGKey of its seed, the
    seeds at the edges of 32 and 64 bits and negative ones included."""
    from jaxdecode.decoding.common import sample_keys

    rng = np.random.default_rng(0)
    seeds = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 7, 2**63 - 1, -1, -5, -(2**31), -(2**63),
             np.int64(7), np.uint32(9)] + [int(x) for x in rng.integers(-(2**63), 2**63 - 1, 20)]
    keys, row_ids = sample_keys(len(seeds), 2, seeds)
    want = np.stack([np.asarray(jax.random.PRNGKey(int(s))) for s in seeds for _ in range(2)])
    assert np.asarray(keys).dtype == want.dtype and np.array_equal(np.asarray(keys), want)
    assert row_ids.tolist() == [0, 1] * len(seeds)
