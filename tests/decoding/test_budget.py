"""Requests of any size and per-prompt seeds: splitting a request by the memory budget never
changes a text, and a prompt's samples do not depend on its position among the prompts."""

import json

import jax
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode.decoding import budget
from jaxdecode import rules
from jaxdecode.decoding import sampling as S
from jaxdecode.decoding.score import score_texts
from jaxdecode.models.checkpoint import LanguageModel

PROMPTS = ["abc", "hig.\nab", "a", "fed cab"]
# one rule and length throughout, so the module compiles few programs
KW = {"rule": rules.chain(rules.top_k(6), rules.repetition_penalty(1.3)), "stop": "."}
N = 12


@pytest.fixture(scope="module")
def lm(tiny_model):
    cfg, params, vocab = tiny_model
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend="portable")


def texts(gens):
    return [g.text for g in gens]


def test_split_request_equals_one_batch(lm):
    whole = jd.generate(lm, PROMPTS, N, seed=5, num_samples=3, **KW)
    parts = jd.generate(lm, PROMPTS, N, seed=5, num_samples=3, max_rows=4, **KW)  # groups cut prompts' samples
    assert texts(parts) == texts(whole)
    assert [g.finish_reason for g in parts] == [g.finish_reason for g in whole]
    assert {g.finish_reason for g in whole} == {"stop", "length"}
    for a, b in zip(parts, whole):
        np.testing.assert_allclose(a.model_logprobs, b.model_logprobs, atol=1e-5)
    # a budget that fits only a few rows splits the same way
    one = budget.row_bytes(lm.decoder, 7, N, 256, lm.cfg.heads)
    tight = jd.generate(lm, PROMPTS, N, seed=5, num_samples=3, memory_budget=4 * one, **KW)
    assert texts(tight) == texts(whole)


def test_split_streams_every_row(lm):
    seen = {}
    jd.generate(lm, PROMPTS, N, seed=2, num_samples=3, max_rows=4,
                on_text=lambda r, t: seen.__setitem__(r, seen.get(r, "") + t), **KW)
    whole = jd.generate(lm, PROMPTS, N, seed=2, num_samples=3, **KW)
    assert [seen[r] for r in range(len(whole))] == texts(whole)


def test_a_prompts_samples_do_not_depend_on_its_position(lm):
    together = jd.generate(lm, PROMPTS, N, seed=7, num_samples=3, **KW)
    for i, p in enumerate(PROMPTS):
        alone = jd.generate(lm, p, N, seed=7, num_samples=3, **KW)
        assert texts(alone) == texts(together[3 * i:3 * i + 3])
    # a prompt added in front changes nothing after it
    shifted = jd.generate(lm, ["ggg"] + PROMPTS, N, seed=7, num_samples=3, **KW)
    assert texts(shifted[3:]) == texts(together)


def test_one_seed_per_prompt(lm):
    seeds = [3, 9, 3, 11]
    mixed = jd.generate(lm, PROMPTS, N, seed=seeds, num_samples=3, **KW)
    for i, (p, s) in enumerate(zip(PROMPTS, seeds)):
        assert texts(mixed[3 * i:3 * i + 3]) == texts(jd.generate(lm, p, N, seed=s, num_samples=3, **KW))
    # and seeds matter: another seed draws another text for some sample
    assert texts(jd.generate(lm, PROMPTS, N, seed=4, num_samples=3, **KW)) != texts(mixed)


def test_per_row_keys_are_the_rows_own(lm):
    """``sample_tokens`` with one key per row equals each row run alone with its key."""
    model, params = lm.decoder, lm.params
    rows = [np.array(lm.vocab.encode(p)) for p in PROMPTS]
    keys = jax.numpy.stack([jax.random.PRNGKey(s) for s in (1, 2, 3, 4)])
    res = S.sample_tokens(model, params, rows, N, keys, row_ids=[0, 0, 0, 0], rule=KW["rule"])
    assert len({tuple(t) for t in res.tokens.tolist()}) > 1
    for i, r in enumerate(rows):
        alone = S.sample_tokens(model, params, [r], N, keys[i], row_ids=[0], rule=KW["rule"])
        assert alone.tokens[0].tolist() == res.tokens[i].tolist()


