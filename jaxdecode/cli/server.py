"""``jaxdecode serve``: the OpenAI-compatible server (``docs/server.md``) on a checkpoint."""

from __future__ import annotations

import functools
import logging
import os
import signal
import time

from jaxdecode.cli.common import add_weights_flag
from jaxdecode.serving.config import EngineConfig


def add_serve(sub) -> None:
    """Register ``serve`` on the subcommand set ``sub``."""
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming)")
    s.add_argument("--ckpt", default=None, help="checkpoint folder (default: the shipped model)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the "
                        "network, with --api-key)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: the checkpoint folder's name)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/ routes (default: $JAXDECODE_API_KEY, "
                        "or none)")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (default: the checkpoint's own, if it has one)")
    s.add_argument("--max-waiting", type=int, default=None, metavar="N",
                   help="refuse new requests with 429 while N rows wait for a slot (default: no limit)")
    s.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype of a Hugging Face checkpoint (default float32)")
    add_weights_flag(s)
    s.add_argument("--no-generation-config", action="store_true",
                   help="ignore a Hugging Face folder's generation_config.json defaults (temperature, top-k, "
                        "top-p, repetition penalty, do_sample), which apply to the fields a request leaves out")
    s.add_argument("--warm-up", action="store_true",
                   help="compile every program the engine can run before listening, so that no request "
                        "waits for the compiler (about a minute for the shipped model on 2 CPU cores; with "
                        "$JAX_COMPILATION_CACHE_DIR set, later starts read them back)")
    s.add_argument("--engine-thread", action="store_true",
                   help="run the engine in a thread of the server's process, not in a process of its own "
                        "(slower under load: the HTTP side and the engine's host work share one GIL)")
    s.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="the server's log level (default warning)")
    s.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="run the model on a mesh of the devices: its parameters split over M of them "
                        "(tensor and expert parallelism, the portable path; docs/scaling.md), D groups of them")
    EngineConfig.add_flags(s, slots=32)
    s.set_defaults(func=cmd_serve)


def parse_mesh(text: str | None) -> dict | None:
    """``"data=D,model=M"`` (either part may be left out) as make_mesh's keywords."""
    if text is None:
        return None
    sizes = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in ("data", "model") or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--mesh takes data=D,model=M with positive integers, got {text!r}")
        sizes[name.strip()] = int(value)
    return sizes


def _on_mesh(lm, sizes: dict | None):
    """``lm`` with its parameters split over the mesh of ``sizes`` (on the portable path)."""
    if not sizes:
        return lm
    from jaxdecode.decoding.placement import make_mesh

    return lm.with_backend("portable").shard(make_mesh(**sizes))


def cmd_serve(args):
    import uvicorn

    from jaxdecode.cli.common import UsageError, load_model
    from jaxdecode.server.app import Server, build_app
    from jaxdecode.server.chat import ChatTemplateError, load_chat_template
    from jaxdecode.models.checkpoint import resolve as resolve_checkpoint
    from jaxdecode.server.core import EngineStartError, ProcessRunner

    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.max_waiting is not None and args.max_waiting < 1:
        raise UsageError(f"--max-waiting must be at least 1, got {args.max_waiting}")
    try:
        folder = resolve_checkpoint(args.ckpt) if args.ckpt else None  # a path, or a shipped model's name
        template = load_chat_template(folder, args.chat_template) if folder or args.chat_template else None
    except ChatTemplateError as e:
        raise UsageError(str(e)) from None
    try:
        config = EngineConfig.from_args(args)
        mesh = parse_mesh(getattr(args, "mesh", None))
    except ValueError as e:
        raise UsageError(str(e)) from None
    options = dict(ckpt=args.ckpt, dtype=getattr(args, "dtype", None) or "float32", weights=args.weights,
                   engine=config, warm_up=args.warm_up, mesh=mesh)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.ckpt)) if args.ckpt
                                      else "shakespeare-char")
    kw = dict(model_name=name, api_key=args.api_key or os.environ.get("JAXDECODE_API_KEY"),
              chat_template=template, max_waiting=args.max_waiting)
    if args.engine_thread:
        lm = load_model(args)
        try:
            lm = _on_mesh(lm, mesh)
            engine = _engine(lm, options)
        except ValueError as e:
            raise UsageError(str(e)) from None
        server = Server(lm.vocab, engine, defaults=_defaults(lm, args), **kw)
        compiled = engine.compiled_at_start
    else:  # the model is loaded in the engine's process only; it sends its vocabulary back
        runner = ProcessRunner(functools.partial(build_engine, options))
        try:
            runner.launch()
        except EngineStartError as e:
            raise UsageError(str(e)) from None
        server = Server(runner.vocab, runner=runner, defaults={} if args.no_generation_config else runner.defaults,
                        **kw)
        compiled = runner.compiled_at_start
    from jaxdecode.cli.explorer import make_explorer  # the explorer's page and endpoints (/, /explore/...)

    server.explorer = make_explorer(options, lm if args.engine_thread else None)
    if args.warm_up:
        print(f"jaxdecode: warm-up compiled {compiled[0]} programs in {compiled[1]:.1f} s", flush=True)
    app = build_app(server)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=None)
    _Uvicorn(config, server).run()
    # stopped cleanly: a second SIGTERM or SIGINT while the process exits (the runtime's own teardown
    # takes a moment) must not turn the clean stop into a death by signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("jaxdecode: server stopped", flush=True)
    return 0


def _defaults(lm, args) -> dict:
    return {} if args.no_generation_config else dict(lm.generation_defaults)


def _engine(lm, options: dict):
    from jaxdecode.serving.engine import Engine, Request
    from jaxdecode.server.handlers import server_layout

    engine = Engine(lm, config=options["engine"], layout=server_layout(lm.decoder.V))
    engine.compiled_at_start = (0, 0.0)
    if options.get("warm_up"):
        # a request of every prompt length with the rest of the window to generate: every prompt
        # piece, batch and span the engine can meet (constrained programs compile on first use)
        start = time.perf_counter()
        count = engine.warm_up([Request([0] * P, engine.T - P) for P in range(1, engine.T)])
        engine.compiled_at_start = (count, time.perf_counter() - start)
    return engine


def build_engine(options: dict):
    """The engine's process's engine (and the vocabulary its constraints compile over), from the
    checkpoint and the engine options ``serve`` was given."""
    from argparse import Namespace

    from jaxdecode.cli.common import UsageError, load_model

    try:
        lm = load_model(Namespace(ckpt=options["ckpt"], dtype=options["dtype"], weights=options.get("weights")))
        lm = _on_mesh(lm, options.get("mesh"))
    except UsageError as e:
        raise ValueError(str(e)) from None
    return _engine(lm, options), lm.vocab, dict(lm.generation_defaults)


def _uvicorn_server():
    import uvicorn

    class Draining(uvicorn.Server):
        """uvicorn's server that, on SIGINT or SIGTERM, answers new requests with 503 while the ones
        in flight finish, and prints its address once it listens."""

        def __init__(self, config, jd_server):
            super().__init__(config)
            self.jd = jd_server

        def handle_exit(self, sig, frame):
            self.jd.draining = True
            super().handle_exit(sig, frame)
            # uvicorn raises the signal again once it has shut down, so that the process dies of it;
            # a server that stopped cleanly on request exits with status 0 instead
            getattr(self, "_captured_signals", []).clear()

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.servers and self.servers[0].sockets:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"jaxdecode: serving '{self.jd.name}' at http://{host}:{port}/v1", flush=True)

    return Draining


def _Uvicorn(config, server):
    return _uvicorn_server()(config, server)
