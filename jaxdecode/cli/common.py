"""What every ``jaxdecode`` command shares: one-line usage errors, argument types, JSON output,
notes on stderr and checked text encoding."""

from __future__ import annotations

import argparse
import json
import math
import sys


class UsageError(ValueError):
    """Bad input from the command line: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
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


def argument_hint(parser, argv) -> str:
    """What to add to an argparse error: where the help is; for a word that starts with '-' but is
    no option, the option meant when one is close (``--top_p``: ``--top-p``), else how to pass a
    text that starts with '-' (a prompt such as "-- Enter ROMEO")."""
    import difflib

    command = next((a for a in argv if not a.startswith("-")), None)
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    where = f"jaxdecode {command}" if sub is not None and command in sub.choices else "jaxdecode"
    known = _known_options(sub.choices[command] if where != "jaxdecode" else parser)

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
            head = word.split("=", 1)[0]
            close = difflib.get_close_matches(head.replace("_", "-"), sorted(known), n=1, cutoff=0.75)
            if close:
                return f" (did you mean {close[0]}? see: {where} --help)"
            return f" (a text that starts with '-' goes after '--', as in: {where} -- {word!r})"
    return f" (see: {where} --help)"


SEED_MAX = 2**32 - 1  # PRNGKey keeps 32 bits of a seed: larger seeds would repeat smaller ones


def seed_value(text: str) -> int:
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


def print_json(obj, **kwargs) -> None:
    """``obj`` as strict JSON on stdout."""
    print(json.dumps(_plain(obj), ensure_ascii=False, allow_nan=False, **kwargs))


def note(args, message: str) -> None:
    """A one-line note on stderr (none with --quiet)."""
    if not getattr(args, "quiet", False):
        print(f"jaxdecode: note: {message}", file=sys.stderr, flush=True)


def encode_text(lm, text: str, what: str):
    """``lm.vocab.encode(text)``; a character outside the vocabulary is a UsageError naming ``what``."""
    from jaxdecode.io.vocab import UnknownCharacterError

    try:
        return lm.vocab.encode(text)
    except UnknownCharacterError as e:
        shown = ", ".join(f"{c!r} at position {i}" for i, c in e.unknown[:10])
        more = f" (and {len(e.unknown) - 10} more)" if len(e.unknown) > 10 else ""
        raise UsageError(f"{what} contains characters outside the model's vocabulary: {shown}{more} "
                         f"('jaxdecode info' lists the vocabulary)") from None


def unescape(s: str) -> str:
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


def draft_kind(text: str) -> str:
    """``--speculative``: a registered draft, or the folder of a smaller model (same tokenizer)."""
    from pathlib import Path

    from jaxdecode.speculative import DRAFTS

    if text in DRAFTS or Path(text).is_dir():
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(DRAFTS)}, or give "
                                     "the folder of a smaller model with the same tokenizer)")


def unit_name(lm) -> str:
    """What a token of ``lm`` is called in messages: a character for the character model."""
    return "token" if getattr(lm.vocab, "subword", False) else "character"


def model_draft(folder):
    """A smaller model with the same tokenizer, as a speculative draft (None: no folder given)."""
    if folder is None:
        return None
    from jaxdecode.models.checkpoint import load
    from jaxdecode.speculative import ModelDraft

    return ModelDraft.from_lm(load(folder))


# The rule flags in the order --help lists them: temperature, the truncations, then the penalties
# (within a kind, the registry's order).
_FLAG_KINDS = ("temperature", "truncation", "penalty")


def rule_specs():
    """The registered rules in the order --help lists their flags."""
    from jaxdecode.rules import REGISTRY

    return sorted(REGISTRY, key=lambda spec: _FLAG_KINDS.index(spec.kind))


def cli_rule(settings: dict):
    """:func:`jaxdecode.make_rule` of the rule flags, its errors naming the flags (``--top-p must
    lie in (0, 1], got 2``) rather than the Python parameters."""
    import re

    from jaxdecode.rules import RuleError, make_rule

    try:
        return make_rule(**settings)
    except RuleError as e:
        m = re.match(r"^(\w+): \w+ (must .*)$", str(e))
        if m and m.group(1) in settings:
            raise UsageError(f"--{m.group(1).replace('_', '-')} {m.group(2)}") from None
        raise UsageError(str(e)) from None


def rule_settings(args) -> dict:
    """The rule flags given on the command line, as :func:`jaxdecode.make_rule` keywords."""
    from jaxdecode.rules import REGISTRY

    return {spec.name: getattr(args, spec.name) for spec in REGISTRY
            if getattr(args, spec.name) is not None}


def add_weights_flag(s) -> None:
    """``--weights``: how a Hugging Face model keeps its matrices (jaxdecode.models.hf.linear)."""
    s.add_argument("--weights", default=None, choices=("auto", "float32", "stored", "bfloat16", "int8", "int4"),
                   help="how a Hugging Face model keeps its weight matrices: auto (as stored on the native CPU "
                        "path, float32 elsewhere), float32, stored (bfloat16/float16 stay so), bfloat16, "
                        "int8 (weight-only, quantized when loaded) or int4 (weight-only, groups of 32)")


def load_model(args):
    """The model of --ckpt, with --dtype and --weights; their misuse on the character model is a UsageError."""
    from jaxdecode.models import checkpoint

    try:
        lm = checkpoint.load(args.ckpt, dtype=getattr(args, "dtype", None) or "float32",
                             weights=getattr(args, "weights", None) or "auto")
    except checkpoint.CheckpointError as e:
        if "applies to Hugging Face folders" in str(e):
            raise UsageError(f"--weights {args.weights} applies to Hugging Face checkpoints; the character model "
                             f"runs in float32") from None
        raise
    if getattr(args, "dtype", None) not in (None, "float32") and not getattr(lm.vocab, "subword", False):
        raise UsageError(f"--dtype {args.dtype} applies to Hugging Face checkpoints; the character model runs "
                         f"in float32")
    return lm


def read_prompt(args) -> str:
    """The prompt argument, unescaped; an empty prompt is a UsageError."""
    prompt = unescape(args.prompt)
    if not prompt:
        raise UsageError("the prompt is empty: give at least one character")
    return prompt


def compile_constraint(args, lm):
    """The --regex / --choice / --json-schema constraint, compiled for ``lm``'s vocabulary, or None."""
    from jaxdecode import constraints as C

    given = [f for f, on in (("--regex", args.regex is not None), ("--choice", bool(args.choice)),
                             ("--json-schema", args.json_schema is not None)) if on]
    if len(given) > 1:
        raise UsageError(f"give one constraint, not {' and '.join(given)}")
    if args.regex is not None:
        c = C.compile_regex(unescape(args.regex), lm.vocab)
    elif args.choice:
        c = C.compile_choices([unescape(x) for x in args.choice], lm.vocab)
    elif args.json_schema is not None:
        try:
            text = open(args.json_schema, encoding="utf-8").read()
        except OSError as e:
            raise UsageError(f"cannot read the JSON schema {args.json_schema}: {e.strerror}") from None
        c = C.compile_json_schema(text, lm.vocab)
    else:
        return None
    c.check_budget(args.n)
    return c


