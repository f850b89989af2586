"""Conditioning on a constraint (jaxdecode.decoding.smc): the exact enumeration against a brute force over
every token string written here from Python's ``re`` and a plain forward per prefix, the masked
distribution against the loop's samples (chi-square, with its power against a named wrong
sampler), the importance weights exactly, SMC converging to the exact conditional, and the study
on the shipped model."""

import functools
import itertools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode import constraints as C
from jaxdecode.eval import exact
from jaxdecode.decoding import smc
from jaxdecode.models.charlm import transformer as M
from jaxdecode.decoding.sampling import sample_tokens

PROMPT = "hi"
CHOICES = ["ab", "abc", "ba", "cab"]  # "ab" is a prefix of "abc": a final state that can continue
# (kind, pattern, n): with n=2 "abc" and "cab" do not fit, and "ab" ends by the length limit; in
# "(ab|ba)+|c" with n=5 the final state after "abab" can take no token within the budget although
# "a" and "b" continue the pattern (budget-blocked tokens count as stopping)
CASES = [("choices", CHOICES, 3), ("choices", CHOICES, 2), ("regex", "[abc]{1,3}", 3),
         ("regex", "(ab|ba)+|c", 5)]
IDS = ["choices-n3", "choices-n2", "abc13-n3", "abba-n5"]


@pytest.fixture(scope="module")
def lm(tiny_model):
    from jaxdecode.models.checkpoint import LanguageModel

    cfg, params, vocab = tiny_model
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend="portable")


def _compile(kind, pattern, vocab):
    return C.compile_choices(pattern, vocab) if kind == "choices" else C.compile_regex(pattern, vocab)


def _regex(kind, pattern):
    return "|".join(re.escape(o) for o in pattern) if kind == "choices" else pattern


# ----------------------------------------------------------------------------- brute force


class Brute:
    """The definitions of jaxdecode.decoding.smc computed from scratch: the language from ``re.fullmatch``
    over every token string of up to ``n`` tokens, next-token probabilities from a plain full
    forward of the prompt and prefix (float64 softmax)."""

    def __init__(self, lm, regex: str, n: int, prompt: str = PROMPT):
        self.lm, self.n = lm, n
        self.V = len(lm.vocab)
        self.prompt = list(lm.vocab.encode(prompt))
        self.lang = set()
        for length in range(n + 1):
            for toks in itertools.product(range(self.V), repeat=length):
                if re.fullmatch(regex, lm.vocab.decode(np.array(toks, np.int32))):
                    self.lang.add(toks)
        # every prefix of a string of the language within n tokens: a prefix that can be finished
        self.completable = {y[:k] for y in self.lang for k in range(len(y) + 1)}
        self._forward = jax.jit(M.forward, static_argnums=1)

    @functools.cache  # noqa: B019 - a test-local object that lives as long as the test
    def probs(self, prefix: tuple) -> np.ndarray:
        tokens = np.array([self.prompt + list(prefix)], np.int32)
        z = np.asarray(self._forward(self.lm.params, self.lm.cfg, tokens), np.float64)[0, -1]
        e = np.exp(z - z.max())
        return e / e.sum()

    def allowed(self, prefix: tuple) -> list[int]:
        """Tokens after which the output can still be finished within n tokens in all."""
        return [v for v in range(self.V) if prefix + (v,) in self.completable]

    def stop(self, y: tuple) -> float:
        """The stop term of a complete output: 1 at n tokens, else the mass of the tokens that
        cannot be taken."""
        if len(y) == self.n:
            return 1.0
        p = self.probs(y)
        ok = self.allowed(y)
        return float(sum(p[v] for v in range(self.V) if v not in ok))

    def P(self) -> dict:
        """Unnormalized: prod p * stop term, for every complete output."""
        out = {}
        for y in self.lang:
            prob = math.prod(self.probs(y[:t])[y[t]] for t in range(len(y)))
            out[self.lm.vocab.decode(np.array(y, np.int32))] = prob * self.stop(y)
        return out

    def Q(self, stop_rule: bool = True) -> dict:
        """The masked sampler; ``stop_rule=False`` is a wrong sampler that renormalizes over the
        allowed tokens in a final state instead of stopping with the blocked mass (it stops only
        where no token is allowed, or at n tokens)."""
        def stop_here(x):
            if x not in self.lang:
                return 0.0
            if len(x) == self.n or not self.allowed(x):
                return 1.0
            return self.stop(x) if stop_rule else 0.0

        out = {}
        for y in self.lang:
            q = 1.0
            for t in range(len(y)):
                x, p = y[:t], self.probs(y[:t])
                Z = sum(p[v] for v in self.allowed(x))
                q *= (1.0 - stop_here(x)) * p[y[t]] / Z
            out[self.lm.vocab.decode(np.array(y, np.int32))] = q * stop_here(y)
        return out


