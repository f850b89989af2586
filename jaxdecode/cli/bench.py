"""``jaxdecode serve-bench``: static against continuous batching on a stream of requests.

Requests arrive as a Poisson process of ``--rate`` per second. Each prompt is a stretch of the
held-out corpus with the first ``--shared-prefix`` characters of the held-out text in front; each
request generates up to ``--n`` characters (its length drawn from n/4 to n, and it stops early at
a blank line), with its own seed and sampling settings (temperature and top-p drawn from a few
values; every fourth request greedy).

Both policies serve the same requests with ``--slots`` slots, on the wall clock, or with
``--simulate`` on a virtual clock whose steps cost what a step-time model says
(:mod:`jaxdecode.serving.simulator`; ``--step-model`` reads a fit, such as the one
``python -m benchmarks.bench_serving`` writes). Either way the model runs and the texts are real, and the two
policies give the same texts. A slot sweep (simulated, replaying the texts of the run) shows
both policies at other slot counts; the figure plots it.

The engine's flags are :class:`~jaxdecode.serving.config.EngineConfig`'s, as ``jaxdecode serve``
takes them. ``--cache paged`` serves the requests on the paged KV cache (a pool of
``--num-blocks`` blocks of ``--block-size`` positions, prompts sharing their cached leading blocks)
and prints each run's peak cache memory beside that of a contiguous cache of ``slots`` rows of the
window ``T``, with the prompt tokens found in the pool (prefix hits).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import numpy as np

from jaxdecode.serving.config import EngineConfig

PROMPT_CHARS = (16, 64)  # prompt lengths (before the shared prefix) are drawn from this range
TEMPERATURES = (0.7, 0.8, 1.0)
TOP_PS = (0.9, 0.95, 1.0)
GREEDY_EVERY = 4
STOP = "\n\n"


def add_serve_bench(sub, seed_type) -> None:
    """Register ``serve-bench`` on the subcommand set ``sub``."""
    s = sub.add_parser("serve-bench", help="static against continuous batching on a stream of requests")
    s.add_argument("--requests", type=int, default=32, metavar="N", help="requests in the stream (default 32)")
    s.add_argument("--rate", type=float, default=4.0, metavar="R",
                   help="arrivals per second, a Poisson process (default 4)")
    s.add_argument("--shared-prefix", type=int, default=0, metavar="CHARS",
                   help="the first CHARS characters of the held-out text in front of every prompt (default 0)")
    s.add_argument("-n", "--n", dest="n", type=int, default=64, metavar="CHARS",
                   help="the most characters a request generates; each draws its length from n/4 to n (default 64)")
    s.add_argument("--simulate", action="store_true",
                   help="a virtual clock: each engine step costs what the step-time model says")
    s.add_argument("--step-model", default=None, metavar="FILE",
                   help="the step-time model for --simulate and the slot sweep: a JSON fit (default: the "
                        "shipped model's fit on a 2-core CPU)")
    s.add_argument("--sweep", default=None, metavar="S1,S2,...",
                   help="slot counts of the simulated sweep (default 1,2,4,...,2*S and S)")
    s.add_argument("--seed", type=seed_type, default=0, help="seed of the arrivals, prompts and settings (default 0)")
    s.add_argument("--json", action="store_true", help="print one JSON object, with every request and its text")
    s.add_argument("--out", default="results/serve-bench.png", metavar="FIG.png",
                   help="the figure (default results/serve-bench.png)")
    s.add_argument("--ckpt", default=None, help="checkpoint folder (default: the shipped model)")
    s.add_argument("--data", default=None, help="corpus path (default: $JAXDECODE_DATA)")
    s.add_argument("--quiet", action="store_true", help="no notes on stderr")
    EngineConfig.add_flags(s, slots=8)
    s.set_defaults(func=cmd_serve_bench)


# ----------------------------------------------------------------------------- the workload


def heldout_text(lm, data=None) -> str:
    """The held-out part of the corpus, less any character the model's vocabulary cannot encode."""
    from jaxdecode.io.data import read_corpus, split

    held = split(read_corpus(data))[1]
    ok = set()
    for c in set(held):
        try:
            lm.vocab.encode(c)
            ok.add(c)
        except ValueError:
            pass
    return "".join(c for c in held if c in ok)


