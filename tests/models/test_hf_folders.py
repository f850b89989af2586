"""Bad Hugging Face folders: each is refused by ``jaxdecode.load`` with one CheckpointError sentence
that names the file and the problem, and by the command line with one ``jaxdecode: error:`` line
and exit status 2; never a traceback, a hang, or NaN weights that load.

Each case copies a fixture of ``tests/fixtures/hf`` and damages one thing: the safetensors bytes
(truncated, random, a header whose offsets lie), a shard index, a tensor (integer dtype, extra,
missing, wrong shape, NaN or infinite values), the end tokens, the tokenizer, the config.
"""

import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import jaxdecode
from jaxdecode.cli.app import main
from jaxdecode.models.checkpoint import CheckpointError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
INDEX = "model.safetensors.index.json"
UP = "model.layers.0.mlp.up_proj.weight"


# ----------------------------------------------------------------------------- damage


def _json(path: Path, **changes):
    """Set (or, given None, remove) fields of a JSON file."""
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


def _header(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header and its data bytes."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path: Path, header: dict, data: bytes):
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def _shift(path: Path, name: str, by: int):
    """Make the header lie: move one tensor's offsets by ``by`` bytes."""
    header, data = _header(path)
    header[name]["data_offsets"] = [o + by for o in header[name]["data_offsets"]]
    _write(path, header, data)


def _tensors(path: Path, edit):
    """Rewrite a safetensors file with ``edit(dict of arrays)`` (float32 or float16 fixtures)."""
    from safetensors.numpy import load_file, save_file

    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


def _poke(path: Path, name: str, index: int, value: float):
    """Write ``value`` into one element of a tensor in place, whatever its float dtype (bfloat16
    included, which numpy's safetensors writer cannot write)."""
    import ml_dtypes

    header, data = _header(path)
    dtype = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}[header[name]["dtype"]]
    start = header[name]["data_offsets"][0] + index * np.dtype(dtype).itemsize
    data = bytearray(data)
    data[start:start + np.dtype(dtype).itemsize] = np.asarray([value], dtype).tobytes()
    _write(path, header, bytes(data))


def _set(name, fn):
    return lambda s: s.__setitem__(name, fn(s[name]))


def _shard_of(folder: Path, name: str) -> Path:
    return folder / json.loads((folder / INDEX).read_text())["weight_map"][name]


def _nan_at(a, index=(3, 5), value=np.nan):
    a = a.copy()
    a[index] = value
    return a


def _cut(path: Path, n: int):
    path.write_bytes(path.read_bytes()[:n])


def _without(folder: Path, name: str):
    weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    _json(folder / INDEX, weight_map={k: v for k, v in weight_map.items() if k != name})


ST, GEN, CFG, TOK = "model.safetensors", "generation_config.json", "config.json", "tokenizer.json"
SHARD1, SHARD2 = "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"
CASES = {}


def _case(name, fixture, damage, file, pattern):
    """A case: ``damage(folder)`` on a copy of ``fixture``; the message names ``file`` and matches
    ``pattern`` (a regular expression)."""
    CASES[name] = (fixture, damage, file, pattern)


CORRUPT = r"corrupt or truncated safetensors file \("
_case("truncated", "llama", lambda f: _cut(f / ST, 200_000), ST, CORRUPT + "incomplete metadata")
_case("truncated-in-the-header", "llama", lambda f: _cut(f / ST, 100), ST,
      CORRUPT + r"invalid header length\)")
_case("random-bytes", "llama", lambda f: (f / ST).write_bytes(np.random.default_rng(0).bytes(5000)), ST,
      CORRUPT + r"header too large\)")
_case("header-offsets-lie", "llama", lambda f: _shift(f / ST, UP, 4), ST,
      CORRUPT + rf"invalid offset for tensor `{UP}`\)")
_case("header-offsets-past-the-end", "llama", lambda f: _shift(f / ST, UP, 10**6), ST,
      CORRUPT + "invalid offset for tensor")
_case("index-not-json", "qwen2", lambda f: (f / INDEX).write_text("{not json"), INDEX, r"not valid JSON \(")
_case("index-without-weight-map", "qwen2", lambda f: (f / INDEX).write_text('{"metadata": {}}'), INDEX,
      "has no weight_map")
_case("index-names-a-missing-shard", "qwen2", lambda f: _shard_of(f, "model.norm.weight").unlink(), INDEX,
      r"names the shard model-\d+-of-00003.safetensors, which the folder does not have")
