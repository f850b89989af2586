"""The Hugging Face decoder's layer as one native call (``kernels.hf_layer``, csrc/hf_layer.cc),
and weights placed on huge pages (``jaxdecode.native.memory``).

References that share no code with the fused call: the same decoder product by product
(``fuse=False``: XLA's norms, rotation, cache writes and residuals around the native products),
and the portable decoder (XLA alone), which test_hf.py and test_hf_families.py hold to
transformers' outputs.
"""

import dataclasses
import mmap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.decoding.sampling import sample_tokens
from jaxdecode.models import checkpoint
from jaxdecode.native import kernels, memory

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
# the fused kinds: plain (llama), q/k/v biases and tied embeddings (qwen2), per-head q/k norms over
# a sliding window (qwen3), a sliding window from bfloat16 weights (mistral)
FUSED = ("llama", "qwen2", "qwen3", "mistral")
TARGET = "jaxdecode_hf_layer"

needs_native = pytest.mark.skipif(not kernels.available(), reason="the native CPU layer is not available")


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def get(name, backend="native", weights="auto"):
        key = (name, backend, weights)
        if key not in cache:
            cache[key] = checkpoint.load(FIXTURES / name, backend=backend, weights=weights)
        return cache[key]

    return get


def _run(decoder, params, tokens, lengths, steps):
    """A prefill of ``tokens`` (rows of ``lengths``) then one token per row at a time: the
    logits of every call, the last cache, and the prefill's compiled text."""
    prefill = jax.jit(decoder.prefill, static_argnames="capacity")
    extend = jax.jit(decoder.extend)
    logits, _, cache = prefill(params, tokens, lengths, capacity=32)
    text = prefill.lower(params, tokens, lengths, capacity=32).as_text()
    out = [logits]
    for s in steps:
        logits, _, cache = extend(params, cache, s)
        out.append(logits[:, 0])
    return np.stack([np.asarray(o) for o in out]), cache, text


@needs_native
@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("weights", ["auto", "int8"])
def test_a_fused_layer_equals_the_layer_product_by_product(loaded, name, weights):
    lm = loaded(name, weights=weights)
    on = lm.decoder
    off = dataclasses.replace(on, fuse=False)
    rng = np.random.RandomState(len(name))
    tokens = jnp.asarray(rng.randint(3, on.V, (2, 11)), jnp.int32)
    lengths = jnp.asarray([11, 6], jnp.int32)
    steps = [jnp.asarray(rng.randint(3, on.V, (2, 1)), jnp.int32) for _ in range(4)]
    a, ca, text_on = _run(on, lm.params, tokens, lengths, steps)
    b, cb, text_off = _run(off, lm.params, tokens, lengths, steps)
    assert text_on.count(TARGET) == on.cfg.L and text_off.count(TARGET) == 0  # the fused path was taken
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    for x, y in zip(ca.k + ca.v, cb.k + cb.v):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(ca.length), np.asarray(cb.length))
    if weights == "auto":  # and the portable decoder (float32 matrices, XLA)
        portable = loaded(name, "portable")
        c, _, _ = _run(portable.decoder, portable.params, tokens, lengths, steps)
        np.testing.assert_allclose(a, c, atol=1e-4, rtol=0)  # (mistral's bfloat16, kept or widened)


@needs_native
def test_fused_and_portable_decoders_give_the_same_greedy_tokens(loaded):
    prompts = jnp.asarray([[5, 9, 11, 4], [7, 3, 2, 8]], jnp.int32)
    runs = [sample_tokens(m.decoder, m.params, prompts, 40, jax.random.PRNGKey(0), greedy=True)
            for m in (loaded("qwen2"), loaded("qwen2", "portable"))]
    ids = [np.asarray(r.tokens) for r in runs]
    np.testing.assert_array_equal(ids[0], ids[1])


@needs_native
@pytest.mark.parametrize("name", ["gemma2", "phi3", "olmo2", "qwen3_moe"])
def test_layers_of_other_kinds_are_not_fused(loaded, name):
    """Norms around the blocks, partial rotation, norms after, a mixture's layers: product by
    product (qwen3_moe's one dense layer of three is fused)."""
    lm = loaded(name)
    tokens = jnp.ones((1, 4), jnp.int32)
    text = jax.jit(lm.decoder.prefill, static_argnames="capacity").lower(
        lm.params, tokens, jnp.asarray([4], jnp.int32), capacity=8).as_text()
    assert text.count(TARGET) == (1 if name == "qwen3_moe" else 0)


