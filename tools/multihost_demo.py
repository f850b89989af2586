"""Batch generation over every device of a JAX cluster: one command per process (host).

    # two processes on one machine, two CPU devices each (four in all), as one cluster:
    python tools/multihost_demo.py --coordinator localhost:12355 --num-processes 2 --process-id 0 \\
        --local-devices 2 --prompt "ROMEO:\\n" --prompt "JULIET:\\n" --prompt "KING:\\n" -n 120 --top-p 0.9 &
    python tools/multihost_demo.py --coordinator localhost:12355 --num-processes 2 --process-id 1 \\
        --local-devices 2 --prompt "ROMEO:\\n" --prompt "JULIET:\\n" --prompt "KING:\\n" -n 120 --top-p 0.9

    # one process over its local devices (no coordinator)
    python tools/multihost_demo.py --local-devices 4 --prompt "ROMEO:\\n" -n 120 --greedy

    # a model split over each process's 4 devices, the rows over the two processes (data x model = 2 x 4)
    python tools/multihost_demo.py --coordinator localhost:12355 --num-processes 2 --process-id 0 \\
        --local-devices 4 --model 4 --checkpoint FOLDER --prompt "Hello" --prompt "The cat" -n 20 --greedy &
    python tools/multihost_demo.py --coordinator localhost:12355 --num-processes 2 --process-id 1 \\
        --local-devices 4 --model 4 --checkpoint FOLDER --prompt "Hello" --prompt "The cat" -n 20 --greedy

Every process gets the same command line but its own ``--process-id``. The prompts are dealt out
in contiguous blocks: process ``i`` encodes only its own block, the blocks are gathered into one
request (:func:`jaxdecode.decoding.sharded.gather_prompts`), the batch is split over a mesh of all
the cluster's devices, and every process receives every row's text. Process ``i`` prints the
texts of its own prompts; ``--out FILE`` writes every row (with the cluster's layout) as JSON.

The texts equal ``jaxdecode.generate(lm, prompts, n, seed=..., rule=..., stop=...)`` on one
device: seeds are per prompt, and a row's randomness depends only on its key, row id and step.

With ``--model M``, the mesh is ``data x model`` (:func:`jaxdecode.make_mesh` with ``model=M``:
M consecutive devices, a process's own first, hold one copy of the model split over them, and the
rows are split over the copies); every process loads only its own devices' slices of the weights
(``load(folder, mesh=...)``) and runs ``jaxdecode.generate(..., mesh=...)`` with every prompt.

The coordinator (``--coordinator HOST:PORT``, default ``$JAX_COORDINATOR_ADDRESS``) is process
0's address, reachable from every host. ``--local-devices N`` makes N CPU devices of this
process's CPU (for trying a cluster on one machine); leave it out on accelerator hosts. See
``docs/multihost.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _unescape(text: str) -> str:
    return text.replace("\\\\", "\0").replace("\\n", "\n").replace("\\t", "\t").replace("\0", "\\")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                   help="HOST:PORT of process 0 (default $JAX_COORDINATOR_ADDRESS); none: one process")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--local-devices", type=int, default=None,
                   help="run on N CPU devices of this process (XLA's host platform device count)")
    p.add_argument("--model", type=int, default=None,
                   help="split the model over M devices (a \"model\" axis; the rows over the rest)")
    p.add_argument("--checkpoint", default=None, help="checkpoint folder (default: the shipped model)")
    p.add_argument("--backend", default=None, choices=["auto", "native", "portable"])
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for more); \\n escapes")
    p.add_argument("-n", type=int, default=120, help="new characters per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeat for more)")
    p.add_argument("--out", default=None, help="write every row as JSON here")
    p.add_argument("--timeout", type=int, default=120, help="seconds to wait for the other processes")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.local_devices is not None:  # before jax is imported
        flags = os.environ.get("XLA_FLAGS", "")
        count = f"--xla_force_host_platform_device_count={args.local_devices}"
        os.environ["XLA_FLAGS"] = f"{flags} {count}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import numpy as np

    if args.num_processes > 1:
        if not args.coordinator:
            print("--num-processes > 1 needs --coordinator HOST:PORT (or $JAX_COORDINATOR_ADDRESS)",
                  file=sys.stderr)
            return 2
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices across processes
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=args.timeout)

    from jaxdecode import rules
    from jaxdecode.decoding import sharded as sharding
    from jaxdecode.decoding.common import sample_keys
    from jaxdecode.models import checkpoint

    if args.model is not None:
        return _on_model_axis(args)
    lm = checkpoint.load(args.checkpoint, backend=args.backend)
    prompts = [_unescape(t) for t in args.prompt]
    stops = [lm.vocab.encode(_unescape(s)) for s in args.stop or []]
    rule = rules.make_rule(temperature=args.temperature, top_p=args.top_p,
                           repetition_penalty=args.repetition_penalty)

    # this process's block of the prompts, then the whole request on every process
    me, count = jax.process_index(), jax.process_count()
    per = -(-len(prompts) // count)
    mine = list(range(me * per, min(len(prompts), (me + 1) * per)))
    rows, own = sharding.gather_prompts([lm.vocab.encode(prompts[i]) for i in mine])

    mesh = sharding.make_mesh()
    keys, row_ids = sample_keys(len(rows), 1, args.seed)
    res = sharding.sharded_sample_tokens(lm.decoder, lm.params, rows, args.n, keys, rule=rule,
                                         greedy=args.greedy, row_ids=row_ids, stops=stops, mesh=mesh)
    new = [res.tokens[r, :res.counts[r]] for r in range(len(rows))]
    texts = [lm.vocab.decode(t) for t in new]

    print(f"process {me} of {count}: {jax.local_device_count()} local devices, {jax.device_count()} in the "
          f"mesh, rows {own.start}..{own.stop - 1} of {len(rows)} are this process's prompts", flush=True)
    for r in range(own.start, own.stop):
        print(f"--- row {r} ({'stop' if res.stopped[r] else 'length'}) {lm.vocab.decode(rows[r])!r}")
        print(texts[r], flush=True)
    if args.out:
        layout = {"process_index": me, "process_count": count, "local_devices": jax.local_device_count(),
                  "devices": jax.device_count(), "mesh": {k: int(v) for k, v in mesh.shape.items()}}
        mean = lambda r: float(np.mean(res.model_logprobs[r, :res.counts[r]])) if res.counts[r] else None
        outputs = [{"prompt": lm.vocab.decode(rows[r]), "text": texts[r], "tokens": new[r].tolist(),
                    "stopped": bool(res.stopped[r]), "mean_logprob": mean(r)} for r in range(len(rows))]
        Path(args.out).write_text(json.dumps({"layout": layout, "own_rows": [own.start, own.stop],
                                              "outputs": outputs}, indent=1))
    if count > 1:
        jax.distributed.shutdown()
    return 0


def _on_model_axis(args) -> int:
    """Every prompt through ``generate`` on a ``data x model`` mesh of the cluster's devices, the
    model loaded slice by slice; every process prints and writes every row."""
    import jax

    import jaxdecode
    from jaxdecode import rules
    from jaxdecode.decoding.placement import make_mesh
    from jaxdecode.models import checkpoint

    mesh = make_mesh(model=args.model)
    lm = checkpoint.load(args.checkpoint, backend=args.backend, mesh=mesh)
    prompts = [_unescape(t) for t in args.prompt]
    rule = rules.make_rule(temperature=args.temperature, top_p=args.top_p,
                           repetition_penalty=args.repetition_penalty)
    gens = jaxdecode.generate(lm, prompts, args.n, greedy=args.greedy, seed=args.seed, rule=rule,
                              stop=[_unescape(s) for s in args.stop or []] or None, mesh=mesh)
    me, count = jax.process_index(), jax.process_count()
    shape = {k: int(v) for k, v in mesh.shape.items()}
    print(f"process {me} of {count}: {jax.local_device_count()} local devices, mesh {shape}", flush=True)
    for g in gens:
        print(f"--- {g.finish_reason} {g.prompt!r}")
        print(g.text, flush=True)
    if args.out:
        layout = {"process_index": me, "process_count": count, "local_devices": jax.local_device_count(),
                  "devices": jax.device_count(), "mesh": shape,
                  "model_axis_local": all(d.process_index == row[0].process_index
                                          for row in mesh.devices for d in row)}
        outputs = [{"prompt": g.prompt, "text": g.text, "tokens": g.tokens.tolist(),
                    "stopped": g.finish_reason == "stop"} for g in gens]
        Path(args.out).write_text(json.dumps({"layout": layout, "outputs": outputs}, indent=1))
    if count > 1:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
