"""Checkpoint folders, the safe .pt converter and their error messages.

``fixtures/book_tiny.pt`` and ``fixtures/book_tiny_logits.npz`` come from
``scripts/make_torch_fixture.py`` (PyTorch); nothing here imports torch. Malicious and
malformed .pt files are written with the standard library by :func:`write_torch_zip`, which lays
out a zip archive and a protocol-2 pickle the way ``torch.save`` does.
"""

from __future__ import annotations

import json
import pickle
import shutil
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode import checkpoint as C
from jaxdecode.cli import main
from jaxdecode.model import ModelConfig, forward
from jaxdecode.vocab import UnknownCharacterError, Vocab

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BOOK_PT = FIXTURES / "book_tiny.pt"
BOOK_LOGITS = FIXTURES / "book_tiny_logits.npz"
CHARS = " abcdefghi.\n"


# ----------------------------------------------------------------------------- a torch.save look-alike

class _Global:
    """A global written into the pickle as ``module name`` without importing anything."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):  # pickle insists that a reduce function be callable
        raise AssertionError("placeholder only")


class _Call:
    """Pickles as ``module.name(*args)``: the opcodes GLOBAL, args, REDUCE."""

    def __init__(self, module: str, name: str, *args):
        self.fn, self.args = _Global(module, name), args

    def __reduce__(self):
        return self.fn, self.args


class _Storage:
    def __init__(self, key: str, array: np.ndarray):
        self.key, self.array = key, np.ascontiguousarray(array, dtype="<f4").reshape(-1)


class _Tensor:
    """A float32 tensor, pickled like torch's ``_rebuild_tensor_v2(storage, offset, size, stride, ...)``."""

    def __init__(self, storage: _Storage, shape, offset: int = 0, stride=None):
        self.storage, self.shape, self.offset = storage, tuple(shape), offset
        if stride is None:
            stride = tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))
        self.stride = tuple(stride)

    def __reduce__(self):
        return (_Global("torch._utils", "_rebuild_tensor_v2"),
                (self.storage, self.offset, self.shape, self.stride, False, OrderedDict()))


class _TorchLikePickler(pickle._Pickler):
    dispatch: ClassVar[dict] = dict(pickle._Pickler.dispatch)

    def _save_global_placeholder(self, obj: _Global):
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))
        self.memoize(obj)

    dispatch[_Global] = _save_global_placeholder

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", _Global("torch", "FloatStorage"), obj.key, "cpu", obj.array.size)
        return None


def _storages(obj, found):
    if isinstance(obj, _Storage):
        found[obj.key] = obj
    elif isinstance(obj, _Tensor):
        _storages(obj.storage, found)
    elif isinstance(obj, _Call):
        _storages(obj.args, found)
    elif isinstance(obj, dict):
        for v in obj.values():
            _storages(v, found)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storages(v, found)
    return found


def write_torch_zip(path: Path, obj, prefix: str = "archive") -> Path:
    """Write ``obj`` as torch.save would: ``<prefix>/data.pkl`` plus one ``<prefix>/data/<key>`` per storage."""
    import io

    buf = io.BytesIO()
    _TorchLikePickler(buf, protocol=2).dump(obj)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{prefix}/data.pkl", buf.getvalue())
        z.writestr(f"{prefix}/byteorder", "little")
        for key, s in _storages(obj, {}).items():
            z.writestr(f"{prefix}/data/{key}", s.array.tobytes())
        z.writestr(f"{prefix}/version", "3\n")
    return path


def torch_like_state(state: dict[str, np.ndarray]) -> OrderedDict:
    """Tensors of a state dict, one storage each (tied names share one, as in torch)."""
    out, by_id = OrderedDict(), {}
    for i, (name, a) in enumerate(state.items()):
        s = by_id.setdefault(id(a), _Storage(str(i), a))
        out[name] = _Tensor(s, a.shape)
    return out


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def book_state():
    """The fixture's state dict as numpy arrays (tok.weight and out.weight share one array)."""
    sd = C.read_torch_checkpoint(BOOK_PT)["state_dict"]
    sd["out.weight"] = sd["tok.weight"]
    return sd


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return C.convert(BOOK_PT, tmp_path_factory.mktemp("conv") / "book_tiny")


@pytest.fixture
def folder(converted, tmp_path):
    """A private copy of the converted folder, free to damage."""
    return Path(shutil.copytree(converted, tmp_path / "ckpt"))


def _edit_config(folder: Path, **changes):
    cfile = folder / C.CONFIG_FILE
    config = json.loads(cfile.read_text(encoding="utf-8"))
    config.update(changes)
    cfile.write_text(json.dumps(config), encoding="utf-8")


