"""The newer Hugging Face families (Qwen3, Gemma 1-3, Phi-3, OLMo 2, Mixtral, Qwen2/3-MoE, OLMoE,
SmolLM3, Granite) against transformers' own outputs.

The references are fixtures written by ``tools/make_hf_family_fixtures.py`` with transformers
5.25 and torch (float32, eager attention): logits of three prompts and of 32 ids reaching four
times past the sliding windows, greedy ids of 80 new tokens stopping at an end token, the
log-probabilities of a fixed continuation. Neither torch nor transformers is needed here.

Kept cheap (a 2-core CI runs the whole suite): one forward per family over the prompts and the
long ids in one right-padded batch, one compiled one-token step for the cached path.
"""

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.power import pooled_chi2_power

import jaxdecode
from jaxdecode.models import checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
FAMILIES = ("qwen3", "gemma", "gemma2", "gemma3_text", "gemma3", "phi3", "olmo2", "mixtral", "qwen3_moe",
            "qwen2_moe", "olmoe", "smollm3", "granite")
MOES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe")


def expected(name):
    return json.loads((FIXTURES / name / "expected.json").read_text())


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name):
        if name not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Gemma 3's image-text folder says its vision tower is unused
                cache[name] = jaxdecode.load(FIXTURES / name)
        return cache[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_full_and_cached_equal_transformers(models, name):
    """The full forward over the three prompts and the 32 long ids (one right-padded batch), and the
    cached path one token at a time over the long ids (past every sliding window), give
    transformers' logits within 1e-4; the tokenizer gives its ids."""
    lm, ex = models(name), expected(name)
    assert lm.meta["model_type"] == name
    rows = ex["prompt_ids"] + [ex["long_ids"]]
    refs = [np.load(FIXTURES / name / f"logits_{i}.npy") for i in range(3)]
    refs.append(np.load(FIXTURES / name / "long_logits.npy"))
    width = len(ex["long_ids"])
    for prompt, ids in zip(ex["prompts"], ex["prompt_ids"]):
        assert lm.vocab.encode(prompt).tolist() == ids
    batch = jnp.asarray([r + [0] * (width - len(r)) for r in rows])
    logits, _ = jax.jit(lm.decoder.forward)(lm.params, batch)
    for i, ref in enumerate(refs):
        np.testing.assert_allclose(np.asarray(logits[i, :len(ref)]), ref, atol=1e-4, rtol=0)
    step = jax.jit(lm.decoder.extend)
    cache = lm.decoder.empty_cache(1, width)
    ids = jnp.asarray([ex["long_ids"]])
    for t in range(width):
        out, _, cache = step(lm.params, cache, ids[:, t:t + 1])
        np.testing.assert_allclose(np.asarray(out[0, 0]), refs[3][t], atol=1e-4, rtol=0, err_msg=f"{name} {t}")


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_ids_and_end_token_equal_transformers(models, name):
    """80 greedy tokens for the three ragged prompts in one batch: generate's ids are transformers'
    ``generate``'s, ending at the same end token (finish_reason "eos")."""
    lm, ex = models(name), expected(name)
    outs = jaxdecode.generate(lm, ex["prompts"], n=80, greedy=True)
    assert ex["greedy_eos_0"]
    for i, out in enumerate(outs):
        assert out.tokens.tolist() == ex[f"greedy_{i}"], (name, i)
        assert out.finish_reason == ("eos" if ex[f"greedy_eos_{i}"] else "length")


@pytest.mark.parametrize("name", FAMILIES)
def test_continuation_logprobs_equal_transformers(models, name):
    lm, ex = models(name), expected(name)
    s = jaxdecode.score(lm, [ex["continuation"]], prompts=[ex["prompts"][0]])[0]
    np.testing.assert_allclose(s.logprobs, ex["continuation_logprobs"], atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- sampling

# one family of each new kind, and the wrong implementation the test must catch (power > 0.99;
# docs/statistical_tests.md): soft-capping dropped, q/k norms dropped, the router's top-2 weights
# not renormalized
KINDS = {"gemma2": {"final_softcap": None}, "olmo2": {"qk_norm": ""}, "mixtral": {"norm_topk": False}}
DRAWS = 5000


def _first_token(lm, ids, cfg=None):
    """The first token's distribution, float64 [V], of the decoder (with ``cfg`` if given)."""
    dec = lm.decoder if cfg is None else dataclasses.replace(lm.decoder, cfg=cfg)
    logits, _ = jax.jit(dec.forward)(lm.params, jnp.asarray([ids]))
    lg = np.asarray(logits[0, -1], np.float64)
    p = np.exp(lg - lg.max())
    return p / p.sum()


@pytest.mark.parametrize("name", list(KINDS))
def test_sampled_first_token_matches_transformers_distribution(models, name):
    """5,000 first tokens sampled after prompt 0 match the softmax of transformers' logits
    (chi-square, cells expected below 5 pooled, p > 0.001); the test has power > 0.99 at that
    level against the family's named wrong implementation."""
    from jaxdecode.eval import exact as E

    lm, ex = models(name), expected(name)
    ref = np.load(FIXTURES / name / "logits_0.npy")[-1].astype(np.float64)
    exact = np.exp(ref - ref.max())
    exact /= exact.sum()
    wrong = _first_token(lm, ex["prompt_ids"][0], dataclasses.replace(lm.decoder.cfg, **KINDS[name]))
    order = np.argsort(exact, kind="stable")
    power = pooled_chi2_power(exact[order], wrong[order], DRAWS, 0.0)[0]
    assert power > 0.99, power
    outs = jaxdecode.generate(lm, ex["prompts"][0], n=1, num_samples=DRAWS, seed=21)
    counts = np.bincount([int(o.tokens[0]) for o in outs], minlength=lm.decoder.V)
    got = {(t,): int(c) for t, c in enumerate(counts) if c}
    p = E.chisquare_pvalue(got, {(t,): float(q) for t, q in enumerate(exact) if q > 0})
    assert p > 1e-3, p


# ----------------------------------------------------------------------------- engines and experts


def test_engines_dense_and_paged_serve_generate(models):
    """The continuous engine on Gemma 3 (sliding layers with their own rope base, a global one),
    with the dense cache and the paged pool (blocks of 8, the window's size): transformers' greedy
    ids for each prompt, ending at the same end token."""
    from jaxdecode.serving.engine import Engine
    from jaxdecode.serving.requests import Request

    lm, ex = models("gemma3_text"), expected("gemma3_text")
    reqs = [Request(p, 80, greedy=True) for p in ex["prompts"]]
    for engine in (Engine(lm, 4), Engine(lm, 4, cache="paged", block_size=8)):
        report = engine.run(reqs)
        for i, res in enumerate(report.results):
            assert res.outputs[0].tokens.tolist() == ex[f"greedy_{i}"], i
            assert res.outputs[0].finish_reason == ("eos" if ex[f"greedy_eos_{i}"] else "length")


@pytest.mark.quick
@pytest.mark.parametrize("name", MOES)
def test_gathered_experts_equal_all_experts(models, name):
    """The two ways of computing a mixture layer (only the chosen experts, gathered; every expert
    with zero weight off the chosen ones) agree on 12 tokens."""
    from jaxdecode.models.hf import moe

    lm = models(name)
    cfg = lm.decoder.cfg
    layer = next(i for i in range(cfg.L) if cfg.is_moe(i))
    h = jax.random.normal(jax.random.PRNGKey(0), (2, 6, cfg.d))
    p = lm.params["layers"][layer]
    a = moe.moe_mlp(cfg, p, h, jax.nn.silu, how="gather")
    b = moe.moe_mlp(cfg, p, h, jax.nn.silu, how="dense")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- configs


def _copy(tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _edit(folder, drop=(), **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    for k in drop:
        cfg.pop(k, None)
    (folder / "config.json").write_text(json.dumps(cfg))


REFUSED = [
    ("phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     ("rope_parameters",), r"rope_scaling: rope scaling of type 'longrope' is not supported"),
    ("gemma3_text", {"use_bidirectional_attention": True}, (), "use_bidirectional_attention=true"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, (),
     "use_sliding_window=true is not supported for qwen3_moe"),
    ("qwen3", {"partial_rotary_factor": 0.5}, (), r"partial_rotary_factor=0.5 is not supported for qwen3"),
    ("gemma2", {"layer_types": ["full_attention"]}, (), "layer_types must list"),
    ("mixtral", {"num_experts_per_tok": 9}, (), "num_experts_per_tok=9 exceeds the 4 experts"),
]


@pytest.mark.quick
@pytest.mark.parametrize("name,changes,drop,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_options_not_implemented_are_refused_in_one_line(tmp_path, name, changes, drop, message):
    f = _copy(tmp_path, name)
    _edit(f, drop, **changes)
    with pytest.raises(checkpoint.CheckpointError, match=message) as e:
        jaxdecode.load(f)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_legacy_config_fields_give_the_same_layers(tmp_path):
    """Older config.json fields transformers still reads: Gemma 3's ``sliding_window_pattern`` and
    ``rope_local_base_freq``/``rope_theta`` without ``layer_types``/``rope_parameters``; Qwen3's
    windows from ``max_window_layers``; the image-text Gemma 3 says its vision tower is unused."""
    from jaxdecode.models.hf import read_config

    want, _ = read_config(FIXTURES / "gemma3_text")
    f = _copy(tmp_path, "gemma3_text")
    _edit(f, ("layer_types", "rope_parameters", "_sliding_window_pattern"), sliding_window_pattern=3,
          rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert read_config(f)[0] == want
    q = _copy(tmp_path, "qwen3")
    _edit(q, ("layer_types",), max_window_layers=1)
    assert read_config(q)[0] == read_config(FIXTURES / "qwen3")[0]
    with pytest.warns(UserWarning, match="the vision tower is left unused"):
        lm = jaxdecode.load(FIXTURES / "gemma3")
    assert "vision tower" in lm.meta["note"] and lm.decoder.cfg.windows == want.windows


# ----------------------------------------------------------------------------- generation_config.json


def test_generation_config_defaults_apply_where_the_user_sets_none(models, capsys):
    """Qwen3's folder ships sampling defaults (temperature 0.6, top-k 20, top-p 0.95): generate
    and the command line use them when no setting is given, a user's flag wins field by field,
    ``generation_config=False``/``--no-generation-config`` turns them off, and ``info`` lists them."""
    from jaxdecode import rules
    from jaxdecode.cli.app import main
    from jaxdecode.decoding.common import default_settings

    lm = models("qwen3")
    assert lm.generation_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}

    def run(**kw):
        return [o.tokens.tolist() for o in jaxdecode.generate(lm, "The café is", n=6, num_samples=4, seed=3, **kw)]

    folder_rule = rules.make_rule(temperature=0.6, top_k=20, top_p=0.95)
    assert run() == run(rule=folder_rule) != run(generation_config=False)
    folder = str(FIXTURES / "qwen3")
    base = ["generate", "The café is", "--ckpt", folder, "-n", "4", "--json"]
    for extra, want in (([], {"temperature": 0.6, "top_k": 20, "top_p": 0.95}),
                        (["--top-k", "5"], {"temperature": 0.6, "top_k": 5, "top_p": 0.95}),
                        (["--no-generation-config"], {})):
        assert main(base + extra) == 0
        settings = json.loads(capsys.readouterr().out)["settings"]
        assert {k: settings.get(k) for k in want} == want and settings["greedy"] is False, extra
        assert extra != ["--no-generation-config"] or "temperature" not in settings
    assert main(["info", folder, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["provenance"]["generation_defaults"] == lm.generation_defaults
    # a folder with do_sample false: greedy with its penalty, unless the user asks for sampling
    greedy_folder = dataclasses.replace(lm, generation_defaults={"greedy": True, "repetition_penalty": 1.2})
    assert default_settings(greedy_folder) == ({"repetition_penalty": 1.2}, True)
    assert default_settings(greedy_folder, {"temperature": 0.8}) == (
        {"repetition_penalty": 1.2, "temperature": 0.8}, False)
    assert default_settings(greedy_folder, {}, True) == ({}, True)
    assert default_settings(greedy_folder, {}, False, use_defaults=False) == ({}, False)


@pytest.mark.parametrize("body,message", [({"top_p": 1.5}, "top_p"), ({"temperature": -1.0}, "temperature")])
def test_a_bad_generation_config_is_refused_in_one_line(tmp_path, body, message):
    f = _copy(tmp_path, "olmo2")
    (f / "generation_config.json").write_text(json.dumps({"eos_token_id": 91, "do_sample": True, **body}))
    with pytest.raises(checkpoint.CheckpointError, match=f"generation_config.json: .*{message}") as e:
        jaxdecode.load(f)
    assert "\n" not in str(e.value)
