"""Tensor and expert parallelism on a ("data", "model") mesh, against one device.

JAX reads the number of CPU devices when its backend starts, so the cases run in one process of
their own on 8 forced CPU devices (``tests/support/mesh_cases.py``, which prints JSON); this process keeps
its single device. The cases: for the Hugging Face fixtures of each kind (dense with grouped-query
attention, a sliding window, Gemma 2's soft-capping, a mixture of experts) and the character
model, greedy tokens and logits of the cached path on model axes 2, 8 and a 2 x 4 mesh (Llama also on 4);
``generate`` greedy and seeded, also with the rows split over "data"; beam search, scoring,
contrastive and speculative decoding and the engine on both caches on a model axis; what each
device holds (``addressable_shards``) and the collectives of the compiled decode step.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "mistral", "gemma2", "mixtral", "charlm")
MESHES = {"llama": ("1x2", "1x4", "1x8", "2x4")}  # every other family: model axes 2 and 8, and 2 x 4
# two processes of about equal work, run side by side (each compiles on one core)
CASES = ([f"family:{f}" for f in FAMILIES],
         ["generate:llama", "loops:llama-draft", "layout:llama:2", "layout:llama:4", "layout:mixtral:2"])


# what CI runs of them (the rest in the full suite): a dense and a mixture-of-experts model on every
# mesh, what each device holds at M = 2, and the collectives of their compiled decode steps
CI_CASES = ["family:llama", "family:mixtral", "layout:llama:2", "layout:mixtral:2"]


def _run(groups) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, str(TESTS / "support" / "mesh_cases.py"), *cases], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=TESTS.parent) for cases in groups]
    out = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-4000:]
        out |= json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def results():
    return _run(CASES)


@pytest.fixture(scope="module")
def ci_results():
    return _run([CI_CASES])


def test_dense_and_expert_models_on_a_model_axis(ci_results):
    """CI's share of this file, through the full suite's checks: Llama (grouped-query attention) on
    model axes 2, 4 and 8 and a 2 x 4 mesh, Mixtral on 2, 8 and 2 x 4 equal one device; each
    device holds its share at M = 2; two all-reduces a layer, and the experts' one."""
    for family in ("llama", "mixtral"):
        test_greedy_and_logits_equal_one_device(ci_results, family)
    for case in ("layout:llama:2", "layout:mixtral:2"):
        test_each_device_holds_its_share(ci_results, case, 2)
    test_decode_step_two_all_reduces_per_layer(ci_results)
    test_experts_split_with_one_all_reduce_of_their_sum(ci_results)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_and_logits_equal_one_device(results, family):
    """Every mesh gives one device's greedy tokens, and its logits within float32 rounding of the
    all-reduces' order (1e-5 of the logits' scale)."""
    got = results[f"family:{family}"]
    for mesh in MESHES.get(family, ("1x2", "1x8", "2x4")):
        assert got[mesh]["greedy"] == got["ref"], f"{family} on {mesh}"
        assert got[mesh]["logits"] <= 1e-5 * max(1.0, got["scale"]), f"{family} on {mesh}: {got[mesh]['logits']}"


@pytest.mark.slow
def test_generate_greedy_and_seeded_on_model_and_data_axes(results):
    got = results["generate:llama"]
    assert got["2x4"] == got["ref"]  # rows split over "data" by the loop, parameters over "model"


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["beam", "score", "contrastive", "speculative", "engine_dense", "engine_paged"])
def test_loops_on_a_model_axis_equal_one_device(results, loop):
    got = results["loops:llama-draft"][loop]
    assert "error" not in got, got.get("error")
    assert got["got"] == got["ref"]


def _replicated(cfg, M):
    """The bytes the rules leave whole on every device (float32): the norms (two a layer and the
    final one), a mixture's routers, and k and v where M does not divide the key/value heads."""
    L, d, hd, KV, E = cfg["L"], cfg["d"], cfg["head_dim"], cfg["kv_heads"], cfg["experts"] or 0
    n = (2 * L + 1) * d + L * d * E
    if KV % M:
        n += 2 * L * d * KV * hd
    return 4 * n


@pytest.mark.slow
@pytest.mark.parametrize("case,M", [("layout:llama:2", 2), ("layout:llama:4", 4), ("layout:mixtral:2", 2)])
def test_each_device_holds_its_share(results, case, M):
    """Per-device parameter bytes (addressable_shards) within 2% of total / M plus the parameters
    the rules replicate (worked out here from the config)."""
    got = results[case]
    b, rep = got[str(M)]["bytes"], _replicated(got["cfg"], M)
    expect = (b["total"] - rep) / M + rep
    assert len(b["per_device"]) == M
    for held in b["per_device"]:
        assert abs(held - expect) <= 0.02 * expect, (held, expect)


def _kinds(collectives, kind):
    return {shape: n for key, n in collectives.items() for k, shape in [key.split(" ", 1)] if k == kind}


@pytest.mark.slow
def test_decode_step_two_all_reduces_per_layer(results):
    """Dense Llama, heads and key/value heads split (M=2): one all-reduce for the embedding's
    lookup, two per layer (after o, after down), each over B x d values; nothing gathered."""
    got = results["layout:llama:2"]
    L, d = got["cfg"]["L"], got["cfg"]["d"]
    step = got["2"]["collectives"]
    assert _kinds(step, "all-reduce") == {f"f32[2,1,{d}]{{2,1,0}}": 2 * L + 1}
    assert set(k.split()[0] for k in step) == {"all-reduce"}
    assert got["1"]["collectives"] == {}