def _book_obj(state_dict, config=None, chars=CHARS):
    return {"config": config or {"V": 12, "T": 16, "d": 32, "L": 2, "heads": 4},
            "chars": list(chars), "state_dict": state_dict}


# ----------------------------------------------------------------------------- conversion

def test_converted_logits_match_torch(converted):
    lm = C.load(converted)
    assert (lm.cfg.V, lm.cfg.T, lm.cfg.d, lm.cfg.L, lm.cfg.heads) == (12, 16, 32, 2, 4)
    assert lm.vocab.chars == CHARS
    assert lm.meta["converted_from"] == BOOK_PT.name
    ref = np.load(BOOK_LOGITS)
    lengths = sorted(int(k.split("_")[1]) for k in ref.files if k.startswith("input_"))
    assert lengths[0] == 1 and lm.cfg.T in lengths and lengths[-1] > lm.cfg.T
    fwd = jax.jit(forward, static_argnums=1)  # one compile per length beats op-by-op dispatch
    for n in lengths:
        tokens, want = ref[f"input_{n}"], ref[f"logits_{n}"]
        got = np.asarray(fwd(lm.params, lm.cfg, jnp.asarray(tokens, jnp.int32)))
        assert got.shape == want.shape == (1, min(n, lm.cfg.T), lm.cfg.V)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"input of length {n}")


def test_converted_folder_holds_torch_names(converted, book_state):
    from safetensors.numpy import load_file

    lm = C.load(converted)
    stored = load_file(str(converted / C.WEIGHTS_FILE))
    assert set(stored) == set(C.expected_shapes(lm.cfg))  # no out.weight, no mask
    for name, a in stored.items():
        np.testing.assert_array_equal(a, book_state[name], err_msg=name)
    assert sum(a.size for a in jax.tree_util.tree_leaves(lm.params)) == lm.num_params


def test_save_load_round_trip_is_exact(converted, tmp_path):
    lm = C.load(converted)
    meta = dict(lm.meta, steps=1234, val_loss=1.5, loss_curve=[[0, 2.5], [100, 1.9]])
    out = C.save(tmp_path / "rt", lm.params, lm.cfg, lm.vocab, meta=meta)
    back = C.load(out)
    assert back.cfg == lm.cfg
    assert back.vocab.chars == lm.vocab.chars
    assert back.meta == meta
    a_leaves, a_tree = jax.tree_util.tree_flatten(lm.params)
    b_leaves, b_tree = jax.tree_util.tree_flatten(back.params)
    assert a_tree == b_tree
    for a, b in zip(a_leaves, b_leaves):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert [p.name for p in tmp_path.iterdir()] == ["rt"]  # no temporary folder left


def test_stdlib_writer_reproduces_the_fixture(book_state, tmp_path, converted):
    # positive control for the malicious-file tests: the same layout without the bad global converts
    pt = write_torch_zip(tmp_path / "clean.pt", _book_obj(torch_like_state(book_state)))
    out = C.convert(pt, tmp_path / "clean")
    a, b = C.load(out), C.load(converted)
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_array_equal(x, y)


