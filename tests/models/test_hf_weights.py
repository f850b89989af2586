"""How a Hugging Face decoder keeps its matrices (float32, as stored, bfloat16, int8) and the
native CPU products that read them (``kernels.linear``).

References that share no code with the kernel: products in float64 numpy on the widened weights,
and the portable decoder (XLA) on the same kept weights; the portable float32 decoder is itself
checked against transformers in test_hf.py and test_hf_families.py.
"""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode.decoding.sampling import sample_tokens
from jaxdecode.models import checkpoint
from jaxdecode.models.hf import linear
from jaxdecode.native import kernels

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
# one family of each kind: the Llama line, GPT-2 (LayerNorm, biases, learned positions), Gemma 2
# (norms around the blocks, soft-capping), Phi-3 (partial rotation), OLMo 2 (norms after), a mixture
FAMILIES = ("llama", "gpt2", "gemma2", "phi3", "olmo2", "qwen3_moe")

needs_native = pytest.mark.skipif(not kernels.available(), reason="the native CPU layer is not available")


def _widened(w, dtype):
    return np.asarray(jnp.asarray(w, dtype).astype(jnp.float32), np.float64)


@pytest.mark.quick
@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_native_linear_equals_the_widened_product_in_float64(dtype):
    rng = np.random.default_rng(0)
    for M, K, N in ((1, 576, 192), (2, 37, 48), (5, 64, 32), (6, 130, 16), (13, 576, 64)):
        x = rng.standard_normal((M, K)).astype(np.float32)
        w = rng.standard_normal((K, N)).astype(np.float32)
        if dtype == "int8":
            q, s = linear.quantize(w)
            ref = (x.astype(np.float64) @ q.astype(np.float64)) * s
            y = kernels.linear(jnp.asarray(x), kernels.pack(jnp.asarray(q)), jnp.asarray(s))
        else:
            ref = x.astype(np.float64) @ _widened(w, dtype)
            y = kernels.linear(jnp.asarray(x), kernels.pack(jnp.asarray(w, dtype)))
        assert y.shape == (M, N) and y.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=2e-5 * np.sqrt(K))


