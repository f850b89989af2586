"""The optax training loop shared by every architecture ``jaxdecode train`` builds.

AdamW with gradient clipping and a linear warm-up then cosine decay, on random windows of a token
stream, with a held-out loss in nats per character evaluated periodically. An architecture hands
the loop a :class:`Recipe`: its initial parameters, a hashable logits function, the token streams,
and how its folder is written and read back (:mod:`jaxdecode.models.charlm.train` for the
character model, :mod:`jaxdecode.models.hf.train` for a Llama with a byte-level BPE vocabulary).

Every random choice derives from one seed: the windows of step ``s`` come from ``fold_in(key_data,
s)``, so a run is deterministic and a run stopped and resumed from its folder follows the same
curve as one that never stopped. Each save replaces the folder atomically (weights, optimizer
state and progress together).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

from jaxdecode.io import data as data_lib

STATE_FILE = "train_state.msgpack"
PROGRESS_FILE = "train_progress.json"
CONFIG_FILE = "config.json"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run's settings. ``arch`` ``"char"`` is the chapter's character model; ``"llama"``
    a Llama (RMSNorm, rotary positions, grouped-query attention, SwiGLU) over a byte-level BPE
    vocabulary of ``vocab_size`` tokens trained on the same split, ``T`` then counting tokens."""

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
    arch: str = "char"
    kv_heads: int | None = None  # llama: key/value heads (default: heads)
    ffn: int | None = None  # llama: the MLP's width (default: 8d/3 rounded up to a multiple of 32)
    vocab_size: int = 1024  # llama: BPE vocabulary, the end-of-text token included
    tokenizer: str | None = None  # llama: a folder whose tokenizer.json to use instead (a draft's)

    def __post_init__(self):
        for name in ("d", "L", "heads", "T", "batch", "steps", "eval_every", "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"train: {name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"train: lr must be > 0, got {self.lr}")
        if self.warmup < 0 or self.warmup >= self.steps:
            raise ValueError(f"train: warmup must lie in [0, steps), got {self.warmup}")
        if self.arch not in ("char", "llama"):
            raise ValueError(f"train: arch must be 'char' or 'llama', got {self.arch!r}")
        if self.d % self.heads:
            raise ValueError(f"train: d={self.d} is not divisible by heads={self.heads}")
        kv = self.kv_heads or self.heads
        if kv < 1 or self.heads % kv:
            raise ValueError(f"train: heads={self.heads} is not a multiple of kv_heads={kv}")
        if self.arch == "llama" and not 258 <= self.vocab_size <= 65536:
            raise ValueError(f"train: vocab_size must lie in [258, 65536] (256 bytes, the end token and "
                             f"at least one merge), got {self.vocab_size}")
        if self.ffn is not None and self.ffn < 1:
            raise ValueError(f"train: ffn must be >= 1, got {self.ffn}")


@dataclasses.dataclass
class Recipe:
    """What the loop needs of an architecture.

    ``logits(params, x)`` must be hashable (it is a static argument of the compiled step).
    ``window_chars`` is the number of characters of held-out text that the targets of
    ``windows`` stand for, so that the held-out loss is in nats per character whatever a token
    is. ``save(out_dir, params, meta, extra_files)`` writes the folder atomically and
    ``load_params(out_dir)`` reads its parameters back exactly (float32)."""

    logits: Callable
    params: Any
    train_tokens: np.ndarray
    windows: np.ndarray
    window_chars: float
    corpus_sha: str
    num_params: int
    decayed: tuple  # names of the leaves under weight decay
    save: Callable
    load_params: Callable


def make_optimizer(tc: TrainConfig, decayed: tuple = ("kernel",)):
    """AdamW with gradient clipping and a warmup-cosine schedule: ``(optimizer, schedule)``; weight
    decay applies to the leaves named in ``decayed`` (matrices; not biases, norms or embeddings)."""
    return _optimizer(tc.lr, tc.warmup, tc.steps, tc.min_lr_ratio, tc.clip, tc.weight_decay, tuple(decayed))


@functools.lru_cache(maxsize=8)  # one optimizer per setting, so that the jitted update is reused
def _optimizer(lr, warmup, steps, min_lr_ratio, clip, weight_decay, decayed):
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=max(warmup, 1), decay_steps=steps,
        end_value=lr * min_lr_ratio)

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) in decayed,
                                                params)

    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=weight_decay,
                                   mask=decay_mask)), schedule


@functools.partial(jax.jit, static_argnames=("logits",))
def _window_nats(params, w, *, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, w[:, :-1]), w[:, 1:]).sum()


def window_nats(params, logits, windows: np.ndarray, chunk: int = 16) -> float:
    """Total nats of every target of the fixed windows ``[n, W + 1]``."""
    total = 0.0
    for i in range(0, len(windows), chunk):
        total += float(_window_nats(params, jnp.asarray(windows[i:i + chunk]), logits=logits))
    return total