def _normalized(d):
    total = sum(d.values())
    return {k: v / total for k, v in d.items()}


def _assert_close(got: dict, want: dict, rtol=2e-4, atol=1e-7):
    assert {k for k, v in got.items() if v > 0} == {k for k, v in want.items() if v > 0}
    for k in want:
        assert got.get(k, 0.0) == pytest.approx(want[k], rel=rtol, abs=atol), k


@pytest.fixture(scope="module")
def brute(lm):
    cache = {}

    def get(kind, pattern, n):
        key = (kind, str(pattern), n)
        if key not in cache:
            cache[key] = Brute(lm, _regex(kind, pattern), n)
        return cache[key]

    return get


# ----------------------------------------------------------------------------- exact enumeration


@pytest.mark.quick_ids('choices-n2')
@pytest.mark.parametrize("kind,pattern,n", CASES, ids=IDS)
def test_exact_conditional_matches_brute_force(lm, brute, kind, pattern, n):
    c = _compile(kind, pattern, lm.vocab)
    walk = smc.enumerate_outputs(lm, PROMPT, n, c)
    P = smc.exact_conditional(lm, PROMPT, n, c)
    assert sum(P.values()) == pytest.approx(1.0, abs=1e-12)
    b = brute(kind, pattern, n)
    want = b.P()
    assert len(want) == len(P)
    _assert_close(P, _normalized(want))
    assert walk.log_normalizer == pytest.approx(math.log(sum(want.values())), abs=2e-5)
    assert 0 < sum(want.values()) < 1


@pytest.mark.parametrize("kind,pattern,n", CASES, ids=IDS)
def test_masked_distribution_matches_brute_force(lm, brute, kind, pattern, n):
    c = _compile(kind, pattern, lm.vocab)
    Q = smc.masked_distribution(lm, PROMPT, n, c)
    want = brute(kind, pattern, n).Q()
    assert sum(want.values()) == pytest.approx(1.0, abs=1e-9)  # the brute force is a distribution
    assert sum(Q.values()) == pytest.approx(1.0, abs=1e-12)
    _assert_close(Q, want)


def test_budget_changes_the_language_and_the_stop_term(lm):
    c = C.compile_choices(CHOICES, lm.vocab)
    P2, P3 = smc.exact_conditional(lm, PROMPT, 2, c), smc.exact_conditional(lm, PROMPT, 3, c)
    assert set(P2) == {"ab", "ba"} and set(P3) == set(CHOICES)
    # with n=2 "ab" ends by the length limit (stop term 1), with n=3 it stops with 1 - p(c | ab)
    assert P2["ab"] / P2["ba"] > P3["ab"] / P3["ba"]


def _power(q_true: dict, q_wrong: dict, samples: int, alpha: float) -> float:
    """The chi-square test's power (noncentral chi-square approximation) at level ``alpha`` when
    the samples come from ``q_wrong`` but are tested against ``q_true`` (cells as in the test: none
    below 5 expected here)."""
    from scipy import stats

    keys = [k for k in q_true if q_true[k] > 0]
    assert all(q_true[k] * samples >= 5 for k in keys) and set(q_wrong) <= set(keys)
    lam = samples * sum((q_wrong.get(k, 0.0) - q_true[k]) ** 2 / q_true[k] for k in keys)
    df = len(keys) - 1
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, lam))


SAMPLES = 4000
ALPHA = 1e-3


