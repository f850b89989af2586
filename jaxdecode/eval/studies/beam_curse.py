"""Does a wider beam find the mode? Beam search against exact search on held-out prompts.

For every prompt, :func:`jaxdecode.decoding.beam.mode_search` finds the single most probable continuation
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

import time
from collections.abc import Sequence

import numpy as np

from jaxdecode.decoding.beam import SearchBudgetExceeded, beam_search, mode_search
from jaxdecode.io.reports import (
    fmt,
    md_table,
    md_text,
    new_figure,
    output_folder,
    progress_bar,
    save_figure,
    write_json,
    write_markdown,
)

NAME = "beam_curse"

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
                     node_budget: int = 100_000, bar=None) -> dict:
    """Per beam width ``k``: how often beam search returns the mode, and the log-probability gap.

    Returns ``{"per_k": {k: {"mode_rate", "found_mode", "solved", "mean_gap", "max_gap",
    "mean_logprob"}}, "prompts": [...], ...}``; gaps are mode minus beam in nats over the ``n``
    characters. Prompts whose exact search exceeds ``node_budget`` expansions are reported
    (``mode`` is ``None``) and left out of the rates and gaps. Each row's ``search_seconds`` is the
    wall-clock time of its exact search. ``bar``: a progress bar advanced once per beam width and
    once per prompt.
    """
    ks = [int(k) for k in ks]
    if not ks:
        raise ValueError("give at least one beam width")
    prompts = list(prompts)
    encoded = [lm.vocab.encode(p) for p in prompts]
    beams = {}
    for k in ks:
        beams[k] = beam_search(lm.decoder, lm.params, encoded, n, k)
        if bar is not None:
            bar.update(1)

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
        if bar is not None:
            bar.update(1)

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


def _plot(result: dict, path) -> bool:
    """The figure (always written); False when no prompt was solved (then it shows only the
    beams' mean log-probabilities)."""
    ks = result["ks"]
    per_k = [result["per_k"][str(k)] for k in ks]
    solved = result["prompts_solved"] > 0
    fig, axes = new_figure(1, 2, figsize=(9, 3.5))
    left, right = axes[0]
    if solved:
        left.plot(ks, [p["mode_rate"] for p in per_k], "o-")
        right.plot(ks, [p["mean_gap"] for p in per_k], "o-", label="mean")
        right.plot(ks, [p["max_gap"] for p in per_k], "s--", label="max")
        right.legend()
    else:
        right.plot(ks, [p["mean_logprob"] for p in per_k], "o-")
    left.set(xscale="log", xlabel="beam width k", ylabel="share of prompts", ylim=(0, 1.05),
             title="beam search returns the mode" if solved else "no prompt solved within the budget")
    right.set(xscale="log", xlabel="beam width k", ylabel="nats",
              title=(f"log-probability gap to the mode ({result['n']} chars)" if solved
                     else f"mean beam log-probability ({result['n']} chars)"))
    for ax in (left, right):
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
    save_figure(fig, path)
    return solved


def _markdown(result: dict) -> str:
    pct = lambda x: fmt(None if x is None else 100 * x, ".0f")  # noqa: E731
    first = result["prompts"][0]
    rows = [[k, f"{p['found_mode']}/{p['solved']}", pct(p["mode_rate"]),
             fmt(p["mean_gap"]), fmt(p["max_gap"]), fmt(p["mean_logprob"])]
            for k, p in ((k, result["per_k"][str(k)]) for k in result["ks"])]
    parts = [
        "# Beam search against the exact mode\n",
        f"{result['prompts_total']} held-out prompts ({result['prompt_rule']}); for each, the most "
        f"probable continuation of {result['n']} characters by exact best-first search (node budget "
        f"{result['node_budget']:,}; {result['prompts_solved']} prompts solved) against beam search of "
        "each width k. Gaps: mode minus beam log-probability, nats over the continuation.\n",
        md_table(["k", "found the mode", "share (%)", "mean gap", "max gap", "mean beam log-prob"],
                 rows) + "\n",
        "Example (first prompt): " + md_text(first["prompt"]) + " → mode "
        + (md_text(first["mode"]) if first["mode"] is not None else "not found") + "\n",
        f"![beam search against the mode]({NAME}.png)",
    ]
    return "\n".join(parts)


def run(lm, out_dir, *, seed: int = 0, data_path=None, progress: bool = True, n_prompts: int = 24,
        n: int = 12, ks: Sequence[int] = (1, 2, 5, 10), node_budget: int = 100_000) -> dict:
    """The study on ``n_prompts`` held-out prompts; writes ``beam_curse.json``, ``.png`` and
    ``.md``. Nothing here is random: ``seed`` is recorded only. The exact searches' wall-clock
    times are left out of the JSON (so that it is the same on every run) and returned under
    ``search_seconds``."""
    from jaxdecode.io.data import read_corpus, split

    out = output_folder(out_dir)
    _, held = split(read_corpus(data_path))
    prompts = heldout_prompts(held, n_prompts)
    with progress_bar(len(ks) + len(prompts), NAME, progress) as bar:
        result = beam_curse_study(lm, prompts, n, ks=ks, node_budget=node_budget, bar=bar)
    seconds = [row.pop("search_seconds") for row in result["prompts"]]
    doc = {"study": NAME, "seed": seed, "prompt_rule": PROMPT_RULE, **result}
    result = write_json(out / f"{NAME}.json", doc)
    _plot(result, out / f"{NAME}.png")
    write_markdown(out / f"{NAME}.md", _markdown(result))
    result["plot"] = str(out / f"{NAME}.png")
    result["search_seconds"] = seconds
    result["files"] = [str(out / f"{NAME}{s}") for s in (".json", ".png", ".md")]
    return result
