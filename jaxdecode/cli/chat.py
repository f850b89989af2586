"""``jaxdecode chat``: talk to a checkpoint in the terminal, through its chat template.

Each turn renders the whole conversation with the template (as the server's chat endpoint does),
generates the reply on an engine of one slot and streams it as it comes. An empty line or end of
input (Ctrl-D) ends the conversation.
"""

from __future__ import annotations

import sys

from jaxdecode.cli.common import add_weights_flag

def add_chat(sub, seed_type) -> None:
    s = sub.add_parser("chat", help="an interactive chat with a checkpoint, through its chat template")
    s.add_argument("--ckpt", default=None, help="checkpoint folder (default: the shipped model, which needs "
                                                "--chat-template)")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (default: the checkpoint's own)")
    s.add_argument("--system", default=None, metavar="TEXT", help="a system message to start with")
    s.add_argument("-n", type=int, default=256, metavar="TOKENS", help="the most tokens of a reply (default 256)")
    s.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0: greedy (default 0.7)")
    s.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling's p (default 0.95)")
    s.add_argument("--seed", type=seed_type, default=0, help="seed of the first reply; reply k uses seed + k")
    s.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype of a Hugging Face checkpoint (default float32)")
    add_weights_flag(s)
    s.set_defaults(func=cmd_chat)


def cmd_chat(args):
    from jaxdecode.cli.common import UsageError, load_model
    from jaxdecode.models.checkpoint import resolve
    from jaxdecode.rules import make_rule
    from jaxdecode.serving.engine import Engine, Request
    from jaxdecode.server.chat import ChatTemplateError, load_chat_template

    if args.n < 1:
        raise UsageError(f"-n must be at least 1, got {args.n}")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    try:
        template = load_chat_template(resolve(args.ckpt), args.chat_template)  # a path or a shipped name
    except ChatTemplateError as e:
        raise UsageError(str(e)) from None
    if template is None:
        raise UsageError("this checkpoint has no chat template: give one with --chat-template FILE")
    lm = load_model(args)
    engine = Engine(lm, 1)
    greedy = args.temperature == 0
    rule = make_rule(temperature=None if greedy or args.temperature == 1 else args.temperature,
                     top_p=None if args.top_p == 1 else args.top_p)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    vocab = lm.vocab
    for turn in range(1 << 30):
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        try:
            text = template.render(messages, add_generation_prompt=True)
        except ChatTemplateError as e:
            raise UsageError(f"the chat template refused the conversation: {e}") from None
        ids = vocab.encode(text, add_special_tokens=False) if getattr(vocab, "subword", False) else vocab.encode(text)
        n = min(args.n, engine.T - len(ids))
        if n < 1:
            raise UsageError(f"the conversation ({len(ids)} tokens) no longer fits the model's window of "
                             f"{engine.T} tokens")
        index = engine.submit(Request(ids, n, seed=args.seed + turn, rule=rule, greedy=greedy))
        stream = engine.stream(index, include_stop=False)
        sys.stdout.write("model> ")
        reply = ""
        while not stream.finished:
            engine.step()
            for d in stream.poll():
                reply += d.text
                sys.stdout.write(d.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        engine.forget(index)
        messages.append({"role": "assistant", "content": reply})
    return 0
