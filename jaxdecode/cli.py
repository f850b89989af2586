"""The ``jaxdecode`` command line."""

from __future__ import annotations

import argparse
import json
import sys


class UsageError(ValueError):
    """Bad input from the command line: reported as one line, exit code 2."""


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


# ----------------------------------------------------------------------------- commands

def cmd_info(args):
    from . import checkpoint

    lm = checkpoint.load(args.ckpt)
    info = {
        "path": str(lm.path),
        "config": {"V": lm.cfg.V, "T": lm.cfg.T, "d": lm.cfg.d, "L": lm.cfg.L, "heads": lm.cfg.heads},
        "parameters": lm.num_params,
        "backend": lm.decoder.backend,
        "backend_reason": getattr(lm.decoder, "why", ""),
        "jax_backend": __import__("jax").default_backend(),
        "vocabulary": lm.vocab.chars,
        "provenance": {k: v for k, v in lm.meta.items()
                       if k not in ("V", "T", "d", "L", "heads", "chars")},
    }
    if args.json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
        return
    c = info["config"]
    print(f"checkpoint  {info['path']}")
    print(f"shape       V={c['V']} T={c['T']} d={c['d']} L={c['L']} heads={c['heads']}")
    print(f"parameters  {info['parameters']:,}")
    print(f"backend     {info['backend_reason'] or info['backend']} [JAX on {info['jax_backend']}]")
    print(f"vocabulary  {lm.vocab.chars!r}")
    for k, v in info["provenance"].items():
        if k == "loss_curve":
            v = " ".join(f"{s}:{loss}" for s, loss in v)
        print(f"{k:<11} {v}")


def cmd_convert(args):
    from . import checkpoint

    out = checkpoint.convert(args.pt, args.out_dir, overwrite=args.force)
    lm = checkpoint.load(out)
    print(f"wrote {out} ({lm.num_params:,} parameters, V={lm.cfg.V}, T={lm.cfg.T})")


def cmd_train(args):
    from .train import TrainConfig, train

    tc = TrainConfig(d=args.d, L=args.layers, heads=args.heads, T=args.T, batch=args.batch,
                     steps=args.steps, lr=args.lr, warmup=args.warmup, seed=args.seed,
                     eval_every=args.eval_every, eval_windows=args.eval_windows)
    train(args.out_dir, tc, data_path=args.data, resume=args.resume, progress=not args.quiet)


def cmd_eval(args):
    from . import checkpoint
    from . import data as data_lib
    from .train import held_out_loss

    lm = checkpoint.load(args.ckpt)
    out = {"checkpoint": str(lm.path)}
    if args.text is None or args.held_out:
        text = data_lib.read_corpus(args.data)
        _, val = data_lib.split(text)
        windows = data_lib.eval_windows(lm.vocab.encode(val), lm.cfg.T, args.windows)
        out["held_out_loss"] = held_out_loss(lm.params, lm.cfg, windows)
        out["held_out_windows"] = int(windows.shape[0])
        if "held_out_loss" in lm.meta and lm.meta.get("held_out_windows") == windows.shape[0]:
            out["recorded_held_out_loss"] = lm.meta["held_out_loss"]
    if args.text is not None:
        from .score import score_texts

        text = _unescape(args.text)
        if not text:
            raise UsageError("the text to score is empty")
        res = score_texts(lm, [text], prompts=[_unescape(args.prompt or "")])[0]
        out["mean_logprob"] = res.mean_logprob
        out["characters"] = len(res.logprobs)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:<22} {v:.4f}" if isinstance(v, float) else f"{k:<22} {v}")


# The rule flags in the order --help lists them: temperature, the truncations, then the penalties
# (within a kind, the registry's order).
_FLAG_KINDS = ("temperature", "truncation", "penalty")


def _rule_specs():
    from .rules import REGISTRY

    return sorted(REGISTRY, key=lambda spec: _FLAG_KINDS.index(spec.kind))


def _settings(args) -> dict:
    from .rules import REGISTRY

    return {spec.name: getattr(args, spec.name) for spec in REGISTRY
            if getattr(args, spec.name) is not None}


def _load(args):
    from . import checkpoint

    return checkpoint.load(args.ckpt)


