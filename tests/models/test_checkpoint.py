"""Checkpoint folders, the safe .pt converter and their error messages.

``fixtures/book_tiny.pt`` and ``fixtures/book_tiny_logits.npz`` come from
``tools/make_torch_fixture.py`` (PyTorch); nothing here imports torch. Malicious and
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

from jaxdecode.models import checkpoint as C
from jaxdecode.cli.app import main
from jaxdecode.models.charlm.transformer import ModelConfig, forward
from jaxdecode.io.vocab import UnknownCharacterError, Vocab

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
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


STORAGE_DTYPES = {"FloatStorage": np.float32, "HalfStorage": np.float16, "DoubleStorage": np.float64,
                  "BFloat16Storage": "bfloat16", "LongStorage": np.int64}


def _np_dtype(dtype) -> np.dtype:
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


class _Storage:
    """One storage: ``array`` (flattened) stored as torch's ``stype`` (FloatStorage: float32, ...)."""

    def __init__(self, key: str, array: np.ndarray, stype: str = "FloatStorage"):
        self.key, self.stype = key, stype
        dtype = _np_dtype(STORAGE_DTYPES[stype])
        self.array = np.ascontiguousarray(np.asarray(array).astype(dtype)).reshape(-1)

    def to_bytes(self, byteorder: str = "little") -> bytes:
        a = self.array
        if byteorder == "big" and a.dtype.itemsize > 1:
            a = a.view(f"u{a.dtype.itemsize}").astype(f">u{a.dtype.itemsize}")  # the same bits, swapped
        return a.tobytes()


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
        if self.proto >= 4:  # what pickle writes from protocol 4 on: two strings, then STACK_GLOBAL
            self.save(obj.module)
            self.save(obj.name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))
        self.memoize(obj)

    dispatch[_Global] = _save_global_placeholder

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", _Global("torch", obj.stype), obj.key, "cpu", obj.array.size)
        if isinstance(obj, _Persistent):
            return obj.pid
        return None


class _Persistent:
    """Pickles as a persistent reference to ``pid`` (what torch uses for storages)."""

    def __init__(self, pid):
        self.pid = pid


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


def write_torch_zip(path: Path, obj, prefix: str = "archive", *, byteorder: str | None = "little",
                    protocol: int = 2, extra: dict[str, bytes] | None = None) -> Path:
    """Write ``obj`` as torch.save would: ``<prefix>/data.pkl`` plus one ``<prefix>/data/<key>`` per
    storage, in ``byteorder`` (``None``: no byteorder entry, as before torch 1.9; another string is
    written as it is and the storages little-endian); ``extra`` adds entries."""
    import io

    buf = io.BytesIO()
    _TorchLikePickler(buf, protocol=protocol).dump(obj)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{prefix}/data.pkl", buf.getvalue())
        if byteorder is not None:
            z.writestr(f"{prefix}/byteorder", byteorder)
        for key, s in _storages(obj, {}).items():
            z.writestr(f"{prefix}/data/{key}", s.to_bytes("big" if byteorder == "big" else "little"))
        z.writestr(f"{prefix}/version", "3\n")
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    return path


def torch_like_state(state: dict[str, np.ndarray], stype: str = "FloatStorage") -> OrderedDict:
    """Tensors of a state dict, one storage each (tied names share one, as in torch)."""
    out, by_id = OrderedDict(), {}
    for i, (name, a) in enumerate(state.items()):
        s = by_id.setdefault(id(a), _Storage(str(i), a, stype))
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

@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
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


# ----------------------------------------------------------------------------- weights the model cannot use

