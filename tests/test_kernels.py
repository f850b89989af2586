"""The native decode-attention kernel against its jax.numpy definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode import kernels
from jaxdecode import model as M

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="native kernels off (JAXDECODE_KERNELS=0) or not buildable (no C++ compiler?)")


def problem(rng, B, H, S, D, C, L, full=False):
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    lim = np.full((B, S), C) if full else rng.integers(0, C + 1, size=(B, S))
    n2 = np.full((B, S), L) if full else rng.integers(0, L + 1, size=(B, S))
    if not full:
        n2[(lim + n2) == 0] = min(1, L)  # every query sees something...
        lim[(lim + n2) == 0] = 1
    return (f(B, H, S, D), f(B, H, C, D), f(B, H, C, D), jnp.asarray(lim, jnp.int32),
            f(B * H, L, D), f(B * H, L, D), jnp.asarray(n2, jnp.int32))


@needs_kernel
@pytest.mark.parametrize("B,H,S,D,C,L", [
    (1, 4, 1, 64, 40, 8),     # a decode step at batch 1
    (3, 2, 5, 16, 33, 0),     # several queries per row (a verify pass), no second buffer
    (2, 3, 2, 32, 17, 5),
    (2, 1, 1, 128, 9, 3),
    (2, 2, 3, 12, 20, 4),     # a head size that is not a multiple of 8 (the scalar path)
    (64, 4, 1, 64, 256, 32),  # large enough to be split across threads
])
def test_kernel_matches_reference(B, H, S, D, C, L):
    rng = np.random.default_rng(B * 1000 + D)
    args = problem(rng, B, H, S, D, C, L)
    got = jax.jit(lambda *a: kernels.attention(*a, scale=0.3))(*args)
    want = kernels.reference_attention(*args, scale=0.3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_kernel_extreme_scores_and_empty_queries():
    """Large score gaps (exp underflow) stay exact; a query that sees nothing gives zeros."""
    rng = np.random.default_rng(0)
    q, k, v, lim, k2, v2, n2 = problem(rng, 2, 2, 2, 64, 30, 4, full=True)
    q = q * 40.0  # scores spread over hundreds of nats
    got = kernels.attention(q, k, v, lim, k2, v2, n2, scale=1.0)
    # scores of a few hundred carry float32 rounding of ~1e-4 nats in either implementation
    np.testing.assert_allclose(got, kernels.reference_attention(q, k, v, lim, k2, v2, n2, 1.0),
                               rtol=1e-3, atol=3e-4)
    zero = jnp.zeros_like(lim)
    out = jax.jit(lambda *a: kernels.attention(*a, scale=1.0))(q, k, v, zero, k2, v2, zero)
    assert np.all(np.asarray(out) == 0.0)


@needs_kernel
def test_kernel_ignores_positions_past_the_limits():
    """Garbage (even NaN) beyond each row's limit never reaches the output."""
    rng = np.random.default_rng(1)
    q, k, v, lim, k2, v2, n2 = problem(rng, 3, 2, 1, 32, 24, 6)
    pos = jnp.arange(24)[None, None, :, None]
    poisoned = lambda a: jnp.where(pos >= lim[:, None, :1, None], jnp.nan, a)
    pos2 = jnp.arange(6)[None, :, None]
    n2_rows = jnp.repeat(n2[:, 0], 2)[:, None, None]
    poisoned2 = lambda a: jnp.where(pos2 >= n2_rows, jnp.nan, a)
    got = kernels.attention(q, poisoned(k), poisoned(v), lim, poisoned2(k2), poisoned2(v2), n2, scale=0.2)
    np.testing.assert_allclose(got, kernels.reference_attention(q, k, v, lim, k2, v2, n2, 0.2),
                               rtol=1e-5, atol=2e-6)


