"""Rules against numpy references written from each paper's definition, and their properties.

The references compute in float64; the rules run in float32. Where a token's fate hinges on a
quantity within rounding distance of its threshold, the reference marks the row undecided and
only the rule's invariants are checked there.

Every hypothesis example uses logits of one fixed shape [B, W] so that each rule compiles once:
row b has its own vocabulary size V_b between 2 and W (the rest of the row is -inf, as after an
earlier truncation), and each row carries its own settings.
"""

import functools
import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxdecode import rules as R
from jaxdecode.rules import base as RB

B, W = 4, 40  # rows, widest vocabulary
EXAMPLES = settings(max_examples=40, deadline=None)


def _apply(rule, logits, state=None):
    """rule.apply, jitted; without a state, the state for one-token prompts."""
    if state is None:
        n = logits.shape[0]
        state = rule.init(jnp.zeros((n, 1), jnp.int32), jnp.ones((n,), jnp.int32),
                          logits.shape[-1], 1)
    return _apply_jit(rule, logits, state)


@jax.jit
def _apply_jit(rule, logits, state):
    return rule.apply(logits, state)


@functools.partial(jax.jit, static_argnums=4)
def _state_after(rule, prompt, lengths, generated, V):
    """init on the prompts [B, P], then update with each row of generated [G, B]."""
    state = rule.init(prompt, lengths, V, generated.shape[0])
    return jax.lax.fori_loop(0, generated.shape[0], lambda i, s: rule.update(s, generated[i]),
                             state)


@jax.jit
def _run(rule, prompt, lengths, generated, logits):
    """The rule applied to logits [B, V] after the prompts and the generated tokens."""
    return rule.apply(logits, _state_after(rule, prompt, lengths, generated, logits.shape[-1]))


# ----------------------------------------------------------------------------- strategies


@st.composite
def logit_rows(draw):
    """float32 logits [B, W]; row b real on its first V_b entries, -inf after."""
    x = draw(hnp.arrays(np.float32, (B, W), elements=f32(-20, 20)))
    sizes = draw(st.lists(st.integers(2, W), min_size=B, max_size=B))
    x = np.where(np.arange(W)[None, :] < np.array(sizes)[:, None], x, -np.inf).astype(np.float32)
    return x, sizes


def f32(lo, hi):
    """float32 values in [lo, hi] (bounds rounded to float32), no subnormals."""
    return st.floats(float(np.float32(lo)), float(np.float32(hi)), width=32, allow_subnormal=False)


def row_settings(elements):
    return hnp.arrays(np.float32, (B,), elements=elements)


def unit(lo_open: bool, hi_open: bool):
    return st.floats(0, 1, exclude_min=lo_open, exclude_max=hi_open, width=32,
                     allow_subnormal=False)


# ----------------------------------------------------------------------------- references


