"""Contrastive search against a plain loop written from the paper (one full forward per
candidate, no cache), on both backends, past T, on the multi-character model and the shipped one."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.compiled import optimized_jit
from support.contrastive import reference_contrastive
from jaxdecode.decoding import contrastive as C
from jaxdecode.decoding.sampling import sample_tokens


def _full_forward(model, params):
    """``f(tokens list) -> (logits [t, V], hidden [t, d])`` of the model's plain forward over the
    last T tokens (positions from 0), right-padded to a power of two of at least 16, at most T
    (causal: right padding is inert; one program per width)."""
    T = model.T
    if hasattr(model, "cfg"):  # the reference CharLM
        from jaxdecode.models.charlm import transformer as M

        fwd = (optimized_jit if model.T >= 256 else jax.jit)(
            lambda toks: M.forward(params, model.cfg, toks, return_hidden=True))
    else:
        fwd = jax.jit(lambda toks: model.forward(params, toks))

    def f(tokens):
        window = list(tokens)[-T:]
        width = 16
        while width < len(window):
            width *= 2
        padded = np.zeros((1, min(width, T)), np.int32)
        padded[0, :len(window)] = window
        logits, hidden = fwd(jnp.asarray(padded))
        return np.asarray(logits[0, :len(window)], np.float64), np.asarray(hidden[0, :len(window)], np.float64)

    return f


@pytest.fixture(scope="module")
def tiny(tiny_model, backend):
    from jaxdecode.models.charlm.decoder import decoder_for

    cfg, params, _ = tiny_model
    return decoder_for(cfg, backend), params


@pytest.mark.quick_ids('native-3-0.3')
@pytest.mark.parametrize("k,alpha", [(4, 0.6), (3, 0.3), (6, 0.9)])
def test_matches_plain_loop_within_and_past_T(tiny, k, alpha):
    """Ragged prompts in one batch; 30 tokens take the shortest prompt (T=16) far past the window."""
    model, params = tiny
    full = _full_forward(model, params)
    prompts = [np.array([1, 2, 3]), np.array([4]), np.array([5, 6, 7, 8, 9, 1, 2])]
    res = C.contrastive_tokens(model, params, prompts, 30, k, alpha, chunk=8)
    assert list(res.counts) == [30, 30, 30]
    for i, p in enumerate(prompts):
        want = reference_contrastive(full, p, 30, k, alpha)
        assert res.tokens[i].tolist() == want, f"prompt {i}"
        # the model's log-probabilities of the chosen tokens
        seq = list(p)
        for j, t in enumerate(want[:5]):
            z = full(seq)[0][-1]
            lp = z[t] - (z.max() + np.log(np.exp(z - z.max()).sum()))
            assert abs(res.model_logprobs[i, j] - lp) < 1e-4
            seq.append(t)
    assert np.all(res.sample_logprobs == 0)


def test_prompt_longer_than_T(tiny):
    model, params = tiny
    full = _full_forward(model, params)
    prompt = np.arange(20) % 11 + 1  # 20 tokens, T = 16
    res = C.contrastive_tokens(model, params, [prompt], 10, 4, 0.6)
    assert res.tokens[0].tolist() == reference_contrastive(full, prompt, 10, 4, 0.6)


# native only: the portable loop is checked by test_matches_plain_loop_within_and_past_T
@pytest.mark.quick_ids('native')
@pytest.mark.parametrize("backend", ["native"], scope="session")
def test_alpha_zero_and_k_one_are_greedy(tiny, key):
    model, params = tiny
    prompts = [np.array([1, 2, 3]), np.array([7, 7])]
    greedy = sample_tokens(model, params, prompts, 12, key, greedy=True).tokens
    assert np.array_equal(C.contrastive_tokens(model, params, prompts, 12, 5, 0.0).tokens, greedy)
    assert np.array_equal(C.contrastive_tokens(model, params, prompts, 12, 1, 0.7).tokens, greedy)


def test_batch_invariance_and_per_row_alpha(tiny):
    """A prompt's output does not depend on its batch; each row may carry its own alpha."""
    model, params = tiny
    prompts = [np.array([1, 2]), np.array([3, 4, 5, 6]), np.array([8])]
    alphas = [0.2, 0.6, 0.9]
    together = C.contrastive_tokens(model, params, prompts, 14, 4, alphas)
    for i, (p, a) in enumerate(zip(prompts, alphas)):
        alone = C.contrastive_tokens(model, params, [p], 14, 4, a)
        assert together.tokens[i].tolist() == alone.tokens[0].tolist()
    # alpha matters on this model (otherwise the per-row check above would be vacuous)
    assert (C.contrastive_tokens(model, params, [prompts[1]], 14, 4, 0.0).tokens.tolist()
            != C.contrastive_tokens(model, params, [prompts[1]], 14, 4, 0.9).tokens.tolist())


def test_no_new_compile_per_prompt_length_or_alpha(tiny):
    model, params = tiny
    C.contrastive_tokens(model, params, [np.array([1, 2]), np.array([3])], 8, 3, 0.5)
    sizes = lambda: (C._cache_chunk._cache_size(), C._start._cache_size())
    before = sizes()
    C.contrastive_tokens(model, params, [np.array([1, 2, 3, 4, 5])], 8, 3, 0.1)  # a new batch bucket: at most one program
    after_one = sizes()
    C.contrastive_tokens(model, params, [np.array([1, 2, 3, 4, 5, 6]), np.array([2])], 8, 3, [0.3, 0.9])
    C.contrastive_tokens(model, params, [np.array([6, 2, 3]), np.array([1, 1, 1, 1])], 8, 3, [0.2, 0.8])
    C.contrastive_tokens(model, params, [np.array([4, 4, 4])], 8, 3, 0.7)
    assert sizes() == after_one
    assert after_one[0] - before[0] <= 1


