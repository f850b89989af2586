"""llama.cpp's side of ``benchmarks/bench_llamacpp.py``, run by the llama-cpp-python environment:
loads every GGUF file (argv: a JSON config), prints a line describing itself, then answers one
JSON request per line ("quit" ends):
  {"op": "pp", "arm", "tokens"} -> {"seconds"}
  {"op": "logits", "arm", "tokens"} -> {"logits"} (the last position's, after an empty cache)
  {"op": "gen", "arm", "prompts" [B][P], "n"} -> {"prefill_s", "decode_s", "tokens" [B][n]}
  {"op": "threads", "arm", "threads"} -> {} (the context's threads from now on)
  {"op": "argmax", "arm", "tokens"} -> {"argmax" [S], "gap" [S]} (every position's most probable
    next token after an empty cache, and its logit's lead over the second's)
  {"op": "tokenize", "arm", "text"} -> {"tokens"} (the file's vocabulary, its special tokens added)
"""
import json, sys, time
import numpy as np
import llama_cpp as L
from llama_cpp._logger import set_verbose
set_verbose(False)
cfg = json.loads(sys.argv[1])
KV = {"f32": L.GGML_TYPE_F32, "f16": L.GGML_TYPE_F16}
L.llama_backend_init()
arms, sizes = {}, {}
for name, path in cfg["files"].items():
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp cannot load {path}")
    cp = L.llama_context_default_params()
    cp.n_seq_max = cfg["seqs"]
    cp.n_ctx = cfg["seqs"] * cfg["ctx_per_seq"]
    cp.n_batch = cp.n_ubatch = cfg["n_batch"]
    cp.kv_unified = False
    cp.n_threads = cp.n_threads_batch = cfg["threads"]
    cp.type_k = cp.type_v = KV[cfg["kv"]]
    cp.flash_attn_type = {"auto": -1, "off": 0, "on": 1}[cfg["flash_attn"]]
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit(f"llama.cpp cannot make a context for {path}")
    arms[name] = ctx
    sizes[name] = {"model_size": L.llama_model_size(model), "n_params": L.llama_model_n_params(model),
                   "n_ctx_seq": L.llama_n_ctx_seq(ctx), "n_seq_max": L.llama_n_seq_max(ctx)}
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
batch = L.llama_batch_init(cfg["n_batch"], 0, 1)

def fill(entries):  # (token, position, sequence, logits?) per batch entry
    batch.n_tokens = len(entries)
    for i, (t, p, s, o) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, o
        batch.seq_id[i][0] = s

def decode(ctx):
    rc = L.llama_decode(ctx, batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")

def argmax(ctx, rows):  # the logits of the batch's flagged entries, in order
    return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(rows, n_vocab)).argmax(axis=1).tolist()

print(json.dumps({"llama_cpp": L.__version__, "system_info": L.llama_print_system_info().decode().strip(),
                  "flash_attn_type": cp.flash_attn_type, "n_vocab": n_vocab, "arms": sizes}), flush=True)
for line in sys.stdin:
    if line.strip() == "quit":
        break
    req = json.loads(line)
    ctx = arms[req["arm"]]
    if req["op"] == "tokenize":
        text = req["text"].encode()
        vocab = L.llama_model_get_vocab(L.llama_get_model(ctx))
        buf = (L.llama_token * (len(text) + 16))()
        count = L.llama_tokenize(vocab, text, len(text), buf, len(buf), True, False)
        if count < 0:
            raise RuntimeError(f"llama_tokenize needs {-count} tokens")
        print(json.dumps({"tokens": list(buf[:count])}), flush=True)
        continue
    if req["op"] == "threads":
        L.llama_set_n_threads(ctx, req["threads"], req["threads"])
        print(json.dumps({}), flush=True)
        continue
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    if req["op"] == "argmax":
        toks = req["tokens"]
        fill([(t, i, 0, True) for i, t in enumerate(toks)])
        decode(ctx)
        every = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(toks), n_vocab))
        top2 = np.sort(np.partition(every, -2, axis=1)[:, -2:], axis=1)
        print(json.dumps({"argmax": every.argmax(axis=1).tolist(), "gap": (top2[:, 1] - top2[:, 0]).tolist()}),
              flush=True)
        continue
    if req["op"] in ("pp", "logits"):
        toks = req["tokens"]
        fill([(t, i, 0, i == len(toks) - 1) for i, t in enumerate(toks)])
        t0 = time.perf_counter()
        decode(ctx)
        L.llama_synchronize(ctx)
        seconds = time.perf_counter() - t0
        if req["op"] == "logits":
            last = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(1, n_vocab))[0]
            print(json.dumps({"logits": last.tolist()}), flush=True)
        else:
            print(json.dumps({"seconds": seconds}), flush=True)
        continue
    prompts, n = req["prompts"], req["n"]
    B, P = len(prompts), len(prompts[0])
    fill([(t, i, b, i == P - 1) for b, row in enumerate(prompts) for i, t in enumerate(row)])
    t0 = time.perf_counter()
    decode(ctx)
    nxt = argmax(ctx, B)
    t1 = time.perf_counter()
    out = [[t] for t in nxt]
    for step in range(1, n):
        fill([(nxt[b], P + step - 1, b, True) for b in range(B)])
        decode(ctx)
        nxt = argmax(ctx, B)
        for b in range(B):
            out[b].append(nxt[b])
    t2 = time.perf_counter()
    print(json.dumps({"prefill_s": t1 - t0, "decode_s": t2 - t1, "tokens": out}), flush=True)
L.llama_batch_free(batch)
