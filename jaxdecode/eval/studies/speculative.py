"""Speculative decoding: the exactness of the acceptance rule, and what a trigram draft buys.

Two parts, as in the chapter:

1. **Toy check.** Target ``p = [.5, .2, .2, .1]``, draft ``q`` uniform, 200,000 independent
   draws through :func:`jaxdecode.speculative.accept`: the acceptance rate should be
   ``sum_i min(p_i, q_i) = 0.75`` and the output frequencies ``p``.
2. **Gamma sweep.** The given model as target, a character trigram table with add-0.01
   smoothing counted on the training 90% of the corpus as draft, ``n`` characters after the
   chapter's prompt ``"KATHARINA:\\nMoved! in good time: "`` for each ``gamma``: the acceptance
   rate ``alpha`` (accepted over examined proposals), the characters per target pass, and the
   i.i.d. prediction ``(1 - alpha^(gamma+1)) / (1 - alpha)`` beside it. Several independent
   samples (rows of one batch) are pooled so the rates are less noisy than a single run.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import speculative as SP
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

NAME = "speculative"
PROMPT = "KATHARINA:\nMoved! in good time: "
TOY_P = (0.5, 0.2, 0.2, 0.1)


def toy_check(draws: int = 200_000, seed: int = 0) -> dict:
    """Speculative sampling of one token from ``p`` with a uniform draft, ``draws`` times."""
    p = np.asarray(TOY_P, np.float32)
    V = len(p)
    q = np.full(V, 1.0 / V, np.float32)
    key = jax.random.PRNGKey(seed)
    proposal = jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(jnp.asarray(q)),
                                      shape=(draws, 1)).astype(jnp.int32)
    P = jnp.broadcast_to(jnp.asarray(p), (draws, 2, V))
    Q = jnp.broadcast_to(jnp.asarray(q), (draws, 1, V))
    n_acc, nxt = SP.accept(P, Q, proposal, key)
    n_acc, nxt, proposal = map(np.asarray, (n_acc, nxt, proposal))
    out = np.where(n_acc == 1, proposal[:, 0], nxt)
    freq = np.bincount(out, minlength=V) / draws
    return {"p": p.tolist(), "q": q.tolist(), "draws": draws,
            "acceptance": float(n_acc.mean()),
            "expected_acceptance": float(np.minimum(p, q).sum()),
            "frequencies": freq.tolist()}


def gamma_sweep(lm, draft, prompt: str = PROMPT, n: int = 400, gammas: Sequence[int] = (1, 2, 4, 8),
                samples: int = 8, seed: int = 1, bar=None) -> dict:
    """Acceptance and characters per target pass for each ``gamma`` (``samples`` rows pooled);
    ``bar``: a progress bar advanced once per ``gamma``."""
    per_gamma = {}
    for gamma in gammas:
        gens = SP.speculative_generate(lm, prompt, n, draft=draft, gamma=gamma, seed=seed,
                                       num_samples=samples)
        total = SP.SpeculativeStats.total([g.stats for g in gens])
        per_row = [g.stats for g in gens]
        per_gamma[str(gamma)] = {
            **total.as_dict(),
            "row_acceptance": [s.acceptance_rate for s in per_row],
            "row_chars_per_pass": [s.chars_per_pass for s in per_row],
            "mean_logprob": float(np.mean([g.mean_logprob for g in gens])),
            "sample": gens[0].text[:120],
        }
        if bar is not None:
            bar.update(1)
    return {"prompt": prompt, "n": n, "gammas": list(gammas), "samples": samples, "seed": seed,
            "per_gamma": per_gamma}


def _plot(result: dict, path) -> None:
    sweep = result["sweep"]
    gs = sweep["gammas"]
    rows = [sweep["per_gamma"][str(g)] for g in gs]
    fig, axes = new_figure(1, 2, figsize=(9, 3.5))
    left, right = axes[0]
    toy = result["toy"]
    x = np.arange(len(toy["p"]))
    left.bar(x - 0.2, toy["p"], 0.4, label="target p")
    left.bar(x + 0.2, toy["frequencies"], 0.4, label="speculative samples")
    left.set(xlabel="token", ylabel="probability",
             title=f"toy check: acceptance {toy['acceptance']:.3f}")
    left.set_xticks(x)
    left.legend()
    right.plot(gs, [r["chars_per_pass"] for r in rows], "o-", label="measured")
    right.plot(gs, [r["predicted_chars_per_pass"] for r in rows], "s--",
               label=r"$(1-\alpha^{\gamma+1})/(1-\alpha)$")
    right.set(xscale="log", xlabel=r"proposals per pass $\gamma$", ylabel="characters per target pass",
              title="trigram draft")
    right.set_xticks(gs, [str(g) for g in gs])
    right.minorticks_off()
    right.legend()
    save_figure(fig, path)


DRAFT_WORDS = {"ModelDraft": "a smaller model with the same tokenizer",
               "PromptLookupDraft": "prompt lookup over the text so far"}


def _markdown(result: dict) -> str:
    toy, sweep = result["toy"], result["sweep"]
    unit = result.get("unit", "char")
    rows = [[g, fmt(r["acceptance_rate"], ".3f"), fmt(r["chars_per_pass"]),
             fmt(r["predicted_chars_per_pass"]), r["passes"], fmt(r["mean_logprob"])]
            for g, r in ((g, sweep["per_gamma"][str(g)]) for g in sweep["gammas"])]
    return "\n".join([
        "# Speculative decoding\n",
        f"**Toy check** (seed {toy['seed']}): target p = {toy['p']}, uniform draft, {toy['draws']:,} draws: "
        f"acceptance {toy['acceptance']:.4f} (exact {toy['expected_acceptance']:.2f}), output frequencies "
        f"{[round(f, 3) for f in toy['frequencies']]}.\n",
        f"**Gamma sweep** (seed {sweep['seed']}): the model as target, the {result['draft']} draft "
        f"({DRAFT_WORDS.get(result['draft'], 'add-0.01 character trigram of the training split')}), "
        f"{sweep['samples']} samples of {sweep['n']} {unit}s after {md_text(sweep['prompt'])}.\n",
        md_table(["gamma", "acceptance", f"{unit}s per target pass", "i.i.d. prediction", "target passes",
                  "mean log-probability"], rows) + "\n",
        f"![toy check and gamma sweep]({NAME}.png)",
    ])


def run(lm, out_dir, *, seed: int = 0, data_path=None, progress: bool = True, n: int = 400,
        gammas: Sequence[int] = (1, 2, 4, 8), samples: int = 8, draft=None, prompt: str = PROMPT) -> dict:
    """Both parts; writes ``speculative.json``, ``speculative.png`` and ``speculative.md`` into
    ``out_dir``. The toy check draws with ``seed`` and the sweep with ``seed + 1`` (the default
    seed 0 gives the published numbers: toy 0, sweep 1).

    ``draft`` defaults to the trigram table of the corpus at ``data_path`` (see
    :func:`jaxdecode.io.data.locate_corpus`), and on a subword model to the model draft in the
    folder ``<name>-draft`` beside the model's (``shakespeare-bpe-draft`` for ``shakespeare-bpe``).
    """
    if draft is None and getattr(lm.vocab, "subword", False):
        from jaxdecode.models.checkpoint import load
        from jaxdecode.speculative.drafts.model import DRAFT_NAME, draft_folder

        folder = draft_folder(lm)  # the folder "<name>-draft" beside the model's, as shipped
        if folder == DRAFT_NAME:
            raise ValueError("the speculative study on a subword model needs a draft model with the same "
                             "tokenizer: --draft FOLDER (the chapter's trigram table over a subword vocabulary "
                             "does not apply)")
        draft = SP.ModelDraft.from_lm(load(folder))
    n = min(n, lm.decoder.T - len(lm.vocab.encode(prompt)) - max(gammas) - 1)  # within the window
    out = output_folder(out_dir)
    with progress_bar(2 + len(gammas), NAME, progress) as bar:
        if draft is None:
            draft = SP.make_draft("ngram", lm, data_path)
        bar.update(1)
        toy = {"seed": seed, **toy_check(seed=seed)}
        bar.update(1)
        sweep = gamma_sweep(lm, draft, prompt=prompt, n=n, gammas=gammas, samples=samples,
                            seed=seed + 1, bar=bar)
    doc = {"study": NAME, "seed": seed, "toy": toy, "sweep": sweep, "draft": type(draft).__name__,
           "unit": "token" if getattr(lm.vocab, "subword", False) else "char"}
    result = write_json(out / f"{NAME}.json", doc)
    _plot(result, out / f"{NAME}.png")
    write_markdown(out / f"{NAME}.md", _markdown(result))
    result["plot"] = str(out / f"{NAME}.png")
    result["files"] = [str(out / f"{NAME}{s}") for s in (".json", ".png", ".md")]
    return result
