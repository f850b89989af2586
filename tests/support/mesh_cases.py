"""Cases of the mesh tests (tests/decoding/test_mesh.py), run in a process of its own on 8 forced CPU
devices: ``python tests/support/mesh_cases.py CASE...`` prints one JSON object per case. The devices must
be forced before JAX starts, so this file is a script, not a test module."""

from __future__ import annotations

import os

# the cases compare programs, not their speed: compiled without LLVM's costly passes (a third of
# the time), one device's reference and the mesh's programs alike
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 "
                           + FAST_COMPILE).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxdecode  # noqa: E402
from jaxdecode.decoding.placement import make_mesh  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
FAMILIES = ("llama", "mistral", "gemma2", "mixtral")  # dense with GQA, sliding window, soft-capping, MoE
PROMPTS = ["Hello world", "The cat sat", "a"]
COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def load(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "charlm":
            from jaxdecode.io.vocab import Vocab
            from jaxdecode.models.charlm.transformer import ModelConfig, init_params
            from jaxdecode.models.lm import LanguageModel

            cfg = ModelConfig(V=16, T=32, d=32, L=2, heads=4)
            params = jax.tree_util.tree_map(lambda a: a * 3.0, init_params(cfg, jax.random.PRNGKey(42)))
            return LanguageModel(params=params, cfg=cfg, vocab=Vocab(" abcdefghijklmn."), meta={},
                                 backend="portable")
        return jaxdecode.load(FIXTURES / name, backend="portable")


def prompts_for(lm):
    return ["abc d", "ha", "efg h"] if lm.cfg.__class__.__name__ == "ModelConfig" else PROMPTS


def tokens(gens):
    return [g.tokens.tolist() for g in gens]


def collectives(text: str) -> dict:
    """Each collective of a compiled program's HLO, by kind and shape."""
    return dict(Counter(f"{m.group(2)} {m.group(1)}" for m in COLLECTIVE.finditer(text)))


def step_hlo(lm, batch=2):
    """The compiled HLO of one decode step (extend by one token) of ``lm`` over a cache of 32."""
    dec = lm.decoder
    cache = jax.jit(lambda: dec.empty_cache(batch, 32))()
    step = jax.jit(lambda p, c, t: dec.extend(p, c, t[:, None])[:2])
    return step.lower(lm.params, cache, jnp.zeros((batch,), jnp.int32)).compile().as_text()


def weight_bytes(lm):
    """Each device's bytes of parameters (from addressable_shards), and the replicated ones."""
    per = Counter()
    replicated = 0
    for a in jax.tree_util.tree_leaves(lm.params):
        for s in a.addressable_shards:
            per[s.device.id] += s.data.nbytes
        if a.sharding.is_fully_replicated:
            replicated += a.nbytes
    total = sum(a.nbytes for a in jax.tree_util.tree_leaves(lm.params))
    return {"per_device": [per[d.id] for d in jax.devices() if d.id in per], "total": total,
            "replicated": replicated}


def greedy_program(dec, steps=6):
    """One compiled program: the prompt through the cache (extend), then ``steps`` greedy steps;
    returns the tokens and every step's logits."""
    def run(params, prompt):
        cache = dec.empty_cache(prompt.shape[0], 32)
        logits, _, cache = dec.extend(params, cache, prompt)

        def body(carry, _):
            last, cache = carry
            token = jnp.argmax(last, axis=-1).astype(jnp.int32)
            logits, _, cache = dec.extend(params, cache, token[:, None])
            return (logits[:, 0], cache), (token, logits[:, 0])

        _, (toks, every) = jax.lax.scan(body, (logits[:, -1], cache), None, length=steps)
        return toks.T, every

    return jax.jit(run)


MESHES = ((1, 2), (1, 4), (1, 8), (2, 4))
FEWER = ((1, 2), (1, 8), (2, 4))  # the families but Llama: the narrowest and widest model axes, and 2 x 4


def case_family(name):
    """Greedy tokens and logits of the cached path: one device against model axes 2, 4 (Llama
    only), 8 and a 2 x 4 mesh (the mesh of 1 is one device: the reference)."""
    lm = load(name)
    prompt = np.stack([np.resize(np.asarray(lm.vocab.encode(p), np.int32), 5) for p in prompts_for(lm)])
    run = greedy_program(lm.decoder)
    toks, logits = (np.asarray(a) for a in run(lm.params, prompt))
    out = {"ref": toks.tolist(), "scale": float(np.abs(logits).max())}
    for data, model in MESHES if name == "llama" else FEWER:
        slm = lm.shard(make_mesh(jax.devices()[:data * model], data=data, model=model))
        got, got_logits = (np.asarray(a) for a in greedy_program(slm.decoder)(slm.params, prompt))
        out[f"{data}x{model}"] = {"greedy": got.tolist(), "logits": float(np.abs(got_logits - logits).max())}
    return out


def case_generate(name):
    """jaxdecode.generate, greedy and seeded: one device against a 2 x 4 mesh, the parameters split
    over "model" and the rows over "data" by the loop (generate(..., mesh=))."""
    lm = load(name)
    ps = prompts_for(lm)
    run = lambda m, **kw: {"greedy": tokens(jaxdecode.generate(m, ps, 8, greedy=True, **kw)),
                           "sampled": tokens(jaxdecode.generate(m, ps, 8, seed=5, **kw))}
    out = {"ref": run(lm)}
    mesh = make_mesh(data=2, model=4)
    out["2x4"] = run(lm.shard(mesh), mesh=mesh)
    return out


def case_loops(name, model=2):
    """beam, score, contrastive, speculative and the engine (both caches) on a model axis, each
    beside its one-device result."""
    from jaxdecode.serving.engine import Engine, Request
    from jaxdecode.speculative.drafts.model import ModelDraft
    from jaxdecode.speculative.loop import speculative_generate

    lm = load(name)
    slm = lm.shard(make_mesh(jax.devices()[:model], data=1, model=model))
    ps = prompts_for(lm)
    out = {}

    def both(label, fn):
        try:
            out[label] = {"ref": fn(lm), "got": fn(slm)}
        except Exception as e:  # recorded, so that the test names the loop
            out[label] = {"error": f"{type(e).__name__}: {e}"}

    both("beam", lambda m: [[[b.text, round(float(b.logprob), 4)] for b in g]
                            for g in jaxdecode.beam_generate(m, ps[:2], 6, 3, n_best=3)])
    both("score", lambda m: [np.round(s.logprobs, 4).tolist() for s in jaxdecode.score(m, ps[:2], ps[1:3])])
    both("contrastive", lambda m: tokens(jaxdecode.contrastive_generate(m, ps[:2], 6, 3, 0.6)))
    both("speculative", lambda m: tokens(speculative_generate(
        m, ps[:2], 6, draft=ModelDraft.from_lm(m), gamma=3, seed=2)))
    for cache in ("dense", "paged"):
        reqs = lambda: [Request(ps[0], 5, seed=1), Request(ps[1], 4, seed=2, num_samples=2)]
        both(f"engine_{cache}", lambda m, cache=cache: [[o.tokens.tolist() for o in r.outputs]
                                                       for r in Engine(m, 2, cache=cache).run(reqs()).results])
    return out


def case_layout(name, model="4"):
    """What each device holds, and the collectives of the compiled decode step, on one device
    and on a model axis of ``model``."""
    lm = load(name)
    model = int(model)
    out = {"cfg": {k: getattr(lm.decoder.cfg, k, None) for k in ("L", "heads", "kv_heads", "experts", "V", "d",
                                                                   "head_dim")}}
    for m in (1, model):
        slm = lm.shard(make_mesh(jax.devices()[:m], data=1, model=m)) if m > 1 else lm
        out[str(m)] = {"bytes": weight_bytes(slm) if m > 1 else None, "collectives": collectives(step_hlo(slm))}
    return out


CASES = {"family": case_family, "generate": case_generate, "loops": case_loops, "layout": case_layout}


def main(argv):
    results = {}
    for arg in argv:
        kind, *args = arg.split(":")
        t = time.time()
        results[arg] = CASES[kind](*args)
        results[arg]["seconds"] = round(time.time() - t, 1)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