def softmax64(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def ref_temperature(z, t):
    if t == 0:
        out = np.full_like(z, -np.inf)
        i = int(np.argmax(z))
        out[i] = z[i]
        return out
    return z / t


def ref_top_k(z, k):
    kth = np.sort(z)[::-1][min(k, len(z)) - 1]
    return z >= kth, True


def ref_top_p(z, p):
    """Smallest set of most probable tokens whose mass reaches p (ties ranked by index)."""
    prob = softmax64(z)
    order = np.argsort(-z, kind="stable")
    before = np.cumsum(prob[order]) - prob[order]
    before[0] = 0.0  # exactly: nothing ranks above the most probable token
    keep = np.empty(len(z), bool)
    keep[order] = (before < p) | (p >= 1)
    # the most probable token is kept for any p > 0 (before = 0 < p), however small p is: only
    # the others' fates can hinge on rounding
    decided = p >= 1 or len(z) == 1 or np.min(np.abs(before[1:] - p)) > 1e-4
    return keep, decided


def ref_min_p(z, r):
    prob = softmax64(z)
    rel = prob / prob.max()
    return rel >= r, np.all(np.abs(rel - r) > 1e-4 * np.maximum(rel, r))


def ref_typical(z, mass):
    """Meister et al.: rank by |surprisal - entropy|; smallest most-typical set with mass >= mass."""
    prob = softmax64(z)
    surprisal = -np.log(prob)
    H = np.sum(prob * surprisal)
    score = np.abs(surprisal - H)
    order = np.argsort(score, kind="stable")
    cum = np.cumsum(prob[order])
    if mass >= 1:
        return np.ones(len(z), bool), True
    last = int(np.argmax(cum >= mass)) if np.any(cum >= mass) else len(z) - 1
    keep = score <= score[order[last]]
    s, zs = score[order], z[order]
    near_tie = (np.abs(np.diff(s)) < 1e-3) & (zs[1:] != zs[:-1])
    decided = np.min(np.abs(cum - mass)) > 1e-4 and not near_tie.any()
    return keep, decided


def ref_epsilon(z, eps):
    prob = softmax64(z)
    keep = (prob >= eps) | (z == z.max())
    return keep, np.all(np.abs(prob - eps) > 1e-4 * np.maximum(prob, eps))


def ref_eta(z, eta):
    prob = softmax64(z)
    H = -np.sum(prob * np.log(prob))
    thr = min(eta, math.sqrt(eta) * math.exp(-H))
    keep = (prob >= thr) | (z == z.max())
    return keep, np.all(np.abs(prob - thr) > 1e-4 * np.maximum(prob, thr))


def ref_top_n_sigma(z, n):
    z64 = z.astype(np.float64)
    thr = z64.max() - n * z64.std()
    return z64 >= thr, np.all((np.abs(z64 - thr) > 1e-3) | (z64 == z64.max()))


TRUNCATIONS = {
    "top_k": (R.top_k, ref_top_k, hnp.arrays(np.int32, (B,), elements=st.integers(1, W + 5))),
    "top_p": (R.top_p, ref_top_p, row_settings(unit(True, False))),
    "min_p": (R.min_p, ref_min_p, row_settings(unit(False, False))),
    "typical": (R.typical, ref_typical, row_settings(unit(True, False))),
    "epsilon": (R.epsilon, ref_epsilon, row_settings(unit(False, True))),
    "eta": (R.eta, ref_eta, row_settings(unit(False, True))),
    "top_n_sigma": (R.top_n_sigma, ref_top_n_sigma, row_settings(f32(0.01, 5))),
}


def kept(out):
    return np.isfinite(np.asarray(out))


# ----------------------------------------------------------------------------- against references


# The least share of rows the reference must decide (compare) per truncation, over the 40
# examples of 4 rows (160 rows). Measured: with the derandomized profile every truncation decides
# 158 to 160 of its 160 rows (eta and min_p 158); over seven runs of HYPOTHESIS_PROFILE=explore the
# fewest were eta 143 (89%), typical 149, top_p 155, min_p 156. 0.85 leaves room for other draws,
# while a reference that gave up on many rows fails: ref_top_p used to mark every row with
# p < 1e-4 undecided (the top token's zero mass before it counted as "near p") and compared only
# 99 of the 160 rows.
MIN_DECIDED = 0.85


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(TRUNCATIONS))
def test_truncation_matches_reference(name):
    make, ref, values = TRUNCATIONS[name]
    rows_seen, rows_compared = [0], [0]

    @EXAMPLES
    @given(logit_rows(), values)
    def check(rows, setting):
        x, sizes = rows
        out = np.asarray(_apply(make(setting), jnp.asarray(x)))
        assert out.dtype == np.float32
        keep = kept(out)
        # whatever the rounding: kept logits unchanged, padding stays out, never empty
        np.testing.assert_array_equal(out[keep], x[keep])
        for b, V in enumerate(sizes):
            assert not keep[b, V:].any()
            assert keep[b, :V].any()
            if name != "typical":  # typical may drop the most probable token
                assert keep[b, int(np.argmax(x[b]))]
            want, decided = ref(x[b, :V], setting[b].item())
            rows_seen[0] += 1
            if decided:
                rows_compared[0] += 1
                np.testing.assert_array_equal(keep[b, :V], want, err_msg=f"row {b}")

    check()
    assert rows_seen[0] >= 4 * 40
    assert rows_compared[0] >= MIN_DECIDED * rows_seen[0], (name, rows_compared[0], rows_seen[0])