def _read_prompt(args) -> str:
    prompt = _unescape(args.prompt)
    if not prompt:
        raise UsageError("the prompt is empty: give at least one character")
    return prompt


def _constraint(args, lm):
    """The --regex / --choice / --json-schema constraint, compiled for ``lm``'s vocabulary, or None."""
    from . import constraints as C

    given = [f for f, on in (("--regex", args.regex is not None), ("--choice", bool(args.choice)),
                             ("--json-schema", args.json_schema is not None)) if on]
    if len(given) > 1:
        raise UsageError(f"give one constraint, not {' and '.join(given)}")
    if args.regex is not None:
        c = C.compile_regex(_unescape(args.regex), lm.vocab)
    elif args.choice:
        c = C.compile_choices([_unescape(x) for x in args.choice], lm.vocab)
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


def _constraint_settings(args) -> dict:
    return {k: v for k, v in (("regex", args.regex), ("choice", args.choice), ("json_schema", args.json_schema))
            if v}


def _streaming(args, prompt):
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


def _print_samples(outs):
    for i, o in enumerate(outs):
        if len(outs) > 1:
            print(f"--- sample {i} (mean log-probability {o.mean_logprob:.3f} nats per character)")
        print(o.prompt + o.text)


def cmd_generate(args):
    from .rules import make_rule
    from .sampling import generate

    prompt = _read_prompt(args)
    if args.n < 0:
        raise UsageError(f"-n must be >= 0, got {args.n}")
    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be >= 1, got {args.num_samples}")
    settings = _settings(args)
    if args.greedy and settings.get("temperature") not in (None, 0.0):
        raise UsageError("--greedy contradicts --temperature > 0")
    rule = make_rule(**settings)  # validates before anything is loaded or traced
    from . import cli_generate as G

    if args.contrastive is not None:
        return G.generate_contrastive(args, prompt, settings)
    if args.smc is not None and (args.beam is not None or args.speculative is not None):
        raise UsageError("--smc does not combine with --beam or --speculative")
    if args.beam is not None:
        if args.speculative is not None:
            raise UsageError("--beam and --speculative cannot be combined")
        return G.generate_beam(args, prompt, rule, settings)
    if args.speculative is not None:
        return G.generate_speculative(args, prompt, rule, settings)
    if args.gamma is not None:
        raise UsageError("--gamma needs --speculative")
    for flag in ("length_penalty", "n_best"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} needs --beam")
    lm = _load(args)
    lm.vocab.encode(prompt)  # unknown characters: a clear error before any work
    constraint = _constraint(args, lm)
    if args.smc is not None:
        return G.generate_smc(args, lm, prompt, constraint, settings)
    stop = [_unescape(s) for s in args.stop] if args.stop else None
    stream, on_text = _streaming(args, prompt)
    outs = generate(lm, prompt, args.n, seed=args.seed, rule=rule, greedy=args.greedy,
                    num_samples=args.num_samples, stop=stop, on_text=on_text, constraint=constraint)
    if args.json:
        doc = {"outputs": [{"prompt": o.prompt, "text": o.text, "mean_logprob": o.mean_logprob,
                            "tokens": o.tokens.tolist(), "finish_reason": o.finish_reason} for o in outs],
               "settings": {"n": args.n, "seed": args.seed, "num_samples": args.num_samples,
                            "greedy": bool(args.greedy), "stop": stop, "checkpoint": str(lm.path),
                            **_constraint_settings(args), **settings}}
        print(json.dumps(doc, ensure_ascii=False))
        return
    if stream:
        sys.stdout.write("\n")
        print(f"--- mean log-probability {outs[0].mean_logprob:.3f} nats per character", file=sys.stderr)
        return
    _print_samples(outs)


def _contrastive_setting(text: str) -> tuple[int, float]:
    """``K,ALPHA`` of --contrastive."""
    try:
        k, alpha = text.split(",")
        return int(k), float(alpha)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K,ALPHA such as 4,0.6, got {text!r}") from None


