"""Train the character model: the chapter's transformer as a :class:`~jaxdecode.models.training.Recipe`
of the shared optax loop (:func:`jaxdecode.models.training.fit`).

The initial parameters come from ``fold_in(key, 0)`` of the run's seed and the windows of step
``s`` from ``fold_in(key_data, s)``; the held-out loss is the mean nats per character over fixed
windows of the last 10% of the corpus.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from jaxdecode.io import data as data_lib
from jaxdecode.io.vocab import Vocab
from jaxdecode.models import checkpoint as ckpt_lib
from jaxdecode.models.charlm.transformer import ModelConfig, forward, init_params
from jaxdecode.models.training import (  # noqa: F401  (the names tests and the CLI import from here)
    PROGRESS_FILE,
    STATE_FILE,
    Recipe,
    TrainConfig,
    check_out_dir,
    fit,
    make_optimizer,
    window_nats,
)


@dataclasses.dataclass(frozen=True)
class _Logits:
    """The character model's logits as a hashable function of ``(params, x)``."""

    cfg: ModelConfig

    def __call__(self, params, x):
        return forward(params, self.cfg, x)


def held_out_loss(params, cfg: ModelConfig, windows, chunk: int = 16) -> float:
    """Mean nats per character over fixed windows ``[n, W + 1]`` (all W positions of each)."""
    return window_nats(params, _Logits(cfg), windows, chunk) / (windows.shape[0] * (windows.shape[1] - 1))


def prepare(text: str, tc: TrainConfig):
    vocab = Vocab(sorted(set(text)))
    train_text, val_text = data_lib.split(text)
    train = vocab.encode(train_text)
    val = vocab.encode(val_text)
    windows = data_lib.eval_windows(val, tc.eval_T or tc.T, tc.eval_windows)
    return vocab, train, windows


def train(out_dir, tc: TrainConfig, data_path=None, resume: bool = False, progress: bool = True,
          stop_after: int | None = None, log=print):
    """Train to ``tc.steps`` (or stop after ``stop_after`` steps of this call), saving to ``out_dir``.

    Returns the list of ``(step, held-out loss)`` evaluations made so far. Each save replaces the
    checkpoint folder atomically (weights, optimizer state and progress together), so an
    interrupted run keeps its last complete save. A folder that already holds something is never
    overwritten by a new run: only ``resume`` continues a run that saved its training state there.
    ``tc.arch == "llama"`` trains a Llama with a BPE vocabulary instead
    (:func:`jaxdecode.models.hf.train.recipe`).
    """
    out_dir = Path(out_dir)
    check_out_dir(out_dir, resume)
    text = data_lib.read_corpus(data_path)
    if tc.arch == "llama":
        from jaxdecode.models.hf.train import recipe as llama_recipe

        return fit(out_dir, tc, llama_recipe(text, tc, out_dir, resume), resume, progress, stop_after, log)
    vocab, train_tokens, windows = prepare(text, tc)
    cfg = ModelConfig(V=len(vocab), T=tc.T, d=tc.d, L=tc.L, heads=tc.heads)

    def save(folder, params, meta, extra_files):
        ckpt_lib.save(folder, params, cfg, vocab, meta=meta, extra_files=extra_files)

    recipe = Recipe(
        logits=_Logits(cfg), params=init_params(cfg, jax.random.fold_in(jax.random.PRNGKey(tc.seed), 0)),
        train_tokens=train_tokens, windows=windows, window_chars=windows.shape[0] * (windows.shape[1] - 1),
        corpus_sha=data_lib.sha256(text), num_params=cfg.num_params(), decayed=("kernel",), save=save,
        load_params=lambda folder: ckpt_lib.load(folder).params)
    return fit(out_dir, tc, recipe, resume, progress, stop_after, log)