@pytest.mark.quick
@EXAMPLES
@given(logit_rows(), row_settings(st.one_of(st.just(0.0), f32(0.05, 10))))
def test_temperature_matches_reference(rows, t):
    x, sizes = rows
    out = np.asarray(_apply(R.temperature(t), jnp.asarray(x)))
    assert out.dtype == np.float32
    for b, V in enumerate(sizes):
        np.testing.assert_allclose(out[b, :V], ref_temperature(x[b, :V], t[b].item()),
                                   rtol=1e-6, atol=1e-30)  # XLA flushes subnormal results
        assert np.all(out[b, V:] == -np.inf)


# ----------------------------------------------------------------------------- penalties

P, G = 6, 5  # prompt width, generated tokens


@st.composite
def history(draw):
    """(logits [B, W], prompt [B, P], lengths [B], generated [G, B]).

    Tokens come from the first n of the W (n drawn from 2..W), so that small n repeat a lot.
    """
    x = draw(hnp.arrays(np.float32, (B, W), elements=f32(-20, 20)))
    tok = st.integers(0, draw(st.integers(2, W)) - 1)
    prompt = draw(hnp.arrays(np.int32, (B, P), elements=tok))
    lengths = draw(hnp.arrays(np.int32, (B,), elements=st.integers(1, P)))
    generated = draw(hnp.arrays(np.int32, (G, B), elements=tok))
    return x, prompt, lengths, generated


def run(rule, x, prompt, lengths, generated):
    return np.asarray(_run(rule, jnp.asarray(prompt), jnp.asarray(lengths),
                           jnp.asarray(generated), jnp.asarray(x)))


def seen_in(prompt, lengths, generated, b):
    return list(prompt[b, :lengths[b]]) + list(generated[:, b])


@pytest.mark.quick
@EXAMPLES
@given(history(), row_settings(f32(0.1, 5)))
def test_repetition_penalty_matches_reference(h, theta):
    x, prompt, lengths, generated = h
    out = run(R.repetition_penalty(theta), *h)
    assert out.dtype == np.float32
    for b in range(B):
        seen = set(seen_in(prompt, lengths, generated, b))
        want = [(z / theta[b] if z > 0 else z * theta[b]) if i in seen else z
                for i, z in enumerate(x[b])]
        np.testing.assert_allclose(out[b], want, rtol=1e-6, atol=1e-30)
        unseen = [i for i in range(x.shape[1]) if i not in seen]
        np.testing.assert_array_equal(out[b, unseen], x[b, unseen])  # only seen tokens change


@pytest.mark.quick
@EXAMPLES
@given(history(), row_settings(f32(-3, 3)),
       row_settings(f32(-3, 3)))
def test_frequency_and_presence_penalties_match_reference(h, f, p):
    x, _prompt, _lengths, generated = h
    freq = run(R.frequency_penalty(f), *h)
    pres = run(R.presence_penalty(p), *h)
    for b in range(B):
        count = Counter(generated[:, b].tolist())  # generated tokens only, not the prompt
        c = np.array([count[i] for i in range(x.shape[1])], np.float64)
        np.testing.assert_allclose(freq[b], x[b] - c * f[b], rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(pres[b], x[b] - (c > 0) * p[b], rtol=1e-6, atol=1e-5)
        np.testing.assert_array_equal(freq[b, c == 0], x[b, c == 0])
        np.testing.assert_array_equal(pres[b, c == 0], x[b, c == 0])


def ref_no_repeat(seq, n, V):
    """Tokens that would complete an n-gram already in seq (Hugging Face's rule)."""
    if len(seq) + 1 < n:
        return set()
    tail = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
    return {seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i:i + n - 1]) == tail}


