"""Whole paths that no other test runs (issue 37, "Whole paths run in no test"), each against an
independent reference on the tiny Hugging Face fixtures:

- the CLI's ``--json-schema`` success path, against ``generate`` with the compiled schema and a
  hand check of the schema;
- the int8 KV cache of the engine (dense and paged) on the Llama, after a warm-up, on the wall
  clock with overlap, against the float cache; and from the CLI (``serve-bench --kv-dtype int8``),
  against the engine's Python API;
- the CLI's ``--dtype bfloat16``, against ``generate`` on ``load(dtype="bfloat16")``;
- the end token in speculative sampling and contrastive search on the Llama;
- Mistral, Qwen2 and GPT-2 beyond logits: seeded sampling equal across ``generate`` and the
  engine, and beam search (k = 2) equal to a plain loop written here;
- the past-window path (prompt + n past the 256 positions), against a plain loop of full forwards
  over the last T tokens;
- ``chunk_step``'s cache on the Llama: no copy of the cache in the compiled step loop.
"""

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode.constraints import compile_json_schema

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
LLAMA = str(FIXTURES / "llama")

_CACHE = {}


def model(name, dtype=None):
    key = (name, dtype)
    if key not in _CACHE:
        _CACHE[key] = jaxdecode.load(FIXTURES / name, **({"dtype": dtype} if dtype else {}))
    return _CACHE[key]


def _cli_json(capsys, argv):
    from jaxdecode.cli.app import main

    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["outputs"][0]


# ----------------------------------------------------------------------------- 1. --json-schema

