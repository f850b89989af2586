"""Exact continuation distributions: a hand-made Markov chain, then the tiny transformer."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.models.charlm import transformer as M
from jaxdecode import rules as R
from jaxdecode.eval.exact import chisquare_pvalue, exact_distribution, model_next_logits, next_logits_for

# next-token probabilities given the last token, V = 3
CHAIN = np.array([[0.5, 0.3, 0.2],
                  [0.1, 0.6, 0.3],
                  [0.25, 0.25, 0.5]])


def markov(tokens):
    return np.log(CHAIN[np.asarray(tokens)[:, -1]])


@pytest.mark.quick
def test_markov_chain_without_rule_is_the_product_of_transitions():
    dist = exact_distribution(markov, [2, 0], 3)
    assert len(dist) == 27
    for a, b, c in itertools.product(range(3), repeat=3):
        assert dist[(a, b, c)] == pytest.approx(CHAIN[0, a] * CHAIN[a, b] * CHAIN[b, c], rel=1e-6)
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.quick
def test_markov_chain_with_top_k_renormalizes_each_step():
    # top-2 of each row: {0: .5, 1: .3} -> 5/8, 3/8; {1: .6, 2: .3} -> 2/3, 1/3
    dist = exact_distribution(markov, [0], 2, R.top_k(2))
    want = {(0, 0): 5 / 8 * 5 / 8, (0, 1): 5 / 8 * 3 / 8, (1, 1): 3 / 8 * 2 / 3,
            (1, 2): 3 / 8 * 1 / 3}
    assert dist.keys() == want.keys()
    for k, p in want.items():
        assert dist[k] == pytest.approx(p, rel=1e-6)
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-12)


def test_rule_state_follows_each_prefix():
    # no token may repeat anything in prompt + continuation
    dist = exact_distribution(markov, [0], 2, R.no_repeat_ngram(1))
    want = {(1, 2): 0.3 / 0.5, (2, 1): 0.2 / 0.5}
    assert dist.keys() == want.keys()
    for k, p in want.items():
        assert dist[k] == pytest.approx(p, rel=1e-6)
    # the repetition penalty sees the prompt and every token on the path
    theta = 2.0
    dist = exact_distribution(markov, [1], 2, R.repetition_penalty(theta))
    z = np.log(CHAIN)  # all negative: seen tokens' logits are multiplied by theta

    def step(last, seen):
        lg = np.where(np.isin(np.arange(3), list(seen)), z[last] * theta, z[last])
        return np.exp(lg) / np.exp(lg).sum()

    for a, b in itertools.product(range(3), repeat=2):
        want = step(1, {1})[a] * step(a, {1, a})[b]
        assert dist[(a, b)] == pytest.approx(want, rel=1e-5)


def test_top_k_one_is_a_point_mass_on_the_greedy_path():
    dist = exact_distribution(markov, [2], 4, R.top_k(1))
    # from 2 the argmax is 2 (.5), and 2 stays: the greedy path
    assert dist == {(2, 2, 2, 2): pytest.approx(1.0)}
    dist = exact_distribution(markov, [0], 3, R.greedy())
    assert dist == {(0, 0, 0): pytest.approx(1.0)}


def test_zero_horizon_and_shape_errors():
    assert exact_distribution(markov, [0], 0) == {(): 1.0}
    with pytest.raises(ValueError, match="expected V=4"):
        exact_distribution(markov, [0], 1, V=4)


@pytest.fixture(scope="module")
def lm(tiny_lm):
    return tiny_lm.params, tiny_lm.cfg


_forward = jax.jit(M.forward, static_argnums=1)
_window_logits = jax.jit(M.window_logits, static_argnums=1)


def path_probs(params, cfg, prompt, seqs, process):
    """Probability of each continuation by one forward over whole rows (all within T);
    ``process`` maps a row of logits [V] to processed logits."""
    rows = jnp.asarray([list(prompt) + list(seq) for seq in seqs])
    logits = np.asarray(_forward(params, cfg, rows), np.float64)  # [N, t, V]
    out = []
    for row, seq in zip(logits, seqs):
        total = 1.0
        for i, tok in enumerate(seq):
            z = process(row[len(prompt) - 1 + i])
            p = np.exp(z - z.max())
            total *= p[tok] / p.sum()
        out.append(total)
    return out


@pytest.mark.quick_ids('native')
def test_tiny_lm_without_rule_matches_full_forwards(lm):
    params, cfg = lm
    prompt = [3, 1, 4, 1, 5]
    # batches of 5: 12 prefixes run as 5 + 5 + 2
    dist = exact_distribution(model_next_logits(params, cfg, batch_size=5), prompt, 2)
    assert len(dist) == cfg.V ** 2
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-9)
    seqs = [(0, 0), (3, 7), (11, 2)]
    for seq, want in zip(seqs, path_probs(params, cfg, prompt, seqs, lambda z: z)):
        assert dist[seq] == pytest.approx(want, rel=1e-4)


def test_tiny_lm_with_truncation_and_temperature(lm):
    params, cfg = lm
    prompt = [1, 2, 3, 4, 5]
    rule = R.chain(R.top_k(3), R.temperature(0.7))

    def process(z):
        return np.where(z >= np.sort(z)[-3], z / 0.7, -np.inf)

    dist = exact_distribution(model_next_logits(params, cfg), prompt, 3, rule)
    assert len(dist) <= 27
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-9)
    seqs = list(dist)
    for seq, want in zip(seqs, path_probs(params, cfg, prompt, seqs, process)):
        assert dist[seq] == pytest.approx(want, rel=1e-4)


def test_tiny_lm_greedy_point_mass_and_window_past_T(lm):
    params, cfg = lm
    prompt = list(np.random.default_rng(0).integers(0, cfg.V, cfg.T - 1))  # crosses T at step 2
    dist = exact_distribution(model_next_logits(params, cfg, batch_size=4), prompt, 3, R.top_k(1))
    (path, p), = dist.items()
    assert p == pytest.approx(1.0)
    history = np.zeros((1, len(prompt) + 3), np.int32)  # left-aligned, real up to length
    history[0, :len(prompt)] = prompt
    for length in range(len(prompt), len(prompt) + 3):  # greedy by the book's window semantics
        logits = _window_logits(params, cfg, jnp.asarray(history), jnp.asarray([length]))
        history[0, length] = int(np.argmax(np.asarray(logits)[0]))
    assert path == tuple(history[0, len(prompt):])


@pytest.mark.quick
def test_chisquare_accepts_samples_from_the_distribution_and_rejects_others():
    dist = exact_distribution(markov, [0], 3)
    keys = list(dist)
    probs = np.array([dist[k] for k in keys])
    rng = np.random.default_rng(0)

    def counts(p, n):
        draws = rng.choice(len(keys), size=n, p=p / p.sum())
        return {keys[i]: int(c) for i, c in zip(*np.unique(draws, return_counts=True))}

    assert chisquare_pvalue(counts(probs, 3000), dist) > 1e-3
    skewed = probs * np.where(np.arange(len(keys)) % 2 == 0, 1.3, 0.7)
    assert chisquare_pvalue(counts(skewed, 3000), dist) < 1e-6
    # a sample outside the support is impossible
    assert chisquare_pvalue({(9, 9, 9): 1, keys[0]: 10}, dist) == 0.0


@pytest.mark.quick
def test_chisquare_pools_small_cells():
    probs = {"a": 0.5, "b": 0.49, "c": 0.004, "d": 0.004, "e": 0.002}
    # 100 samples: c, d, e expect 1 between them and pool with b (49) into one cell
    assert chisquare_pvalue({"a": 50, "b": 49, "c": 1}, probs) == pytest.approx(1.0, abs=0.05)
    assert chisquare_pvalue({"a": 80, "c": 20}, probs) < 1e-6


@pytest.mark.quick
def test_model_next_logits_takes_a_loaded_model(tiny_lm, lm, monkeypatch):
    """A loaded model gives the same next-token logits as its parameters and shape, on the
    portable decoder whatever backend it was loaded on; a shape without parameters is refused."""
    from jaxdecode.eval import exact

    params, cfg = lm
    rows = np.array([[3, 1, 4, 1], [5, 9, 2, 6]], np.int32)
    want = np.asarray(model_next_logits(params, cfg)(rows))
    used = []
    monkeypatch.setattr(exact, "next_logits_for", lambda m, *a: used.append(m) or next_logits_for(m, *a))
    got = np.asarray(model_next_logits(tiny_lm)(rows))
    assert [m.backend for m in used] == ["portable"] and used[0].cfg == cfg
    np.testing.assert_array_equal(got, want)
    z = np.asarray(_forward(params, cfg, jnp.asarray(rows)))[:, -1]
    np.testing.assert_allclose(want, z, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="pass no cfg"):
        model_next_logits(tiny_lm, cfg)
    with pytest.raises(TypeError, match="need the model's shape cfg"):
        model_next_logits(params)
