import json

import numpy as np
import pytest

from jaxdecode import checkpoint
from jaxdecode import data as data_lib
from jaxdecode.cli import main
from jaxdecode.train import TrainConfig, held_out_loss, train

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


@pytest.mark.slow
def test_resume_continues_the_same_curve(corpus_path, tmp_path):
    tc = TrainConfig(**TINY, seed=0)
    whole = train(tmp_path / "whole", tc, data_path=corpus_path, progress=False, log=lambda *_: None)
    train(tmp_path / "split", tc, data_path=corpus_path, progress=False, stop_after=3, log=lambda *_: None)
    resumed = train(tmp_path / "split", tc, data_path=corpus_path, progress=False, resume=True,
                    log=lambda *_: None)
    assert resumed == whole
    a, b = checkpoint.load(tmp_path / "whole"), checkpoint.load(tmp_path / "split")
    for name in ("tok", "ln"):
        for leaf in a.params[name]:
            np.testing.assert_array_equal(a.params[name][leaf], b.params[name][leaf])
    meta = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert meta["steps"] == 6 and meta["corpus_sha256"] and meta["characters_seen"] == 6 * 2 * 32
    # resuming with other settings is refused by name
    with pytest.raises(ValueError, match="lr"):
        train(tmp_path / "split", TrainConfig(**{**TINY, "steps": 8}, lr=1e-3), data_path=corpus_path,
              progress=False, resume=True, log=lambda *_: None)


def test_missing_corpus_error(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDECODE_DATA", str(tmp_path / "nope.txt"))
    with pytest.raises(data_lib.CorpusError, match="JAXDECODE_DATA.*tinyshakespeare|JAXDECODE_DATA"):
        data_lib.read_corpus()
    with pytest.raises(data_lib.CorpusError, match="--data PATH"):
        data_lib.read_corpus(tmp_path / "nope.txt")


@pytest.mark.parametrize("content", [b"too short", b"\xff\xfe" + b"x" * 20000])
def test_corrupt_corpus_error(tmp_path, content, capsys):
    p = tmp_path / "corpus.txt"
    p.write_bytes(content)
    with pytest.raises(data_lib.CorpusError, match="1,115,394"):
        data_lib.read_corpus(p)
    assert main(["train", str(tmp_path / "out"), "--data", str(p), "--steps", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdecode: error:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
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
