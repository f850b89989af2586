"""The distilled draft: an n-gram table of the target's own predictions over the corpus, cached
on disk (:func:`distilled_draft`)."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ... import model as M
from ... import paths
from ...data import read_corpus
from . import register_draft
from .ngram import NGramDraft


def target_predictions(params, cfg: M.ModelConfig, tokens, *, stride: int | None = None,
                       batch: int = 16, progress: bool = False) -> np.ndarray:
    """``[N, V]`` float32: row ``i`` is the target's next-token distribution for token ``i``
    given the tokens before it (row 0, which has none, is the one-hot of token 0).

    The text is read in windows of ``T`` tokens starting every ``stride`` (default ``3 T / 4``):
    the first window gives the predictions for tokens 1 .. T, window ``j >= 1`` (starting at
    ``s = j * stride``) those for tokens ``s + T - stride + 1 .. s + T``. A prediction therefore
    sees all earlier tokens up to ``T``, and at least ``T - stride`` of them beyond.
    ``progress`` shows a progress bar (tqdm) on stderr."""
    T, V = cfg.T, cfg.V
    stride = (3 * T) // 4 if stride is None else stride
    if not isinstance(stride, int) or not 1 <= stride <= T:
        raise ValueError(f"target_predictions: stride must be an integer in [1, T={T}], got {stride!r}")
    if batch < 1:
        raise ValueError(f"target_predictions: batch must be >= 1, got {batch}")
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    N = len(tokens)
    if N and (tokens.min() < 0 or tokens.max() >= V):
        raise ValueError(f"target_predictions: token ids must lie in [0, {V})")
    out = np.zeros((N, V), np.float32)
    if N == 0:
        return out
    out[0, tokens[0]] = 1.0
    J = 1 + -(-max(0, N - 1 - T) // stride)  # windows until token N - 1 is predicted
    padded = np.zeros(((J - 1) * stride + T + 1,), np.int32)
    padded[:N] = tokens
    starts = np.arange(J) * stride
    probs = jax.jit(lambda p, w: jax.nn.softmax(M.forward(p, cfg, w), axis=-1))  # weights as arguments
    from tqdm import tqdm

    bar = tqdm(total=J, desc="target predictions", unit="window", leave=False, disable=not progress,
               file=sys.stderr)
    for b0 in range(0, J, batch):
        part = starts[b0:b0 + batch]
        idx = np.concatenate([part, np.full(batch - len(part), part[-1])])  # one compiled shape
        windows = padded[idx[:, None] + np.arange(T)[None, :]]
        p = np.asarray(probs(params, jnp.asarray(windows)))
        for j, s in enumerate(part):
            first = 0 if s == 0 else T - stride  # window position of the first kept prediction
            lo, hi = s + first + 1, min(s + T + 1, N)  # the tokens it predicts
            if hi > lo:
                out[lo:hi] = p[j, first:first + hi - lo]
        bar.update(len(part))
    bar.close()
    return out


DISTILLED_N = 6
DISTILLED_BACKOFF = 2.0


def _cache_key(lm, tokens: np.ndarray, n: int, backoff: float) -> str:
    """A hash of the weights, the text and the settings: the cache file's name."""
    h = hashlib.sha256()
    h.update(f"distilled-v2 n={n} backoff={backoff!r} V={lm.cfg.V} cfg={lm.cfg}".encode())
    for leaf in jax.tree_util.tree_leaves(lm.params):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    h.update(tokens.tobytes())
    return h.hexdigest()[:24]