def _rewrite_weights(folder: Path, **changes):
    from safetensors.numpy import load_file, save_file

    w = folder / C.WEIGHTS_FILE
    state = load_file(str(w))
    state.update(changes)
    save_file(state, str(w))
    return state


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_weight_is_named(folder, value):
    from safetensors.numpy import load_file

    a = load_file(str(folder / C.WEIGHTS_FILE))["blocks.layers.1.linear2.weight"].copy()
    a[3, 7] = value
    _rewrite_weights(folder, **{"blocks.layers.1.linear2.weight": a})
    with pytest.raises(C.CheckpointError) as e:
        C.load(folder)
    msg = str(e.value)
    assert "blocks.layers.1.linear2.weight contains NaN or infinite values" in msg
    assert f"(1 of 4096, the first at index (3, 7): {value})" in msg and C.WEIGHTS_FILE in msg


def test_weight_beyond_float32_is_refused(folder):
    _rewrite_weights(folder, **{"blocks.layers.0.norm1.bias": np.full(32, 1e300)})  # float64: finite
    with pytest.raises(C.CheckpointError,
                       match=r"blocks\.layers\.0\.norm1\.bias holds values beyond the range of float32"):
        C.load(folder)


def test_integer_weight_is_refused(folder):
    _rewrite_weights(folder, **{"ln.weight": np.ones(32, np.int64)})
    with pytest.raises(C.CheckpointError,
                       match="tensor ln.weight has dtype int64, but the model's weights are floating point"):
        C.load(folder)


def test_tied_output_weight(folder, book_state):
    # present and equal to tok.weight: accepted, and the model is the same
    before = C.load(folder)
    _rewrite_weights(folder, **{"out.weight": np.asarray(book_state["tok.weight"]).copy()})
    after = C.load(folder)
    for x, y in zip(jax.tree_util.tree_leaves(before.params), jax.tree_util.tree_leaves(after.params)):
        np.testing.assert_array_equal(x, y)
    # present and different: refused, naming both
    out = np.asarray(book_state["tok.weight"]).copy()
    out[2, 5] += 0.25
    _rewrite_weights(folder, **{"out.weight": out})
    with pytest.raises(C.CheckpointError) as e:
        C.load(folder)
    assert "out.weight differs from tok.weight (largest difference 0.25)" in str(e.value)
    # another shape
    _rewrite_weights(folder, **{"out.weight": out[:, :16].copy()})
    with pytest.raises(C.CheckpointError,
                       match=r"out\.weight has shape \(12, 16\) but tok\.weight \(12, 32\)"):
        C.load(folder)


@pytest.mark.quick
@pytest.mark.parametrize("fault, message", [
    ("no-config", "not a checkpoint folder, it has no config.json"),
    ("no-weights", "incomplete checkpoint folder, it has no model.safetensors"),
    ("a-file", "is a file, not a checkpoint folder (a folder with config.json and model.safetensors)"),
    ("a-pt-file", "(convert a torch .pt file first: jaxdecode convert FILE FOLDER)"),
    ("missing", "does not exist"),
])
def test_not_a_checkpoint_folder(folder, tmp_path, capsys, fault, message):
    target = folder
    if fault == "no-config":
        (folder / C.CONFIG_FILE).unlink()
    elif fault == "no-weights":
        (folder / C.WEIGHTS_FILE).unlink()
    elif fault == "a-file":
        target = folder / C.CONFIG_FILE
    elif fault == "a-pt-file":
        target = BOOK_PT
    else:
        target = tmp_path / "nowhere"
    with pytest.raises(C.CheckpointError) as e:
        C.load(target)
    assert message in str(e.value) and str(target) in str(e.value)
    # the command line: exit 2 and the same message as one line
    assert main(["info", str(target)]) == 2
    err = capsys.readouterr().err
    assert err == f"jaxdecode: error: {e.value}\n"


# ----------------------------------------------------------------------------- .pt storages

def _stored(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(folder / C.WEIGHTS_FILE))