_case("index-lists-a-tensor-its-shard-lacks", "qwen2",
      lambda f: _tensors(_shard_of(f, UP), lambda s: s.pop(UP)), INDEX,
      rf"puts tensor '{UP}' in {SHARD2}, which does not hold it")
_case("corrupt-shard", "qwen2", lambda f: _cut(_shard_of(f, UP), 5000), SHARD2, CORRUPT)
_case("integer-dtype", "llama",
      lambda f: _tensors(f / ST, _set("model.norm.weight", lambda a: a.astype(np.int32))), ST,
      "tensor 'model.norm.weight' is stored as I32; expected one of F32, BF16, F16")
_case("unexpected-tensor", "llama",
      lambda f: _tensors(f / ST, lambda s: s.__setitem__("model.extra.weight", np.zeros(3, np.float32))),
      ST, "unexpected tensor 'model.extra.weight' for a llama of this config.json")
_case("missing-tensor", "llama", lambda f: _tensors(f / ST, lambda s: s.pop(UP)), ST,
      f"the weights lack {UP}, which a llama of this config.json needs")
_case("missing-tensor-sharded", "qwen2", lambda f: _without(f, UP), INDEX, f"the weights lack {UP}")
_case("wrong-shape", "llama", lambda f: _tensors(f / ST, _set("model.norm.weight", lambda a: a[:-1])), ST,
      r"tensor 'model.norm.weight' has shape \(63,\), the config implies \(64,\)")
# refused before a table of every layer's tensors is built (a billion layers would take minutes;
# 10**5 keeps this test short should that check go)
_case("more-layers-than-the-weights", "llama", lambda f: _json(f / CFG, num_hidden_layers=10**5), ST,
      "the weights hold 2 layers, but config.json's num_hidden_layers is 100000")
_case("end-token-outside-the-vocabulary", "llama", lambda f: _json(f / GEN, eos_token_id=[2, 448]), GEN,
      r"eos_token_id 448 lies outside the vocabulary: the model has 448 token ids "
      r"\(vocab_size in config.json\)")
_case("end-token-outside-the-vocabulary-in-config", "llama",
      lambda f: ((f / GEN).unlink(), _json(f / CFG, eos_token_id=9999)), CFG,
      "eos_token_id 9999 lies outside the vocabulary")
_case("negative-end-token", "gpt2", lambda f: _json(f / GEN, eos_token_id=-1), GEN,
      "eos_token_id -1 lies outside the vocabulary")
_case("end-token-the-tokenizer-lacks", "llama", lambda f: _json(f / GEN, eos_token_id=420), GEN,
      "eos_token_id 420 is not a token of tokenizer.json, which has 400 tokens")
_case("tokenizer-larger-than-the-embedding", "llama", lambda f: _json(f / CFG, vocab_size=300), TOK,
      r"the tokenizer has 400 tokens, more than the model's 300 \(vocab_size in config.json")
_case("nan-weight", "llama", lambda f: _tensors(f / ST, _set(UP, _nan_at)), ST,
      rf"tensor '{UP}' holds NaN or infinite values \(1 of 8192, the first at index \(3, 5\): nan\)")
FC = "transformer.h.1.mlp.c_fc.weight"
_case("inf-weight-float16", "gpt2",
      lambda f: _tensors(f / ST, _set(FC, lambda a: _nan_at(a, (0, 1), -np.inf))), ST,
      rf"tensor '{FC}' holds NaN or infinite values \(1 of 16384, the first at index \(0, 1\): -inf\)")
_case("nan-weight-bfloat16", "mistral", lambda f: _poke(f / ST, "model.norm.weight", 7, np.nan), ST,
      r"tensor 'model.norm.weight' holds NaN .* index \(7,\): nan")
_case("nan-weight-in-a-shard", "qwen2",
      lambda f: _poke(_shard_of(f, "model.embed_tokens.weight"), "model.embed_tokens.weight", 0, np.nan),
      SHARD1, "tensor 'model.embed_tokens.weight' holds NaN")
_case("config-without-model-type", "llama", lambda f: _json(f / CFG, model_type=None), CFG,
      r"config.json has no model_type \(supported: llama, mistral, qwen2, .*, gpt2; ")
_case("config-not-json", "llama", lambda f: (f / CFG).write_text('{"model_type": "llama",'), CFG,
      r"not valid JSON \(")