def _save(draft: NGramDraft, path) -> None:
    """Write ``draft``'s table to ``path`` atomically (a temporary file, then ``os.replace``);
    a cache that cannot be written only costs the next run the rebuild. Whatever interrupts the
    writing (``KeyboardInterrupt`` included) leaves the previous file as it was and no temporary
    file behind."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, keys=np.asarray(draft.keys), logp=np.asarray(draft.logits),
                     goto=np.asarray(draft.goto))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        warnings.warn(f"could not cache the distilled draft at {path}: {e}", stacklevel=3)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _read(path, n: int, quiet: bool = False) -> NGramDraft | None:
    """The cached table at ``path``, or None if there is none or it cannot be read (warned)."""
    if not path.exists():
        return None
    try:
        with np.load(path) as f:
            return NGramDraft.from_table(f["keys"], f["logp"], n, True, f["goto"])
    except Exception as e:  # noqa: BLE001 - a damaged cache is rebuilt, not fatal
        if not quiet:
            warnings.warn(f"rebuilding the distilled draft: cannot read {path} ({e})", stacklevel=3)
        return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def estimated_seconds(cfg: M.ModelConfig, tokens: int) -> float:
    """A rough build time: the forward passes' floating-point operations (windows of ``T`` every
    ``3 T / 4`` tokens) at about 30 GFLOP/s per core, plus the table."""
    d, L, T, V = cfg.d, cfg.L, cfg.T, cfg.V
    per_token = (4 / 3) * (24 * L * d * d + 2 * L * T * d + 2 * d * V)
    return tokens * per_token / (30e9 * min(_cores(), 16)) + tokens * 1e-5


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    if minutes < 1:
        return "under a minute"
    return "about 1 minute" if minutes == 1 else f"about {minutes} minutes"


def _notice(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def distilled_draft(lm, data_path=None, *, n: int = DISTILLED_N, backoff: float = DISTILLED_BACKOFF,
                    train_fraction: float = 0.9, progress: bool = False) -> NGramDraft:
    """:meth:`NGramDraft.distill` of ``lm`` over the training split of the corpus, cached.

    Reading the corpus through the target takes a few minutes of CPU (the shipped model over a
    million characters: about 2 minutes on two cores), so the table is kept in
    :func:`jaxdecode.paths.cache_dir` ``("drafts")`` (``$JAXDECODE_CACHE/drafts``, default
    ``~/.cache/jaxdecode/drafts``) by a hash of the weights, the text and the settings, written
    atomically. A cache file that cannot be read is rebuilt. With ``$JAXDECODE_CACHE`` set to an
    empty string no cache file is read or written.

    Processes that need the same table at once build it once: the first holds a lock (a ``.lock``
    file next to the table) while it builds, the others wait for it and read its file.
    ``progress`` prints a one-line notice and a progress bar on stderr before a build."""
    text = read_corpus(data_path)
    train = text[:int(train_fraction * len(text))]
    tokens = np.asarray(lm.vocab.encode(train), np.int32)
    folder = paths.cache_dir("drafts")
    took = _duration(estimated_seconds(lm.cfg, len(tokens)))
    if folder is None:  # caching off
        if progress:
            _notice(f"building the distilled draft ({took}; caching is off, so it is not kept)")
        return NGramDraft.distill(lm.params, lm.cfg, tokens, n=n, backoff=backoff, progress=progress)
    path = folder / f"distilled-{_cache_key(lm, tokens, n, backoff)}.npz"
    draft = _read(path, n)
    if draft is not None:
        return draft

    def waiting():
        if progress:
            _notice(f"waiting for another process building the distilled draft at {path}")

    with paths.lock(path.with_name(path.name + ".lock"), on_wait=waiting):
        draft = _read(path, n, quiet=True)  # another process may have built it meanwhile
        if draft is not None:
            return draft
        if progress:
            _notice(f"building the distilled draft (once, {took}); cached at {path}")
        draft = NGramDraft.distill(lm.params, lm.cfg, tokens, n=n, backoff=backoff, progress=progress)
        _save(draft, path)
    return draft


@register_draft("distilled", "an n-gram table of the model's own predictions over the corpus's "
                             "training split (default: 6-gram, backoff 2); built once (minutes), cached")
def _build(lm, data_path=None, *, n: int | None = None, backoff: float | None = None,
           progress: bool = False) -> NGramDraft:
    return distilled_draft(lm, data_path, n=DISTILLED_N if n is None else n,
                           backoff=DISTILLED_BACKOFF if backoff is None else backoff, progress=progress)


__all__ = ["DISTILLED_BACKOFF", "DISTILLED_N", "distilled_draft", "target_predictions"]