@pytest.mark.parametrize("kind,pattern,n", [CASES[0], CASES[3]], ids=[IDS[0], IDS[3]])
def test_sampler_draws_from_the_masked_distribution(lm, brute, kind, pattern, n):
    c = _compile(kind, pattern, lm.vocab)
    Q = smc.masked_distribution(lm, PROMPT, n, c)
    prompt = np.asarray(lm.vocab.encode(PROMPT), np.int32)
    res = sample_tokens(lm.decoder, lm.params, [prompt] * SAMPLES, n, jax.random.PRNGKey(7), constraint=c)
    counts = {}
    for r in range(SAMPLES):
        text = lm.vocab.decode(res.tokens[r, :res.counts[r]])
        counts[text] = counts.get(text, 0) + 1
    assert set(counts) <= set(Q)
    assert exact.chisquare_pvalue(counts, Q) > ALPHA
    # The test's power against a wrong sampler that renormalizes over the allowed tokens in a
    # final state instead of stopping with the blocked mass, at 4,000 samples and level 1e-3
    # (noncentral chi-square): 1.0 to double precision in both cases (noncentrality 77,000 for the
    # choices, where that sampler never outputs "ab", and 11,000 for (ab|ba)+|c). Against a
    # sampler only 5% of the way from Q to it (the mixture 0.95 Q + 0.05 wrong): 1.0 and 0.86.
    wrong = brute(kind, pattern, n).Q(stop_rule=False)
    assert _power(Q, wrong, SAMPLES, ALPHA) > 0.9999
    mix = {k: 0.95 * Q[k] + 0.05 * wrong.get(k, 0.0) for k in Q}
    assert _power(Q, mix, SAMPLES, ALPHA) > 0.8


# ----------------------------------------------------------------------------- SMC


def _choices(lm, n=3):
    c = C.compile_choices(CHOICES, lm.vocab)
    return c, smc.enumerate_outputs(lm, PROMPT, n, c)


@pytest.mark.quick
def test_weights_are_p_over_q_exactly(lm):
    """Without resampling each particle's weight is P(y) / Q(y) (the product of Z_t over its
    steps from non-final states), and the log marginal is log mean_i P(y_i) / Q(y_i)."""
    c, walk = _choices(lm)
    ratio = {t: lp - lq for t, lp, lq in zip(walk.texts, walk.log_p, walk.log_q)}
    res = smc.smc_generate(lm, PROMPT, 3, c, 300, seed=3, ess_threshold=0.0)
    assert res.resampled == [] and len(res.texts) == 300 and set(res.texts) == set(CHOICES)
    logw = np.array([ratio[t] for t in res.texts])
    np.testing.assert_allclose(res.weights, np.exp(logw) / np.exp(logw).sum(), rtol=1e-4)
    m = logw.max()
    assert res.log_marginal == pytest.approx(m + math.log(np.mean(np.exp(logw - m))), abs=1e-4)
    for t, toks in zip(res.texts, res.tokens):
        assert c.accepts(toks) and lm.vocab.decode(toks) == t


def _is_sigmas(walk, N: int) -> dict:
    """The asymptotic standard deviation of each self-normalized importance sampling estimate of
    the conditional with N draws from Q: var_i = (1/N) sum_y Pbar(y)^2 / Q(y) (1[y=i] - Pbar_i)^2."""
    Pbar = np.exp(walk.log_p - walk.log_normalizer)
    Q = np.exp(walk.log_q)
    return {t: math.sqrt(np.sum(Pbar ** 2 / Q * ((np.arange(len(Pbar)) == i) - Pbar[i]) ** 2) / N)
            for i, t in enumerate(walk.texts)}


SEEDS = range(5)


def test_smc_approaches_the_exact_conditional(lm):
    c, walk = _choices(lm)
    P = walk.conditional()
    tv = {N: [smc.total_variation(P, smc.smc_generate(lm, PROMPT, 3, c, N, seed=s).distribution)
              for s in SEEDS] for N in (100, 4000)}
    # the error shrinks about as 1/sqrt(N): mean over 5 seeds 0.044 at 100 particles, 0.005 at 4000
    assert np.mean(tv[4000]) < np.mean(tv[100]) / 3
    # The bound at 4,000 particles: with the default threshold this case never resamples at 4,000
    # (the ESS stays above half: asserted below), so SMC is self-normalized importance sampling from
    # Q; its estimate of P_i is asymptotically normal with sd sigma_i (_is_sigmas), so each
    # |error_i| <= 4 sigma_i except with probability 6e-5, and TV = 1/2 sum |error_i| <= 2 sum sigma_i
    # = 0.033 (the expected TV is about 0.007; 20 seeds gave at most 0.018).
    bound = 2 * sum(_is_sigmas(walk, 4000).values())
    assert 0.02 < bound < 0.05
    for s in SEEDS:
        res = smc.smc_generate(lm, PROMPT, 3, c, 4000, seed=s)
        assert res.resampled == []
        assert smc.total_variation(P, res.distribution) < bound
        # log of the mean weight against log sum_y P(y): the mean weight's relative sd is
        # sqrt(chi2(Pbar || Q) / N) = 0.019 here; 4 sd
        chi2 = np.sum(np.exp(2 * (walk.log_p - walk.log_normalizer) - walk.log_q)) - 1
        assert abs(res.log_marginal - walk.log_normalizer) < 4 * math.sqrt(chi2 / 4000)
    # not vacuous: masking alone is far from P (TV 0.49), many times the bound
    assert smc.total_variation(P, walk.masked()) > 10 * bound


