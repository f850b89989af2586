"""GGUF files: ``load("model.gguf")`` against the Hugging Face folder the file was written from.

The files are written here with the gguf package's GGUFWriter from the fixture folders and the
shipped subword model, as llama.cpp's converter writes them (a Llama's q and k rows permuted for
its rotation, byte-level BPE vocabularies with their merges, Q8_0/Q4_0 blocks by the package's
own quantizer); the reference is the folder loaded by the safetensors path.
"""

import itertools
import json
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.decoding.sampling import sample_tokens
from jaxdecode.models import checkpoint
from jaxdecode.models.hf import linear
from jaxdecode.native import kernels

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
BPE = Path(__file__).resolve().parents[2] / "checkpoints" / "shakespeare-bpe"
T = gguf.GGMLQuantizationType
needs_native = pytest.mark.skipif(not kernels.available(), reason="the native CPU layer is not available")
TEXT = "Hello world! It's 2024, and the QUICK brown fox—naïve—jumps over 12345 lazy dogs.\n\n  Tabs\tand spaces."


def _state(folder: Path) -> dict:
    from safetensors.numpy import load_file

    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update({k: np.asarray(v, np.float32) for k, v in load_file(str(f)).items()})
    return state


def _permute(w, heads):  # llama.cpp's converter: rotate-half rows -> interleaved pairs
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def write_gguf(folder: Path, out: Path, qtype=T.F32, arch: str | None = None, types: dict | None = None) -> Path:
    """``folder`` (a Hugging Face Llama, Mistral, Qwen 2 or Qwen 3) as a GGUF file, its matrices in
    ``qtype`` (``types``: a type per GGUF tensor name instead)."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = arch or {"mistral": "llama"}.get(cfg["model_type"], cfg["model_type"])
    tok = json.loads((folder / "tokenizer.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_value_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    if cfg.get("sliding_window") and cfg["model_type"] == "mistral":
        w.add_sliding_window(cfg["sliding_window"])
    if rope.get("rope_type") == "llama3":  # llama.cpp's converter: each frequency's divisor
        hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
        freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
        old, lo, hi = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
        factors = []
        for freq in freqs:
            wavelen = 2 * np.pi / freq
            if wavelen < old / hi:
                factors.append(1.0)
            elif wavelen > old / lo:
                factors.append(rope["factor"])
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
        w.add_tensor("rope_freqs.weight", np.asarray(factors, np.float32))
    vocab = tok["model"]["vocab"]
    tokens = [None] * cfg["vocab_size"]
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    for a in tok["added_tokens"]:
        tokens[a["id"]] = a["content"]
    for i, t in enumerate(tokens):
        if t is None:
            tokens[i] = f"[PAD{i}]"
            special.add(i)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    bos = cfg.get("bos_token_id")
    eos = cfg.get("eos_token_id")
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    post = json.dumps(tok.get("post_processor") or {})
    w.add_add_bos_token(bos is not None and "SpecialToken" in post)
    for name, a in _state(folder).items():
        if name == "lm_head.weight":
            gname = "output.weight"
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            parts = name.split(".")  # model.layers.i.<module...>.weight|bias
            gname = f"blk.{parts[2]}.{NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            a = _permute(a, heads if ".attn_q." in gname else kv)
        want = (types or {}).get(gname, qtype if a.ndim == 2 else T.F32)
        if a.ndim == 2 and want != T.F32 and a.shape[1] % gguf.GGML_QUANT_SIZES[want][0] == 0:
            w.add_tensor(gname, gguf.quants.quantize(a, want), raw_dtype=want)
        else:
            w.add_tensor(gname, a if want == T.F32 or a.ndim == 1 else a.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    cache = {}

    def get(name, qtype=T.F32):
        key = (name, qtype)
        if key not in cache:
            folder = FIXTURES / name if name != "shakespeare-bpe" else BPE
            out = tmp_path_factory.mktemp("gguf") / f"{name}-{qtype.name}.gguf"
            cache[key] = write_gguf(folder, out, qtype)
        return cache[key]

    return get


def _logits(lm, tokens):
    logits, _ = lm.decoder.forward(lm.params, jnp.asarray(tokens, jnp.int32))
    return np.asarray(logits)


TOKENS = [[4, 8, 15, 16, 23, 42, 108, 7, 9, 11, 13, 17, 19, 21, 29, 31, 37, 41]]


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "qwen3", "shakespeare-bpe"])
def test_f32_file_gives_the_folders_logits(written, name):
    folder = FIXTURES / name if name != "shakespeare-bpe" else BPE
    path = written(name)
    lm = checkpoint.load(path, backend="portable")
    ref = checkpoint.load(folder, backend="portable", weights="float32")
    assert lm.meta["format"] == "gguf" and lm.meta["weights"] == "float32"
    assert lm.cfg.model_type == ref.cfg.model_type and lm.cfg.V == ref.cfg.V and lm.cfg.L == ref.cfg.L
    # the Qwen 3 fixture's second layer attends over a window of 8, which GGUF's qwen3 does not record
    tokens = [TOKENS[0][:8]] if name == "qwen3" else TOKENS
    np.testing.assert_allclose(_logits(lm, tokens), _logits(ref, tokens), atol=1e-4, rtol=0)


@pytest.mark.quick
@pytest.mark.parametrize("name", ["qwen2", "mistral", "shakespeare-bpe"])
def test_the_tokenizer_gives_the_folders_ids(written, name):
    folder = FIXTURES / name if name != "shakespeare-bpe" else BPE
    lm = checkpoint.load(written(name), backend="portable")
    ref = checkpoint.load(folder, backend="portable")
    specials = "".join(t.content for t in ref.vocab.tok.get_added_tokens_decoder().values())
    for text in (TEXT, "ROMEO:\nBut soft, what light through yonder window breaks?", "", f"a{specials}b c",
                 "x   \n\n   y  ,  123456789 it'll  they're"):
        np.testing.assert_array_equal(lm.vocab.encode(text), ref.vocab.encode(text))
        np.testing.assert_array_equal(lm.vocab.encode_piece(text), ref.vocab.encode_piece(text))
    ids = ref.vocab.encode(TEXT)
    assert lm.vocab.decode(ids) == ref.vocab.decode(ids)


def test_q4_0_is_kept_as_the_files_nibbles_and_scales(written):
    """Q4_0's weights are int4 with the file's values exactly (not re-rounded), q and k rows put
    back in the decoder's order; the model is near the float32 folder's."""
    path = written("shakespeare-bpe", T.Q4_0)
    lm = checkpoint.load(path, backend="portable")
    assert lm.meta["weights"] == "int4"
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.1.attn_k.weight")
    assert T(t.tensor_type) == T.Q4_0
    file_k = gguf.quants.dequantize(t.data, t.tensor_type)  # [out, in], llama.cpp's row order
    wk = lm.params["layers"][1]["wk"]
    u = np.asarray(wk["q4"]).astype(np.int8) + 8
    kept = linear.dequantize4(u, np.asarray(wk["scale"]))  # [in, out]
    np.testing.assert_array_equal(_permute(kept.T, lm.cfg.kv_heads), file_k)
    f = checkpoint.load(BPE, backend="portable", weights="float32")
    tokens = [list(f.vocab.encode("ROMEO:\nBut soft, what light through yonder window breaks? It is the east."))]
    agree = float((_logits(lm, tokens).argmax(-1) == _logits(f, tokens).argmax(-1)).mean())
    assert agree >= 0.8, agree


LLAMACPP = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"  # tools/make_llamacpp_fixture.py


@pytest.mark.parametrize("backend", ["portable", "native"])
def test_a_file_llama_cpp_made_gives_llama_cpps_tokens(backend):
    """The shipped draft model converted and quantized to Q4_0 by llama.cpp itself: jaxdecode's
    tokenizer gives llama.cpp's ids for a held-out text, and the most probable next token at each
    of its 1,024 positions (teacher-forced, windows of 256) is llama.cpp's wherever llama.cpp's
    top logit leads its second by 0.1 or more (90% of the positions). llama.cpp rounds the
    activations to 8 bits for its products and jaxdecode keeps them in float32, which flips some
    near-ties: 15 positions here (98.5%; 98.6% with every matrix widened to float32)."""
    path = LLAMACPP / "shakespeare-bpe-draft-q4_0.gguf"
    if not path.exists():
        pytest.skip(f"{path.name} is absent (python -m tools.make_llamacpp_fixture writes it)")
    if backend == "native" and not kernels.available():
        pytest.skip("the native CPU layer is not available")
    ref = json.loads(path.with_name("shakespeare-bpe-draft-q4_0.llamacpp.json").read_text())
    lm = checkpoint.load(path, backend=backend)
    assert lm.meta["weights"] == "mixed: int8, int4" and "Q4_0" in lm.meta["gguf_types"]
    assert list(lm.vocab.encode(ref["text"])) == ref["tokens"]
    ours = _logits(lm, ref["windows"]).argmax(-1)
    same = ours == np.asarray(ref["argmax"])
    lead = np.asarray(ref["lead"])
    assert same.mean() >= 0.98 and (lead[~same] < 0.1).all(), (same.mean(), lead[~same])


@needs_native
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.F16], ids=["Q4_0", "Q8_0", "F16"])
def test_native_reads_the_kept_forms_as_the_portable_path(written, qtype):
    path = written("shakespeare-bpe", qtype)
    native, portable = checkpoint.load(path, backend="native"), checkpoint.load(path, backend="portable")
    want = {T.Q4_0: "int4", T.Q8_0: "int8", T.F16: "float16"}[qtype]
    assert native.meta["weights"] == want
    layer = native.params["layers"][0]
    assert layer["qkv"]["packed"].dtype == {"int4": jnp.uint8, "int8": jnp.int8, "float16": jnp.float16}[want]
    np.testing.assert_allclose(_logits(native, TOKENS), _logits(portable, TOKENS), atol=2e-4, rtol=0)
    prompt = jnp.asarray([list(native.vocab.encode("ROMEO:\nWhat light"))], jnp.int32)
    ids = [np.asarray(sample_tokens(m.decoder, m.params, prompt, 16, jax.random.PRNGKey(0), greedy=True).tokens)
           for m in (native, portable)]
    np.testing.assert_array_equal(ids[0], ids[1])


def test_q8_0_is_close_to_the_folder(written):
    lm = checkpoint.load(written("qwen2", T.Q8_0), backend="portable")
    assert lm.meta["weights"] == "int8"
    f = _logits(checkpoint.load(FIXTURES / "qwen2", backend="portable", weights="float32"), TOKENS)
    rel = float(np.sqrt(np.mean((_logits(lm, TOKENS) - f) ** 2) / np.mean((f - f.mean()) ** 2)))
    assert 0 < rel < 0.05, rel


def test_k_quants_convert_to_the_nearest_kept_form(tmp_path):
    """A Q6_K and a Q4_K matrix (blocks of 256 written by hand: gguf has no K-quantizer) become
    int8 and int4, each within its rounding of the file's values."""
    rng = np.random.default_rng(0)
    path = write_gguf(BPE, tmp_path / "k.gguf", T.F32)
    src = gguf.GGUFReader(str(path))
    out = tmp_path / "kq.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    for field in src.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    blocks = {}
    for t in src.tensors:
        a = np.asarray(t.data)
        qt = {"blk.0.ffn_down.weight": T.Q6_K, "blk.1.ffn_down.weight": T.Q4_K}.get(t.name)
        if qt is None:
            w.add_tensor(t.name, a)
            continue
        rows, cols = a.shape
        size = gguf.GGML_QUANT_SIZES[qt][1]
        raw = rng.integers(0, 256, (rows, cols // 256 * size), dtype=np.uint8)
        scale = np.full(rows * (cols // 256), 2e-4, np.float16).view(np.uint8).reshape(rows, cols // 256, 2)
        raw = raw.reshape(rows, cols // 256, size)
        if qt == T.Q6_K:
            raw[:, :, -2:] = scale  # d last
        else:
            raw[:, :, 0:2] = scale  # d, then dmin
            raw[:, :, 2:4] = scale
        blocks[t.name] = (raw.reshape(rows, -1), qt)
        w.add_tensor(t.name, raw.reshape(rows, -1), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    lm = checkpoint.load(out, backend="portable")
    assert set(lm.meta["gguf_types"]) == {"F32", "Q6_K", "Q4_K"} and lm.meta["weights"].startswith("mixed")
    for i, (name, kind) in enumerate((("blk.0.ffn_down.weight", "int8"), ("blk.1.ffn_down.weight", "int4"))):
        data, qt = blocks[name]
        want = gguf.quants.dequantize(data, qt).T  # [in, out]
        kept = lm.params["layers"][i]["w_down"]
        if kind == "int8":
            got, step = np.asarray(kept["q"], np.float32) * np.asarray(kept["scale"]), np.asarray(kept["scale"])
        else:
            u = np.asarray(kept["q4"]).astype(np.int8) + 8
            got = linear.dequantize4(u, np.asarray(kept["scale"]))
            step = np.repeat(np.abs(np.asarray(kept["scale"], np.float32)), 32, axis=0)
        assert np.abs(got - want).max() > 0  # re-rounded
        assert (np.abs(got - want) <= step * 1.01 + 1e-6).all()  # a step at most where +8 steps clips to +7


@pytest.mark.quick
def test_refusals_are_one_line(tmp_path, written):
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(checkpoint.CheckpointError, match="GGUF architecture 'bert' is not supported"):
        checkpoint.load(tmp_path / "bert.gguf")
    bad = write_gguf(FIXTURES / "qwen2", tmp_path / "iq.gguf", T.F32)
    data = bytearray(bad.read_bytes())
    (tmp_path / "cut.gguf").write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(tmp_path / "cut.gguf")
    assert "\n" not in str(e.value) and "cut.gguf" in str(e.value)
    w = gguf.GGUFWriter(str(tmp_path / "i32.gguf"), "qwen2")
    src = gguf.GGUFReader(str(written("qwen2")))
    for field in src.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            vtype = field.types[0]
            w.add_key_value(field.name, field.contents(), vtype,
                            sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in src.tensors:
        a = np.asarray(t.data)
        w.add_tensor(t.name, a.astype(np.int32) if t.name == "blk.0.ffn_up.weight" else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(checkpoint.CheckpointError, match="blk.0.ffn_up.weight has type I32, which is not supported"):
        checkpoint.load(tmp_path / "i32.gguf")
    with pytest.raises(checkpoint.CheckpointError, match="dtype float32"):
        checkpoint.load(written("qwen2"), dtype="bfloat16")


def test_command_line_reads_a_gguf_file(written, capsys):
    """--ckpt model.gguf: the folder's greedy text (F32 file)."""
    from jaxdecode.cli.app import main

    docs = []
    for ckpt in (written("qwen2"), FIXTURES / "qwen2"):
        assert main(["generate", "Hello", "-n", "8", "--greedy", "--ckpt", str(ckpt), "--json"]) == 0
        docs.append(json.loads(capsys.readouterr().out)["outputs"][0])
    assert docs[0]["tokens"] == docs[1]["tokens"] and docs[0]["text"] == docs[1]["text"]


SAMPLE = """First Citizen:
Before we proceed any further, hear me speak.
All: Speak, speak. You are all resolved rather to die than to famish?
Resolved. resolved. First, you know Caius Marcius is chief enemy to the people."""


def _spm_vocab(merges_wanted: int = 80):
    """A SentencePiece-like vocabulary learnt from SAMPLE: pieces and scores (-rank), <0xNN> bytes."""
    text = "\u2581" + SAMPLE.replace(" ", "\u2581")
    words = [list(text)]
    pieces = sorted(set(text))
    made = []
    for _ in range(merges_wanted):
        counts = {}
        for w in words:
            for a, b in itertools.pairwise(w):
                counts[a + "\0" + b] = counts.get(a + "\0" + b, 0) + 1
        if not counts:
            break
        best = max(sorted(counts), key=counts.__getitem__)
        a, b = best.split("\0")
        made.append(a + b)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    types = [2, 3, 3, *([6] * 256)]
    scores = [0.0] * len(tokens)
    for rank, p in enumerate([*made, *pieces]):
        if p not in tokens:
            tokens.append(p)
            types.append(1)
            scores.append(-float(rank))
    return tokens, types, scores


def _spm_reference(text, tokens, types, scores, bos=True):
    """llama.cpp's SentencePiece tokenizer: merge the adjacent pair making the best-scored piece
    (the leftmost of equals) until none is in the vocabulary; unknown pieces as their bytes."""
    vocab = {t: i for i, t in enumerate(tokens)}
    sym = list("\u2581" + text.replace(" ", "\u2581"))
    while True:
        best = None
        for i in range(len(sym) - 1):
            j = vocab.get(sym[i] + sym[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        sym[i:i + 2] = [sym[i] + sym[i + 1]]
    ids = [1] if bos else []
    for s in sym:
        ids += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return ids


def test_a_sentencepiece_vocabulary_tokenizes_as_llama_cpp(tmp_path):
    from jaxdecode.models import gguf as gguf_model

    tokens, types, scores = _spm_vocab()
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = tmp_path / "spm.gguf"
    tok = gguf_model.tokenizer(gguf_model._Meta(gguf.GGUFReader(str(path)), path))
    for text in (SAMPLE, "Speak, speak.", "  two  spaces and\nnewline", "naïve café 中文 ok", "x", "Caius\tMarcius"):
        want = _spm_reference(text, tokens, types, scores)
        assert tok.encode(text).ids == want, text
        assert tok.decode(want, skip_special_tokens=True) == text
