"""Writes that are interrupted or raced: checkpoint folders, the distilled draft's cache, study
outputs, training saves and the native library's build.

An interruption is simulated by a writer that writes part of its data and then raises (an
``OSError``, or ``KeyboardInterrupt``, which is not an ``Exception``); afterwards the previous
file or folder must be exactly as it was and nothing temporary may be left beside it. Races run
two real processes against one cache folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from jaxdecode.models import checkpoint as C
from jaxdecode.cli.app import main
from jaxdecode.speculative.drafts import distilled
from jaxdecode.speculative.drafts.ngram import NGramDraft
from jaxdecode.io import reports as common

ROOT = Path(__file__).resolve().parents[2]
CORPUS = "abc de.\nfghi a " * 680  # 10,200 characters of the tiny model's vocabulary


class Interrupted(OSError):
    """An I/O error raised half-way through a write."""


FAULTS = [KeyboardInterrupt, Interrupted]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ----------------------------------------------------------------------------- checkpoint folders

@pytest.fixture
def saved(tiny_model, tmp_path):
    """A checkpoint folder (version 1) alone in its parent folder, and its files' bytes."""
    cfg, params, vocab = tiny_model
    target = C.save(tmp_path / "ckpt", params, cfg, vocab, meta={"version": 1},
                    extra_files={"notes.bin": b"first"})
    return target, _snapshot(target)


def _save_again(tiny_model, target):
    import jax

    cfg, params, vocab = tiny_model
    params = jax.tree_util.tree_map(lambda a: a + 1.0, params)
    return C.save(target, params, cfg, vocab, meta={"version": 2},
                  extra_files={"notes.bin": b"second " * 1000})


def _assert_previous(target: Path, before: dict[str, bytes]):
    assert _listing(target.parent) == [target.name], "a temporary folder was left behind"
    assert _snapshot(target) == before
    assert C.load(target).meta["version"] == 1