def constraint_settings(args) -> dict:
    """The constraint flags given, for the JSON output's settings."""
    return {k: v for k, v in (("regex", args.regex), ("choice", args.choice), ("json_schema", args.json_schema))
            if v}


def streaming(args, prompt):
    """Whether to stream (one sample, not JSON; a terminal or --stream), and the callback."""
    stream = not args.json and args.num_samples == 1 and (sys.stdout.isatty() or args.stream)
    if not stream:
        return False, None
    sys.stdout.write(prompt)
    sys.stdout.flush()

    def on_text(row, text):
        sys.stdout.write(text)
        sys.stdout.flush()

    return True, on_text


BIG_REQUEST = 50_000  # characters: a request this large shows a progress bar


def memory_size(text: str) -> int:
    """A --memory-budget value such as ``2G``, in bytes."""
    from jaxdecode.decoding.budget import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
    """An argument type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def past_window(args, lm, prompt_len: int, n: int, rows: int = 1, on_text=None, bar: bool = True):
    """Generation that reaches past the model's window ``T`` runs the exact window path (a forward
    over the last ``T`` characters per step, much slower than a cached step): say so on stderr and,
    with ``bar``, show a progress bar with the time left, advanced through ``on_text``.

    Returns ``(on_text, close)``: the callback to give the loop (``on_text`` that also advances the
    bar) and what to call when generation ends. No bar when the text itself streams to a terminal,
    or with --quiet."""
    T = lm.decoder.T
    if prompt_len + n <= T or n == 0:
        return on_text, lambda: None
    unit = "tokens" if getattr(lm.vocab, "subword", False) else "characters"
    if prompt_len > T:
        note(args, f"the prompt has {prompt_len} {unit}: the model sees only the last {T} (its window "
                    f"T), and each {unit[:-1]} generated past T runs the exact window path (a forward over "
                    f"the last {T} {unit} per step), much slower than within T")
    else:
        past = prompt_len + n - T
        note(args, f"{past} of the {n} {unit} {'lies' if past == 1 else 'lie'} past the model's window "
                    f"T={T}: each runs the exact window path (a forward over the last {T} {unit} per step), much "
                    f"slower than within T")
    if not bar or args.quiet or (on_text is not None and sys.stdout.isatty()):
        return on_text, lambda: None
    from tqdm import tqdm

    # the bar counts only the slow characters (those past T), so that its rate and time left are theirs
    fast = max(0, T - prompt_len)
    progress = tqdm(total=(n - fast) * rows, unit="char", desc="past the window", file=sys.stderr,
                    leave=False, dynamic_ncols=True)
    made = [0] * rows

    def advance(row, text):
        before = made[row]
        made[row] += len(text)
        slow = max(0, made[row] - fast) - max(0, before - fast)
        if slow:
            progress.update(slow)
        if on_text is not None:
            on_text(row, text)

    return advance, progress.close


def print_samples(outs, unit="character"):
    """The samples as text on stdout, each headed by its mean log-probability when there are several."""
    for i, o in enumerate(outs):
        if len(outs) > 1:
            print(f"--- sample {i} (mean log-probability {o.mean_logprob:.3f} nats per {unit})")
        print(o.prompt + o.text)


def stop_strings(args, lm):
    """The --stop strings, unescaped and checked against the vocabulary, or None."""
    if not args.stop:
        return None
    stops = [unescape(s) for s in args.stop]
    for s in stops:
        if not s:
            raise UsageError("--stop: a stop string must not be empty")
        encode_text(lm, s, f"the stop string {s!r}")
    return stops
