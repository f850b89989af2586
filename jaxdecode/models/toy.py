"""A second cached model behind the decoding-model interface: a tiny transformer in plain jax.numpy.

:class:`TinyTransformer` is an example of implementing :class:`~jaxdecode.models.base.DecodingModel`
for your own model, and the tests' second model (its cache is laid out unlike the reference
model's, so the loops are checked to see it only through the interface). It is a pre-LayerNorm
GPT-style decoder: token and learned position embeddings, ``L`` blocks of multi-head causal
attention and a GELU MLP, a final LayerNorm and an untied head with a bias. Its weights are random
(:meth:`TinyTransformer.init_params`); nothing here trains it.

Its cache is one array ``kv [L, 2, B, capacity, d]`` (keys and values of every layer, batch on
axis 2) and the rows' lengths. Position ``p`` of row ``b`` holds the keys of that row's token
``p``; a query at position ``q`` attends to positions ``<= q``, so whatever lies at or past a
row's length is never read before it is overwritten: truncating is setting the lengths.

:func:`multichar_lm` wraps it with a :class:`~jaxdecode.io.vocab.TokenVocab` of 1- to 3-character
tokens into a :class:`~jaxdecode.models.checkpoint.LanguageModel`, so the high-level functions
(:func:`jaxdecode.generate`, :func:`jaxdecode.beam_generate`) run on it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.io.vocab import TokenVocab
from jaxdecode.models.base import DecodingModel, added_positions, prefill_by_extend, window_by_forward


class ToyCache(NamedTuple):
    """The cache of :class:`TinyTransformer`."""

    kv: jax.Array  # [L, 2, B, capacity, d] keys (0) and values (1) of every layer
    length: jax.Array  # [B] int32 positions filled per row


def _row(v, ndim):
    """A ``[n]`` vector shaped to broadcast over the last axis of an ``ndim``-d array (the tests
    run with ``jax_numpy_rank_promotion="raise"``)."""
    return v.reshape((1,) * (ndim - 1) + (-1,))


def _layer_norm(x, g, b, eps=1e-5):
    m = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - m), axis=-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(var + eps) * _row(g, x.ndim) + _row(b, x.ndim)


@dataclasses.dataclass(frozen=True)
class TinyTransformer(DecodingModel):
    """A random-weight transformer of vocabulary ``V``, window ``T``, width ``d``, ``L`` layers.

    Frozen and hashable (the loops take it as a static jit argument); the parameters are a separate
    pytree from :meth:`init_params`. :meth:`forward` is the full causal forward without a cache,
    so ``FunctionModel(model.forward, V, T)`` is the same model through the function adapter.
    """

    V: int
    T: int = 64
    d: int = 32
    L: int = 2
    heads: int = 4

    def __post_init__(self):
        for name in ("V", "T", "d", "L", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TinyTransformer: {name} must be a positive integer, got {value!r}")
        if self.d % self.heads:
            raise ValueError(f"TinyTransformer: d={self.d} is not a multiple of heads={self.heads}")

    @property
    def attention_heads(self):
        return self.heads

    # --- parameters
    def init_params(self, key: jax.Array, unigram=None):
        """Random parameters (a dict of float32 arrays). ``unigram`` (``[V]`` positive numbers,
        optional) sets the head's bias to their normalized logarithm, so that sampled text has
        roughly those token frequencies."""
        V, T, d, L = self.V, self.T, self.d, self.L
        # (shape, standard deviation) of every random tensor, drawn as one normal vector
        shapes = {"tok": ((V, d), 1.0), "pos": ((T, d), 0.5), "wqkv": ((L, d, 3 * d), 1.5 / math.sqrt(d)),
                  "wo": ((L, d, d), 1.0 / math.sqrt(d)), "w1": ((L, d, 4 * d), 1.0 / math.sqrt(d)),
                  "w2": ((L, 4 * d, d), 1.0 / math.sqrt(4 * d)), "head": ((d, V), 2.0 / math.sqrt(d))}
        sizes = [math.prod(shape) for shape, _ in shapes.values()]
        flat = np.asarray(jax.random.normal(key, (sum(sizes),), jnp.float32))
        parts = np.split(flat, np.cumsum(sizes)[:-1])
        w = {name: jnp.asarray(std * part.reshape(shape))
             for (name, (shape, std)), part in zip(shapes.items(), parts)}
        bias = np.zeros((V,), np.float32)
        if unigram is not None:
            p = np.asarray(unigram, np.float64)
            if p.shape != (V,) or np.any(p <= 0):
                raise ValueError(f"unigram must hold {V} positive numbers")
            bias = np.log(p / p.sum()).astype(np.float32)
        ones = lambda *shape: jnp.ones(shape, jnp.float32)
        zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
        return {
            "tok": w["tok"], "pos": w["pos"],
            "layers": {  # stacked along a leading layer axis (the layers run as one lax.scan)
                "ln1_g": ones(L, d), "ln1_b": zeros(L, d), "wqkv": w["wqkv"], "bqkv": zeros(L, 3 * d),
                "wo": w["wo"], "bo": zeros(L, d), "ln2_g": ones(L, d), "ln2_b": zeros(L, d),
                "w1": w["w1"], "b1": zeros(L, 4 * d), "w2": w["w2"], "b2": zeros(L, d),
            },
            "lnf_g": ones(d), "lnf_b": zeros(d), "head": w["head"], "bias": jnp.asarray(bias),
        }

    # --- the network
    def _embed(self, params, tokens, pos):
        # positions past T occur only at padding (FunctionModel may run its function over a
        # cache span wider than T); clipped there, and causal attention keeps them out of sight
        return params["tok"][tokens] + params["pos"][jnp.clip(pos, 0, self.T - 1)]

    def _attend(self, q, k, v, mask):
        """q [B, S, d], k/v [B, K, d], mask [B, S, K] (True: may attend) -> [B, S, d]."""
        B, S, d = q.shape
        K = k.shape[1]
        H, hd = self.heads, d // self.heads
        q = q.reshape(B, S, H, hd)
        k = k.reshape(B, K, H, hd)
        v = v.reshape(B, K, H, hd)
        scores = jnp.einsum("bshe,bkhe->bhsk", q, k) / math.sqrt(hd)
        scores = jnp.where(mask[:, None], scores, -jnp.inf)
        weights = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("bhsk,bkhe->bshe", weights, v).reshape(B, S, d)

    def _qkv(self, p, x):
        h = _layer_norm(x, p["ln1_g"], p["ln1_b"])
        qkv = h @ p["wqkv"] + _row(p["bqkv"], 3)
        return jnp.split(qkv, 3, axis=-1)

    def _finish_block(self, p, x, att):
        x = x + att @ p["wo"] + _row(p["bo"], 3)
        h = _layer_norm(x, p["ln2_g"], p["ln2_b"])
        return x + jax.nn.gelu(h @ p["w1"] + _row(p["b1"], 3)) @ p["w2"] + _row(p["b2"], 3)

    def _head(self, params, x):
        hidden = _layer_norm(x, params["lnf_g"], params["lnf_b"])
        return hidden @ params["head"] + _row(params["bias"], 3), hidden

    def forward(self, params, tokens):
        """The full causal forward: tokens ``[B, t]`` -> ``(logits [B, t, V], hidden [B, t, d])``,
        positions numbered from 0 at the first token (no cache involved)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        B, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t)[None, :], (B, t))
        x = self._embed(params, tokens, pos)
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (B, t, t))

        def block(x, p):
            q, k, v = self._qkv(p, x)
            return self._finish_block(p, x, self._attend(q, k, v, causal)), None

        x, _ = jax.lax.scan(block, x, params["layers"])
        return self._head(params, x)

    def __call__(self, params, tokens):
        return self.forward(params, tokens)

    # --- the decoding-model interface
    def empty_cache(self, batch, capacity):
        kv = jnp.zeros((self.L, 2, batch, capacity, self.d), jnp.float32)
        return ToyCache(kv, jnp.zeros((batch,), jnp.int32))

    def capacity(self, cache):
        return cache.kv.shape[3]

    def extend(self, params, cache, tokens, span=None, in_place=True):
        tokens = jnp.asarray(tokens, jnp.int32)
        B, S = tokens.shape
        C = self.capacity(cache)
        span = C if span is None else min(span, C)
        pos = cache.length[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]  # [B, S]
        x = self._embed(params, tokens, pos)
        mask = jnp.arange(span)[None, None, :] <= pos[:, :, None]  # [B, S, span]
        # cache position c of row b takes new token c - length[b] where that lies in [0, S): a
        # gather and a select (simpler for XLA than a scatter, and positions past C just drop)
        src = jnp.arange(C, dtype=jnp.int32)[None, :] - cache.length[:, None]  # [B, C]
        written = ((src >= 0) & (src < S))[:, :, None]  # [B, C, 1]
        src = jnp.clip(src, 0, S - 1)[:, :, None]

        def block(x, layer):
            p, kv = layer  # kv [2, B, C, d]
            q, k, v = self._qkv(p, x)
            new = jnp.stack([jnp.take_along_axis(k, src, axis=1), jnp.take_along_axis(v, src, axis=1)])
            kv = jnp.where(written[None], new, kv)
            att = self._attend(q, kv[0, :, :span], kv[1, :, :span], mask)
            return self._finish_block(p, x, att), kv

        x, kv = jax.lax.scan(block, x, (params["layers"], cache.kv))
        logits, hidden = self._head(params, x)
        return logits, hidden, ToyCache(kv, cache.length + S)

    def prefill(self, params, tokens, lengths, capacity):
        return prefill_by_extend(self, params, tokens, lengths, capacity)

    def window(self, params, history, lengths):
        return window_by_forward(self.forward, self.T, params, history, lengths)

    def reorder(self, cache, rows, span=None):
        return ToyCache(jnp.take(cache.kv, rows, axis=2), jnp.take(cache.length, rows, axis=0))

    def truncate(self, cache, lengths):
        return cache._replace(length=jnp.asarray(lengths, jnp.int32))

    def grow(self, cache, capacity):
        pad = added_positions(self, cache, capacity)
        if pad == 0:
            return cache
        return cache._replace(kv=jnp.pad(cache.kv, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0))))


