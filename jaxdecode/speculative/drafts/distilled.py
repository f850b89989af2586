"""The distilled draft: an n-gram table of the target's own predictions over the corpus, cached
on disk (:func:`distilled_draft`)."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import warnings

import jax
import numpy as np

from jaxdecode.io import paths
from jaxdecode.io.data import read_corpus
from jaxdecode.speculative.drafts.ngram import NGramDraft, target_predictions


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


def estimated_seconds(cfg, tokens: int) -> float:
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
    :func:`jaxdecode.io.paths.cache_dir` ``("drafts")`` (``$JAXDECODE_CACHE/drafts``, default
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
        return NGramDraft.distill(lm.decoder, lm.params, tokens, n=n, backoff=backoff, progress=progress)
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
        draft = NGramDraft.distill(lm.decoder, lm.params, tokens, n=n, backoff=backoff, progress=progress)
        _save(draft, path)
    return draft


def build(lm, data_path=None, *, n: int | None = None, backoff: float | None = None,
           progress: bool = False) -> NGramDraft:
    return distilled_draft(lm, data_path, n=DISTILLED_N if n is None else n,
                           backoff=DISTILLED_BACKOFF if backoff is None else backoff, progress=progress)


__all__ = ["DISTILLED_BACKOFF", "DISTILLED_N", "distilled_draft", "target_predictions"]
