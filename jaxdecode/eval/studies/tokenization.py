"""Many spellings of one text: how a subword vocabulary meets sampling and constrained decoding.

A byte-level BPE tokenizer writes a text one way, its **canonical** tokenization
(``vocab.encode_piece(text)``), but the model may spell the same text with other tokens ("Ay" as
``A`` + ``y``). Every probability over *strings* is a sum over every spelling; masking a pattern
token by token also forbids tokens that would cross the pattern's edges. On a model with such a
vocabulary (``--ckpt shakespeare-bpe``; a character model is refused), seeded, it measures:

1. **Non-canonical outputs** of plain and masked samples (with a 95% Wilson interval), and the
   exact non-canonical share of the masked sampler ``Q`` and the conditional ``P`` where the
   language can be enumerated;
2. **Mass lost at token boundaries**: ``1 - Z_1``, the nats the mask removes over an output
   (:mod:`jaxdecode.decoding.smc`'s weights), and ``P(language)`` over every spelling and over
   canonical ones only;
3. **Masked against conditional, over strings**: TV(P, Q), KL(P || Q) and SMC's estimate of ``P``
   (a language too large to enumerate: sampled quantities only);
4. **Token healing**: the prompt's last token taken back into the pattern, the same numbers again.

The languages with an end token and those without, and how long an enumeration runs:
``docs/chapter.md`` (Tokenization and constraints). Everything is the raw model (no generation
defaults, no rule). The JSON holds no timings: one seed writes the same bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

import numpy as np

from jaxdecode import constraints as C
from jaxdecode.decoding import smc
from jaxdecode.decoding.common import next_logits_for
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

NAME = "tokenization"
END = "{end}"  # stands for the end token's text in a prompt
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
SPEAKERS = ("ROMEO", "JULIET", "NURSE", "FRIAR LAURENCE", "BENVOLIO", "First Watchman")
PLAIN_PROMPTS = (f"{END}ROMEO:\n", f"{END}JULIET:\n", f"{END}FRIAR LAURENCE:\nThe night is spent, and")


class Language(NamedTuple):
    """A pattern after a prompt (see the module docstring for ``ends_speech``)."""

    name: str
    about: str
    prompt: str
    pattern: str
    ends_speech: bool = False


LANGUAGES = (
    Language("heading", "the heading of the next speech", f"{END}ROMEO:\nGood night, good night!{END}",
             "(" + "|".join(SPEAKERS) + "):"),
    Language("word", "the first word of a speech", f"{END}JULIET:\n", "(O|Ay|Nay|Why|Come|Good),"),
    Language("answer", "a speech of one word", f"{END}ROMEO:\n", "(Ay|Nay|Yes|No)[.!]", True),
    Language("after-space", "a word after a prompt ending in a space", f"{END}ROMEO:\nGood ",
             "(night|morrow|friar|nurse)[,.!]"),
    Language("line", "a first line of three to seven words", f"{END}JULIET:\n",
             "[A-Z][a-z]*(,? [a-z]+){2,6}[.!?]"),
)
SAMPLES = 256
PLAIN_TOKENS = 48
LINE_TOKENS = 32
PARTICLES = (100, 1000)
MAX_OUTPUTS = 5000


# ----------------------------------------------------------------------------- checks and small parts


def unsuitable(lm) -> str | None:
    """Why the study cannot run on ``lm`` (one line), or None: it needs a subword vocabulary
    with an end token."""
    if not getattr(lm.vocab, "subword", False):
        return ("the tokenization study needs a model with a subword vocabulary (this one has a token "
                "per character): run it with --ckpt shakespeare-bpe")
    if not lm.eos_ids:
        return "the tokenization study needs a model with an end token: run it with --ckpt shakespeare-bpe"
    return None


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of ``k`` successes in ``n`` trials (95% by default)."""
    if n <= 0:
        return math.nan, math.nan
    p = k / n
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, centre - half), min(1.0, centre + half)


