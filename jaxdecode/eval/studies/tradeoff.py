"""The quality–likelihood trade-off of decoding rules, on held-out prompts.

For 24 held-out prompts (the rule of :func:`jaxdecode.eval.studies.beam_curse.heldout_prompts`,
applied to the held-out text less its last ``n`` characters, so that the held-out text goes on
for ``n`` characters after every prompt), ``n`` characters are generated under every setting of
six sampling families (temperature, top-k, top-p, min-p, typical, eta), by greedy decoding,
beam search (k = 5, one prompt at a time: faster on CPU than a batch) and contrastive search
(k = 4, alpha = 0.6, batched); the held-out text's own next ``n`` characters after each prompt
(the "human" continuation) are the reference. Each setting's outputs, pooled over the prompts,
get the untruncated model's probability of each character (its CDF, the shares below 0.1 and
above 0.9, the NLL) and word measures (:func:`words`: the real-word share, the repeated-trigram
share, distinct-n); their definitions are in ``docs/chapter.md`` (The quality–likelihood trade-off).

Every family runs as ONE call of :func:`jaxdecode.decoding.sampling.sample_tokens`: a batch of
``settings x prompts`` rows, each carrying its own setting of one chain ``temperature -> top_k ->
top_p -> min_p -> typical -> eta`` (the rules a row does not use at their neutral values), so
every family is the same compiled program; greedy rides in the top-k call as ``t = 0`` rows. Row
``i`` of every setting has row id ``i``: common random numbers across settings, key ``PRNGKey(seed)``.

Outputs: ``tradeoff.json`` (byte-identical for a seed), ``tradeoff.md`` (the key numbers beside
the chapter's) and ``tradeoff.png`` (the CDFs; real-word share against NLL) when matplotlib is installed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

import jax
import numpy as np

from jaxdecode.eval.studies.beam_curse import PROMPT_RULE, heldout_prompts
from jaxdecode.rules import NEUTRAL as RULE_NEUTRAL
from jaxdecode.io.reports import (
    fmt,
    md_table,
    new_figure,
    output_folder,
    progress_bar,
    save_figure,
    write_json,
    write_markdown,
)

NAME = "tradeoff"

# ----------------------------------------------------------------------------- settings

#: The sampling families and their settings (in the order plotted).
FAMILIES: dict[str, tuple[float, ...]] = {
    "temperature": (0.5, 0.7, 0.85, 1.0, 1.2),
    "top_k": (2, 5, 10, 20),
    "top_p": (0.5, 0.8, 0.9, 0.95),
    "min_p": (0.02, 0.05, 0.1, 0.2, 0.4),
    "typical": (0.2, 0.5, 0.9, 0.95),
    # eta's threshold is min(eta, sqrt(eta) * exp(-H)): for a character model (entropy mostly
    # 0.3-2.5 nats) 0.003 removes only the far tail, 0.4 keeps little more than the top letters
    "eta": (0.003, 0.02, 0.1, 0.4),
}

#: The chain every family runs through, and the setting that leaves a logit untouched.
#: (``None`` for top-k: the vocabulary size.)
CHAIN: tuple[str, ...] = ("temperature", "top_k", "top_p", "min_p", "typical", "eta")
NEUTRAL = {name: None if RULE_NEUTRAL[name] == "V" else RULE_NEUTRAL[name] for name in CHAIN}
GREEDY_FAMILY = "top_k"  # the call greedy rows join (top-k at k = 1 is greedy)

BEAM_K = 5
CONTRASTIVE_K = 4
CONTRASTIVE_ALPHA = 0.6

SYMBOLS = {"temperature": "τ", "top_k": "top-k", "top_p": "top-p", "min_p": "min-p", "typical": "typical",
           "eta": "eta"}

GRID = np.round(np.linspace(0.0, 1.0, 101), 2)  # the CDF's x values

#: The chapter's numbers (book checkpoint, 24 prompts x 300 characters): (label, measure) -> value.
CHAPTER = {
    ("held-out", "below_0.1"): 0.269,
    ("τ=1", "below_0.1"): 0.222,
    ("top-p=0.8", "below_0.1"): 0.151,
    ("greedy", "below_0.1"): 0.035,
    ("greedy", "above_0.9"): 0.393,
    ("held-out", "above_0.9"): 0.242,
    ("greedy", "real_words"): 0.990,
    ("greedy", "nll"): 0.60,
    ("greedy", "repeated_trigrams"): 0.47,
    ("τ=1", "real_words"): 0.893,
    ("τ=1", "nll"): 1.26,
    ("held-out", "real_words"): 0.988,
    ("held-out", "nll"): 1.47,
}

WORD_RULE = ("a word is a maximal run of ASCII letters and apostrophes holding at least one letter, "
             "lowercased; a word touching the end of a text is left out (it may be cut off), and so "
             "is a first word that continues a prompt cut inside a word")

# ----------------------------------------------------------------------------- pure measures

_WORD = re.compile(r"[A-Za-z']*[A-Za-z][A-Za-z']*")
_WORD_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'")


def words(text: str, *, cut_start: bool = False) -> list[str]:
    """The whole words of ``text`` (see :data:`WORD_RULE`).

    The last word is dropped when it touches the end of ``text``; with ``cut_start`` (the text
    continues a prompt that ends inside a word) a first word touching the start is dropped too.
    """
    found = list(_WORD.finditer(text))
    if found and found[-1].end() == len(text):
        found.pop()
    if cut_start and found and found[0].start() == 0:
        found.pop(0)
    return [m.group().lower() for m in found]


def corpus_words(text: str) -> set[str]:
    """Every word of ``text`` (none left out: the corpus is one text whose ends do not matter)."""
    return {m.group().lower() for m in _WORD.finditer(text)}


def ends_inside_word(prompt: str) -> bool:
    """Whether a continuation of ``prompt`` starts inside a word."""
    return bool(prompt) and prompt[-1] in _WORD_CHARS


def ngrams(ws: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)]


def repeated_trigrams(samples: Sequence[Sequence[str]]) -> tuple[int, int]:
    """(trigrams that occurred earlier in the same sample, all trigrams), summed over samples."""
    repeated = total = 0
    for ws in samples:
        seen = set()
        for g in ngrams(ws, 3):
            repeated += g in seen
            seen.add(g)
            total += 1
    return repeated, total


def distinct_n(samples: Sequence[Sequence[str]], n: int) -> float | None:
    """Distinct n-grams over n-grams per sample, averaged over samples that have any (else None)."""
    ratios = [len(set(g)) / len(g) for g in (ngrams(ws, n) for ws in samples) if g]
    return float(np.mean(ratios)) if ratios else None


def probability_cdf(logprobs: Sequence[np.ndarray], grid: np.ndarray = GRID) -> np.ndarray:
    """The empirical CDF ``F(x) = P(p <= x)`` of the pooled per-token probabilities on ``grid``."""
    p = np.sort(np.exp(np.concatenate([np.asarray(lp, np.float64).reshape(-1) for lp in logprobs])))
    return np.searchsorted(p, grid, side="right") / len(p)


def measures(texts: Sequence[str], logprobs: Sequence[np.ndarray], vocabulary: set[str], *,
             cut_start: Sequence[bool] | None = None, train_vocabulary: set[str] | None = None) -> dict:
    """The measures of one setting: ``texts`` (one per prompt), ``logprobs`` the untruncated model's
    log-probability of each of their tokens, ``vocabulary`` the corpus's words (:func:`corpus_words`).

    ``cut_start[i]``: text ``i`` continues a prompt that ends inside a word (:func:`ends_inside_word`).
    Shares are None where there is nothing to count. See the module docstring for the definitions.
    """
    if len(texts) != len(logprobs):
        raise ValueError(f"{len(logprobs)} log-probability arrays for {len(texts)} texts")
    if not texts:
        raise ValueError("no texts to measure")
    cut_start = [False] * len(texts) if cut_start is None else list(cut_start)
    lp = np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in logprobs])
    if lp.size == 0:
        raise ValueError("no tokens to measure")
    p = np.exp(lp)
    samples = [words(t, cut_start=c) for t, c in zip(texts, cut_start)]
    pooled = [w for ws in samples for w in ws]
    share = lambda hits, total: hits / total if total else None
    rep, tri = repeated_trigrams(samples)
    out = {
        "tokens": int(lp.size),
        "nll": float(-lp.mean()),
        "below_0.1": float(np.mean(p < 0.1)),
        "above_0.9": float(np.mean(p > 0.9)),
        "words": len(pooled),
        "real_words": share(sum(w in vocabulary for w in pooled), len(pooled)),
    }
    if train_vocabulary is not None:
        out["real_words_train"] = share(sum(w in train_vocabulary for w in pooled), len(pooled))
    out.update({
        "trigrams": tri,
        "repeated_trigrams": share(rep, tri),
        "distinct_1": distinct_n(samples, 1),
        "distinct_2": distinct_n(samples, 2),
        "distinct_3": distinct_n(samples, 3),
        "cdf": probability_cdf(logprobs).tolist(),
    })
    return out


# ----------------------------------------------------------------------------- prompts and text


def prompt_offsets(held: str, prompts: Sequence[str]) -> list[int]:
    """Where each prompt of :func:`heldout_prompts` (over ``held`` or a beginning of it) starts.

    Each prompt starts a line; prompts come in the order of the text, so each is looked up at the
    first line start at or after the previous one that it matches.
    """
    offsets, at = [], 0
    for p in prompts:
        i = at
        while True:
            i = held.find(p, i)
            if i < 0:
                raise ValueError(f"prompt {p!r} not found in the held-out text after offset {at}")
            if i == 0 or held[i - 1] == "\n":
                break
            i += 1
        offsets.append(i)
        at = i + 1
    return offsets


def human_continuations(held: str, prompts: Sequence[str], n: int) -> list[str]:
    """The held-out text's own next ``n`` characters after each prompt."""
    out = []
    for p, s in zip(prompts, prompt_offsets(held, prompts)):
        cont = held[s + len(p):s + len(p) + n]
        if len(cont) < n:
            raise ValueError(f"the held-out text ends {len(cont)} characters after prompt {p!r}; need {n}")
        out.append(cont)
    return out


