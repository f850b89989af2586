"""Does a wider beam find the mode? Beam search against exact search on held-out prompts.

For every prompt, :func:`jaxdecode.beam.mode_search` finds the single most probable continuation
of ``n`` characters; beam search of each width ``k`` is compared with it: how often it returns
the mode, and how far its log-probability falls below the mode's. The chapter's point: beam
search is an approximate search whose errors shrink as ``k`` grows, while the mode itself is an
atypical target (the beam search curse of Koehn and Knowles 2017; the exact search of Stahlberg
and Byrne 2019).

Prompts (:func:`heldout_prompts`): line starts evenly spaced over the held-out 10% of the corpus
(blank lines skipped), each cut just after the first space or line break at or past 32
characters (at most 64), so that every prompt is a few dozen characters that end at a word or
line boundary, like the chapter's ``"KATHARINA:\\nMoved! in good time: "``, and the
continuation starts a new word.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..beam import SearchBudgetExceeded, beam_search, mode_search

MIN_CHARS = 32
MAX_CHARS = 64
PROMPT_RULE = (f"line starts evenly spaced over the held-out 10% (blank lines skipped), each cut just "
               f"after the first space or line break at or past {MIN_CHARS} characters (at most "
               f"{MAX_CHARS})")


def heldout_prompts(held: str, count: int = 24, min_chars: int = MIN_CHARS,
                    max_chars: int = MAX_CHARS) -> list[str]:
    """``count`` prompts from held-out text ``held``: see the module docstring for the rule."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    # a line start is the character after a line break; the first line of ``held`` may be cut
    starts = [i + 1 for i, c in enumerate(held)
              if c == "\n" and i + 1 + max_chars < len(held) and held[i + 1] != "\n"]
    if len(starts) < count:
        raise ValueError(f"the held-out text has only {len(starts)} usable line starts, need {count}")
    picks = np.linspace(0, len(starts) - 1, count).round().astype(int)
    prompts = []
    for s in (starts[j] for j in picks):
        window = held[s + min_chars - 1:s + max_chars]
        cut = next((j for j, c in enumerate(window) if c in " \n"), None)
        prompts.append(held[s:s + max_chars] if cut is None else held[s:s + min_chars + cut])
    return prompts


def beam_curse_study(lm, prompts: Sequence[str], n: int, ks: Sequence[int] = (1, 2, 5, 10),
                     node_budget: int = 100_000) -> dict:
    """Per beam width ``k``: how often beam search returns the mode, and the log-probability gap.

    Returns ``{"per_k": {k: {"mode_rate", "found_mode", "solved", "mean_gap", "max_gap",
    "mean_logprob"}}, "prompts": [...], ...}``; gaps are mode minus beam in nats over the ``n``
    characters. Prompts whose exact search exceeds ``node_budget`` expansions are reported
    (``mode`` is ``None``) and left out of the rates and gaps.
    """
    ks = [int(k) for k in ks]
    if not ks:
        raise ValueError("give at least one beam width")
    prompts = list(prompts)
    encoded = [lm.vocab.encode(p) for p in prompts]
    beams = {k: beam_search(lm.decoder, lm.params, encoded, n, k) for k in ks}

    rows = []
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        best = {k: beams[k].best(i) for k in ks}
        row = {"prompt": prompt, "mode": None, "mode_logprob": None, "nodes_expanded": None,
               "beams": {}}
        start = time.perf_counter()
        try:
            # the best beam is a known continuation: nothing below it can be the mode
            lower = max(h.logprob for h in best.values())
            tokens, logprob, nodes = mode_search(lm.decoder, lm.params, ids, n, node_budget, lower_bound=lower)
            row.update(mode=lm.vocab.decode(tokens), mode_logprob=float(logprob), nodes_expanded=nodes)
        except SearchBudgetExceeded:
            tokens = None
        row["search_seconds"] = round(time.perf_counter() - start, 3)
        for k, h in best.items():
            is_mode = tokens is not None and np.array_equal(h.tokens, tokens)
            gap = None if tokens is None else (0.0 if is_mode else row["mode_logprob"] - h.logprob)
            row["beams"][str(k)] = {"text": lm.vocab.decode(h.tokens), "logprob": h.logprob,
                                    "is_mode": is_mode, "gap": gap}
        rows.append(row)

    solved = [r for r in rows if r["mode"] is not None]
    per_k = {}
    for k in ks:
        gaps = np.array([r["beams"][str(k)]["gap"] for r in solved], np.float64)
        found = sum(r["beams"][str(k)]["is_mode"] for r in solved)
        per_k[str(k)] = {
            "solved": len(solved), "found_mode": int(found),
            "mode_rate": found / len(solved) if solved else None,
            "mean_gap": float(gaps.mean()) if solved else None,
            "max_gap": float(gaps.max()) if solved else None,
            "mean_logprob": float(np.mean([r["beams"][str(k)]["logprob"] for r in rows])),
        }
    return {"n": n, "ks": ks, "node_budget": node_budget, "prompts_total": len(rows),
            "prompts_solved": len(solved), "per_k": per_k, "prompts": rows}


def _plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ks = result["ks"]
    per_k = [result["per_k"][str(k)] for k in ks]
    if any(p["mode_rate"] is None for p in per_k):
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(ks, [p["mode_rate"] for p in per_k], "o-")
    left.set(xscale="log", xlabel="beam width k", ylabel="share of prompts", ylim=(0, 1.05),
             title="beam search returns the mode")
    right.plot(ks, [p["mean_gap"] for p in per_k], "o-", label="mean")
    right.plot(ks, [p["max_gap"] for p in per_k], "s--", label="max")
    right.set(xscale="log", xlabel="beam width k", ylabel="nats",
              title=f"log-probability gap to the mode ({result['n']} chars)")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(ks, [str(k) for k in ks])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(lm, out_dir, n_prompts: int = 24, n: int = 12, data_path=None, ks: Sequence[int] = (1, 2, 5, 10),
        node_budget: int = 100_000) -> dict:
    """The study on ``n_prompts`` held-out prompts; writes ``beam_curse.json`` (and ``.png``)."""
    from ..data import read_corpus, split

    _, held = split(read_corpus(data_path))
    prompts = heldout_prompts(held, n_prompts)
    result = beam_curse_study(lm, prompts, n, ks=ks, node_budget=node_budget)
    result["prompt_rule"] = PROMPT_RULE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "beam_curse.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    result["plot"] = str(out / "beam_curse.png") if _plot(result, out / "beam_curse.png") else None
    return result
