"""llama.cpp's unchanged ``convert_hf_to_gguf.py`` with two workarounds (the docstring of
``benchmarks/bench_llamacpp.py`` says which), run by the torch environment. argv: the converter,
the folder, then the converter's other arguments; the converter's folder and its gguf-py are on
PYTHONPATH.
"""
import importlib.util
import json
import runpy
import sys
from pathlib import Path
converter, folder = sys.argv[1], Path(sys.argv[2])
from conversion.base import TextModel
if importlib.util.find_spec("sentencepiece") is None:
    spm = TextModel._create_vocab_sentencepiece
    def _create_vocab_sentencepiece(self):  # look for tokenizer.model before importing sentencepiece
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
        return spm(self)
    TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
pre = json.loads((folder / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
gpt2_like = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
original = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:  # an unknown pre-tokenizer hash
        if not gpt2_like:
            raise
        print("bench_llamacpp: unknown BPE pre-tokenizer hash; ByteLevel with GPT-2's regex: 'gpt-2'",
              file=sys.stderr)
        return "gpt-2"
TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [converter, *sys.argv[2:]]
runpy.run_path(converter, run_name="__main__")