@pytest.mark.parametrize("stype, rtol, atol", [
    ("DoubleStorage", 0, 0),              # float32 -> float64 -> float32 is exact
    ("HalfStorage", 2.0 ** -11, 2.0 ** -24),  # half an ulp of float16 (and of its subnormals)
    ("BFloat16Storage", 2.0 ** -8, 0),       # half an ulp of bfloat16
])
def test_pt_storage_dtypes_convert_to_float32(book_state, tmp_path, stype, rtol, atol):
    pt = write_torch_zip(tmp_path / "b.pt", _book_obj(torch_like_state(book_state, stype)))
    got = _stored(C.convert(pt, tmp_path / "out"))
    dtype = _np_dtype(STORAGE_DTYPES[stype])
    for name, a in got.items():
        want = np.asarray(book_state[name], np.float32)
        assert a.dtype == np.float32
        # exactly the original rounded to the storage's dtype, and that is close to the original
        np.testing.assert_array_equal(a, want.astype(dtype).astype(np.float32), err_msg=name)
        np.testing.assert_allclose(a, want, rtol=rtol, atol=atol, err_msg=name)
    if stype != "DoubleStorage":
        assert any(not np.array_equal(a, book_state[n]) for n, a in got.items())  # really rounded


def test_pt_integer_storage_is_refused(book_state, tmp_path):
    state = torch_like_state(book_state)
    state["ln.weight"] = _Tensor(_Storage("99", np.ones(32), "LongStorage"), (32,))
    pt = write_torch_zip(tmp_path / "b.pt", _book_obj(state))
    with pytest.raises(C.CheckpointError, match="tensor ln.weight has dtype int64"):
        C.convert(pt, tmp_path / "out")
    _assert_clean(tmp_path, {"b.pt"})


@pytest.mark.parametrize("stype", ["FloatStorage", "HalfStorage", "DoubleStorage", "BFloat16Storage"])
def test_pt_big_endian_storages(book_state, tmp_path, stype):
    state = torch_like_state(book_state, stype)
    little = _stored(C.convert(write_torch_zip(tmp_path / "le.pt", _book_obj(state)), tmp_path / "le"))
    big_pt = write_torch_zip(tmp_path / "be.pt", _book_obj(state), byteorder="big")
    with zipfile.ZipFile(big_pt) as z:  # the bytes really are big-endian
        raw = z.read(f"archive/data/{state['tok.weight'].storage.key}")
    first = np.asarray(book_state["tok.weight"]).reshape(-1)[:4].astype(_np_dtype(STORAGE_DTYPES[stype]))
    assert raw[:first.nbytes] == first.view(f"u{first.itemsize}").astype(f">u{first.itemsize}").tobytes()
    big = _stored(C.convert(big_pt, tmp_path / "be"))
    assert set(big) == set(little)
    for name in little:
        np.testing.assert_array_equal(big[name], little[name], err_msg=name)


def test_pt_without_byteorder_entry_is_little_endian(book_state, tmp_path):
    pt = write_torch_zip(tmp_path / "b.pt", _book_obj(torch_like_state(book_state)), byteorder=None)
    for name, a in _stored(C.convert(pt, tmp_path / "out")).items():
        np.testing.assert_array_equal(a, book_state[name], err_msg=name)


@pytest.mark.parametrize("byteorder", ["middle", "", "LITTLE"])
def test_pt_unknown_byteorder_is_refused(book_state, tmp_path, byteorder):
    pt = write_torch_zip(tmp_path / "b.pt", _book_obj(torch_like_state(book_state)), byteorder=byteorder)
    with pytest.raises(C.CheckpointError) as e:
        C.convert(pt, tmp_path / "out")
    assert f"byteorder entry says {byteorder!r}; expected 'little' or 'big'" in str(e.value)
    _assert_clean(tmp_path, {"b.pt"})