# ----------------------------------------------------------------------------- generation


def family_rule(groups: Sequence[dict], n_prompts: int, V: int):
    """The shared chain (:data:`CHAIN`) with one setting per row: rows ``g * n_prompts + i`` take
    group ``g``'s settings (e.g. ``{"top_p": 0.8}``, ``{"temperature": 0.0}``), the rest neutral."""
    from jaxdecode import rules

    unknown = set().union(*groups) - set(CHAIN)
    if unknown:
        raise ValueError(f"unknown setting(s) {sorted(unknown)}; the chain holds {CHAIN}")
    cols = {}
    for name in CHAIN:
        neutral = V if name == "top_k" else NEUTRAL[name]
        vals = [g.get(name, neutral) for g in groups]
        dtype = np.int32 if name == "top_k" else np.float32
        cols[name] = np.repeat(np.asarray(vals, dtype), n_prompts)
    return rules.make_rule(**cols)


def sample_groups(model, params, prompt_tokens: Sequence[np.ndarray], n: int, key, groups: Sequence[dict]):
    """One :func:`~jaxdecode.decoding.sampling.sample_tokens` call for every group of settings x prompt;
    returns per group ``(tokens [P, n], model_logprobs [P, n])``. Row ids are prompt indices."""
    from jaxdecode.decoding.sampling import sample_tokens

    P = len(prompt_tokens)
    rule = family_rule(groups, P, model.V)
    res = sample_tokens(model, params, list(prompt_tokens) * len(groups), n, key, rule=rule,
                        row_ids=list(range(P)) * len(groups))
    if not np.all(res.counts == n):
        raise RuntimeError("a sampled row stopped early")  # no stop strings: cannot happen
    rows = lambda g: slice(g * P, (g + 1) * P)
    return [(res.tokens[rows(g)], res.model_logprobs[rows(g)]) for g in range(len(groups))]