@pytest.mark.quick
@pytest.mark.parametrize("bad, match", [
    ({"seed": [1, 2]}, "2 seeds for 4 prompts"),
    ({"seed": [1, 2, "x", 4]}, "a seed must be an integer"),
    ({"seed": 1.5}, "a seed must be an integer"),
    ({"max_rows": 0}, "max_rows must be an integer >= 1"),
    ({"max_rows": 2.5}, "max_rows must be an integer >= 1"),
    ({"memory_budget": -5}, "memory budget must be a positive, finite"),
    ({"memory_budget": float("nan")}, "memory budget must be a positive, finite"),
    ({"memory_budget": "12Q"}, "a memory budget must be a positive size such as 2G"),
    ({"memory_budget": [1]}, "memory budget must be a number of bytes or a size"),
])
def test_bad_request_settings(lm, bad, match):
    with pytest.raises(ValueError, match=match):
        jd.generate(lm, PROMPTS, 4, **bad)


@pytest.mark.quick
def test_budget_parsing(monkeypatch):
    assert budget.parse_bytes("2G") == 2 << 30
    assert budget.parse_bytes("500m") == 500 << 20
    assert budget.parse_bytes("1.5KiB") == 1536
    assert budget.parse_bytes("12345") == 12345
    for bad in ("", "0", "-1G", "lots", "2X"):
        with pytest.raises(ValueError, match="positive size"):
            budget.parse_bytes(bad)
    monkeypatch.setenv(budget.ENV, "3M")
    assert budget.default_budget() == 3 << 20
    monkeypatch.setenv(budget.ENV, "three")
    with pytest.raises(ValueError, match=budget.ENV):
        budget.default_budget()


