"""The ``jaxdecode`` command line."""

from __future__ import annotations

import argparse
import math
import sys


from jaxdecode.cli.common import (
    UsageError,
    add_weights_flag,
    Parser,
    argument_hint,
    draft_kind,
    model_draft,
    unit_name,
    SEED_MAX,
    seed_value,
    print_json,
    encode_text,
    unescape,
    rule_specs,
    cli_rule,
    rule_settings,
    load_model,
    read_prompt,
    compile_constraint,
    constraint_settings,
    streaming,
    BIG_REQUEST,
    memory_size,
    positive_int,
    past_window,
    print_samples,
    stop_strings,
)
from jaxdecode.cli.checkpoint import cmd_convert, cmd_eval, cmd_info, cmd_quantize, cmd_train


MAX_NEW_TOKENS = 10_000_000  # -n: beyond this a request is a typo, not a study
MAX_SAMPLES = 1_000_000  # --num-samples


def _check_combinations(args):
    """Flags that contradict each other or would be ignored: refused by name, before any work."""
    if args.beam is not None and args.speculative is not None:
        raise UsageError("--beam and --speculative cannot be combined")
    if args.smc is not None and (args.beam is not None or args.speculative is not None):
        raise UsageError("--smc does not combine with --beam or --speculative")
    if args.stream:
        if args.json:
            raise UsageError("--stream and --json do not combine: --json prints one object when generation "
                             "ends (drop --json to stream the text)")
        if args.num_samples != 1:
            raise UsageError(f"--stream shows one sample as it is generated; it does not combine with "
                             f"--num-samples {args.num_samples}")
        if args.beam is not None:
            raise UsageError("--stream does not apply to --beam: a beam's text is final only when the search ends")
        if args.smc is not None:
            raise UsageError("--stream does not apply to --smc: the estimate is known only at the end")
    if args.greedy:
        truncation = [spec.flag for spec in rule_specs() if spec.kind in ("truncation", "temperature")
                      and spec.name != "temperature" and getattr(args, spec.name) is not None]
        if truncation:
            raise UsageError(f"--greedy takes the most probable token, which {', '.join(truncation)} would not "
                             f"change: drop one or the other")
        if args.num_samples != 1:
            raise UsageError(f"--greedy gives one answer: --num-samples {args.num_samples} would print it "
                             f"{args.num_samples} times")
    if args.greedy and args.beam is not None:
        raise UsageError("--greedy does not combine with --beam (beam search is deterministic; --beam 1 is "
                         "greedy search)")
    if args.beam is None:
        for flag in ("length_penalty", "n_best"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} needs --beam")
    if args.speculative is None and args.gamma is not None:
        raise UsageError("--gamma needs --speculative")
    if args.speculative not in ("ngram", "distilled"):
        if args.ngram_order is not None or args.ngram_backoff is not None:
            raise UsageError("--ngram-order and --ngram-backoff need --speculative ngram or distilled")
        if args.data is not None:
            raise UsageError("--data (the draft's corpus) needs --speculative ngram or distilled")