def _layer_in_float64(x, pos, inv, w, k, v, H, eps, scale, window):
    """The layer by its definition, in float64 numpy, one row of the batch at a time: the
    reference for :func:`kernels.hf_layer` (``w`` holds plain ``[K, N]`` matrices); also the
    largest gate value's magnitude."""
    f = lambda a: np.asarray(a, np.float64)
    rms = lambda a, g: a / np.sqrt(np.mean(a * a, -1, keepdims=True) + eps) * g
    B, S, d = x.shape
    KV, C, D = k.shape[1:]
    k, v, y, reach = f(k).copy(), f(v).copy(), np.zeros((B, S, d)), 0.0
    for b in range(B):
        h = rms(f(x[b]), f(w["norm1_w"]))
        qkv = h @ f(w["qkv"]) + f(w["bqkv"])
        q = qkv[:, :H * D].reshape(S, H, D)
        kn = qkv[:, H * D:(H + KV) * D].reshape(S, KV, D)
        vn = qkv[:, (H + KV) * D:].reshape(S, KV, D)
        q, kn = rms(q, f(w["q_norm"])), rms(kn, f(w["k_norm"]))
        angle = f(pos[b])[:, None, None] * f(inv)[None, None, :]
        cos, sin = np.cos(angle), np.sin(angle)
        turn = lambda a: np.concatenate([a[..., :D // 2] * cos - a[..., D // 2:] * sin,
                                         a[..., D // 2:] * cos + a[..., :D // 2] * sin], -1)
        q, kn = turn(q), turn(kn)
        for s_ in range(S):
            k[b, :, pos[b, s_]], v[b, :, pos[b, s_]] = kn[s_], vn[s_]
        att = np.zeros((S, H, D))
        for s_ in range(S):
            lo = max(0, pos[b, s_] - window + 1) if window else 0
            for hh in range(H):
                j = hh // (H // KV)
                sc = k[b, j, lo:pos[b, s_] + 1] @ q[s_, hh] * scale
                p_ = np.exp(sc - sc.max())
                att[s_, hh] = p_ @ v[b, j, lo:pos[b, s_] + 1] / p_.sum()
        x1 = f(x[b]) + att.reshape(S, H * D) @ f(w["wo"])
        gu = rms(x1, f(w["norm2_w"])) @ f(w["gu"])
        F = gu.shape[-1] // 2
        g = gu[:, :F]
        reach = max(reach, float(np.abs(g).max()))
        y[b] = x1 + (g / (1 + np.exp(-g)) * gu[:, F:]) @ f(w["w_down"])
    return y, k, v, reach


@needs_native
@pytest.mark.quick
@pytest.mark.parametrize("window", [None, 3])
def test_the_fused_call_equals_the_layer_in_float64(window):
    """Two rows of three new positions each at different places in the cache, biases, q/k norms,
    and gate values out to +-150 (the activation's exponential in both tails)."""
    rng = np.random.RandomState(7)
    d, H, KV, D, F, C = 32, 4, 2, 16, 48, 12
    r = lambda *shape, s=0.3: (rng.randn(*shape) * s).astype(np.float32)
    N = (H + 2 * KV) * D
    plain = {"norm1_w": 1 + r(d), "norm2_w": 1 + r(d), "qkv": r(d, N), "bqkv": r(N), "q_norm": 1 + r(D),
             "k_norm": 1 + r(D), "wo": r(H * D, d), "gu": r(d, 2 * F), "w_down": r(F, d)}
    plain["gu"][:, :F] *= 40  # gate values of tens to a hundred and more
    packed = dict(plain, **{m: {"packed": kernels.pack(jnp.asarray(plain[m]))}
                            for m in ("qkv", "wo", "gu", "w_down")})
    x = r(2, 3, d, s=1.0)
    pos = np.asarray([[4, 5, 6], [0, 1, 2]], np.int32)
    k, v = r(2, KV, C, D, s=1.0), r(2, KV, C, D, s=1.0)
    inv = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    angle = pos[..., None].astype(np.float32) * inv
    y, k2, v2 = kernels.hf_layer(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(np.cos(angle)),
                                 jnp.asarray(np.sin(angle)), packed, jnp.asarray(k), jnp.asarray(v), H,
                                 1e-6, 0.25, window=window)
    ry, rk, rv, reach = _layer_in_float64(x, pos, inv, plain, k, v, H, 1e-6, 0.25, window)
    assert reach > 88  # past where exp(-g) overflows float32
    np.testing.assert_allclose(np.asarray(y), ry, rtol=0, atol=2e-4 * np.abs(ry).max())
    np.testing.assert_allclose(np.asarray(k2), rk, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(v2), rv, rtol=0, atol=1e-5)


@needs_native
@pytest.mark.quick
def test_the_fused_call_refuses_operands_that_do_not_fit():
    d, H, KV, D, F = 32, 4, 2, 8, 48
    w = lambda K, N: {"packed": kernels.pack(jnp.ones((K, N), jnp.float32))}
    weights = {"norm1_w": jnp.ones(d), "norm2_w": jnp.ones(d), "qkv": w(d, (H + 2 * KV) * D),
               "wo": w(H * D, d), "gu": w(d, 2 * F), "w_down": w(F, d)}
    x = jnp.ones((1, 1, d), jnp.float32)
    turn = jnp.ones((1, 1, D // 2), jnp.float32)
    k = jnp.zeros((1, KV, 8, D), jnp.float32)
    y, k2, _ = kernels.hf_layer(x, jnp.zeros((1, 1), jnp.int32), turn, turn, weights, k, k, H, 1e-5, 0.3)
    assert y.shape == (1, 1, d) and np.isfinite(np.asarray(y)).all() and np.asarray(k2)[0, :, 0].any()
    with pytest.raises(Exception, match="hf_layer: a matrix is not packed"):  # wo for 3 heads, not 4
        kernels.hf_layer(x, jnp.zeros((1, 1), jnp.int32), turn, turn, dict(weights, wo=w(3 * D, d)), k, k,
                         H, 1e-5, 0.3)
    with pytest.raises(Exception, match="hf_layer: more new positions than the cache holds"):
        nine = jnp.ones((1, 9, D // 2), jnp.float32)
        kernels.hf_layer(jnp.ones((1, 9, d), jnp.float32), jnp.zeros((1, 9), jnp.int32), nine, nine,
                         weights, k, k, H, 1e-5, 0.3)


@needs_native
@pytest.mark.quick
def test_a_row_past_the_cache_is_written_at_its_end_as_dynamic_update_slice_writes():
    """A finished row that keeps stepping (its position past the cache): written at the last
    position and attending to every position, as the product-by-product path's
    dynamic_update_slice and mask do; never an error in the middle of a loop."""
    rng = np.random.RandomState(3)
    d, H, KV, D, F, C = 32, 4, 2, 8, 48, 8
    w = lambda K, N: {"packed": kernels.pack(jnp.asarray(rng.randn(K, N).astype(np.float32) * 0.3))}
    weights = {"norm1_w": jnp.ones(d), "norm2_w": jnp.ones(d), "qkv": w(d, (H + 2 * KV) * D),
               "wo": w(H * D, d), "gu": w(d, 2 * F), "w_down": w(F, d)}
    x = jnp.asarray(rng.randn(2, 1, d).astype(np.float32))
    turn = jnp.asarray(rng.rand(2, 1, D // 2).astype(np.float32))
    k = jnp.asarray(rng.randn(2, KV, C, D).astype(np.float32))
    run = lambda pos: kernels.hf_layer(x, jnp.asarray(pos, jnp.int32), turn, turn, weights, k, k, H,
                                       1e-5, 0.3)
    inside, past = run([[C - 1], [2]]), run([[C + 5], [2]])
    for a, b in zip(inside, past):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.quick
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_placed_arrays_hold_the_same_values(dtype):
    a = np.asarray(jnp.asarray(np.random.RandomState(0).randn(300, 512) * 50, dtype))
    placed = memory.place(a)
    assert placed.dtype == a.dtype and placed.shape == a.shape
    np.testing.assert_array_equal(np.asarray(placed), a)
    small = memory.place(a[:2])
    np.testing.assert_array_equal(np.asarray(small), a[:2])


@pytest.mark.quick
def test_placed_arrays_live_on_huge_page_memory_when_asked(monkeypatch):
    a = np.arange(1 << 18, dtype=np.float32)  # 1 MB
    if memory.enabled():
        x = memory.place(a)
        assert x.unsafe_buffer_pointer() % memory.ALIGN == 0  # in a slab, not XLA's own memory
        y = memory.place(a)
        assert 0 < abs(y.unsafe_buffer_pointer() - x.unsafe_buffer_pointer()) < memory.SLAB
    monkeypatch.setenv("JAXDECODE_HUGEPAGES", "0")
    assert not memory.enabled()
    np.testing.assert_array_equal(np.asarray(memory.place(a)), a)
    monkeypatch.setenv("JAXDECODE_HUGEPAGES", "yes")
    with pytest.raises(ValueError, match="JAXDECODE_HUGEPAGES must be 0 or 1"):
        memory.enabled()
    assert hasattr(mmap, "MAP_ANONYMOUS")