@pytest.mark.quick_ids('native')
def test_stop_strings(tiny):
    model, params = tiny
    free = C.contrastive_tokens(model, params, [np.array([1, 2, 3])], 20, 4, 0.6).tokens[0]
    stop = free[5:7]
    res = C.contrastive_tokens(model, params, [np.array([1, 2, 3])], 20, 4, 0.6, stops=[stop])
    assert res.stopped[0]
    first = next(i for i in range(1, len(free)) if free[i - 1:i + 1].tolist() == stop.tolist())
    assert res.counts[0] == first + 1
    assert res.tokens[0, :res.counts[0]].tolist() == free[:first + 1].tolist()


@pytest.mark.quick
@pytest.mark.parametrize("bad,msg", [({"k": 0}, "k must be"), ({"k": 13}, "exceeds the vocabulary"),
                                     ({"alpha": 1.5}, "alpha must lie"), ({"alpha": [0.1, 0.2]}, "one per prompt")])
def test_bad_settings(tiny, bad, msg):
    model, params = tiny
    settings = {"k": 4, "alpha": 0.5, **bad}
    with pytest.raises(ValueError, match=msg):
        C.contrastive_tokens(model, params, [np.array([1])], 5, **settings)


def test_multichar_model_matches_plain_loop():
    from jaxdecode.models.toy import multichar_lm

    lm = multichar_lm(T=24)
    full = _full_forward(lm.decoder, lm.params)
    prompts = ["the cat and", "a dog"]
    gens = C.contrastive_generate(lm, prompts, 30, k=4, alpha=0.6)
    for g, p in zip(gens, prompts):
        want = reference_contrastive(full, lm.vocab.encode(p), 30, 4, 0.6)
        assert g.tokens.tolist() == want
        assert g.text == lm.vocab.decode(np.array(want))


@pytest.mark.slow
def test_shipped_model_matches_plain_loop_and_repeats_less_than_greedy():
    """The native backend (the tiny-model tests above compare both backends with the plain loop)."""
    from jaxdecode.models import checkpoint
    from jaxdecode.decoding.sampling import generate

    try:
        lm = checkpoint.load(backend="native")
    except checkpoint.CheckpointError as e:
        pytest.skip(str(e))
    prompt = "KATHARINA:\nMoved! in good time: "
    g = C.contrastive_generate(lm, [prompt, "ROMEO:\n"], 40, k=4, alpha=0.6)
    full = _full_forward(lm.decoder, lm.params)
    assert g[0].tokens.tolist() == reference_contrastive(full, lm.vocab.encode(prompt), 40, 4, 0.6)
    assert g[0].text == C.contrastive_generate(lm, prompt, 40, k=4, alpha=0.6)[0].text
    # greedy after this prompt loops ("the state of the state"); contrastive search does not
    greedy = generate(lm, prompt, 200, greedy=True)[0]
    cs = C.contrastive_generate(lm, prompt, 200, k=4, alpha=0.6)[0]

    def repeated_trigrams(text):
        w = text.split()
        grams = [tuple(w[i:i + 3]) for i in range(len(w) - 2)]
        return sum(g in grams[:i] for i, g in enumerate(grams)) / max(len(grams), 1)

    assert repeated_trigrams(cs.text) < repeated_trigrams(greedy.text)
    assert cs.mean_logprob < greedy.mean_logprob


# ----------------------------------------------------------------------------- the command line


def test_cli_contrastive(tiny_ckpt, tiny_model, capsys):
    import json

    from jaxdecode.models import checkpoint
    from jaxdecode.cli.app import main

    assert main(["generate", "abc", "-n", "15", "--contrastive", "4,0.6", "--ckpt", tiny_ckpt, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    lm = checkpoint.load(tiny_ckpt)
    want = C.contrastive_generate(lm, "abc", 15, k=4, alpha=0.6)[0]
    assert doc["outputs"][0]["text"] == want.text and len(want.text) == 15
    assert doc["settings"]["contrastive"] == {"k": 4, "alpha": 0.6}
    assert main(["generate", "abc", "-n", "15", "--contrastive", "4,0.6", "--ckpt", tiny_ckpt]) == 0
    assert capsys.readouterr().out == "abc" + want.text + "\n"


@pytest.mark.quick
@pytest.mark.parametrize("argv,message", [
    (["--contrastive", "4"], "expected K,ALPHA"),
    (["--contrastive", "4,2"], "alpha must lie in [0, 1]"),
    (["--contrastive", "0,0.5"], "k must be an integer >= 1"),
    (["--contrastive", "4,0.5", "--top-p", "0.9"], "does not combine with --top-p"),
    (["--contrastive", "4,0.5", "--beam", "3"], "does not combine with --beam"),
])
def test_cli_contrastive_bad_input(tiny_ckpt, capsys, argv, message):
    from jaxdecode.cli.app import main

    try:
        code = main(["generate", "abc", "-n", "5", "--ckpt", tiny_ckpt, *argv])
    except SystemExit as e:  # argparse's own type errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
