"""Atomic writes: a file (:func:`atomic_write`) or a whole folder (:func:`atomic_folder`) appears
complete or not at all; a reader or a second run never sees half of one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path


def atomic_write(path, write) -> Path:
    """Call ``write(file)`` on a new temporary file next to ``path``, then move it onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    # os.open with 0o666 lets the umask decide the permissions, as for any new file
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


class _AtomicFolder:
    """Write into a temporary sibling folder; move it into place only if everything succeeded.

    Whatever interrupts the writing (an error, ``KeyboardInterrupt``), the previous folder stays
    as it was and the temporary one is removed. The files are flushed to disk before the folder is
    moved into place, so a crash cannot publish a folder of empty files either."""

    def __init__(self, target: Path, overwrite: bool, error: type[Exception]):
        self.target = Path(target)
        self.overwrite = overwrite
        self.error = error

    def __enter__(self) -> Path:
        if self.target.exists() and not self.target.is_dir():
            raise self.error(f"{self.target} is a file, not a folder: refusing to replace it")
        if self.target.exists() and not self.overwrite:
            raise self.error(f"{self.target} already exists (use overwrite=True / --force)")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", dir=self.target.parent))
        return self.tmp

    def _publish_permissions(self):
        # mkdtemp makes a private folder; give the result the permissions of a normal folder
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)
        for f in self.tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)

    def _sync(self):
        for f in self.tmp.iterdir():
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:  # any exception, KeyboardInterrupt included
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        old = None
        try:
            self._publish_permissions()
            self._sync()
            if self.target.exists():
                # the old folder steps aside under a fresh name, the new one takes its place
                old = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.old.", dir=self.target.parent))
                os.replace(self.target, old)
            os.replace(self.tmp, self.target)
        except BaseException:
            if old is not None and old.exists() and not self.target.exists():
                os.replace(old, self.target)  # put the previous folder back
            shutil.rmtree(self.tmp, ignore_errors=True)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            raise
        _fsync_dir(self.target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return False


def _fsync_dir(folder: Path) -> None:
    """Make a rename inside ``folder`` durable (best effort: not every system allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_folder(target, overwrite: bool = True, error: type[Exception] = FileExistsError) -> _AtomicFolder:
    """A context manager: write files into the temporary folder it yields; on a clean exit the folder
    replaces ``target`` in one rename (on an exception it is removed). ``error``: what is raised when
    ``target`` is a file, or exists and ``overwrite`` is False."""
    return _AtomicFolder(Path(target), overwrite, error)


def read_json(path, error: type[Exception] = ValueError, *, object_only: bool = True):
    """The JSON value in ``path``; a file that cannot be read or parsed (or, with ``object_only``,
    holds no JSON object) is one ``error`` sentence naming the file and the problem."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    if object_only and not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object")
    return value
