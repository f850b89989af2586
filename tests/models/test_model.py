import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.models.charlm import transformer as M

import support.compiled as C


@pytest.fixture(scope="module")
def small():
    cfg = M.ModelConfig(V=11, T=24, d=32, L=2, heads=4)
    params = M.init_params(cfg, jax.random.PRNGKey(1))
    params = jax.tree_util.tree_map(lambda a: a * 3.0, params)  # logits of order 1-5; larger scales make float32 itself disagree across batch shapes
    return cfg, params


@pytest.mark.quick
def test_cache_matches_forward_ragged(small):
    cfg, params = small
    rng = np.random.default_rng(0)
    lengths = np.array([1, 5, 9, 3])
    B, P = len(lengths), 10
    full = rng.integers(0, cfg.V, size=(B, cfg.T))
    prompts = np.where(np.arange(P)[None] < lengths[:, None], full[:, :P], 0)
    logits, cache = C.prefill(params, cfg, jnp.asarray(prompts), jnp.asarray(lengths))
    ref = np.asarray(C.forward(params, cfg, jnp.asarray(full)))  # [B, T, V]
    np.testing.assert_allclose(logits, ref[np.arange(B), lengths - 1], atol=1e-5, rtol=0)
    # step every row up to T positions; every step's logits equal the full forward's
    for s in range(cfg.T - lengths.max()):
        pos = lengths + s
        token = full[np.arange(B), pos]
        span = min(cfg.T, -(-(int(pos.max()) + 1) // 8) * 8)  # bucketed, as the loops do
        logits, cache = C.step(params, cfg, cache, jnp.asarray(token), span=span)
        np.testing.assert_allclose(logits, ref[np.arange(B), pos], atol=1e-5, rtol=0)
    assert list(np.asarray(cache.length)) == list(lengths + cfg.T - lengths.max())


def test_extend_several_tokens_and_rollback(small):
    cfg, params = small
    rng = np.random.default_rng(1)
    full = rng.integers(0, cfg.V, size=(2, cfg.T))
    ref = np.asarray(C.forward(params, cfg, jnp.asarray(full)))
    lengths = jnp.array([4, 7])
    _, cache = C.prefill(params, cfg, jnp.asarray(full[:, :8]), lengths)
    new = np.stack([full[0, 4:8], full[1, 7:11]])
    logits, cache2 = C.extend(params, cfg, cache, jnp.asarray(new))
    np.testing.assert_allclose(logits[0], ref[0, 4:8], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[1], ref[1, 7:11], atol=1e-5, rtol=0)
    # roll row 0 back by two positions and append different tokens: still exact
    cache3 = cache2._replace(length=cache2.length - jnp.array([2, 0]))
    logits, _ = C.step(params, cfg, cache3, jnp.asarray([full[0, 6], full[1, 11]]))
    np.testing.assert_allclose(logits[0], ref[0, 6], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[1], ref[1, 11], atol=1e-5, rtol=0)


def test_window_semantics_past_T(small):
    cfg, params = small
    rng = np.random.default_rng(2)
    N = cfg.T + 9
    hist = rng.integers(0, cfg.V, size=(3, N))
    lengths = np.array([5, cfg.T + 3, N])
    got = np.asarray(C.window_logits(params, cfg, jnp.asarray(hist), jnp.asarray(lengths)))
    for b, n in enumerate(lengths):
        # the plain loop: the model on the last T tokens, logits at the final position
        ctx = hist[b, max(0, n - cfg.T):n]
        want = np.asarray(C.forward(params, cfg, jnp.asarray(ctx[None])))[0, -1]
        np.testing.assert_allclose(got[b], want, atol=1e-5, rtol=0)
    # forward itself keeps only the last T tokens, numbered from 0
    a = M.forward(params, cfg, jnp.asarray(hist))
    b_ = M.forward(params, cfg, jnp.asarray(hist[:, -cfg.T:]))
    np.testing.assert_array_equal(a, b_)


@pytest.mark.quick
def test_compile_once_per_bucket(small):
    cfg, params = small
    traces = {"prefill": 0, "step": 0}

    @jax.jit
    def prefill(params, tokens, lengths):
        traces["prefill"] += 1
        return M.prefill(params, cfg, tokens, lengths)

    @jax.jit
    def step(params, cache, token):
        traces["step"] += 1
        return M.step(params, cfg, cache, token, span=16)

    rng = np.random.default_rng(3)
    for _trial in range(3):
        lengths = rng.integers(1, 9, size=4)
        tokens = rng.integers(0, cfg.V, size=(4, 8))
        _, cache = prefill(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32))
        for _ in range(5):
            _, cache = step(params, cache, jnp.asarray(rng.integers(0, cfg.V, size=4), jnp.int32))
    assert traces == {"prefill": 1, "step": 1}


@pytest.mark.quick
def test_hidden_states(small):
    cfg, params = small
    x = jnp.asarray(np.arange(10)[None] % cfg.V)
    logits, h = C.forward(params, cfg, x, return_hidden=True)
    assert h.shape == (1, 10, cfg.d)
    np.testing.assert_allclose(logits, h @ params["tok"]["embedding"].T, atol=1e-5)


@pytest.mark.quick
def test_config_validation():
    with pytest.raises(ValueError, match="not divisible"):
        M.ModelConfig(V=5, T=8, d=10, L=1, heads=3)
    with pytest.raises(ValueError, match="positive integer"):
        M.ModelConfig(V=5, T=0, d=8, L=1, heads=2)
