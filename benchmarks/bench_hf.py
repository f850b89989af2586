"""The shipped checkpoint as a Hugging Face ``transformers`` model, timed with ``generate``.

Runs in its own virtual environment (never a dependency of jaxdecode)::

    python3 -m venv .venv-hf && .venv-hf/bin/pip install torch==2.13.0 transformers safetensors numpy
    .venv-hf/bin/python -m benchmarks.bench_hf --check           # HF model == jaxdecode?
    .venv-hf/bin/python -m benchmarks.bench_hf --batches 1,64 -n 300 --rounds 3 --json
    .venv-hf/bin/python -m benchmarks.bench_hf --serve           # driven by benchmarks/bench_backends.py

The model is the reference transformer of :mod:`jaxdecode.models.charlm.transformer` written as a
``transformers`` ``PreTrainedModel`` + ``GenerationMixin`` with a KV cache (a
``transformers.DynamicCache``): token plus learned position embeddings, ``L`` pre-norm layers
(``x + SA(LN1(x))`` then ``x + FF(LN2(x))``, FF ``d -> 4d -> d`` with exact-erf GELU), causal
attention with ``heads`` heads (``torch.nn.functional.scaled_dot_product_attention``), a final
LayerNorm (eps 1e-5) and an output layer tied to the token embedding. Its modules carry the
PyTorch names of the checkpoint (``tok``, ``pos``, ``blocks.layers.{i}.self_attn.in_proj_weight``,
``linear1``, ``norm1``, ``ln``, ...), so ``model.safetensors`` loads with a strict
``load_state_dict``.

``--check`` compares it with jaxdecode: the greedy text after the prompt (``generate`` with
``do_sample=False``) must equal ``jaxdecode generate PROMPT -n N --greedy``, and the next-token
logits after the prompt must match jaxdecode's to ``--atol`` (1e-4). Without ``--reference`` the
jaxdecode side is computed by running the project's own environment (``--jaxdecode-python``,
default ``.venv/bin/python``).

Timing: ``generate`` with ``max_new_tokens = min_new_tokens = n`` and no end-of-sequence token,
greedy (``do_sample=False``) and sampling (``do_sample=True, top_p=0.9, top_k=0``, temperature
1), on ``B`` copies of the prompt, under ``torch.inference_mode()`` with
``torch.set_num_threads(os.cpu_count())`` (``--threads``: a list of thread counts to time
instead); one warm-up per setting, then the fastest of ``--rounds``. On a machine whose cores
other work also uses, torch's intra-op threads wait for each other at every operation: a second
thread count (``--threads 2,1`` on two cores) shows what that costs.

``--serve`` reads commands from stdin, one a line, and answers each with one line:
``B MODE [threads=K] [n=N]`` (``MODE``: ``greedy``, ``top-p`` or ``beamK``, beam search with
``num_beams=K`` and no length penalty; default ``os.cpu_count()``
threads and ``-n``) runs one ``generate`` and prints its seconds; ``check PATH``
checks against the jaxdecode reference in the JSON file PATH and prints the result as JSON;
``quit`` ends. Its first line is a JSON object describing the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from benchmarks import harness as H

try:  # transformers >= 5
    from transformers import PreTrainedConfig
except ImportError:  # pragma: no cover - transformers 4.x
    from transformers import PretrainedConfig as PreTrainedConfig

ROOT = H.ROOT
DEFAULT_CKPT = ROOT / "checkpoints" / "shakespeare-char"
PROMPT = "KATHARINA:\nMoved! in good time: "
MODES = ("greedy", "top-p")
TOP_P = 0.9
# the name of the cache in the outputs and inputs of a model: `cache` from transformers 5.x on
# (which still accepts `past_key_values` as a deprecated alias), `past_key_values` before
_FIELDS = getattr(CausalLMOutputWithPast, "__dataclass_fields__", {})
CACHE_FIELD = "cache" if "cache" in _FIELDS else "past_key_values"


class CharLMConfig(PreTrainedConfig):
    model_type = "jaxdecode-charlm"

    def __init__(self, V: int = 65, T: int = 512, d: int = 256, L: int = 4, heads: int = 4, chars: str = "",
                 **kwargs):
        self.V, self.T, self.d, self.L, self.heads, self.chars = V, T, d, L, heads, chars
        # the standard names, which generate and the cache read
        self.vocab_size, self.max_position_embeddings, self.hidden_size = V, T, d
        self.num_hidden_layers, self.num_attention_heads = L, heads
        kwargs.setdefault("tie_word_embeddings", True)
        super().__init__(**kwargs)


class SelfAttention(nn.Module):
    """Causal multi-head attention with the parameters of ``torch.nn.MultiheadAttention``."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d, d))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d))
        self.out_proj = nn.Linear(d, d)

    def forward(self, x, cache, layer_idx: int):
        B, S, d = x.shape
        H = self.heads
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias).view(B, S, 3, H, d // H)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, S, hd]
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)  # the whole history, [B, H, past + S, hd]
        Tk = k.shape[2]
        if S == 1:  # a decode step sees every cached position
            out = F.scaled_dot_product_attention(q, k, v)
        elif Tk == S:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # several new positions after a filled cache
            mask = torch.ones(S, Tk, dtype=torch.bool, device=x.device).tril(Tk - S)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(B, S, d))


