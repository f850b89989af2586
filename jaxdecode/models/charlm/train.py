"""Train the character model with optax: AdamW, linear warm-up then cosine decay, clipping.

Every random choice derives from one seed: the initial parameters from ``fold_in(key, 0)`` and
the windows of step ``s`` from ``fold_in(key_data, s)``, so a run is deterministic and a run
stopped and resumed from its checkpoint follows the same curve as one that never stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

from jaxdecode.models import checkpoint as ckpt_lib
from jaxdecode.io import data as data_lib
from jaxdecode.models.charlm.transformer import ModelConfig, forward, init_params
from jaxdecode.io.vocab import Vocab

STATE_FILE = "train_state.msgpack"
PROGRESS_FILE = "train_progress.json"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    d: int = 256
    L: int = 4
    heads: int = 4
    T: int = 512
    batch: int = 16
    steps: int = 1000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_windows: int = 64
    eval_T: int | None = None  # window length of the held-out evaluation (default: T)

    def __post_init__(self):
        for name in ("d", "L", "heads", "T", "batch", "steps", "eval_every", "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"train: {name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"train: lr must be > 0, got {self.lr}")
        if self.warmup < 0 or self.warmup >= self.steps:
            raise ValueError(f"train: warmup must lie in [0, steps), got {self.warmup}")


def make_optimizer(tc: TrainConfig):
    """AdamW with gradient clipping and a warmup-cosine schedule: ``(optimizer, schedule)``."""
    return _optimizer(tc.lr, tc.warmup, tc.steps, tc.min_lr_ratio, tc.clip, tc.weight_decay)


@functools.lru_cache(maxsize=8)  # one optimizer per setting, so that the jitted update is reused
def _optimizer(lr, warmup, steps, min_lr_ratio, clip, weight_decay):
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=max(warmup, 1), decay_steps=steps,
        end_value=lr * min_lr_ratio)

    def decay_mask(params):  # no weight decay on biases, LayerNorm and embeddings
        return jax.tree_util.tree_map_with_path(
            lambda path, _: path[-1].key == "kernel", params)

    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=weight_decay,
                                   mask=decay_mask)), schedule


def loss_fn(params, cfg: ModelConfig, x, y):
    logits = forward(params, cfg, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@functools.partial(jax.jit, static_argnames=("cfg",))
def _window_loss(params, w, *, cfg):
    return optax.softmax_cross_entropy_with_integer_labels(forward(params, cfg, w[:, :-1]), w[:, 1:]).sum()


@functools.partial(jax.jit, static_argnames=("cfg", "batch", "optimizer"))
def _update(params, opt_state, step, data_key, train_dev, *, cfg, batch, optimizer):
    """One optimizer step on a batch of windows drawn with ``fold_in(data_key, step)`` (the
    training tokens are an argument, not a constant of the program)."""
    x, y = data_lib.sample_windows(jax.random.fold_in(data_key, step), train_dev, batch, cfg.T)
    loss, grads = jax.value_and_grad(loss_fn)(params, cfg, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def held_out_loss(params, cfg: ModelConfig, windows: np.ndarray, chunk: int = 16) -> float:
    """Mean nats per character over fixed windows ``[n, W + 1]`` (all W positions of each)."""
    total = 0.0
    for i in range(0, len(windows), chunk):
        total += float(_window_loss(params, jnp.asarray(windows[i:i + chunk]), cfg=cfg))
    return total / (windows.shape[0] * (windows.shape[1] - 1))


def prepare(text: str, tc: TrainConfig):
    vocab = Vocab(sorted(set(text)))
    train_text, val_text = data_lib.split(text)
    train = vocab.encode(train_text)
    val = vocab.encode(val_text)
    windows = data_lib.eval_windows(val, tc.eval_T or tc.T, tc.eval_windows)
    return vocab, train, windows


def _check_out_dir(out_dir: Path, resume: bool) -> None:
    """Refuse to start a new run over an existing file, checkpoint or run in ``out_dir``."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file, not a folder to train into")
    if (out_dir / STATE_FILE).is_file():
        if not resume:
            raise ValueError(f"{out_dir} already holds a training run: continue it with resume=True "
                             "(--resume) or train into another folder")
    elif any(out_dir.iterdir()):
        what = "a checkpoint" if (out_dir / ckpt_lib.CONFIG_FILE).is_file() else "files"
        why = "to resume" if resume else "and would be overwritten"
        raise ValueError(f"{out_dir} already holds {what} but no training state ({STATE_FILE}) {why}: "
                         "train into another folder")


