"""Loading onto a mesh, measured in a process of its own on 8 forced CPU devices (the devices
must be forced before JAX starts, and a process's memory high-water mark covers its whole life):
``python tests/support/mesh_loading.py FOLDER sharded|whole [equal]`` prints one JSON object
(tests/models/test_mesh_loading.py)."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import resource
import sys
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

import jaxdecode
from jaxdecode.decoding.placement import make_mesh
from jaxdecode.models.hf import sliced
from jaxdecode.models.hf.quantized import save_int8

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"


def rss() -> int:
    """The process's resident bytes now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak() -> int:
    """The process's resident high-water mark in bytes since :func:`reset_peak` (``VmHWM``; where
    /proc has none, ``ru_maxrss``, in KiB on Linux, over the process's life)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> None:
    """Start the high-water mark again from the resident bytes now (Linux: ``clear_refs`` 5), so
    that what the warm-up load and the imports held before the measured load does not count."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


class Counted:
    """Every slice read through :class:`jaxdecode.models.hf.sliced.Files`, with its bytes."""

    def __init__(self):
        self.reads: dict[str, list[int]] = defaultdict(list)
        get = sliced.Files.get
        reads = self.reads

        class Slice:
            def __init__(self, inner, name):
                self.inner, self.name = inner, name

            def __getitem__(self, index):
                a = self.inner[index]
                reads[self.name].append(int(a.nbytes))
                return a

            def __getattr__(self, attr):
                return getattr(self.inner, attr)

        class File:
            def __init__(self, inner):
                self.inner = inner

            def get_slice(self, name):
                return Slice(self.inner.get_slice(name), name)

            def __getattr__(self, attr):
                return getattr(self.inner, attr)

        sliced.Files.get = lambda files, path: File(get(files, path))


def tensor_bytes(folder: Path) -> dict[str, int]:
    from safetensors import safe_open

    out = {}
    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        for k in f.keys():  # noqa: SIM118
            sl = f.get_slice(k)
            out[k] = int(np.prod(sl.get_shape())) * {"F32": 4, "BF16": 2, "F16": 2}[sl.get_dtype()]
    return out


def measure(folder: Path, how: str) -> dict:
    """Resident growth while loading ``folder`` onto a 1 x 8 mesh: ``sharded`` reads each device's
    slice; ``whole`` loads on one device and then splits (the comparison)."""
    mesh = make_mesh(data=1, model=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jaxdecode.load(FIXTURES / "llama", mesh=mesh)  # every module imported, every pool started
        counted = Counted() if how == "sharded" else None
        reset_peak()
        before, high = rss(), peak()
        if how == "sharded":
            lm = jaxdecode.load(folder, mesh=mesh)
        else:
            lm = jaxdecode.load(folder, backend="portable").shard(mesh)
    jax.block_until_ready(lm.params)
    leaves = jax.tree_util.tree_leaves(lm.params)
    out = {"growth": peak() - before, "before": before, "peak_before_load": high,
           "device_bytes": sum(s.data.nbytes for a in leaves for s in a.addressable_shards),
           "model_bytes": sum(a.nbytes for a in leaves), "tensors": tensor_bytes(folder)}
    if counted is not None:
        out["reads"] = {k: list(v) for k, v in counted.reads.items()}
    return out


def equal() -> dict:
    """For each kind of folder and way of keeping the matrices: the sharded load's parameters
    against one device's load then split (values, dtypes, shardings)."""
    out = {}
    wide = [("llama", w) for w in ("float32", "bfloat16", "int8")] + [
        ("mistral", "stored"),  # bfloat16 storage, a sliding window
        ("gemma2", "float32"), ("mixtral", "float32"), ("qwen2_moe", "float32"),  # soft-capping, experts
        ("phi3", "int8"), ("gpt2", "stored"),  # fused q/k/v and gate/up; float16 storage, Conv1D
        ("qwen2", "float32")]  # weights in three files under an index
    narrow = [("llama", "int8"), ("phi3", "float32"), ("mixtral", "float32")]  # key/value heads split too
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        quantized = Path(tmp) / "int8"  # a folder written by `jaxdecode quantize`
        save_int8(jaxdecode.load(FIXTURES / "llama", backend="portable", weights="int8"), quantized)
        for (data, model), cases in (((1, 8), wide), ((4, 2), narrow)):
            mesh = make_mesh(data=data, model=model)
            for family, weights in [*cases, (quantized, "int8")]:
                one = jaxdecode.load(FIXTURES / family, backend="portable", weights=weights).shard(mesh)
                got = jaxdecode.load(FIXTURES / family, weights=weights, mesh=mesh)
                a, b = (jax.tree_util.tree_flatten_with_path(m.params)[0] for m in (one, got))
                bad = [jax.tree_util.keystr(p) for (p, x), (q, y) in zip(a, b, strict=False)
                       if p != q or x.dtype != y.dtype or x.sharding != y.sharding
                       or not np.array_equal(np.asarray(x), np.asarray(y))]
                if len(a) != len(b):
                    bad.append("a different tree")
                out[f"{Path(family).name}:{weights}:{data}x{model}"] = bad
    return out


if __name__ == "__main__":  # FOLDER sharded|whole [equal]
    result = measure(Path(sys.argv[1]), sys.argv[2])
    if "equal" in sys.argv[3:]:
        result["equal"] = equal()
    print(json.dumps(result))