@functools.partial(jax.jit, static_argnames=("logits", "batch", "T", "optimizer"))
def _update(params, opt_state, step, data_key, train_dev, *, logits, batch, T, optimizer):
    """One optimizer step on a batch of windows drawn with ``fold_in(data_key, step)`` (the
    training tokens are an argument, not a constant of the program)."""
    x, y = data_lib.sample_windows(jax.random.fold_in(data_key, step), train_dev, batch, T)

    def loss_fn(p):
        return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def check_out_dir(out_dir: Path, resume: bool) -> None:
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
        what = "a checkpoint" if (out_dir / CONFIG_FILE).is_file() else "files"
        why = "to resume" if resume else "and would be overwritten"
        raise ValueError(f"{out_dir} already holds {what} but no training state ({STATE_FILE}) {why}: "
                         "train into another folder")


def fit(out_dir, tc: TrainConfig, recipe: Recipe, resume: bool = False, progress: bool = True,
        stop_after: int | None = None, log=print):
    """Train ``recipe`` to ``tc.steps`` (or stop after ``stop_after`` steps of this call), saving
    to ``out_dir`` at every evaluation; returns the ``(step, held-out loss)`` evaluations so far."""
    out_dir = Path(out_dir)
    optimizer, schedule = make_optimizer(tc, recipe.decayed)
    data_key = jax.random.fold_in(jax.random.PRNGKey(tc.seed), 1)
    params = recipe.params
    opt_state = optimizer.init(params)
    start, history, wall, train_loss = 0, [], 0.0, float("nan")
    if resume and (out_dir / STATE_FILE).is_file():
        prog = json.loads((out_dir / PROGRESS_FILE).read_text())
        # the run length may change on resume (the cosine schedule is then recomputed from the
        # current step on); every other setting must match the run being continued
        saved = {k: v for k, v in prog["train_config"].items() if k != "steps"}
        mine = {k: v for k, v in dataclasses.asdict(tc).items() if k != "steps"}
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name != "steps"}
        saved = {k: v for k, v in defaults.items() if k not in saved} | saved  # runs saved before a field
        if saved != mine:
            diff = {k: (saved.get(k), mine.get(k)) for k in saved.keys() | mine.keys() if saved.get(k) != mine.get(k)}
            raise ValueError(f"{out_dir}: cannot resume with different settings (saved, given): {diff}")
        if prog["step"] > tc.steps:
            raise ValueError(f"{out_dir}: already trained {prog['step']} steps, more than steps={tc.steps}")
        if prog["corpus_sha256"] != recipe.corpus_sha:
            raise ValueError(f"{out_dir}: cannot resume, it was trained on a different corpus")
        params = jax.tree_util.tree_map(jnp.asarray, recipe.load_params(out_dir))
        opt_state = serialization.from_bytes(opt_state, (out_dir / STATE_FILE).read_bytes())
        start, history, wall = prog["step"], [tuple(h) for h in prog["history"]], prog["wall_s"]
        if prog["train_config"]["steps"] != tc.steps:
            log(f"resuming with steps={tc.steps} (was {prog['train_config']['steps']})")
        train_loss = prog["train_loss"]
        log(f"resuming {out_dir} at step {start}")

    train_dev = jnp.asarray(recipe.train_tokens)
    update = functools.partial(_update, data_key=data_key, train_dev=train_dev, logits=recipe.logits,
                               batch=tc.batch, T=tc.T, optimizer=optimizer)
    windows = recipe.windows
    unit = "char" if tc.arch == "char" else "token"

    def save(step):
        char = unit == "char"  # a window's targets are its characters; a token's vary
        meta = {
            "steps": step, "characters_seen" if char else "tokens_seen": step * tc.batch * tc.T,
            "train_loss": round(train_loss, 4),
            "held_out_loss": round(history[-1][1], 4) if history else None,
            "held_out_windows": windows.shape[0], f"held_out_window_{unit}s": windows.shape[1] - 1,
            **({} if char else {"held_out_chars": round(recipe.window_chars)}),
            "wall_time_s": round(wall, 1), "corpus_sha256": recipe.corpus_sha,
            "parameters": recipe.num_params, "train_config": dataclasses.asdict(tc),
            "loss_curve": [[s, round(v, 4)] for s, v in history],
        }
        prog = {"step": step, "history": history, "wall_s": wall, "train_loss": train_loss,
                "train_config": dataclasses.asdict(tc), "corpus_sha256": recipe.corpus_sha}
        recipe.save(out_dir, jax.device_get(params), meta, {
            STATE_FILE: serialization.to_bytes(jax.device_get(opt_state)),
            PROGRESS_FILE: json.dumps(prog).encode()})

    end = tc.steps if stop_after is None else min(tc.steps, start + stop_after)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=tc.steps, initial=start, desc="train", dynamic_ncols=True)
    per_step = tc.batch * tc.T
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
            bar.set_postfix(loss=f"{loss:.3f}", **{f"{unit}s_s": f"{per_step / dt:,.0f}"},
                            lr=f"{float(schedule(step)):.2e}")
            bar.update(1)
        if done % tc.eval_every == 0 or done == tc.steps:
            t1 = time.perf_counter()
            val = window_nats(params, recipe.logits, windows) / recipe.window_chars
            wall += time.perf_counter() - t1
            history.append((done, val))
            log(f"step {done}: train {train_loss:.4f} nats/{unit}, held-out {val:.4f} nats/char "
                f"({wall:.0f} s, {done * per_step / max(wall, 1e-9):,.0f} {unit}s/s)")
            save(done)
    if bar is not None:
        bar.close()
    if end % tc.eval_every and end != tc.steps:
        save(end)
    return history
