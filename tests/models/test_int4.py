"""Weight-only int4 (groups of 32 along the input dimension, a float16 scale each): the
quantizer, the native kernel that sums each group in integers against the rows split into
signed bytes (``kernels.linear`` on ``pack4``'s panels, and the fused layer), the portable product on XLA's int4 type, and the
folders ``jaxdecode quantize --weights int4`` writes.

References that share no code with the kernel: float64 numpy products on the dequantized weights,
and the portable decoder on the same int4 matrices; the shipped subword model's float32 text.
"""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.cli.app import main as cli_main
from jaxdecode.decoding.sampling import sample_tokens
from jaxdecode.models import checkpoint
from jaxdecode.models.hf import linear
from jaxdecode.native import kernels

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
needs_native = pytest.mark.skipif(not kernels.available(), reason="the native CPU layer is not available")


def _dequantized64(u, scale):
    return np.asarray(linear.dequantize4(u, scale), np.float64)


def test_quantize4_is_q4_0_rounding_within_half_a_step():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((96, 32)).astype(np.float32) * np.linspace(0.01, 3, 32, dtype=np.float32)
    w[32:64, 7] = 0.0  # a group of zeros: scale 0, every weight 0
    u, s, low = linear.quantize4(w)
    assert low is None and u.dtype == np.uint8 and u.max() <= 15 and s.dtype == np.float16 and s.shape == (3, 32)
    assert s[1, 7] == 0 and (u[32:64, 7] == 8).all()
    back = linear.dequantize4(u, s)
    step = np.repeat(np.abs(s.astype(np.float32)), 32, axis=0)
    # half a step, but a step where +8 steps is clipped to +7 (the largest weight is the negative side's)
    bound = np.where(u == 15, step, step / 2) + 1e-6 * np.abs(w) + 1e-7
    assert (np.abs(back - w) <= bound).all()
    assert (np.abs(back - w) <= step / 2 + 1e-6 * np.abs(w) + 1e-7).mean() > 0.99
    # the weight of largest magnitude of each group is -8 * scale, exactly
    g = w.reshape(3, 32, 32)
    at = np.abs(g).argmax(axis=1)
    extreme = np.take_along_axis(u.reshape(3, 32, 32), at[:, None], axis=1)[:, 0]
    assert (extreme[s != 0] == 0).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        linear.quantize4(w[:40])