def test_convert_refuses_to_overwrite(converted, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(C.CheckpointError, match="already exists"):
        C.convert(BOOK_PT, target)
    assert (target / "keep.txt").read_text() == "mine"
    C.convert(BOOK_PT, target, overwrite=True)
    assert not (target / "keep.txt").exists()
    assert C.load(target).cfg == C.load(converted).cfg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ----------------------------------------------------------------------------- clear errors

def test_unknown_character_names_each_and_its_position():
    v = Vocab(CHARS)
    with pytest.raises(UnknownCharacterError) as e:
        v.encode("abZ c!d")
    msg = str(e.value)
    assert "'Z' at position 2" in msg and "'!' at position 5" in msg
    assert e.value.unknown == [(2, "Z"), (5, "!")]
    assert isinstance(e.value, ValueError)


def test_truncated_safetensors(folder):
    w = folder / C.WEIGHTS_FILE
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(C.CheckpointError, match="corrupt or truncated") as e:
        C.load(folder)
    assert C.WEIGHTS_FILE in str(e.value)


@pytest.mark.parametrize("garbage", [
    b"\xff" * 64,                                   # absurd header length
    (20).to_bytes(8, "little") + b"{not json at all!!!" + b"\0" * 40,  # header is not JSON
    b"",                                            # empty file
], ids=["huge-header", "bad-json-header", "empty"])
def test_garbage_safetensors(folder, garbage):
    (folder / C.WEIGHTS_FILE).write_bytes(garbage)
    with pytest.raises(C.CheckpointError, match="corrupt or truncated") as e:
        C.load(folder)
    assert C.WEIGHTS_FILE in str(e.value)


@pytest.mark.parametrize("change, named", [
    ({"d": 16}, ["tok.weight", "(12, 32)", "(12, 16)"]),
    ({"T": 8}, ["pos.weight", "(16, 32)", "(8, 32)"]),
    ({"L": 1}, ["unexpected", "blocks.layers.1.linear1.weight"]),
    ({"L": 3}, ["missing", "blocks.layers.2.self_attn.in_proj_weight"]),
], ids=["d", "T", "fewer-layers", "more-layers"])
def test_config_disagrees_with_tensors(folder, change, named):
    _edit_config(folder, **change)
    with pytest.raises(C.CheckpointError) as e:
        C.load(folder)
    for s in named:
        assert s in str(e.value)


def test_missing_tensor_is_named(folder):
    from safetensors.numpy import load_file, save_file

    w = folder / C.WEIGHTS_FILE
    state = load_file(str(w))
    del state["blocks.layers.1.norm2.bias"]
    save_file(state, str(w))
    with pytest.raises(C.CheckpointError, match=r"missing tensor\(s\) blocks\.layers\.1\.norm2\.bias"):
        C.load(folder)


def test_corrupt_config_json(folder):
    (folder / C.CONFIG_FILE).write_text('{"V": 12, "T": 16,', encoding="utf-8")
    with pytest.raises(C.CheckpointError, match="not valid JSON") as e:
        C.load(folder)
    assert C.CONFIG_FILE in str(e.value)


def test_config_lacks_a_field(folder):
    cfile = folder / C.CONFIG_FILE
    config = json.loads(cfile.read_text(encoding="utf-8"))
    del config["heads"]
    cfile.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(C.CheckpointError, match="lacks field 'heads'"):
        C.load(folder)


def test_V_disagrees_with_chars(folder):
    _edit_config(folder, V=13)
    with pytest.raises(C.CheckpointError, match="V=13 but 'chars' has 12 characters"):
        C.load(folder)


def test_pt_V_disagrees_with_chars(book_state, tmp_path):
    pt = write_torch_zip(tmp_path / "b.pt", _book_obj(torch_like_state(book_state), chars=CHARS[:-1]))
    with pytest.raises(C.CheckpointError, match="V=12 but 'chars' has 11 characters"):
        C.convert(pt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- malicious and broken .pt

def _evil_calls(marker: Path):
    return {
        "os.system": _Call("os", "system", f"touch {marker}"),
        "posix.system": _Call("posix", "system", f"touch {marker}"),
        "builtins.exec": _Call("builtins", "exec", f"open({str(marker)!r}, 'w').close()"),
        "subprocess.call": _Call("subprocess", "call", ["touch", str(marker)]),
        "builtins.getattr": _Call("builtins", "getattr", _Call("builtins", "__import__", "os"), "system"),
    }


def _assert_clean(parent: Path, expected: set[str]):
    assert {p.name for p in parent.iterdir()} == expected, "leftover output or temporary folder"


@pytest.mark.parametrize("offender", ["os.system", "posix.system", "builtins.exec", "subprocess.call",
                                      "builtins.getattr"])
def test_malicious_pt_top_level(tmp_path, offender):
    marker = tmp_path / "pwned"
    pt = write_torch_zip(tmp_path / "evil.pt", _evil_calls(marker)[offender])
    out = tmp_path / "out"
    with pytest.raises(C.UnsafePickleError) as e:
        C.convert(pt, out)
    assert offender in str(e.value)
    assert not marker.exists()
    _assert_clean(tmp_path, {"evil.pt"})


def test_malicious_global_nested_in_state_dict(book_state, tmp_path):
    marker = tmp_path / "pwned"
    state = torch_like_state(book_state)
    # real tensors come first, so storages are read before the bad global is reached
    state["ln.bias"] = {"inner": [1.0, (2, _evil_calls(marker)["os.system"])]}
    pt = write_torch_zip(tmp_path / "evil.pt", _book_obj(state))
    with pytest.raises(C.UnsafePickleError, match=r"os\.system") as e:
        C.convert(pt, tmp_path / "out")
    assert "not on the allow-list" in str(e.value)
    assert not marker.exists()
    _assert_clean(tmp_path, {"evil.pt"})


def test_malicious_global_as_tensor_argument(book_state, tmp_path):
    marker = tmp_path / "pwned"
    state = torch_like_state(book_state)
    tok = state["tok.weight"]
    hooks = _evil_calls(marker)["subprocess.call"]  # where torch puts backward hooks
    state["tok.weight"] = _Call("torch._utils", "_rebuild_tensor_v2",
                                tok.storage, 0, tok.shape, tok.stride, False, hooks)
    pt = write_torch_zip(tmp_path / "evil.pt", _book_obj(state))
    with pytest.raises(C.UnsafePickleError, match=r"subprocess\.call"):
        C.convert(pt, tmp_path / "out")
    assert not marker.exists()
    _assert_clean(tmp_path, {"evil.pt"})


def test_pt_missing_a_tensor(book_state, tmp_path):
    state = torch_like_state(book_state)
    del state["blocks.layers.0.linear1.bias"]
    pt = write_torch_zip(tmp_path / "short.pt", _book_obj(state))
    with pytest.raises(C.CheckpointError, match=r"missing tensor\(s\) blocks\.layers\.0\.linear1\.bias"):
        C.convert(pt, tmp_path / "out")
    _assert_clean(tmp_path, {"short.pt"})


@pytest.mark.parametrize("offset, stride", [
    (0, (64, 1)),      # strides reach past the end of the storage
    (500, (32, 1)),    # starts too close to the end
    (-512, (32, 1)),   # negative offset
    (480, (-32, 1)),   # negative stride
], ids=["stride-past-end", "offset-past-end", "negative-offset", "negative-stride"])
def test_pt_tensor_outside_its_storage(book_state, tmp_path, offset, stride):
    # pos.weight keeps its expected shape (16, 32), so only the bounds check can catch this
    state = torch_like_state(book_state)
    pos = state["pos.weight"]
    assert pos.storage.array.size == 16 * 32
    state["pos.weight"] = _Tensor(pos.storage, (16, 32), offset=offset, stride=stride)
    pt = write_torch_zip(tmp_path / "oob.pt", _book_obj(state))
    with pytest.raises(C.CheckpointError, match="storage") as e:
        C.convert(pt, tmp_path / "out")
    assert "(16, 32)" in str(e.value)
    _assert_clean(tmp_path, {"oob.pt"})


def test_pt_not_a_zip(tmp_path):
    pt = tmp_path / "legacy.pt"
    pt.write_bytes(pickle.dumps({"config": {}, "chars": [], "state_dict": {}}))
    with pytest.raises(C.CheckpointError, match="not a torch.save zip archive"):
        C.convert(pt, tmp_path / "out")
    _assert_clean(tmp_path, {"legacy.pt"})


def test_pt_with_a_missing_storage_entry(book_state, tmp_path):
    pt = write_torch_zip(tmp_path / "b.pt", _book_obj(torch_like_state(book_state)))
    broken = tmp_path / "broken.pt"
    with zipfile.ZipFile(pt) as src, zipfile.ZipFile(broken, "w") as dst:
        for item in src.infolist():
            if item.filename != "archive/data/3":
                dst.writestr(item, src.read(item))
    with pytest.raises(C.CheckpointError, match="lacks tensor storage archive/data/3"):
        C.convert(broken, tmp_path / "out")
    _assert_clean(tmp_path, {"b.pt", "broken.pt"})


def test_pt_with_the_wrong_top_level(tmp_path):
    pt = write_torch_zip(tmp_path / "b.pt", {"model": OrderedDict()})
    with pytest.raises(C.CheckpointError, match="'config', 'chars' and 'state_dict'"):
        C.convert(pt, tmp_path / "out")


# ----------------------------------------------------------------------------- command line

def test_cli_convert_and_info(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["convert", str(BOOK_PT), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["info", str(out)]) == 0
    printed = capsys.readouterr().out
    cfg = ModelConfig(V=12, T=16, d=32, L=2, heads=4)
    assert "V=12 T=16 d=32 L=2 heads=4" in printed
    assert f"{cfg.num_params():,}" in printed
    assert "converted_from" in printed and BOOK_PT.name in printed


def test_cli_convert_bad_file_is_one_line(tmp_path, capsys):
    marker = tmp_path / "pwned"
    bad = write_torch_zip(tmp_path / "evil.pt", _evil_calls(marker)["os.system"])
    out = tmp_path / "out"
    assert main(["convert", str(bad), str(out)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("jaxdecode: error: ") and "os.system" in err
    assert "\n" not in err and "Traceback" not in captured.err
    assert not out.exists() and not marker.exists()


def test_cli_convert_refuses_existing_folder(tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    assert main(["convert", str(BOOK_PT), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdecode: error: ") and "already exists" in err
    assert main(["convert", str(BOOK_PT), str(out), "--force"]) == 0