class Layer(nn.Module):
    """A pre-norm encoder layer (``torch.nn.TransformerEncoderLayer(norm_first=True)``'s names)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.self_attn = SelfAttention(d, heads)
        self.linear1 = nn.Linear(d, 4 * d)
        self.linear2 = nn.Linear(4 * d, d)
        self.norm1 = nn.LayerNorm(d, eps=1e-5)
        self.norm2 = nn.LayerNorm(d, eps=1e-5)

    def forward(self, x, cache, layer_idx: int):
        x = x + self.self_attn(self.norm1(x), cache, layer_idx)
        return x + self.linear2(F.gelu(self.linear1(self.norm2(x))))  # exact (erf) GELU


class Blocks(nn.Module):
    def __init__(self, d: int, heads: int, L: int):
        super().__init__()
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(L))


class CharLMForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = CharLMConfig
    base_model_prefix = "charlm"
    main_input_name = "input_ids"
    _supports_cache_class = True  # transformers 4.x: generate may pass a DynamicCache

    def __init__(self, config: CharLMConfig):
        super().__init__(config)
        self.tok = nn.Embedding(config.V, config.d)
        self.pos = nn.Embedding(config.T, config.d)
        self.blocks = Blocks(config.d, config.heads, config.L)
        self.ln = nn.LayerNorm(config.d, eps=1e-5)
        self.post_init()

    def _init_weights(self, module):  # the weights are always loaded from the checkpoint
        pass

    def get_input_embeddings(self):
        return self.tok

    def set_input_embeddings(self, value):
        self.tok = value

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                use_cache=None, logits_to_keep: int = 0, **kwargs):
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        S = input_ids.shape[1]
        if past + S > self.config.T:
            raise ValueError(f"{past + S} positions exceed the model's window T={self.config.T}")
        if past == 0 and attention_mask is not None and not bool(attention_mask.all()):
            raise NotImplementedError("padded prompts are not supported: every row is all real tokens")
        positions = torch.arange(past, past + S, device=input_ids.device)
        h = self.tok(input_ids) + self.pos(positions)[None]
        for i, layer in enumerate(self.blocks.layers):
            h = layer(h, cache, i)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = F.linear(self.ln(h), self.tok.weight)  # tied to the token embedding
        return CausalLMOutputWithPast(logits=logits, **{CACHE_FIELD: cache if use_cache else None})


def load(ckpt: Path = DEFAULT_CKPT) -> tuple[CharLMForCausalLM, str]:
    meta = json.loads((Path(ckpt) / "config.json").read_text(encoding="utf-8"))
    config = CharLMConfig(**{k: meta[k] for k in ("V", "T", "d", "L", "heads", "chars")})
    model = CharLMForCausalLM(config)
    state = load_file(str(Path(ckpt) / "model.safetensors"))
    for name in ("mask", "out.weight"):  # a buffer and the tied output layer, if present
        state.pop(name, None)
    model.load_state_dict(state, strict=True)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval(), meta["chars"]


def encode(chars: str, text: str) -> list[int]:
    return [chars.index(c) for c in text]


def generate(model, ids: list[int], B: int, n: int, mode: str, seed: int = 0) -> torch.Tensor:
    """``B`` copies of the prompt, ``n`` new tokens each; returns the new tokens ``[B, n]``."""
    x = torch.tensor([ids] * B, dtype=torch.long)
    kw = {"max_new_tokens": n, "min_new_tokens": n, "eos_token_id": None, "pad_token_id": 0}
    if mode == "greedy":
        kw.update(do_sample=False)
    elif mode == "top-p":
        kw.update(do_sample=True, top_p=TOP_P, top_k=0, temperature=1.0)
        torch.manual_seed(seed)
    elif mode.startswith("beam") and mode[4:].isdigit():  # beam5: num_beams=5, the best beam returned
        kw.update(do_sample=False, num_beams=int(mode[4:]), num_return_sequences=1, length_penalty=0.0)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), **kw)
    assert out.shape == (B, len(ids) + n), out.shape
    return out[:, len(ids):]


def time_once(model, ids, B, n, mode) -> float:
    t = time.perf_counter()
    generate(model, ids, B, n, mode)
    return time.perf_counter() - t


def prompt_logits(model, ids) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.tensor([ids]), use_cache=False).logits[0, -1].double().numpy()


def jaxdecode_reference(n: int, ckpt: Path, python: str) -> dict:
    """jaxdecode's greedy text (its CLI) and next-token logits after the prompt, computed in the
    project's own environment."""
    cli = Path(python).parent / "jaxdecode"
    cmd = [str(cli), "generate", PROMPT.replace("\n", "\\n"), "-n", str(n), "--greedy", "--json",
           "--ckpt", str(ckpt)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    text = json.loads(out.stdout)["outputs"][0]["text"]
    code = ("import json, sys, jax.numpy as jnp\n"
            "from jaxdecode import checkpoint, model as M\n"
            "lm = checkpoint.load(sys.argv[1])\n"
            "ids = lm.vocab.encode(sys.argv[2])\n"
            "logits = M.forward(lm.params, lm.cfg, jnp.asarray([ids]))[0, -1]\n"
            "print(json.dumps([float(v) for v in logits]))\n")
    out = subprocess.run([python, "-c", code, str(ckpt), PROMPT], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    return {"n": n, "greedy_text": {"jaxdecode CLI": text},
            "logits": {"jaxdecode forward": json.loads(out.stdout)}}


def check(model, chars: str, reference: dict, atol: float = 1e-4) -> dict:
    """Compare the HF model with jaxdecode's reference: ``{"n", "greedy_text": {name: text},
    "logits": {name: [V floats]}}``. Returns the result (``ok``: everything matched)."""
    ids = encode(chars, PROMPT)
    n = int(reference["n"])
    hf_text = "".join(chars[i] for i in generate(model, ids, 1, n, "greedy")[0].tolist())
    hf_logits = prompt_logits(model, ids)
    result = {"n": n, "hf_greedy_text": hf_text, "greedy": {}, "logits": {}, "atol": atol}
    for name, text in reference.get("greedy_text", {}).items():
        same = text == hf_text
        first = next((i for i, (a, b) in enumerate(zip(text, hf_text)) if a != b),
                     min(len(text), len(hf_text)))
        result["greedy"][name] = {"equal": same, "first_difference": None if same else first}
    for name, ref in reference.get("logits", {}).items():
        diff = np.abs(np.asarray(ref, np.float64) - hf_logits)
        result["logits"][name] = {"max_abs_diff": float(diff.max()),
                                  "same_argmax": int(np.argmax(ref)) == int(np.argmax(hf_logits)),
                                  "ok": bool(diff.max() <= atol)}
    result["ok"] = (bool(result["greedy"]) and all(g["equal"] for g in result["greedy"].values())
                    and bool(result["logits"]) and all(v["ok"] for v in result["logits"].values()))
    return result


def describe_check(result: dict) -> str:
    lines = [f"HF generate(do_sample=False), {result['n']} chars: {result['hf_greedy_text'][:40]!r}..."]
    for name, g in result["greedy"].items():
        verdict = "identical" if g["equal"] else f"DIFFERS from character {g['first_difference']}"
        lines.append(f"  greedy text vs {name}: {verdict}")
    for name, v in result["logits"].items():
        within = "within" if v["ok"] else "OUTSIDE"
        lines.append(f"  next-token logits vs {name}: max |diff| {v['max_abs_diff']:.2e} "
                     f"({within} {result['atol']:g}), same argmax: {v['same_argmax']}")
    lines.append(f"  check: {'PASS' if result['ok'] else 'FAIL'}")
    return "\n".join(lines)


def environment() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "cache": "transformers.DynamicCache",
            "attention": "torch.nn.functional.scaled_dot_product_attention"}


def serve(model, chars: str, n: int) -> None:
    ids = encode(chars, PROMPT)
    print(json.dumps({"ready": True, **environment()}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            if words[0] == "quit":
                break
            if words[0] == "check":
                reference = json.loads(Path(words[1]).read_text(encoding="utf-8"))
                atol = float(words[2]) if len(words) > 2 else 1e-4
                print(json.dumps(check(model, chars, reference, atol)), flush=True)
                continue
            B, mode = int(words[0]), words[1]
            opts = dict(w.split("=", 1) for w in words[2:])
            torch.set_num_threads(int(opts.get("threads", os.cpu_count())))
            print(f"{time_once(model, ids, B, int(opts.get('n', n)), mode):.6f}", flush=True)
        except Exception as e:  # noqa: BLE001 -- one line back, so the driver is never left waiting
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, default=DEFAULT_CKPT)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--threads", default=None,
                    help="torch thread counts to time; the fastest is reported beside each (default: "
                         "os.cpu_count() and 1)")
    ap.add_argument("--json", action="store_true", help="print the timings as one JSON object")
    ap.add_argument("--check", action="store_true", help="check the model against jaxdecode, then exit")
    ap.add_argument("--reference", type=Path, help="jaxdecode's reference (JSON) for --check")
    ap.add_argument("--jaxdecode-python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--serve", action="store_true", help="answer commands on stdin (see the module doc)")
    args = ap.parse_args()

    torch.set_num_threads(os.cpu_count())
    model, chars = load(args.ckpt)
    if args.serve:
        serve(model, chars, args.n)
        return
    if args.check:
        reference = (json.loads(args.reference.read_text(encoding="utf-8")) if args.reference
                     else jaxdecode_reference(args.n, args.ckpt, args.jaxdecode_python))
        result = check(model, chars, reference, args.atol)
        print(json.dumps(result, indent=2) if args.json else describe_check(result))
        sys.exit(0 if result["ok"] else 1)

    ids = encode(chars, PROMPT)
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    threads = H.thread_counts(args.threads)

    def timer(mode, B):
        def run(th):
            torch.set_num_threads(th)
            return time_once(model, ids, B, args.n, mode)
        return run

    rows = []
    for mode in modes:
        for B in batches:
            best = H.best_threads(timer(mode, B), threads, repeats=args.rounds)
            rows.append({"mode": mode, "batch": B, "threads": best["threads"], "seconds": best["seconds"],
                         "chars_per_s": B * args.n / best["seconds"],
                         "seconds_by_threads": best["seconds_by_threads"]})
    if args.json:
        print(json.dumps({"environment": environment(), "machine": H.machine(), "n": args.n, "rounds": args.rounds,
                          "prompt": PROMPT, "rows": rows}, indent=2))
    else:
        for r in rows:
            print(f"HF generate {r['mode']:<7} batch {r['batch']:>4}, {r['threads']} thread(s): "
                  f"{r['chars_per_s']:>10,.0f} chars/s")


if __name__ == "__main__":
    main()