def cmd_generate(args):
    from jaxdecode.decoding.sampling import generate

    prompt = read_prompt(args)
    if not 0 <= args.n <= MAX_NEW_TOKENS:
        raise UsageError(f"-n must be in 0..{MAX_NEW_TOKENS:,}, got {args.n}")
    if not 1 <= args.num_samples <= MAX_SAMPLES:
        raise UsageError(f"--num-samples must be in 1..{MAX_SAMPLES:,}, got {args.num_samples}")
    _check_combinations(args)
    settings = rule_settings(args)
    for name, value in settings.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    if args.greedy and settings.get("temperature") not in (None, 0.0):
        raise UsageError("--greedy contradicts --temperature > 0")
    rule = cli_rule(settings)  # validates before anything is loaded or traced
    from jaxdecode.cli import generate as G

    if args.contrastive is not None:
        return G.generate_contrastive(args, prompt, settings)
    if args.beam is not None:
        return G.generate_beam(args, prompt, rule, settings)
    if args.speculative is not None:
        return G.generate_speculative(args, prompt, rule, settings)
    lm = load_model(args)
    ids = encode_text(lm, prompt, "the prompt")  # unknown characters: a clear error before any work
    constraint = compile_constraint(args, lm)
    if args.smc is not None:
        return G.generate_smc(args, lm, prompt, constraint, settings)
    stop = stop_strings(args, lm)
    from jaxdecode.decoding.common import default_settings

    settings, greedy = default_settings(lm, settings, args.greedy, not args.no_generation_config)
    cli_rule(settings)  # the merged settings checked, their errors naming the flags
    stream, on_text = streaming(args, prompt)
    on_text, done = past_window(args, lm, len(ids), args.n, args.num_samples, on_text)
    # a large request (within the window) shows a bar of its own; it runs in batches that fit memory
    big = (not args.quiet and not stream and len(ids) + args.n <= lm.decoder.T
           and args.num_samples * args.n >= BIG_REQUEST)
    try:
        params = G.decode_params(args, settings, greedy=greedy, seed=args.seed, num_samples=args.num_samples,
                                 stop=stop, constraint=constraint, max_rows=args.max_rows, generation_config=False)
        outs = generate(lm, prompt, params, on_text=on_text, progress=big)
    finally:
        done()
    if args.json:
        doc = {"outputs": [{"prompt": o.prompt, "text": o.text, "mean_logprob": o.mean_logprob,
                            "tokens": o.tokens.tolist(), "finish_reason": o.finish_reason} for o in outs],
               "settings": {"n": args.n, "seed": args.seed, "num_samples": args.num_samples,
                            "greedy": bool(greedy), "stop": stop, "checkpoint": str(lm.path),
                            **constraint_settings(args), **settings}}
        print_json(doc)
        return
    if stream:
        sys.stdout.write("\n")
        print(f"--- mean log-probability {outs[0].mean_logprob:.3f} nats per {unit_name(lm)}", file=sys.stderr)
        return
    print_samples(outs, unit_name(lm))


def _contrastive_setting(text: str) -> tuple[int, float]:
    """``K,ALPHA`` of --contrastive."""
    try:
        k, alpha = text.split(",")
        return int(k), float(alpha)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K,ALPHA such as 4,0.6, got {text!r}") from None


def cmd_mode(args):
    from jaxdecode.decoding.beam import mode_search

    prompt = read_prompt(args)
    if args.n < 1:
        raise UsageError(f"-n must be >= 1, got {args.n}")
    if args.budget < 1:
        raise UsageError(f"--budget must be >= 1 node, got {args.budget}")
    lm = load_model(args)
    ids = encode_text(lm, prompt, "the prompt")
    past_window(args, lm, len(ids), args.n, bar=False)
    from jaxdecode.decoding.search import SearchBudgetExceeded

    try:
        tokens, logprob, nodes = mode_search(lm.decoder, lm.params, ids, args.n, node_budget=args.budget,
                                             stop_token_ids=lm.eos_ids)
    except SearchBudgetExceeded as e:
        raise UsageError(f"{str(e).split(';')[0]}: raise --budget or lower -n") from None
    from jaxdecode.decoding.common import finish_text

    tokens, text, reason = finish_text(lm, tokens, False)
    if args.json:
        print_json({"prompt": prompt, "text": text, "tokens": tokens.tolist(), "logprob": logprob,
                     "finish_reason": reason, "nodes_expanded": nodes})
    else:
        unit = "tokens" if getattr(lm.vocab, "subword", False) else "characters"
        ended = ", ends with the end token" if reason == "eos" else ""
        print(f"--- mode of {len(tokens)} {unit}{ended}: log-probability {logprob:.4f} ({nodes} nodes expanded)")
        print(prompt + text)


def _study_folders(args):
    """The folders ``study`` may create that do not exist yet, deepest last (``all``: the parent,
    its parents and one per study)."""
    from pathlib import Path

    from jaxdecode.eval.studies import STUDIES

    if args.name != "all":
        targets = [Path(args.out or f"results/{args.name}")]
    else:
        root = Path(args.out or "results")
        targets = [root / name for name in STUDIES]
    new = []
    for target in targets:
        for folder in [*reversed(target.parents), target]:
            if not folder.exists() and folder not in new:
                new.append(folder)
    return new


