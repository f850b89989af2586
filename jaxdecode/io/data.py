"""The Tiny Shakespeare corpus: locate it, split it like the book, draw training windows."""

from __future__ import annotations

import hashlib
import os
import urllib.request
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

CORPUS_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
CORPUS_CHARS = 1_115_394
DEFAULT_PATH = Path("data") / "tinyshakespeare.txt"


class CorpusError(RuntimeError):
    """The corpus is missing or not the expected file."""


HOW_TO_GET = (
    "get Tiny Shakespeare (the char-rnn input.txt, 1,115,394 characters) from "
    f"{CORPUS_URL} and pass --data PATH, set $JAXDECODE_DATA, or put it at {DEFAULT_PATH}"
)


def locate_corpus(path: str | os.PathLike | None = None, download: bool = True) -> Path:
    """Find the corpus: ``path``, then ``$JAXDECODE_DATA``, then ``data/tinyshakespeare.txt``,
    then a download into that path (never with ``$JAXDECODE_OFFLINE`` set to 1)."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise CorpusError(f"corpus not found at {p}: {HOW_TO_GET}")
        return p
    env = os.environ.get("JAXDECODE_DATA")
    if env:
        p = Path(env)
        if not p.is_file():
            raise CorpusError(f"$JAXDECODE_DATA points to {p}, which is not a file: {HOW_TO_GET}")
        return p
    if DEFAULT_PATH.is_file():
        return DEFAULT_PATH
    if download and os.environ.get("JAXDECODE_OFFLINE", "") not in ("1", "true", "yes"):
        return _download(DEFAULT_PATH)
    raise CorpusError(f"corpus not found: {HOW_TO_GET}")


def _download(dest: Path) -> Path:
    """Download the corpus to ``dest``. Its folder is created only once the whole file has arrived
    and checks out; a failed or partial download leaves nothing behind (no file, no folder)."""
    import http.client
    import sys

    print(f"jaxdecode: downloading the corpus from {CORPUS_URL} to {dest}", file=sys.stderr, flush=True)
    try:
        with urllib.request.urlopen(CORPUS_URL, timeout=20) as r:
            data = r.read()
        text = data.decode("utf-8")
    except (OSError, http.client.HTTPException, UnicodeDecodeError, ValueError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise CorpusError(f"corpus not found and the download failed ({reason}): {HOW_TO_GET}") from None
    if len(text) != CORPUS_CHARS:
        raise CorpusError(f"corpus not found and the download is not the expected file ({len(text):,} "
                          f"characters, expected {CORPUS_CHARS:,}): {HOW_TO_GET}")
    made = [p for p in reversed(dest.parents) if not p.exists()]  # the folders this call creates
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        tmp.replace(dest)  # atomic: a reader never sees half the file
    except OSError as e:
        tmp.unlink(missing_ok=True)
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:
                break
        raise CorpusError(f"corpus downloaded but could not be written to {dest} ({e.strerror or e}): "
                          f"{HOW_TO_GET}") from None
    return dest


def read_corpus(path=None) -> str:
    p = locate_corpus(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise CorpusError(f"corpus at {p} could not be read as UTF-8 text ({e}): {HOW_TO_GET}") from None
    if len(text) < 10_000:
        raise CorpusError(f"corpus at {p} has only {len(text)} characters, expected {CORPUS_CHARS:,}: {HOW_TO_GET}")
    return text


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def split(text: str) -> tuple[str, str]:
    """First 90% for training, last 10% held out (the book's split)."""
    n = int(0.9 * len(text))
    return text[:n], text[n:]


def sample_windows(key: jax.Array, data: jax.Array, batch: int, T: int):
    """``batch`` random windows of ``T + 1`` tokens: inputs ``[batch, T]`` and targets."""
    starts = jax.random.randint(key, (batch,), 0, data.shape[0] - T - 1)
    idx = starts[:, None] + jnp.arange(T + 1)[None, :]
    w = data[idx]
    return w[:, :-1], w[:, 1:]


def eval_windows(data: np.ndarray, T: int, count: int) -> np.ndarray:
    """``count`` evenly spaced, fixed windows of ``T + 1`` tokens (for a held-out loss)."""
    count = max(1, min(count, (len(data) - 1) // T))
    starts = np.linspace(0, len(data) - T - 1, count).astype(np.int64)
    return np.stack([data[s:s + T + 1] for s in starts])