# ----------------------------------------------------------------------------- a multi-character model

# 1- to 3-character tokens: space, the letters, a full stop, and some frequent English pieces
MULTICHAR_TOKENS = (
    [" "] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["."]
    + ["th", "he", "in", "er", "an", " a", "the", "ing", "and", " th", "ou", "s "]
)
# rough frequencies (per mille) for the head's bias, so that sampled text looks like token soup
# of English rather than of the alphabet
_FREQ = {" ": 120, "e": 90, "t": 60, "a": 60, "o": 55, "i": 50, "n": 50, "s": 45, "h": 40, "r": 40,
         "d": 30, "l": 30, "u": 20, "c": 20, "m": 18, "w": 16, "f": 16, "g": 14, "y": 14, "p": 13,
         "b": 10, "v": 7, "k": 5, ".": 10, "th": 25, "he": 20, "in": 18, "er": 15, "an": 15, " a": 12,
         "the": 25, "ing": 12, "and": 15, " th": 15, "ou": 10, "s ": 15}


def multichar_lm(seed: int = 0, T: int = 64, d: int = 32, L: int = 2, heads: int = 4):
    """A :class:`~jaxdecode.models.checkpoint.LanguageModel`: a random :class:`TinyTransformer` over a
    :class:`~jaxdecode.io.vocab.TokenVocab` of 40 tokens of 1 to 3 characters (``MULTICHAR_TOKENS``).
    Every text of lowercase letters, spaces and full stops encodes."""
    from jaxdecode.models.lm import LanguageModel

    vocab = TokenVocab(MULTICHAR_TOKENS)
    model = TinyTransformer(V=len(vocab), T=T, d=d, L=L, heads=heads)
    unigram = [_FREQ.get(t, 3) for t in vocab.tokens]
    params = model.init_params(jax.random.PRNGKey(seed), unigram=unigram)
    meta = {"model": "TinyTransformer", "seed": seed, "random_weights": True}
    return LanguageModel(params=params, cfg=None, vocab=vocab, meta=meta, decoder=model)


__all__ = ["MULTICHAR_TOKENS", "TinyTransformer", "ToyCache", "multichar_lm"]
