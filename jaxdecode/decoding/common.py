"""What every decoding loop shares: request checks, bucketing, padding, row ids, rule padding,
stop strings and result types. The loops (:mod:`.sampling`, :mod:`.beam`, :mod:`.speculative`)
build their batches here and talk to the model only through :mod:`jaxdecode.models.base`.

Shapes are bucketed so that new prompts do not recompile: the batch is padded to a power of two
(dummy rows, discarded), the prompt width to a multiple of :data:`PROMPT_BUCKET`, and the KV cache
to multiples of :data:`SPAN_BUCKET` positions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

SPAN_BUCKET = 128
PROMPT_BUCKET = 16
DUMMY_ROW_ID = 2**30  # dummy (padding) rows are named from here on, apart from any real row


def batch_bucket(b: int) -> int:
    """The smallest power of two >= ``b``."""
    return 1 << max(0, (b - 1).bit_length())


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def check_int(name: str, value, low: int) -> int:
    """``value`` as an int, or a ValueError naming ``name`` unless it is an integer >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


@dataclasses.dataclass
class Batch:
    """A checked, bucketed batch of token prompts (``Bb`` rows, ``B`` of them real)."""

    B: int
    Bb: int
    lens: np.ndarray  # [B] int32 prompt lengths
    prompt: np.ndarray  # [Bb, Pb] int32 right-padded prompts (Pb a multiple of PROMPT_BUCKET)
    recent: np.ndarray  # [Bb, T] int32 the last T tokens of each prompt, left-aligned
    length: np.ndarray  # [Bb] int32 prompt lengths, 1 for dummy rows
    row_ids: np.ndarray  # [Bb] uint32 the rows' names for the PRNG

    @property
    def Pmax(self) -> int:
        return int(self.lens.max())

    @property
    def Pb(self) -> int:
        return self.prompt.shape[1]


def make_batch(prompts, n: int, V: int, T: int, row_ids: Sequence[int] | None = None) -> Batch:
    """Check a request (prompts as token arrays of any lengths >= 1, or one ``[B, P]`` array; ``n``
    new tokens; token ids in ``[0, V)``; one row id per prompt) and pad it to its buckets."""
    check_int("the number of new tokens n", n, 0)
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        rows = list(prompts.astype(np.int32))
    else:
        rows = [np.asarray(p).reshape(-1) for p in prompts]
    B = len(rows)
    if B == 0:
        raise ValueError("no prompts given")
    for i, p in enumerate(rows):
        if p.size == 0:
            raise ValueError("every prompt needs at least one token")
        if not np.issubdtype(p.dtype, np.integer):
            raise ValueError(f"prompt {i}: token ids must be integers, got dtype {p.dtype}")
        if p.min() < 0 or p.max() >= V:
            raise ValueError(f"prompt {i}: token ids must lie in [0, {V}), got min {p.min()} max {p.max()}")
    lens = np.array([len(p) for p in rows], np.int32)
    ids = np.arange(B) if row_ids is None else np.asarray(row_ids)
    if ids.shape != (B,):
        raise ValueError(f"row_ids must have one id per prompt ({B}), got shape {ids.shape}")
    Bb = batch_bucket(B)
    Pb = round_up(int(lens.max()), PROMPT_BUCKET)
    prompt = np.zeros((Bb, Pb), np.int32)
    recent = np.zeros((Bb, T), np.int32)
    length = np.ones((Bb,), np.int32)
    for i, p in enumerate(rows):
        prompt[i, :len(p)] = p
        last = p[-T:]
        recent[i, :len(last)] = last
        length[i] = len(p)
    row_ids_b = np.concatenate([ids, np.arange(B, Bb) + DUMMY_ROW_ID]).astype(np.uint32)
    return Batch(B, Bb, lens, prompt, recent, length, row_ids_b)


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


def push_recent(recent, length, token, T):
    """Append ``token`` to each row's last-T buffer (shifting once it is full)."""
    B = recent.shape[0]
    full = length >= T
    shifted = jnp.concatenate([recent[:, 1:], token[:, None]], axis=1)
    written = recent.at[jnp.arange(B), jnp.minimum(length, T - 1)].set(token)
    return jnp.where(full[:, None], shifted, written)


