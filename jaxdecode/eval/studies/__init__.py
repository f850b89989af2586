"""The chapter's experiments, one module each, and the registry the ``study`` command runs.

Every study module has ``run(lm, out_dir, *, seed=0, data_path=None, progress=True, ...)`` that
writes ``NAME.json``, ``NAME*.png`` and ``NAME.md`` into ``out_dir`` (see :mod:`.common`) and
returns the numbers it wrote. With one seed a second run writes the same JSON, byte for byte
(except ``cost``, whose numbers are timings).

Modules are imported only when their study runs, so a study whose module is not installed
(``tradeoff`` before it is written) makes only that study fail, with a clear message. A module may
also have ``unsuitable(lm)``: a one-line reason why it cannot run on that model (``tokenization``
on a character model), or None; ``all`` skips such a study with that reason as a note.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path

from jaxdecode.io.registry import Registry


class StudyUnavailable(RuntimeError):
    """A registered study whose module is not installed."""


@dataclasses.dataclass(frozen=True)
class Study:
    """A study by name: its module under ``jaxdecode.eval.studies``, a one-line description, and the
    options of the ``study`` command it takes, as ``(command-line dest, run() keyword)``, and the
    shipped checkpoint it runs on when the command names none (None: the default one). The
    registry, :data:`STUDIES`, is a :class:`~jaxdecode.io.registry.Registry`, as the rules' and the
    drafts' are."""

    name: str
    module: str
    about: str
    options: tuple[tuple[str, str], ...] = ()
    ckpt: str | None = None


STUDIES: Registry[Study] = Registry("study", (
    Study("decoders", "decoders", "human, greedy, beam and sampling after the KATHARINA prompt"),
    Study("truncation", "truncation", "what each truncation rule keeps at a word start and inside 'hither'"),
    Study("tradeoff", "tradeoff", "quality against likelihood for each rule and setting"),
    Study("speculative", "speculative", "speculative decoding: the toy check and the gamma sweep",
          options=(("draft", "draft"),)),
    Study("beam-curse", "beam_curse", "beam search against the exact mode on held-out prompts",
          options=(("prompts", "n_prompts"), ("n", "n"), ("budget", "node_budget"))),
    Study("constrained", "constrained", "masked against exact conditional sampling of a choice of names (SMC)"),
    Study("cost", "cost", "prefill against decode, throughput against batch size (timings)"),
    Study("tokenization", "tokenization", "non-canonical tokenizations, mass lost at token boundaries, "
          "masked against conditional over strings, token healing (a subword model)", ckpt="shakespeare-bpe"),
))


def load_study(name: str):
    """The module of study ``name``; :class:`StudyUnavailable` when it is not installed."""
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}: choose from {', '.join(STUDIES)} or all")
    study = STUDIES[name]
    full = f"{__name__}.{study.module}"
    if importlib.util.find_spec(full) is None:
        raise StudyUnavailable(f"the {name} study is not installed: module {full} is missing")
    return importlib.import_module(full)


def _keywords(name: str, options: dict) -> dict:
    """The run() keywords of study ``name`` for command-line options (``None``: not given)."""
    given = {k: v for k, v in options.items() if v is not None}
    allowed = dict(STUDIES[name].options)
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        flags = ", ".join("-n" if k == "n" else f"--{k}" for k in unknown)
        raise ValueError(f"the {name} study takes no option {flags}")
    return {allowed[k]: v for k, v in given.items()}


def run_study(name: str, lm, out_dir, *, seed: int | None = None, data_path=None, progress: bool = True,
              **options) -> dict:
    """Run study ``name`` into ``out_dir``. ``seed=None`` keeps the study's default seed; options
    that are ``None`` are left at the study's defaults, others must be options of that study."""
    module = load_study(name)
    kwargs = _keywords(name, options)
    if seed is not None:
        kwargs["seed"] = seed
    return module.run(lm, out_dir, data_path=data_path, progress=progress, **kwargs)


def run_command(name: str, lm, out: str | None, *, seed: int | None = None, data_path=None,
                progress: bool = True, options: dict | None = None, echo=print, load_default=None) -> list[Path]:
    """What ``jaxdecode study NAME`` does: ``name`` is a study or ``all``; output goes to ``out``
    (default ``results/NAME``; for ``all``, ``out/NAME`` for each, default ``results/NAME``).
    ``lm``: a loaded model, or a function that loads one (called once, after the study is found,
    so that an unknown or missing study fails before any loading). With ``all`` a study that is
    not installed is skipped with a note on stderr, and options go only to the studies that take
    them; a study whose module finds the model unsuitable (its ``unsuitable(lm)``) is skipped with
    a note on stderr. ``load_default(name)``: loads a shipped checkpoint by name, for the studies
    that run on their own (:attr:`Study.ckpt`) when the caller chose no model (None: ``lm`` for
    every study). Returns the folders written; ``echo`` reports each."""
    options = {k: v for k, v in (options or {}).items() if v is not None}
    if name == "all":
        names = []
        for n in STUDIES:
            try:
                load_study(n)
                names.append(n)
            except StudyUnavailable as e:
                print(f"jaxdecode: skipping {n}: {e}", file=sys.stderr)
    else:
        load_study(name)
        _keywords(name, options)  # bad options fail before any loading
        names = [name]
    loaded: dict = {}

    def model_for(n: str):
        own = STUDIES[n].ckpt if load_default is not None else None
        if own not in loaded:
            loaded[own] = load_default(own) if own else (lm() if callable(lm) else lm)
        return loaded[own]

    written = []
    for n in names:
        model = model_for(n)
        if name == "all":
            reason = getattr(load_study(n), "unsuitable", lambda _: None)(model)
            if reason:
                print(f"jaxdecode: skipping {n}: {reason}", file=sys.stderr)
                continue
            folder = Path(out or "results") / n
            mine = {k: v for k, v in options.items() if k in dict(STUDIES[n].options)}
        else:
            folder, mine = Path(out or f"results/{n}"), options
        run_study(n, model, folder, seed=seed, data_path=data_path, progress=progress, **mine)
        files = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
        echo(f"wrote {folder}: {', '.join(files)}")
        written.append(folder)
    return written


__all__ = ["STUDIES", "Study", "StudyUnavailable", "load_study", "run_command", "run_study"]
