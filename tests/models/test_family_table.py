"""The family table (``jaxdecode/models/hf/families.py``): the only place that names a
``model_type``, every entry tested against transformers, and the two families added as entries
alone (SmolLM3: a layer without rotation every fourth; Granite: embedding, residual, attention
and logit multipliers) on the portable and the native paths.

The references are the fixtures of ``tools/make_hf_family_fixtures.py`` (test_hf_families.py
holds every family's logits, cached steps, greedy ids and scores to them on the default path).
"""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_hf
import test_hf_families

import jaxdecode
from jaxdecode.models import checkpoint
from jaxdecode.models.hf import families
from jaxdecode.native import kernels

PACKAGE = Path(jaxdecode.__file__).resolve().parent
TABLE = PACKAGE / "models" / "hf" / "families.py"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
NEW = ("smollm3", "granite")
BACKENDS = ["portable", pytest.param("native", marks=pytest.mark.skipif(
    not kernels.available(), reason="the native CPU layer is not available"))]
# a test of the family by name: `model_type ==`, `!=`, `in`, `not in`, or the name compared to it
FAMILY_TEST = re.compile(r"model_type\b\s*(==|!=|\bin\b|\bnot\s+in\b)|(==|!=)\s*[\w.]*\bmodel_type\b")


def family_tests(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if FAMILY_TEST.search(line)]


@pytest.mark.quick
def test_no_model_type_test_outside_the_family_table():
    """Loading, weights, the decoder and the native path read a family's entry: no module but the
    table compares a ``model_type``."""
    assert family_tests('if cfg.model_type == "gpt2":\nx = mt if model_type in ("a",) else 0\n'
                        'if "phi3" != self.cfg.model_type:') == [
        'if cfg.model_type == "gpt2":', 'x = mt if model_type in ("a",) else 0',
        'if "phi3" != self.cfg.model_type:']  # the scan finds what it looks for
    assert family_tests('meta = {"model_type": cfg.model_type}\nif "model_type" in raw:') == []
    found = [f"{path.relative_to(PACKAGE)}: {line}" for path in sorted(PACKAGE.rglob("*.py")) if path != TABLE
             for line in family_tests(path.read_text(encoding="utf-8"))]
    assert not found, found


@pytest.mark.quick
def test_every_family_has_a_fixture_checked_against_transformers():
    """Each entry's ``model_type`` has a folder written by transformers (a config of that type and
    its reference outputs), which test_hf.py or test_hf_families.py compares with."""
    tested = set(test_hf.ARCHS) | set(test_hf_families.FAMILIES)
    for name, spec in families.FAMILIES.items():
        assert spec.model_type == name
        folder = FIXTURES / name
        assert json.loads((folder / "config.json").read_text())["model_type"] == name, name
        assert (folder / "expected.json").is_file() and (folder / "logits_0.npy").is_file(), name
        assert name in tested, f"{name}: no test compares its fixture with transformers"
    assert families.SUPPORTED == tuple(families.FAMILIES)


def test_an_entry_derived_from_another_differs_by_its_fields():
    """SmolLM3 and Granite are Llama's entry with a few fields changed, and read as such."""
    changed = lambda spec: {f.name for f in dataclasses.fields(spec)
                            if getattr(spec, f.name) != getattr(families.LLAMA, f.name)}
    assert changed(families.SMOLLM3) == {"model_type", "rope_theta", "tied", "nope_layers", "windows"}
    assert changed(families.GRANITE) == {"model_type", "multipliers", "native_layer"}


# ----------------------------------------------------------------------------- the two new families


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def get(name, backend):
        if (name, backend) not in cache:
            cache[name, backend] = jaxdecode.load(FIXTURES / name, backend=backend)
        return cache[name, backend]

    return get


def _expected(name):
    return json.loads((FIXTURES / name / "expected.json").read_text())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NEW)
def test_greedy_text_and_scores_equal_transformers(loaded, name, backend):
    """Greedy ids and text (three ragged prompts in one batch, to the end token) and the
    continuation's log-probabilities are transformers'."""
    lm, ex = loaded(name, backend), _expected(name)
    outs = jaxdecode.generate(lm, ex["prompts"], n=80, greedy=True)
    for i, out in enumerate(outs):
        assert out.tokens.tolist() == ex[f"greedy_{i}"], (name, backend, i)
        assert out.text == lm.vocab.decode(ex[f"greedy_{i}"][:-1] if ex[f"greedy_eos_{i}"] else ex[f"greedy_{i}"])
        assert out.finish_reason == ("eos" if ex[f"greedy_eos_{i}"] else "length")
    s = jaxdecode.score(lm, [ex["continuation"]], prompts=[ex["prompts"][0]])[0]
    np.testing.assert_allclose(s.logprobs, ex["continuation_logprobs"], atol=1e-4, rtol=0)


