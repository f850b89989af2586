"""What a model axis costs, counted in the compiled programs: for the Hugging Face fixtures on
model axes of 1, 2, 4 and 8 (forced CPU devices), each device's parameter bytes and the
collectives of one decode step (how many, of what shape, and their bytes), with the embedding and
the output layer split by vocabulary and by hidden size. A reader can check the counts here, not
the speed (docs/scaling.md).

    python -m benchmarks.bench_mesh [--batch 2] [--families llama,mistral,gemma2,mixtral] [--out FILE]
    python -m benchmarks.bench_mesh --speed [--folder DIR]   # on a GPU/TPU: greedy tokens/s of the
                                                             # 106M Llama at batch 1 and 64 beside
                                                             # the bound of the device's bandwidth

The counts go to benchmarks/results/bench_mesh.json (``--out``); a ``--speed`` run is written
only where ``--out`` names a file.

``--speed`` writes a SmolLM-135M-shaped Llama (random weights, 106M parameters; the shape of
benchmarks/bench_hf_llama.py) with numpy and safetensors alone when the folder lacks one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

from benchmarks import harness as H

ROOT = H.ROOT
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* (all-reduce|all-gather|all-to-all|collective-permute|"
                        r"reduce-scatter)(?:-start)?\(")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "s8": 1, "pred": 1, "u32": 4}
# published HBM bandwidth per chip, bytes/s (docs/scaling.md cites the sources)
HBM = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12, "L4": 0.3e12, "TPU v5 lite": 0.819e12,
       "TPU v5e": 0.819e12, "TPU v5p": 2.765e12, "TPU v4": 1.2e12, "TPU v6": 1.64e12}
SHAPE = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
         "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
         "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "model_type": "llama",
         "architectures": ["LlamaForCausalLM"], "torch_dtype": "float32"}


def collectives(text: str) -> list[tuple[str, int]]:
    """``(kind, bytes)`` of each collective in a compiled program's HLO."""
    out = []
    for m in COLLECTIVE.finditer(text):
        dims = [int(x) for x in m.group(2).split(",") if x]
        n = 1
        for x in dims:
            n *= x
        out.append((m.group(3), n * DTYPE_BYTES.get(m.group(1), 4)))
    return out


def count(lm, batch: int):
    """Per-device parameter bytes and the decode step's collectives for ``lm``."""
    import jax
    import jax.numpy as jnp

    held: dict = {}
    for a in jax.tree_util.tree_leaves(lm.params):
        for s in a.addressable_shards:
            held[s.device.id] = held.get(s.device.id, 0) + s.data.nbytes
    dec = lm.decoder
    cache = jax.jit(lambda: dec.empty_cache(batch, 64))()
    step = jax.jit(lambda p, c, t: dec.extend(p, c, t[:, None])[:2])
    text = step.lower(lm.params, cache, jnp.zeros((batch,), jnp.int32)).compile().as_text()
    found = collectives(text)
    kinds: dict = {}
    for kind, nbytes in found:
        k = kinds.setdefault(kind, {"count": 0, "bytes": 0})
        k["count"] += 1
        k["bytes"] += nbytes
    return {"bytes_per_device": max(held.values()), "collectives": kinds}


def counts(families, batch):
    import warnings

    import jax

    import jaxdecode
    from jaxdecode.decoding.placement import make_mesh

    rows = []
    for name in families:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lm = jaxdecode.load(FIXTURES / name, backend="portable")
        total = sum(a.nbytes for a in jax.tree_util.tree_leaves(lm.params))
        for M in (1, 2, 4, 8):
            for embedding in (("vocab", "hidden") if M > 1 else ("vocab",)):
                placed = lm if M == 1 else lm.shard(make_mesh(jax.devices()[:M], data=1, model=M),
                                                    embedding=embedding)
                rows.append({"model": name, "M": M, "embedding": embedding, "total_bytes": total,
                             **count(placed, batch)})
    return rows


def print_counts(rows, batch):
    print(f"# one decode step at batch {batch}, float32; collectives: count / bytes per step")
    print(f"{'model':9} {'M':>2} {'embed':6} {'bytes/device':>12} {'of total':>8}  {'all-reduce':>14} "
          f"{'all-gather':>14} {'other':>10}")
    for r in rows:
        c = r["collectives"]
        ar, ag = c.get("all-reduce", {}), c.get("all-gather", {})
        other = sum(v["count"] for k, v in c.items() if k not in ("all-reduce", "all-gather"))
        print(f"{r['model']:9} {r['M']:>2} {r['embedding']:6} {r['bytes_per_device']:>12,} "
              f"{r['bytes_per_device'] / r['total_bytes']:>8.3f}  "
              f"{ar.get('count', 0):>4} / {ar.get('bytes', 0):>7,} {ag.get('count', 0):>4} / {ag.get('bytes', 0):>7,} "
              f"{other:>10}")