def share(flags) -> dict:
    """How many of ``flags`` are true, of how many, the share and its 95% interval."""
    flags = [bool(f) for f in flags]
    k, n = sum(flags), len(flags)
    return {"count": k, "of": n, "share": k / n if n else math.nan, "ci95": list(wilson(k, n))}


class Canonical:
    """``self(tokens)``: whether ``tokens``, end tokens removed, are ``vocab.encode_piece`` of
    their own text (encodings cached by text)."""

    def __init__(self, vocab, ends=()):
        self.vocab, self.ends, self.cache = vocab, {int(e) for e in ends}, {}

    def __call__(self, tokens) -> bool:
        body = [int(t) for t in np.asarray(tokens).reshape(-1) if int(t) not in self.ends]
        text = self.vocab.decode(np.asarray(body, np.int32))
        if text not in self.cache:
            self.cache[text] = self.vocab.encode_piece(text).tolist()
        return self.cache[text] == body


def language_constraint(lm, pattern: str, ends_speech: bool) -> C.Constraint:
    """``pattern`` over the model's tokens: with its end tokens (``ends_speech``), or without them
    (the output stops when the pattern is complete)."""
    c = C.compile_regex(pattern, lm.vocab)
    if ends_speech:
        if not c.end_tokens:
            raise ValueError("a language that ends a speech needs the model's end token")
        return c
    table = c.table.copy()
    table[:, list(c.end_tokens)] = -1
    return dataclasses.replace(c, table=table, end_tokens=())


def longest_output(c: C.Constraint) -> int | None:
    """The most tokens of any string of the language (end tokens not counted); None when the
    language is infinite (a cycle among its states: every state can reach a final one)."""
    table = c.table.copy()
    table[:, list(c.end_tokens)] = -1
    succ = [sorted(set(table[s][table[s] >= 0].tolist())) for s in range(c.states)]
    memo: dict[int, int] = {}
    on_path: set[int] = set()

    def walk(s: int) -> int | None:
        if s in memo:
            return memo[s]
        if s in on_path:
            return None
        on_path.add(s)
        best = 0 if c.final[s] else -1
        for t in succ[s]:
            sub = walk(t)
            if sub is None:
                return None
            best = max(best, sub + 1)
        on_path.discard(s)
        memo[s] = best
        return best

    return walk(0)


def _log_softmax(logits) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _allowed_mass(c: C.Constraint, states, left, logp) -> np.ndarray:
    """Per row: the model's probability on the tokens allowed in ``states`` with ``left`` tokens left."""
    nxt = c.table[np.asarray(states)]
    ok = (nxt >= 0) & (c.dist[np.maximum(nxt, 0)] <= np.asarray(left)[:, None] - 1)
    return np.where(ok, np.exp(logp), 0.0).sum(axis=1)


def _by_text(texts, weights) -> dict[str, float]:
    out: dict[str, float] = {}
    for t, w in zip(texts, weights):
        out[t] = out.get(t, 0.0) + float(w)
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def _strip(text: str, tail: str) -> str:
    if not text.startswith(tail):
        raise AssertionError(f"an output {text!r} does not begin with the healed tail {tail!r}")
    return text[len(tail):]


# ----------------------------------------------------------------------------- the measurements