@pytest.mark.quick
@pytest.mark.parametrize("fault", FAULTS)
def test_checkpoint_weights_interrupted(saved, tiny_model, monkeypatch, fault):
    import safetensors.numpy

    target, before = saved
    real = safetensors.numpy.save

    def half_then_fail(tensors, filename, metadata=None):
        data = real(tensors, metadata=metadata)
        with open(filename, "wb") as f:
            f.write(data[: len(data) // 2])
        raise fault("interrupted while writing the weights")

    monkeypatch.setattr(safetensors.numpy, "save_file", half_then_fail)
    with pytest.raises(fault):
        _save_again(tiny_model, target)
    _assert_previous(target, before)
    monkeypatch.undo()
    _save_again(tiny_model, target)  # and a save that is not interrupted replaces it
    assert C.load(target).meta["version"] == 2 and _listing(target.parent) == ["ckpt"]
    assert (target / "notes.bin").read_bytes() == b"second " * 1000


@pytest.mark.parametrize("fault", FAULTS)
def test_checkpoint_extra_file_interrupted(saved, tiny_model, monkeypatch, fault):
    target, before = saved
    real = Path.write_bytes

    def half_then_fail(self, data):
        real(self, data[: len(data) // 2])
        raise fault("interrupted while writing an extra file")

    monkeypatch.setattr(Path, "write_bytes", half_then_fail)
    with pytest.raises(fault):
        _save_again(tiny_model, target)
    monkeypatch.undo()
    _assert_previous(target, before)


@pytest.mark.parametrize("at_call", [1, 2], ids=["moving-the-old-aside", "moving-the-new-in"])
@pytest.mark.parametrize("fault", FAULTS)
def test_checkpoint_publish_interrupted(saved, tiny_model, monkeypatch, fault, at_call):
    """Publishing is two renames (the old folder aside, the new one in): an interruption before
    either leaves the old folder in place."""
    target, before = saved
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == at_call:
            raise fault("interrupted while publishing")
        return real(src, dst)

    monkeypatch.setattr(C.os, "replace", replace)
    with pytest.raises(fault):
        _save_again(tiny_model, target)
    monkeypatch.undo()
    assert len(calls) >= at_call
    _assert_previous(target, before)


@pytest.mark.quick
@pytest.mark.parametrize("fault", FAULTS)
def test_atomic_folder_new_target_interrupted(tmp_path, fault):
    target = tmp_path / "new"
    with pytest.raises(fault):
        with C.atomic_folder(target) as tmp:
            (tmp / "a.bin").write_bytes(b"x" * 100)
            raise fault("interrupted")
    assert _listing(tmp_path) == []


@pytest.mark.quick
def test_save_over_a_file_is_refused(tiny_model, tmp_path):
    cfg, params, vocab = tiny_model
    f = tmp_path / "ckpt"
    f.write_text("mine")
    with pytest.raises(C.CheckpointError, match="is a file, not a folder: refusing to replace it"):
        C.save(f, params, cfg, vocab)
    assert f.read_text() == "mine" and _listing(tmp_path) == ["ckpt"]


# ----------------------------------------------------------------------------- training saves

@pytest.mark.slow
def test_training_save_interrupted_keeps_the_last_save(corpus_path, tmp_path, monkeypatch):
    """A run interrupted while saving keeps its previous save: weights, optimizer state and
    progress all of the same step (resuming from it follows the same curve: test_train)."""
    from jaxdecode.models.charlm.train import PROGRESS_FILE, STATE_FILE, TrainConfig, train

    tc = TrainConfig(d=16, L=1, heads=2, T=16, batch=2, steps=4, warmup=1, eval_every=2, eval_windows=2)
    quiet = dict(data_path=corpus_path, progress=False, log=lambda *_: None)
    real, saves = C.save, []

    def save(*args, **kwargs):
        saves.append(1)
        if len(saves) == 2:  # the save at step 4 is interrupted while it writes the weights
            import safetensors.numpy

            def boom(*a, **k):
                raise KeyboardInterrupt

            monkeypatch.setattr(safetensors.numpy, "save_file", boom)
        return real(*args, **kwargs)

    monkeypatch.setattr(C, "save", save)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "run", tc, **quiet)
    monkeypatch.undo()
    run = tmp_path / "run"
    assert len(saves) == 2 and _listing(tmp_path) == ["run"]
    assert _listing(run) == sorted([C.CONFIG_FILE, C.WEIGHTS_FILE, STATE_FILE, PROGRESS_FILE])
    progress = json.loads((run / PROGRESS_FILE).read_text())
    assert C.load(run).meta["steps"] == progress["step"] == 2 and len(progress["history"]) == 1
    # a run is not overwritten by a new one by mistake
    with pytest.raises(ValueError, match="already holds a training run: continue it with resume=True"):
        train(run, tc, **quiet)


def test_training_refuses_to_overwrite_a_checkpoint(tiny_ckpt, tmp_path):
    from jaxdecode.models.charlm.train import TrainConfig, train

    tc = TrainConfig(d=16, L=1, heads=2, T=16, steps=2, warmup=0)
    before = _snapshot(Path(tiny_ckpt))
    for resume, words in ((False, "and would be overwritten"), (True, "to resume")):
        with pytest.raises(ValueError) as e:
            train(tiny_ckpt, tc, resume=resume, progress=False)
        assert str(e.value) == (f"{tiny_ckpt} already holds a checkpoint but no training state "
                                f"(train_state.msgpack) {words}: train into another folder")
    assert _snapshot(Path(tiny_ckpt)) == before


# ----------------------------------------------------------------------------- the distilled draft's cache

def _table(seed: int) -> NGramDraft:
    tokens = np.random.default_rng(seed).integers(0, 12, 400)
    return NGramDraft.from_tokens(tokens, 12, n=3, backoff=2.0)


@pytest.mark.quick
@pytest.mark.parametrize("fault", FAULTS)
def test_distilled_cache_write_interrupted(tmp_path, monkeypatch, fault):
    path = tmp_path / "drafts" / "distilled-x.npz"
    distilled._save(_table(0), path)
    before = path.read_bytes()
    real = np.savez

    def half_then_fail(file, **arrays):
        real(file, **arrays)
        file.seek(0)
        file.truncate(len(before) // 2)
        raise fault("interrupted while writing the table")

    monkeypatch.setattr(np, "savez", half_then_fail)
    if fault is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            distilled._save(_table(1), path)
    else:  # an I/O error only costs the next run the rebuild
        with pytest.warns(UserWarning, match="could not cache the distilled draft"):
            distilled._save(_table(1), path)
    monkeypatch.undo()
    assert _listing(path.parent) == [path.name] and path.read_bytes() == before
    distilled._save(_table(1), path)
    assert _listing(path.parent) == [path.name] and path.read_bytes() != before


_RACER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from jaxdecode.models import checkpoint
    from jaxdecode.speculative.drafts import distilled
    from jaxdecode.speculative.drafts.ngram import NGramDraft

    ckpt, corpus, folder, me, peer = sys.argv[1:]
    lm = checkpoint.load(ckpt, backend="portable")
    real = NGramDraft.distill.__func__

    def distill(cls, *args, **kwargs):
        with open(os.path.join(folder, "builds"), "a") as f:
            f.write(me + "\\n")
        # keep building until the other process waits for this one (it says so on stderr)
        peer_err = os.path.join(folder, peer + ".err")
        deadline = time.time() + 60
        while time.time() < deadline:
            with open(peer_err) as f:
                if "waiting for another process" in f.read():
                    break
            time.sleep(0.05)
        return real(cls, *args, **kwargs)

    NGramDraft.distill = classmethod(distill)
    open(os.path.join(folder, me + ".ready"), "w").close()
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.01)
    d = distilled.distilled_draft(lm, corpus, n=3, progress=True)
    np.savez(os.path.join(folder, me + ".npz"), keys=np.asarray(d.keys), logp=np.asarray(d.logits),
             goto=np.asarray(d.goto))
""")


@pytest.mark.slow
def test_distilled_cache_built_once_by_two_processes(tiny_ckpt, tmp_path, monkeypatch):
    """Two processes that need the same table at once: one builds, the other waits for it and
    reads its file; both get the table a single build gives."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    work = tmp_path / "work"
    work.mkdir()
    cache = tmp_path / "cache"
    env = dict(os.environ, JAXDECODE_CACHE=str(cache), JAXDECODE_KERNELS="0", PYTHONPATH=str(ROOT))
    procs = []
    for me, peer in (("a", "b"), ("b", "a")):
        err = open(work / f"{me}.err", "w")  # noqa: SIM115 - closed below
        argv = [sys.executable, "-c", _RACER, tiny_ckpt, str(corpus), str(work), me, peer]
        procs.append((subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err), err))
    try:
        deadline = time.time() + 120
        while not all((work / f"{me}.ready").exists() for me in "ab"):
            alive = all(p.poll() is None for p, _ in procs)
            assert time.time() < deadline and alive, "a racer failed to start"
            time.sleep(0.05)
        (work / "go").touch()
        for p, _ in procs:
            assert p.wait(timeout=180) == 0
    finally:
        for p, err in procs:
            if p.poll() is None:
                p.kill()
            err.close()
    errs = {me: (work / f"{me}.err").read_text() for me in "ab"}
    builds = (work / "builds").read_text().split()
    assert len(builds) == 1, f"built {len(builds)} times"
    builder, waiter = builds[0], "b" if builds[0] == "a" else "a"
    table = next((cache / "drafts").glob("distilled-*.npz"))
    assert f"building the distilled draft (once, under a minute); cached at {table}" in errs[builder]
    assert "target predictions" in errs[builder]  # the progress bar
    assert f"waiting for another process building the distilled draft at {table}" in errs[waiter]
    assert "building" not in errs[waiter].replace("process building", "")
    assert _listing(cache / "drafts") == [table.name, table.name + ".lock"]
    # both equal a single build in this process (caching off)
    monkeypatch.setenv("JAXDECODE_CACHE", "")
    lm = C.load(tiny_ckpt, backend="portable")
    single = distilled.distilled_draft(lm, corpus, n=3)
    for me in "ab":
        with np.load(work / f"{me}.npz") as got:
            np.testing.assert_array_equal(got["keys"], np.asarray(single.keys))
            np.testing.assert_array_equal(got["logp"], np.asarray(single.logits))
            np.testing.assert_array_equal(got["goto"], np.asarray(single.goto))


@pytest.mark.slow
def test_cli_distilled_build_notice_on_stderr(tiny_ckpt, tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    monkeypatch.setenv("JAXDECODE_CACHE", str(tmp_path / "cache"))
    argv = ["generate", "abc", "-n", "5", "--ckpt", tiny_ckpt, "--json", "--greedy",
            "--speculative", "distilled", "--ngram-order", "3", "--data", str(corpus)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    json.loads(out)  # stdout holds the result only
    table = next((tmp_path / "cache" / "drafts").glob("distilled-*.npz"))
    lines = err.splitlines()
    assert f"building the distilled draft (once, under a minute); cached at {table}" in lines
    assert "target predictions" in err  # the tqdm bar
    assert main(argv) == 0  # cached: no notice, no bar
    out, err = capsys.readouterr()
    json.loads(out)
    assert "distilled draft" not in err and "target predictions" not in err


def test_build_time_estimate(monkeypatch):
    from jaxdecode.models.charlm.transformer import ModelConfig

    monkeypatch.setattr(distilled, "_cores", lambda: 2)
    shipped = ModelConfig(V=65, T=512, d=256, L=4, heads=4)
    seconds = distilled.estimated_seconds(shipped, 1_003_854)
    assert 90 < seconds < 300  # measured: about 2 to 3 minutes on two cores
    assert distilled._duration(seconds) in ("about 2 minutes", "about 3 minutes", "about 4 minutes")
    assert distilled._duration(20) == "under a minute" and distilled._duration(70) == "about 1 minute"


# ----------------------------------------------------------------------------- study outputs

@pytest.mark.quick
@pytest.mark.parametrize("fault", FAULTS)
def test_study_output_interrupted(tmp_path, fault):
    path = tmp_path / "study.json"
    common.write_json(path, {"x": 1.0})
    before = path.read_bytes()

    def half_then_fail(f):
        f.write(b'{"x": 2.0, "y": [1, 2')
        raise fault("interrupted while writing the study")

    with pytest.raises(fault):
        common._atomic_write(path, half_then_fail)
    assert _listing(tmp_path) == ["study.json"] and path.read_bytes() == before


# ----------------------------------------------------------------------------- the native library

_FAKE_CXX = """#!/bin/sh
# a stand-in compiler: records which process called it, writes half a file, waits, then builds a
# tiny library (the build runs it once per source file, then once to link)
echo $PPID >> "{log}"
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
printf 'half a library' > "$out"
sleep 1
exec "{cxx}" -shared -fPIC -o "$out" "{src}"
"""


@pytest.mark.slow
def test_native_build_by_two_processes(tmp_path):
    """Two processes build the native library into a fresh cache at once: one compiles, the other
    waits and gets the same, loadable library. Compiling the real sources takes about 30 s (60 s
    for two at once on two cores), so a stand-in compiler builds a tiny library instead; the
    locking, the temporary file and the rename are the real ones."""
    import ctypes
    import shutil

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "stand_in.cc"
    src.write_text('extern "C" int jaxdecode_stand_in(void) { return 42; }\n')
    log = tmp_path / "compiles"
    fake = tmp_path / "fake-cxx"
    fake.write_text(_FAKE_CXX.format(log=log, cxx=cxx, src=src))
    fake.chmod(0o755)
    env = dict(os.environ, JAXDECODE_CACHE=str(tmp_path / "cache"), CXX=str(fake), PYTHONPATH=str(ROOT))
    go = tmp_path / "go"
    script = textwrap.dedent(f"""
        import os, sys, time
        from jaxdecode.native import kernels
        open(sys.argv[1], "w").close()
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        print(kernels.build())
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / f"{i}.ready")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        deadline = time.time() + 120
        while not all((tmp_path / f"{i}.ready").exists() for i in range(2)):
            alive = all(p.poll() is None for p in procs)
            assert time.time() < deadline and alive, "a builder failed to start"
            time.sleep(0.02)
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    paths = {o.strip() for o, _ in outs}
    assert len(paths) == 1
    lib = Path(paths.pop())
    callers = log.read_text().split()
    assert len(set(callers)) == 1, "both processes compiled"
    assert len(callers) == len(list((ROOT / "jaxdecode" / "native" / "csrc").glob("*.cc"))) + 1
    assert ctypes.CDLL(str(lib)).jaxdecode_stand_in() == 42
    assert _listing(lib.parent) == [lib.name, lib.name + ".lock"]  # no temporary file


def test_native_build_interrupted_leaves_nothing(tmp_path, monkeypatch):
    from jaxdecode.native import kernels

    monkeypatch.setenv("JAXDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "c++")

    def half_then_fail(cmd, **kwargs):
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"half a library")
        raise KeyboardInterrupt

    monkeypatch.setattr(kernels.subprocess, "run", half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        kernels.build()
    folder = tmp_path / "cache" / "kernels"
    assert not list(folder.glob("*.so")) and not [p for p in folder.iterdir() if not p.name.endswith(".lock")]