def build_workload(lm, held: str, count: int, rate: float, n: int, shared_prefix: int = 0, seed: int = 0):
    """``count`` requests (see the module docstring) arriving as a Poisson process of ``rate``."""
    from jaxdecode import rules
    from jaxdecode.serving.engine import Request
    from jaxdecode.serving.simulator import poisson_arrivals

    T = lm.decoder.T
    if shared_prefix + 1 + n > T:
        raise ValueError(f"--shared-prefix ({shared_prefix}) + --n ({n}) + a prompt of at least one character "
                         f"exceed the model window T = {T}")
    if len(held) < shared_prefix + PROMPT_CHARS[1] + 1:
        raise ValueError(f"the held-out text has only {len(held)} usable characters, too few for "
                         f"--shared-prefix {shared_prefix}")
    prefix = held[:shared_prefix]
    arrivals = poisson_arrivals(count, rate, seed)
    rng = np.random.default_rng([seed, 1])
    try:
        stop = STOP if len(lm.vocab.encode(STOP)) else None
    except ValueError:
        stop = None
    out = []
    for i in range(count):
        ni = int(rng.integers(max(1, n // 4), n + 1))
        length = int(min(rng.integers(PROMPT_CHARS[0], PROMPT_CHARS[1] + 1), T - shared_prefix - ni))
        start = int(rng.integers(shared_prefix, len(held) - length))
        greedy = i % GREEDY_EVERY == GREEDY_EVERY - 1
        rule = None if greedy else rules.chain(rules.temperature(float(rng.choice(TEMPERATURES))),
                                               rules.top_p(float(rng.choice(TOP_PS))))
        out.append(Request(prefix + held[start:start + length], ni, seed=int(rng.integers(0, 2**31)), rule=rule,
                           greedy=greedy, stop=stop, arrival=float(arrivals[i])))
    return out


def request_settings(r) -> dict:
    """A request's settings as plain values."""
    import jax

    from jaxdecode.serving.engine import rule_parts

    settings = {type(p).__name__: np.asarray(leaf).tolist()
                for p in rule_parts(r.rule) for leaf in jax.tree_util.tree_leaves(p)}
    return {"n": r.n, "seed": r.seed, "num_samples": r.num_samples, "greedy": r.greedy,
            "stop": r.stop, "rule": settings}


# ----------------------------------------------------------------------------- the command


def _slot_sweep(text: str | None, slots: int) -> list[int]:
    if text is None:
        counts = {1 << k for k in range(0, max(0, int(math.log2(2 * slots))) + 1)} | {slots}
        return sorted(counts)
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise ValueError(f"--sweep must list slot counts >= 1 separated by commas, got {text!r}")
    return counts


def _table(rows: list[dict]) -> str:
    ms = lambda v: "–" if v is None else f"{1e3 * v:.0f}"
    lines = [f"{'':10} {'policy':10} {'slots':>5} {'tok/s':>8} {'lat p50':>8} {'lat p99':>8} {'ttft p50':>8} "
             f"{'ttft p99':>8} {'tpot p50':>8}  (times in ms)"]
    for r in rows:
        thr = "–" if r["throughput"] is None else f"{r['throughput']:.1f}"
        lines.append(f"{r['kind']:10} {r['policy']:10} {r['slots']:>5} {thr:>8} {ms(r['latency']['p50']):>8} "
                     f"{ms(r['latency']['p99']):>8} {ms(r['ttft']['p50']):>8} {ms(r['ttft']['p99']):>8} "
                     f"{ms(r['tpot']['p50']):>8}")
    return "\n".join(lines)


def _request_entry(res) -> dict:
    """One request of the continuous run for --json: its prompt, settings, text and timings (one
    sample: its text and finish reason; several: lists)."""
    one = len(res.outputs) == 1
    texts = [g.text for g in res.outputs]
    reasons = [g.finish_reason for g in res.outputs]
    return dict(index=res.index, prompt=res.request.prompt, arrival=res.arrival, **request_settings(res.request),
                text=texts[0] if one else texts, finish_reason=reasons[0] if one else reasons, ttft=res.ttft,
                latency=res.latency)


def cache_line(policy: str, c: dict, slots: int, T: int) -> str:
    """A paged run's cache memory against a contiguous cache, and its prefix hits, in one line."""
    kib = lambda b: "–" if b is None else f"{b / 1024:.1f} KiB"
    ratio = "" if not c["contiguous_bytes"] else f", {c['peak_bytes'] / c['contiguous_bytes']:.0%} of it"
    return (f"{c.get('layout', 'paged')} KV cache ({c.get('kv_dtype', 'float32')}), {policy}: peak {c['peak_blocks']} of {c['num_blocks']} blocks of {c['block_size']} "
            f"positions = {kib(c['peak_bytes'])} against {kib(c['contiguous_bytes'])} contiguous ({slots} x T = "
            f"{T} positions){ratio}; prefix hits {c['prefix_hit_tokens']} prompt tokens; "
            f"{c['block_waits']} admissions waited for blocks")


def _figure(path, sweep: list[dict], runs: list[dict], title: str):
    from jaxdecode.io.reports import new_figure, save_figure

    fig, axes = new_figure(1, 3, figsize=(13, 3.8))
    panels = (("throughput", None, "generated characters / s"), ("latency", "p99", "p99 latency (s)"),
              ("ttft", "p99", "p99 time to first token (s)"))
    for ax, (key, q, label) in zip(axes[0], panels):
        for policy, style in (("static", "o--"), ("continuous", "s-")):
            pts = [(r["slots"], r[key] if q is None else r[key][q]) for r in sweep if r["policy"] == policy]
            pts = [(s, v) for s, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{policy} (simulated)")
            for r in runs:
                v = r[key] if q is None else r[key][q]
                if r["policy"] == policy and v is not None:
                    ax.plot([r["slots"]], [v], "k*" if policy == "continuous" else "kx", ms=10,
                            label=f"{policy}, the run ({r['kind']})")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["slots"] for r in sweep} | {r["slots"] for r in runs})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("slots")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def cmd_serve_bench(args):
    from jaxdecode.cli.common import UsageError, load_model, note
    from jaxdecode.serving.engine import Engine, RealClock
    from jaxdecode.serving.warmup import count_compiles
    from jaxdecode.serving.simulator import DEFAULT_STEP_MODEL, StepTimeModel, VirtualClock, compare, scripts_of
    from jaxdecode.io.reports import clean, require_matplotlib

    for name, value, low in (("--requests", args.requests, 1), ("--shared-prefix", args.shared_prefix, 0),
                             ("--n", args.n, 1)):
        if value < low:
            raise UsageError(f"{name} must be an integer >= {low}, got {value}")
    if not (math.isfinite(args.rate) and args.rate > 0):
        raise UsageError(f"--rate must be a finite number > 0 (requests per second), got {args.rate}")
    try:
        config = EngineConfig.from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    engine = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("slots", "policy")}
    sweep_slots = _slot_sweep(args.sweep, args.slots)
    step_model = DEFAULT_STEP_MODEL if args.step_model is None else StepTimeModel.load(args.step_model)
    if args.out:
        require_matplotlib()

    lm = load_model(args)
    held = heldout_text(lm, args.data)
    requests = build_workload(lm, held, args.requests, args.rate, args.n, args.shared_prefix, args.seed)
    kind = "simulated" if args.simulate else "measured"
    if not args.simulate:
        # every program either policy can take for these requests, whatever the timing (both share
        # them); then a first pass on the wall clock, each policy, runs each program once before
        # the timed runs (a program's first call costs more than the later ones, compiled or not)
        compiled = Engine(lm, config=config).warm_up(requests)
        note(args, f"compiled {compiled} programs; a first pass of {len(requests)} requests on the wall "
                    f"clock, each policy (about {requests[-1].arrival:.0f} s of arrivals each), "
                    f"then the timed pass")
        for policy in ("static", "continuous"):
            Engine(lm, config=dataclasses.replace(config, policy=policy), clock=RealClock()).run(requests)
    reports, compiles = {}, {}
    for policy in ("static", "continuous"):
        clock = VirtualClock(step_model) if args.simulate else RealClock()
        with count_compiles() as counted:
            reports[policy] = Engine(lm, config=dataclasses.replace(config, policy=policy),
                                     clock=clock).run(requests)
        compiles[policy] = counted[0]
    texts = {p: [[g.text for g in r.outputs] for r in rep.results] for p, rep in reports.items()}
    identical = texts["static"] == texts["continuous"]
    runs = [dict(reports[p].summary(), kind=kind, compiles=compiles[p]) for p in ("static", "continuous")]
    measured_fit = None
    if not args.simulate:
        records = [s for p in reports for s in reports[p].steps]
        fit = StepTimeModel.fit(records, note="this run (one slot count: rows and the intercept are not separated)")
        measured_fit = dict(fit.to_dict(), rms_error=fit.residual(records))
    sweep = [dict(r, kind="simulated") for r in
             compare(lm, requests, sweep_slots, step_model, scripts=scripts_of(reports["continuous"]),
                     **engine)]

    figure = None
    if args.out:
        title = (f"{len(requests)} requests, Poisson {args.rate:g}/s, n <= {args.n}, shared prefix "
                 f"{args.shared_prefix}; sweep simulated with t = {step_model.a * 1e3:.2f} ms + "
                 f"{step_model.b * 1e3:.3f} ms/row + {step_model.c * 1e3:.4f} ms/prefill token")
        figure = str(_figure(args.out, sweep, runs, title))

    if args.json:
        cont = reports["continuous"]
        doc = {
            "settings": {"requests": args.requests, "rate": args.rate, "slots": args.slots,
                         "shared_prefix": args.shared_prefix, "n": args.n, "seed": args.seed,
                         "simulate": args.simulate, "backend": lm.decoder.backend, **engine},
            "step_model": step_model.to_dict(),
            "measured_step_model": measured_fit,
            "runs": runs,
            "identical_outputs": identical,
            "sweep": sweep,
            "figure": figure,
            "requests": [_request_entry(r) for r in cont.results],
        }
        print(json.dumps(clean(doc), indent=2, ensure_ascii=False))
        return
    print(f"{len(requests)} requests, Poisson arrivals {args.rate:g}/s, up to {args.n} characters each, "
          f"{lm.decoder.backend} backend; {'virtual' if args.simulate else 'wall'} clock")
    print(_table(runs + sweep))
    print(f"static and continuous batching gave {'the same' if identical else 'DIFFERENT'} texts")
    for run in runs:
        if run.get("cache"):
            print(cache_line(run["policy"], run["cache"], args.slots, lm.decoder.T))
    if measured_fit is not None:
        decode = measured_fit["a"] + measured_fit["b"] * args.slots
        print(f"measured steps: {decode * 1e3:.2f} ms a decode pass of {args.slots} slots + "
              f"{measured_fit['c'] * 1e3:.4f} ms per prefill token (rms error {measured_fit['rms_error'] * 1e3:.2f} ms)")
    if figure:
        print(f"wrote {figure}")
    sys.stdout.flush()