def exact_language(lm, ids, c: C.Constraint, n: int, *, tail: str = "",
                   max_outputs: int = MAX_OUTPUTS) -> dict:
    """What the enumeration of ``c`` after the prompt ``ids`` gives (see the module docstring);
    ``tail``: the healed text, cut from each output's text. The keys ``_P`` and ``_Q`` (the two
    distributions over strings) are for the study's own use and are not written."""
    ids = np.asarray(ids, np.int32)
    walk = smc.enumerate_outputs(lm, ids, n, c, max_outputs=max_outputs)
    canonical = Canonical(lm.vocab, lm.eos_ids)
    texts = [_strip(t, tail) for t in walk.texts]
    canon = np.array([canonical(t) for t in walk.tokens], bool)
    log_p, log_q = walk.log_p, walk.log_q
    lz = walk.log_normalizer
    p = np.exp(log_p - lz)
    q = np.exp(log_q - np.logaddexp.reduce(log_q))
    next_logits = next_logits_for(lm.decoder, lm.params)
    z1 = float(_allowed_mass(c, [0], [n], _log_softmax(next_logits(ids[None])))[0])
    # the end step's log Z_t, which log Q - log P counts and the removed nats leave out
    log_z_end = np.zeros(len(texts))
    if c.end_tokens:
        lengths = np.array([len(t) for t in walk.tokens])
        for m in sorted(set(lengths.tolist()) - {n}):  # n tokens: ended by the length limit
            rows = np.flatnonzero(lengths == m)
            seqs = np.array([walk.tokens[r] for r in rows], np.int32).reshape(len(rows), m)
            full = np.concatenate([np.broadcast_to(ids, (len(rows), len(ids))), seqs], axis=1)
            states = [c.walk(s) for s in seqs]
            mass = _allowed_mass(c, states, np.full(len(rows), n - m), _log_softmax(next_logits(full)))
            log_z_end[rows] = np.log(mass)
    P, Q = _by_text(texts, p), _by_text(texts, q)
    spellings = _by_text(texts, np.ones(len(texts)))
    on_canonical = _by_text(texts, np.where(canon, p, 0.0))
    lz_canon = float(np.logaddexp.reduce(log_p[canon]))
    return {
        "n": n,
        "strings": len(P),
        "token_sequences": len(texts),
        "first_step_forbidden": 1.0 - z1,
        "removed_nats": float(np.sum(q * (log_q - log_p + log_z_end))),
        "log_p_language": lz,
        "log_p_language_canonical": lz_canon,
        "canonical_only_misses": 1.0 - math.exp(lz_canon - lz),
        "noncanonical_q": float(q[~canon].sum()),
        "noncanonical_p": float(p[~canon].sum()),
        "tv": smc.total_variation(P, Q),
        "kl_p_q": smc.kl_divergence(P, Q),
        "rows": [{"string": s, "p": P[s], "q": Q.get(s, 0.0), "spellings": int(spellings[s]),
                  "p_on_canonical": on_canonical.get(s, 0.0)} for s in P],
        "_P": P, "_Q": Q,
    }


def _exact_or_none(lm, ids, c, n, tail, max_outputs):
    """:func:`exact_language`, or None for a language of more than ``max_outputs`` token sequences."""
    try:
        return exact_language(lm, ids, c, n, tail=tail, max_outputs=max_outputs)
    except ValueError as e:
        if "max_outputs" not in str(e):
            raise
        return None


def masked_samples(lm, prompt: str, c: C.Constraint, n: int, samples: int, seed: int, tail: str = "",
                   Q: dict | None = None) -> tuple[dict, list]:
    """``samples`` masked samples of ``n`` tokens: their non-canonical share and, when the exact
    masked distribution ``Q`` is given, their string frequencies' TV to it; and the samples."""
    gens = generate(lm, prompt, n, constraint=c, num_samples=samples, seed=seed, generation_config=False)
    canonical = Canonical(lm.vocab, lm.eos_ids)
    out = {"noncanonical": share(not canonical(g.tokens) for g in gens)}
    if Q is not None:
        freq = _by_text([_strip(g.text, tail) for g in gens], np.full(len(gens), 1.0 / len(gens)))
        out["tv_to_q"] = smc.total_variation(freq, Q)
    return out, gens


def sampled_language(lm, prompt: str, ids, c, n: int, samples: int, particles: int, seed: int) -> dict:
    """A language too large to enumerate: masked samples against SMC's weighted particles (their
    non-canonical shares, and their distributions of the number of words)."""
    masked, gens = masked_samples(lm, prompt, c, n, samples, seed)
    res = smc.smc_generate(lm, ids, n, c, particles, seed=seed)
    canonical = Canonical(lm.vocab, lm.eos_ids)
    smc_canon = np.array([canonical(t) for t in res.tokens], bool)
    words = {"masked": _by_text([str(len(g.text.split())) for g in gens], np.full(len(gens), 1 / len(gens))),
             "smc": _by_text([str(len(t.split())) for t in res.texts], res.weights)}
    return {
        "n": n, "masked_samples": masked, "particles": particles,
        "smc_noncanonical": float(res.weights[~smc_canon].sum()),
        "smc_log_p_language": res.log_marginal, "smc_final_ess": res.final_ess,
        "words": words, "tv_words_masked_smc": smc.total_variation(words["masked"], words["smc"]),
    }