def cmd_mode(args):
    from .beam import mode_search

    prompt = _read_prompt(args)
    if args.n < 1:
        raise UsageError(f"-n must be >= 1, got {args.n}")
    lm = _load(args)
    tokens, logprob, nodes = mode_search(lm.decoder, lm.params, lm.vocab.encode(prompt), args.n,
                                         node_budget=args.budget)
    text = lm.vocab.decode(tokens)
    if args.json:
        print(json.dumps({"prompt": prompt, "text": text, "logprob": logprob, "nodes_expanded": nodes},
                         ensure_ascii=False))
    else:
        print(f"--- mode of {args.n} characters: log-probability {logprob:.4f} ({nodes} nodes expanded)")
        print(prompt + text)


def cmd_study(args):
    """The chapter's experiments (:mod:`jaxdecode.studies`): JSON, PNG and Markdown in --out."""
    from .studies import run_command

    options = {"prompts": args.prompts, "n": args.n, "budget": args.budget}
    run_command(args.name, lambda: _load(args), args.out, seed=args.seed, data_path=args.data,
                progress=not args.quiet, options=options)


def cmd_score(args):
    from .score import score_texts

    text, prompt = _unescape(args.text), _unescape(args.prompt or "")
    if not text:
        raise UsageError("the text to score is empty")
    lm = _load(args)
    res = score_texts(lm, [text], [prompt])[0]
    if args.json:
        print(json.dumps({"prompt": prompt, "text": text, "mean_logprob": res.mean_logprob,
                          "logprobs": res.logprobs.tolist(),
                          "probabilities": res.probabilities.tolist()}, ensure_ascii=False))
    else:
        print(f"{res.mean_logprob:.4f} nats per character over {len(text)} characters")