def _label(family: str, value) -> str:
    return f"{SYMBOLS[family]}={value:g}"


def generate_all(lm, prompts: Sequence[str], n: int, *, seed: int = 0, families: dict | None = None,
                 contrastive: bool = True, progress: bool = True) -> tuple[list[dict], dict]:
    """Every decoder's outputs after ``prompts``: a list of ``{"label", "family", "setting",
    "texts", "logprobs"}`` (families in order, then greedy, beam, contrastive, held-out last is
    added by the caller) and the seconds each part took."""
    from jaxdecode.decoding.beam import beam_generate
    from jaxdecode.decoding.score import score_texts

    families = FAMILIES if families is None else families
    tokens = [lm.vocab.encode(p) for p in prompts]
    key = jax.random.PRNGKey(seed)
    decode = lm.vocab.decode
    out, seconds = [], {}
    bar = progress_bar(len(families) + 1 + int(contrastive), NAME, progress)
    greedy_row = None
    for fam, values in families.items():
        start = time.perf_counter()
        groups = [{fam: v} for v in values]
        with_greedy = fam == GREEDY_FAMILY or (GREEDY_FAMILY not in families and greedy_row is None)
        if with_greedy:
            groups.append({"temperature": 0.0})
        bar.set_postfix_str(fam)
        res = sample_groups(lm.decoder, lm.params, tokens, n, key, groups)
        for v, (toks, lps) in zip(values, res):
            out.append({"label": _label(fam, v), "family": fam, "setting": v,
                        "texts": [decode(t) for t in toks], "logprobs": list(lps)})
        if with_greedy:
            toks, lps = res[-1]
            greedy_row = {"label": "greedy", "family": "greedy", "setting": None,
                          "texts": [decode(t) for t in toks], "logprobs": list(lps)}
        seconds[fam] = time.perf_counter() - start
        bar.update(1)
    if greedy_row is None:  # no sampling family at all
        start = time.perf_counter()
        toks, lps = sample_groups(lm.decoder, lm.params, tokens, n, key, [{"temperature": 0.0}])[0]
        greedy_row = {"label": "greedy", "family": "greedy", "setting": None,
                      "texts": [decode(t) for t in toks], "logprobs": list(lps)}
        seconds["greedy"] = time.perf_counter() - start
    out.append(greedy_row)

    start = time.perf_counter()
    bar.set_postfix_str("beam")
    # one prompt at a time: on the 2-core CPU a batch of 24 prompts (120 beams) took about 6x as
    # long as 24 searches of one prompt each (the per-row cost of a beam step grows with the batch)
    beams = [beam_generate(lm, p, n, BEAM_K)[0][0].text for p in prompts]
    scores = score_texts(lm, beams, list(prompts))
    out.append({"label": f"beam k={BEAM_K}", "family": "beam", "setting": BEAM_K, "texts": beams,
                "logprobs": [s.logprobs for s in scores]})
    seconds["beam"] = time.perf_counter() - start
    bar.update(1)

    if contrastive:
        from jaxdecode.decoding.contrastive import contrastive_generate

        start = time.perf_counter()
        bar.set_postfix_str("contrastive")
        gens = contrastive_generate(lm, list(prompts), n, CONTRASTIVE_K, CONTRASTIVE_ALPHA)
        out.append({"label": f"contrastive k={CONTRASTIVE_K} α={CONTRASTIVE_ALPHA:g}",
                    "family": "contrastive", "setting": {"k": CONTRASTIVE_K, "alpha": CONTRASTIVE_ALPHA},
                    "texts": [g.text for g in gens],
                    "logprobs": [np.asarray(g.model_logprobs) for g in gens]})
        seconds["contrastive"] = time.perf_counter() - start
        bar.update(1)
    bar.close()
    return out, seconds


