"""Greedy and ancestral sampling as ``lax.scan`` loops over a KV cache, for ragged batches.

The loop runs in chunks of up to ``chunk`` steps, each one jitted loop; between chunks the host
receives the new tokens (for streaming) and checks whether every row has stopped. Shapes are
bucketed so that new prompts do not recompile:

- the batch is padded to a power of two (dummy rows, discarded);
- the prompt width to a multiple of 16 (prefill only);
- the KV cache to a multiple of 128 positions. On the CPU backend the native attention kernel
  (:mod:`jaxdecode.kernels`) reads each row only up to its length, so the cache is allocated once
  for the request; elsewhere attention reads the whole cache, so the cache covers the text only up
  to the end of the current chunk and grows, chunk by chunk, as the text does.

Rule settings are traced (see :mod:`jaxdecode.rules`), so one compiled program serves every value.

Randomness: the key of row ``r`` at step ``s`` is ``fold_in(fold_in(key, row_id[r]), s)``, so a
row's sample depends only on the user key, its row id and the step, never on which other prompts
share the batch, on the batch size or on padding.

Past the model window ``T`` the book's model sees a different window at every step; the loop then
switches to the exact window mode (a forward over the last ``T`` tokens of every row per step).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import kernels
from . import model as M

SPAN_BUCKET = 128
PROMPT_BUCKET = 16
DEFAULT_CHUNK = 32
SMALL_BATCH_CHUNK = 64  # up to 4 rows a step is cheap, and each host round trip counts more
WHOLE_CHUNK_MAX = 512  # without streaming or stop strings, up to 4 rows run in one chunk this long


def batch_bucket(b: int) -> int:
    return 1 << max(0, (b - 1).bit_length())


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class SamplingState(NamedTuple):
    """The loop carry (everything but the KV cache)."""

    logits: jax.Array  # [B, V] raw next-token logits of the model
    recent: jax.Array  # [B, T] the last T tokens of each row, left-aligned
    length: jax.Array  # [B] tokens so far (prompt + generated), may exceed T
    rule_state: Any  # the rule chain's state
    done: jax.Array  # [B] bool, row has produced a stop string
    tail: jax.Array  # [B, S] the last S generated tokens (for stop strings), -1 = none yet
    step: jax.Array  # [] int32, steps taken


class StepOutput(NamedTuple):
    token: jax.Array  # [B] int32
    model_logprob: jax.Array  # [B] log-probability under the unmodified model
    sample_logprob: jax.Array  # [B] log-probability under the distribution sampled from
    emitted: jax.Array  # [B] bool, the token is part of the row's output


@dataclasses.dataclass
class Generation:
    """One generated continuation."""

    prompt: str
    text: str
    tokens: np.ndarray  # [n] int32
    model_logprobs: np.ndarray  # [n] float32, unmodified model log-probability of each token
    sample_logprobs: np.ndarray  # [n] float32, under the processed distribution sampled from
    finish_reason: str  # "length" or "stop"

    @property
    def mean_logprob(self) -> float:
        """The model's mean log-probability per generated character (nats)."""
        return float(np.mean(self.model_logprobs)) if len(self.model_logprobs) else float("nan")


# ----------------------------------------------------------------------------- one step


def _choose(logits, rule, rule_state, key, row_ids, step, greedy: bool):
    if rule is None:
        processed, processed_logprobs = logits, lambda x: jax.nn.log_softmax(x, axis=-1)
    else:
        from .rules import processed_logprobs

        processed = rule.apply(logits, rule_state)
    if greedy:
        token = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    else:
        keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, r), step))(row_ids)
        token = jax.vmap(jax.random.categorical)(keys, processed).astype(jnp.int32)
    take = lambda lp: jnp.take_along_axis(lp, token[:, None], axis=-1)[:, 0]
    model_lp = take(jax.nn.log_softmax(logits, axis=-1))
    sample_lp = take(processed_logprobs(processed))
    if rule is not None:
        rule_state = rule.update(rule_state, token)
    return token, model_lp, sample_lp, rule_state


def push_recent(recent, length, token, T):
    """Append ``token`` to each row's last-T buffer (shifting once it is full)."""
    B = recent.shape[0]
    full = length >= T
    shifted = jnp.concatenate([recent[:, 1:], token[:, None]], axis=1)
    written = recent.at[jnp.arange(B), jnp.minimum(length, T - 1)].set(token)
    return jnp.where(full[:, None], shifted, written)


