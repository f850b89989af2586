"""The native CPU layer against the model's own (portable) code: there is no third copy.

The references below only call the model's functions (:func:`jaxdecode.models.charlm.transformer.attend`,
:meth:`jaxdecode.models.charlm.transformer.Block.decode`) with the kernels' argument layout. The native layer is
required here (no skips): a failed build fails these tests.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.native import kernels
from jaxdecode.models.charlm import transformer as M

import support.compiled as C



@pytest.fixture
def registered():
    """The kernels' FFI targets are registered when the native layer is first selected
    (``kernels.select`` / ``available``), not by the kernel functions themselves: a test that
    calls a kernel directly and runs alone (``-k``) needs this ("No FFI handler registered"
    otherwise). Not autouse: test_other_backends_never_build must see an unbuilt layer."""
    assert kernels.available()


@pytest.mark.quick
def test_native_layer_is_available():
    native, why = kernels.select("native")
    assert native and kernels.available(), why


@jax.jit
def reference_attention(q, k, v, lim, k2, v2, n2, scale):
    """The model's attention over the cache (up to ``lim``) and the buffer (up to ``n2``)."""
    B, H, _, D = q.shape
    k2, v2 = k2.reshape(B, H, -1, D), v2.reshape(B, H, -1, D)
    return M.attend(q, [(k, v, M.visible_below(k.shape[2], lim)), (k2, v2, M.visible_below(k2.shape[2], n2))],
                    scale)


@functools.partial(jax.jit, static_argnums=8)  # one program per shape (see tests/support/compiled.py)
def reference_decode_layer(x, weights, k, v, lim, k2, v2, n2, eps=1e-5):
    """The model's decoder layer (``Block.decode``, portable) on the kernel's weight tuple."""
    assert eps == M.LN_EPS
    g1, be1, wqkv, bqkv, wo, bo, g2, be2, w1, b1, w2, b2 = weights
    dense = lambda w, b: {"kernel": kernels.unpack(w), "bias": b}
    params = {"ln1": {"scale": g1, "bias": be1}, "ln2": {"scale": g2, "bias": be2},
              "attn": {"qkv": dense(wqkv, bqkv), "proj": dense(wo, bo)},
              "ff1": dense(w1, b1), "ff2": dense(w2, b2)}
    d, H = x.shape[2], k.shape[1]
    cfg = M.ModelConfig(V=1, T=1, d=d, L=1, heads=H)
    y, (kn, vn) = M.Block(cfg).apply({"params": params}, x, k, v, lim, k2, v2, n2, method=M.Block.decode)
    return y, kn, vn


def problem(rng, B, H, S, D, C, L, full=False):
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    lim = np.full((B, S), C) if full else rng.integers(0, C + 1, size=(B, S))
    n2 = np.full((B, S), L) if full else rng.integers(0, L + 1, size=(B, S))
    if not full:
        n2[(lim + n2) == 0] = min(1, L)  # every query sees something...
        lim[(lim + n2) == 0] = 1
    return (f(B, H, S, D), f(B, H, C, D), f(B, H, C, D), jnp.asarray(lim, jnp.int32),
            f(B * H, L, D), f(B * H, L, D), jnp.asarray(n2, jnp.int32))