# ----------------------------------------------------------------------------- output


def _pct(x) -> str:
    return fmt(None if x is None else 100 * x, ".1f") + ("" if x is None else "%")


def _markdown(result: dict, figure: bool) -> str:
    rows = {r["label"]: r for r in result["rows"]}
    names = {"below_0.1": "chars with p < 0.1", "above_0.9": "chars with p > 0.9",
             "real_words": "real words", "nll": "NLL (nats/char)",
             "repeated_trigrams": "repeated word trigrams"}
    key = []
    for (label, m), ref in CHAPTER.items():
        val = rows[label][m] if label in rows else None
        show = (lambda v: fmt(v, ".2f")) if m == "nll" else _pct
        key.append((label, names[m], show(val), show(ref)))
    every = [(r["label"], fmt(r["nll"], ".3f"), _pct(r["real_words"]), _pct(r.get("real_words_train")),
              _pct(r["below_0.1"]), _pct(r["above_0.9"]), _pct(r["repeated_trigrams"]),
              fmt(r["distinct_1"], ".3f"), fmt(r["distinct_2"], ".3f"), fmt(r["distinct_3"], ".3f"))
             for r in result["rows"]]
    lines = [
        f"# Quality against likelihood: {result['n_prompts']} held-out prompts x {result['n']} characters "
        f"(seed {result['seed']})",
        "",
        "Key numbers beside the chapter's (the book's checkpoint; ours is the shipped model, so the "
        "numbers differ: the pattern is what should agree). Our held-out text has 100% real words by "
        "construction (its words are the corpus's and cut-off words are left out); the chapter's 98.8% "
        "presumably counts words cut off at the end of a continuation.",
        "",
        md_table(("decoder", "measure", "ours", "chapter"), key),
        "",
        "Every setting (shares pooled over the prompts, distinct-n averaged per sample; NLL in nats "
        "per character under the untruncated model):",
        "",
        md_table(("decoder", "NLL", "real words", "real words (train 90%)", "p < 0.1", "p > 0.9",
                  "repeated trigrams", "distinct-1", "distinct-2", "distinct-3"), every),
        "",
        f"Prompts: {result['prompt_rule']}.",
        "",
        f"Words: {result['word_rule']}.",
    ]
    if figure:
        lines += ["", f"![per-character probability and quality against likelihood]({NAME}.png)"]
    return "\n".join(lines)