@pytest.mark.quick
@EXAMPLES
@given(history(), st.integers(1, 4))
def test_no_repeat_ngram_matches_reference(h, n):
    x, prompt, lengths, generated = h
    out = run(R.no_repeat_ngram(n), *h)
    V = x.shape[1]
    for b in range(B):
        banned = ref_no_repeat(seen_in(prompt, lengths, generated, b), n, V)
        want = np.array([i not in banned for i in range(V)])
        np.testing.assert_array_equal(kept(out[b]), want)
        np.testing.assert_array_equal(out[b, want], x[b, want])


def test_no_repeat_ngram_keeps_the_argmax_when_everything_is_banned():
    rule = R.no_repeat_ngram(1)
    x = jnp.asarray([[0.5, 2.0, 1.0], [0.5, 2.0, 1.0]])
    out = np.asarray(_run(rule, jnp.asarray([[0, 1, 2], [0, 2, 2]]), jnp.asarray([3, 3]),
                          jnp.zeros((1, 2), jnp.int32), x))
    assert list(kept(out[0])) == [False, True, False]  # all three seen: keep the argmax
    assert list(kept(out[1])) == [False, True, False]  # 0 and 2 seen
    np.testing.assert_array_equal(out[:, 1], [2.0, 2.0])


# ----------------------------------------------------------------------------- properties


@EXAMPLES
@given(logit_rows(), row_settings(unit(True, False)), row_settings(unit(True, False)))
def test_top_p_kept_set_grows_with_p_and_is_smallest(rows, p1, p2):
    x, sizes = rows
    lo, hi = np.minimum(p1, p2), np.maximum(p1, p2)
    k_lo = kept(_apply(R.top_p(lo), jnp.asarray(x)))
    k_hi = kept(_apply(R.top_p(hi), jnp.asarray(x)))
    assert np.all(k_lo <= k_hi)
    for b, V in enumerate(sizes):
        prob = softmax64(x[b, :V])
        S = k_hi[b, :V]
        assert prob[S].sum() >= hi[b] - 1e-5  # reaches p
        assert prob[S].sum() - prob[S].min() < hi[b] + 1e-5  # without its least member it does not
        assert prob[S].min() >= prob[~S].max(initial=0) - 1e-7  # and it is made of the top tokens


@EXAMPLES
@given(logit_rows(), hnp.arrays(np.int32, (2, B), elements=st.integers(1, W + 5)))
def test_top_k_kept_set_grows_with_k(rows, ks):
    x, sizes = rows
    lo, hi = ks.min(axis=0), ks.max(axis=0)
    k_lo = kept(_apply(R.top_k(lo), jnp.asarray(x)))
    k_hi = kept(_apply(R.top_k(hi), jnp.asarray(x)))
    assert np.all(k_lo <= k_hi)
    for b, V in enumerate(sizes):
        assert k_lo[b].sum() >= min(lo[b], V)  # at least k (more only with ties)


@EXAMPLES
@given(logit_rows(), row_settings(unit(False, False)),
       row_settings(f32(0.1, 5)))
def test_min_p_threshold_follows_temperature(rows, r, tau):
    """With logits z / tau, min-p with ratio r keeps p_i / p_max = exp((z_i - z_max) / tau) >= r:
    on the raw logits that is min-p with ratio r ** tau."""
    x, sizes = rows
    after = kept(_apply(R.chain(R.temperature(tau), R.min_p(r)), jnp.asarray(x)))
    raw = kept(_apply(R.min_p(r.astype(np.float64) ** tau), jnp.asarray(x)))
    for b, V in enumerate(sizes):
        gap = x[b, :V].astype(np.float64) - x[b, :V].max()
        with np.errstate(divide="ignore"):
            cut = tau[b] * np.log(np.float64(r[b]))  # -inf for r = 0: keep everything
        decided = np.abs(gap - cut) > 1e-3
        np.testing.assert_array_equal(after[b, :V][decided], raw[b, :V][decided])
        np.testing.assert_array_equal(after[b, :V][decided], (gap >= cut)[decided])


