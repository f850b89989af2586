"""The variants of ``jaxdecode generate``: beam search, speculative sampling, contrastive search
and sequential Monte Carlo (plain sampling and greedy stay in :mod:`jaxdecode.cli.app`)."""

from __future__ import annotations

import math
import sys

import numpy as np

from jaxdecode.cli.common import (
    UsageError,
    compile_constraint,
    constraint_settings,
    encode_text,
    load_model,
    past_window,
    print_json,
    print_samples,
    stop_strings,
    streaming,
    unit_name,
)


def decode_params(args, settings: dict | None = None, **fields):
    """The :class:`~jaxdecode.decoding.params.DecodeParams` of the generate command's flags: ``-n``,
    ``--memory-budget``, the rule flags ``settings`` (already checked, their errors naming the
    flags) and ``fields`` (the stop strings, the constraint, ... each variant honours)."""
    from jaxdecode.decoding.params import DecodeParams

    try:
        return DecodeParams(n=args.n, memory_budget=args.memory_budget, **(settings or {}), **fields)
    except ValueError as e:
        raise UsageError(str(e)) from None


def generate_contrastive(args, prompt, settings):
    from jaxdecode.decoding.contrastive import contrastive_generate

    k, alpha = args.contrastive
    clash = [f for f, on in (("--beam", args.beam is not None), ("--speculative", args.speculative is not None),
                             ("--greedy", args.greedy), ("--num-samples", args.num_samples != 1),
                             ("--regex", args.regex is not None), ("--choice", bool(args.choice)),
                             ("--json-schema", args.json_schema is not None), ("--smc", args.smc is not None)) if on]
    clash += ["--" + name.replace("_", "-") for name in settings]
    if clash:
        raise UsageError(f"--contrastive is deterministic and ranks the model's own top-k; it does not "
                         f"combine with {', '.join(clash)}")
    lm = load_model(args)
    ids = encode_text(lm, prompt, "the prompt")
    stop = stop_strings(args, lm)
    stream, on_text = streaming(args, prompt)
    on_text, done = past_window(args, lm, len(ids), args.n, 1, on_text)
    try:
        out = contrastive_generate(lm, prompt, decode_params(args, stop=stop), k, alpha, on_text=on_text)[0]
    except ValueError as e:
        raise UsageError(str(e)) from None
    finally:
        done()
    if args.json:
        print_json({"outputs": [{"prompt": prompt, "text": out.text, "mean_logprob": out.mean_logprob,
                                  "tokens": out.tokens.tolist(), "finish_reason": out.finish_reason}],
                     "settings": {"n": args.n, "contrastive": {"k": k, "alpha": alpha}, "stop": stop,
                                  "checkpoint": str(lm.path)}})
    elif stream:
        sys.stdout.write("\n")
        print(f"--- mean log-probability {out.mean_logprob:.3f} nats per {unit_name(lm)}", file=sys.stderr)
    else:
        print(out.prompt + out.text)


def generate_smc(args, lm, prompt, constraint, settings):
    """--smc: the constrained continuation's exact conditional distribution, estimated by
    sequential Monte Carlo; prints the estimate and ``--num-samples`` draws from it."""
    clash = [f for f, on in (("--greedy", args.greedy), ("--stop", bool(args.stop))) if on]
    clash += ["--" + name.replace("_", "-") for name in settings]
    if constraint is None or clash:
        raise UsageError("--smc needs a constraint (--regex, --choice or --json-schema)" if constraint is None else
                         f"--smc samples the model's own distribution; it does not combine with {', '.join(clash)}")
    if args.smc < 1:
        raise UsageError(f"--smc must be >= 1 particle, got {args.smc}")
    from jaxdecode.decoding.smc import smc_generate

    res = smc_generate(lm, prompt, args.n, constraint, args.smc, seed=args.seed, memory_budget=args.memory_budget)
    ranked = sorted(res.distribution.items(), key=lambda kv: (-kv[1], kv[0]))
    rng = np.random.default_rng(args.seed)
    draws = rng.choice(len(ranked), size=args.num_samples, p=np.array([p for _, p in ranked]) / sum(p for _, p in ranked))
    texts = [ranked[i][0] for i in draws]
    if args.json:
        print_json({"outputs": [{"prompt": prompt, "text": t} for t in texts],
                     "distribution": [{"text": t, "probability": p} for t, p in ranked],
                     "log_marginal_likelihood": res.log_marginal,
                     "settings": {"n": args.n, "seed": args.seed, "num_samples": args.num_samples,
                                  "smc": args.smc, "checkpoint": str(lm.path), **constraint_settings(args)}})
        return
    for t in texts:
        print(prompt + t)
    print(f"--- SMC estimate over {args.smc} particles ({len(ranked)} distinct outputs):", file=sys.stderr)
    for t, p in ranked[:20]:
        print(f"{p:8.4f}  {t!r}", file=sys.stderr)


