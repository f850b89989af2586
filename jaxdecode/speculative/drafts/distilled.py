"""The distilled draft: an n-gram table of the target's own predictions over the corpus, cached
on disk (:func:`distilled_draft`)."""

from __future__ import annotations

import hashlib
import os
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

    bar = tqdm(total=J, desc="target predictions", unit="window", leave=False, disable=not progress)
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
    a cache that cannot be written only costs the next run the rebuild."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, keys=np.asarray(draft.keys), logp=np.asarray(draft.logits),
                     goto=np.asarray(draft.goto))
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"could not cache the distilled draft at {path}: {e}", stacklevel=3)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def distilled_draft(lm, data_path=None, *, n: int = DISTILLED_N, backoff: float = DISTILLED_BACKOFF,
                    train_fraction: float = 0.9, progress: bool = False) -> NGramDraft:
    """:meth:`NGramDraft.distill` of ``lm`` over the training split of the corpus, cached.

    Reading the corpus through the target takes a few minutes of CPU (the shipped model over a
    million characters: about 2 minutes on two cores), so the table is kept in
    :func:`jaxdecode.paths.cache_dir` ``("drafts")`` (``$JAXDECODE_CACHE/drafts``, default
    ``~/.cache/jaxdecode/drafts``) by a hash of the weights, the text and the settings, written
    atomically. A cache file that cannot be read is rebuilt. With ``$JAXDECODE_CACHE`` set to an
    empty string no cache file is read or written."""
    text = read_corpus(data_path)
    train = text[:int(train_fraction * len(text))]
    tokens = np.asarray(lm.vocab.encode(train), np.int32)
    folder = paths.cache_dir("drafts")
    if folder is None:  # caching off
        return NGramDraft.distill(lm.params, lm.cfg, tokens, n=n, backoff=backoff, progress=progress)
    path = folder / f"distilled-{_cache_key(lm, tokens, n, backoff)}.npz"
    if path.exists():
        try:
            with np.load(path) as f:
                return NGramDraft.from_table(f["keys"], f["logp"], n, True, f["goto"])
        except Exception as e:  # noqa: BLE001 - a damaged cache is rebuilt, not fatal
            warnings.warn(f"rebuilding the distilled draft: cannot read {path} ({e})", stacklevel=2)
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
