"""Reports: deterministic, atomic output files (JSON, Markdown, figures) and a progress bar, for
the studies and the serving benchmark.

Every study writes ``NAME.json`` (its numbers), one or more ``NAME*.png`` (its figures) and
``NAME.md`` (a short summary that links the figures) into its output folder. Each file is
written to a temporary file in the same folder and moved into place with :func:`os.replace`, so
a reader (or a second run) never sees half a file. The JSON is deterministic: the same result
gives the same bytes (floats rounded to :data:`SIGNIFICANT` significant digits, numpy values
turned into plain numbers, non-finite floats written as ``null``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from jaxdecode.io.files import atomic_write as _atomic_write

SIGNIFICANT = 6  # significant digits of every float in a study's JSON


# ----------------------------------------------------------------------------- values


def round_float(x: float, digits: int = SIGNIFICANT) -> float | None:
    """``x`` rounded to ``digits`` significant digits; ``None`` for NaN and infinities."""
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def clean(obj, digits: int = SIGNIFICANT):
    """``obj`` as plain JSON values: dicts (keys as strings, order kept), lists, strings,
    ints, bools, ``None`` and floats rounded by :func:`round_float`. numpy scalars and arrays,
    tuples and paths are converted."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, np.generic):
        return clean(obj.item(), digits)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return round_float(obj, digits)
    if isinstance(obj, Mapping):
        return {str(k): clean(v, digits) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return clean(obj.tolist(), digits)
    if isinstance(obj, (list, tuple)):
        return [clean(v, digits) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"cannot write a {type(obj).__name__} to a study's JSON")


# ----------------------------------------------------------------------------- atomic files


def write_json(path, obj) -> dict:
    """Write ``obj`` (cleaned by :func:`clean`) as indented JSON, atomically; return what was
    written, so that a study can return exactly the numbers in its file."""
    doc = clean(obj)
    data = (json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
    _atomic_write(path, lambda f: f.write(data))
    return doc


def write_markdown(path, text: str) -> Path:
    """Write ``text`` (ending in one newline) atomically."""
    data = (text.rstrip("\n") + "\n").encode("utf-8")
    return _atomic_write(path, lambda f: f.write(data))


class MissingMatplotlib(RuntimeError):
    """matplotlib, which draws the studies' figures, cannot be imported."""


def require_matplotlib() -> None:
    """Raise :class:`MissingMatplotlib` (one line, with the fix) unless matplotlib imports: a study
    never ends without the figure it promises, and the command line checks before any work."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError as e:
        raise MissingMatplotlib(f"the studies' figures need matplotlib, which cannot be imported ({e}): "
                                "pip install 'matplotlib>=3.8'") from None


def new_figure(nrows: int = 1, ncols: int = 1, figsize=(9, 3.5)):
    """A matplotlib figure and its axes, without pyplot (no global state, no GUI backend);
    :class:`MissingMatplotlib` without matplotlib."""
    require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def save_figure(fig, path, dpi: int = 120) -> Path:
    """Save ``fig`` (format from the suffix of ``path``) atomically."""
    path = Path(path)
    fmt = path.suffix.lstrip(".") or "png"
    # no "Software" entry: the file does not depend on the matplotlib version
    metadata = {"Software": None} if fmt == "png" else None
    fig.tight_layout()
    return _atomic_write(path, lambda f: fig.savefig(f, format=fmt, dpi=dpi, metadata=metadata))


# ----------------------------------------------------------------------------- markdown


def md_text(s: str, limit: int | None = None) -> str:
    """``s`` as inline code in a table cell: line breaks shown as ``\\n``, pipes escaped."""
    if limit is not None and len(s) > limit:
        s = s[:limit] + "…"
    s = s.replace("\\", "\\\\").replace("\n", "\\n").replace("|", "\\|").replace("`", "'")
    return f"`{s}`"


def md_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A Markdown table; cells are formatted with ``str``."""
    lines = ["| " + " | ".join(map(str, headers)) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def fmt(x, spec: str = ".2f", none: str = "–") -> str:
    """``x`` formatted with ``spec``, or ``none`` for ``None``."""
    return none if x is None else format(x, spec)


# ----------------------------------------------------------------------------- progress


def progress_bar(total: int | None, desc: str, enabled: bool = True):
    """A tqdm bar on stderr (``enabled=False``: a silent one with the same methods)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, leave=False,
                dynamic_ncols=True)


def output_folder(out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out
