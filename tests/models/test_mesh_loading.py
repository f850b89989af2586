"""Loading a Hugging Face folder onto a mesh by slices (jaxdecode.models.hf.sliced).

Each device's slice is read from the safetensors files: the host never holds a split matrix
whole. Measured in processes of their own on 8 forced CPU devices (tests/support/mesh_loading.py): the
resident high-water mark while loading a synthetic Llama of about 220 MB onto a model axis of 8,
against loading it on one device and then splitting it; every read's bytes (no read of a split
matrix whole); and the parameters equal, bit for bit, to one device's load then split, for every
kind of folder and way of keeping the matrices. In this process: where each parameter of a
fused tensor lies, and a bad slice refused in one line.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parents[1]
LLAMA = TESTS / "fixtures" / "hf" / "llama"
ALLOWANCE = 16 * 2**20  # the runtime's own allocations (measured growth: the parameters plus 17 to 19 MB)
WAYS = 8


def synthetic_llama(folder: Path) -> None:
    """A Llama folder of about 220 MB of random float32 weights (the fixture's tokenizer): every
    matrix splits over 8 devices (8 heads, 8 key/value heads, 2,816 FFN units, 8,192 tokens)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    cfg = json.loads((LLAMA / "config.json").read_text())
    d, F, L, V, H = 1024, 2816, 3, 8192, 8
    cfg.update(hidden_size=d, intermediate_size=F, num_hidden_layers=L, vocab_size=V, num_attention_heads=H,
               num_key_value_heads=H, head_dim=d // H)
    (folder / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(LLAMA / name, folder / name)
    rng = np.random.default_rng(0)
    w = lambda *shape: (rng.random(shape, np.float32) - 0.5) * 0.04
    tensors = {"model.embed_tokens.weight": w(V, d), "lm_head.weight": w(V, d),
               "model.norm.weight": np.ones(d, np.float32)}
    for i in range(L):
        h = f"model.layers.{i}."
        tensors |= {h + f"self_attn.{m}_proj.weight": w(d, d) for m in "qkvo"}
        tensors |= {h + "mlp.gate_proj.weight": w(F, d), h + "mlp.up_proj.weight": w(F, d),
                    h + "mlp.down_proj.weight": w(d, F), h + "input_layernorm.weight": np.ones(d, np.float32),
                    h + "post_attention_layernorm.weight": np.ones(d, np.float32)}
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mesh_loading") / "llama-220mb"
    synthetic_llama(folder)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    args = {"sharded": [str(folder), "sharded", "equal"], "whole": [str(folder), "whole"]}
    procs = {k: subprocess.Popen([sys.executable, str(TESTS / "support" / "mesh_loading.py"), *a], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env, cwd=TESTS.parent)
             for k, a in args.items()}
    out = {}
    for k, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-4000:]
        out[k] = json.loads(stdout.strip().splitlines()[-1])
    return out


def bound(run: dict) -> int:
    return run["model_bytes"] + max(run["tensors"].values()) + ALLOWANCE


@pytest.mark.slow
def test_sharded_load_holds_at_most_the_model_and_one_matrix(runs):
    """The resident growth while loading onto a model axis of 8 stays under the parameters' bytes
    plus the largest matrix (plus a small allowance); loading on one device and then splitting,
    which holds every tensor on the host before placing it, goes far over the same bound."""
    sharded, whole = runs["sharded"], runs["whole"]
    assert sharded["device_bytes"] <= sharded["model_bytes"] + 2**20  # only the norms are replicated
    assert sharded["growth"] <= bound(sharded), (sharded["growth"], bound(sharded))
    assert whole["growth"] > bound(whole), (whole["growth"], bound(whole))


@pytest.mark.slow
def test_no_split_matrix_is_read_whole(runs):
    """Every matrix (all split over the 8 devices here) is read in slices of an eighth of it at
    most, and each of its bytes once."""
    reads, tensors = runs["sharded"]["reads"], runs["sharded"]["tensors"]
    matrices = {k: n for k, n in tensors.items() if "norm" not in k}
    assert len(matrices) == 2 + 7 * 3
    for name, nbytes in matrices.items():
        assert max(reads[name]) <= nbytes // WAYS, (name, max(reads[name]), nbytes)
        assert sum(reads[name]) == nbytes, (name, sum(reads[name]), nbytes)


@pytest.mark.slow
def test_sharded_load_equals_one_device_then_split(runs):
    """Dense, sliding-window, soft-capped, mixture-of-experts, fused (Phi-3, GPT-2), indexed and
    quantized folders; float32, bfloat16 and float16 storage kept, rounded to bfloat16 or int8:
    the same values, dtypes and shardings on model axes of 8 and 2."""
    equal = runs["sharded"]["equal"]
    assert len(equal) == 15
    assert {k: v for k, v in equal.items() if v} == {}


class Held:
    """One tensor in memory standing for a folder's files (:class:`jaxdecode.models.hf.sliced.Files`)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def get(self, path):
        return self

    def get_slice(self, name):
        return self.tensor


@pytest.mark.quick
@pytest.mark.parametrize("family", ["phi3", "gpt2", "llama"])
def test_each_part_of_a_tensor_is_where_the_reader_split_puts_it(family):
    """Every parameter's :class:`Piece` reads, at any device's index, what the reader's own split
    of the whole tensor holds there (fused q/k/v and gate/up, transposed or not, 1-D biases)."""
    from jaxdecode.models.hf import read_config, sliced
    from jaxdecode.models.hf.weights import split_tensor, tensor_table

    cfg, _ = read_config(TESTS / "fixtures" / "hf" / family)
    rng = np.random.default_rng(1)
    tables = [(k, v) for k, v in tensor_table(cfg).items() if v[1] in (None, 0) and "/" not in v[0]]
    assert any(how in ("qkv", "Tqkv", "Tgu") for _, (_, _, how, _) in tables) or family == "llama"
    for name, (param, _, how, shape) in tables:
        tensor = rng.standard_normal(shape).astype(np.float32)


        whole = dict(split_tensor(cfg, param, how, tensor))
        got = sliced.pieces(cfg, param, how, shape, Path("x"), name)
        assert [p for p, _ in got] == list(whole)
        for pname, piece in got:
            want = whole[pname]
            assert piece.shape == want.shape
            index = tuple(slice(n // 3, n - n // 4) for n in want.shape)
            got_slice = piece.read(Held(tensor), index)
            np.testing.assert_array_equal(got_slice, want[index], err_msg=f"{name} {pname}")


@pytest.mark.quick
def test_a_bad_slice_is_refused_in_one_line(tmp_path):
    """A NaN in a matrix read by slices is refused naming the file and the tensor."""
    from safetensors.numpy import load_file, save_file

    import jaxdecode
    from jaxdecode.decoding.placement import make_mesh
    from jaxdecode.models.checkpoint import CheckpointError

    folder = tmp_path / "llama"
    shutil.copytree(LLAMA, folder)
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        jaxdecode.load(folder, mesh=make_mesh(data=1, model=1))
    msg = str(e.value)
    assert "\n" not in msg and "model.layers.1.mlp.down_proj.weight" in msg and "NaN" in msg
    assert str(folder / "model.safetensors") in msg


def test_int4_on_a_mesh_is_refused_in_one_line():
    """int4 matrices run on one device: a load onto a mesh, or a split, says so in one line."""
    import jaxdecode
    from jaxdecode.decoding.placement import make_mesh
    from jaxdecode.models.checkpoint import CheckpointError
    from jaxdecode.models.hf.sharding import ShardingError

    mesh = make_mesh(data=1, model=1)
    with pytest.raises(CheckpointError, match="weights='int4' runs on one device"):
        jaxdecode.load(LLAMA, weights="int4", mesh=mesh)
    lm = jaxdecode.load(LLAMA, weights="int4", backend="portable")
    with pytest.raises(ShardingError, match="kept in a form that runs on one device"):
        lm.shard(mesh)
