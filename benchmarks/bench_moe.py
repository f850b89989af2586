"""A mixture-of-experts decode step against a dense model with the same active parameters.

A Qwen3-30B-A3B-like shape scaled down to a 2-core machine (``d`` 512, 64 experts of width 192,
8 chosen per token, 4 layers, grouped-query attention 8/2 heads of 64, vocabulary 4,096), random
weights, float32: one cached decode step (``extend`` of one token over a cache of 256
positions) timed at batch 1 against the same decoder with a dense MLP of width 8 x 192 = 1,536
(the same active parameters); then, at 1 to 16 tokens, the mixture computed by gathering the
chosen experts against every expert with zero weight off the chosen ones (the measurement behind
``jaxdecode.models.hf.moe.GATHER_LIMIT``)::

    python -m benchmarks.bench_moe         # prints the table of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness as H
from jaxdecode.models.hf import moe
from jaxdecode.models.hf.config import HFConfig
from jaxdecode.models.hf.transformer import HFDecoder

D, L, E, K, F, V, CTX = 512, 4, 64, 8, 192, 4096, 256


def config(experts: bool) -> HFConfig:
    return HFConfig(model_type="qwen3_moe" if experts else "qwen3", V=V, T=1024, d=D, L=L, heads=8, kv_heads=2,
                    head_dim=64, ffn=K * F, eps=1e-6, norm="rms", positions="rope", mlp="gated", act="silu",
                    qkv_bias=False, o_bias=False, mlp_bias=False, tied=True, qk_norm="head",
                    experts=E if experts else 0, top_k=K if experts else 0, moe_ffn=F if experts else 0,
                    moe_layers=(experts,) * L)


def params(cfg: HFConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.05)

    hd = cfg.head_dim
    layers = []
    for i in range(cfg.L):
        p = {"norm1_w": jnp.ones(D), "norm2_w": jnp.ones(D), "q_norm": jnp.ones(hd), "k_norm": jnp.ones(hd),
             "wq": w(D, cfg.heads * hd), "wk": w(D, cfg.kv_heads * hd), "wv": w(D, cfg.kv_heads * hd),
             "wo": w(cfg.heads * hd, D)}
        if cfg.is_moe(i):
            p |= {"router": w(D, E), "e_gu": w(E, 2 * F, D), "e_down": w(E, F, D)}
        else:
            p |= {"w_gate": w(D, cfg.ffn), "w_up": w(D, cfg.ffn), "w_down": w(cfg.ffn, D)}
        layers.append(p)
    return {"embed": w(V, D), "norm_w": jnp.ones(D), "layers": tuple(layers)}


def timed(fn, *args, repeat: int = 30) -> float:
    """Median seconds of ``fn(*args)`` (compiled and warmed first)."""
    jax.block_until_ready(fn(*args))
    return float(np.median([H.seconds(lambda: fn(*args)) for _ in range(repeat)]))


def decode_step(cfg: HFConfig, batch: int) -> float:
    dec = HFDecoder(cfg)
    prm = params(cfg)
    cache = dec.empty_cache(batch, CTX + 8)
    _, _, cache = jax.jit(dec.extend)(prm, cache, jnp.zeros((batch, CTX), jnp.int32))
    step = jax.jit(dec.extend)
    return timed(step, prm, cache, jnp.ones((batch, 1), jnp.int32))


def mixture(how: str, n: int) -> float:
    cfg = config(True)
    p = params(dataclasses.replace(cfg, L=1))["layers"][0]
    h = jax.random.normal(jax.random.PRNGKey(0), (n, 1, D))
    fn = jax.jit(lambda p, h: moe.moe_mlp(cfg, p, h, jax.nn.silu, how=how))
    return timed(fn, p, h)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print(f"# {H.describe(H.machine())}")
    dense, sparse = decode_step(config(False), 1), decode_step(config(True), 1)
    print(f"decode step, batch 1, cache {CTX}: dense (ffn {K * F}) {dense * 1e3:.2f} ms, "
          f"mixture ({E} experts, top {K}, gather) {sparse * 1e3:.2f} ms: {sparse / dense:.2f}x")
    print("tokens  N*k/E  gather ms  dense ms")
    for n in (1, 2, 4, 8, 16):
        g, d = mixture("gather", n), mixture("dense", n)
        print(f"{n:>6}  {n * K / E:>5.2f}  {g * 1e3:>9.3f}  {d * 1e3:>8.3f}")
    print(f"# load average at the end {H.load()[0]:.2f}")


if __name__ == "__main__":
    main()
