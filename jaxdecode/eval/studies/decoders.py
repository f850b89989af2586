"""The chapter's decoder comparison: the human continuation, greedy, beam search and sampling
after the KATHARINA prompt, each scored by the model's mean log-probability per character."""

from __future__ import annotations

from jaxdecode.io import data as data_lib
from jaxdecode.decoding.beam import beam_generate
from jaxdecode.decoding.sampling import generate
from jaxdecode.decoding.score import score_texts
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

NAME = "decoders"
PROMPT = "KATHARINA:\nMoved! in good time: "


def compare(lm, text: str, prompt: str = PROMPT, n: int = 120, k: int = 5, seed: int = 0,
            bar=None) -> dict:
    """Four continuations of ``prompt`` of ``n`` characters; ``text`` is the corpus that holds
    the human continuation (the prompt must occur in it). ``bar``: a progress bar to advance
    (four steps)."""
    at = text.find(prompt)
    if at < 0:
        raise ValueError(f"the prompt {prompt!r} does not occur in the corpus")
    step = (lambda: bar.update(1)) if bar is not None else (lambda: None)
    rest = text[at + len(prompt):at + len(prompt) + 16 * n]
    subword = getattr(lm.vocab, "subword", False)
    # n tokens of the human text: characters for the character model, subword tokens otherwise
    human = lm.vocab.decode(lm.vocab.encode_piece(rest)[:n]) if subword else rest[:n]
    outputs = {"human": human}
    outputs["greedy"] = generate(lm, prompt, n, greedy=True)[0].text
    step()
    outputs[f"beam, k={k}"] = beam_generate(lm, prompt, n, k)[0][0].text
    step()
    outputs["sampling"] = generate(lm, prompt, n, seed=seed)[0].text
    step()
    # a model with an end token may end an output at once: an empty text has no score
    scored = [t for t in outputs.values() if t]
    scores = iter(score_texts(lm, scored, [prompt] * len(scored)))
    step()
    return {"prompt": prompt, "n": n, "seed": seed, "unit": "token" if subword else "character",
            "rows": [{"decoder": name, "mean_logprob": next(scores).mean_logprob if t else float("nan"), "text": t}
                     for name, t in outputs.items()]}


def _plot(result: dict, path) -> None:
    fig, axes = new_figure(1, 1, figsize=(6, 3))
    ax = axes[0, 0]
    rows = result["rows"]
    y = range(len(rows))
    nll = [float("nan") if r["mean_logprob"] is None else -r["mean_logprob"] for r in rows]
    ax.barh(list(y), nll, color="tab:blue")
    ax.set_yticks(list(y), [r["decoder"] for r in rows])
    ax.invert_yaxis()
    unit = result.get("unit", "character")
    ax.set(xlabel=f"negative log-likelihood (nats per {unit})",
           title=f"{result['n']} {unit}s after {result['prompt'][-16:]!r}")
    save_figure(fig, path)


def _markdown(result: dict) -> str:
    rows = [[r["decoder"], fmt(r["mean_logprob"]), md_text(r["text"])] for r in result["rows"]]
    unit = result.get("unit", "character")
    return "\n".join([
        "# Decoders after a prompt\n",
        f"{result['n']} {unit}s after {md_text(result['prompt'])}: Shakespeare's own continuation "
        f"(human), greedy decoding, beam search and sampling at temperature 1 (seed {result['seed']}), "
        f"each scored by the model's mean log-probability per {unit} (an output that ends at once at the "
        "model's end token has no score: –).\n",
        md_table(["decoder", f"mean log-probability (nats/{unit[:4] if unit == 'character' else unit})", "text"],
                 rows) + "\n",
        f"![negative log-likelihood per decoder]({NAME}.png)",
    ])


def run(lm, out_dir, *, seed: int = 0, data_path=None, progress: bool = True, n: int = 120,
        k: int = 5, prompt: str = PROMPT) -> dict:
    """Writes ``decoders.json``, ``decoders.png`` and ``decoders.md`` into ``out_dir``; ``seed``
    is the sampling row's; ``prompt`` must occur in the corpus."""
    out = output_folder(out_dir)
    text = data_lib.read_corpus(data_path)
    with progress_bar(4, NAME, progress) as bar:
        result = compare(lm, text, prompt=prompt, n=n, k=k, seed=seed, bar=bar)
    result = write_json(out / f"{NAME}.json", {"study": NAME, **result})
    _plot(result, out / f"{NAME}.png")
    write_markdown(out / f"{NAME}.md", _markdown(result))
    result["files"] = [str(out / f"{NAME}{s}") for s in (".json", ".png", ".md")]
    return result