@pytest.mark.quick
@EXAMPLES
@given(history(), f32(0.5, 3), f32(0.1, 1))
def test_chain_applies_parts_in_order_with_their_states(h, theta, p):
    x, prompt, lengths, generated = h
    parts = (R.repetition_penalty(theta), R.no_repeat_ngram(2), R.top_p(p))
    rule = R.chain(*parts)
    args = (jnp.asarray(prompt), jnp.asarray(lengths), jnp.asarray(generated), x.shape[1])
    state = _state_after(rule, *args)
    states = [_state_after(r, *args) for r in parts]
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(tuple(states))):
        np.testing.assert_array_equal(a, b)
    step = jnp.asarray(x)
    for r, s in zip(parts, states):
        step = _apply(r, step, s)
    np.testing.assert_array_equal(_apply(rule, jnp.asarray(x), state), step)


def test_temperature_zero_keeps_only_the_argmax():
    x = np.random.default_rng(0).normal(size=(B, 17)).astype(np.float32)
    for rule in (R.greedy(), R.temperature(0), R.temperature(np.zeros(B))):
        out = np.asarray(_apply(rule, jnp.asarray(x)))
        assert np.all(kept(out).sum(axis=1) == 1)
        np.testing.assert_array_equal(np.argmax(out, axis=1), np.argmax(x, axis=1))
    mixed = np.asarray(_apply(R.temperature(np.array([0, 1, 0.5, 0], np.float32)),
                              jnp.asarray(x), ()))
    assert list(kept(mixed).sum(axis=1)) == [1, 17, 17, 1]
    np.testing.assert_allclose(mixed[2], x[2] / 0.5)


def test_peaked_and_flat_distributions_like_the_book():
    """In the middle of a word one letter is nearly certain: top-p 0.9 and min-p 0.1 keep only it,
    top-k 5 still keeps five. At the start of a word many letters are plausible: both keep many."""
    rng = np.random.default_rng(3)
    V = 65
    peaked = rng.normal(size=V).astype(np.float32)
    peaked[7] = 12.0
    flat = (0.3 * rng.normal(size=V)).astype(np.float32)
    x = jnp.asarray(np.stack([peaked, flat]))
    n = {name: kept(_apply(rule, x)).sum(axis=1) for name, rule in [
        ("top_k", R.top_k(5)), ("top_p", R.top_p(0.9)), ("min_p", R.min_p(0.1))]}
    assert list(n["top_k"]) == [5, 5]
    assert n["top_p"][0] == 1 and n["min_p"][0] == 1
    assert n["top_p"][1] > 30 and n["min_p"][1] > 30
    assert kept(_apply(R.top_p(0.9), x))[0, 7]


def test_ties_with_the_kth_logit_are_kept():
    x = jnp.asarray([[3.0, 1.0, 2.0, 2.0, 0.0]])
    assert list(kept(_apply(R.top_k(2), x))[0]) == [True, False, True, True, False]
    assert list(kept(_apply(R.top_k(9), x))[0]) == [True] * 5


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 70)),
                  elements=st.sampled_from([-np.inf, -2.0, -0.0, 0.0, 0.5, 1.0, 3.0])))
@pytest.mark.slow
def test_descending_rank_is_the_stable_sort_order(x):
    """Top-p's pairwise ranking equals the inverse of a stable descending argsort (ties, -0.0 and
    -inf included), which is what makes its cumulative sums those of the sorted row."""
    order = np.argsort(-np.where(x == 0, 0.0, x), axis=-1, kind="stable")
    want = np.argsort(order, axis=-1)
    # one compiled shape: rows padded with -inf columns after the last, which a stable order puts
    # after every real entry (so the real entries keep their ranks)
    padded = np.full((4, 70), -np.inf, np.float32)
    padded[:x.shape[0], :x.shape[1]] = x
    got = np.asarray(_jit_descending_rank(jnp.asarray(padded)))[:x.shape[0], :x.shape[1]]
    np.testing.assert_array_equal(got, want)


_jit_descending_rank = jax.jit(RB._descending_rank)


