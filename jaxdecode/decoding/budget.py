"""Splitting a request of any size into batches that fit in memory.

A batch entry point (:func:`jaxdecode.decoding.sampling.sample_tokens`, :func:`jaxdecode.decoding.score.token_logprobs`)
runs its rows in groups of at most :func:`rows_per_batch` rows. The bound is the smaller of

- the **memory budget** divided by an estimate of one row's memory (its KV cache, measured with
  :func:`jax.eval_shape` on the model's own ``empty_cache``, plus the prompt's attention scores and
  the loop's working arrays, with a safety factor), and
- :data:`MAX_ROWS`, the batch size past which throughput stops growing (measured in
  ``docs/benchmarks.md``: bigger batches only cost memory).

The budget is, in order: the ``memory_budget`` argument, ``$JAXDECODE_MEMORY_BUDGET`` (bytes, or
with a suffix ``K``, ``M``, ``G``), half of the free memory the accelerator reports, or a quarter
of the host's physical memory on the CPU.

Rows keep their ids (and so their random streams) whichever group they land in, so splitting
never changes a text.

The loops whose rows are not independent draws of one request (beam search: a prompt's ``k``
beams; contrastive search: ``k`` candidates a row; speculative decoding; SMC: a prompt's
particles) check the whole request against the budget before allocating anything
(:func:`require`), and refuse in one line that says how many rows fit.
"""

from __future__ import annotations

import os
import re

import jax
import numpy as np

ENV = "JAXDECODE_MEMORY_BUDGET"
MAX_ROWS = 256
SAFETY = 2.0
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"2G"`` -> 2147483648; a ValueError naming the text unless it is a positive size."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"a memory budget must be a positive size such as 2G or 500M, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def default_budget() -> int:
    """The memory budget in bytes when none is given (see the module docstring)."""
    env = os.environ.get(ENV)
    if env:
        try:
            return parse_bytes(env)
        except ValueError as e:
            raise ValueError(f"${ENV}: {e}") from None
    dev = jax.devices()[0]
    stats = None
    try:
        stats = dev.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        stats = None
    if stats and stats.get("bytes_limit"):
        return max(1 << 26, (int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))) // 2)
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        phys = 8 << 30
    return max(1 << 26, phys // 4)


def cache_bytes(model, rows: int, capacity: int) -> int:
    """Bytes of ``model``'s cache for ``rows`` rows of ``capacity`` positions (nothing allocated)."""
    shapes = jax.eval_shape(lambda: model.empty_cache(rows, capacity))
    return int(sum(np.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(shapes)))


def row_bytes(model, prompt_len: int, n: int, capacity: int, heads: int | None = None) -> int:
    """An estimate of one row's peak memory in a sampling loop (``heads``: the model's
    ``attention_heads`` unless given)."""
    V, T = model.V, model.T
    heads = model.attention_heads if heads is None else heads
    P = min(prompt_len, T)
    per_row = cache_bytes(model, 1, capacity)
    per_row += 4 * heads * P * P  # the prompt's attention scores
    per_row += 4 * (16 * V + 2 * T + 4 * (prompt_len + n))  # logits, rule state, windows, outputs
    return int(SAFETY * per_row)


class MemoryBudgetError(ValueError):
    """A request that does not fit the memory budget (one line: what it needs, and what fits)."""


def size_text(nbytes: int) -> str:
    """``3221225472`` -> ``"3.0 GiB"``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def require(what: str, rows: int, per_row: int, budget: int | str | None = None, *, unit: str = "rows",
            fewer: str = "fewer") -> None:
    """Raise :class:`MemoryBudgetError` unless ``rows`` rows of ``per_row`` bytes fit the budget.

    ``what`` names the request (``"beam search of 64 prompts x 5 beams"``), ``unit`` its rows and
    ``fewer`` what to ask for instead."""
    budget = resolve(budget)
    fit = budget // max(int(per_row), 1)
    if rows > fit:
        raise MemoryBudgetError(
            f"{what} needs about {size_text(rows * per_row)} ({rows} {unit} of {size_text(per_row)}), over the "
            f"memory budget of {size_text(budget)}: {fit} {unit} fit; ask for {fewer}, or raise the budget "
            f"(memory_budget=, --memory-budget or ${ENV})")


def resolve(budget: int | str | None) -> int:
    """The budget in bytes: ``budget`` (bytes, or a size such as ``"2G"``), else :func:`default_budget`."""
    if budget is None:
        budget = default_budget()
    elif isinstance(budget, str):
        budget = parse_bytes(budget)
    elif isinstance(budget, bool) or not isinstance(budget, (int, np.integer, float, np.floating)):
        raise ValueError(f"the memory budget must be a number of bytes or a size such as '2G', got {budget!r}")
    if not budget > 0 or budget == float("inf"):
        raise ValueError(f"the memory budget must be a positive, finite number of bytes, got {budget!r}")
    return int(budget)


def rows_per_batch(per_row: int, budget: int | None = None, max_rows: int | None = None) -> int:
    """How many rows of ``per_row`` bytes one batch may hold (at least 1). ``budget``: bytes, or a
    size such as ``"2G"`` (default :func:`default_budget`)."""
    budget = resolve(budget)
    if max_rows is None:
        cap = MAX_ROWS
    elif isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)) or max_rows < 1:
        raise ValueError(f"max_rows must be an integer >= 1, got {max_rows!r}")
    else:
        cap = int(max_rows)
    return max(1, min(cap, budget // max(per_row, 1)))


def groups(total: int, size: int) -> list[range]:
    """``range(total)`` cut into consecutive ranges of at most ``size``, as even as possible (so
    the last batch is not a tiny one in a bucket of its own)."""
    if total <= 0:
        return []
    count = -(-total // size)
    step = -(-total // count)
    return [range(i, min(total, i + step)) for i in range(0, total, step)]
