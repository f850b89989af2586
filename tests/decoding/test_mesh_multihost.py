"""Two processes joined by ``jax.distributed``, four CPU devices each, as one ``data x model``
mesh of 2 x 4: the model split over each process's own devices, the rows over the processes
(``tools/multihost_demo.py --model 4``). Every process loads only its devices' slices and gets
every row; the greedy tokens equal one device's."""

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "tests" / "fixtures" / "hf" / "llama"
PROMPTS = ["Hello world", "The cat sat", "a"]
N = 8
TIMEOUT = 240  # seconds for the cluster to join and finish (about 25 s on two busy cores)
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh_multihost")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = FAST_COMPILE  # the demo adds the device count
    procs = []
    for i in range(2):
        cmd = [sys.executable, str(ROOT / "tools" / "multihost_demo.py"), "--coordinator", f"127.0.0.1:{port}",
               "--num-processes", "2", "--process-id", str(i), "--local-devices", "4", "--model", "4",
               "--checkpoint", str(LLAMA), "-n", str(N), "--greedy", "--out", str(tmp / f"{i}.json"),
               "--timeout", str(TIMEOUT)]
        cmd += [a for p in PROMPTS for a in ("--prompt", p)]
        with open(tmp / f"{i}.log", "w") as log:
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, tmp / f"{i}.json", tmp / f"{i}.log"))
    yield procs
    for proc, _, _ in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _finish(proc, path: Path, log: Path) -> dict:
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"no result within {TIMEOUT} s\n{log.read_text()[-4000:]}")
    assert proc.returncode == 0, log.read_text()[-6000:]
    return json.loads(path.read_text())


@pytest.mark.slow
def test_two_processes_with_a_model_axis_equal_one_device(cluster):
    import jaxdecode

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = jaxdecode.load(LLAMA, backend="portable")
    ref = jaxdecode.generate(lm, PROMPTS, N, greedy=True)
    for i, (proc, path, log) in enumerate(cluster):
        got = _finish(proc, path, log)
        assert got["layout"] == {"process_index": i, "process_count": 2, "local_devices": 4, "devices": 8,
                                 "mesh": {"data": 2, "model": 4}, "model_axis_local": True}
        assert [o["prompt"] for o in got["outputs"]] == PROMPTS
        assert [o["tokens"] for o in got["outputs"]] == [g.tokens.tolist() for g in ref]
        assert [o["text"] for o in got["outputs"]] == [g.text for g in ref]


@pytest.mark.quick
def test_the_demo_on_a_model_axis_in_one_process(tmp_path):
    """The demo's model-axis path in this process (one device, a model axis of 1): every row,
    one device's tokens."""
    import importlib.util

    import jaxdecode

    spec = importlib.util.spec_from_file_location("multihost_demo", ROOT / "tools" / "multihost_demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    out = tmp_path / "one.json"
    argv = ["--model", "1", "--checkpoint", str(LLAMA), "-n", "3", "--greedy", "--out", str(out)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert demo.main([*argv, "--prompt", PROMPTS[0]]) == 0
        lm = jaxdecode.load(LLAMA, backend="portable")
    got = json.loads(out.read_text())
    assert got["layout"]["mesh"] == {"data": 1, "model": 1} and got["layout"]["process_count"] == 1
    ref = jaxdecode.generate(lm, PROMPTS[:1], 3, greedy=True)
    assert [o["tokens"] for o in got["outputs"]] == [g.tokens.tolist() for g in ref]