def encode_prompts(lm, prompts: str | Sequence[str], num_samples: int):
    """Check and encode text prompts; returns the prompt list and one token row per sample
    (prompt-major: sample ``j`` of prompt ``i`` is row ``i * num_samples + j``)."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    check_int("num_samples", num_samples, 1)
    for p in prompts:
        if not isinstance(p, str):
            raise ValueError(f"a prompt must be a string, got {type(p).__name__}")
        if not p:
            raise ValueError("the prompt is empty: give at least one character")
    encoded = [lm.vocab.encode(p) for p in prompts]
    for p, e in zip(prompts, encoded):
        if len(e) == 0:
            raise ValueError(f"the prompt {p!r} encodes to no tokens")
    return prompts, [e for e in encoded for _ in range(num_samples)]


def sample_keys(n_prompts: int, num_samples: int, seed=0, key=None):
    """The PRNG keys and row ids of a text request: sample ``j`` of prompt ``i`` is drawn with
    ``PRNGKey(seed_i)`` and row id ``j`` (``seed``: one for every prompt or one per prompt;
    ``key`` instead: one key for every prompt). Returns ``(keys [n_prompts * num_samples, 2],
    row_ids)``, prompt-major, so a prompt's samples never depend on the other prompts."""
    if key is not None:
        key = jnp.asarray(key)
        if key.ndim != 1:
            raise ValueError(f"key must be one PRNG key (shape (2,)), got shape {key.shape}")
        keys = jnp.broadcast_to(key, (n_prompts * num_samples,) + key.shape)
    else:
        if isinstance(seed, (list, tuple, np.ndarray)):
            seeds = list(seed)
        elif isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            seeds = [seed] * n_prompts
        else:
            raise ValueError(f"a seed must be an integer (or one per prompt), got {seed!r}")
        if len(seeds) != n_prompts:
            raise ValueError(f"{len(seeds)} seeds for {n_prompts} prompts: give one seed, or one per prompt")
        for s in seeds:
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not -2**63 <= s < 2**64:
                raise ValueError(f"a seed must be an integer, got {s!r}")
        seeds = [int(s) for s in seeds]
        if _plain_keys() and all(s < 2**63 for s in seeds):
            # PRNGKey(s) without a device call per seed: threefry's key of a seed held as a 32-bit
            # integer is [0, its low 32 bits] (tests/decoding/test_sampling.py checks it against PRNGKey)
            keys = jnp.asarray(np.repeat(np.array([[0, s & 0xFFFFFFFF] for s in seeds], np.uint32),
                                         num_samples, axis=0))
        else:
            distinct = list(dict.fromkeys(seeds))
            base = jnp.stack([jax.random.PRNGKey(s) for s in distinct])
            index = {s: i for i, s in enumerate(distinct)}
            keys = base[np.repeat([index[s] for s in seeds], num_samples)]
    return keys, np.tile(np.arange(num_samples), n_prompts)


def _plain_keys() -> bool:
    """Whether PRNGKey makes raw threefry keys from 32-bit seeds (JAX's defaults)."""
    return not jax.config.jax_enable_x64 and str(jax.config.jax_default_prng_impl) == "threefry2x32"