@pytest.mark.quick
@needs_native
def test_a_rows_product_does_not_depend_on_the_other_rows():
    """Bit for bit: the engine's rows equal generate's alone whatever shares the batch."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((13, 200)).astype(np.float32))
    q, s = linear.quantize(rng.standard_normal((200, 96)))
    # 13 rows: a tile of 8 and one of 5 (bfloat16 and int8 widened once for both); alone: streamed
    for w, scale in ((kernels.pack(jnp.asarray(rng.standard_normal((200, 96)), jnp.bfloat16)), None),
                     (kernels.pack(jnp.asarray(q)), jnp.asarray(s))):
        full = np.asarray(kernels.linear(x, w, scale))
        for i in range(13):
            assert (np.asarray(kernels.linear(x[i:i + 1], w, scale))[0] == full[i]).all()
        assert (np.asarray(kernels.linear(x[3:9], w, scale)) == full[3:9]).all()


@pytest.mark.quick
def test_int8_quantization_is_within_half_a_step_per_column():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((50, 24)).astype(np.float32) * np.linspace(0.01, 3, 24, dtype=np.float32)
    w[:, 5] = 0.0
    q, s = linear.quantize(w)
    assert q.dtype == np.int8 and s.shape == (24,) and s[5] == 1.0 and (q[:, 5] == 0).all()
    assert (np.abs(q.astype(np.float32) * s - w) <= s / 2 + 1e-7).all()
    assert (np.abs(q).max(axis=0)[np.arange(24) != 5] == 127).all()


@pytest.mark.quick
@needs_native
def test_bad_operands_are_refused():
    x = jnp.ones((2, 32), jnp.float32)
    with pytest.raises(TypeError, match="scale"):
        kernels.linear(x, kernels.pack(jnp.ones((32, 16), jnp.int8)))
    with pytest.raises(TypeError, match="int32"):
        kernels.linear(x, kernels.pack(jnp.ones((32, 16), jnp.int32)))


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def get(name, backend, weights="auto"):
        key = (name, backend, weights)
        if key not in cache:
            cache[key] = checkpoint.load(FIXTURES / name, backend=backend, weights=weights)
        return cache[key]

    return get


def _fwd(lm, tokens):
    """``lm.decoder.forward`` as one compiled program (run op by op, a test compiles hundreds of
    small programs)."""
    return jax.jit(lm.decoder.forward)(lm.params, tokens)


def _cached_logits(lm, tokens, split):
    """Logits of ``tokens`` [1, t] through the cache: a prefill of ``split``, then one at a time."""
    d = lm.decoder
    extend = jax.jit(d.extend)
    cache = d.empty_cache(1, tokens.shape[1])
    logits, _, cache = extend(lm.params, cache, tokens[:, :split])
    out = [logits]
    for i in range(split, tokens.shape[1]):
        logits, _, cache = extend(lm.params, cache, tokens[:, i:i + 1])
        out.append(logits)
    return jnp.concatenate(out, axis=1)


@needs_native
@pytest.mark.parametrize("name", FAMILIES)
def test_native_equals_portable_in_logits(loaded, name):
    native, portable = loaded(name, "native"), loaded(name, "portable")
    assert native.decoder.backend == "native" and portable.decoder.backend == "portable"
    assert "packed" in native.params["layers"][0]["wo"]
    tokens = jnp.asarray([np.arange(3, 3 + 21) % native.decoder.V], jnp.int32)
    a, _ = _fwd(native, tokens)
    b, _ = _fwd(portable, tokens)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(_cached_logits(native, tokens, 7)), np.asarray(b), atol=1e-4, rtol=0)


@needs_native
@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_native_and_portable_give_the_same_greedy_tokens(loaded, name):
    import jax

    prompts = jnp.asarray([[5, 9, 11], [7, 3, 2]], jnp.int32)
    ids = [np.asarray(sample_tokens(m.decoder, m.params, prompts, 40, jax.random.PRNGKey(0), greedy=True).tokens)
           for m in (loaded(name, "native"), loaded(name, "portable"))]
    np.testing.assert_array_equal(ids[0], ids[1])


@needs_native
@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_kept_weights_native_equal_portable(loaded, weights):
    """The same kept matrices through the C++ kernel and through XLA."""
    native, portable = loaded("llama", "native", weights), loaded("llama", "portable", weights)
    assert native.meta["weights"] == weights
    tokens = jnp.asarray([[4, 8, 15, 16, 23, 42, 108, 7]], jnp.int32)
    a, _ = _fwd(native, tokens)
    b, _ = _fwd(portable, tokens)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)
    f, _ = _fwd(loaded("llama", "portable", "float32"), tokens)
    f = np.asarray(f)
    rel = float(np.sqrt(np.mean((np.asarray(b) - f) ** 2) / np.mean((f - f.mean()) ** 2)))
    assert 0 < rel < 0.05, rel  # rounded weights: near float32's logits (random weights: 3% for int8)


def test_stored_bfloat16_weights_stay_bfloat16_and_give_the_widened_result(tmp_path, loaded):
    """A bfloat16 folder: kept as bfloat16 (half the bytes), the same logits as widening it when
    loaded, on both paths."""
    from safetensors.numpy import load_file, save_file

    src = FIXTURES / "llama"
    dst = tmp_path / "llama-bf16"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("expected*", "*.npz"))
    state = load_file(str(src / "model.safetensors"))
    import ml_dtypes

    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in state.items()}, str(dst / "model.safetensors"))
    tokens = jnp.asarray([[4, 8, 15, 16, 23, 42]], jnp.int32)
    widened = checkpoint.load(dst, backend="portable", weights="float32")
    want, _ = _fwd(widened, tokens)
    backends = ["portable"] + (["native"] if kernels.available() else [])
    for backend in backends:
        lm = checkpoint.load(dst, backend=backend, weights="stored")
        assert lm.meta["weights"] == "bfloat16"
        wo = lm.params["layers"][0]["wo"]
        assert (wo["packed"] if isinstance(wo, dict) else wo).dtype == jnp.bfloat16
        got, _ = _fwd(lm, tokens)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=0)


@pytest.mark.quick
def test_bad_weight_options_are_refused_in_one_line():
    with pytest.raises(checkpoint.CheckpointError, match="weights must be one of"):
        checkpoint.load(FIXTURES / "llama", weights="int3")
    with pytest.raises(checkpoint.CheckpointError, match="needs dtype float32"):
        checkpoint.load(FIXTURES / "llama", dtype="bfloat16", weights="int8")
    with pytest.raises(checkpoint.CheckpointError, match="native CPU layer computes in float32"):
        checkpoint.load(FIXTURES / "llama", dtype="bfloat16", backend="native")
    with pytest.raises(checkpoint.CheckpointError, match="applies to Hugging Face folders"):
        checkpoint.load(None, weights="int8")


@needs_native
def test_with_backend_reloads_a_folder_on_the_other_path(loaded):
    lm = loaded("qwen2", "native", "int8")
    other = lm.with_backend("portable")
    assert other.decoder.backend == "portable" and other.meta["weights"] == "int8"
    assert "q" in other.params["layers"][0]["wo"]
    assert lm.with_backend("native") is lm


def test_engine_on_native_int8_serves_generate(loaded):
    """Every loop takes the kept weights: the engine's texts equal generate's, seeds fixed."""
    from jaxdecode.serving.engine import Engine
    from jaxdecode.serving.requests import Request

    lm = loaded("llama", None, "int8")
    assert lm.meta["weights"] == "int8"
    prompts = ["Hello", "The cat", "A"]
    reqs = [Request(p, 12, seed=i, num_samples=2) for i, p in enumerate(prompts)]
    report = Engine(lm, 3).run(reqs)
    for r, res in zip(reqs, report.results):
        want = jaxdecode.generate(lm, r.prompt, n=12, seed=r.seed, num_samples=2)
        assert [o.tokens.tolist() for o in res.outputs] == [o.tokens.tolist() for o in want]


def test_an_int8_folder_loads_back_as_it_was_written(tmp_path, loaded):
    """`jaxdecode quantize`: the saved folder gives the logits of the model it was saved from (the
    same int8 matrices and scales, not quantized again), on both paths; bad uses are one line."""
    from jaxdecode.cli.app import main

    out = tmp_path / "llama-int8"
    assert main(["quantize", str(FIXTURES / "llama"), str(out)]) in (0, None)
    ref = loaded("llama", "portable", "int8")
    tokens = jnp.asarray([[4, 8, 15, 16, 23, 42, 108]], jnp.int32)
    want, _ = _fwd(ref, tokens)
    for backend in ["portable"] + (["native"] if kernels.available() else []):
        lm = checkpoint.load(out, backend=backend)
        assert lm.meta["weights"] == "int8" and lm.decoder.backend == backend
        got, _ = _fwd(lm, tokens)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0 if backend == "portable" else 1e-4)
    assert jaxdecode.generate(checkpoint.load(out), "The", n=8, greedy=True)[0].text == \
        jaxdecode.generate(ref, "The", n=8, greedy=True)[0].text
    with pytest.raises(checkpoint.CheckpointError, match="holds int8 weights"):
        checkpoint.load(out, weights="float32")
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(checkpoint.CheckpointError, match="corrupt or truncated"):
        checkpoint.load(out)


@pytest.mark.quick
def test_quantize_refuses_a_character_model_and_an_existing_folder(tmp_path, capsys):
    from jaxdecode.cli.app import main

    assert main(["quantize", "shakespeare-char", str(tmp_path / "x")]) == 2
    assert "character model" in capsys.readouterr().err
    (tmp_path / "y").mkdir()
    assert main(["quantize", str(FIXTURES / "llama"), str(tmp_path / "y")]) == 2
    assert "exists" in capsys.readouterr().err