@pytest.mark.parametrize("V", [RB.PAIRWISE_RANK_MAX_V, RB.PAIRWISE_RANK_MAX_V + 1])
def test_top_p_on_both_sides_of_the_pairwise_limit(V):
    """Up to PAIRWISE_RANK_MAX_V tokens top-p ranks by comparing pairs, beyond by sorting; both
    give the reference's kept set (logits rounded so that ties occur)."""
    x = np.round(np.random.default_rng(V).normal(size=(3, V)) * 2, 1).astype(np.float32)
    for p in (0.3, 0.9):
        got = kept(_apply(R.top_p(p), jnp.asarray(x)))
        for row in range(3):
            want, decided = ref_top_p(x[row].astype(np.float64), p)
            if decided:
                np.testing.assert_array_equal(got[row], want)


def test_top_p_ranks_ties_by_index():
    x = jnp.zeros((1, 4))
    assert list(kept(_apply(R.top_p(0.5), x))[0]) == [True, True, False, False]
    assert list(kept(_apply(R.top_p(0.51), x))[0]) == [True, True, True, False]
    assert kept(_apply(R.top_p(1.0), jnp.asarray([[30.0, -30.0]]))).all()


def test_typical_can_drop_the_most_probable_token():
    # p = .48 for the top token, .065 for each of eight others: entropy 1.77 nats lies nearer
    # the others' surprisal (2.73) than the top token's (0.73), and they hold mass .52 >= .5
    x = jnp.asarray([[5.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, -5.0]])
    keep = kept(_apply(R.typical(0.5), x))[0]
    assert not keep[0] and keep[1:9].all()


def test_processed_logprobs_handles_minus_infinity():
    x = jnp.asarray([[0.0, -jnp.inf, 1.0], [-jnp.inf, -jnp.inf, -jnp.inf]])
    lp = np.asarray(R.processed_logprobs(x))
    assert not np.isnan(lp).any()
    assert lp[0, 1] == -np.inf and np.all(lp[1] == -np.inf)
    np.testing.assert_allclose(np.exp(lp[0]).sum(), 1.0, rtol=1e-6)


# ----------------------------------------------------------------------------- compile guard

SCALAR_VALUES = {
    R.temperature: [0.0, 0.5, 1, 2.0],
    R.top_k: [1, 3, 50],
    R.top_p: [0.1, 0.9, 1.0],
    R.min_p: [0.0, 0.1, 1.0],
    R.typical: [0.2, 0.95, 1.0],
    R.epsilon: [0.0, 1e-3, 0.5],
    R.eta: [0.0, 1e-3, 0.5],
    R.top_n_sigma: [0.5, 1.0, 3],
    R.repetition_penalty: [0.5, 1.0, 1.3],
    R.frequency_penalty: [-1.0, 0.0, 0.7],
    R.presence_penalty: [-1.0, 0.0, 0.7],
}


def test_jitted_rule_is_traced_once_per_structure():
    V = 9
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, V)).astype(np.float32))
    prompt, lengths = jnp.asarray(rng.integers(0, V, (B, 5)), jnp.int32), jnp.full((B,), 5)
    traces = []

    @jax.jit
    def apply(logits, rule, state):
        traces.append(type(rule).__name__)
        return rule.apply(logits, state)

    def f(*args):  # trace (cached like a call) without paying for compilation
        apply.trace(*args)

    for make, values in SCALAR_VALUES.items():
        state = make(values[0]).init(prompt, lengths, V, 4)
        traces.clear()
        for v in values:
            f(x, make(v), state)
        assert len(traces) == 1, make.__name__
        traces.clear()
        for v in values:  # per-row: broadcast scalars and genuinely per-row arrays, one trace
            f(x, R.per_row(make(v), B), state)
        f(x, make(np.resize(np.asarray(values), B)), state)
        assert len(traces) == 1, make.__name__

    def everything(i):
        return R.chain(*(make(values[i]) for make, values in SCALAR_VALUES.items()),
                       R.no_repeat_ngram(2))

    state = everything(0).init(prompt, lengths, V, 4)
    traces.clear()
    for i in range(3):
        f(x, everything(i), state)
    assert len(traces) == 1