class _Incremental:
    """One row's text so far, given out in whole characters (a subword vocabulary may split a
    multi-byte character over several tokens: its bytes are held back until it is whole)."""

    def __init__(self, vocab):
        self.vocab, self.ids, self.emitted = vocab, [], 0

    def push(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self.vocab.decode(self.ids)
        end = len(text)
        while end > self.emitted and text[end - 1] == "\ufffd":
            end -= 1
        new, self.emitted = text[self.emitted:end], end
        return new


def text_streamer(lm, on_text):
    """``on_text(row, new_text)`` as a loop's ``on_chunk(tokens [B, c], emitted [B, c])``, or None.
    End tokens are not text: they are never streamed."""
    if on_text is None:
        return None
    eos = np.asarray(getattr(lm, "eos_ids", ()) or [-1], np.int32)
    rows: dict[int, _Incremental] = {}

    def on_chunk(tokens, emitted):
        for r in range(tokens.shape[0]):
            keep = emitted[r] & ~np.isin(tokens[r], eos)
            if not keep.any():
                continue
            if is_subword(lm.vocab):
                new = rows.setdefault(r, _Incremental(lm.vocab)).push(tokens[r][keep])
                if new:
                    on_text(r, new)
            else:
                on_text(r, lm.vocab.decode(tokens[r][keep]))

    return on_chunk


def is_subword(vocab) -> bool:
    """Whether ``vocab`` is a subword tokenizer (stop strings are matched on the decoded text)."""
    return bool(getattr(vocab, "subword", False))


def stop_string_list(stop: str | Sequence[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for s in stops:
        if not isinstance(s, str):
            raise ValueError(f"a stop string must be a string, got {type(s).__name__}")
        if not s:
            raise ValueError("a stop string must not be empty")
        if "\ufffd" in s:  # it stands for bytes that are not text, which no automaton over bytes can match
            raise ValueError(f"the stop string {s!r} holds U+FFFD, the replacement character (it stands for "
                             "bytes that are not text): leave it out")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"the stop string {s!r} is not valid Unicode text (a lone surrogate)") from None
    return stops


def encode_stop_strings(lm, stop: str | Sequence[str] | None) -> list[np.ndarray]:
    """Stop strings as their canonical token sequences (a subword vocabulary's encoding, without
    special tokens), followed by the model's end tokens. A model spells a string in many ways:
    the loops end rows with :func:`jaxdecode.decoding.stops.stop_automaton` instead, which
    matches the text however it was tokenized."""
    stops = stop_string_list(stop)
    encode = getattr(lm.vocab, "encode_piece", lm.vocab.encode)
    return [encode(s) for s in stops] + list(getattr(lm, "end_stops", []))


def _first_stop(decode, tokens: np.ndarray, stops: list[str]) -> tuple[int, str] | None:
    """The fewest leading tokens whose text contains a stop string, and that text; None if even
    all of them do not. A binary search on the decoded text itself (a prefix of tokens that ends
    inside a multi-byte character decodes to U+FFFD, so no count of characters is compared)."""
    has = lambda text: any(s in text for s in stops)
    hi, text = len(tokens), decode(tokens)
    if not has(text):
        return None
    lo = 0  # has(decode(tokens[:lo])) is False (no stop string is empty), has(... [:hi]) True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        t = decode(tokens[:mid])
        if has(t):
            hi, text = mid, t
        else:
            lo = mid
    return hi, text


def finish_text(lm, tokens: np.ndarray, stopped: bool, stop: str | Sequence[str] | None = None,
                include_stop: bool = True):
    """A finished row: ``(tokens kept, text, finish_reason)``, whichever came first of a stop
    string and an end token. ``"stop"``: the text contains a stop string, however it was
    tokenized; the tokens kept are the fewest whose text contains it, and the text ends with it
    (it may end inside the last token). ``"eos"``: it generated an end token (kept in the tokens,
    not in the text). ``"length"``: it ran out of new tokens. ``stopped``: the loop ended the row
    early (with neither in the tokens, a constrained stop: ``"stop"``). ``include_stop=False``: the
    stop string is cut from the text (OpenAI's convention; the tokens still hold it)."""
    tokens = np.asarray(tokens)
    eos = set(getattr(lm, "eos_ids", ()))
    end = next((i for i, t in enumerate(tokens.tolist()) if t in eos), None) if eos else None
    body = tokens if end is None else tokens[:end]
    stops = stop_string_list(stop)
    if stops:  # the first stop string in the text, however it was tokenized
        found = _first_stop(lm.vocab.decode, body, stops)
        if found is not None:
            k, text = found
            # the stop string that ends first (the longest of those that end there)
            cut, minus, _ = min((text.find(s) + len(s), -len(s), s) for s in stops if s in text)
            return tokens[:k], text[:cut] if include_stop else text[:cut + minus], "stop"
    if end is not None:
        return tokens[:end + 1], lm.vocab.decode(body), "eos"
    return tokens, lm.vocab.decode(tokens), "stop" if stopped else "length"


@dataclasses.dataclass
class Generation:
    """One generated continuation."""

    prompt: str
    text: str
    tokens: np.ndarray  # [n] int32
    model_logprobs: np.ndarray  # [n] float32, unmodified model log-probability of each token
    sample_logprobs: np.ndarray  # [n] float32, under the processed distribution sampled from
    finish_reason: str  # "length", "stop" (a stop string) or "eos" (an end token, not in the text)

    @property
    def mean_logprob(self) -> float:
        """The model's mean log-probability per generated token (nats)."""
        return float(np.mean(self.model_logprobs)) if len(self.model_logprobs) else float("nan")


# ----------------------------------------------------------------------------- next-token predictions

NextLogits = Callable[[np.ndarray], np.ndarray]  # tokens [N, t] -> next-token logits [N, V]


@functools.partial(jax.jit, static_argnames=("model",))
def _window_next(params, history, lengths, *, model):  # history [N, t'], lengths [N] -> logits [N, V]
    return model.window(params, history, lengths)[0]


def next_logits_for(model, params, batch_size: int = 256) -> NextLogits:
    """``next_logits`` for any decoding model (:class:`jaxdecode.models.DecodingModel`): its exact
    window prediction, ``model.window``, after each full row.

    Rows longer than ``model.T`` are predicted from their last ``T`` tokens (the window's
    semantics). Rows are right-padded to a power-of-two width
    (``window`` reads each row only up to its length) and run ``batch_size`` at a time, the last
    chunk padded to a power of two, so that few shapes compile.
    """

    # one compiled program per model and shape, shared by every call (not one per closure)
    at = functools.partial(_window_next, model=model)

    def bucket(m: int, cap: int) -> int:
        return min(cap, 1 << max(m - 1, 0).bit_length())

    def next_logits(tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, np.int32)
        if tokens.ndim != 2:
            raise ValueError(f"next_logits_for: give rows of tokens [N, t], got shape {tokens.shape}")
        tokens = tokens[:, -model.T:]
        t = tokens.shape[1]
        if t == 0:
            raise ValueError("next_logits_for: rows must hold at least one token")
        tokens = np.pad(tokens, ((0, 0), (0, bucket(t, model.T) - t)))
        out = []
        for start in range(0, len(tokens), batch_size):
            chunk = tokens[start:start + batch_size]
            m = len(chunk)
            chunk = np.pad(chunk, ((0, bucket(m, batch_size) - m), (0, 0)))
            lengths = np.full((len(chunk),), t, np.int32)
            out.append(np.asarray(at(params, jnp.asarray(chunk), jnp.asarray(lengths)))[:m])
        return np.concatenate(out, axis=0)

    return next_logits


# ----------------------------------------------------------------------------- randomness and choice


def row_keys(key, row_ids):
    """``[B]`` keys ``fold_in(key[r], row_id[r])`` (``key``: one for every row, or one per row)."""
    key = jnp.broadcast_to(key, (row_ids.shape[0],) + key.shape[-1:])
    return jax.vmap(jax.random.fold_in)(key, row_ids)


def step_keys(key, row_ids, steps):
    """``[B]`` keys ``fold_in(fold_in(key[r], row_id[r]), step[r])``: the key of row ``r`` at a
    step (``steps``: one step for every row, or one per row). Every loop and the engine draw
    their tokens with these keys, so a row's sample depends only on its key, id and step."""
    steps = jnp.broadcast_to(jnp.asarray(steps, jnp.int32), row_ids.shape)
    return jax.vmap(jax.random.fold_in)(row_keys(key, row_ids), steps)


def pick_tokens(processed, keys, greedy):
    """One token per row from processed logits ``[B, V]``: the argmax where ``greedy``, else a
    draw with the row's key. ``greedy``: a Python bool (one program per value) or ``[B]`` bools."""
    if greedy is True:
        return jnp.argmax(processed, axis=-1).astype(jnp.int32)
    drawn = jax.vmap(jax.random.categorical)(keys, processed).astype(jnp.int32)
    if greedy is False:
        return drawn
    return jnp.where(greedy, jnp.argmax(processed, axis=-1).astype(jnp.int32), drawn)


def default_settings(lm, settings: dict | None = None, greedy: bool = False,
                     use_defaults: bool = True) -> tuple[dict, bool]:
    """The decoding settings a request runs with: ``(settings, greedy)``, where ``settings`` are
    :func:`jaxdecode.rules.make_rule` keywords. The user's ``settings`` (None values: unset) and
    ``greedy`` win field by field over the model's folder defaults (``lm.generation_defaults``,
    read from ``generation_config.json``); a user's greedy takes nothing from them, and a user's
    sampling setting turns the folder's greedy (``do_sample: false``) into sampling. With
    ``use_defaults`` false (``--no-generation-config``) the user's settings stand alone."""
    user = {k: v for k, v in (settings or {}).items() if v is not None}
    defaults = dict(getattr(lm, "generation_defaults", None) or {}) if use_defaults else {}
    if greedy or not defaults:
        return user, bool(greedy)
    folder_greedy = bool(defaults.pop("greedy", False))
    samples = any(k != "repetition_penalty" for k in user)
    return defaults | user, folder_greedy and not samples