@pytest.mark.quick
def test_pack4_round_trip_and_nibble_order():
    rng = np.random.default_rng(3)
    u = rng.integers(0, 16, (64, 32)).astype(np.uint8)
    s = rng.standard_normal((2, 32)).astype(np.float16)
    up, sp = kernels.pack4(u, s)
    assert up.shape == (2, 32, 16) and up.dtype == np.uint8 and sp.shape == (2, 2, 16)
    # panel 1, group 1, block 2, column 5, byte 3: byte 256 + 2 * 64 + 4 * 5 + 3 = 407 of the panel,
    # rows 32 + 8 * 2 + 3 (low four bits) and 4 rows further (high four bits)
    assert up[1, 407 // 16, 407 % 16] == u[51, 21] | (u[55, 21] << 4)
    back_u, back_s = kernels.unpack4(up, sp)
    assert (back_u == u).all() and (back_s == s).all()


@needs_native
@pytest.mark.parametrize("M,K,N", [(1, 576, 192), (2, 64, 48), (5, 64, 32), (8, 128, 80), (13, 576, 64)])
def test_native_int4_equals_the_dequantized_product_in_float64(M, K, N):
    rng = np.random.default_rng(M * K + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    u, s, _ = linear.quantize4(rng.standard_normal((K, N)))
    up, sp = kernels.pack4(u, s)
    y = kernels.linear(jnp.asarray(x), jnp.asarray(up), jnp.asarray(sp))
    assert y.shape == (M, N) and y.dtype == jnp.float32
    ref = x.astype(np.float64) @ _dequantized64(u, s)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=2e-5 * np.sqrt(K))


@pytest.mark.quick
@needs_native
def test_an_int4_rows_product_does_not_depend_on_the_other_rows():
    """Bit for bit: 13 rows (a tile of 8 and one of 5, the panel widened once for both) against
    each row alone (streamed over four panels at once) and a slice of 6."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((13, 192)).astype(np.float32))
    u, s, _ = linear.quantize4(rng.standard_normal((192, 96)))
    up, sp = (jnp.asarray(a) for a in kernels.pack4(u, s))
    full = np.asarray(kernels.linear(x, up, sp))
    for i in range(13):
        assert (np.asarray(kernels.linear(x[i:i + 1], up, sp))[0] == full[i]).all()
    assert (np.asarray(kernels.linear(x[3:9], up, sp)) == full[3:9]).all()
    assert (np.asarray(kernels.linear(x[:2], up, sp)) == full[:2]).all()


@needs_native
def test_int4_operands_are_checked():
    x = jnp.ones((2, 64), jnp.float32)
    up, sp = kernels.pack4(np.zeros((64, 16), np.uint8), np.ones((2, 16), np.float16))
    with pytest.raises(TypeError, match="float16 scales"):
        kernels.linear(x, jnp.asarray(up))
    with pytest.raises(TypeError, match="float16 scales"):
        kernels.linear(x, jnp.asarray(up), jnp.asarray(sp, jnp.float32))


def test_portable_int4_product_equals_the_dequantized_product():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    u, s, _ = linear.quantize4(rng.standard_normal((128, 40)))
    w = linear.portable_int4(u, s)
    assert w["q4"].dtype == jnp.int4 and w["scale"].dtype == jnp.float16
    y = jax.jit(linear.matmul)(jnp.asarray(x), w)
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ _dequantized64(u, s), rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def get(name, backend, weights="int4"):
        key = (name, backend, weights)
        if key not in cache:
            path = FIXTURES / name if (FIXTURES / name).is_dir() else name
            cache[key] = checkpoint.load(path, backend=backend, weights=weights)
        return cache[key]

    return get


def _logits(lm, tokens):
    logits, _ = lm.decoder.forward(lm.params, tokens)
    return np.asarray(logits)


@needs_native
@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_int4_native_equals_portable(loaded, name):
    """The same int4 matrices through the fused native layer (Llama) or product by product (Gemma,
    whose MLP's input of 48 keeps its down projection in int8) and through XLA."""
    native, portable = loaded(name, "native"), loaded(name, "portable")
    assert native.meta["weights"] == portable.meta["weights"] == "int4"
    layer = native.params["layers"][0]
    assert layer["qkv"]["packed"].dtype == jnp.uint8 and layer["qkv"]["scale"].dtype == jnp.float16
    assert portable.params["layers"][0]["wq"]["q4"].dtype == jnp.int4
    tokens = jnp.asarray([[4, 8, 15, 16, 23, 42, 108, 7]], jnp.int32)
    np.testing.assert_allclose(_logits(native, tokens), _logits(portable, tokens), atol=1e-4, rtol=0)
    prompts = jnp.asarray([[5, 9, 11], [7, 3, 2]], jnp.int32)
    ids = [np.asarray(sample_tokens(m.decoder, m.params, prompts, 24, jax.random.PRNGKey(0), greedy=True).tokens)
           for m in (native, portable)]
    np.testing.assert_array_equal(ids[0], ids[1])


@needs_native
@pytest.mark.parametrize("name", ["llama", "smollm3"])
def test_a_fused_int4_layer_equals_the_layer_product_by_product(loaded, name):
    """The fused layer prepares each product's rows as the phase before writes them (Llama: the
    attention's output by key/value head, 32 values each) or in the product (SmolLM3: 16 values a
    head, less than a group); product by product, XLA's operations run between native products."""
    lm = loaded(name, "native")
    on = lm.decoder
    off = dataclasses.replace(on, fuse=False)
    rng = np.random.RandomState(3)
    tokens = jnp.asarray(rng.randint(3, on.V, (2, 9)), jnp.int32)
    lengths = jnp.asarray([9, 5], jnp.int32)
    step = jnp.asarray(rng.randint(3, on.V, (2, 1)), jnp.int32)
    out = []
    for dec in (on, off):
        prefill = jax.jit(dec.prefill, static_argnames="capacity")
        logits, _, cache = prefill(lm.params, tokens, lengths, capacity=16)
        text = prefill.lower(lm.params, tokens, lengths, capacity=16).as_text()
        out.append((np.asarray(logits), np.asarray(jax.jit(dec.extend)(lm.params, cache, step)[0]),
                    text.count("jaxdecode_hf_layer")))
    assert out[0][2] == on.cfg.L and out[1][2] == 0
    np.testing.assert_allclose(out[0][0], out[1][0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(out[0][1], out[1][1], atol=1e-4, rtol=0)


def test_int4_on_the_subword_model_is_close_to_float32(loaded):
    """On the shipped subword model (held-out loss 1.4968 against float32's 1.4953 nats per
    character, tools/int4_layouts.py): the most probable next token agrees with float32's at
    nearly every position of a text, and greedy text starts the same."""
    q, f = loaded("shakespeare-bpe", "portable"), loaded("shakespeare-bpe", "portable", "float32")
    tokens = jnp.asarray([f.vocab.encode(TEXT)], jnp.int32)
    assert tokens.shape[1] > 150
    agree = float((_logits(q, tokens).argmax(-1) == _logits(f, tokens).argmax(-1)).mean())
    assert agree >= 0.85, agree  # 0.89 (int8: 0.98)
    prompt = jnp.asarray([f.vocab.encode("ROMEO:\nWhat light")], jnp.int32)
    ids = [np.asarray(sample_tokens(m.decoder, m.params, prompt, 12, jax.random.PRNGKey(0), greedy=True).tokens)
           for m in (q, f)]
    np.testing.assert_array_equal(ids[0][0, :10], ids[1][0, :10])


TEXT = """ROMEO:
But soft, what light through yonder window breaks?
It is the east, and Juliet is the sun.
Arise, fair sun, and kill the envious moon,
Who is already sick and pale with grief,
That thou her maid art far more fair than she.

JULIET:
O Romeo, Romeo, wherefore art thou Romeo?
Deny thy father and refuse thy name;
Or, if thou wilt not, be but sworn my love,
And I'll no longer be a Capulet.

ROMEO:
Shall I hear more, or shall I speak at this?

JULIET:
'Tis but thy name that is my enemy;
Thou art thyself, though not a Montague.
What's in a name? that which we call a rose
By any other name would smell as sweet.
"""


def test_quantize_int4_folder_loads_back_as_written(tmp_path, loaded, capsys):
    out = tmp_path / "llama-int4"
    assert cli_main(["quantize", str(FIXTURES / "llama"), str(out), "--weights", "int4"]) in (0, None)
    assert "int4 matrices" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_size < 0.6 * (FIXTURES / "llama" / "model.safetensors").stat().st_size
    ref = loaded("llama", "portable")
    tokens = jnp.asarray([[4, 8, 15, 16, 23, 42]], jnp.int32)
    backends = ("portable", "native") if kernels.available() else ("portable",)
    for backend in backends:
        lm = checkpoint.load(out, backend=backend)
        assert lm.meta["weights"] == "int4"
        np.testing.assert_allclose(_logits(lm, tokens), _logits(ref, tokens), atol=1e-4, rtol=0)
    same = checkpoint.load(out, backend="portable", weights="int4")
    np.testing.assert_array_equal(np.asarray(same.params["layers"][1]["wv"]["q4"]),
                                  np.asarray(ref.params["layers"][1]["wv"]["q4"]))
    with pytest.raises(checkpoint.CheckpointError, match="holds int4 weights"):
        checkpoint.load(out, weights="int8")


def test_weights_int4_flag_and_bad_uses():
    import argparse

    from jaxdecode.cli.common import add_weights_flag

    p = argparse.ArgumentParser()
    add_weights_flag(p)
    assert p.parse_args(["--weights", "int4"]).weights == "int4"
    with pytest.raises(checkpoint.CheckpointError, match="applies to Hugging Face"):
        checkpoint.load(None, weights="int4")
    with pytest.raises(checkpoint.CheckpointError, match="needs dtype float32"):
        checkpoint.load(FIXTURES / "llama", dtype="bfloat16", weights="int4")