@pytest.mark.quick
def test_rows_per_batch_and_groups():
    assert budget.rows_per_batch(100, budget=1000) == 10
    assert budget.rows_per_batch(100, budget=50) == 1  # never zero rows
    assert budget.rows_per_batch(1, budget=10**12) == budget.MAX_ROWS
    assert budget.rows_per_batch(1, budget=10**12, max_rows=5) == 5
    assert budget.rows_per_batch(1 << 20, budget="8M") == 8  # a size, as on the command line
    for total in (1, 5, 255, 256, 257, 1000, 100_000):
        for size in (1, 3, 256):
            g = budget.groups(total, size)
            assert [i for r in g for i in r] == list(range(total))
            assert max(len(r) for r in g) <= size and len(g) == -(-total // size)


def test_cache_and_row_bytes_against_measured_allocations(lm):
    """``cache_bytes`` (computed from ``eval_shape``) against bytes actually allocated: the leaves
    of the cache that a real prefill returns, to the byte. ``row_bytes`` against the compiler's
    own account of a prefill's memory (``memory_analysis``: temporaries and outputs, per row, the
    difference between 8 and 4 rows): the estimate, safety factor included, must cover it, and be
    at most 4 times it. When this was written: 73,788 measured bytes a row, 135,048 estimated."""
    import jax.numpy as jnp

    d, P, capacity = lm.decoder, 7, 128
    for rows in (1, 3):
        cache = d.prefill_cache(lm.params, jnp.ones((rows, P), jnp.int32), jnp.full((rows,), P, jnp.int32), capacity)
        allocated = sum(a.nbytes for a in jax.tree_util.tree_leaves(cache))
        assert budget.cache_bytes(d, rows, capacity) == allocated, rows

    def peak(rows):
        f = jax.jit(lambda p, t, n: d.prefill(p, t, n, capacity))
        m = f.lower(lm.params, jnp.ones((rows, P), jnp.int32), jnp.full((rows,), P, jnp.int32)).compile()
        m = m.memory_analysis()
        return m.temp_size_in_bytes + m.output_size_in_bytes

    measured = (peak(8) - peak(4)) / 4
    estimate = budget.row_bytes(d, P, N, capacity, lm.cfg.heads)
    assert measured <= estimate <= 4 * measured, (measured, estimate)


@pytest.mark.quick
def test_score_split_equals_one_batch(lm):
    texts_ = ["abc def", "hi", "a" * 40, "ge.\nfa"]  # one past T=16: the window path
    whole = score_texts(lm, texts_)
    split = score_texts(lm, texts_, max_rows=1)
    for a, b in zip(whole, split):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_cli_batches_and_bar(tiny_ckpt, capsys, monkeypatch):
    from jaxdecode.cli import app as cli

    argv = ["generate", "abc", "-n", "12", "--num-samples", "5", "--seed", "3", "--ckpt", tiny_ckpt, "--json"]
    assert cli.main(argv) == 0
    whole = json.loads(capsys.readouterr().out)["outputs"]
    monkeypatch.setattr(cli, "BIG_REQUEST", 10)  # a "large" request: a bar on stderr, JSON alone on stdout
    assert cli.main(argv[:-1] + ["--max-rows", "2", "--memory-budget", "1G", "--json"]) == 0
    out = capsys.readouterr()
    split = json.loads(out.out)["outputs"]
    assert [o["tokens"] for o in split] == [o["tokens"] for o in whole]  # log-probs: to the last bit or so
    assert [o["mean_logprob"] for o in split] == pytest.approx([o["mean_logprob"] for o in whole], abs=1e-5)
    assert "generate" in out.err
    for flag, value, message in [("--max-rows", "0", "expected an integer >= 1, got '0'"),
                                 ("--memory-budget", "lots", "a memory budget must be a positive size")]:
        assert cli.main(argv[:-1] + [flag, value]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- the loops that do not split

def _fits(message: str) -> int:
    import re

    m = re.search(r"over the memory budget of [^:]+: (\d+) [a-z ]+ fit", message)
    assert m, message
    return int(m.group(1))


def _pow2_at_most(x: int) -> int:
    return 1 << (x.bit_length() - 1)


SMALL = "200K"


def _beam(lm, size, budget):
    return jd.beam_generate(lm, ["abc"] * (1 if size <= 12 else size // 4), 6, min(size, 12) if size <= 12 else 4,
                            memory_budget=budget)


def _contrastive(lm, size, budget):
    return jd.contrastive_generate(lm, ["abc"] * max(1, size // 4), 6, k=min(size, 4), alpha=0.5,
                                   memory_budget=budget)


def _speculative(lm, size, budget):
    from jaxdecode import speculative as SP

    return SP.speculative_generate(lm, "abc", 6, draft=SP.PromptLookupDraft(2), num_samples=size,
                                   memory_budget=budget)


def _smc(lm, size, budget):
    from jaxdecode import constraints as C
    from jaxdecode.decoding.smc import smc_generate

    return smc_generate(lm, "a", 4, C.compile_choices(["bad", "cab"], lm.vocab), size, memory_budget=budget)


@pytest.mark.quick_ids('beam')
@pytest.mark.parametrize("run, big", [(_beam, 64), (_contrastive, 64), (_speculative, 256), (_smc, 4096)],
                         ids=["beam", "contrastive", "speculative", "smc"])
def test_loops_refuse_what_does_not_fit_and_run_what_does(lm, run, big):
    """Over the budget: one line that names what fits, before anything runs. The same budget then
    runs a request of that size (rounded down to a power of two where rows are bucketed)."""
    with pytest.raises(budget.MemoryBudgetError) as e:
        run(lm, big, SMALL)
    message = str(e.value)
    assert "\n" not in message and "200.0 KiB" in message
    fit = _fits(message)
    assert 1 <= fit < big
    run(lm, _pow2_at_most(fit), SMALL)  # fits: runs
    with pytest.raises(budget.MemoryBudgetError):
        run(lm, 2 * _pow2_at_most(fit) if run is not _beam else fit + 1, SMALL)


def test_cli_smc_over_the_budget_is_one_line(tiny_ckpt, capsys):
    from jaxdecode.cli import main

    rc = main(["generate", "a", "--ckpt", str(tiny_ckpt), "-n", "4", "--choice", "bad", "--choice", "cab",
               "--smc", "5000", "--memory-budget", "1M"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "5000 particles" in err and "fit" in err, err


def test_default_budget_from_the_device_or_the_host(monkeypatch):
    """Unset: half the accelerator's free memory when it reports a limit, else a quarter of the
    host's physical memory; never below 64 MiB."""
    monkeypatch.delenv(budget.ENV, raising=False)

    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    monkeypatch.setattr(budget.jax, "devices", lambda: [Device({"bytes_limit": 10 << 30, "bytes_in_use": 2 << 30})])
    assert budget.default_budget() == 4 << 30
    monkeypatch.setattr(budget.jax, "devices", lambda: [Device({"bytes_limit": 100 << 20, "bytes_in_use": 90 << 20})])
    assert budget.default_budget() == 64 << 20  # the floor
    monkeypatch.setattr(budget.jax, "devices", lambda: [Device(None)])  # the CPU reports nothing
    import os

    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert budget.default_budget() == max(64 << 20, phys // 4)