def test_pt_truncated_storage_is_named(book_state, tmp_path):
    state = torch_like_state(book_state)
    entry = f"archive/data/{state['pos.weight'].storage.key}"
    pt = write_torch_zip(tmp_path / "b.pt", _book_obj(state))
    short = tmp_path / "short.pt"
    with zipfile.ZipFile(pt) as src, zipfile.ZipFile(short, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            dst.writestr(item, data[:-6] if item.filename == entry else data)
    with pytest.raises(C.CheckpointError) as e:
        C.convert(short, tmp_path / "out")
    assert str(e.value) == (f"{short}: storage {entry} is truncated: it holds 2042 bytes, but its "
                            "512 float32 elements need 2048")
    _assert_clean(tmp_path, {"b.pt", "short.pt"})


# ----------------------------------------------------------------------------- .pt pickles

@pytest.mark.parametrize("where", ["archive/extra/data.pkl", "other/data.pkl"])
def test_pt_with_several_data_pkl(book_state, tmp_path, where):
    pt = write_torch_zip(tmp_path / "b.pt", _book_obj(torch_like_state(book_state)), extra={where: b"."})
    with pytest.raises(C.CheckpointError) as e:
        C.convert(pt, tmp_path / "out")
    assert f"expected one data.pkl in the archive, found 2 (archive/data.pkl, {where})" in str(e.value)
    _assert_clean(tmp_path, {"b.pt"})


def test_pt_without_data_pkl(tmp_path):
    pt = tmp_path / "b.pt"
    with zipfile.ZipFile(pt, "w") as z:
        z.writestr("archive/mydata.pkl", b".")  # only a file named exactly data.pkl counts
    with pytest.raises(C.CheckpointError, match="expected one data.pkl in the archive, found 0$"):
        C.convert(pt, tmp_path / "out")


@pytest.mark.parametrize("pid, message", [
    (("weird", 1), "unknown persistent id ('weird', 1)"),
    ("storage", "unknown persistent id 'storage'"),
    (("storage", "FloatStorage", "0", "cpu", 4), "storage of unknown type 'FloatStorage'"),
    (("storage", _Global("torch", "ComplexFloatStorage"), "0", "cpu", 4), "torch.ComplexFloatStorage"),
    (("storage", _Global("torch", "FloatStorage"), "0", "cpu", 4.0), "key '0' and size 4.0"),
], ids=["tag", "not-a-tuple", "type-not-a-global", "complex", "float-size"])
def test_pt_unknown_persistent_id(book_state, tmp_path, pid, message):
    state = torch_like_state(book_state)
    state["ln.bias"] = _Call("torch._utils", "_rebuild_tensor_v2", _Persistent(pid), 0, (32,), (1,),
                             False, OrderedDict())
    pt = write_torch_zip(tmp_path / "b.pt", _book_obj(state))
    with pytest.raises(C.CheckpointError) as e:
        C.convert(pt, tmp_path / "out")
    assert message in str(e.value) and str(e.value).startswith(str(pt))
    _assert_clean(tmp_path, {"b.pt"})


def _opcodes(pt: Path) -> set[str]:
    import pickletools

    with zipfile.ZipFile(pt) as z:
        return {op.name for op, _, _ in pickletools.genops(z.read("archive/data.pkl"))}


def test_pt_protocol_4_pickle(book_state, tmp_path, converted):
    # the same allow-listed objects, referred to by STACK_GLOBAL instead of GLOBAL: loads the same
    pt = write_torch_zip(tmp_path / "p4.pt", _book_obj(torch_like_state(book_state)), protocol=4)
    ops = _opcodes(pt)
    assert "STACK_GLOBAL" in ops and "GLOBAL" not in ops and "FRAME" in ops
    got = _stored(C.convert(pt, tmp_path / "out"))
    want = _stored(converted)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("offender", ["os.system", "builtins.getattr"])
def test_pt_protocol_4_pickle_with_a_bad_global(book_state, tmp_path, offender):
    marker = tmp_path / "pwned"
    state = torch_like_state(book_state)
    state["ln.bias"] = _evil_calls(marker)[offender]
    pt = write_torch_zip(tmp_path / "evil.pt", _book_obj(state), protocol=4)
    assert "STACK_GLOBAL" in _opcodes(pt)
    with pytest.raises(C.UnsafePickleError, match="not on the allow-list") as e:
        C.convert(pt, tmp_path / "out")
    assert offender in str(e.value)
    assert not marker.exists()
    _assert_clean(tmp_path, {"evil.pt"})


# ----------------------------------------------------------------------------- command line

@pytest.mark.quick
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
