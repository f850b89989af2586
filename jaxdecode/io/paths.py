"""Where jaxdecode keeps what it builds or caches: one place, one rule.

``$JAXDECODE_CACHE`` names the folder (default ``~/.cache/jaxdecode``); set to an empty string it
turns every on-disk cache off (distilled drafts). The native CPU layer is the
exception: it must be compiled somewhere to be loaded, so with caching off it is built into a
temporary folder for the process.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ENV = "JAXDECODE_CACHE"


def cache_root() -> Path | None:
    """The cache folder, or None when ``$JAXDECODE_CACHE`` is set to an empty string (caching off)."""
    value = os.environ.get(ENV)
    if value is None:
        return Path(os.path.expanduser("~")) / ".cache" / "jaxdecode"
    return Path(value) if value.strip() else None


def cache_dir(kind: str) -> Path | None:
    """``cache_root() / kind`` (``"kernels"``, ``"drafts"``), or None when caching is off."""
    root = cache_root()
    return None if root is None else root / kind


@contextlib.contextmanager
def lock(path, on_wait=None):
    """Hold an exclusive lock on the file ``path`` (created if needed) for a ``with`` block.

    A second process asking for the same lock waits until the first leaves its block, calling
    ``on_wait()`` once before it starts waiting. Builders of a cached file use it so that one
    process builds while the others wait and then read the result. The lock file stays (removing
    it would let a third process lock a new file while the second still holds the old one). Where
    files cannot be locked (no ``fcntl``, a read-only folder) the block runs unlocked.
    """
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        yield
        return
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks
            pass
        yield
    finally:
        os.close(fd)  # releases the lock