_case("config-not-json-sharded", "qwen2", lambda f: (f / CFG).write_text('{"model_type": '), CFG,
      r"not valid JSON \(")
_case("config-field-of-a-wrong-type", "llama", lambda f: _json(f / CFG, rms_norm_eps="small"), CFG,
      "rms_norm_eps must be a positive number, got 'small'")
_case("config-field-of-another-wrong-type", "llama", lambda f: _json(f / CFG, rope_parameters={
    "rope_type": "llama3", "rope_theta": 1e4, "factor": 8, "low_freq_factor": 1, "high_freq_factor": "4",
    "original_max_position_embeddings": 64}), CFG, "llama3 rope scaling needs numbers for high_freq_factor")
_case("no-tokenizer", "llama", lambda f: (f / TOK).unlink(), TOK, "no tokenizer.json")
_case("tokenizer-not-a-tokenizer", "llama", lambda f: (f / TOK).write_text("{}"), TOK,
      "not a tokenizer the tokenizers library can read")
_case("generation-config-not-json", "llama", lambda f: (f / GEN).write_text("{"), GEN, r"not valid JSON \(")


def _damaged(tmp_path: Path, case: str) -> tuple[Path, str, str]:
    fixture, damage, file, pattern = CASES[case]
    folder = tmp_path / case
    shutil.copytree(FIXTURES / fixture, folder)
    damage(folder)
    return folder, file, pattern


@pytest.mark.quick
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_folder_is_refused_in_one_line_naming_the_file(case, tmp_path, capsys):
    folder, file, pattern = _damaged(tmp_path, case)
    with pytest.raises(CheckpointError) as e:
        jaxdecode.load(folder)
    message = str(e.value)
    assert "\n" not in message and "Traceback" not in message
    # the file: its whole path, or for a missing file the folder and the file's name
    named = str(folder / file) in message or (str(folder) in message and file in message)
    assert named, f"the message does not name {file}: {message}"
    assert re.search(pattern, message), message
    # the command line: exactly one line, the same sentence, exit 2
    assert main(["info", "--ckpt", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err == f"jaxdecode: error: {' '.join(message.split())}\n"


def test_weights_beyond_the_range_of_the_chosen_dtype(tmp_path, capsys):
    """A float32 weight that float16 cannot hold would load as an infinity: refused, naming it."""
    folder = tmp_path / "big"
    shutil.copytree(FIXTURES / "llama", folder)
    _tensors(folder / "model.safetensors", _set(UP, lambda a: _nan_at(a, (0, 0), 1e6)))
    beyond = rf"model.safetensors: tensor '{UP}' holds values up to 1e\+06, beyond the range of float16 "
    with pytest.raises(CheckpointError, match=beyond + r"\(load it as float32 or bfloat16\)"):
        jaxdecode.load(folder, dtype="float16")
    jaxdecode.load(folder, dtype="bfloat16")  # bfloat16 holds it
    assert main(["generate", "Hi", "--ckpt", str(folder), "--dtype", "float16", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdecode: error: ") and "float16" in err and len(err.splitlines()) == 1


def test_a_config_field_no_check_foresaw_is_still_one_line(tmp_path, monkeypatch):
    """A field of a type that no check of config.py foresaw (a TypeError deep in the reading) is
    still refused in one line naming config.json."""
    from jaxdecode.models.hf import families

    def unforeseen(cfg, where):
        return None < 1

    monkeypatch.setattr(families, "decoder_config", unforeseen)
    folder = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama", folder)
    with pytest.raises(CheckpointError, match=r"config.json: a field has a value of the wrong type \("):
        jaxdecode.load(folder)


def test_a_character_models_config_keeps_its_own_messages(tmp_path):
    """The no-model_type sentence is for a config that is neither kind: a character model's
    config.json with a field missing still gets the character model's message."""
    folder = tmp_path / "char"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"V": 3, "T": 8, "d": 4, "L": 1, "chars": "abc"}))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="config lacks field 'heads'"):
        jaxdecode.load(folder)


# ----------------------------------------------------------------------------- drafts and prompts