def generate_beam(args, prompt, rule, settings):
    from jaxdecode.decoding.beam import beam_generate

    if args.beam < 1:
        raise UsageError(f"--beam must be >= 1, got {args.beam}")
    n_best = args.n_best if args.n_best is not None else 1
    if not 1 <= n_best <= args.beam:
        raise UsageError(f"--n-best must lie in [1, --beam={args.beam}], got {n_best}")
    if args.num_samples != 1:
        raise UsageError("--num-samples does not apply to beam search (use --n-best)")
    alpha = args.length_penalty if args.length_penalty is not None else 0.0
    lm = load_model(args)
    ids = encode_text(lm, prompt, "the prompt")
    constraint = compile_constraint(args, lm)
    stop = stop_strings(args, lm)
    past_window(args, lm, len(ids), args.n, bar=False)  # beam search reports nothing until the end
    params = decode_params(args, settings, stop=stop, constraint=constraint)
    hyps = beam_generate(lm, prompt, params, args.beam, n_best=n_best, length_penalty=alpha)[0]
    if args.json:
        doc = {"outputs": [{"prompt": prompt, "text": h.text, "mean_logprob": h.mean_logprob,
                            "tokens": np.asarray(h.tokens).tolist(), "score": h.score,
                            "logprob": h.logprob, "finished": bool(h.finished)} for h in hyps],
               "settings": {"n": args.n, "beam": args.beam, "n_best": n_best, "length_penalty": alpha,
                            "stop": stop, "checkpoint": str(lm.path), **constraint_settings(args), **settings}}
        print_json(doc)
        return
    for i, h in enumerate(hyps):
        print(f"--- beam {i}: score {h.score:.3f}, mean log-probability {h.mean_logprob:.3f} nats per {unit_name(lm)}")
        print(prompt + h.text)


def generate_speculative(args, prompt, rule, settings):
    from jaxdecode.speculative import (
        DRAFTS,
        ModelDraft,
        SpeculativeStats,
        check_request,
        make_draft,
        speculative_generate,
    )

    if args.gamma is None:  # the fastest on CPU for each draft (docs/benchmarks.md)
        gamma = 3 if args.speculative == "distilled" else 2
    else:
        gamma = args.gamma
    if gamma < 1:
        raise UsageError(f"--gamma must be >= 1, got {gamma}")
    order, backoff = args.ngram_order, args.ngram_backoff
    if order is not None and not 1 <= order <= 6:
        raise UsageError(f"--ngram-order must be between 1 and 6, got {order}")
    if backoff is not None and not (backoff > 0 and math.isfinite(backoff)):
        raise UsageError(f"--ngram-backoff must be a positive number, got {backoff}")
    lm = load_model(args)
    check_request(lm.decoder, len(encode_text(lm, prompt, "the prompt")), args.n, gamma)  # before building a draft
    constraint = compile_constraint(args, lm)
    stop = stop_strings(args, lm)
    if args.speculative in DRAFTS:
        draft = make_draft(args.speculative, lm, data_path=args.data, n=order, backoff=backoff,
                           progress=not args.quiet)
    else:  # a smaller model of the same family and tokenizer
        from jaxdecode.io.vocab import same_vocabulary
        from jaxdecode.models import checkpoint

        small = checkpoint.load(args.speculative, dtype=getattr(args, "dtype", None) or "float32")
        if small.decoder.V != lm.decoder.V or getattr(small.vocab, "size", None) != getattr(lm.vocab, "size", None) \
                or not same_vocabulary(small.vocab, lm.vocab):
            raise UsageError(f"--speculative {args.speculative}: the draft's vocabulary ({small.decoder.V} tokens) "
                             f"is not the model's ({lm.decoder.V}); a draft must share the model's tokenizer")
        draft = ModelDraft.from_lm(small)
    stream, on_text = streaming(args, prompt)
    params = decode_params(args, settings, seed=args.seed, greedy=args.greedy, num_samples=args.num_samples,
                           stop=stop, constraint=constraint)
    outs = speculative_generate(lm, prompt, params, draft=draft, gamma=gamma, on_text=on_text)
    total = SpeculativeStats.total([o.stats for o in outs])
    line = (f"speculative ({args.speculative}, gamma={gamma}): acceptance {total.acceptance_rate:.2f}, "
            f"{total.chars_per_pass:.2f} tokens per target pass "
            f"(i.i.d. prediction {total.predicted_chars_per_pass:.2f}), {total.passes} passes")
    if args.json:
        doc = {"outputs": [{"prompt": o.prompt, "text": o.text, "mean_logprob": o.mean_logprob,
                            "tokens": o.tokens.tolist(), "finish_reason": o.finish_reason,
                            "stats": o.stats.as_dict()} for o in outs],
               "settings": {"n": args.n, "seed": args.seed, "num_samples": args.num_samples,
                            "greedy": bool(args.greedy), "stop": stop, "speculative": args.speculative,
                            "gamma": gamma, **constraint_settings(args),
                            "ngram_order": order, "ngram_backoff": backoff,
                            "checkpoint": str(lm.path), **settings},
               "stats": total.as_dict()}
        print_json(doc)
        return
    if stream:
        sys.stdout.write("\n")
    else:
        print_samples(outs, unit_name(lm))
    print(line, file=sys.stderr)
