"""The commands about checkpoints themselves: ``info``, ``convert``, ``train`` and ``eval``."""

from __future__ import annotations

from jaxdecode.cli.common import UsageError, encode_text, load_model, print_json, unescape


def cmd_info(args):
    from jaxdecode.models import checkpoint

    lm = checkpoint.load(args.ckpt)
    shape = {"V": lm.cfg.V, "T": lm.decoder.T, "d": lm.cfg.d, "L": lm.cfg.L, "heads": lm.cfg.heads}
    subword = getattr(lm.vocab, "subword", False)
    if subword:  # a Hugging Face model: its family's own fields
        shape |= {"kv_heads": lm.cfg.kv_heads, "head_dim": lm.cfg.head_dim, "ffn": lm.cfg.ffn}
    info = {
        "path": str(lm.path),
        "config": shape,
        "parameters": lm.num_params,
        "backend": lm.decoder.backend,
        "backend_reason": getattr(lm.decoder, "why", ""),
        "jax_backend": __import__("jax").default_backend(),
        "vocabulary": repr(lm.vocab) if subword else lm.vocab.chars,
        "end_tokens": list(lm.eos_ids),
        # the shape, the vocabulary and the parameter count are shown above, not again here
        "provenance": {k: v for k, v in lm.meta.items()
                       if k not in ("V", "T", "d", "L", "heads", "chars", "parameters")},
    }
    if args.json:
        print_json(info, indent=2)
        return
    c = info["config"]
    print(f"checkpoint  {info['path']}")
    print("shape       " + " ".join(f"{k}={v}" for k, v in c.items()))
    print(f"parameters  {info['parameters']:,}")
    print(f"backend     {info['backend_reason'] or info['backend']} [JAX on {info['jax_backend']}]")
    print(f"vocabulary  {info['vocabulary'] if subword else repr(lm.vocab.chars)}")
    if lm.eos_ids:
        print(f"end tokens  {list(lm.eos_ids)}")
    for k, v in info["provenance"].items():
        if k == "loss_curve":
            v = " ".join(f"{s}:{loss}" for s, loss in v)
        print(f"{k:<11} {v}")


def cmd_convert(args):
    from jaxdecode.models import checkpoint

    out = checkpoint.convert(args.pt, args.out_dir, overwrite=args.force)
    lm = checkpoint.load(out)
    print(f"wrote {out} ({lm.num_params:,} parameters, V={lm.cfg.V}, T={lm.cfg.T})")


def cmd_quantize(args):
    import os

    from jaxdecode.models import checkpoint
    from jaxdecode.models.hf.quantized import QuantizedError, save

    if os.path.exists(args.out_dir) and not args.force:
        raise UsageError(f"{args.out_dir} exists (--force replaces it)")
    try:
        lm = checkpoint.load(args.src, weights=args.weights, backend="portable")
    except checkpoint.CheckpointError as e:
        if "applies to Hugging Face folders" in str(e):
            raise UsageError(f"quantize takes a Hugging Face folder; {args.src} is a character model") from None
        raise
    try:
        out = save(lm, args.out_dir)
    except QuantizedError as e:
        raise UsageError(str(e)) from None
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({lm.num_params:,} parameters, {args.weights} matrices; {size / 1e6:.1f} MB)")


def cmd_train(args):
    from jaxdecode.models.charlm.train import TrainConfig, train

    tc = TrainConfig(d=args.d, L=args.layers, heads=args.heads, T=args.T, batch=args.batch,
                     steps=args.steps, lr=args.lr, warmup=args.warmup, seed=args.seed,
                     eval_every=args.eval_every, eval_windows=args.eval_windows, arch=args.arch,
                     kv_heads=args.kv_heads, ffn=args.ffn, vocab_size=args.vocab_size,
                     tokenizer=args.tokenizer)
    train(args.out_dir, tc, data_path=args.data, resume=args.resume, progress=not args.quiet)


def cmd_eval(args):
    from jaxdecode.io import data as data_lib
    from jaxdecode.models.charlm.train import held_out_loss

    if args.windows < 1:
        raise UsageError(f"--windows must be >= 1, got {args.windows}")
    if args.text is None and args.prompt is not None:
        raise UsageError("--prompt needs --text (the text to score after it)")
    if args.text is not None and not unescape(args.text):
        raise UsageError("the text to score is empty")
    lm = load_model(args)
    out = {"checkpoint": str(lm.path)}
    if lm.meta.get("format") == "huggingface":
        out["weights"] = lm.meta["weights"]
    if args.text is None or args.held_out:
        text = data_lib.read_corpus(args.data)
        if lm.meta.get("format") == "huggingface":  # nats per character, whatever a token is
            from jaxdecode.models.hf.train import held_out_loss as hf_held_out_loss, training_record

            out["held_out_loss"], out["held_out_windows"] = hf_held_out_loss(lm, text, count=args.windows)
            record = training_record(lm)
        else:
            _, val = data_lib.split(text)
            held = encode_text(lm, val, f"the held-out part of the corpus ({data_lib.locate_corpus(args.data)})")
            windows = data_lib.eval_windows(held, lm.cfg.T, args.windows)
            out["held_out_loss"] = held_out_loss(lm.params, lm.cfg, windows)
            out["held_out_windows"] = int(windows.shape[0])
            record = lm.meta
        if "held_out_loss" in record and record.get("held_out_windows") == out["held_out_windows"]:
            out["recorded_held_out_loss"] = record["held_out_loss"]
    if args.text is not None:
        from jaxdecode.decoding.score import score_texts

        text, prompt = unescape(args.text), unescape(args.prompt or "")
        encode_text(lm, prompt, "the prompt")
        encode_text(lm, text, "the text")
        res = score_texts(lm, [text], prompts=[prompt])[0]
        out["mean_logprob"] = res.mean_logprob
        out["characters"] = len(res.logprobs)
    if args.json:
        print_json(out, indent=2)
    else:
        for k, v in out.items():
            print(f"{k:<22} {v:.4f}" if isinstance(v, float) else f"{k:<22} {v}")