def test_smc_on_the_native_backend(tiny_model, lm):
    """SMC through the native CPU layer against the exact conditional enumerated on the portable
    path: within the same 4-sigma bound as above (each seed fails it with probability below 1e-4)."""
    from jaxdecode.models.checkpoint import LanguageModel

    cfg, params, vocab = tiny_model
    native = LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend="native")
    assert native.decoder.backend == "native"
    c, walk = _choices(lm)  # the portable model's enumeration: the reference
    P = walk.conditional()
    bound = 2 * sum(_is_sigmas(walk, 4000).values())
    for s in SEEDS[:2]:
        res = smc.smc_generate(native, PROMPT, 3, c, 4000, seed=s)
        assert set(res.texts) <= set(CHOICES)
        assert smc.total_variation(P, res.distribution) < bound


@pytest.mark.optimized
@pytest.mark.parametrize("resampling", ["systematic", "multinomial"])
def test_smc_with_resampling_at_every_step(lm, resampling):
    """ess_threshold=1 resamples whenever the weights are unequal: after the second step here (the
    first is taken by every particle from the initial state, with the same Z; the last step is
    never followed by resampling)."""
    c, walk = _choices(lm)
    P = walk.conditional()
    # Resampling once adds at most a multinomial draw's variance Pbar_i (1 - Pbar_i) / N per cell to
    # the importance sampling variance (asymptotically); 4 sd per cell as above: 0.065 at 4,000
    # (20 seeds gave at most 0.028 for either scheme).
    Pbar = dict(zip(walk.texts, np.exp(walk.log_p - walk.log_normalizer)))
    sig = _is_sigmas(walk, 4000)
    bound = 2 * sum(math.sqrt(sig[t] ** 2 + Pbar[t] * (1 - Pbar[t]) / 4000) for t in sig)
    for s in range(3):
        res = smc.smc_generate(lm, PROMPT, 3, c, 4000, seed=s, ess_threshold=1.0, resampling=resampling)
        assert res.resampled == [1]
        assert smc.total_variation(P, res.distribution) < bound
        assert abs(res.log_marginal - walk.log_normalizer) < 0.15
        # every particle takes its first step from the initial state, with the same Z: equal weights
        assert res.ess[0] == pytest.approx(4000)
    # Power: a resampling step that keeps each particle's weight instead of resetting it to the mean
    # gives TV 0.19 (5 seeds, either scheme), far above the bound (0.050). One that forgets to
    # normalize the weights before the systematic draw (cumulative sum of exp(logw)) only resamples
    # among the first particles, an unbiased estimate of larger variance: TV 0.030 on average, so 3
    # seeds catch it with probability 0.05. Systematic resampling's own property catches both: each
    # particle gets floor(N w_i) or ceil(N w_i) copies, every weight becomes the mean.
    if resampling == "systematic":
        N, Nb = 37, 64
        logw = np.log(np.random.default_rng(0).uniform(0.01, 0.2, Nb))  # unnormalized: they sum to 4.0
        logw = np.where(np.arange(Nb) < N, logw, -np.inf).astype(np.float32)
        parts = smc._Particles(jnp.zeros((Nb, 1)), jnp.zeros(Nb, jnp.int32), jnp.zeros(Nb, bool),
                               jnp.asarray(logw))
        _, new, anc = smc._smc_resample(jnp.zeros(Nb), parts, jax.random.PRNGKey(0), jnp.int32(N),
                                        model=_KeepCache(), systematic=True)
        w = np.exp(logw[:N].astype(np.float64))
        copies = np.bincount(np.asarray(anc)[:N], minlength=N)
        assert np.all(copies >= np.floor(N * w / w.sum())) and np.all(copies <= np.ceil(N * w / w.sum()))
        assert np.asarray(anc)[N:].tolist() == list(range(N, Nb))  # padding rows keep themselves
        np.testing.assert_allclose(np.asarray(new.logw)[:N], math.log(w.mean()), rtol=1e-6)


class _KeepCache:
    """A stand-in model for resampling without a cache."""

    def reorder(self, cache, anc):
        return cache