def _stop_hit(tail, stops, stop_lens):
    """[B] bool: the tail ends with one of the stop sequences (right-aligned in ``stops``)."""
    S = stops.shape[1]
    pos = jnp.arange(S)[None, :]  # [1, S]
    relevant = pos >= (S - stop_lens)[:, None]  # [n_stops, S]
    match = (tail[:, None, :] == stops[None]) | ~relevant[None]  # [B, n_stops, S]
    return jnp.any(jnp.all(match, axis=-1) & (stop_lens > 0)[None], axis=-1)


def _advance(st: SamplingState, out, stops, stop_lens, T, push: bool = True):
    """The state's recent window (unchanged when ``push`` is False), stop tail and done flags
    after ``out``'s token."""
    token, _, _, _ = out
    recent = push_recent(st.recent, st.length, token, T) if push else st.recent
    tail = jnp.concatenate([st.tail[:, 1:], token[:, None]], axis=1)
    done = st.done
    if stops is not None:
        done = done | _stop_hit(tail, stops, stop_lens)
    return recent, tail, done


def _empty_outputs(chunk: int, B: int) -> StepOutput:
    z = lambda dtype: jnp.zeros((chunk, B), dtype)
    return StepOutput(z(jnp.int32), z(jnp.float32), z(jnp.float32), z(bool))


@functools.partial(jax.jit, static_argnames=("cfg", "chunk", "greedy"), donate_argnames=("cache",))
def _cache_chunk(params, state: SamplingState, cache: M.KVCache, rule, key, row_ids, stops,
                 stop_lens, step_end, packed=None, *, cfg: M.ModelConfig, chunk: int, greedy: bool):
    """Steps up to ``step_end`` (at most ``chunk``) attending over the cache, which is read-only
    inside the loop (see ``model.chunk_step``); the chunk's keys are then appended to it.

    The loop runs exactly the steps asked for (a dynamic trip count), so a last, partial chunk
    costs no idle steps and needs no program of its own. Outputs past the steps run are zeros
    (``emitted`` False). ``packed``: the weights packed for a step of a few rows (see
    ``model.pack_params``), or None.
    """
    B = state.logits.shape[0]
    steps = jnp.clip(step_end - state.step, 0, chunk)
    # With one native call per layer, that call writes the step's keys and values into the cache
    # in place, and the loop carries the cache. Otherwise they go to a small chunk buffer, merged
    # after the loop (see model.chunk_step).
    in_place = packed is not None and kernels.fuses_rows(B)

    def body(i, carry):
        st, kv, outs = carry
        token, mlp, slp, rule_state = _choose(st.logits, rule, st.rule_state, key, row_ids, st.step, greedy)
        # the recent window is written once after the loop (nothing in it reads the window, and
        # a step that writes it also copies it)
        recent, tail, done = _advance(st, (token, mlp, slp, rule_state), stops, stop_lens, cfg.T, push=False)
        if in_place:
            logits, kv = M.step(params, cfg, kv, token, packed=packed)
        else:
            logits, kv = M.chunk_step(params, cfg, cache, kv, i, token, packed)
        new = SamplingState(logits, recent, st.length + 1, rule_state, done, tail, st.step + 1)
        out = StepOutput(token, mlp, slp, ~st.done)
        outs = jax.tree_util.tree_map(lambda buf, x: buf.at[i].set(x), outs, out)
        return new, kv, outs

    start = state.length
    kv = cache if in_place else M.empty_local(cfg, B, chunk, cache.k[0].dtype)
    state, kv, outs = jax.lax.fori_loop(0, steps, body, (state, kv, _empty_outputs(chunk, B)))
    cache = kv if in_place else M.merge_chunk(cache, kv, steps)
    # every row stays inside the window on this path (the caller switches to the window mode at
    # T), so step i's token goes to position start + i; steps not run point past the end
    at = jnp.where(jnp.arange(chunk)[:, None] < steps, start[None, :] + jnp.arange(chunk)[:, None], cfg.T)
    recent = state.recent.at[jnp.broadcast_to(jnp.arange(B)[None, :], at.shape), at].set(outs.token, mode="drop")
    return state._replace(recent=recent), cache, outs


