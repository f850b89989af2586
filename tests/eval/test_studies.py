"""The studies: shared output helpers, the registry and the ``study`` command, the truncation
table on the shipped model (the chapter's pattern), the cost study in a small configuration, and
the existing studies' Markdown, figure and deterministic JSON."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.eval import studies
from jaxdecode.io import reports as common


@pytest.fixture(scope="module")
def shipped():
    from jaxdecode.models import checkpoint

    return checkpoint.load()


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """The tiny random model on the default backend (one LanguageModel, not one per backend)."""
    from jaxdecode.models.checkpoint import LanguageModel

    cfg, params, vocab = tiny_model
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={})


def _files_ok(folder, *names):
    for name in names:
        p = folder / name
        assert p.is_file() and p.stat().st_size > 0, p
    assert not [p for p in folder.iterdir() if p.name.startswith(".")], "a temporary file was left behind"


# ----------------------------------------------------------------------------- helpers


@pytest.mark.quick
def test_write_json_is_deterministic_and_clean(tmp_path):
    obj = {"b": np.float32(0.1), "a": [1.0 / 3, np.int64(7), True, None], "nan": math.nan,
           "inf": -math.inf, "arr": np.arange(3), "t": (1, 2), 3: "k"}
    doc = common.write_json(tmp_path / "x.json", obj)
    first = (tmp_path / "x.json").read_bytes()
    assert json.loads(first) == doc
    assert list(doc) == ["b", "a", "nan", "inf", "arr", "t", "3"]  # insertion order kept
    assert doc["b"] == 0.1 and doc["a"] == [0.333333, 7, True, None]
    assert doc["nan"] is None and doc["inf"] is None and doc["arr"] == [0, 1, 2] and doc["t"] == [1, 2]
    common.write_json(tmp_path / "x.json", obj)
    assert (tmp_path / "x.json").read_bytes() == first
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    assert common.round_float(123456789.0) == 123457000.0
    with pytest.raises(TypeError):
        common.clean({"x": object()})


@pytest.mark.quick
def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "a.md"
    common.write_markdown(path, "old")
    fig, axes = common.new_figure()
    axes[0, 0].plot([0, 1], [1, 0])
    common.save_figure(fig, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def broken(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        common._atomic_write(path, broken)
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.md", "f.png"]


@pytest.mark.quick
def test_registry_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown study"):
        studies.load_study("nope")
    monkeypatch.setitem(studies.STUDIES, "ghost", studies.Study("ghost", "no_such_module", "missing"))
    loaded = []
    with pytest.raises(studies.StudyUnavailable, match="not installed"):
        studies.run_command("ghost", lambda: loaded.append(1), str(tmp_path))
    with pytest.raises(ValueError, match="takes no option --prompts"):
        studies.run_command("truncation", lambda: loaded.append(1), str(tmp_path), options={"prompts": 3})
    assert not loaded  # both fail before the model is loaded


def test_cli_reports_a_missing_study(monkeypatch, capsys):
    from jaxdecode.cli.app import main

    monkeypatch.setitem(studies.STUDIES, "ghost", studies.Study("ghost", "no_such_module", "missing"))
    assert main(["study", "ghost"]) == 2
    assert "the ghost study is not installed" in capsys.readouterr().err


@pytest.mark.quick
def test_every_study_module_has_run():
    import inspect

    for name in studies.STUDIES:
        try:
            mod = studies.load_study(name)
        except studies.StudyUnavailable:
            continue
        params = inspect.signature(mod.run).parameters
        assert {"seed", "data_path", "progress"} <= set(params), name
        assert params["seed"].default == 0, name


# ----------------------------------------------------------------------------- truncation


def test_truncation_shows_the_chapters_pattern(shipped, tmp_path):
    from jaxdecode.eval.studies import truncation

    res = truncation.run(shipped, tmp_path / "a", progress=False)
    V = len(shipped.vocab)
    start, hither = ({r["rule"]: r for r in ctx["rows"]} for ctx in res["contexts"])
    for rows in (start, hither):
        assert rows["model"]["kept"] == V and rows["temperature 0.5"]["kept"] == V
        assert rows["top-k 5"]["kept"] == 5
        assert all(1 <= r["kept"] <= V and len(r["top"]) == min(5, r["kept"]) for r in rows.values())
        assert rows["model"]["model_mass_kept"] == pytest.approx(1.0)
    # a word start: many letters are plausible; top-p and min-p keep more than top-k
    assert start["top-p 0.9"]["kept"] > 5 and start["min-p 0.1"]["kept"] > 5
    assert start["temperature 0.5"]["entropy_bits"] < start["model"]["entropy_bits"]
    assert start["top-k 5"]["model_mass_kept"] < start["top-p 0.9"]["model_mass_kept"]
    # inside "hither": one letter is nearly certain; they keep fewer than top-k
    assert hither["top-p 0.9"]["kept"] < 5 and hither["min-p 0.1"]["kept"] < 5
    assert hither["model"]["top"][0]["char"] == "e"
    assert hither["model"]["entropy_bits"] < start["model"]["entropy_bits"]

    _files_ok(tmp_path / "a", "truncation.json", "truncation.png", "truncation.md")
    md = (tmp_path / "a" / "truncation.md").read_text()
    assert "top-p 0.9" in md and "(truncation.png)" in md
    assert json.loads((tmp_path / "a" / "truncation.json").read_text())["contexts"] == res["contexts"]
    truncation.run(shipped, tmp_path / "b", progress=False)
    assert (tmp_path / "a" / "truncation.json").read_bytes() == \
        (tmp_path / "b" / "truncation.json").read_bytes()


def test_study_command_truncation(tmp_path, capsys):
    from jaxdecode.cli.app import main

    out = tmp_path / "trunc"
    assert main(["study", "truncation", "--out", str(out), "--seed", "3", "--quiet"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    _files_ok(out, "truncation.json", "truncation.png", "truncation.md")
    assert json.loads((out / "truncation.json").read_text())["seed"] == 3


def test_all_runs_each_study_into_its_folder_and_skips_missing_ones(shipped, tmp_path, monkeypatch, capsys):
    registry = {"truncation": studies.STUDIES["truncation"],
                "ghost": studies.Study("ghost", "no_such_module", "missing")}
    monkeypatch.setattr(studies, "STUDIES", registry)
    said = []
    # -n is a beam-curse option: with all, the studies that do not take it do not get it
    written = studies.run_command("all", shipped, str(tmp_path), progress=False, options={"n": 3},
                                  echo=said.append)
    assert written == [tmp_path / "truncation"] and said[0].startswith(f"wrote {tmp_path / 'truncation'}")
    assert "skipping ghost" in capsys.readouterr().err
    _files_ok(tmp_path / "truncation", "truncation.json", "truncation.png", "truncation.md")


@pytest.mark.quick
def test_study_parser_lists_every_study():
    from jaxdecode.cli.app import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["study"]
    name = next(a for a in sub._actions if a.dest == "name")
    assert set(name.choices) == set(studies.STUDIES) | {"all"}
    assert {"tradeoff", "truncation", "cost"} <= set(name.choices)


# ----------------------------------------------------------------------------- cost


def test_cost_study_small(tiny, tmp_path, monkeypatch):
    """Besides positive timings: every number of the JSON is derived from the times the study
    measured (recorded here by a spy around its timer, which is the real one) as its definition
    says, each timed call did the work its row names (the backend, prompt lengths, batch size
    and number of new tokens, checked on what the loop returned), and cost.json is the result."""
    from jaxdecode.native import kernels
    from jaxdecode.eval.studies import cost

    timed = []  # per timer call: (best time, [(backend, rows, prompt lengths, n, greedy, counts)])
    work = []

    def spy_timer(fn, repeats=3, budget_s=1.0):
        work.clear()
        t = real_best_time(fn, repeats=repeats, budget_s=budget_s)
        timed.append((t, list(work)))
        return t

    def spy_sample_tokens(model, params, prompts, n, key, *args, **kw):
        res = real_sample_tokens(model, params, prompts, n, key, *args, **kw)
        work.append(("sample", model.backend, len(prompts), [len(p) for p in prompts], n, kw.get("greedy", False),
                     np.asarray(res.counts).tolist()))
        return res

    def spy_prefill(params, tokens, lengths, *, model, capacity):
        work.append(("prefill", model.backend, np.asarray(lengths).tolist()))
        return real_prefill(params, tokens, lengths, model=model, capacity=capacity)

    real_best_time, real_sample_tokens, real_prefill = cost.best_time, cost.sample_tokens, cost.prefill
    monkeypatch.setattr(cost, "best_time", spy_timer)
    monkeypatch.setattr(cost, "sample_tokens", spy_sample_tokens)
    monkeypatch.setattr(cost, "prefill", spy_prefill)
    n, batch_sizes, lengths, lat_batches, P = 4, (1, 2), (4, 8), (1,), 4
    res = cost.run(tiny, tmp_path, n=n, batch_sizes=batch_sizes, prompt_lengths=lengths, latency_batches=lat_batches,
                   throughput_prompt=P, repeats=1, progress=False)
    assert res["deterministic"] is False and "timings" in res["note"]
    want = ["native", "portable"] if kernels.available() else ["portable"]
    assert list(res["backends"]) == want
    for per in res["backends"].values():
        assert [r["batch"] for r in per["throughput"]] == [1, 2]
        assert all(r["chars_per_s"] > 0 for r in per["throughput"])
        assert [r["prompt_length"] for r in per["prefill_vs_decode"]] == [4, 8]
        assert all(r["prefill_ms_per_token"] > 0 for r in per["prefill_vs_decode"])
        assert per["latency"][0]["ttft_ms"] > 0
    assert res["machine"]["cpu_count"] >= 1 and res["machine"]["jax"]

    # every timed call, in the study's order: per backend, prefill then generation per prompt
    # length, sampling per batch size, then one token and n tokens per latency batch
    def only(w, item):  # the calls made inside one timer call (compiling and timed) all did this
        return len(w) >= 2 and all(x == item for x in w)

    def same(x, y):  # the JSON keeps 6 significant digits: within half a unit of the 6th
        return x == pytest.approx(y, rel=5.01e-6, abs=1e-12)

    calls = iter(timed)
    for name in want:
        per = res["backends"][name]
        for row, L in zip(per["prefill_vs_decode"], lengths):
            (t_pre, w_pre), (t_gen, w_gen) = next(calls), next(calls)
            # the compiling call and each timed one did the same work
            assert only(w_pre, ("prefill", name, [L]))
            assert only(w_gen, ("sample", name, 1, [L], n, True, [n]))
            assert same(row["prefill_s"], t_pre) and same(row["generate_s"], t_gen)
            assert same(row["prefill_ms_per_token"], 1e3 * t_pre / L)
            assert same(row["decode_ms_per_token"], 1e3 * max(t_gen - t_pre, 0.0) / n)
        for row, B in zip(per["throughput"], batch_sizes):
            t, w = next(calls)
            assert only(w, ("sample", name, B, [P] * B, n, False, [n] * B))  # B rows of n tokens each
            assert same(row["seconds"], t) and same(row["chars_per_s"], B * n / t)
        for row, B in zip(per["latency"], lat_batches):
            (t1, w1), (tn, wn) = next(calls), next(calls)
            assert only(w1, ("sample", name, B, [P] * B, 1, False, [1] * B))
            assert only(wn, ("sample", name, B, [P] * B, n, False, [n] * B))
            assert row["batch"] == B and row["prompt_length"] == P
            assert same(row["ttft_ms"], 1e3 * t1) and same(row["total_ms"], 1e3 * tn)
            assert same(row["tpot_ms"], 1e3 * max(tn - t1, 0.0) / (n - 1))
    assert next(calls, None) is None  # nothing else was timed

    assert res["settings"] == {"n": n, "batch_sizes": list(batch_sizes), "prompt_lengths": list(lengths),
                               "latency_batches": list(lat_batches), "throughput_prompt": P, "repeats": 1,
                               "budget_s": 1.0}
    assert res["parameters"] == sum(np.size(a) for a in jax.tree_util.tree_leaves(tiny.params)) > 0
    _files_ok(tmp_path, "cost.json", "cost_throughput.png", "cost_tokens.png", "cost.md")
    doc = json.loads((tmp_path / "cost.json").read_text())
    assert doc == {k: v for k, v in res.items() if k != "files"}
    md = (tmp_path / "cost.md").read_text()
    assert "not reproducible" in md
    first = res["backends"][want[0]]["throughput"][1]
    assert f"| 2 | {first['chars_per_s']:,.0f} |" in md  # the table shows the JSON's numbers
    with pytest.raises(ValueError, match="window"):
        cost.run(tiny, tmp_path, n=8, prompt_lengths=(16,), progress=False)


def test_cost_best_time_takes_the_best_timed_call_within_the_budget(monkeypatch):
    """best_time: one untimed (compiling) call, then timed calls until ``repeats`` or until
    they have used ``budget_s``; the least time counts. The clock here is fake."""
    from jaxdecode.eval.studies import cost

    clock = [0.0]
    durations = iter([100.0, 0.5, 0.2, 0.4, 0.1, 0.05])  # the first call compiles: never counted
    monkeypatch.setattr(cost.time, "perf_counter", lambda: clock[0])

    def fn():
        clock[0] += next(durations)

    assert cost.best_time(fn, repeats=10, budget_s=1.0) == pytest.approx(0.2)  # 0.5 + 0.2 + 0.4 >= 1: stop
    assert next(durations) == 0.1  # the calls after the budget ran out were not made
    durations = iter([9.0, 0.3, 0.2, 0.6])
    assert cost.best_time(fn, repeats=2, budget_s=100.0) == pytest.approx(0.2)  # two timed calls
    assert next(durations) == 0.6


# ----------------------------------------------------------------------------- the other studies


def _twice(run, tmp_path, name, **kw):
    first = run(tmp_path / "a", **kw)
    run(tmp_path / "b", **kw)
    assert (tmp_path / "a" / f"{name}.json").read_bytes() == (tmp_path / "b" / f"{name}.json").read_bytes()
    _files_ok(tmp_path / "a", f"{name}.json", f"{name}.png", f"{name}.md")
    return first


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghi"), size=rng.integers(1, 7))) for _ in range(4000)]
    lines = [" ".join(words[i:i + 8]) + "." for i in range(0, len(words), 8)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@functools.partial(jax.jit, static_argnums=1)
def _forward(params, cfg, tokens):
    from jaxdecode.models.charlm import transformer as M

    return M.forward(params, cfg, tokens)


def _book_next_logprobs(lm, ids):
    """log p(. | ids) for ``ids`` of at most T tokens: one forward over the whole text,
    right-padded to T (the causal mask keeps the padding out), read at its last token; float64."""
    x = np.zeros((1, lm.cfg.T), np.int32)
    x[0, :len(ids)] = ids
    z = np.asarray(_forward(lm.params, lm.cfg, jnp.asarray(x)), np.float64)[0, len(ids) - 1]
    return z - (z.max() + np.log(np.exp(z - z.max()).sum()))


def _book_decoders(lm, prompt: str, n: int, k: int, seed: int) -> dict:
    """The chapter's greedy, beam and sampling loops written plainly: a full forward per step, no
    cache, the beam's candidates sorted in Python, the sample drawn from the model's distribution
    with the key of row 0 at step s, fold_in(fold_in(PRNGKey(seed), 0), s). Returns texts."""
    ids = [int(t) for t in lm.vocab.encode(prompt)]
    greedy = list(ids)
    for _ in range(n):
        greedy.append(int(np.argmax(_book_next_logprobs(lm, greedy))))
    beams = [(0.0, list(ids))]
    for _ in range(n):
        cand = []
        for score, seq in beams:
            lp = _book_next_logprobs(lm, seq)
            cand += [(score + lp[i], seq + [int(i)]) for i in np.argsort(-lp, kind="stable")[:k]]
        beams = sorted(cand, key=lambda c: -c[0])[:k]
    sample, key = list(ids), jax.random.PRNGKey(seed)
    for s in range(n):
        lp = jnp.asarray(_book_next_logprobs(lm, sample), jnp.float32)
        sample.append(int(jax.random.categorical(jax.random.fold_in(jax.random.fold_in(key, 0), s), lp)))
    return {name: lm.vocab.decode(seq[len(ids):])
            for name, seq in [("greedy", greedy), (f"beam, k={k}", beams[0][1]), ("sampling", sample)]}


@pytest.mark.quick
def test_decoders_study_files_and_determinism(tiny, tiny_corpus, tmp_path):
    from jaxdecode.eval.studies import decoders

    text = tiny_corpus.read_text()
    prompt = text[100:108]
    res = _twice(lambda out, **kw: decoders.run(tiny, out, **kw), tmp_path, "decoders",
                 data_path=tiny_corpus, n=8, k=2, prompt=prompt, progress=False)
    assert [r["decoder"] for r in res["rows"]] == ["human", "greedy", "beam, k=2", "sampling"]
    assert "| human |" in (tmp_path / "a" / "decoders.md").read_text()
    # every row against the plain loops: its text, and its mean log-probability as the book's
    # score computes it (prompt + 8 characters fit the window T = 16 of the tiny model)
    at = text.index(prompt) + len(prompt)
    want = {"human": text[at:at + 8], **_book_decoders(tiny, prompt, 8, 2, seed=0)}
    for row in res["rows"]:
        assert row["text"] == want[row["decoder"]], row["decoder"]
        ids = [int(t) for t in tiny.vocab.encode(prompt + row["text"])]
        lps = [_book_next_logprobs(tiny, ids[:t])[ids[t]] for t in range(len(prompt), len(ids))]
        assert row["mean_logprob"] == pytest.approx(float(np.mean(lps)), abs=1e-5), row["decoder"]
    # human, greedy and sampling differ, so none of them could pass for another (beam k=2 agrees
    # with greedy on this model and prompt; it is checked against the plain beam all the same)
    assert len({want["human"], want["greedy"], want["sampling"]}) == 3


def _window_next_logprobs(lm, rows):
    """log p(. | row) for rows [N, t] of equal length t >= T: one plain forward over each row's
    last T tokens (the model's window), read at the last position; float64 [N, V]."""
    rows = np.asarray(rows, np.int32)[:, -lm.cfg.T:]
    assert rows.shape[1] == lm.cfg.T
    z = np.asarray(_forward(lm.params, lm.cfg, jnp.asarray(rows)), np.float64)[:, -1]
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _brute_force_continuations(lm, prompt: str, n: int):
    """Every continuation of n characters after ``prompt`` (at least T characters long) with its
    log-probability, level by level: ({text: log-probability}, the greedy text)."""
    ids = [int(t) for t in lm.vocab.encode(prompt)]
    V = lm.cfg.V
    prefixes, lps = np.zeros((1, 0), np.int32), np.zeros(1)
    for _ in range(n):
        ctx = np.concatenate([np.broadcast_to(np.asarray(ids, np.int32), (len(prefixes), len(ids))), prefixes], 1)
        lp = _window_next_logprobs(lm, ctx)  # [N, V]
        lps = (lps[:, None] + lp).reshape(-1)
        prefixes = np.concatenate([np.repeat(prefixes, V, axis=0), np.tile(np.arange(V, dtype=np.int32), len(prefixes))[:, None]], 1)
    greedy = list(ids)
    for _ in range(n):
        greedy.append(int(np.argmax(_window_next_logprobs(lm, [greedy])[0])))
    scores = {lm.vocab.decode(p): float(v) for p, v in zip(prefixes, lps)}
    assert len(scores) == V ** n
    return scores, lm.vocab.decode(np.asarray(greedy[len(ids):], np.int32))


def test_beam_curse_study_files_and_determinism(tiny, tiny_corpus, tmp_path):
    from jaxdecode.eval.studies import beam_curse

    n, ks = 3, (1, 2)
    res = _twice(lambda out, **kw: beam_curse.run(tiny, out, **kw), tmp_path, "beam_curse",
                 data_path=tiny_corpus, n_prompts=2, n=n, ks=ks, progress=False)
    assert len(res["search_seconds"]) == 2
    assert "search_seconds" not in json.dumps(json.loads((tmp_path / "a" / "beam_curse.json").read_text()))
    # against an independent computation: every continuation of n characters scored by a plain
    # forward over the model's window (the prompts are longer than T = 16)
    text = tiny_corpus.read_text()
    held = text[int(0.9 * len(text)):]
    assert res["prompts_total"] == res["prompts_solved"] == 2 and res["ks"] == list(ks) and res["n"] == n
    gaps = {k: [] for k in ks}
    for row in res["prompts"]:
        prompt = row["prompt"]
        # a line start of the held-out part, cut after a space or line break at or past 32 characters
        assert ("\n" + prompt) in held and 32 <= len(prompt) <= 64 and prompt[-1] in " \n"
        scores, greedy = _brute_force_continuations(tiny, prompt, n)
        ranked = sorted(scores.items(), key=lambda kv: -kv[1])
        assert ranked[0][1] - ranked[1][1] > 1e-3  # a unique mode
        assert row["mode"] == ranked[0][0]
        assert row["mode_logprob"] == pytest.approx(ranked[0][1], abs=1e-4)
        for k in ks:
            beam = row["beams"][str(k)]
            assert beam["logprob"] == pytest.approx(scores[beam["text"]], abs=1e-4), (prompt, k)
            assert beam["is_mode"] == (beam["text"] == row["mode"])
            assert beam["gap"] == pytest.approx(ranked[0][1] - scores[beam["text"]], abs=1e-4)
            gaps[k].append(beam["gap"])
        assert row["beams"]["1"]["text"] == greedy  # beam width 1 is greedy decoding
    for k in ks:
        per = res["per_k"][str(k)]
        found = sum(row["beams"][str(k)]["is_mode"] for row in res["prompts"])
        assert per["found_mode"] == found and per["solved"] == 2
        assert per["mode_rate"] == pytest.approx(found / 2)
        assert per["mean_gap"] == pytest.approx(np.mean(gaps[k]), abs=1e-5)
        assert per["max_gap"] == pytest.approx(max(gaps[k]), abs=1e-5)
        assert per["mean_logprob"] == pytest.approx(np.mean([r["beams"][str(k)]["logprob"] for r in res["prompts"]]),
                                                    abs=1e-5)


def test_speculative_study_files_and_determinism(tiny, tiny_corpus, tmp_path):
    from jaxdecode.eval.studies import speculative

    res = _twice(lambda out, **kw: speculative.run(tiny, out, **kw), tmp_path, "speculative",
                 data_path=tiny_corpus, n=6, gammas=(1, 2), samples=2, prompt="abc", progress=False)
    assert res["toy"]["seed"] == 0 and res["sweep"]["seed"] == 1
    # 200,000 draws: 0.01 is 10 standard errors of the acceptance rate sum_i min(p_i, q_i) = 0.75
    # (accepting with min(1, q/p) gives 0.875)
    toy = res["toy"]
    assert abs(toy["acceptance"] - 0.75) < 0.01
    # the output frequencies follow p: chi-square below 16.266, its level-1e-3 value on 3 degrees of
    # freedom (5.4 here, p = 0.14). The acceptance rate cannot see the residual: drawing from p
    # instead of max(p - q, 0) after a rejection gives [.375, .25, .25, .125], noncentrality 12,500,
    # power 1.0
    counts = np.round(np.asarray(toy["frequencies"]) * toy["draws"])
    assert counts.sum() == toy["draws"]
    expected = np.asarray(toy["p"]) / np.sum(toy["p"]) * toy["draws"]
    assert np.sum((counts - expected) ** 2 / expected) < 16.266


@pytest.mark.slow
def test_decoders_study_shows_the_chapters_ordering(shipped, corpus_path, tmp_path):
    """After the KATHARINA prompt: beam search's text is more probable than Shakespeare's line,
    which is more probable than a sample at temperature 1; greedy falls into a loop."""
    from jaxdecode.eval.studies import decoders

    res = decoders.run(shipped, tmp_path, data_path=corpus_path, progress=False)
    lp = {row["decoder"]: row["mean_logprob"] for row in res["rows"]}
    text = {row["decoder"]: row["text"] for row in res["rows"]}
    assert lp["beam, k=5"] > lp["human"] > lp["sampling"]
    assert lp["greedy"] > lp["human"]
    words = text["greedy"].split()
    trigrams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    assert len(set(trigrams)) < len(trigrams)  # a repeated word trigram: the loop