def test_settings_may_be_traced():
    x = jnp.asarray([[0.0, 1.0, 2.0]])
    out = jax.jit(lambda p, k: _apply(R.chain(R.top_p(p), R.top_k(k)), x))(0.3, 2)
    assert list(kept(out)[0]) == [False, False, True]
    # out-of-range traced values are not checked (they cannot be): the value passes through
    # unchanged, and p >= 1 keeps every token, as it does for a checked p = 1
    assert float(jax.jit(lambda p: R.top_p(p).p)(1.5)) == 1.5
    wide = jnp.asarray([[0.0, 1.0, 2.0, -30.0]])
    assert kept(jax.jit(lambda p: _apply(R.top_p(p), wide))(1.5)).all()
    assert list(kept(jax.jit(lambda p: _apply(R.top_p(p), wide))(0.5))[0]) == [False, False, True, False]


# ----------------------------------------------------------------------------- validation

INVALID = [
    (R.temperature, "t", [-0.1, math.nan]),
    (R.top_k, "k", [0, -2, 2.5, math.nan, math.inf, 1e10]),
    (R.top_p, "p", [0.0, 1.5, -0.1, math.nan]),
    (R.min_p, "ratio", [-0.1, 1.01, math.nan]),
    (R.typical, "mass", [0.0, 1.1, math.nan]),
    (R.epsilon, "eps", [-1e-3, 1.0, math.nan]),
    (R.eta, "eta", [-1e-3, 1.0, math.nan]),
    (R.top_n_sigma, "n", [0.0, -1.0, math.nan]),
    (R.repetition_penalty, "theta", [0.0, -1.0, math.nan]),
    (R.frequency_penalty, "f", [math.inf, -math.inf, math.nan, 1e39]),  # (1e39: infinite in float32)
    (R.presence_penalty, "p", [math.inf, math.nan, -1e39]),
    (R.no_repeat_ngram, "n", [0, 1.5, -3, math.nan]),
]


@pytest.mark.quick
@pytest.mark.parametrize("make,setting,bad", [(m, s, v) for m, s, vs in INVALID for v in vs],
                         ids=lambda a: getattr(a, "__name__", repr(a)))
def test_invalid_settings_raise(make, setting, bad):
    with pytest.raises(R.RuleError, match=rf"^{make.__name__}: {setting} must .*, got ") as e:
        make(bad)
    assert isinstance(e.value, ValueError)
    assert "\n" not in str(e.value)


def test_invalid_per_row_value_is_named():
    with pytest.raises(R.RuleError, match=r"top_p: p must lie in \(0, 1\], got 1.5"):
        R.top_p(np.array([0.5, 1.5, 0.9]))
    with pytest.raises(R.RuleError, match="min_p: ratio must"):
        R.min_p(jnp.asarray([0.1, jnp.nan]))
    with pytest.raises(R.RuleError, match="top_k: k must be a number"):
        R.top_k(True)
    with pytest.raises(R.RuleError, match="chain: argument 1"):
        R.chain(R.top_k(1), 0.5)


# ----------------------------------------------------------------------------- registry and make_rule


def _valid(spec):
    """A setting every registered rule accepts: 2 for integer settings, else 0.5."""
    return 2 if spec.type is int else 0.5


def test_registry_names_its_factories_in_application_order():
    assert list(R.RULES) == [spec.name for spec in R.REGISTRY] == list(R.RULE_ORDER)
    for spec in R.REGISTRY:
        assert spec.factory is getattr(R, spec.name), spec.name
        assert spec.kind in R.KINDS and spec.type in (int, float) and spec.help
        assert spec.flag == "--" + spec.name.replace("_", "-")
    kinds = [R.KINDS.index(spec.kind) for spec in R.REGISTRY]
    assert kinds == sorted(kinds)  # penalties, then temperature, then the truncations
    assert R.RULE_ORDER.index("temperature") < R.RULE_ORDER.index("top_k")
    assert R.RULE_ORDER.index("repetition_penalty") < R.RULE_ORDER.index("temperature")