def heal_tail(lm, ids) -> str | None:
    """The text of the prompt's last token when healing applies to it (a plain token, a proper
    byte prefix of another plain token, and not the prompt's only token), else None."""
    if len(ids) < 2:
        return None
    last = int(ids[-1])
    special = set(getattr(lm.vocab, "special", ())) | set(lm.eos_ids)
    b = lm.vocab.token_bytes(last)
    if last in special or not b:
        return None
    others = (lm.vocab.token_bytes(i) for i in range(len(lm.vocab)) if i not in special)
    longer = any(len(o) > len(b) and o.startswith(b) for o in others)
    try:
        return b.decode("utf-8") if longer else None
    except UnicodeDecodeError:
        return None


def _text(lm, template: str) -> str:
    """A prompt template with the model's end token written in."""
    return template.replace(END, lm.vocab.token_bytes(lm.eos_ids[0]).decode("utf-8"))


def _healing(lm, lang: Language, prompt: str, ids, unhealed: dict, samples, seed, max_outputs) -> dict:
    tail = heal_tail(lm, ids)
    if tail is None:
        return {"applies": False, "why": "the prompt's last token is a prefix of no other token"}
    healed = prompt[:-len(tail)] if prompt.endswith(tail) else None
    if healed is None or lm.vocab.encode(healed).tolist() != ids[:-1].tolist():
        return {"applies": False, "why": "the prompt without its last token encodes differently"}
    hc = language_constraint(lm, re.escape(tail) + f"(?:{lang.pattern})", lang.ends_speech)
    hn = longest_output(hc) + int(lang.ends_speech)
    ex = _exact_or_none(lm, ids[:-1], hc, hn, tail, max_outputs)
    if ex is None:
        return {"applies": False, "why": f"healed, more than {max_outputs} token sequences"}
    ex["masked_samples"] = masked_samples(lm, healed, hc, hn, samples, seed, tail, ex["_Q"])[0]
    ex["tv_to_unhealed_p"] = smc.total_variation(ex["_P"], unhealed["_P"])
    return {"applies": True, "tail": tail, "prompt": healed, **ex}


def study_language(lm, lang: Language, *, samples: int, particles, seed: int, max_outputs: int,
                   line_tokens: int, tick) -> dict:
    """One language: exact numbers, SMC and masked samples, and healing where it applies; or,
    for one that cannot be enumerated (infinite, or too long for the window), sampled ones."""
    prompt = _text(lm, lang.prompt)
    ids = lm.vocab.encode(prompt)
    c = language_constraint(lm, lang.pattern, lang.ends_speech)
    longest = longest_output(c)
    out = {"name": lang.name, "about": lang.about, "prompt": prompt, "pattern": lang.pattern,
           "ends_speech": lang.ends_speech}
    room = lm.decoder.T - len(ids)
    ex, why = None, f"more than {max_outputs} token sequences"
    if longest is None or longest + lang.ends_speech > room:
        why = "infinite language" if longest is None else "longer than the model's window"
    else:
        ex = _exact_or_none(lm, ids, c, longest + int(lang.ends_speech), "", max_outputs)
    if ex is None:
        n = min(line_tokens, room)
        out.update(enumerated=False, why_not=why,
                   sampled=sampled_language(lm, prompt, ids, c, n, samples, max(particles), seed))
        tick(2)
        return out
    n = ex["n"]
    ex["smc"] = []
    for k in particles:
        res = smc.smc_generate(lm, ids, n, c, k, seed=seed)
        S = _by_text(res.texts, res.weights)
        ex["smc"].append({"particles": k, "tv_to_p": smc.total_variation(ex["_P"], S),
                          "log_p_language": res.log_marginal})
    out.update(enumerated=True, exact=ex,
               masked_samples=masked_samples(lm, prompt, c, n, samples, seed, Q=ex["_Q"])[0])
    tick(1)
    out["healing"] = _healing(lm, lang, prompt, ids, ex, samples, seed, max_outputs)
    tick(1)
    return out


