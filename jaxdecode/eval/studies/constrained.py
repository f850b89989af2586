"""Masking is not conditioning: the choice of the next speaker, three ways.

After a prompt that ends one speech, the output is constrained to one of a few speaker headings
of *The Taming of the Shrew* (:data:`CHOICES`). Three distributions over the choices:

- **masked** ``Q``: what masked sampling (``generate(..., constraint=c)``) draws from, computed
  exactly by :func:`jaxdecode.decoding.smc.enumerate_outputs`;
- **exact** ``P``: the model's distribution conditioned on the output being one of the choices
  (the model's probability of each heading, renormalized over the headings), computed exactly
  by the same walk;
- **SMC**: the estimate of ``P`` by sequential Monte Carlo (:func:`jaxdecode.decoding.smc.smc_generate`)
  with ``particles`` particles.

Also: ``KL(P || Q)`` and ``KL(P || SMC)`` (nats) and total variation; the model's probability
that its next line is one of the headings, exactly and as SMC estimates it; and 200 masked
samples from :func:`jaxdecode.generate` with their frequencies beside ``Q`` (a chi-square check
that the sampler draws from ``Q``).

The prompt (:data:`PROMPT`) is verbatim from the corpus (*The Taming of the Shrew*, Act II,
scene 1: Katharina's "A join'd-stool." and Petruchio's reply), ending with the blank line after
Petruchio's speech; in the corpus the next line is ``KATHARINA:``. It lies in the held-out 10%
(the model saw ``KATHARINA:`` as a heading only 10 times in training), and it is short (75
characters) so that the cache of 2,000 particles stays small (about 2 GB in all). Every choice
ends in ``:``, after which the choices' automaton allows nothing, so the stop probability of a
complete choice is 1 and ``P(choice)`` is the model's probability of the heading's characters.
"""

from __future__ import annotations

import numpy as np

from jaxdecode import constraints as C
from jaxdecode.io import data as data_lib
from jaxdecode.eval import exact
from jaxdecode.decoding import smc
from jaxdecode.decoding.sampling import generate
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

NAME = "constrained"
PROMPT = "KATHARINA:\nA join'd-stool.\n\nPETRUCHIO:\nThou hast hit it: come, sit on me.\n\n"
CHOICES = ("PETRUCHIO:", "KATHARINA:", "BAPTISTA:", "HORTENSIO:", "GREMIO:", "TRANIO:", "BIANCA:")
SAMPLES = 200


def _locate(text: str, prompt: str) -> dict:
    at = text.find(prompt)
    if at < 0:
        raise ValueError(f"the prompt {prompt!r} does not occur in the corpus")
    rest = text[at + len(prompt):]
    return {"offset": at, "line": text.count("\n", 0, at) + 1, "next_line": rest.split("\n", 1)[0]}


def _check_choices(lm, choices) -> list[str]:
    choices = list(choices)
    if len(set(choices)) != len(choices) or not choices:
        raise ValueError(f"give distinct, non-empty choices, got {choices!r}")
    for ch in choices:
        try:
            lm.vocab.encode(ch)
        except (ValueError, KeyError) as e:
            raise ValueError(f"the choice {ch!r} cannot be encoded with the model's vocabulary: "
                             f"{e}") from None
    return choices


def compare(lm, *, prompt: str = PROMPT, choices=CHOICES, seed: int = 0, particles: int = 2000,
            samples: int = SAMPLES, bar=None) -> dict:
    """The numbers of the study (see the module docstring), without writing anything."""
    choices = _check_choices(lm, choices)
    tick = (lambda: bar.update(1)) if bar is not None else (lambda: None)
    c = C.compile_choices(choices, lm.vocab)
    n = max(len(lm.vocab.encode(ch)) for ch in choices)
    walk = smc.enumerate_outputs(lm, prompt, n, c)
    P, Q = walk.conditional(), walk.masked()
    tick()
    res = smc.smc_generate(lm, prompt, n, c, particles, seed=seed)
    S = res.distribution
    tick()
    gens = generate(lm, prompt, n, constraint=c, num_samples=samples, seed=seed)
    counts = {ch: 0 for ch in choices}
    for g in gens:
        if g.text not in counts:  # cannot happen: every masked sample is one of the choices
            raise AssertionError(f"a masked sample {g.text!r} is not one of the choices")
        counts[g.text] += 1
    tick()
    rows = [{"choice": ch, "masked": Q.get(ch, 0.0), "exact": P.get(ch, 0.0), "smc": S.get(ch, 0.0),
             "samples": counts[ch], "sample_frequency": counts[ch] / samples} for ch in choices]
    return {
        "prompt": prompt,
        "choices": choices,
        "n": n,
        "seed": seed,
        "particles": particles,
        "rows": rows,
        "kl": {"exact_masked": smc.kl_divergence(P, Q), "exact_smc": smc.kl_divergence(P, S)},
        "tv": {"exact_masked": smc.total_variation(P, Q), "exact_smc": smc.total_variation(P, S),
               "masked_samples": smc.total_variation(Q, {k: v / samples for k, v in counts.items()})},
        "log_prob_in_language": {"exact": walk.log_normalizer, "smc": res.log_marginal},
        "smc": {"ess": res.ess, "resampled_after_steps": res.resampled, "final_ess": res.final_ess},
        "masked_samples": {"count": samples, "chisquare_pvalue_vs_masked": exact.chisquare_pvalue(counts, Q)},
    }