@functools.partial(jax.jit, static_argnames=("cfg", "chunk", "greedy"))
def _window_chunk(params, state: SamplingState, rule, key, row_ids, stops, stop_lens, step_end, *,
                  cfg: M.ModelConfig, chunk: int, greedy: bool):
    """Steps up to ``step_end`` (at most ``chunk``) of the exact window mode: a forward over each
    row's last T tokens."""
    B = state.logits.shape[0]

    def body(i, carry):
        st, outs = carry
        token, mlp, slp, rule_state = _choose(st.logits, rule, st.rule_state, key, row_ids, st.step, greedy)
        recent, tail, done = _advance(st, (token, mlp, slp, rule_state), stops, stop_lens, cfg.T)
        logits = M.window_logits(params, cfg, recent, st.length + 1)
        new = SamplingState(logits, recent, st.length + 1, rule_state, done, tail, st.step + 1)
        outs = jax.tree_util.tree_map(lambda buf, x: buf.at[i].set(x), outs,
                                      StepOutput(token, mlp, slp, ~st.done))
        return new, outs

    steps = jnp.clip(step_end - state.step, 0, chunk)
    return jax.lax.fori_loop(0, steps, body, (state, _empty_outputs(chunk, B)))


@functools.partial(jax.jit, static_argnames=("cfg", "capacity"))
def _prefill(params, tokens, lengths, packed=None, *, cfg, capacity):
    return M.prefill(params, cfg, tokens, lengths, capacity=capacity, packed=packed)


_grow = jax.jit(M.grow_cache, static_argnames=("capacity",))
@functools.partial(jax.jit, static_argnames=("cfg",))
def _window_start(params, recent, lengths, *, cfg):
    return M.window_logits(params, cfg, recent, lengths)


@functools.partial(jax.jit, static_argnames=("V", "max_new"))
def _rule_init(rule, prompt, lengths, *, V, max_new):
    return rule.init(prompt, lengths, V, max_new)


# ----------------------------------------------------------------------------- driver


@dataclasses.dataclass
class TokenResult:
    tokens: np.ndarray  # [B, n] int32 (garbage where not emitted)
    model_logprobs: np.ndarray  # [B, n]
    sample_logprobs: np.ndarray  # [B, n]
    counts: np.ndarray  # [B] tokens emitted per row
    stopped: np.ndarray  # [B] bool


def pad_rule(rule, B: int, Bb: int):
    """Broadcast every numeric setting of ``rule`` to one value per (bucketed) row."""
    if rule is None:
        return None

    def fix(a):
        a = jnp.asarray(a)
        if a.ndim == 0:
            return jnp.broadcast_to(a, (Bb,))
        if a.shape[0] != B:
            raise ValueError(f"a per-row rule setting has {a.shape[0]} values for {B} rows")
        return jnp.concatenate([a, jnp.broadcast_to(a[:1], (Bb - B,) + a.shape[1:])])

    return jax.tree_util.tree_map(fix, rule)


def encode_stops(stops: Sequence[np.ndarray]):
    if not stops:
        return None, None
    S = round_up(max(len(s) for s in stops), 8)
    n = batch_bucket(len(stops))
    arr = np.full((n, S), -2, np.int32)
    lens = np.zeros((n,), np.int32)
    for i, s in enumerate(stops):
        if len(s) == 0:
            raise ValueError("a stop string must not be empty")
        arr[i, S - len(s):] = s
        lens[i] = len(s)
    return jnp.asarray(arr), jnp.asarray(lens)