@pytest.mark.slow
def test_decode_step_never_gathers_a_weight(results):
    """M=4 with 2 key/value heads: k and v are replicated (each device computes both heads), the
    query heads split; still 2 all-reduces a layer, and anything gathered is a new position's
    keys or values, never a weight matrix."""
    got = results["layout:llama:4"]
    L, d = got["cfg"]["L"], got["cfg"]["d"]
    step = got["4"]["collectives"]
    assert sum(_kinds(step, "all-reduce").values()) == 2 * L + 1
    for shape in _kinds(step, "all-gather"):
        dims = [int(x) for x in shape.split("[")[1].split("]")[0].split(",")]
        assert int(np.prod(dims)) < d * d // 4, shape  # smaller than any weight matrix of the model


@pytest.mark.slow
def test_experts_split_with_one_all_reduce_of_their_sum(results):
    """Mixtral with its 4 experts over a model axis of 2: each device holds half of them, and the
    compiled step holds the expert-parallel collective, one all-reduce of the combined experts'
    output per MoE layer ([tokens, d], the layer's flattened rows), beside the attention's."""
    got = results["layout:mixtral:2"]
    L, d = got["cfg"]["L"], got["cfg"]["d"]
    reduces = _kinds(got["2"]["collectives"], "all-reduce")
    assert reduces.get(f"f32[2,{d}]{{1,0}}") == L  # the experts' sum, one per layer
    assert reduces.get(f"f32[2,1,{d}]{{2,1,0}}") == L + 1  # after o, and the embedding


# ----------------------------------------------------------------------------- in this process

@pytest.mark.quick
def test_make_mesh_shapes_and_errors():
    import jax

    from jaxdecode.decoding.placement import make_mesh

    assert make_mesh().axis_names == ("data",)  # the default: every device on the batch axis
    mesh = make_mesh(data=1, model=1)
    assert mesh.axis_names == ("data", "model") and dict(mesh.shape) == {"data": 1, "model": 1}
    with pytest.raises(ValueError, match="does not cover the 1 devices"):
        make_mesh(data=2, model=4)
    with pytest.raises(ValueError, match="model must be a positive integer"):
        make_mesh(model=0)
    assert make_mesh(jax.devices(), model=1).devices.shape == (1, 1)


@pytest.mark.quick
def test_partition_rules_split_whole_heads_only():
    """The rules on the Llama fixture's shape (4 heads, 2 key/value heads, FFN 128, vocabulary
    448): what M divides is split, the rest replicated; o and down by rows; scales with columns."""
    from jax.sharding import PartitionSpec as P

    from jaxdecode.models.hf import sharding
    from jaxdecode.models.hf.config import HFConfig  # noqa: F401 (the fixture's config type)
    from jaxdecode.models.hf.families import read_config

    cfg, _ = read_config(TESTS / "fixtures" / "hf" / "llama")
    layer = {"wq": np.zeros((64, 64)), "wk": np.zeros((64, 32)), "wo": np.zeros((64, 64)),
             "w_down": {"q": np.zeros((128, 64), np.int8), "scale": np.zeros(64)},
             "w_up": {"q": np.zeros((64, 128), np.int8), "scale": np.zeros(128)}, "norm1_w": np.zeros(64)}
    params = {"embed": np.zeros((448, 64)), "layers": (layer,)}
    two = sharding.param_specs(params, cfg, 2)
    assert two["embed"] == P("model", None)
    got = two["layers"][0]
    assert (got["wq"], got["wk"], got["wo"], got["norm1_w"]) == (P(None, "model"), P(None, "model"),
                                                                 P("model", None), P(None))
    assert got["w_up"] == {"q": P(None, "model"), "scale": P("model")}
    assert got["w_down"] == {"q": P("model", None), "scale": P(None)}
    four = sharding.param_specs(params, cfg, 4)["layers"][0]
    assert four["wk"] == P(None, None) and four["wq"] == P(None, "model")  # 2 key/value heads on 4
    eight = sharding.param_specs(params, cfg, 8)["layers"][0]
    assert eight["wq"] == P(None, None) and eight["w_up"]["q"] == P(None, "model")  # 4 heads on 8
    assert sharding.cache_spec(cfg, 2) == P(None, "model", None, None)
    assert sharding.cache_spec(cfg, 4) == P(None, None, None, None)
    with pytest.raises(sharding.ShardingError, match="'mystery' has no sharding rule"):
        sharding.param_specs({"mystery": np.zeros(3), "layers": ()}, cfg, 2)


def test_native_backend_with_a_mesh_is_refused():
    import jaxdecode
    from jaxdecode.decoding.placement import make_mesh
    from jaxdecode.models.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="native CPU layer runs on one device"):
        jaxdecode.load(TESTS / "fixtures" / "hf" / "llama", backend="native", mesh=make_mesh(data=1, model=1))
    lm = jaxdecode.load(TESTS / "fixtures" / "hf" / "llama", mesh=make_mesh(data=1, model=1))
    assert lm.decoder.backend == "portable" and lm.meta["mesh"] == {"data": 1, "model": 1}