SCHEMA = {"type": "object", "properties": {"name": {"enum": ["Romeo", "Juliet", "Nurse"]},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _valid(text):
    doc = json.loads(text)
    return (set(doc) == {"name", "age"} and doc["name"] in SCHEMA["properties"]["name"]["enum"]
            and isinstance(doc["age"], int) and not isinstance(doc["age"], bool))


@pytest.mark.quick
def test_cli_json_schema_success_path(capsys, tmp_path):
    """The CLI's ``--json-schema FILE``: its text parses, satisfies the schema (checked by hand) and
    equals ``generate`` under ``compile_json_schema`` with the same seed."""
    lm = model("llama")
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(SCHEMA))
    prompt = "The answer:"
    out = _cli_json(capsys, ["generate", prompt, "--ckpt", LLAMA, "--json-schema", str(f), "-n", "40",
                             "--json", "--seed", "1"])
    assert _valid(out["text"]), out["text"]
    want = jaxdecode.generate(lm, prompt, 40, seed=1, constraint=compile_json_schema(SCHEMA, lm.vocab))[0]
    assert out["text"] == want.text
    assert out["tokens"] == want.tokens.tolist()


# ----------------------------------------------------------------------------- 3. --dtype bfloat16


@pytest.mark.quick
def test_cli_dtype_bfloat16(capsys):
    """``--dtype bfloat16`` runs, and its greedy tokens are ``generate``'s on the model loaded in
    bfloat16 (and the load is really bfloat16)."""
    lm = model("llama", "bfloat16")
    assert any(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(lm.params))
    prompt = "ROMEO:"
    out = _cli_json(capsys, ["generate", prompt, "--ckpt", LLAMA, "--dtype", "bfloat16", "-n", "12",
                             "--greedy", "--json"])
    want = jaxdecode.generate(lm, prompt, 12, greedy=True)[0]
    assert out["tokens"] == want.tokens.tolist()
    assert out["text"] == want.text
    # the greedy tokens of float32 and bfloat16 agree on these fixtures, so the tokens alone cannot
    # tell whether --dtype was applied: the mean log-probability can (bfloat16's differs by ~1e-2)
    assert out["mean_logprob"] == pytest.approx(want.mean_logprob, abs=1e-5)
    f32 = jaxdecode.generate(model("llama"), prompt, 12, greedy=True)[0]
    assert abs(f32.mean_logprob - want.mean_logprob) > 1e-3


# ----------------------------------------------------------------------------- 2. int8 KV cache

INT8_N = 16
INT8_PROMPTS = ["ROMEO:\nWhat light", "The café is", "Good night", "O"]
INT8_SAME_PREFIX = 12  # measured: all 16 greedy tokens of every row agree with the float cache's


@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_int8_kv_cache_on_llama_after_warm_up(cache):
    """The engine's int8 KV cache on the Llama, warmed up, then run with overlap and arrivals
    staggered by engine steps: nothing compiles, every row finishes, and greedy rows agree with the
    float cache's ``generate`` on their first tokens."""
    from jaxdecode.serving.engine import Engine, Request
    from jaxdecode.serving.simulator import StepClock, with_arrivals
    from jaxdecode.serving.warmup import count_compiles

    lm = model("llama")
    reqs = [Request(p, INT8_N, greedy=True) for p in INT8_PROMPTS]
    kw = {"cache": "paged", "num_blocks": 32, "block_size": 8} if cache == "paged" else {}
    engine = Engine(lm, 2, kv_dtype="int8", overlap=True, clock=StepClock(), **kw)
    assert engine.warm_up(reqs) > 0
    stream = with_arrivals(reqs, [float(i) for i in range(len(reqs))])  # staggered by engine steps
    with count_compiles() as counted:
        report = engine.run(stream)
    assert counted[0] == 0
    want = jaxdecode.generate(lm, INT8_PROMPTS, INT8_N, greedy=True)
    agree = []
    for res, w in zip(report.results, want):
        got = res.outputs[0]
        assert got.finish_reason == w.finish_reason  # every row finished, as the float cache's did
        if got.finish_reason == "length":
            assert len(got.tokens) == INT8_N
        t, u = got.tokens.tolist(), w.tokens.tolist()
        k = next((i for i, (a, b) in enumerate(zip(t, u)) if a != b), min(len(t), len(u)))
        agree.append(k)
    assert min(agree) >= INT8_SAME_PREFIX, agree


def test_int8_kv_cache_from_the_cli(capsys, tmp_path, monkeypatch):
    """``serve-bench --kv-dtype int8`` on the Llama folder: the engines it builds store keys and
    values in int8, and every request's text and finish reason is what the Python API gives it
    (``Engine(lm, 2, kv_dtype="int8")`` on the report's requests, rebuilt from their settings)."""
    from jaxdecode import rules
    from jaxdecode.cli.app import main
    from jaxdecode.serving import engine as E

    made = []

    class Recorded(E.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(E, "Engine", Recorded)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("ROMEO:\nWhat light through yonder window breaks? The café is shut.\n\n" * 200)
    argv = ["serve-bench", "--ckpt", LLAMA, "--data", str(corpus), "--kv-dtype", "int8", "--requests", "3",
            "--rate", "50", "--slots", "2", "-n", "8", "--sweep", "2", "--simulate", "--json", "--out", "",
            "--seed", "5", "--quiet"]
    capsys.readouterr()
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert made and all(e.kv_dtype == "int8" for e in made)
    monkeypatch.undo()
    reqs = [E.Request(r["prompt"], r["n"], seed=r["seed"], greedy=r["greedy"], stop=r["stop"],
                      rule=None if r["greedy"] else rules.chain(rules.temperature(r["rule"]["Temperature"]),
                                                                rules.top_p(r["rule"]["TopP"])))
            for r in doc["requests"]]
    assert any(not r.greedy for r in reqs)
    report = E.Engine(model("llama"), 2, kv_dtype="int8").run(reqs)
    want = [(res.outputs[0].text, res.outputs[0].finish_reason) for res in report.results]
    assert [(r["text"], r["finish_reason"]) for r in doc["requests"]] == want


# ----------------------------------------------------------------------------- chunk_step's cache


def _cache_sized_ops(hlo: str, shape: str) -> list[tuple[str, str]]:
    """(opcode, what it computes) of each instruction in the compiled program's while-loop bodies
    (and what they call) that produces an array of ``shape`` other than by passing it along; a
    fusion is named by its called computation's root opcode."""
    comps = {}
    for block in re.split(r"\n(?=\S)", hlo):
        m = re.match(r"(?:ENTRY )?%(\S+) ", block)
        if m:
            comps[m.group(1)] = block
    root = lambda name: re.search(r"ROOT %\S+ = \S+ ([\w\-]+)\(", comps[name]).group(1)
    todo = [name for block in comps.values() for name in re.findall(r"while\(.*?body=%([\w.\-]+)", block)]
    seen, found = set(), []
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name].splitlines()[1:]:
            m = re.match(r"\s*(?:ROOT )?%\S+ = (\S+) ([\w\-]+)\(", line)
            if not m or m.group(2) in ("parameter", "get-tuple-element", "tuple", "bitcast"):
                continue
            if m.group(2) in ("while", "call", "conditional"):  # walked on their own
                todo += re.findall(r"(?:body|to_apply)=%([\w.\-]+)", line)
                todo += re.findall(r"%([\w.\-]+)", line.partition("branch_computations=")[2])
            elif m.group(1).startswith(shape):
                called = re.search(r"calls=%([\w.\-]+)", line)
                found.append((m.group(2), root(called.group(1)) if called else m.group(2)))
    return found


@pytest.mark.parametrize("fuse", [False, True])
def test_no_cache_copy_in_the_step_loop_on_the_llama(fuse):
    """``chunk_step`` on a model other than the reference one (the Llama's decoder, which keeps the
    interface's default: each step extends the loop-carried cache): in the compiled chunk loop of
    ``sample_tokens`` the only instructions that produce a cache-sized array write a step's keys or
    values into the cache in place (a scatter or a dynamic-update-slice, alone or as a fusion's
    root), two per layer; no copy of the cache and nothing else rebuilds it. With each layer as one
    native call (``fuse``), that call writes them, its two cache outputs aliased to its cache
    operands, and nothing else produces a cache-sized array."""
    from jaxdecode.decoding import sampling as S

    lm = model("llama")
    m, B, C = lm.decoder, 4, 256
    if fuse and m.backend != "native":
        pytest.skip("the fused layer is native")
    m = dataclasses.replace(m, fuse=fuse)
    p = m.prepare(lm.params, B)
    batch = S.make_batch([np.array([1, 2, 3])] * B, 10, m.V, m.T)
    logits, cache = S.prefill(p, jnp.asarray(batch.prompt), jnp.asarray(batch.length), model=m, capacity=C)
    state = S.SamplingState(logits, jnp.asarray(batch.recent), jnp.asarray(batch.length), None,
                            jnp.zeros((B,), bool), jnp.zeros((B,), jnp.int32), jnp.int32(0))
    row_ids = jnp.zeros((B,), jnp.uint32)
    hlo = S.cache_chunk.lower(p, state, cache, None, jax.random.PRNGKey(0), row_ids, None, np.int32(10),
                               model=m, chunk=16, greedy=False).compile(
        compiler_options={"xla_cpu_use_fusion_emitters": True}).as_text()
    k = jax.tree_util.tree_leaves(cache)[0]
    assert k.ndim == 4 and k.shape[0] == B and k.shape[2] == C  # [B, KV heads, C, head_dim]
    ops = _cache_sized_ops(hlo, f"f32[{','.join(map(str, k.shape))}]")
    if fuse:
        calls = [line for line in hlo.splitlines() if 'custom_call_target="jaxdecode_hf_layer"' in line]
        assert len(calls) == m.cfg.L and ops == [], ops
        assert all("output_to_operand_aliasing={{1}: (17, {}), {2}: (18, {})}" in c for c in calls), calls[0]
        return
    assert len(ops) == 2 * m.cfg.L, ops
    assert all(what in ("scatter", "dynamic-update-slice") for _, what in ops), ops


# ----------------------------------------------------------------------------- 4. end token


def _eos_ids(name):  # from the fixture's config as transformers wrote it, not from the loader
    e = json.loads((FIXTURES / name / "expected.json").read_text())["eos_token_id"]
    return set(e if isinstance(e, list) else [e])


def _check_eos_row(lm, o):
    eos = _eos_ids("llama")
    assert o.finish_reason == "eos"
    toks = o.tokens.tolist()
    assert toks[-1] in eos and not any(t in eos for t in toks[:-1])
    assert o.text == lm.vocab.decode(toks[:-1])


def test_end_token_in_speculative_sampling():
    """Speculative sampling with the one-layer Llama draft: rows that draw the end token end there
    ("eos", the token last, the text without it); and greedy speculative equals plain greedy
    through the end token."""
    from jaxdecode import speculative

    lm = model("llama")
    draft = speculative.ModelDraft.from_lm(model("llama-draft"))
    outs = speculative.speculative_generate(lm, "ROMEO:", 16, draft=draft, gamma=3, num_samples=16, seed=0)
    ended = [o for o in outs if o.finish_reason == "eos"]
    assert ended, [o.finish_reason for o in outs]
    for o in ended:
        _check_eos_row(lm, o)
    for o in outs:
        if o.finish_reason == "length":
            assert len(o.tokens) == 16 and not any(t in _eos_ids("llama") for t in o.tokens.tolist())
    # greedy through the end token: the fixture's first prompt, whose greedy continuation (from
    # transformers) ends with the end token at its 50th token (no shorter prompt found: decoding a
    # prefix of it and encoding again gives other ids)
    ex = json.loads((FIXTURES / "llama" / "expected.json").read_text())
    prompt = ex["prompts"][0]
    plain = jaxdecode.generate(lm, prompt, 64, greedy=True)[0]
    assert plain.tokens.tolist() == ex["greedy_0"] and plain.finish_reason == "eos"
    spec = speculative.speculative_generate(lm, prompt, 64, draft=draft, gamma=3, greedy=True)[0]
    assert spec.tokens.tolist() == plain.tokens.tolist()
    _check_eos_row(lm, spec)


def test_end_token_in_contrastive_search():
    """Contrastive search (k = 4, alpha = 0.6) on the Llama ends the prompt "O" at the end token
    within 16 tokens; the row is the paper's plain loop (tests/decoding/test_contrastive.py) up to it."""
    from support.contrastive import reference_contrastive

    lm = model("llama")
    o = jaxdecode.contrastive_generate(lm, "O", 16, k=4, alpha=0.6)[0]
    _check_eos_row(lm, o)
    fwd = jax.jit(lm.decoder.forward)

    def full(tokens):
        width = 32
        logits, hidden = fwd(lm.params, jnp.asarray([list(tokens) + [0] * (width - len(tokens))]))
        t = len(tokens)
        return np.asarray(logits[0, :t], np.float64), np.asarray(hidden[0, :t], np.float64)

    want = reference_contrastive(full, lm.vocab.encode("O").tolist(), 16, 4, 0.6)
    end = next(i + 1 for i, t in enumerate(want) if t in _eos_ids("llama"))
    assert o.tokens.tolist() == want[:end]


# ----------------------------------------------------------------------------- 5. other architectures

OTHERS = ("mistral", "qwen2", "gpt2")


@pytest.mark.parametrize("name", OTHERS)
def test_seeded_sampling_equal_in_generate_and_engine(name):
    """A seeded sampled request gives the engine the tokens, text and finish reason of generate."""
    from jaxdecode.serving.engine import Engine, Request

    lm = model(name)
    want = jaxdecode.generate(lm, "The café is", 12, seed=7, num_samples=2)
    got = Engine(lm, 2).run([Request("The café is", 12, seed=7, num_samples=2)]).results[0].outputs
    assert [o.tokens.tolist() for o in got] == [o.tokens.tolist() for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert got[0].tokens.tolist() != got[1].tokens.tolist()  # two different draws


def _plain_beam(lm, eos, prompt, n, k):
    """Beam search as written in a book: every live beam extended by every token, scored by the
    model's full forward (log-softmax, float64), the k best candidates without an end token kept as
    the live beams; every candidate that ends with an end token goes to a pool of the k best
    finished hypotheses, and the search stops
    once no live beam beats the pool's worst (no length penalty: scores only fall). At the end the
    live beams compete with the pool."""
    fwd = jax.jit(lm.decoder.forward)
    ids = lm.vocab.encode(prompt).tolist()
    live, pool = [([], 0.0)], []
    for _ in range(n):
        cands = []
        for toks, s in live:
            seq = ids + toks
            logits, _ = fwd(lm.params, jnp.asarray([seq + [0] * (32 - len(seq))]))
            lp = np.asarray(jax.nn.log_softmax(np.asarray(logits[0, len(seq) - 1], np.float64)))
            cands += [(toks + [v], s + float(lp[v])) for v in range(lp.shape[0])]
        cands.sort(key=lambda c: -c[1])
        live = [c for c in cands if c[0][-1] not in eos][:k]
        pool = sorted(pool + [c for c in cands if c[0][-1] in eos], key=lambda c: -c[1])[:k]
        if not live or (len(pool) == k and max(c[1] for c in live) <= pool[-1][1]):
            break
    return sorted(pool + live, key=lambda c: -c[1])


@pytest.mark.parametrize("name", OTHERS)
def test_beam_search_equals_a_plain_beam(name):
    """Beam search (k = 2, 5 steps) returns the plain loop's two best hypotheses, tokens, text and
    score. On these fixtures the end token wins within three steps (the pool path); the same model
    without end tokens runs all 5 steps on live beams (the book's beam)."""
    import dataclasses

    lm = model(name)
    n, k = 5, 2
    for m, eos in ((lm, _eos_ids(name)), (dataclasses.replace(lm, eos_ids=()), set())):
        want = _plain_beam(m, eos, "ROMEO:", n, k)[:2]
        got = jaxdecode.beam_generate(m, "ROMEO:", n, k, n_best=2)[0]
        assert [h.tokens.tolist() for h in got] == [b[0] for b in want], bool(eos)
        assert [h.text for h in got] == [m.vocab.decode([t for t in b[0] if t not in eos]) for b in want]
        np.testing.assert_allclose([h.score for h in got], [b[1] for b in want], atol=1e-3)
    assert len(want[0][0]) == n  # the live path ran every step


# ----------------------------------------------------------------------------- 6. past the window


@pytest.mark.parametrize("name", ["llama"])
def test_greedy_past_the_model_window(name):
    """A 250-token prompt and 12 greedy tokens go past the fixtures' 256 positions: generate's
    tokens are a plain loop's, each step a full forward over the last T tokens."""
    lm = model(name)
    T = lm.decoder.T
    assert T == 256
    text = "ROMEO:\nWhat light through yonder window breaks? " * 20
    while len(lm.vocab.encode(text)) > 250:
        text = text[:-1]
    ids = lm.vocab.encode(text).tolist()
    assert 240 <= len(ids) <= 250
    n = 12
    assert len(ids) + n > T
    fwd = jax.jit(lm.decoder.forward)
    seq, want = list(ids), []
    for _ in range(n):
        window = seq[-T:]
        logits, _ = fwd(lm.params, jnp.asarray([window + [0] * (T - len(window))]))
        t = int(np.argmax(np.asarray(logits[0, len(window) - 1])))
        want.append(t)
        if t in _eos_ids(name):
            break
        seq.append(t)
    got = jaxdecode.generate(lm, text, n, greedy=True)[0]
    assert got.tokens.tolist() == want