def sample_tokens(params, cfg: M.ModelConfig, prompts: Sequence[np.ndarray], n: int, key: jax.Array,
                  rule=None, greedy: bool = False, row_ids: Sequence[int] | None = None,
                  stops: Sequence[np.ndarray] = (), chunk: int | None = None,
                  on_chunk: Callable[[np.ndarray, np.ndarray], None] | None = None) -> TokenResult:
    """Generate ``n`` tokens after each prompt (token arrays of any lengths >= 1).

    ``rule``: a :mod:`jaxdecode.rules` rule (or chain) applied before choosing; ``greedy`` takes
    the argmax of the processed logits instead of sampling. ``row_ids`` (default ``0..B-1``) name
    the rows for the PRNG. ``stops``: token sequences that end a row once generated.
    ``on_chunk(tokens [B, c], emitted [B, c])`` is called after every chunk (for streaming);
    ``chunk`` is the number of steps between host round trips (default 64 up to 4 rows, else 32;
    up to 4 rows with neither ``on_chunk`` nor ``stops``, the request's length rounded up to a
    power of two, at most 512, on the native CPU path).
    """
    B = len(prompts)
    if B == 0:
        raise ValueError("no prompts given")
    if n < 0:
        raise ValueError(f"the number of new tokens must be >= 0, got {n}")
    lens = np.array([len(p) for p in prompts], np.int32)
    if lens.min() < 1:
        raise ValueError("every prompt needs at least one token")
    row_ids = np.arange(B) if row_ids is None else np.asarray(row_ids)
    if row_ids.shape != (B,):
        raise ValueError(f"row_ids must have one id per prompt ({B}), got shape {row_ids.shape}")
    if n == 0:
        e = np.zeros((B, 0), np.int32)
        return TokenResult(e, e.astype(np.float32), e.astype(np.float32), np.zeros(B, np.int32),
                           np.zeros(B, bool))
    T = cfg.T
    if chunk is None:
        chunk = SMALL_BATCH_CHUNK if B <= 4 else DEFAULT_CHUNK
        if B <= 4 and on_chunk is None and not stops and kernels.reads_only_filled():
            # nothing to stream or to check between chunks, and a few rows, where each host round
            # trip costs about half a millisecond: the request in one chunk (a power of two, so
            # one program per size bucket of n)
            chunk = max(chunk, min(batch_bucket(n), WHOLE_CHUNK_MAX))
    chunk = min(chunk, batch_bucket(n))  # short requests get a smaller buffer
    Bb = batch_bucket(B)
    Pmax = int(lens.max())
    Pb = round_up(Pmax, PROMPT_BUCKET)
    prompt = np.zeros((Bb, Pb), np.int32)
    recent = np.zeros((Bb, T), np.int32)
    length = np.ones((Bb,), np.int32)
    for i, p in enumerate(prompts):
        p = np.asarray(p, np.int32)
        prompt[i, :len(p)] = p
        last = p[-T:]
        recent[i, :len(last)] = last
        length[i] = len(p)
    row_ids_b = np.concatenate([row_ids, np.arange(B, Bb) + 2**30]).astype(np.uint32)
    rule_b = pad_rule(rule, B, Bb)
    stop_arr, stop_lens = encode_stops(stops)
    S = stop_arr.shape[1] if stop_arr is not None else 1
    n_bucket = round_up(n, 256)

    rule_state = None
    if rule_b is not None:
        rule_state = _rule_init(rule_b, jnp.asarray(prompt), jnp.asarray(length), V=cfg.V, max_new=n_bucket)

    # The cache a chunk starting after `taken` steps needs. The native CPU attention kernel reads
    # each row only up to its length, so there the cache is allocated once for the whole request;
    # the jax.numpy attention reads the whole cache, so there it grows with the text.
    whole = kernels.reads_only_filled()

    def capacity(taken):
        return round_up((min(T, Pmax + n) if whole else Pmax + taken) + chunk, SPAN_BUCKET)

    # each layer of a step (and of the prefill of short prompts) is one native call
    # (kernels.decode_layer) on packed weights, instead of a dozen small XLA operations
    packed = M.packed_params(params) if kernels.packs_rows(Bb) else None
    cache = None
    if Pmax <= T:
        logits, cache = _prefill(params, jnp.asarray(prompt[:, :min(Pb, T)]), jnp.asarray(length),
                                 packed, cfg=cfg, capacity=capacity(0))
        n_cache = min(n, T - Pmax)
    else:
        logits = _window_start(params, jnp.asarray(recent), jnp.asarray(length), cfg=cfg)
        n_cache = 0
    state = SamplingState(
        logits=logits, recent=jnp.asarray(recent), length=jnp.asarray(length), rule_state=rule_state,
        done=jnp.zeros((Bb,), bool), tail=jnp.full((Bb, S), -1, jnp.int32), step=jnp.int32(0))
    common = {"rule": rule_b, "key": key, "row_ids": jnp.asarray(row_ids_b), "stops": stop_arr,
                  "stop_lens": stop_lens}

    outs, taken = [], 0
    while taken < n:
        valid = min(chunk, (n_cache if taken < n_cache else n) - taken)
        step_end = np.int32(taken + valid)  # a numpy scalar: a jnp one costs a dispatch of its own
        if taken < n_cache:
            if cache.capacity < capacity(taken):
                cache = _grow(cache, capacity=capacity(taken))
            state, cache, out = _cache_chunk(params, state, cache, step_end=step_end, packed=packed,
                                             cfg=cfg, chunk=chunk, greedy=greedy, **common)
        else:
            cache = None
            state, out = _window_chunk(params, state, step_end=step_end, cfg=cfg, chunk=chunk,
                                       greedy=greedy, **common)
        out = jax.device_get(out)
        out = StepOutput(*(np.asarray(a)[:valid, :B].T for a in out))  # [B, valid]
        outs.append(out)
        taken += valid
        if on_chunk is not None:
            on_chunk(out.token, out.emitted)
        if stop_arr is not None and bool(np.all(np.asarray(state.done)[:B])):
            break  # every row has produced a stop string

    cat = lambda i: np.concatenate([o[i] for o in outs], axis=1)
    tokens, mlp, slp, emitted = cat(0), cat(1), cat(2), cat(3)
    counts = emitted.sum(axis=1).astype(np.int32)
    stopped = np.asarray(state.done)[:B]
    return TokenResult(tokens.astype(np.int32), mlp.astype(np.float32), slp.astype(np.float32),
                       counts, stopped)


