"""The Hugging Face side of ``benchmarks/bench_hf_llama.py``, run by the Hugging Face environment:
one generate per request line "B THREADS" (the first B prompt rows, on THREADS torch threads),
answered with {"seconds", "tokens"}; "quit" ends. argv: folder, prompts JSON file, n. Its first
line describes the environment.
"""
import json
import sys
import time
import torch
import transformers
from transformers import AutoModelForCausalLM
folder, prompts, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = json.load(open(prompts))
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                  "threads": torch.get_num_threads(),
                  "attention": model.config._attn_implementation}), flush=True)
for line in sys.stdin:
    if line.strip() == "quit":
        break
    B, threads = (int(v) for v in line.split())
    torch.set_num_threads(threads)
    x = torch.tensor(rows[:B], dtype=torch.long)
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=3)
        seconds = time.perf_counter() - t
    assert out.shape == (B, x.shape[1] + n), out.shape
    print(json.dumps({"seconds": seconds, "tokens": out[:, x.shape[1]:].tolist()}), flush=True)