# what each family adds, undone: the logits then leave transformers' by far more than the tolerance
UNDONE = {"smollm3": [{"rotate": ()}],
          "granite": [{"embed_multiplier": 1.0}, {"residual_multiplier": 1.0}, {"attn_multiplier": None},
                      {"logits_scaling": 1.0}]}


@pytest.mark.parametrize("name", NEW)
def test_each_feature_of_the_family_is_needed(loaded, name):
    """The fixture tells each feature from its absence: with it undone, the logits over the 32
    long ids are more than 100 times the tolerance away from transformers'."""
    lm, ex = loaded(name, "portable"), _expected(name)
    ref = np.load(FIXTURES / name / "long_logits.npy")
    ids = jnp.asarray([ex["long_ids"]])
    logits, _ = jax.jit(lm.decoder.forward)(lm.params, ids)
    assert np.abs(np.asarray(logits[0]) - ref).max() < 1e-4
    for change in UNDONE[name]:
        dec = dataclasses.replace(lm.decoder, cfg=dataclasses.replace(lm.decoder.cfg, **change))
        wrong, _ = jax.jit(dec.forward)(lm.params, ids)
        assert np.abs(np.asarray(wrong[0]) - ref).max() > 1e-2, change


@pytest.mark.skipif(not kernels.available(), reason="the native CPU layer is not available")
@pytest.mark.parametrize("name", NEW)
def test_the_fused_native_layer_runs_where_the_entry_says(loaded, name):
    """SmolLM3's layers, the one without rotation too, run as one native call each; Granite's
    (its residual multiplier inside the layer) product by product; the logits are the same."""
    lm = loaded(name, "native")
    dec, cfg = lm.decoder, lm.decoder.cfg
    tokens = jnp.asarray(_expected(name)["long_ids"][:12])[None]
    prefill = jax.jit(dec.prefill, static_argnames="capacity")
    text = prefill.lower(lm.params, tokens, jnp.asarray([12]), capacity=16).as_text()
    assert text.count("jaxdecode_hf_layer") == (cfg.L if families.FAMILIES[name].native_layer else 0)
    assert (name == "smollm3") == families.FAMILIES[name].native_layer
    a = prefill(lm.params, tokens, jnp.asarray([12]), capacity=16)[0]
    b = jax.jit(dataclasses.replace(dec, fuse=False).prefill, static_argnames="capacity")(
        lm.params, tokens, jnp.asarray([12]), capacity=16)[0]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- configs


def _folder(tmp_path, name, drop=(), **changes):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    for k in drop:
        cfg.pop(k, None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.quick
def test_smollm3_layers_without_rotation_from_each_field(tmp_path):
    """``no_rope_layers`` or, without it, ``no_rope_layer_interval`` (4 by default) name the layers
    without rotation; with ``use_sliding_window``, those layers take the window; a bad list is
    refused in one line."""
    want, _ = families.read_config(FIXTURES / "smollm3")
    assert want.rotate == (True, True, True, False) and want.rope_theta == 2e6 and want.tied
    assert families.read_config(_folder(tmp_path / "a", "smollm3", ("no_rope_layers",)))[0] == want
    two = families.read_config(_folder(tmp_path / "b", "smollm3", ("no_rope_layers",), no_rope_layer_interval=2))[0]
    assert two.rotate == (True, False, True, False)
    win = families.read_config(_folder(tmp_path / "c", "smollm3", ("layer_types",), use_sliding_window=True,
                                       sliding_window=8))[0]
    assert win.windows == (None, None, None, 8)
    with pytest.raises(checkpoint.CheckpointError, match="no_rope_layers must list 1") as e:
        jaxdecode.load(_folder(tmp_path / "d", "smollm3", no_rope_layers=[1, 2, 1, 0]))
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


@pytest.mark.quick
def test_granite_multipliers_are_read_and_checked(tmp_path):
    cfg, _ = families.read_config(FIXTURES / "granite")
    assert (cfg.embed_multiplier, cfg.residual_multiplier, cfg.attn_multiplier, cfg.logits_scaling) == (
        6.0, 0.5, 0.25, 4.0)
    assert cfg.scale == 0.25 and not cfg.tied and cfg.qkv_bias and cfg.o_bias
    plain = families.read_config(_folder(tmp_path / "a", "granite", ("embedding_multiplier", "residual_multiplier",
                                                                     "attention_multiplier", "logits_scaling")))[0]
    assert (plain.embed_multiplier, plain.residual_multiplier, plain.attn_multiplier, plain.logits_scaling) == (
        1.0, 1.0, 1.0, 1.0)
    with pytest.raises(checkpoint.CheckpointError, match="logits_scaling must be a positive number") as e:
        jaxdecode.load(_folder(tmp_path / "b", "granite", logits_scaling=0))
    assert "\n" not in str(e.value)