@pytest.mark.quick
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
    want = reference_attention(*args, scale=0.3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_kernel_extreme_scores_and_empty_queries():
    """Large score gaps (exp underflow) stay exact; a query that sees nothing gives zeros."""
    rng = np.random.default_rng(0)
    q, k, v, lim, k2, v2, n2 = problem(rng, 2, 2, 2, 64, 30, 4, full=True)
    q = q * 40.0  # scores spread over hundreds of nats
    got = kernels.attention(q, k, v, lim, k2, v2, n2, scale=1.0)
    # scores of a few hundred carry float32 rounding of ~1e-4 nats in either implementation
    np.testing.assert_allclose(got, reference_attention(q, k, v, lim, k2, v2, n2, 1.0),
                               rtol=1e-3, atol=3e-4)
    zero = jnp.zeros_like(lim)
    out = jax.jit(lambda *a: kernels.attention(*a, scale=1.0))(q, k, v, zero, k2, v2, zero)
    assert np.all(np.asarray(out) == 0.0)


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
    np.testing.assert_allclose(got, reference_attention(q, k, v, lim, k2, v2, n2, 0.2),
                               rtol=1e-5, atol=2e-6)


@pytest.mark.quick
def test_cached_decoding_with_kernel_matches_forward():
    """extend() (kernel attention over the cache) against a full forward, ragged rows."""
    cfg = M.ModelConfig(V=11, T=24, d=32, L=2, heads=4)
    params = M.init_params(cfg, jax.random.PRNGKey(3))
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, cfg.V, size=(3, 20)).astype(np.int32)
    lengths = np.array([5, 9, 7], np.int32)
    _, cache = C.prefill(params, cfg, jnp.asarray(tokens[:, :9]), lengths, native=True)
    S = 4
    new = np.stack([tokens[b, lengths[b]:lengths[b] + S] for b in range(3)])
    ext = jax.jit(lambda c, t: M.extend(params, cfg, c, t, native=True))
    assert "jaxdecode_decode_attention" in ext.lower(cache, jnp.asarray(new)).as_text()
    got, _ = ext(cache, jnp.asarray(new))
    for b in range(3):
        full = C.forward(params, cfg, jnp.asarray(tokens[b:b + 1, :lengths[b] + S]))
        np.testing.assert_allclose(got[b], full[0, lengths[b]:], rtol=1e-4, atol=1e-5)


@pytest.mark.quick
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


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8, 13, 15])  # every tile: 8, 5-7, 4, 3, 2, 1
def test_packed_dense_matches_matmul(M):
    rng = np.random.default_rng(M)
    K, N = 48, 96
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(K, N)) * 0.1, jnp.float32)
    b = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
    got = jax.jit(kernels.packed_dense)(x, kernels.pack(w), b)
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b),
                               rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("S", [3, 4, 5, 7])
