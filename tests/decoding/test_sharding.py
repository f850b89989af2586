"""Batch generation sharded over devices (jaxdecode.decoding.sharded) against one device.

Several devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before jax is
imported, so the sharded runs happen in other processes, started once for the module and run
while this process computes the single-device references:

- this file run as a script (``--sharded OUT``) on 4 devices: every case's tokens, and the layout
  of each program's arrays (which are split over the devices, how many shards, their shapes);
- ``tools/multihost_demo.py`` twice, two processes of 2 devices each joined into one cluster of
  4 by ``jax.distributed`` (CPU collectives: gloo).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICES = 4
TIMEOUT = 420
CHARS = " abcdefghi.\n"  # the tiny model's vocabulary (conftest's tiny_model)


# ----------------------------------------------------------------------------- the cases


def cases():
    """Each case: (name, model, params, prompts, n, key, keyword arguments of sample_tokens)."""
    from jaxdecode import constraints as C
    from jaxdecode import rules
    from jaxdecode.models.charlm.transformer import ModelConfig, init_params
    from jaxdecode.models import TinyTransformer, decoder_for
    from jaxdecode.io.vocab import Vocab

    cfg = ModelConfig(V=12, T=16, d=32, L=2, heads=4)
    params = jax.tree_util.tree_map(lambda a: a * 3.0, init_params(cfg, jax.random.PRNGKey(42)))
    vocab = Vocab(CHARS)
    enc = lambda texts: [vocab.encode(t) for t in texts]
    toy = TinyTransformer(V=12, T=160, d=32, L=2, heads=4)
    out = []
    # ragged prompts, greedy, through the cache and on past T in the window mode; native layer
    out.append(("greedy-native", decoder_for(cfg, "native"), params,
                enc(["abc", "a\nbcdefg", "h", "abcdefghi.\nb", "ee ab"]), 24, jax.random.PRNGKey(0),
                {"greedy": True}))
    # sampling: a penalty (rule state), a per-row top-p, one key per row, two stop strings, a
    # regex on two rows (automaton states); six rows in a batch of eight
    chain = rules.chain(rules.repetition_penalty(1.3), rules.temperature(0.9),
                        rules.top_p(jnp.array([0.5, 0.9, 0.95, 1.0, 0.8, 0.9])))
    con = C.compile_regex("[a-d]{1,4}\\.", vocab)
    out.append(("sample-portable", decoder_for(cfg, "portable"), params,
                enc(["ab", "h", "cab", "i.", "d", "ge"]), 12,
                jax.random.split(jax.random.PRNGKey(7), 6),
                {"rule": chain, "stops": enc(["h ", "\ng"]), "row_ids": [5, 1, 9, 2, 0, 7],
                 "constraint": [con, None, None, con, None, None]}))
    # a model whose cache keeps the rows on its third axis; one prompt, padded to four rows; 130
    # new tokens: the cache grows past its first 128 positions
    out.append(("sample-toy", toy, toy.init_params(jax.random.PRNGKey(5)), enc(["bad ca"]), 130,
                jax.random.PRNGKey(3), {"rule": rules.chain(rules.temperature(1.2), rules.top_k(6))}))
    return out


def text_case():
    """A text request through ``generate``: a prompt longer than the model's window (the window
    mode from the first step), two samples of each prompt (per-prompt seeds: one key per row)."""
    from jaxdecode import rules
    from jaxdecode.models.checkpoint import LanguageModel
    from jaxdecode.models.charlm.transformer import ModelConfig, init_params
    from jaxdecode.io.vocab import Vocab

    cfg = ModelConfig(V=12, T=16, d=32, L=2, heads=4)
    params = jax.tree_util.tree_map(lambda a: a * 3.0, init_params(cfg, jax.random.PRNGKey(42)))
    lm = LanguageModel(params=params, cfg=cfg, vocab=Vocab(CHARS), meta={}, backend="native")
    return lm, ["abc d\nefghi. abcdefg", "hi"], 6, {"seed": [4, 9], "num_samples": 2,
                                                   "rule": rules.make_rule(top_k=5)}


def run_text_case(sharded: bool) -> list:
    import jaxdecode
    from jaxdecode.decoding.placement import make_mesh

    lm, prompts, n, kw = text_case()
    outs = jaxdecode.generate(lm, prompts, n, mesh=make_mesh() if sharded else None, **kw)
    return [[g.prompt, g.text, g.tokens.tolist(), g.finish_reason] for g in outs]


def result_dict(res) -> dict:
    rows = lambda a: [a[r, :c].tolist() for r, c in enumerate(res.counts)]
    return {"tokens": rows(res.tokens), "counts": res.counts.tolist(), "stopped": res.stopped.tolist(),
            "model_logprobs": rows(res.model_logprobs), "sample_logprobs": rows(res.sample_logprobs)}


def run_case(case, sharded: bool, mesh=None) -> dict:
    from jaxdecode.decoding.sampling import sample_tokens
    from jaxdecode.decoding.sharded import sharded_sample_tokens

    name, model, params, prompts, n, key, kw = case
    if sharded:
        return result_dict(sharded_sample_tokens(model, params, prompts, n, key, mesh=mesh, **kw))
    return result_dict(sample_tokens(model, params, prompts, n, key, **kw))


# ----------------------------------------------------------------------------- the sharded side


def _leaf_layout(x) -> dict:
    shards = x.addressable_shards
    return {"shape": list(x.shape), "spec": [None if s is None else str(s) for s in x.sharding.spec],
            "shards": len(shards), "devices": len({s.device for s in shards}),
            "shard_shapes": sorted({tuple(s.data.shape) for s in shards})}


def _describe(tree) -> list:
    return [_leaf_layout(a) for a in jax.tree_util.tree_leaves(tree) if isinstance(a, jax.Array)]


def _sharded_main(out_path: str) -> None:
    """On 4 devices: every case, and the layout of the first call of each program per case."""
    jax.config.update("jax_numpy_rank_promotion", "raise")
    from jaxdecode.decoding import placement as S

    assert jax.device_count() == DEVICES, jax.devices()
    layouts: dict = {}
    current = {"case": None}
    original = S._program

    def spy(fn, static, mesh, in_specs, out_specs, donate):
        program = original(fn, static, mesh, in_specs, out_specs, donate)

        def call(*args):
            key = f"{current['case']}/{fn.__name__}"
            record = key not in layouts
            if record:  # before the call: a donated cache is gone after it
                names = {"cache_chunk": ["params", "state", "cache", "rule", "key", "row_ids"],
                         "window_chunk": ["params", "state", "rule", "key", "row_ids"],
                         "prefill": ["params", "prompt", "length"], "grow": ["cache"]}.get(fn.__name__, [])
                layouts[key] = {"in": {nm: _describe(a) for nm, a in zip(names, args)}}
                if fn.__name__ == "cache_chunk":
                    layouts[key]["state_fields"] = {f: _describe(v) for f, v in args[1]._asdict().items()}
                if fn.__name__ == "cache_chunk" and current["case"] == "sample-portable":
                    hlo = program.lower(*args).compile().as_text()
                    layouts[key]["collectives"] = sum(hlo.count(c) for c in (
                        "all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"))
            res = program(*args)
            if record:
                layouts[key]["out"] = _describe(res)
            return res

        return call

    S._program = spy
    results = {}
    for case in cases():
        current["case"] = case[0]
        results[case[0]] = run_case(case, sharded=True)
    current["case"] = "text"
    results["text"] = run_text_case(sharded=True)
    Path(out_path).write_text(json.dumps({"results": results, "layouts": layouts,
                                          "devices": jax.device_count()}))


# ----------------------------------------------------------------------------- the processes


def _env(devices: int | None) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        (f" --xla_force_host_platform_device_count={devices}" if devices else "")).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cache = jax.config.jax_compilation_cache_dir  # the suite's persistent compilation cache
    if cache:
        env["JAX_COMPILATION_CACHE_DIR"] = cache
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.3"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


CLUSTER_PROMPTS = ["abc", "h", "i.\nb", "d", "ee"]
CLUSTER_ARGS = ["-n", "10", "--seed", "3", "--top-p", "0.9", "--repetition-penalty", "1.2", "--stop", "\\nc"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_ckpt):
    """Start the sharded processes (they run while the references are computed here)."""
    tmp = tmp_path_factory.mktemp("sharding")
    procs = {}

    def start(name, cmd, env):
        log = open(tmp / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT),
                       tmp / f"{name}.json", tmp / f"{name}.log")
        log.close()

    start("four", [sys.executable, __file__, "--sharded", str(tmp / "four.json")], _env(DEVICES))
    port = _free_port()
    for i in range(2):
        cmd = [sys.executable, str(ROOT / "tools" / "multihost_demo.py"), "--coordinator",
               f"localhost:{port}", "--num-processes", "2", "--process-id", str(i), "--local-devices", "2",
               "--checkpoint", tiny_ckpt, "--backend", "native", "--out", str(tmp / f"cluster{i}.json"),
               "--timeout", str(TIMEOUT)]
        cmd += [a for p in CLUSTER_PROMPTS for a in ("--prompt", p.replace("\n", "\\n"))] + CLUSTER_ARGS
        start(f"cluster{i}", cmd, _env(None))
    yield procs
    for proc, _, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _finish(procs, name) -> dict:
    proc, path, log = procs[name]
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{name}: no result within {TIMEOUT} s\n{log.read_text()[-4000:]}")
    assert proc.returncode == 0, f"{name} failed:\n{log.read_text()[-6000:]}"
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------- the tests


def _same(ref: dict, got: dict, label: str):
    assert got["counts"] == ref["counts"], label
    assert got["stopped"] == ref["stopped"], label
    assert got["tokens"] == ref["tokens"], label  # exactly the same tokens
    for r in range(len(ref["counts"])):
        for field in ("model_logprobs", "sample_logprobs"):
            np.testing.assert_allclose(got[field][r], ref[field][r], atol=2e-5, err_msg=label)


def test_four_devices_equal_one(launched):
    refs = {case[0]: run_case(case, sharded=False) for case in cases()}
    text_ref = run_text_case(sharded=False)
    got = _finish(launched, "four")
    assert got["devices"] == DEVICES
    for name, ref in refs.items():
        _same(ref, got["results"][name], name)
    assert got["results"]["text"] == text_ref
    assert len(text_ref) == 4 and text_ref[0][2] != text_ref[1][2]  # two samples of a prompt differ
    # the cases exercise what they claim: the constrained rows end their pattern, stop strings
    # end rows, the greedy rows run on past the window
    sample = refs["sample-portable"]
    assert sample["stopped"][0] and sample["stopped"][3] and max(sample["counts"][::3]) <= 5
    assert sample["stopped"] == [True] * 5 + [False] and refs["sample-toy"]["counts"] == [130]
    assert refs["greedy-native"]["counts"] == [24] * 5

    lay = got["layouts"]

    def split(leaf, axis, rows):
        """``leaf`` is split four ways along ``axis`` (``rows`` rows in all), one shard a device."""
        spec = leaf["spec"] + [None] * (len(leaf["shape"]) - len(leaf["spec"]))
        assert spec[axis] == "data" and spec.count(None) == len(spec) - 1, leaf
        assert leaf["shape"][axis] == rows and leaf["shards"] == DEVICES and leaf["devices"] == DEVICES, leaf
        want = leaf["shape"][:axis] + [rows // DEVICES] + leaf["shape"][axis + 1:]
        assert leaf["shard_shapes"] == [want], leaf

    def replicated(leaf):
        assert all(s is None for s in leaf["spec"]) and leaf["shards"] == DEVICES, leaf
        assert leaf["shard_shapes"] == [leaf["shape"]], leaf

    for name, rows, cache_axis in (("greedy-native", 8, 0), ("sample-portable", 8, 0), ("sample-toy", 4, 2)):
        chunk = lay[f"{name}/cache_chunk"]
        for leaf in chunk["in"]["params"]:
            replicated(leaf)
        for leaf in chunk["in"]["cache"]:  # KV cache: rows split; their lengths too
            split(leaf, cache_axis if len(leaf["shape"]) > 1 else 0, rows)
        for f in ("logits", "recent", "length", "done", "stop_state"):
            [leaf] = chunk["state_fields"][f]
            split(leaf, 0, rows)
        [step] = chunk["state_fields"]["step"]
        replicated(step)
        for leaf in chunk["in"]["row_ids"] + chunk["in"]["rule"]:
            split(leaf, 0, rows)
        for leaf in chunk["out"]:  # the new state, cache and outputs keep the layout
            assert leaf["shards"] == DEVICES
        prefill = lay[f"{name}/prefill"]
        for leaf in prefill["in"]["prompt"] + prefill["in"]["length"]:
            split(leaf, 0, rows)
    sample = lay["sample-portable/cache_chunk"]
    assert sample["collectives"] == 0  # every device decodes its own rows: no communication
    assert len(sample["state_fields"]["rule_state"]) >= 1 and len(sample["state_fields"]["cstate"]) == 1
    for leaf in sample["state_fields"]["rule_state"] + sample["state_fields"]["cstate"] + sample["in"]["key"]:
        split(leaf, 0, 8)  # penalty state, automaton states, one key per row
    for leaf in lay["sample-toy/cache_chunk"]["in"]["key"]:
        replicated(leaf)  # one key for every row
    # past the window: the exact window mode, split the same way
    for leaf in lay["greedy-native/window_chunk"]["in"]["state"]:
        if leaf["shape"]:
            split(leaf, 0, 8)
        else:
            replicated(leaf)  # the step count
    # the toy model's cache grown from 128 to 256 positions, rows still split on its third axis
    grow = lay["sample-toy/grow"]
    for leaf in grow["in"]["cache"] + grow["out"]:
        split(leaf, 2 if len(leaf["shape"]) > 1 else 0, 4)
    assert [grow["in"]["cache"][0]["shape"][3], grow["out"][0]["shape"][3]] == [128, 256]
    # a prompt past the window: no cache at all, the window mode from the start (4 rows)
    assert "text/prefill" not in lay and "text/cache_chunk" not in lay
    for leaf in lay["text/window_chunk"]["in"]["state"] + lay["text/window_chunk"]["in"]["key"]:
        if leaf["shape"] and leaf["shape"] != [2]:
            split(leaf, 0, 4)


@pytest.mark.quick
def test_one_device_mesh():
    """The same code on the single device here (the default mesh: every device)."""
    from jaxdecode.decoding.sharded import make_mesh

    assert jax.device_count() == 1 and make_mesh().devices.shape == (1,)
    assert run_text_case(sharded=True) == run_text_case(sharded=False)


def test_two_processes_equal_one_device(launched, tiny_ckpt):
    """Two processes of two devices each, one cluster: every process gets every row, and the
    texts are the single-device ones."""
    import jaxdecode
    from jaxdecode import rules

    lm = jaxdecode.load(tiny_ckpt, backend="native")
    ref = jaxdecode.generate(lm, CLUSTER_PROMPTS, 10, seed=3, stop="\nc",
                             rule=rules.make_rule(top_p=0.9, repetition_penalty=1.2))
    assert [g.finish_reason for g in ref] == ["stop", "stop", "length", "stop", "length"]
    owned = []
    for i in range(2):
        got = _finish(launched, f"cluster{i}")
        assert got["layout"] == {"process_index": i, "process_count": 2, "local_devices": 2, "devices": 4,
                                 "mesh": {"data": 4}}
        assert [o["prompt"] for o in got["outputs"]] == CLUSTER_PROMPTS
        assert [o["text"] for o in got["outputs"]] == [g.text for g in ref]
        assert [o["tokens"] for o in got["outputs"]] == [g.tokens.tolist() for g in ref]
        assert [o["stopped"] for o in got["outputs"]] == [g.finish_reason == "stop" for g in ref]
        owned.append(got["own_rows"])
    assert owned == [[0, 3], [3, 5]]  # each process fed its own block of the prompts


# ----------------------------------------------------------------------------- small parts


@pytest.mark.quick
def test_pad_batch_and_mesh_checks():
    from jaxdecode.decoding.common import DUMMY_ROW_ID, make_batch
    from jaxdecode.decoding.sharded import Placement, pad_batch
    from jax.sharding import Mesh

    b = make_batch([np.array([1, 2, 3]), np.array([4])], 5, V=8, T=16, row_ids=[7, 3])
    p = pad_batch(b, 3)  # 2 rows (a power of two) -> 3
    assert (p.Bb, p.B) == (3, 2) and p.prompt.shape == (3, 16) and p.recent.shape == (3, 16)
    assert p.row_ids.tolist() == [7, 3, DUMMY_ROW_ID + 2] and p.length.tolist() == [3, 1, 1]
    assert (p.prompt[2] == 0).all() and (p.prompt[:2] == b.prompt).all()
    assert pad_batch(b, 2) is b
    with pytest.raises(ValueError, match="batch axis named 'data'"):
        Placement(Mesh(np.array(jax.devices()), ("rows",)))


@pytest.mark.quick
def test_gather_prompts_one_process():
    from jaxdecode.decoding.sharded import gather_prompts

    rows, own = gather_prompts([[1, 2], np.array([3])])
    assert [r.tolist() for r in rows] == [[1, 2], [3]] and own == slice(0, 2)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--sharded":
        sys.path.insert(0, str(ROOT))
        _sharded_main(sys.argv[2])
    else:
        sys.exit("usage: test_sharding.py --sharded OUT.json (the test's 4-device side)")