@needs_kernel
def test_cached_decoding_with_kernel_matches_forward():
    """extend() (kernel attention over the cache) against a full forward, ragged rows."""
    cfg = M.ModelConfig(V=11, T=24, d=32, L=2, heads=4)
    params = M.init_params(cfg, jax.random.PRNGKey(3))
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, cfg.V, size=(3, 20)).astype(np.int32)
    lengths = np.array([5, 9, 7], np.int32)
    _, cache = M.prefill(params, cfg, jnp.asarray(tokens[:, :9]), lengths)
    S = 4
    new = np.stack([tokens[b, lengths[b]:lengths[b] + S] for b in range(3)])
    got, _ = M.extend(params, cfg, cache, jnp.asarray(new))
    for b in range(3):
        full = M.forward(params, cfg, jnp.asarray(tokens[b:b + 1, :lengths[b] + S]))
        np.testing.assert_allclose(got[b], full[0, lengths[b]:], rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("M,K,N", [(1, 256, 768), (2, 256, 1024), (1, 1024, 256), (2, 12, 16), (1, 256, 80), (3, 256, 768), (5, 300, 1024), (8, 1024, 256)])
def test_dense_matches_matmul(M, K, N, monkeypatch):
    monkeypatch.setattr(kernels, "DENSE_MAX_ROWS", 16)  # exercise the kernel beyond its default use
    rng = np.random.default_rng(M * K + N)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(K, N)) * 0.05, jnp.float32)
    b = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
    got = jax.jit(lambda *a: kernels.dense(*a))(x[:, None], w, b)  # leading dims flattened, restored
    assert got.shape == (M, 1, N)
    np.testing.assert_allclose(got[:, 0], np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b),
                               rtol=1e-5, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8])
def test_packed_dense_matches_matmul(M):
    rng = np.random.default_rng(M)
    K, N = 48, 96
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(K, N)) * 0.1, jnp.float32)
    b = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
    got = jax.jit(kernels.packed_dense)(x, kernels.pack(w), b)
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b),
                               rtol=1e-5, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("S", [3, 4])
def test_extend_with_packed_weights(S):
    """A verify-sized pass with packed weights gives the logits of the ordinary pass."""
    cfg = M.ModelConfig(V=11, T=24, d=32, L=2, heads=2)
    params = M.init_params(cfg, jax.random.PRNGKey(5))
    packed = M.pack_params(params)
    assert set(packed["block_0"]) == {"attn", "ff1", "ff2"} and "tok" not in packed
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.V, size=(1, 12)), jnp.int32)
    _, cache = M.prefill(params, cfg, tokens[:, :8], jnp.array([8], jnp.int32))
    want, _ = M.extend(params, cfg, cache, tokens[:, 8:8 + S])
    got, _ = jax.jit(lambda p, c, t, pk: M.extend(p, cfg, c, t, packed=pk))(params, cache, tokens[:, 8:8 + S], packed)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernels_under_vmap():
    """vmap over a leading axis (the kernels run once per element) agrees with the reference."""
    rng = np.random.default_rng(7)
    args = [jnp.stack([a, a * 0.5 + 0.1]) if a.dtype == jnp.float32 else jnp.stack([a, a])
            for a in problem(rng, 2, 2, 1, 16, 10, 3, full=True)]
    got = jax.vmap(lambda *a: kernels.attention(*a, scale=0.5))(*args)
    want = jax.vmap(lambda *a: kernels.reference_attention(*a, 0.5))(*args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    x = jnp.asarray(rng.normal(size=(3, 1, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
    b = jnp.zeros((32,), jnp.float32)
    np.testing.assert_allclose(jax.vmap(lambda x: kernels.dense(x, w, b))(x), x @ w, rtol=1e-5, atol=1e-5)


def test_kernels_mode_is_checked(monkeypatch):
    monkeypatch.setenv("JAXDECODE_KERNELS", "sometimes")
    with pytest.raises(kernels.KernelError, match="JAXDECODE_KERNELS must be"):
        kernels._mode()