def encode_prompts(lm, prompts: str | Sequence[str], num_samples: int):
    """Check and encode text prompts; returns the prompt list and one token row per sample
    (prompt-major: sample ``j`` of prompt ``i`` is row ``i * num_samples + j``)."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    for p in prompts:
        if not p:
            raise ValueError("the prompt is empty: give at least one character")
    encoded = [lm.vocab.encode(p) for p in prompts]
    return prompts, [e for e in encoded for _ in range(num_samples)]


def generate(lm, prompts: str | Sequence[str], n: int = 300, *, seed: int = 0, key: jax.Array | None = None,
             rule=None, greedy: bool = False, num_samples: int = 1, stop: str | Sequence[str] | None = None,
             chunk: int | None = None, on_text: Callable[[int, str], None] | None = None) -> list[Generation]:
    """Generate ``n`` characters after each prompt with a loaded model ``lm``.

    Returns ``len(prompts) * num_samples`` :class:`Generation` objects, prompt-major. Sample ``j``
    of prompt ``i`` uses row id ``i * num_samples + j``, so it is the same whether the prompt is
    generated alone or with others. ``on_text(row, new_text)`` streams text as chunks finish.
    """
    prompts, rows = encode_prompts(lm, prompts, num_samples)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    stop_tokens = [lm.vocab.encode(s) for s in stops]
    key = jax.random.PRNGKey(seed) if key is None else key

    on_chunk = None
    if on_text is not None:
        def on_chunk(tokens, emitted):
            for r in range(tokens.shape[0]):
                ids = tokens[r][emitted[r]]
                if len(ids):
                    on_text(r, lm.vocab.decode(ids))

    res = sample_tokens(lm.params, lm.cfg, rows, n, key, rule=rule, greedy=greedy, stops=stop_tokens,
                        chunk=chunk, on_chunk=on_chunk)
    out = []
    for r in range(len(rows)):
        c = res.counts[r]
        toks = res.tokens[r, :c]
        out.append(Generation(prompt=prompts[r // num_samples], text=lm.vocab.decode(toks), tokens=toks,
                              model_logprobs=res.model_logprobs[r, :c],
                              sample_logprobs=res.sample_logprobs[r, :c],
                              finish_reason="stop" if res.stopped[r] else "length"))
    return out


# The order in which make_rule applies settings: penalties see the raw logits, then temperature,
# then the truncations (as Hugging Face and vLLM order their processors).
RULE_ORDER = ("repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram",
              "temperature", "top_k", "top_p", "min_p", "typical", "epsilon", "eta", "top_n_sigma")


def make_rule(**settings):
    """Build the rule chain for named settings (``top_p=0.9, temperature=0.8, ...``), or ``None``.

    Settings that are ``None`` are skipped; an unknown name or an invalid value raises
    :class:`jaxdecode.rules.RuleError` before anything is traced.
    """
    from . import rules

    unknown = set(settings) - set(RULE_ORDER)
    if unknown:
        raise rules.RuleError(f"unknown decoding setting(s): {', '.join(sorted(unknown))}")
    parts = [getattr(rules, name)(settings[name]) for name in RULE_ORDER if settings.get(name) is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else rules.chain(*parts)