# ----------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    from .speculative import DRAFTS

    p = argparse.ArgumentParser(prog="jaxdecode", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("generate", help="generate text after a prompt")
    s.add_argument("prompt", help=r"the prompt; \n and \t are unescaped")
    s.add_argument("-n", type=int, default=300, help="characters to generate (default 300)")
    s.add_argument("--num-samples", type=int, default=1)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--ckpt", default=None, help="checkpoint folder (default: the shipped model)")
    s.add_argument("--stop", action="append", help="stop a sample once it produces this string (repeatable)")
    s.add_argument("--greedy", action="store_true", help="always take the most probable character")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    s.add_argument("--stream", action="store_true", help="stream text even when stdout is not a terminal")
    for spec in _rule_specs():
        s.add_argument(spec.flag, dest=spec.name, type=spec.type, default=None, metavar=spec.metavar,
                       help=spec.help)
    s.add_argument("--regex", default=None, metavar="PATTERN",
                   help=r"constrain the continuation to this regular expression (matched in full; \n unescaped)")
    s.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="constrain the continuation to one of these (repeatable)")
    s.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the continuation to JSON text valid under the schema in FILE")
    s.add_argument("--smc", type=int, default=None, metavar="PARTICLES",
                   help="with a constraint: exact conditional sampling by sequential Monte Carlo")
    s.add_argument("--beam", type=int, default=None, metavar="K", help="beam search with K beams")
    s.add_argument("--contrastive", type=_contrastive_setting, default=None, metavar="K,ALPHA",
                   help="contrastive search: of the K most probable characters, the one maximizing "
                        "(1-ALPHA) p - ALPHA * (max cosine similarity to earlier hidden states)")
    s.add_argument("--length-penalty", type=float, default=None, metavar="ALPHA",
                   help="beam: divide scores by ((5+|y|)/6)^ALPHA")
    s.add_argument("--n-best", type=int, default=None, help="beam: print the N best hypotheses")
    s.add_argument("--speculative", choices=list(DRAFTS), default=None,
                   help="speculative sampling with this draft (exact: same distribution as plain "
                        "sampling); distilled, the fastest, is an n-gram table of the model's own "
                        "predictions over the corpus, built once (minutes) and cached")
    s.add_argument("--gamma", type=int, default=None,
                   help="speculative: draft tokens per target pass (default: the fastest on CPU, "
                        "3 with the distilled draft, else 2)")
    s.add_argument("--ngram-order", type=int, default=None, metavar="N",
                   help="speculative ngram: context of N-1 characters (default 3, the chapter's "
                        "trigram; distilled: 6)")
    s.add_argument("--ngram-backoff", type=float, default=None, metavar="BETA",
                   help="speculative ngram: interpolate with shorter contexts, weight BETA (default: "
                        "add-0.01 smoothing; distilled: 2)")
    s.add_argument("--data", default=None, help="corpus for the n-gram draft (default: $JAXDECODE_DATA)")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("mode", help="the most probable continuation of n characters (exact best-first search)")
    s.add_argument("prompt")
    s.add_argument("-n", type=int, default=12)
    s.add_argument("--budget", type=int, default=100_000, help="give up after expanding this many nodes")
    s.add_argument("--ckpt", default=None)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_mode)

    s = sub.add_parser("score", help="the model's log-probability of a text after a prompt")
    s.add_argument("text")
    s.add_argument("--prompt", default=None, help="condition on this prompt (default: a newline)")
    s.add_argument("--ckpt", default=None)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_score)

    from .studies import STUDIES

    s = sub.add_parser("study", help="reproduce one of the chapter's experiments (JSON + PNG + Markdown)")
    s.add_argument("name", choices=[*STUDIES, "all"], help="the study, or all of them in turn")
    s.add_argument("--out", default=None, help="output folder (default results/NAME; with all, "
                                               "one folder per study in it, default results/)")
    s.add_argument("--seed", type=int, default=None, help="random seed (default: each study's, 0)")
    s.add_argument("--ckpt", default=None)
    s.add_argument("--data", default=None)
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--prompts", type=int, default=None, help="beam-curse: held-out prompts (default 24)")
    s.add_argument("-n", type=int, default=None, help="beam-curse: characters searched (default 12)")
    s.add_argument("--budget", type=int, default=None, help="beam-curse: exact-search node budget "
                                                            "(default 100,000)")
    s.set_defaults(func=cmd_study)

    s = sub.add_parser("info", help="describe a checkpoint folder")
    s.add_argument("ckpt", nargs="?", default=None, help="checkpoint folder (default: the shipped model)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("convert", help="convert the book's .pt into a checkpoint folder (no code from the file runs)")
    s.add_argument("pt")
    s.add_argument("out_dir")
    s.add_argument("--force", action="store_true", help="replace an existing output folder")
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser("train", help="train the character model on Tiny Shakespeare")
    s.add_argument("out_dir")
    s.add_argument("--data", default=None, help="corpus path (default: $JAXDECODE_DATA, data/tinyshakespeare.txt)")
    s.add_argument("--d", type=int, default=256)
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--heads", type=int, default=4)
    s.add_argument("--T", type=int, default=512)
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--steps", type=int, default=3000)
    s.add_argument("--lr", type=float, default=2e-3)
    s.add_argument("--warmup", type=int, default=100)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--eval-every", type=int, default=250)
    s.add_argument("--eval-windows", type=int, default=32)
    s.add_argument("--resume", action="store_true", help="continue from the optimizer state in out_dir")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("eval", help="held-out loss of a checkpoint, or the model's score of a text")
    s.add_argument("ckpt", nargs="?", default=None)
    s.add_argument("--data", default=None)
    s.add_argument("--windows", type=int, default=32, help="held-out windows of T characters")
    s.add_argument("--text", default=None, help="score this text (mean log-probability per character)")
    s.add_argument("--prompt", default=None, help="condition --text on this prompt")
    s.add_argument("--held-out", action="store_true", help="with --text, also compute the held-out loss")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_eval)
    return p


def _enable_compilation_cache():
    """Keep compiled programs between runs, in :func:`jaxdecode.paths.cache_dir` ``("xla")``
    (``$JAXDECODE_CACHE``/xla, default ~/.cache/jaxdecode/xla; ``$JAXDECODE_CACHE`` set to an
    empty string turns the cache off)."""
    from . import paths

    path = paths.cache_dir("xla")
    if path is None:
        return
    try:
        import jax

        path.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    except (OSError, AttributeError):
        pass  # a read-only home or an older jax: run without the cache


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None:  # the console script, not a test calling main([...])
        _enable_compilation_cache()
    from .checkpoint import CheckpointError
    from .data import CorpusError

    try:
        args.func(args)
    except (UsageError, CheckpointError, CorpusError, ValueError, RuntimeError, FileExistsError,
            FileNotFoundError) as e:
        print(f"jaxdecode: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
