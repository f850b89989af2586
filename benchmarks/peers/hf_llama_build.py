"""Writes ``benchmarks/bench_hf_llama.py``'s model folder once, run by the Hugging Face
environment (argv: folder, tokenizer.json, shape JSON).
"""
import json
import shutil
import sys
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
folder, tokenizer, shape = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.manual_seed(0)
config = LlamaConfig(**shape)
model = LlamaForCausalLM(config).to(torch.float32).eval()  # transformers' init: std 0.02
model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3)
model.save_pretrained(folder)
shutil.copy(tokenizer, folder + "/tokenizer.json")
print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))
