import json
import math
import re

import jax
import numpy as np
import pytest
from flax import serialization

from jaxdecode.models import checkpoint
from jaxdecode.io import data as data_lib
from jaxdecode.models.charlm import train as train_lib
from jaxdecode.cli.app import main
from jaxdecode.models.charlm.transformer import ModelConfig, init_params
from jaxdecode.models.charlm.train import TrainConfig, held_out_loss, train

TINY = {"d": 16, "L": 1, "heads": 2, "T": 32, "batch": 2, "steps": 6, "warmup": 1, "eval_every": 2, "eval_windows": 3}


@pytest.mark.slow
def test_same_seed_same_losses(corpus_path, tmp_path):
    tc = TrainConfig(**TINY, seed=3)
    a = train(tmp_path / "a", tc, data_path=corpus_path, progress=False, log=lambda *_: None)
    b = train(tmp_path / "b", tc, data_path=corpus_path, progress=False, log=lambda *_: None)
    assert a == b and len(a) == 3
    c = train(tmp_path / "c", TrainConfig(**TINY, seed=4), data_path=corpus_path, progress=False,
              log=lambda *_: None)
    assert c != a


def _leaves(tree):
    """``{path: array}`` of every leaf of a pytree (nested dicts from msgpack included)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def _assert_same_leaves(a, b):
    a, b = _leaves(a), _leaves(b)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    return a


@pytest.mark.slow
def test_resume_continues_the_same_curve(corpus_path, tmp_path):
    tc = TrainConfig(**TINY, seed=0)
    whole = train(tmp_path / "whole", tc, data_path=corpus_path, progress=False, log=lambda *_: None)
    train(tmp_path / "split", tc, data_path=corpus_path, progress=False, stop_after=3, log=lambda *_: None)
    state_file = train_lib.STATE_FILE
    state_at_3 = serialization.msgpack_restore((tmp_path / "split" / state_file).read_bytes())
    resumed = train(tmp_path / "split", tc, data_path=corpus_path, progress=False, resume=True,
                    log=lambda *_: None)
    assert resumed == whole
    # every parameter, bit for bit
    a, b = checkpoint.load(tmp_path / "whole"), checkpoint.load(tmp_path / "split")
    params = _assert_same_leaves(a.params, b.params)
    cfg = ModelConfig(V=65, T=32, d=16, L=1, heads=2)
    assert len(params) == len(_leaves(init_params(cfg, jax.random.PRNGKey(0))))  # none left out
    # every leaf of the optimizer state (Adam's moments, its step count, the clipping state), bit
    # for bit: a resume that restarted the moments or the schedule would differ here
    runs = ("whole", "split")
    state = [serialization.msgpack_restore((tmp_path / run / state_file).read_bytes()) for run in runs]
    leaves = _assert_same_leaves(*state)
    counts = [v for k, v in leaves.items() if "count" in k]
    assert counts and all(int(c) == 6 for c in counts)
    moments = [v for v in leaves.values() if v.dtype == np.float32 and v.size > 1]
    assert sum(v.size for v in moments) == 2 * sum(v.size for v in params.values())  # mu and nu
    # ... and the state really moved between the two halves (the comparison is not of constants)
    before = _leaves(state_at_3)
    assert any(not np.array_equal(before[k], leaves[k]) for k in leaves)
    progress = [json.loads((tmp_path / run / train_lib.PROGRESS_FILE).read_text()) for run in runs]
    for p in progress:
        p.pop("wall_s")
    assert progress[0] == progress[1]
    meta = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert meta["steps"] == 6 and meta["corpus_sha256"] and meta["characters_seen"] == 6 * 2 * 32
    # resuming with other settings is refused by name
    with pytest.raises(ValueError, match="lr"):
        train(tmp_path / "split", TrainConfig(**{**TINY, "steps": 8}, lr=1e-3), data_path=corpus_path,
              progress=False, resume=True, log=lambda *_: None)


@pytest.mark.slow
def test_loss_falls(corpus_path, tmp_path):
    """30 steps of a tiny model: the held-out loss falls well below its value at step 0 (about
    ln 65, a uniform guess) and so does the training loss. A learning rate of 0 leaves the
    parameters, hence the held-out loss, exactly at their step-0 values and fails this test."""
    tc = TrainConfig(d=16, L=1, heads=2, T=16, batch=8, steps=30, warmup=3, lr=1e-2, eval_every=10,
                     eval_windows=16)
    history = train(tmp_path / "run", tc, data_path=corpus_path, progress=False, log=lambda *_: None)
    assert [s for s, _ in history] == [10, 20, 30]
    vocab, _, windows = train_lib.prepare(data_lib.read_corpus(corpus_path), tc)
    cfg = ModelConfig(V=len(vocab), T=tc.T, d=tc.d, L=tc.L, heads=tc.heads)
    start = held_out_loss(init_params(cfg, jax.random.fold_in(jax.random.PRNGKey(tc.seed), 0)), cfg, windows)
    assert abs(start - math.log(65)) < 0.05  # the initial model is close to uniform
    final = history[-1][1]
    assert final < start - 0.4, (start, history)
    # the saved weights are the trained ones: their held-out loss is the last one reported
    lm = checkpoint.load(tmp_path / "run")
    assert held_out_loss(lm.params, lm.cfg, windows) == pytest.approx(final, abs=1e-5)
    train_loss = json.loads((tmp_path / "run" / train_lib.PROGRESS_FILE).read_text())["train_loss"]
    assert train_loss < start - 0.4


@pytest.mark.quick
def test_missing_corpus_error(tmp_path, monkeypatch):
    missing = tmp_path / "nope.txt"
    monkeypatch.setenv("JAXDECODE_DATA", str(missing))
    where = re.escape(str(missing))
    with pytest.raises(data_lib.CorpusError,
                       match=rf"^\$JAXDECODE_DATA points to {where}, which is not a file: get "):
        data_lib.read_corpus()
    with pytest.raises(data_lib.CorpusError, match=rf"^corpus not found at {where}: get "):
        data_lib.read_corpus(missing)


@pytest.mark.quick
@pytest.mark.parametrize("content,message", [
    (b"too short", "has only 9 characters, expected 1,115,394: get "),
    (b"\xff\xfe" + b"x" * 20000, r"could not be read as UTF-8 text \('utf-8' codec can't decode"),
], ids=["too-short", "not-utf8"])
def test_corrupt_corpus_error(tmp_path, content, message, capsys):
    p = tmp_path / "corpus.txt"
    p.write_bytes(content)
    with pytest.raises(data_lib.CorpusError, match=rf"^corpus at {re.escape(str(p))} {message}"):
        data_lib.read_corpus(p)
    # a valid training configuration, so that the command gets as far as reading the corpus
    argv = ["train", str(tmp_path / "out"), "--data", str(p), "--steps", "2", "--warmup", "1", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdecode: error:") and len(err.strip().splitlines()) == 1
    assert re.search(rf"corpus at {re.escape(str(p))} {message}", err)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.optimized
def test_shipped_checkpoint_loss_matches_its_record(corpus_path):
    try:
        lm = checkpoint.load()
    except checkpoint.CheckpointError as e:
        pytest.skip(str(e))
    meta = lm.meta
    text = data_lib.read_corpus(corpus_path)
    assert data_lib.sha256(text) == meta["corpus_sha256"]
    _, val = data_lib.split(text)
    windows = data_lib.eval_windows(lm.vocab.encode(val), lm.cfg.T, meta["held_out_windows"])
    assert abs(held_out_loss(lm.params, lm.cfg, windows) - meta["held_out_loss"]) < 0.01
    assert lm.cfg.T == 512 and meta["held_out_loss"] <= 1.65