@pytest.mark.quick
def test_make_rule_applies_rules_in_registry_order():
    r = R.make_rule(top_k=5, temperature=0.5)
    assert [type(x) for x in r.rules] == [R.Temperature, R.TopK]
    # every rule at once, given in reverse: the chain follows the registry
    settings = {spec.name: _valid(spec) for spec in reversed(R.REGISTRY)}
    r = R.make_rule(**settings)
    assert [type(x) for x in r.rules] == [type(spec.factory(_valid(spec))) for spec in R.REGISTRY]
    # one rule alone is not wrapped in a chain; None settings are skipped
    assert isinstance(R.make_rule(top_p=0.9, min_p=None), R.TopP)
    assert R.make_rule() is None and R.make_rule(top_k=None) is None


def test_make_rule_order_shows_in_its_output():
    # min-p after temperature: the threshold is taken on the tempered distribution
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]], jnp.float32))
    got = _apply(R.make_rule(min_p=0.2, temperature=3.0), logits)
    want = _apply(R.chain(R.temperature(3.0), R.min_p(0.2)), logits)
    other = _apply(R.chain(R.min_p(0.2), R.temperature(3.0)), logits)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    assert np.isfinite(got).sum() == 4 and np.isfinite(other).sum() == 3  # the orders differ here


@pytest.mark.quick
def test_make_rule_errors():
    with pytest.raises(R.RuleError, match="unknown decoding setting.*top_q"):
        R.make_rule(top_q=0.5, temperature=0.7)
    with pytest.raises(R.RuleError, match="^top_p: p must"):
        R.make_rule(top_p=1.5)
    with pytest.raises(R.RuleError, match="no_repeat_ngram"):
        R.make_rule(no_repeat_ngram=1.5)


# every rule the engine keeps in a batch at its neutral setting: (factory, neutral, a setting that is not)
SKIPPED_WHEN_NEUTRAL = {
    "top_k": (R.top_k, W, 3), "top_p": (R.top_p, 1.0, 0.6), "min_p": (R.min_p, 0.0, 0.3),
    "typical": (R.typical, 1.0, 0.5), "repetition_penalty": (R.repetition_penalty, 1.0, 1.7),
    "frequency_penalty": (R.frequency_penalty, 0.0, 0.8), "presence_penalty": (R.presence_penalty, 0.0, 0.8),
}


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(SKIPPED_WHEN_NEUTRAL))
def test_a_rule_skips_its_work_only_when_every_row_is_neutral(name):
    """A rule whose rows are all at the neutral setting returns the logits untouched without doing
    its work (a conditional in the program); one row that is not neutral in a batch gets its own
    result, and the neutral rows theirs, as when each row runs alone."""
    make, neutral, other = SKIPPED_WHEN_NEUTRAL[name]
    logits = jax.random.normal(jax.random.PRNGKey(3), (B, W)) * 3.0
    prompt = jnp.array([[1, 2, 2, 5]] * B, jnp.int32)
    lengths = jnp.full((B,), 4, jnp.int32)
    generated = jnp.array([[1, 7, 7, 9]] * 3, jnp.int32)
    settings_ = np.array([neutral] * B, np.float32 if isinstance(other, float) else np.int32)
    mixed = settings_.copy()
    mixed[2] = other
    out_neutral = np.asarray(_run(make(settings_), prompt, lengths, generated, logits))
    assert out_neutral.tobytes() == np.asarray(logits).tobytes()
    out_mixed = np.asarray(_run(make(mixed), prompt, lengths, generated, logits))
    alone = np.asarray(_run(make(other), prompt, lengths, generated, logits))
    assert np.array_equal(out_mixed[2], alone[2]) and not np.array_equal(alone[2], np.asarray(logits)[2])
    np.testing.assert_array_equal(np.delete(out_mixed, 2, axis=0), np.delete(np.asarray(logits), 2, axis=0))
    hlo = _run.lower(make(settings_), prompt, lengths, generated, logits).as_text()
    assert "stablehlo.case" in hlo or "stablehlo.if" in hlo, "the rule's work is not under a conditional"