CDF_LABELS = ("held-out", "τ=1", "top-p=0.8", "min-p=0.1", "greedy", f"beam k={BEAM_K}")


def _plot(result: dict, path) -> bool:
    try:
        fig, axes = new_figure(1, 2, figsize=(11, 4.5))
    except ImportError:  # matplotlib is an optional dependency
        return False
    left, right = axes[0]
    rows = result["rows"]
    by_label = {r["label"]: r for r in rows}
    grid = GRID
    cdf_labels = list(CDF_LABELS) + [r["label"] for r in rows if r["family"] == "contrastive"]
    for label in cdf_labels:
        if label in by_label:
            style = {"color": "black", "lw": 2} if label == "held-out" else {}
            left.plot(grid, by_label[label]["cdf"], label=label, **style)
    left.set(xlabel="probability of the generated character (untruncated model)",
             ylabel="share of characters with probability ≤ x", xlim=(0, 1), ylim=(0, 1),
             title="per-character probability")
    left.legend(fontsize=8, loc="upper left")
    for fam in result["families"]:
        pts = [r for r in rows if r["family"] == fam and r["real_words"] is not None]
        if pts:
            right.plot([r["nll"] for r in pts], [100 * r["real_words"] for r in pts], "o-", ms=4,
                       label=SYMBOLS[fam])
            for r in pts:
                right.annotate(f"{r['setting']:g}", (r["nll"], 100 * r["real_words"]), fontsize=6,
                               xytext=(3, 2), textcoords="offset points")
    markers = {"greedy": "s", "beam": "D", "contrastive": "^", "held-out": "*"}
    for r in rows:
        if r["family"] in markers and r["real_words"] is not None:
            human = r["family"] == "held-out"
            right.plot(r["nll"], 100 * r["real_words"], markers[r["family"]], ms=9 if human else 7,
                       color="black" if human else None, label=r["label"])
    right.set(xlabel="negative log-likelihood (nats per character)", ylabel="real words (%)",
              title="quality against likelihood")
    right.legend(fontsize=7, ncol=2)
    save_figure(fig, path)
    return True


# ----------------------------------------------------------------------------- the study


def unsuitable(lm) -> str | None:
    """Why ``study all`` skips this study on ``lm``: on a subword model its 300 steps a prompt are
    tokens, not the characters its human continuations and measures are cut to, and they run past
    a 256-token window on the slow exact path (``study tradeoff`` still runs it when asked)."""
    if getattr(lm.vocab, "subword", False):
        return ("the tradeoff study is cut to characters (n = 300) and would run past a subword model's "
                "window on the slow exact path; run it alone with 'jaxdecode study tradeoff' if wanted")
    return None