def test_smc_is_deterministic_and_pads_particles(lm):
    c, _ = _choices(lm)
    a = smc.smc_generate(lm, PROMPT, 3, c, 37, seed=11, ess_threshold=1.0)
    b = smc.smc_generate(lm, PROMPT, 3, c, 37, seed=11, ess_threshold=1.0)
    other = smc.smc_generate(lm, PROMPT, 3, c, 37, seed=12, ess_threshold=1.0)
    assert a.texts == b.texts and np.array_equal(a.weights, b.weights) and a.log_marginal == b.log_marginal
    assert a.texts != other.texts
    assert len(a.texts) == 37 and a.weights.shape == (37,) and a.weights.sum() == pytest.approx(1.0)
    assert sum(a.distribution.values()) == pytest.approx(1.0)
    one = smc.smc_generate(lm, PROMPT, 3, c, 1, seed=0)
    assert one.weights.tolist() == [1.0] and one.texts[0] in CHOICES
    # one program per (particle bucket, capacity): other seeds, particle counts in the bucket, n,
    # prompts and patterns of a similar size compile nothing new
    fns = (smc._smc_step, smc._smc_resample, smc._smc_start, smc._smc_repeat)
    before = [f._cache_size() for f in fns]
    other_c = C.compile_choices(["ba", "cab", "ac"], lm.vocab)
    smc.smc_generate(lm, "bad", 4, other_c, 50, seed=5, ess_threshold=1.0)
    assert [f._cache_size() for f in fns] == before


def test_regex_with_budget_blocked_stops(lm):
    """(ab|ba)+|c within 5 tokens: final states whose continuations do not fit stop with that mass."""
    c = C.compile_regex("(ab|ba)+|c", lm.vocab)
    walk = smc.enumerate_outputs(lm, PROMPT, 5, c)
    P = walk.conditional()
    res = smc.smc_generate(lm, PROMPT, 5, c, 4000, seed=0)
    sig = _is_sigmas(walk, 4000)
    bound = 2 * sum(math.sqrt(sig[t] ** 2 + P[t] * (1 - P[t]) / 4000) for t in sig)  # resampling or not
    assert smc.total_variation(P, res.distribution) < bound
    assert smc.total_variation(P, walk.masked()) > 5 * bound


@pytest.mark.quick
def test_errors(lm):
    c = C.compile_regex("[abc]{1,4}", lm.vocab)
    with pytest.raises(ValueError, match="more than 50 complete outputs"):
        smc.exact_conditional(lm, PROMPT, 4, c, max_outputs=50)
    assert len(smc.exact_conditional(lm, PROMPT, 4, c, max_outputs=120)) == 3 + 9 + 27 + 81
    with pytest.raises(ValueError, match="more than 119"):
        smc.masked_distribution(lm, PROMPT, 4, c, max_outputs=119)
    with pytest.raises(ValueError, match="window"):
        smc.smc_generate(lm, "a" * 14, 4, c, 8)
    with pytest.raises(C.ConstraintError, match="too small"):
        smc.smc_generate(lm, PROMPT, 2, C.compile_choices(["abc"], lm.vocab), 8)
    with pytest.raises(ValueError, match="particles"):
        smc.smc_generate(lm, PROMPT, 3, c, 0)
    with pytest.raises(ValueError, match="resampling"):
        smc.smc_generate(lm, PROMPT, 3, c, 8, resampling="stratified")
    with pytest.raises(TypeError, match="Constraint"):
        smc.exact_conditional(lm, PROMPT, 3, "ab|ba")


@pytest.mark.quick
def test_divergences():
    assert smc.kl_divergence({"a": 1.0}, {"a": 0.5, "b": 0.5}) == pytest.approx(math.log(2))
    assert smc.kl_divergence({"a": 0.5, "b": 0.5}, {"a": 1.0}) == math.inf
    assert smc.total_variation({"a": 1.0}, {"b": 1.0}) == 1.0


# ----------------------------------------------------------------------------- a JSON schema

