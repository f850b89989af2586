"""Where jaxdecode keeps what it builds or caches: one place, one rule.

``$JAXDECODE_CACHE`` names the folder (default ``~/.cache/jaxdecode``); set to an empty string it
turns every on-disk cache off (compiled programs, distilled drafts). The native CPU layer is the
exception: it must be compiled somewhere to be loaded, so with caching off it is built into a
temporary folder for the process.
"""

from __future__ import annotations

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
    """``cache_root() / kind`` (``"kernels"``, ``"drafts"``, ``"xla"``), or None when caching is off."""
    root = cache_root()
    return None if root is None else root / kind
