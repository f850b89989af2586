"""llama.cpp's quantizer (what the llama-quantize tool calls), run by the llama-cpp-python
environment: argv: the input GGUF file (F32), the output file, the type (Q4_0, Q4_K_M, ...),
threads. Prints one JSON line: the type's number and the seconds it took.
"""
import json, sys, time
import llama_cpp as L
src, out, kind, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{kind}")
params = L.llama_model_quantize_default_params()
params.ftype, params.nthread = ftype, threads
L.llama_backend_init()
t = time.perf_counter()
rc = L.llama_model_quantize(src.encode(), out.encode(), params)
if rc != 0:
    raise SystemExit(f"llama_model_quantize returned {rc}")
print(json.dumps({"ftype": ftype, "seconds": time.perf_counter() - t}))
