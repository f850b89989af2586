"""What each truncation rule keeps, at two points of one line: the chapter's truncation table.

After ``"KATHARINA:\\nMoved! in good time: let him that moved you "`` a new word starts and many
letters are plausible; after the same text + ``"hith"`` (inside "hither") one letter is nearly
certain. For each context the model's next-character logits are processed by the library's own
rules (:func:`jaxdecode.rules.make_rule`, ``rule.init`` / ``rule.apply``): none (the model),
temperature 0.5, top-k 5, top-p 0.9, min-p 0.1, typical 0.9 and eta 0.0009 (a threshold in the
range Hewitt, Manning and Liang 2022 recommend, 3e-4 to 2e-3). Each row reports how many
characters stay in play (finite processed logits), the entropy in bits of the processed
distribution, the model's probability mass on the kept characters, and the five most probable
kept characters.

The chapter's pattern: at the word start top-p and min-p keep more letters than top-k 5 (which
discards a large share of the mass); inside "hither" they keep fewer than five, while top-k
still admits five and temperature leaves every character in play. The study is deterministic
(no sampling): the seed is recorded, nothing depends on it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxdecode.eval.exact import next_logits_for
from jaxdecode.rules import make_rule
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

NAME = "truncation"
LINE = "KATHARINA:\nMoved! in good time: let him that moved you "
CONTEXTS = (("word start", LINE), ("inside 'hither'", LINE + "hith"))
ETA = 0.0009
# (label, make_rule settings); None: the model's own distribution
RULES = (
    ("model", None),
    ("temperature 0.5", {"temperature": 0.5}),
    ("top-k 5", {"top_k": 5}),
    ("top-p 0.9", {"top_p": 0.9}),
    ("min-p 0.1", {"min_p": 0.1}),
    ("typical 0.9", {"typical": 0.9}),
    (f"eta {ETA}", {"eta": ETA}),
)
TOP = 5


def _probs64(logits: np.ndarray) -> np.ndarray:
    """Softmax in float64 over the finite entries (removed tokens get probability 0)."""
    z = np.asarray(logits, np.float64)
    finite = np.isfinite(z)
    m = z[finite].max()
    e = np.where(finite, np.exp(np.where(finite, z, m) - m), 0.0)
    return e / e.sum()


def processed(rule, logits: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """``logits`` [V] after ``rule`` (``None``: unchanged), as a rule sees a one-row batch."""
    if rule is None:
        return np.asarray(logits, np.float32)
    V = logits.shape[-1]
    state = rule.init(jnp.asarray(prompt[None], jnp.int32), jnp.asarray([len(prompt)], jnp.int32), V, 1)
    return np.asarray(rule.apply(jnp.asarray(logits[None], jnp.float32), state))[0]


def describe(lm, out_logits: np.ndarray, model_probs: np.ndarray, top: int = TOP) -> dict:
    """Kept count, entropy (bits), model mass kept and the ``top`` most probable kept characters."""
    kept = np.isfinite(out_logits)
    p = _probs64(out_logits)
    nz = p > 0
    entropy = float(-(p[nz] * np.log2(p[nz])).sum())
    order = np.argsort(-p, kind="stable")[:min(top, int(kept.sum()))]
    return {"kept": int(kept.sum()), "entropy_bits": abs(entropy),
            "model_mass_kept": float(model_probs[kept].sum()),
            "top": [{"char": lm.vocab.decode([int(i)]), "prob": float(p[i])} for i in order]}


def truncation_table(lm, contexts=CONTEXTS, rules=RULES, bar=None) -> list[dict]:
    """One entry per context: ``{"name", "context", "rows": [{"rule", "settings", "kept",
    "entropy_bits", "model_mass_kept", "top": [{"char", "prob"}]}], "probs": {rule: [V]}}``
    (``probs``: each processed distribution over the vocabulary, for the figure)."""
    next_logits = next_logits_for(lm.decoder, lm.params)
    built = [(label, settings, None if settings is None else make_rule(**settings))
             for label, settings in rules]
    out = []
    for name, text in contexts:
        ids = np.asarray(lm.vocab.encode(text), np.int32)
        logits = np.asarray(next_logits(ids[None]), np.float32)[0]
        model_probs = _probs64(logits)
        rows, probs = [], {}
        for label, settings, rule in built:
            z = processed(rule, logits, ids)
            rows.append({"rule": label, "settings": settings, **describe(lm, z, model_probs)})
            probs[label] = _probs64(z)
            if bar is not None:
                bar.update(1)
        out.append({"name": name, "context": text, "rows": rows, "probs": probs})
    return out


def _plot(result: dict, probs: list[dict], chars: list[str], path) -> None:
    contexts = result["contexts"]
    fig, axes = new_figure(2, len(contexts), figsize=(5.5 * len(contexts), 7))
    for j, ctx in enumerate(contexts):
        ax = axes[0, j]
        labels = [r["rule"] for r in ctx["rows"]]
        kept = [r["kept"] for r in ctx["rows"]]
        y = np.arange(len(labels))
        ax.barh(y, kept, color="tab:blue")
        for yi, k, r in zip(y, kept, ctx["rows"]):
            ax.text(k, yi, f" {k} ({r['entropy_bits']:.2f} bits)", va="center", fontsize=8)
        ax.set_yticks(y, labels)
        ax.invert_yaxis()
        ax.set_xlim(0, len(chars) * 1.35)
        ax.set(xlabel="characters kept", title=f"after {ctx['context'][-12:]!r} ({ctx['name']})")
        # the processed distributions over the model's 12 most probable characters
        ax = axes[1, j]
        model = probs[j]["model"]
        order = np.argsort(-model, kind="stable")[:12]
        shown = [lab for lab in ("model", "top-k 5", "top-p 0.9", "min-p 0.1") if lab in probs[j]]
        width = 0.8 / len(shown)
        x = np.arange(len(order))
        for i, lab in enumerate(shown):
            ax.bar(x + (i - (len(shown) - 1) / 2) * width, probs[j][lab][order], width, label=lab)
        ax.set_xticks(x, [_label(chars[i]) for i in order])
        ax.set(xlabel="next character (the model's 12 most probable)", ylabel="probability (log scale)",
               yscale="log", ylim=(1e-5, 1.5), title="processed distributions")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def _label(c: str) -> str:
    return {" ": "\u2423", "\n": "\\n"}.get(c, c)


def _markdown(result: dict) -> str:
    parts = ["# Truncation rules at a word start and inside a word\n",
             f"The shipped model's next-character distribution after two contexts, processed by "
             f"each rule of `jaxdecode.rules` (checkpoint `{result['checkpoint']}`). *kept*: "
             f"characters still in play; *mass*: the model's probability of the kept characters; "
             f"deterministic (no sampling).\n"]
    for ctx in result["contexts"]:
        rows = [[r["rule"], r["kept"], fmt(r["entropy_bits"]), fmt(r["model_mass_kept"], ".3f"),
                 " ".join(f"{md_text(t['char'])} {t['prob']:.2f}" for t in r["top"])]
                for r in ctx["rows"]]
        parts.append(f"## After {md_text(ctx['context'][-24:])} ({ctx['name']})\n")
        parts.append(md_table(["rule", "kept", "entropy (bits)", "mass", "top 5"], rows) + "\n")
    parts.append(f"![kept characters and processed distributions]({NAME}.png)")
    return "\n".join(parts)


def run(lm, out_dir, *, seed: int = 0, data_path=None, progress: bool = True,
        contexts=CONTEXTS, rules=RULES) -> dict:
    """The table for ``contexts`` x ``rules``; writes ``truncation.json``, ``.png`` and ``.md``.
    ``seed`` and ``data_path`` are recorded / accepted for a uniform interface (nothing here is
    random and no corpus is read)."""
    out = output_folder(out_dir)
    with progress_bar(len(contexts) * len(rules), NAME, progress) as bar:
        table = truncation_table(lm, contexts, rules, bar=bar)
    probs = [t.pop("probs") for t in table]
    ckpt = getattr(lm, "path", None)
    doc = {"study": NAME, "seed": seed, "deterministic": True,
           "checkpoint": None if ckpt is None else ckpt.name, "eta": ETA, "top": TOP,
           "contexts": table}
    result = write_json(out / f"{NAME}.json", doc)
    _plot(result, probs, list(lm.vocab.chars), out / f"{NAME}.png")
    write_markdown(out / f"{NAME}.md", _markdown(result))
    result["files"] = [str(out / f"{NAME}{s}") for s in (".json", ".png", ".md")]
    return result