# An array of at most two of 1 and 2, or an integer. Within 4 characters outlines-core's regex allows
# 39 strings: "[]", "[ ]", "[  ]", "[1]", "[ 1]", "[2 ]" and the like, and the integers spelled with
# 1 and 2 ("2", "12", "1212", ...). An integer can always go on: its stop term is the mass of the
# other tokens. The tiny model's shape (V = 12) with another alphabet: the same compiled programs,
# spelled in JSON's characters.
SCHEMA = {"anyOf": [{"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}, {"type": "integer"}]}
SCHEMA_VOCAB = '[]12, "abtre'
SCHEMA_N = 4
SCHEMA_PROMPT = "ab"


def _satisfies_schema(text: str) -> bool:
    """The schema checked by hand on the parsed text."""
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    if isinstance(doc, list):
        return len(doc) <= 2 and all(type(x) is int and x in (1, 2) for x in doc)
    return type(doc) is int


@pytest.fixture(scope="module")
def schema_case(tiny_model):
    """(model on the JSON alphabet, the compiled schema, the brute force over its regex)."""
    from outlines_core.json_schema import build_regex_from_schema

    from jaxdecode.io.vocab import Vocab
    from jaxdecode.models.checkpoint import LanguageModel

    cfg, params, _ = tiny_model
    lm = LanguageModel(params=params, cfg=cfg, vocab=Vocab(SCHEMA_VOCAB), meta={}, backend="portable")
    b = Brute(lm, build_regex_from_schema(json.dumps(SCHEMA)), SCHEMA_N, SCHEMA_PROMPT)
    texts = {lm.vocab.decode(np.array(y, np.int32)) for y in b.lang}
    assert all(_satisfies_schema(t) for t in texts)
    assert {"[]", "[ ]", "[1]", "[2 ]", "2", "1212"} <= texts and len(texts) == 39
    return lm, C.compile_json_schema(SCHEMA, lm.vocab), b


def test_json_schema_in_smc(schema_case):
    """A JSON schema conditions SMC as a pattern does: the exact conditional is the brute force's
    over the strings the schema's regex matches, and without resampling each particle is one of
    them, weighted P(y) / Q(y) with P and Q from the brute force."""
    lm, c, b = schema_case
    P = smc.exact_conditional(lm, SCHEMA_PROMPT, SCHEMA_N, c)
    _assert_close(P, _normalized(b.P()))
    want_P, want_Q = b.P(), b.Q()
    res = smc.smc_generate(lm, SCHEMA_PROMPT, SCHEMA_N, c, 300, seed=4, ess_threshold=0.0)
    assert res.resampled == [] and len(set(res.texts)) > 5
    assert all(_satisfies_schema(t) and t in want_P for t in res.texts)
    ratio = np.array([want_P[t] / want_Q[t] for t in res.texts])
    np.testing.assert_allclose(res.weights, ratio / ratio.sum(), rtol=1e-4)


@pytest.mark.quick
def test_json_schema_in_exact_mode_search(schema_case):
    """Exact mode search under the schema returns the most probable of the strings the schema
    allows (the brute force's argmax of P, stop term included), with its log-probability."""
    from jaxdecode.decoding.search import mode_search

    lm, c, b = schema_case
    want = b.P()
    best = max(want, key=want.get)
    prompt = np.asarray(lm.vocab.encode(SCHEMA_PROMPT), np.int32)
    tokens, logprob, _ = mode_search(lm.decoder, lm.params, prompt, SCHEMA_N, constraint=c)
    assert lm.vocab.decode(tokens) == best and _satisfies_schema(best)
    assert logprob == pytest.approx(math.log(want[best]), abs=1e-4)


# ----------------------------------------------------------------------------- the study


@pytest.mark.slow
def test_study_on_the_shipped_model(tmp_path, corpus_path):
    import json

    import jaxdecode
    from jaxdecode.eval.studies import constrained

    lm = jaxdecode.models.checkpoint.load()
    # a reduced configuration: 256 particles instead of 2,000 (about 11 s with the model's load)
    res = constrained.run(lm, tmp_path, data_path=corpus_path, progress=False, particles=256)
    names = ["constrained.json", "constrained.md", "constrained.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    doc = json.loads((tmp_path / "constrained.json").read_text())
    assert doc["rows"] == res["rows"] and doc["source"]["next_line"] == "KATHARINA:"
    for key in ("masked", "exact", "smc", "sample_frequency"):
        assert sum(r[key] for r in doc["rows"]) == pytest.approx(1.0, abs=1e-4)
    assert sum(r["samples"] for r in doc["rows"]) == 200
    assert doc["kl"]["exact_masked"] > 0.1 and doc["kl"]["exact_masked"] > 5 * doc["kl"]["exact_smc"]
    assert doc["masked_samples"]["chisquare_pvalue_vs_masked"] > 1e-3
    md = (tmp_path / "constrained.md").read_text()
    assert "| choice | masked | exact | SMC |" in md and "constrained.png" in md