def plain_samples(lm, template: str, samples: int, tokens: int, seed: int) -> dict:
    """``samples`` plain samples of up to ``tokens`` tokens after one prompt: the non-canonical share."""
    prompt = _text(lm, template)
    n = min(tokens, lm.decoder.T - len(lm.vocab.encode(prompt)))
    gens = generate(lm, prompt, n, num_samples=samples, seed=seed, generation_config=False)
    canonical = Canonical(lm.vocab, lm.eos_ids)
    return {"prompt": prompt, "n": n, "noncanonical": share(not canonical(g.tokens) for g in gens),
            "ended_by_end_token": sum(g.finish_reason == "eos" for g in gens)}


def measure(lm, *, seed: int = 0, samples: int = SAMPLES, plain_tokens: int = PLAIN_TOKENS,
            particles=PARTICLES, max_outputs: int = MAX_OUTPUTS, line_tokens: int = LINE_TOKENS,
            bar=None) -> dict:
    """The study's numbers (see the module docstring), without writing anything."""
    reason = unsuitable(lm)
    if reason:
        raise ValueError(reason)
    for name, v in (("samples", samples), ("plain_tokens", plain_tokens), ("max_outputs", max_outputs),
                    ("line_tokens", line_tokens), *(("particles", k) for k in particles)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    particles = tuple(int(k) for k in particles)
    if not particles:
        raise ValueError("give at least one particle count")
    tick = bar.update if bar is not None else (lambda k: None)
    plain = []
    for template in PLAIN_PROMPTS:
        plain.append(plain_samples(lm, template, samples, plain_tokens, seed))
        tick(1)
    langs = [study_language(lm, lang, samples=samples, particles=particles, seed=seed,
                            max_outputs=max_outputs, line_tokens=line_tokens, tick=tick)
             for lang in LANGUAGES]
    path = getattr(lm, "path", None)
    return {
        "study": NAME,
        "model": {"name": None if path is None else path.name, "path": None if path is None else str(path),
                  "vocabulary": len(lm.vocab), "end_token": _text(lm, END)},
        "seed": seed,
        "settings": {"samples": samples, "plain_tokens": plain_tokens, "particles": list(particles),
                     "max_outputs": max_outputs, "line_tokens": line_tokens},
        "plain": plain,
        "languages": langs,
    }


def _public(obj):
    """``obj`` without the keys that start with ``_``."""
    if isinstance(obj, list):
        return [_public(v) for v in obj]
    return {k: _public(v) for k, v in obj.items() if k[0] != "_"} if isinstance(obj, dict) else obj


# ----------------------------------------------------------------------------- the report


def _variants(result: dict):
    """``(label, exact numbers, masked samples)`` of every enumerated language, each healed one
    after its unhealed one."""
    for lang in result["languages"]:
        if lang["enumerated"]:
            yield lang["name"], lang["exact"], lang["masked_samples"]
            if lang["healing"]["applies"]:
                yield f"{lang['name']} (healed)", lang["healing"], lang["healing"]["masked_samples"]


def _pct(x, spec: str = ".1f") -> str:
    return "–" if x is None else f"{100 * x:{spec}}%"


def _interval(s: dict) -> str:
    lo, hi = s["ci95"]
    return f"{_pct(s['share'])} ({_pct(lo)}–{_pct(hi)})"


def _plot(result: dict, path) -> None:
    fig, axes = new_figure(1, 2, figsize=(12, 4.2))
    ax = axes[0][0]
    variants = list(_variants(result))
    x = np.arange(len(variants))
    series = [("TV(P, Q)", "tv"), ("non-canonical mass under Q", "noncanonical_q"),
              ("non-canonical mass under P", "noncanonical_p"), ("1 - Z_1", "first_step_forbidden")]
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        heights = [e[key] or 0.0 for _, e, _ in variants]
        ax.bar(x + (i - (len(series) - 1) / 2) * width, heights, width, label=label)
    ax.set_xticks(x)
    ax.set_xticklabels([v[0] for v in variants], rotation=20, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_title("enumerated languages: the masked Q against the conditional P")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    rows = [(f"plain {i + 1}", p["noncanonical"]) for i, p in enumerate(result["plain"])]
    rows += [(f"masked {label}", m["noncanonical"]) for label, _, m in variants]
    rows += [(f"masked {lang['name']}", lang["sampled"]["masked_samples"]["noncanonical"])
             for lang in result["languages"] if not lang["enumerated"]]
    y = [s["share"] for _, s in rows]
    err = np.array([[v - s["ci95"][0], s["ci95"][1] - v] for (_, s), v in zip(rows, y)]).T
    ax.barh(np.arange(len(rows)), y, xerr=err, color="tab:gray", capsize=3)
    ax.set_yticks(np.arange(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("share of samples not canonically tokenized (95% interval)")
    ax.set_title("non-canonical samples")
    save_figure(fig, path)


def _findings(result: dict) -> list[str]:
    """Sentences that state what the numbers show, worded from the numbers themselves."""
    plain = [p["noncanonical"]["share"] for p in result["plain"]]
    out = [f"Plain samples are non-canonically tokenized in {_pct(min(plain))} to {_pct(max(plain))} of "
           f"cases across the {len(plain)} prompts."]
    variants = [(label, e) for label, e, _ in _variants(result) if not label.endswith("(healed)")]
    more = [label for label, e in variants if e["noncanonical_q"] > e["noncanonical_p"]]
    less = [label for label, e in variants if e["noncanonical_q"] < e["noncanonical_p"]]
    for word, names in (("more", more), ("less", less)):
        if names:
            out.append(f"The masked sampler puts {word} probability on non-canonical spellings than the "
                       f"model's conditional does for {', '.join(names)}.")
    if variants:
        label, e = max(variants, key=lambda v: v[1]["canonical_only_misses"])
        out.append("Counting canonical spellings only misses at most "
                   f"{_pct(e['canonical_only_misses'], '.2f')} of P(language) ({label}).")
        label, e = max(variants, key=lambda v: v[1]["tv"])
        out.append(f"TV(P, Q) over strings is largest for {label} ({fmt(e['tv'], '.3f')}).")
        last = [(label, e["smc"][-1]) for label, e in variants]
        label, worst = max(last, key=lambda v: v[1]["tv_to_p"])
        out.append(f"With {worst['particles']} particles SMC is within TV {fmt(worst['tv_to_p'], '.3f')} "
                   f"of P on every enumerated language (the largest: {label}).")
    for lang in result["languages"]:
        h = lang.get("healing", {})
        if h.get("applies"):
            e = lang["exact"]
            z_before, z_after = fmt(e["first_step_forbidden"], ".3f"), fmt(h["first_step_forbidden"], ".3f")
            out.append(f"Healing {lang['name']} (the tail {md_text(h['tail'])}) moves 1 − Z_1 from "
                       f"{z_before} to {z_after} and TV(P, Q) from {fmt(e['tv'], '.3f')} to "
                       f"{fmt(h['tv'], '.3f')}; the conditional over strings moves by TV "
                       f"{fmt(h['tv_to_unhealed_p'], '.3f')}.")
    return out


def _markdown(result: dict) -> str:
    m, s = result["model"], result["settings"]
    ks = " / ".join(map(str, s["particles"]))
    shares = [[md_text(p["prompt"], 40), p["n"], _interval(p["noncanonical"]), "–", "–"]
              for p in result["plain"]]
    boundary = []
    for label, e, ms in _variants(result):
        shares.append([f"masked: {label}", e["n"], _interval(ms["noncanonical"]),
                       _pct(e["noncanonical_q"], ".2f"), _pct(e["noncanonical_p"], ".2f")])
        smc_tv = " / ".join(fmt(r["tv_to_p"], ".3f") for r in e.get("smc", [])) or "–"
        boundary.append([label, e["strings"], e["token_sequences"], fmt(e["first_step_forbidden"], ".3f"),
                         fmt(e["removed_nats"], ".3f"), fmt(math.exp(e["log_p_language"]), ".3g"),
                         _pct(e["canonical_only_misses"], ".2f"), fmt(e["tv"], ".3f"),
                         fmt(e["kl_p_q"], ".3f"), smc_tv, fmt(ms.get("tv_to_q"), ".3f")])
    sampled = []
    for lang in result["languages"]:
        if not lang["enumerated"]:
            sm = lang["sampled"]
            shares.append([f"masked: {lang['name']}", sm["n"],
                           _interval(sm["masked_samples"]["noncanonical"]), "–",
                           f"{_pct(sm['smc_noncanonical'], '.2f')} (SMC)"])
            sampled.append([lang["name"], md_text(lang["pattern"]), lang["why_not"],
                            fmt(sm["tv_words_masked_smc"], ".3f"), fmt(sm["smc_final_ess"], ".1f")])
    parts = [
        "# Tokenization and constrained decoding\n",
        f"Model {md_text(str(m['name']))} ({m['vocabulary']} tokens), seed {result['seed']}, "
        f"{s['samples']} samples per prompt and language, SMC with {ks} particles. A sample is "
        "non-canonical when its tokens (end token removed) are not the tokenizer's encoding of its text. "
        "P: the model conditioned on the language; Q: the masked sampler; both over strings, every "
        "spelling of a string summed.\n",
        "## Non-canonical outputs\n",
        md_table(["source", "tokens", "sampled (95% interval)", "exact under Q", "exact under P"],
                 shares) + "\n",
        "## Token boundaries, and masked against conditional\n",
        "1 − Z_1: the model's probability on the first tokens the mask forbids; removed: the nats the mask "
        "removes before the end token, expected under Q; P(L): the model's probability of the language; "
        "canonical only misses: the share of P(L) on non-canonical spellings.\n",
        md_table(["language", "strings", "spellings", "1 − Z_1", "removed (nats)", "P(L)",
                  "canonical only misses", "TV(P, Q)", "KL(P ‖ Q)", f"SMC TV to P ({ks})",
                  "samples' TV to Q"], boundary) + "\n",
    ]
    if sampled:
        parts += [f"Too large to enumerate: masked samples against SMC ({max(s['particles'])} particles) "
                  "on the number of words.\n",
                  md_table(["language", "pattern", "why", "TV of word counts", "SMC final ESS"], sampled)
                  + "\n"]
    parts += ["## What the numbers show\n", " ".join(_findings(result)) + "\n",
              f"![TV and non-canonical shares per language]({NAME}.png)"]
    return "\n".join(parts)


def run(lm, out_dir, *, seed: int = 0, data_path=None, progress: bool = True, samples: int = SAMPLES,
        plain_tokens: int = PLAIN_TOKENS, particles=PARTICLES, max_outputs: int = MAX_OUTPUTS,
        line_tokens: int = LINE_TOKENS) -> dict:
    """Writes ``tokenization.json``, ``tokenization.png`` and ``tokenization.md`` into ``out_dir``.
    A model without a subword vocabulary and an end token is refused (:class:`ValueError`, one
    line) before anything is written. ``data_path`` is accepted for a uniform interface (no
    corpus is read: the prompts are the module's)."""
    reason = unsuitable(lm)
    if reason:
        raise ValueError(reason)
    with progress_bar(len(PLAIN_PROMPTS) + 2 * len(LANGUAGES), NAME, progress) as bar:
        result = measure(lm, seed=seed, samples=samples, plain_tokens=plain_tokens, particles=particles,
                         max_outputs=max_outputs, line_tokens=line_tokens, bar=bar)
    out = output_folder(out_dir)
    result = write_json(out / f"{NAME}.json", _public(result))
    _plot(result, out / f"{NAME}.png")
    write_markdown(out / f"{NAME}.md", _markdown(result))
    result["files"] = [str(out / f"{NAME}{s}") for s in (".json", ".png", ".md")]
    return result