def cmd_study(args):
    """The chapter's experiments (:mod:`jaxdecode.eval.studies`): JSON, PNG and Markdown in --out."""
    from jaxdecode.eval.studies import run_command
    from jaxdecode.io.reports import require_matplotlib

    for flag, value in (("--prompts", args.prompts), ("-n", args.n), ("--budget", args.budget)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    require_matplotlib()  # the figures: before minutes of work, not after
    options = {"prompts": args.prompts, "n": args.n, "budget": args.budget, "draft": model_draft(args.draft)}
    created = _study_folders(args)
    try:
        # a study with a shipped model of its own (tokenization: the subword one) runs on it unless
        # --ckpt names another
        own = None if args.ckpt else (lambda name: load_model(argparse.Namespace(**{**vars(args), "ckpt": name})))
        run_command(args.name, lambda: load_model(args), args.out, seed=args.seed, data_path=args.data,
                    progress=not args.quiet, options=options, load_default=own)
    except BaseException:
        # a study that failed (no corpus, a bad option) leaves no empty folder behind
        for folder in reversed(created):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise


def cmd_score(args):
    from jaxdecode.decoding.score import score_texts

    text, prompt = unescape(args.text), unescape(args.prompt or "")
    if not text:
        raise UsageError("the text to score is empty")
    lm = load_model(args)
    encode_text(lm, prompt, "the prompt")
    encode_text(lm, text, "the text")
    res = score_texts(lm, [text], [prompt])[0]
    if args.json:
        print_json({"prompt": res.prompt, "text": text, "mean_logprob": res.mean_logprob,
                     "logprobs": res.logprobs.tolist(), "probabilities": res.probabilities.tolist()})
    else:
        print(f"{res.mean_logprob:.4f} nats per {unit_name(lm)} over {len(res.logprobs)} {unit_name(lm)}s")


# ----------------------------------------------------------------------------- parser

def _checkpoint_argument(s) -> None:
    """The checkpoint as ``--ckpt FOLDER``, as every command takes it, or as a positional folder."""
    s.add_argument("folder", nargs="?", default=None, help="checkpoint folder (the same as --ckpt)")
    s.add_argument("--ckpt", default=None, help="checkpoint folder (default: the shipped model)")
    s.set_defaults(_merge_ckpt=True)


def _merge_checkpoint(args) -> None:
    if getattr(args, "_merge_ckpt", False):
        if args.folder is not None and args.ckpt is not None and args.folder != args.ckpt:
            raise UsageError(f"two checkpoints given: {args.folder} and --ckpt {args.ckpt}")
        args.ckpt = args.ckpt or args.folder


def build_parser() -> argparse.ArgumentParser:
    from jaxdecode.speculative import DRAFTS

    from importlib.metadata import version

    p = Parser(prog="jaxdecode", description="Decode text from a language model: generate, search, score, "
                "serve. 'jaxdecode COMMAND --help' describes each command.")
    p.add_argument("--version", action="version", version=f"jaxdecode {version('jaxdecode')}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("generate", help="generate text after a prompt")
    s.add_argument("prompt", help=r"the prompt; \n and \t are unescaped")
    s.add_argument("-n", type=int, default=300,
                   help="tokens to generate (default 300; for the character model a token is a character)")
    s.add_argument("--num-samples", type=int, default=1, metavar="N",
                   help="samples per prompt, each with its own random stream (default 1)")
    s.add_argument("--memory-budget", type=memory_size, default=None, metavar="SIZE",
                   help="run the samples in batches that fit SIZE bytes (e.g. 2G; default: "
                        "$JAXDECODE_MEMORY_BUDGET, else from the device's memory)")
    s.add_argument("--max-rows", type=positive_int, default=None, metavar="N",
                   help="at most N samples per batch (default 256: larger batches are no faster)")
    s.add_argument("--seed", type=seed_value, default=0, help=f"random seed, 0 to {SEED_MAX} (default 0)")
    s.add_argument("--ckpt", default=None, help="checkpoint folder: the shipped model (default), one of ours, "
                   "or a Hugging Face folder (docs/huggingface.md lists the families)")
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="a Hugging Face model's parameter and compute dtype (default float32; bfloat16 for "
                        "accelerators)")
    add_weights_flag(s)
    s.add_argument("--stop", action="append", help="stop a sample once it produces this string (repeatable)")
    s.add_argument("--greedy", action="store_true", help="always take the most probable token")
    s.add_argument("--no-generation-config", action="store_true",
                   help="ignore a Hugging Face folder's generation_config.json defaults (temperature, top-k, "
                        "top-p, repetition penalty, do_sample), which apply where no flag is given")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    s.add_argument("--stream", action="store_true",
                   help="stream text even when stdout is not a terminal (one sample; not with --json, "
                        "--beam or --smc, whose output is known only at the end)")
    s.add_argument("--quiet", action="store_true", help="no notes or progress bars on stderr")
    for spec in rule_specs():
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
    s.add_argument("--beam", type=int, default=None, metavar="K",
                   help="beam search with K beams; rule flags (--temperature, --top-p, the penalties, "
                        "...) apply to the beam scores: each step adds the log-probabilities of the "
                        "processed distribution, while the reported log-probability stays the model's")
    s.add_argument("--contrastive", type=_contrastive_setting, default=None, metavar="K,ALPHA",
                   help="contrastive search: of the K most probable characters, the one maximizing "
                        "(1-ALPHA) p - ALPHA * (max cosine similarity to earlier hidden states)")
    s.add_argument("--length-penalty", type=float, default=None, metavar="ALPHA",
                   help="beam: divide scores by ((5+|y|)/6)^ALPHA")
    s.add_argument("--n-best", type=int, default=None, help="beam: print the N best hypotheses")
    s.add_argument("--speculative", type=draft_kind, default=None, metavar="DRAFT",
                   help=f"speculative sampling with this draft (exact: same distribution as plain "
                        f"sampling): {', '.join(DRAFTS)}, or the folder of a smaller model sharing the "
                        f"model's tokenizer; distilled, the fastest for the character model, is an n-gram "
                        f"table of the model's own predictions over the corpus, built once (minutes) and cached")
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

    from jaxdecode.eval.studies import STUDIES

    s = sub.add_parser("study", help="reproduce one of the chapter's experiments (JSON + PNG + Markdown)")
    s.add_argument("name", choices=[*STUDIES, "all"], help="the study, or all of them in turn")
    s.add_argument("--out", default=None, help="output folder (default results/NAME; with all, "
                                               "one folder per study in it, default results/)")
    s.add_argument("--seed", type=seed_value, default=None, help="random seed (default: each study's, 0)")
    s.add_argument("--ckpt", default=None, help="the model (default: the shipped character model; the "
                                                "tokenization study: the shipped subword one, shakespeare-bpe)")
    s.add_argument("--data", default=None)
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--prompts", type=int, default=None, help="beam-curse: held-out prompts (default 24)")
    s.add_argument("-n", type=int, default=None, help="beam-curse: characters searched (default 12)")
    s.add_argument("--budget", type=int, default=None, help="beam-curse: exact-search node budget "
                                                            "(default 100,000)")
    s.add_argument("--draft", default=None, metavar="FOLDER",
                   help="speculative: a smaller model with the same tokenizer as the draft")
    s.set_defaults(func=cmd_study)

    s = sub.add_parser("info", help="describe a checkpoint folder")
    _checkpoint_argument(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("quantize", help="a Hugging Face folder's weight matrices in int8 or int4, saved as a "
                                         "folder that loads back as it was written")
    s.add_argument("src", help="the Hugging Face folder (or a shipped model's name)")
    s.add_argument("out_dir")
    s.add_argument("--weights", default="int8", choices=("int8", "int4"),
                   help="int8 (a scale per column; default) or int4 (a scale per column and group of 32)")
    s.add_argument("--force", action="store_true", help="replace an existing output folder")
    s.set_defaults(func=cmd_quantize)

    s = sub.add_parser("convert", help="convert the book's .pt into a checkpoint folder (no code from the file runs)")
    s.add_argument("pt")
    s.add_argument("out_dir")
    s.add_argument("--force", action="store_true", help="replace an existing output folder")
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser("train", help="train a model on Tiny Shakespeare: the character model, or a Llama "
                                      "with a byte-level BPE vocabulary (--arch llama)")
    s.add_argument("out_dir")
    s.add_argument("--data", default=None, help="corpus path (default: $JAXDECODE_DATA, data/tinyshakespeare.txt)")
    s.add_argument("--arch", choices=("char", "llama"), default="char",
                   help="char: the chapter's character model (a checkpoint folder); llama: a Llama over a "
                        "BPE vocabulary trained on the same split, written as a Hugging Face folder")
    s.add_argument("--d", type=int, default=256, help="model width")
    s.add_argument("--layers", type=int, default=4, help="transformer blocks")
    s.add_argument("--heads", type=int, default=4, help="attention heads")
    s.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads (default: --heads)")
    s.add_argument("--ffn", type=int, default=None, help="llama: the MLP's width (default: 8d/3, rounded up to 32)")
    s.add_argument("--vocab-size", type=int, default=1024,
                   help="llama: BPE tokens, the end-of-text token included (default 1024)")
    s.add_argument("--tokenizer", default=None, metavar="FOLDER",
                   help="llama: use this folder's tokenizer instead of training one (a draft shares its "
                        "target's vocabulary)")
    s.add_argument("--T", type=int, default=512, help="training window (characters, or tokens for llama)")
    s.add_argument("--batch", type=int, default=8, help="windows per optimizer step")
    s.add_argument("--steps", type=int, default=3000, help="optimizer steps")
    s.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (cosine decay to 10%%)")
    s.add_argument("--warmup", type=int, default=100, help="steps of linear warm-up")
    s.add_argument("--seed", type=seed_value, default=0, help="the run's seed: parameters and windows")
    s.add_argument("--eval-every", type=int, default=250, help="steps between held-out evaluations (and saves)")
    s.add_argument("--eval-windows", type=int, default=32, help="fixed held-out windows evaluated")
    s.add_argument("--resume", action="store_true", help="continue from the optimizer state in out_dir")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("eval", help="held-out loss of a checkpoint, or the model's score of a text")
    _checkpoint_argument(s)
    s.add_argument("--data", default=None, help="corpus path (default: $JAXDECODE_DATA)")
    s.add_argument("--windows", type=int, default=32, help="held-out windows of T characters")
    s.add_argument("--text", default=None, help="score this text (mean log-probability per character)")
    s.add_argument("--prompt", default=None, help="condition --text on this prompt")
    s.add_argument("--held-out", action="store_true", help="with --text, also compute the held-out loss")
    add_weights_flag(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_eval)

    from jaxdecode.cli.bench import add_serve_bench  # serve-bench: static against continuous batching

    add_serve_bench(sub, seed_value)
    from jaxdecode.cli.server import add_serve  # serve: the OpenAI-compatible server

    add_serve(sub)
    from jaxdecode.cli.chat import add_chat  # chat: an interactive conversation

    add_chat(sub, seed_value)
    from jaxdecode.cli.explore import add_explore  # explore: the decoding explorer in a browser

    add_explore(sub)
    return p


def _one_line(e: BaseException) -> str:
    """An error's message on one line (a message of several lines, such as a compiler's output,
    is joined; a very long one is cut)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 600 else text[:597] + "..."


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        hint = argument_hint(parser, sys.argv[1:] if argv is None else list(argv))
        print(f"jaxdecode: error: {_one_line(e)}{hint}", file=sys.stderr)
        return 2
    from jaxdecode.models.checkpoint import CheckpointError
    from jaxdecode.io.data import CorpusError

    try:
        _merge_checkpoint(args)
        args.func(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught below rather than at exit
    except (UsageError, CheckpointError, CorpusError, ValueError, RuntimeError, FileExistsError,
            FileNotFoundError) as e:
        print(f"jaxdecode: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxdecode: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`jaxdecode generate ... | head`): not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