def test_extend_with_packed_weights(S):
    """A verify-sized pass with packed weights gives the logits of the ordinary pass."""
    cfg = M.ModelConfig(V=11, T=24, d=32, L=2, heads=2)
    params = M.init_params(cfg, jax.random.PRNGKey(5))
    packed = M.pack_params(params)
    assert set(packed["block_0"]) == {"attn", "ff1", "ff2"} and "tok" not in packed
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.V, size=(1, 16)), jnp.int32)
    _, cache = C.prefill(params, cfg, tokens[:, :8], jnp.array([8], jnp.int32))
    want, _ = C.extend(params, cfg, cache, tokens[:, 8:8 + S])
    got, _ = jax.jit(lambda p, c, t, pk: M.extend(p, cfg, c, t, packed=pk, native=True))(params, cache, tokens[:, 8:8 + S], packed)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_kernels_under_vmap():
    """vmap over a leading axis (the kernels run once per element) agrees with the reference."""
    rng = np.random.default_rng(7)
    args = [jnp.stack([a, a * 0.5 + 0.1]) if a.dtype == jnp.float32 else jnp.stack([a, a])
            for a in problem(rng, 2, 2, 1, 16, 10, 3, full=True)]
    got = jax.vmap(lambda *a: kernels.attention(*a, scale=0.5))(*args)
    want = jax.vmap(lambda *a: reference_attention(*a, 0.5))(*args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    x = jnp.asarray(rng.normal(size=(3, 1, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
    b = jnp.zeros((32,), jnp.float32)
    np.testing.assert_allclose(jax.vmap(lambda x: kernels.dense(x, w, b))(x), x @ w, rtol=1e-5, atol=1e-5)


def layer_problem(rng, B, S, H, D, C, L):
    d = H * D
    f = lambda *shape, scale=1.0: jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
    weights = (1 + f(d, scale=0.1), f(d, scale=0.1), kernels.pack(f(d, 3 * d, scale=0.1)), f(3 * d, scale=0.1),
               kernels.pack(f(d, d, scale=0.1)), f(d, scale=0.1), 1 + f(d, scale=0.1), f(d, scale=0.1),
               kernels.pack(f(d, 4 * d, scale=0.1)), f(4 * d, scale=0.1), kernels.pack(f(4 * d, d, scale=0.05)),
               f(d, scale=0.1))
    lim = jnp.asarray(rng.integers(0, C + 1, size=(B, S)), jnp.int32)
    n2 = jnp.asarray(rng.integers(0, L + 1, size=(B, S)), jnp.int32)
    return f(B, S, d), weights, f(B, H, C, D), f(B, H, C, D), lim, f(B * H, L, D), f(B * H, L, D), n2


@pytest.mark.quick_ids('2-2-4-16-17-5')
@pytest.mark.parametrize("B,S,H,D,C,L", [
    (1, 1, 4, 64, 40, 8),    # a decode step at batch 1 (the shipped model's shape)
    (1, 3, 2, 32, 20, 0),    # a verify pass: several new positions, no chunk buffer
    (2, 2, 4, 16, 17, 5),
    (3, 1, 4, 12, 9, 3),     # head size 12: the scalar attention path
    (13, 1, 4, 32, 33, 6),   # 13 rows: tiles of 8, 4 and 1 rows
    (2, 1, 2, 64, 30, 4),    # d = 128: split across threads
    (4, 2, 4, 32, 30, 4),
])
def test_decode_layer_matches_reference(B, S, H, D, C, L):
    rng = np.random.default_rng(B * 100 + S * 10 + D)
    x, weights, k, v, lim, k2, v2, n2 = layer_problem(rng, B, S, H, D, C, L)
    got = jax.jit(lambda *a: kernels.decode_layer(a[0], a[1:13], *a[13:], eps=1e-5))(x, *weights, k, v, lim, k2, v2, n2)
    want = reference_decode_layer(x, weights, k, v, lim, k2, v2, n2, 1e-5)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("B,S,H,D,C,L", [
    (1, 4, 4, 64, 170, 0),   # a verify pass of 4 positions: two pairs of queries
    (2, 3, 2, 24, 20, 5),    # a pair and a single query; head size 24
    (1, 5, 3, 16, 9, 2),
    (2, 2, 4, 12, 11, 3),    # head size 12: one query at a time
])
def test_decode_layer_queries_with_shared_limits(B, S, H, D, C, L):
    """New positions of a row that see the same cache positions (a verify pass) are attended in
    pairs that read each key and value once."""
    rng = np.random.default_rng(S * 10 + D)
    x, weights, k, v, lim, k2, v2, n2 = layer_problem(rng, B, S, H, D, C, L)
    lim = jnp.broadcast_to(lim[:, :1], (B, S))
    n2 = jnp.broadcast_to(n2[:, :1], (B, S))
    got = kernels.decode_layer(x, weights, k, v, lim, k2, v2, n2, eps=1e-5)
    want = reference_decode_layer(x, weights, k, v, lim, k2, v2, n2, 1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("B,S,H,D,C,L", [
    (70, 1, 4, 64, 40, 5),   # one query per row: heads attended together; 16-row blocks and a rest
    (9, 1, 3, 32, 25, 0),    # three heads, a single block and a ragged one
    (24, 3, 2, 32, 20, 4),   # several queries per row: head by head, in pairs
    (40, 1, 4, 12, 15, 3),   # head size 12: the scalar path
    (5, 1, 9, 16, 12, 2),    # more heads than are attended together
])
@pytest.mark.parametrize("schedule", ["pipeline", "phases"])
def test_decode_layer_schedules_match_reference(B, S, H, D, C, L, schedule):
    """Both ways of running the layer (phase by phase, or as a pipeline over blocks of rows,
    which the kernel chooses from 64 rows on) agree with the reference, on ragged limits."""
    rng = np.random.default_rng(B * 10 + S + H)
    x, weights, k, v, lim, k2, v2, n2 = layer_problem(rng, B, S, H, D, C, L)
    got = kernels.decode_layer(x, weights, k, v, lim, k2, v2, n2, eps=1e-5, schedule=schedule)
    want = reference_decode_layer(x, weights, k, v, lim, k2, v2, n2, 1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("B,S,schedule", [(2, 3, "phases"), (70, 1, "pipeline"), (20, 2, "pipeline")])
def test_decode_layer_writes_in_place(B, S, schedule, registered):
    """write="cache" / "buffer": the call returns the cache (buffer) with the new keys and values
    at each row's first limit (count), and the same output as when it returns them."""
    H, D, C, L = 2, 32, 12, 6
    rng = np.random.default_rng(B + S)
    x, weights, k, v, lim, k2, v2, n2 = layer_problem(rng, B, S, H, D, C, L)
    lim = jnp.broadcast_to(jnp.asarray(rng.integers(0, C - S + 1, size=(B, 1)), jnp.int32), (B, S))
    n2 = jnp.broadcast_to(jnp.asarray(rng.integers(0, L - S + 1, size=(B, 1)), jnp.int32), (B, S))
    y, kn, vn = reference_decode_layer(x, weights, k, v, lim, k2, v2, n2, 1e-5)

    def placed(buf, new, at):
        buf, new = np.array(buf).reshape(B, H, -1, D), np.asarray(new)
        for b in range(B):
            buf[b, :, int(at[b]):int(at[b]) + S] = new[b]
        return buf

    run = jax.jit(lambda *a, write: kernels.decode_layer(a[0], a[1:13], *a[13:], eps=1e-5,
                                                         schedule=schedule, write=write),
                  static_argnames="write")
    args = (x, *weights, k, v, lim, k2, v2, n2)
    names = ["x", *(f"weights[{i}]" for i in range(12)), "k", "v", "lim", "k2", "v2", "n2"]
    before = [np.array(a, copy=True) for a in args]  # host copies, taken before any call

    def unchanged(write):
        """Every input is bit for bit what it was: the operands the call does not alias (x, the
        weights, the limits and the other pair of caches) are only read; and nothing is donated,
        so XLA hands the kernel a copy of the aliased pair (k, v for "cache"; k2, v2 for
        "buffer") and the caller's arrays keep their contents too."""
        for name, a, b in zip(names, args, before):
            got = np.asarray(a)
            assert got.dtype == b.dtype and got.shape == b.shape, (write, name)
            assert got.tobytes() == b.tobytes(), f"write={write!r} changed the input {name}"

    gy, gk, gv = run(*args, write="cache")
    jax.block_until_ready((gy, gk, gv))
    unchanged("cache")
    np.testing.assert_allclose(gy, y, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(gk, placed(k, kn, lim[:, 0]), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(gv, placed(v, vn, lim[:, 0]), rtol=2e-5, atol=2e-5)
    gy, gk, gv = run(*args, write="buffer")
    jax.block_until_ready((gy, gk, gv))
    unchanged("buffer")
    np.testing.assert_allclose(gy, y, rtol=2e-5, atol=2e-5)
    assert gk.shape == k2.shape
    np.testing.assert_allclose(np.asarray(gk).reshape(B, H, L, D), placed(k2, kn, n2[:, 0]), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(gv).reshape(B, H, L, D), placed(v2, vn, n2[:, 0]), rtol=2e-5, atol=2e-5)
    # write=None (the keys and values returned, nothing aliased) reads its inputs only, too
    jax.block_until_ready(run(*args, write=None))
    unchanged(None)


def paged_layer_problem(rng, B, S, H, D, BS, M):
    """A pool and block tables as a paged engine keeps them: each row's full blocks drawn from a
    few blocks that rows share, its blocks from ``lengths // BS`` on its own; ``counts`` new
    positions written per row (0..S)."""
    x, weights, *_ = layer_problem(rng, B, S, H, D, 1, 0)
    shared = 4
    N = shared + B * M
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    lengths = rng.integers(0, M * BS - S + 1, size=B)
    tables = np.zeros((B, M), np.int32)
    for b in range(B):
        full = lengths[b] // BS
        tables[b, :full] = rng.integers(0, shared, size=full)
        tables[b, full:] = shared + b * M + np.arange(full, M)
    counts = rng.integers(0, S + 1, size=B).astype(np.int32)
    lim = np.broadcast_to(lengths[:, None], (B, S)).astype(np.int32)
    return x, weights, f(N, H, BS, D), f(N, H, BS, D), jnp.asarray(tables), jnp.asarray(lim), jnp.asarray(counts)


def reference_paged_layer(x, weights, k_pool, v_pool, tables, lim, counts):
    """The dense reference layer over each row's blocks gathered through its table, then the new
    keys and values written into the pool (``jaxdecode.models.base``: ``gather_blocks``,
    ``write_blocks``)."""
    from jaxdecode.models.base import gather_blocks, write_blocks

    B, S, _ = x.shape
    H, D = k_pool.shape[1], k_pool.shape[3]
    k, v = gather_blocks(k_pool, tables), gather_blocks(v_pool, tables)
    none = jnp.zeros((B * H, 0, D), jnp.float32)
    y, kn, vn = reference_decode_layer(x, weights, k, v, lim, none, none, jnp.zeros((B, S), jnp.int32))
    positions = lim[:, :1] + jnp.arange(S)[None, :]
    valid = jnp.arange(S)[None, :] < counts[:, None]
    return y, write_blocks(k_pool, kn, tables, positions, valid), write_blocks(v_pool, vn, tables, positions, valid)


@pytest.mark.quick_ids('5-1-4-16-4-6-phases')
@pytest.mark.parametrize("B,S,H,D,BS,M,schedule", [
    (5, 1, 4, 16, 4, 6, "phases"),      # decode steps: every head of a row together
    (70, 1, 4, 32, 8, 4, "pipeline"),   # many rows: the pipeline over blocks of rows
    (3, 3, 2, 24, 4, 6, "phases"),      # several new positions a row (a prefill chunk), some not written
    (4, 2, 4, 12, 3, 5, "phases"),      # head size 12: the scalar path
    (6, 1, 9, 16, 4, 4, "auto"),        # more heads than are attended together
])
def test_paged_layer_matches_reference(B, S, H, D, BS, M, schedule, registered):
    """The fused layer through block tables (kernels.paged_layer) reads shared blocks in place,
    writes each row's first ``counts`` new positions into its own blocks, and agrees with the
    dense reference layer over the gathered blocks; blocks no row writes keep their contents."""
    rng = np.random.default_rng(B * 100 + S * 10 + H)
    x, weights, k_pool, v_pool, tables, lim, counts = paged_layer_problem(rng, B, S, H, D, BS, M)
    run = jax.jit(lambda *a: kernels.paged_layer(a[0], a[1:13], *a[13:], eps=1e-5, schedule=schedule))
    got = run(x, *weights, k_pool, v_pool, tables, lim, counts)
    want = reference_paged_layer(x, weights, k_pool, v_pool, tables, lim, counts)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[1][:4], k_pool[:4])  # the shared blocks are only read
    assert int(counts.sum()) > 0


def test_paged_layer_refuses_a_table_entry_outside_the_pool(registered):
    rng = np.random.default_rng(0)
    x, weights, k_pool, v_pool, tables, lim, counts = paged_layer_problem(rng, 2, 1, 2, 16, 4, 3)
    bad = tables.at[1, :].set(k_pool.shape[0])
    with pytest.raises(Exception, match="paged_layer: a block table entry lies outside the pool"):
        jax.block_until_ready(kernels.paged_layer(x, weights, k_pool, v_pool, bad, lim, jnp.ones((2,), jnp.int32),
                                                  eps=1e-5))


def test_decode_layer_ignores_positions_past_the_limits():
    rng = np.random.default_rng(4)
    B, S, H, D, C, L = 3, 2, 2, 32, 24, 6
    x, weights, k, v, lim, k2, v2, n2 = layer_problem(rng, B, S, H, D, C, L)
    seen = jnp.max(lim, axis=1)[:, None, None, None]  # per row: the most any of its queries sees
    pos = jnp.arange(C)[None, None, :, None]
    poison = lambda a: jnp.where(pos >= seen, jnp.nan, a)
    seen2 = jnp.repeat(jnp.max(n2, axis=1), H)[:, None, None]
    pos2 = jnp.arange(L)[None, :, None]
    poison2 = lambda a: jnp.where(pos2 >= seen2, jnp.nan, a)
    got = kernels.decode_layer(x, weights, poison(k), poison(v), lim, poison2(k2), poison2(v2), n2, eps=1e-5)
    want = reference_decode_layer(x, weights, k, v, lim, k2, v2, n2, 1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("d,heads", [(32, 2), (128, 4)])
def test_fused_decode_matches_module_path(d, heads):
    """extend() and chunk_step() with packed weights (one native call per layer) against the
    ordinary Flax path, on ragged rows; and the fused call is really in the compiled program."""
    cfg = M.ModelConfig(V=11, T=40, d=d, L=2, heads=heads)
    params = M.init_params(cfg, jax.random.PRNGKey(d))
    packed = M.pack_params(params)
    rng = np.random.default_rng(d)
    tokens = jnp.asarray(rng.integers(0, cfg.V, size=(3, 30)), jnp.int32)
    _, cache = C.prefill(params, cfg, tokens[:, :9], jnp.array([5, 9, 7], jnp.int32), capacity=40)
    ext = jax.jit(lambda c, t, pk: M.extend(params, cfg, c, t, packed=pk, native=True))
    assert "jaxdecode_decode_layer" in ext.lower(cache, tokens[:, 20:22], packed).as_text()
    want, want_cache = C.extend(params, cfg, cache, tokens[:, 20:22])
    got, got_cache = ext(cache, tokens[:, 20:22], packed)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    local = want_local = M.empty_local(cfg, 3, 4)
    step = jax.jit(lambda loc, i, t: M.chunk_step(params, cfg, cache, loc, i, t, packed, native=True))
    for i in range(3):
        want, _, want_local = C.chunk_step(params, cfg, cache, want_local, i, tokens[:, 25 + i])
        got, _, local = step(local, i, tokens[:, 25 + i])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(local.k + local.v, want_local.k + want_local.v):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_decode_layer_under_vmap():
    rng = np.random.default_rng(9)
    probs = [layer_problem(np.random.default_rng(i), 2, 1, 2, 16, 8, 2) for i in range(2)]
    x, weights, k, v, lim, k2, v2, n2 = probs[0]
    xs = jnp.stack([x, probs[1][0]])
    ks = jnp.stack([k, probs[1][2]])
    got = jax.vmap(lambda x, k: kernels.decode_layer(x, weights, k, v, lim, k2, v2, n2, eps=1e-5)[0])(xs, ks)
    for i in range(2):
        want = reference_decode_layer(xs[i], weights, ks[i], v, lim, k2, v2, n2, 1e-5)[0]
        np.testing.assert_allclose(got[i], want, rtol=2e-5, atol=2e-5)
    del rng


def test_prefill_with_packed_weights():
    """Short prompts go through the fused layers on an empty cache: same logits and cache."""
    cfg = M.ModelConfig(V=11, T=24, d=32, L=2, heads=2)
    params = M.init_params(cfg, jax.random.PRNGKey(6))
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, cfg.V, size=(2, 16)), jnp.int32)
    lengths = jnp.array([16, 5], jnp.int32)
    want, want_cache = C.prefill(params, cfg, tokens, lengths, capacity=24)
    got, cache = jax.jit(lambda p, pk: M.prefill(p, cfg, tokens, lengths, capacity=24, packed=pk, native=True))(
        params, M.pack_params(params))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert cache.length.tolist() == [16, 5]
    for b, n in enumerate(lengths.tolist()):  # positions past a row's length are never read
        for a, w in zip(cache.k + cache.v, want_cache.k + want_cache.v):
            np.testing.assert_allclose(a[b, :, :n], w[b, :, :n], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_prefill_cache_is_prefills_cache(packed):
    """The cache-only prefill (the last layer only computes its keys and values) fills the same
    cache as the full prefill, on the native path and off it."""
    cfg = M.ModelConfig(V=11, T=24, d=32, L=3, heads=2)
    params = M.init_params(cfg, jax.random.PRNGKey(7))
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.V, size=(2, 16)), jnp.int32)
    lengths = jnp.array([16, 5], jnp.int32)
    _, want = C.prefill(params, cfg, tokens, lengths, capacity=24)
    pk = M.pack_params(params) if packed else None
    cache = jax.jit(lambda p, pk: M.prefill_cache(p, cfg, tokens, lengths, capacity=24, packed=pk,
                                                  native=packed))(params, pk)
    assert cache.length.tolist() == [16, 5] and cache.capacity == 24
    for b, n in enumerate(lengths.tolist()):  # positions past a row's length are never read
        for a, w in zip(cache.k + cache.v, want.k + want.v):
            np.testing.assert_allclose(a[b, :, :n], w[b, :, :n], rtol=1e-4, atol=1e-5)


def test_packed_weights_are_reused_per_parameter_set():
    cfg = M.ModelConfig(V=11, T=24, d=32, L=1, heads=2)
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    first = M.packed_params(params)
    assert M.packed_params(params) is first  # the same (immutable) arrays: packed once
    other = jax.tree_util.tree_map(lambda a: a + 1.0, params)
    assert M.packed_params(other) is not first
    np.testing.assert_array_equal(M.packed_params(other)["block_0"]["ff1"]["kernel"],
                                  kernels.pack(other["block_0"]["ff1"]["kernel"]))
    as_numpy = jax.tree_util.tree_map(np.asarray, params)  # numpy arrays may change in place
    assert M.packed_params(as_numpy) is not M.packed_params(as_numpy)


@pytest.mark.quick
def test_kernels_mode_is_checked(monkeypatch):
    monkeypatch.setenv("JAXDECODE_KERNELS", "sometimes")
    with pytest.raises(kernels.KernelError, match="JAXDECODE_KERNELS must be"):
        kernels._mode()


def test_required_native_layer_without_a_compiler_is_one_line(monkeypatch, tmp_path):
    """JAXDECODE_KERNELS=1 where nothing can be built: a one-line KernelError naming why."""
    monkeypatch.setenv("JAXDECODE_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    monkeypatch.setattr(kernels, "_library", kernels._library.__wrapped__)  # no cached answer
    with pytest.raises(kernels.KernelError) as e:
        kernels.select("1")
    assert "\n" not in str(e.value) and "unavailable" in str(e.value)
    native, why = kernels.select("auto")
    assert not native and why.startswith("portable: the native CPU layer could not be built")


def test_other_backends_never_build(monkeypatch):
    """Off the CPU backend the portable path is chosen without building anything."""
    monkeypatch.setattr(kernels.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(kernels, "build", lambda *a, **k: pytest.fail("tried to build C++ on a GPU"))
    assert kernels.select("auto") == (False, "portable: JAX runs on gpu (the native layer is for the CPU only)")
    with pytest.raises(kernels.KernelError, match="needs the CPU backend"):
        kernels.select("native")