def write_llama(folder: Path) -> None:
    """A SmolLM-135M-shaped Llama with random weights (std 0.02), written with numpy."""
    import numpy as np
    from safetensors.numpy import save_file

    if (folder / "model.safetensors").is_file():
        return
    folder.mkdir(parents=True, exist_ok=True)
    s = SHAPE
    d, F, V, L = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["num_hidden_layers"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    rng = np.random.default_rng(0)
    w = lambda *shape: (rng.standard_normal(shape, np.float32) * 0.02)
    t = {"model.embed_tokens.weight": w(V, d), "model.norm.weight": np.ones(d, np.float32)}
    for i in range(L):
        h = f"model.layers.{i}."
        t |= {h + "self_attn.q_proj.weight": w(q, d), h + "self_attn.k_proj.weight": w(kv, d),
              h + "self_attn.v_proj.weight": w(kv, d), h + "self_attn.o_proj.weight": w(d, q),
              h + "mlp.gate_proj.weight": w(F, d), h + "mlp.up_proj.weight": w(F, d),
              h + "mlp.down_proj.weight": w(d, F), h + "input_layernorm.weight": np.ones(d, np.float32),
              h + "post_attention_layernorm.weight": np.ones(d, np.float32)}
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(s, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (folder / "tokenizer.json").write_bytes((FIXTURES / "llama" / "tokenizer.json").read_bytes())


def speed(folder: Path, n: int = 64):
    """Greedy tokens/s at batch 1 and 64 on the devices found, beside the weight-reading bound."""
    import jax
    import numpy as np

    import jaxdecode
    from jaxdecode.decoding.placement import make_mesh

    write_llama(folder)
    dev = jax.devices()[0]
    kind = dev.device_kind
    bw = next((v for k, v in HBM.items() if k.lower() in kind.lower()), None)
    M = len(jax.devices())
    # the 106M Llama's 9 heads and 3 key/value heads split over 3 devices at most: a wider axis
    # replicates the attention (docs/scaling.md)
    lm = jaxdecode.load(folder, dtype="bfloat16", backend="portable")
    if M > 1:
        lm = lm.shard(make_mesh(data=1, model=M))
    held: dict = {}
    for a in jax.tree_util.tree_leaves(lm.params):
        for s in a.addressable_shards:
            held[s.device.id] = held.get(s.device.id, 0) + s.data.nbytes
    per_device = max(held.values())
    rng = np.random.default_rng(0)
    print(f"# {kind} x{M}, {per_device / 1e6:.1f} MB of bfloat16 weights per device, "
          f"HBM {bw / 1e12 if bw else float('nan'):.2f} TB/s")
    out = []
    for B in (1, 64):
        prompts = [rng.integers(4, 400, 16).tolist() for _ in range(B)]
        texts = [lm.vocab.decode(p) for p in prompts]
        jaxdecode.generate(lm, texts, n, greedy=True)  # compile
        t = time.perf_counter()
        gens = jaxdecode.generate(lm, texts, n, greedy=True)
        secs = time.perf_counter() - t
        tokens = sum(len(g.tokens) for g in gens)
        bound = bw / per_device if bw else float("nan")  # steps/s if each step reads the weights once
        row = {"device": kind, "devices": M, "batch": B, "tokens_per_s": tokens / secs,
               "steps_per_s": tokens / B / secs, "bound_steps_per_s": bound}
        out.append(row)
        print(f"batch {B:>3}: {row['tokens_per_s']:>9.0f} tok/s, {row['steps_per_s']:>7.0f} steps/s; "
              f"bound (weights / HBM bandwidth) {bound:>7.0f} steps/s ({row['steps_per_s'] / bound:.0%} of it)")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--families", default="llama,mistral,gemma2,mixtral")
    ap.add_argument("--out", default=None, help="the result file (default for the counts: "
                    "benchmarks/results/bench_mesh.json; '-': none)")
    ap.add_argument("--speed", action="store_true", help="benchmark greedy decoding on the real devices")
    ap.add_argument("--folder", default=str(Path.home() / ".cache" / "jaxdecode-bench" / "llama106m-np"))
    args = ap.parse_args(argv)
    if args.speed:
        rows = speed(Path(args.folder))
    else:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        rows = counts(args.families.split(","), args.batch)
        print_counts(rows, args.batch)
    out = args.out or (None if args.speed else H.default_out("bench_mesh"))
    if out and out != "-":
        H.write_json(out, H.result("benchmarks.bench_mesh", argv, rows=rows))


if __name__ == "__main__":
    main()
