"""What every ``jaxdecode`` command shares: one-line usage errors, argument types, JSON output,
notes on stderr and checked text encoding."""

from __future__ import annotations

import argparse
import json
import math
import sys


class UsageError(ValueError):
    """Bad input from the command line: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (``jaxdecode: error: ...``, exit code 2) instead of
    a usage block: :func:`main` reports the :class:`UsageError`."""

    def error(self, message):
        raise UsageError(message)


def _known_options(parser) -> set[str]:
    """Every option string of ``parser`` and its subcommands."""
    found = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _known_options(sub)
    return found


def _argument_hint(parser, argv) -> str:
    """What to add to an argparse error: where the help is, and, when a word starts with '-' but
    is no option (a prompt such as "-- Enter ROMEO"), how to pass it."""
    command = next((a for a in argv if not a.startswith("-")), None)
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    where = f"jaxdecode {command}" if sub is not None and command in sub.choices else "jaxdecode"
    known = _known_options(parser)

    def is_option(word):
        head = word.split("=", 1)[0]
        return head in known or (head.startswith("--") and any(k.startswith(head) for k in known))

    for word in argv:
        if word == "--":
            break
        if word.startswith("-") and len(word) > 1 and not is_option(word):
            try:
                float(word)
                continue  # a negative number
            except ValueError:
                pass
            return f" (a text that starts with '-' goes after '--', as in: {where} -- {word!r})"
    return f" (see: {where} --help)"


SEED_MAX = 2**32 - 1  # PRNGKey keeps 32 bits of a seed: larger seeds would repeat smaller ones


def _seed(text: str) -> int:
    """A --seed value: an integer in [0, SEED_MAX]."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"the seed must be an integer from 0 to {SEED_MAX}, got {text!r}")
    return value


def _plain(obj):
    """``obj`` with every non-finite float as None (JSON has no NaN: an output of no characters
    has no mean log-probability)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _print_json(obj, **kwargs) -> None:
    """``obj`` as strict JSON on stdout."""
    print(json.dumps(_plain(obj), ensure_ascii=False, allow_nan=False, **kwargs))


def _note(args, message: str) -> None:
    """A one-line note on stderr (none with --quiet)."""
    if not getattr(args, "quiet", False):
        print(f"jaxdecode: note: {message}", file=sys.stderr, flush=True)


def _encode(lm, text: str, what: str):
    """``lm.vocab.encode(text)``; a character outside the vocabulary is a UsageError naming ``what``."""
    from .vocab import UnknownCharacterError

    try:
        return lm.vocab.encode(text)
    except UnknownCharacterError as e:
        shown = ", ".join(f"{c!r} at position {i}" for i, c in e.unknown[:10])
        more = f" (and {len(e.unknown) - 10} more)" if len(e.unknown) > 10 else ""
        raise UsageError(f"{what} contains characters outside the model's vocabulary: {shown}{more} "
                         f"('jaxdecode info' lists the vocabulary)") from None


def _unescape(s: str) -> str:
    r"""Turn the escapes ``\n``, ``\t`` and ``\\`` into their characters."""
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            nxt = s[i + 1]
            if nxt in "nt\\":
                out.append({"n": "\n", "t": "\t", "\\": "\\"}[nxt])
                i += 2
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _draft_kind(text: str) -> str:
    """``--speculative``: a registered draft, or the folder of a smaller model (same tokenizer)."""
    from pathlib import Path

    from .speculative import DRAFTS

    if text in DRAFTS or Path(text).is_dir():
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(DRAFTS)}, or give "
                                     "the folder of a smaller model with the same tokenizer)")


def _unit(lm) -> str:
    """What a token of ``lm`` is called in messages: a character for the character model."""
    return "token" if getattr(lm.vocab, "subword", False) else "character"


def _model_draft(folder):
    """A smaller model with the same tokenizer, as a speculative draft (None: no folder given)."""
    if folder is None:
        return None
    from .checkpoint import load
    from .speculative import ModelDraft

    return ModelDraft.from_lm(load(folder))