def _draft(tmp_path: Path, kind: str) -> Path:
    """llama-draft with another vocabulary: ``padded`` (512 embedding rows, the same tokenizer) or
    ``swapped`` (the same sizes, two tokens' ids exchanged in tokenizer.json)."""
    folder = tmp_path / f"draft-{kind}"
    shutil.copytree(FIXTURES / "llama-draft", folder)
    if kind == "padded":
        _json(folder / "config.json", vocab_size=512)
        pad = lambda a: np.concatenate([a, np.zeros((512 - a.shape[0], a.shape[1]), a.dtype)])  # noqa: E731
        _tensors(folder / "model.safetensors", lambda s: [s.__setitem__(k, pad(s[k])) for k in
                                                          ("model.embed_tokens.weight", "lm_head.weight")])
    else:
        tok = json.loads((folder / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        vocab["a"], vocab["e"] = vocab["e"], vocab["a"]
        (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder


def _refused_in_one_line(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("jaxdecode: error: ") and len(captured.err.splitlines()) == 1, captured.err
    return captured.err


@pytest.mark.quick
def test_a_draft_with_another_vocabulary_size_is_refused(tmp_path, capsys):
    from jaxdecode.speculative import ModelDraft, speculative_generate

    draft = _draft(tmp_path, "padded")
    target = str(FIXTURES / "llama")
    err = _refused_in_one_line(capsys, ["generate", "Hello", "--ckpt", target, "-n", "4", "--greedy",
                                        "--speculative", str(draft)])
    assert "the draft's vocabulary (512 tokens) is not the model's (448)" in err
    lm = jaxdecode.load(target)
    with pytest.raises(ValueError, match="the draft model has V=512, the target V=448"):
        speculative_generate(lm, "Hello", 4, draft=ModelDraft.from_lm(jaxdecode.load(draft)), greedy=True)


def test_same_vocabulary():
    from jaxdecode.models.checkpoint import same_vocabulary

    llama, gpt2 = jaxdecode.load(FIXTURES / "llama"), jaxdecode.load(FIXTURES / "gpt2")
    assert same_vocabulary(llama.vocab, gpt2.vocab)  # one byte-level vocabulary, other special tokens' use
    char = jaxdecode.load()
    assert same_vocabulary(char.vocab, char.vocab) and not same_vocabulary(char.vocab, llama.vocab)


def test_same_vocabulary_sees_two_tokens_exchanged(tmp_path):
    from jaxdecode.models.checkpoint import same_vocabulary

    swapped = jaxdecode.load(_draft(tmp_path, "swapped"))
    assert not same_vocabulary(swapped.vocab, jaxdecode.load(FIXTURES / "llama").vocab)


# A draft whose tokens are other tokens under the same ids (same sizes) is refused, by the command line
# and by the library.
def test_the_command_line_refuses_a_draft_whose_tokens_differ(tmp_path, capsys):
    draft = _draft(tmp_path, "swapped")
    _refused_in_one_line(capsys, ["generate", "Hello", "--ckpt", str(FIXTURES / "llama"), "-n", "2",
                                  "--greedy", "--speculative", str(draft)])


def test_the_library_refuses_a_draft_whose_tokens_differ(tmp_path):
    from jaxdecode.speculative import ModelDraft, speculative_generate

    lm = jaxdecode.load(FIXTURES / "llama")
    small = jaxdecode.load(_draft(tmp_path, "swapped"))
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(lm, "Hello", 2, draft=ModelDraft.from_lm(small), greedy=True, gamma=2)


@pytest.mark.quick
def test_an_empty_prompt_on_a_hugging_face_model(capsys):
    lm = jaxdecode.load(FIXTURES / "llama")  # its tokenizer adds a BOS: "" still encodes to one token
    for call in (lambda: jaxdecode.generate(lm, "", 4), lambda: jaxdecode.generate(lm, ["Hi", ""], 4),
                 lambda: jaxdecode.beam_generate(lm, "", 4, 2),
                 lambda: jaxdecode.contrastive_generate(lm, "", 4)):
        with pytest.raises(ValueError, match="the prompt is empty"):
            call()
    err = _refused_in_one_line(capsys, ["generate", "", "--ckpt", str(FIXTURES / "llama"), "-n", "4"])
    assert "the prompt is empty" in err


def test_score_takes_one_string_and_refuses_an_empty_one():
    lm = jaxdecode.load()
    one = jaxdecode.score(lm, "let him", prompts="KATHARINA:\n")
    assert len(one) == 1 and one[0].text == "let him"
    with pytest.raises(ValueError, match="the text to score is empty"):
        jaxdecode.score(lm, "")