def train(out_dir, tc: TrainConfig, data_path=None, resume: bool = False, progress: bool = True,
          stop_after: int | None = None, log=print):
    """Train to ``tc.steps`` (or stop after ``stop_after`` steps of this call), saving to ``out_dir``.

    Returns the list of ``(step, held-out loss)`` evaluations made so far. Each save replaces the
    checkpoint folder atomically (weights, optimizer state and progress together), so an
    interrupted run keeps its last complete save. A folder that already holds something is never
    overwritten by a new run: only ``resume`` continues a run that saved its training state there.
    """
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, resume)
    text = data_lib.read_corpus(data_path)
    corpus_sha = data_lib.sha256(text)
    vocab, train_tokens, windows = prepare(text, tc)
    cfg = ModelConfig(V=len(vocab), T=tc.T, d=tc.d, L=tc.L, heads=tc.heads)
    optimizer, schedule = make_optimizer(tc)
    key = jax.random.PRNGKey(tc.seed)
    data_key = jax.random.fold_in(key, 1)

    params = init_params(cfg, jax.random.fold_in(key, 0))
    opt_state = optimizer.init(params)
    start, history, wall, train_loss = 0, [], 0.0, float("nan")
    if resume and (out_dir / STATE_FILE).is_file():
        prog = json.loads((out_dir / PROGRESS_FILE).read_text())
        # the run length may change on resume (the cosine schedule is then recomputed from the
        # current step on); every other setting must match the run being continued
        saved = {k: v for k, v in prog["train_config"].items() if k != "steps"}
        mine = {k: v for k, v in dataclasses.asdict(tc).items() if k != "steps"}
        if saved != mine:
            diff = {k: (saved.get(k), mine.get(k)) for k in saved.keys() | mine.keys() if saved.get(k) != mine.get(k)}
            raise ValueError(f"{out_dir}: cannot resume with different settings (saved, given): {diff}")
        if prog["step"] > tc.steps:
            raise ValueError(f"{out_dir}: already trained {prog['step']} steps, more than steps={tc.steps}")
        if prog["corpus_sha256"] != corpus_sha:
            raise ValueError(f"{out_dir}: cannot resume, it was trained on a different corpus")
        lm = ckpt_lib.load(out_dir)
        params = jax.tree_util.tree_map(jnp.asarray, lm.params)
        opt_state = serialization.from_bytes(opt_state, (out_dir / STATE_FILE).read_bytes())
        start, history, wall = prog["step"], [tuple(h) for h in prog["history"]], prog["wall_s"]
        if prog["train_config"]["steps"] != tc.steps:
            log(f"resuming with steps={tc.steps} (was {prog['train_config']['steps']})")
        train_loss = prog["train_loss"]
        log(f"resuming {out_dir} at step {start}")

    train_dev = jnp.asarray(train_tokens)

    update = functools.partial(_update, data_key=data_key, train_dev=train_dev, cfg=cfg, batch=tc.batch,
                               optimizer=optimizer)

    def save(step):
        meta = {
            "steps": step, "characters_seen": step * tc.batch * tc.T,
            "train_loss": round(train_loss, 4),
            "held_out_loss": round(history[-1][1], 4) if history else None,
            "held_out_windows": windows.shape[0], "held_out_window_chars": windows.shape[1] - 1,
            "wall_time_s": round(wall, 1), "corpus_sha256": corpus_sha,
            "parameters": cfg.num_params(), "train_config": dataclasses.asdict(tc),
            "loss_curve": [[s, round(v, 4)] for s, v in history],
        }
        prog = {"step": step, "history": history, "wall_s": wall, "train_loss": train_loss,
                "train_config": dataclasses.asdict(tc), "corpus_sha256": corpus_sha}
        ckpt_lib.save(out_dir, jax.device_get(params), cfg, vocab, meta=meta, extra_files={
            STATE_FILE: serialization.to_bytes(jax.device_get(opt_state)),
            PROGRESS_FILE: json.dumps(prog).encode()})

    end = tc.steps if stop_after is None else min(tc.steps, start + stop_after)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=tc.steps, initial=start, desc="train", dynamic_ncols=True)
    chars_per_step = tc.batch * tc.T
    for step in range(start, end):
        t0 = time.perf_counter()
        params, opt_state, loss = update(params, opt_state, jnp.int32(step))
        loss = float(loss)
        dt = time.perf_counter() - t0
        wall += dt
        train_loss = loss if math.isnan(train_loss) else 0.9 * train_loss + 0.1 * loss
        if not math.isfinite(loss):
            raise FloatingPointError(f"training diverged at step {step} (loss {loss})")
        done = step + 1
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", chars_s=f"{chars_per_step / dt:,.0f}",
                            lr=f"{float(schedule(step)):.2e}")
            bar.update(1)
        if done % tc.eval_every == 0 or done == tc.steps:
            t1 = time.perf_counter()
            val = held_out_loss(params, cfg, windows)
            wall += time.perf_counter() - t1
            history.append((done, val))
            log(f"step {done}: train {train_loss:.4f} held-out {val:.4f} nats/char "
                f"({wall:.0f} s, {done * chars_per_step / max(wall, 1e-9):,.0f} chars/s)")
            save(done)
    if bar is not None:
        bar.close()
    if end % tc.eval_every and end != tc.steps:
        save(end)
    return history