def run(lm, out_dir, *, seed: int = 0, data_path=None, progress: bool = True, n: int = 300,
        n_prompts: int = 24, families: dict | None = None, contrastive: bool = True,
        examples: int = 2) -> dict:
    """The study; writes ``tradeoff.json``, ``tradeoff.md`` and (with matplotlib) ``tradeoff.png``
    into ``out_dir`` and returns the JSON's content plus ``seconds`` (per part) and ``files``.

    ``families`` overrides :data:`FAMILIES` (e.g. fewer settings); ``contrastive=False`` leaves
    contrastive search out; ``examples``: how many prompts' texts to store per decoder.
    """
    from jaxdecode.io.data import read_corpus, split

    started = time.perf_counter()
    families = dict(FAMILIES if families is None else families)
    corpus = read_corpus(data_path)
    train, held = split(corpus)
    # the rule of beam_curse.heldout_prompts over the held-out text less its last n characters,
    # so that the held-out text goes on for n characters after every prompt
    prompts = heldout_prompts(held[:len(held) - n], n_prompts)
    human = human_continuations(held, prompts, n)
    vocabulary, train_vocabulary = corpus_words(corpus), corpus_words(train)
    cut = [ends_inside_word(p) for p in prompts]

    outputs, seconds = generate_all(lm, prompts, n, seed=seed, families=families, contrastive=contrastive,
                                    progress=progress)
    start = time.perf_counter()
    from jaxdecode.decoding.score import score_texts

    outputs.append({"label": "held-out", "family": "held-out", "setting": None, "texts": human,
                    "logprobs": [s.logprobs for s in score_texts(lm, human, prompts)]})
    seconds["held-out"] = time.perf_counter() - start

    rows = []
    for o in outputs:
        m = measures(o["texts"], o["logprobs"], vocabulary, cut_start=cut, train_vocabulary=train_vocabulary)
        rows.append({"label": o["label"], "family": o["family"], "setting": o["setting"], **m})
    doc = {
        "study": NAME,
        "seed": seed,
        "n": n,
        "n_prompts": n_prompts,
        "prompt_rule": f"{PROMPT_RULE}; the held-out text less its last n characters, so that each prompt "
                       f"is followed by n characters of held-out text (the human continuation)",
        "word_rule": WORD_RULE,
        "row_ids": "row id = the prompt's index under every setting (common random numbers)",
        "families": {f: list(v) for f, v in families.items()},
        "chain": list(CHAIN),
        "greedy": "temperature 0 rows in the top-k call",
        "beam_k": BEAM_K,
        "contrastive": {"k": CONTRASTIVE_K, "alpha": CONTRASTIVE_ALPHA} if contrastive else None,
        "cdf_grid": GRID.tolist(),
        "measure_notes": {
            "probabilities": "under the untruncated model, pooled over all generated characters",
            "below_0.1": "share of characters with p < 0.1", "above_0.9": "share with p > 0.9",
            "cdf": "share of characters with p <= x for x in cdf_grid",
            "nll": "mean of -log p, nats per character",
            "real_words": "share of words (pooled) that occur in the whole corpus",
            "real_words_train": "share of words (pooled) that occur in the training 90%",
            "repeated_trigrams": "share of word trigrams (pooled) that occur earlier in the same sample",
            "distinct_n": "distinct word n-grams / n-grams per sample, averaged over samples with any",
        },
        "prompts": list(prompts),
        "chapter": {f"{label}: {m}": v for (label, m), v in CHAPTER.items()},
        "rows": rows,
        "examples": {o["label"]: o["texts"][:examples] for o in outputs},
    }
    out = output_folder(out_dir)
    result = write_json(out / f"{NAME}.json", doc)
    figure = _plot(result, out / f"{NAME}.png")
    write_markdown(out / f"{NAME}.md", _markdown(result, figure))
    seconds["total"] = time.perf_counter() - started
    result["files"] = [str(out / f"{NAME}{s}") for s in (".json", ".md") + ((".png",) if figure else ())]
    result["seconds"] = seconds
    return result
