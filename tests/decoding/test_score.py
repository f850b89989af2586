"""Scoring against the chapter's ``score``: a plain loop that, for every position, runs the model's
full forward on the text before it (the forward keeps the last ``T`` tokens, numbered from 0) and
reads the log-softmax of the next token. No cache and no window batching of the library: each
context is its own row of one forward, right-padded to a common width (the causal mask keeps the
padding out of the logits at the context's last position)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode.models.charlm import transformer as M
from jaxdecode.models.checkpoint import LanguageModel
from jaxdecode.decoding.score import Score, token_logprobs
from jaxdecode.io.vocab import Vocab

PROMPT = "KATHARINA:\nMoved! in good time: "
HUMAN = "let him that moved you hither\nRemove you"  # the held-out continuation, 40 characters
ROWS = 64  # the reference's forwards run in batches of this many contexts (one compiled shape)


@functools.partial(jax.jit, static_argnums=1)
def _forward(params, cfg, tokens):
    return M.forward(params, cfg, tokens)


def book_logprobs(params, cfg, ids, start, width=None):
    """log p(ids[t] | ids[:t]) for t = start .. len(ids) - 1, each read at the last position of a
    forward over ids[:t] (its last T tokens, as ``M.forward`` keeps them), in float64."""
    width = cfg.T if width is None else width
    contexts = [list(ids[:t])[-cfg.T:] for t in range(start, len(ids))]
    assert max(len(c) for c in contexts) <= width <= cfg.T
    out = []
    for j in range(0, len(contexts), ROWS):
        part = contexts[j:j + ROWS]
        x = np.zeros((ROWS, width), np.int32)
        for r, c in enumerate(part):
            x[r, :len(c)] = c
        logits = np.asarray(_forward(params, cfg, jnp.asarray(x)), np.float64)
        for r, c in enumerate(part):
            z = logits[r, len(c) - 1]
            m = z.max()
            out.append(z[ids[start + j + r]] - (m + np.log(np.exp(z - m).sum())))
    return np.array(out)


# ----------------------------------------------------------------------------- the shipped model


@pytest.fixture(scope="module")
def shipped():
    from jaxdecode.models import checkpoint

    try:
        return checkpoint.load()
    except checkpoint.CheckpointError as e:
        pytest.skip(str(e))


def test_score_matches_the_book_on_the_shipped_model(shipped):
    assert len(HUMAN) == 40
    s = jaxdecode.score(shipped, [HUMAN], prompts=[PROMPT])[0]
    ids = np.concatenate([shipped.vocab.encode(PROMPT), shipped.vocab.encode(HUMAN)])
    want = book_logprobs(shipped.params, shipped.cfg, ids, len(PROMPT), width=len(ids))
    assert isinstance(s, Score) and s.prompt == PROMPT and s.text == HUMAN and s.in_language is None
    assert s.logprobs.shape == (40,)
    np.testing.assert_allclose(s.logprobs, want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(s.probabilities, np.exp(want), rtol=1e-5, atol=0)
    np.testing.assert_allclose(s.probabilities, np.exp(s.logprobs.astype(np.float64)), rtol=1e-6)
    assert s.mean_logprob == pytest.approx(want.mean(), abs=1e-5)
    # the trained model knows this text: well above a uniform guess over 65 characters
    assert s.mean_logprob > -np.log(65) + 1.5


# ----------------------------------------------------------------------------- past T


@pytest.fixture(scope="module")
def short_window(backend):
    """A random model with a window of only T = 8 (V = 12), far from uniform, on each backend."""
    cfg = M.ModelConfig(V=12, T=8, d=16, L=2, heads=2)
    params = jax.tree_util.tree_map(lambda a: a * 3.0, M.init_params(cfg, jax.random.PRNGKey(5)))
    lm = LanguageModel(params=params, cfg=cfg, vocab=Vocab(" abcdefghi.\n"), meta={}, backend=backend)
    return cfg, params, lm


@pytest.mark.quick_ids('portable')
def test_token_logprobs_past_T_match_the_book(short_window):
    cfg, params, lm = short_window
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, cfg.V, 30), rng.integers(0, cfg.V, 30), rng.integers(0, cfg.V, 9),
            rng.integers(0, cfg.V, 3), rng.integers(0, cfg.V, 17)]
    # from the first possible token; after a 5-token prompt; exactly T + 1 tokens; shorter than T;
    # a start past T + 1 (only window positions are scored)
    starts = [1, 5, 1, 2, 12]
    got = token_logprobs(lm.decoder, params, seqs, starts)
    for s, st, g in zip(seqs, starts, got):
        want = book_logprobs(params, cfg, s.tolist(), st)
        assert g.shape == (len(s) - st,)
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-5)
    # past T the window matters: the same token after its full history and after a history cut
    # to the model's window give the same value, but not after a history cut shorter than T
    s = seqs[0]
    cut = token_logprobs(lm.decoder, params, [s[29 - cfg.T:30]], [cfg.T])[0]
    np.testing.assert_allclose(cut, got[0][-1:], atol=1e-6)
    shorter = token_logprobs(lm.decoder, params, [s[29 - cfg.T + 3:30]], [cfg.T - 3])[0]
    assert abs(shorter[0] - got[0][-1]) > 1e-4


@pytest.mark.quick_ids('portable')
def test_score_texts_with_and_without_a_prompt_past_T(short_window):
    cfg, params, lm = short_window
    text = "bad cab.\nhid a fig each bead\ni"  # 30 characters: past T = 8 with any prompt
    prompts = ["abc ", None]
    for prompt in prompts:
        s = jaxdecode.score(lm, [text], prompts=None if prompt is None else [prompt])[0]
        context = "\n" if prompt is None else prompt  # the default context is a line break
        ids = np.concatenate([lm.vocab.encode(context), lm.vocab.encode(text)])
        want = book_logprobs(params, cfg, ids.tolist(), len(context))
        assert s.prompt == context and len(s.logprobs) == 30
        np.testing.assert_allclose(s.logprobs, want, rtol=0, atol=1e-5)
        np.testing.assert_allclose(s.probabilities, np.exp(want), rtol=1e-5)
        assert s.mean_logprob == pytest.approx(want.mean(), abs=1e-5)
    # an empty prompt is the default context too; several texts of different lengths in one call
    many = jaxdecode.score(lm, [text, "a", text[:12]], prompts=["", "hi", "e"])
    assert many[0].prompt == "\n"
    np.testing.assert_allclose(many[0].logprobs, jaxdecode.score(lm, [text])[0].logprobs, atol=1e-6)
    for s in many[1:]:
        ids = np.concatenate([lm.vocab.encode(s.prompt), lm.vocab.encode(s.text)])
        np.testing.assert_allclose(s.logprobs, book_logprobs(params, cfg, ids.tolist(), len(s.prompt)),
                                   atol=1e-5)


@pytest.mark.quick
def test_score_errors(short_window):
    cfg, params, lm = short_window
    with pytest.raises(ValueError, match="empty"):
        jaxdecode.score(lm, [""])
    with pytest.raises(ValueError, match="2 prompts for 1 texts"):
        jaxdecode.score(lm, ["ab"], prompts=["a", "b"])
    with pytest.raises(ValueError, match=r"scoring starts at index 3; it must lie in \[1, 3\)"):
        token_logprobs(lm.decoder, params, [np.array([1, 2, 3])], [3])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 12\)"):
        token_logprobs(lm.decoder, params, [np.array([1, 12])], [1])