def _plot(result: dict, path) -> None:
    rows = result["rows"]
    fig, axes = new_figure(1, 1, figsize=(10, 4))
    ax = axes[0][0]
    x = np.arange(len(rows))
    series = [("masked Q", "masked"), ("exact P", "exact"), (f"SMC ({result['particles']} particles)", "smc"),
              (f"{result['masked_samples']['count']} masked samples", "sample_frequency")]
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, [r[key] for r in rows], width, label=label)
    ax.set_xticks(x)
    ax.set_xticklabels([r["choice"] for r in rows])
    ax.set_ylabel("probability")
    ax.set_title("the next speaker: masked sampling against the model conditioned on the choices")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def _markdown(result: dict) -> str:
    rows = [[md_text(r["choice"]), fmt(r["masked"], ".4f"), fmt(r["exact"], ".4f"), fmt(r["smc"], ".4f"),
             f"{r['samples']} ({fmt(r['sample_frequency'], '.3f')})"] for r in result["rows"]]
    kl, tv, lz = result["kl"], result["tv"], result["log_prob_in_language"]
    src = result["source"]
    return "\n".join([
        "# Masking is not conditioning\n",
        f"The next line after {md_text(result['prompt'])} (corpus line {src['line']}; the corpus continues "
        f"with {md_text(src['next_line'])}), constrained to one of {len(result['choices'])} speaker "
        "headings. "
        "**masked**: the distribution masked sampling draws from; **exact**: the model conditioned on the "
        "output being one of the headings; **SMC**: sequential Monte Carlo's estimate of the exact one with "
        f"{result['particles']} particles (seed {result['seed']}); the last column counts "
        f"{result['masked_samples']['count']} masked samples from `generate(..., constraint=c)`.\n",
        md_table(["choice", "masked", "exact", "SMC", "masked samples"], rows) + "\n",
        f"KL(exact ‖ masked) = {fmt(kl['exact_masked'], '.4f')} nats, KL(exact ‖ SMC) = "
        f"{fmt(kl['exact_smc'], '.5f')} nats (total variation {fmt(tv['exact_masked'], '.3f')} and "
        f"{fmt(tv['exact_smc'], '.4f')}). The model's probability that the next line is one of the headings: "
        f"exp({fmt(lz['exact'], '.4f')}) exactly, exp({fmt(lz['smc'], '.4f')}) as SMC estimates it. "
        f"The masked samples against the masked distribution: chi-square p = "
        f"{fmt(result['masked_samples']['chisquare_pvalue_vs_masked'], '.3f')}.\n",
        f"![masked, exact and SMC distributions over the headings]({NAME}.png)",
    ])


def run(lm, out_dir, *, seed: int = 0, data_path=None, progress: bool = True, particles: int = 2000) -> dict:
    """Writes ``constrained.json``, ``constrained.png`` and ``constrained.md`` into ``out_dir``."""
    out = output_folder(out_dir)
    source = _locate(data_lib.read_corpus(data_path), PROMPT)
    with progress_bar(3, NAME, progress) as bar:
        result = compare(lm, seed=seed, particles=particles, bar=bar)
    result = write_json(out / f"{NAME}.json", {"study": NAME, "source": source, **result})
    _plot(result, out / f"{NAME}.png")
    write_markdown(out / f"{NAME}.md", _markdown(result))
    result["files"] = [str(out / f"{NAME}{s}") for s in (".json", ".png", ".md")]
    return result
