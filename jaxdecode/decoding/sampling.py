"""Greedy and ancestral sampling as jitted loops over a decoding model's cache, for ragged batches.

The loop runs in chunks of up to ``chunk`` steps, each one jitted loop; between chunks the host
receives the new tokens (for streaming) and checks whether every row has stopped. Batches are
bucketed (:mod:`jaxdecode.decoding.common`) so that new prompts do not recompile. The cache grows with the
text, chunk by chunk, unless the model attends only over each row's filled part
(``reads_only_filled``, the native CPU layer), where it is allocated once per request.

The loop knows the model only through :mod:`jaxdecode.models.base`. Rule settings are traced
(see :mod:`jaxdecode.rules`), so one compiled program serves every value.

Randomness: the key of row ``r`` at step ``s`` is ``fold_in(fold_in(key[r], row_id[r]), s)``
(``key``: one for every row, or one per row), so a row's sample depends only on its key, its row
id and the step, never on which other prompts share the batch, on the batch size, on padding or on
how a large request is split into batches.

Past the model window ``T`` the reference model sees a different window at every step; the loop
then switches to the model's exact window mode (``window``: a forward over the last ``T`` tokens
of every row per step).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdecode import constraints as C
from jaxdecode.decoding import budget as budget_lib
from jaxdecode.decoding.common import (
    PROMPT_BUCKET,
    SPAN_BUCKET,
    Generation,
    batch_bucket,
    check_int,
    default_settings,
    encode_prompts,
    finish_text,
    make_batch,
    pad_rule,
    push_recent,
    round_up,
    sample_keys,
    text_streamer,
)
from jaxdecode.decoding.params import (
    GENERATE,
    DecodeParams,
    resolve,
    stop_automaton_for,
    with_controls,
)
from jaxdecode.decoding.placement import (
    AXIS,
    ONE_DEVICE,
    Placement,
    batch_axes,
    rows_struct,
    spec_tree,
    pad_batch,
)
from jaxdecode.decoding.steps import (
    DEFAULT_CHUNK,
    SMALL_BATCH_CHUNK,
    WHOLE_CHUNK_MAX,
    SamplingState,
    StepOutput,
    TokenResult,
    cache_chunk,
    grow,
    prefill,
    prefill_shared,
    rule_init,
    window_chunk,
    window_start,
)
from jaxdecode.decoding.stops import as_automaton
from jaxdecode.models.base import DecodingModel
from jaxdecode.rules import make_rule

__all__ = [
    "PROMPT_BUCKET",
    "SPAN_BUCKET",
    "Generation",
    "SamplingState",
    "StepOutput",
    "TokenResult",
    "batch_bucket",
    "generate",
    "pad_rule",
    "push_recent",
    "round_up",
]


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How every row of a batch is decoded: the settings :func:`sample_tokens` hands each batch
    as one object. ``rule``: a rule (or chain) or None; ``greedy``: argmax instead of sampling;
    ``stops``: a :class:`~jaxdecode.decoding.stops.StopAutomaton` or None; ``chunk``: steps
    between host round trips (None: chosen per batch); ``constraint``: one constraint, one per
    row, or None."""

    rule: object = None
    greedy: bool = False
    stops: object = None
    chunk: int | None = None
    constraint: object = None


def sample_tokens(model: DecodingModel, params, prompts: Sequence[np.ndarray], n: int, key: jax.Array,
                  rule=None, greedy: bool = False, row_ids: Sequence[int] | None = None,
                  stops: Sequence[np.ndarray] = (), chunk: int | None = None,
                  on_chunk: Callable[[np.ndarray, np.ndarray], None] | None = None,
                  constraint=None, *, memory_budget: int | str | None = None, max_rows: int | None = None,
                  progress: bool | str = False, mesh=None) -> TokenResult:
    """Generate ``n`` tokens after each prompt (token arrays of any lengths >= 1) from ``model``
    (a :class:`jaxdecode.models.DecodingModel`, e.g. ``lm.decoder``) with ``params``.

    The token-level engine that :func:`generate` runs, not in ``__all__``: its arguments are the
    loop's own (a rule, stop sequences, row ids, a callback per chunk), and they change with the
    loop. A request's settings belong in :func:`generate`'s :class:`DecodeParams`.

    ``key``: one PRNG key for every row, or one per row (``[B, 2]``). A request of any size runs
    in batches that fit ``memory_budget`` (bytes, or a size such as ``"2G"``), of at most
    ``max_rows`` rows each (defaults: :mod:`jaxdecode.decoding.budget`); rows keep their ids, so the tokens
    do not depend on the split.
    ``progress``: a tqdm bar on stderr (a string: its label). ``mesh``: a
    :class:`jax.sharding.Mesh` with a ``"data"`` axis: each batch is split over its devices
    (:mod:`jaxdecode.decoding.sharded`), with the tokens of one device.

    ``constraint``: a :class:`jaxdecode.constraints.Constraint` for every row, or one per row
    (None: free); a constrained row's output is in the pattern's language, and the row may stop
    before ``n`` where the pattern allows it (see :mod:`jaxdecode.constraints`).

    ``rule``: a :mod:`jaxdecode.rules` rule (or chain) applied before choosing; ``greedy`` takes
    the argmax of the processed logits instead of sampling. ``row_ids`` (default ``0..B-1``) name
    the rows for the PRNG. ``stops``: token sequences that end a row once generated, or a
    :class:`~jaxdecode.decoding.stops.StopAutomaton` (stop strings however tokenized, end tokens).
    ``on_chunk(tokens [B, c], emitted [B, c])`` is called after every chunk (for streaming);
    ``chunk`` is the number of steps between host round trips (default 64 up to 4 rows, else 32;
    up to 4 rows with neither ``on_chunk`` nor ``stops``, the request's length rounded up to a
    power of two, at most 512, when the model reads only the filled cache).
    """
    rows = _as_rows(prompts)
    B = len(rows)
    if B == 0:
        raise ValueError("no prompts given")
    check_int("the number of new tokens n", n, 0)
    ids = np.arange(B) if row_ids is None else np.asarray(row_ids)
    if ids.shape != (B,):
        raise ValueError(f"row_ids must have one id per prompt ({B}), got shape {ids.shape}")
    key = jnp.asarray(key)
    if key.ndim == 2 and key.shape[0] != B:
        raise ValueError(f"{key.shape[0]} keys for {B} prompts: give one key, or one per prompt")
    if key.ndim not in (1, 2):
        raise ValueError(f"key must be one PRNG key or one per prompt, got shape {key.shape}")
    stops = as_automaton(stops, model.V)  # once for every batch
    longest = max(len(r) for r in rows)
    capacity = round_up(min(model.T, longest + n) + SMALL_BATCH_CHUNK, SPAN_BUCKET)
    per_row = budget_lib.row_bytes(model, longest, n, capacity)
    size = budget_lib.rows_per_batch(per_row, memory_budget, max_rows)
    if mesh is not None:  # each device holds the cache of its share of the rows
        size *= mesh.shape["data"]
    parts = budget_lib.groups(B, size)
    cons = constraint if isinstance(constraint, (list, tuple)) else None
    if cons is not None and len(cons) != B:
        raise C.ConstraintError(f"give one constraint per row ({B}), got {len(cons)}")
    rule_rows = _rule_per_row(rule, B)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=B * n, unit="tok", unit_scale=True, desc=progress if isinstance(progress, str) else "generate",
                   file=sys.stderr, leave=False, dynamic_ncols=True)
    results = []
    try:
        for part in parts:
            sel = np.asarray(part)

            def chunk_cb(tokens, emitted, sel=sel):
                if bar is not None:
                    bar.update(int(tokens.size))
                if on_chunk is not None:
                    full_t = np.zeros((B, tokens.shape[1]), tokens.dtype)
                    full_e = np.zeros((B, tokens.shape[1]), bool)
                    full_t[sel], full_e[sel] = tokens, emitted
                    on_chunk(full_t, full_e)

            how = Decoding(rule if len(parts) == 1 else rule_rows(sel), greedy, stops, chunk,
                           constraint if cons is None else [cons[i] for i in sel])
            results.append(sample_batch(
                model, params, [rows[i] for i in sel], n, key if key.ndim == 1 else key[sel], how,
                row_ids=ids[sel], on_chunk=chunk_cb if (on_chunk is not None or bar is not None) else None,
                mesh=mesh))
    finally:
        if bar is not None:
            bar.close()
    if len(results) == 1:
        return results[0]
    width = max(r.tokens.shape[1] for r in results)
    pad = lambda a, v: np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=v)
    return TokenResult(np.concatenate([pad(r.tokens, 0) for r in results]),
                       np.concatenate([pad(r.model_logprobs, 0) for r in results]),
                       np.concatenate([pad(r.sample_logprobs, 0) for r in results]),
                       np.concatenate([r.counts for r in results]),
                       np.concatenate([r.stopped for r in results]))


def _as_rows(prompts) -> list[np.ndarray]:
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        return list(prompts.astype(np.int32))
    return [np.asarray(p).reshape(-1) for p in prompts]


def _rule_per_row(rule, B: int):
    """``sel -> rule`` with every per-row setting cut to the rows ``sel``."""
    def cut(sel):
        if rule is None:
            return None

        def fix(a):
            a = jnp.asarray(a)
            if a.ndim == 0:
                return a
            if a.shape[0] != B:
                raise ValueError(f"a per-row rule setting has {a.shape[0]} values for {B} rows")
            return a[sel]

        return jax.tree_util.tree_map(fix, rule)

    return cut


def sample_batch(model, params, prompts, n, key, how: Decoding | None = None, row_ids=None, on_chunk=None,
                 mesh=None, placement=None) -> TokenResult:
    """:func:`sample_tokens` for one batch (``key``: one, or one per row) decoded as ``how`` says
    (default: plain sampling), its arrays placed and its programs run by ``placement`` (default:
    one device, or split over ``mesh``)."""
    how = how or Decoding()
    if placement is None:
        placement = ONE_DEVICE if mesh is None else Placement(mesh)
    rule, greedy, chunk, constraint = how.rule, how.greedy, how.chunk, how.constraint
    stops = as_automaton(how.stops, model.V)
    batch = pad_batch(make_batch(prompts, n, model.V, model.T, row_ids), placement.ways)
    B, Bb, T = batch.B, batch.Bb, model.T
    local = Bb // placement.ways  # the rows of each device
    key = jnp.asarray(key)
    if key.ndim not in (1, 2) or jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and placement.split:
        raise ValueError(f"key must be one PRNG key or one per prompt, got shape {key.shape}")
    if key.ndim == 2:  # one key per row: the dummy rows take the first
        if key.shape[0] != B:
            raise ValueError(f"{key.shape[0]} keys for {B} prompts: give one key, or one per prompt")
        key = jnp.concatenate([key, jnp.broadcast_to(key[:1], (Bb - B, key.shape[1]))])
    if n == 0:
        e = np.zeros((B, 0), np.int32)
        return TokenResult(e, e.astype(np.float32), e.astype(np.float32), np.zeros(B, np.int32),
                           np.zeros(B, bool))
    key_axis = 0 if key.ndim == 2 else None
    key = placement.put(key, key_axis)
    con, cstate, budget = C.for_rows(constraint, B, Bb, model.V, n)
    con, cstate, budget = placement.replicated(con), placement.put(cstate), placement.put(budget)
    whole = model.reads_only_filled
    if chunk is None:
        chunk = SMALL_BATCH_CHUNK if B <= 4 else DEFAULT_CHUNK
        if B <= 4 and on_chunk is None and stops is None and con is None and whole:
            # nothing to stream or to check between chunks, and a few rows, where each host round
            # trip costs about half a millisecond: the request in one chunk (a power of two, so
            # one program per size bucket of n)
            chunk = max(chunk, min(batch_bucket(n), WHOLE_CHUNK_MAX))
    chunk = min(chunk, batch_bucket(n))  # short requests get a smaller buffer
    Pmax, Pb = batch.Pmax, batch.Pb
    rule_b = placement.rows(pad_rule(rule, B, Bb))
    stop_dev = None if stops is None else placement.replicated(stops.device())
    prompt, length = placement.put(batch.prompt), placement.put(batch.length)
    recent, row_ids_b = placement.put(batch.recent), placement.put(batch.row_ids)
    max_new = round_up(n, 256)

    rule_state, rule_axes, rule_specs = None, None, None
    if rule_b is not None:
        if placement.split:
            # which axis of each leaf of the rule's state holds the rows: compare its shape at two
            # batch sizes (every leaf of a padded rule has the rows first)
            init = lambda r, p, lengths: r.init(p, lengths, model.V, max_new)
            shapes = [jax.eval_shape(init, *(rows_struct(a, extra) for a in (rule_b, prompt, length)))
                      for extra in (0, 1)]
            rule_axes = batch_axes(*shapes)
            rule_specs = spec_tree(placement, rule_axes, shapes[0])
        rule_state = placement.run(rule_init, (rule_b, prompt, length), (0, 0, 0), rule_specs,
                                   V=model.V, max_new=max_new)

    # The cache a chunk starting after `taken` steps needs: allocated once for the whole request
    # when attention reads each row only up to its length, else grown with the text.
    def capacity(taken):
        return round_up((min(T, Pmax + n) if whole else Pmax + taken) + chunk, SPAN_BUCKET)

    params = placement.replicated(model.prepare(params, local))
    cache, cache_axes, cache_specs = None, None, None
    if Pmax <= T:
        if placement.split:  # the axis of each cache leaf that holds the rows (a model lays its cache out as it likes)
            cache_shape, bigger = (jax.eval_shape(lambda b=b: model.empty_cache(b, capacity(0)))
                                   for b in (local, local + 1))
            cache_axes = batch_axes(cache_shape, bigger)
            cache_specs = spec_tree(placement, cache_axes, cache_shape)
        tokens = batch.prompt[:, :min(Pb, T)]
        first: dict[bytes, int] = {}  # each distinct prompt's first row
        same = [first.setdefault(tokens[i, :batch.length[i]].tobytes(), i) for i in range(B)]
        if len(first) < B and not placement.split:
            # several samples of a prompt: prefill it once, copy its cache (one device: with the
            # rows split, every device prefills its own)
            uniq = list(first.values())
            Ub = batch_bucket(len(uniq))
            where = {r: j for j, r in enumerate(uniq)}
            rows = np.zeros((Bb,), np.int32)  # dummy rows copy the first prompt (discarded)
            rows[:B] = [where[r] for r in same]
            tok_u = np.zeros((Ub, tokens.shape[1]), np.int32)
            len_u = np.ones((Ub,), np.int32)
            tok_u[:len(uniq)], len_u[:len(uniq)] = tokens[uniq], batch.length[uniq]
            logits, cache = prefill_shared(params, jnp.asarray(tok_u), jnp.asarray(len_u), jnp.asarray(rows),
                                            model=model, capacity=capacity(0))
        else:
            prompt_T = prompt if Pb <= T else placement.put(tokens)
            logits, cache = placement.run(prefill, (params, prompt_T, length), (None, 0, 0),
                                          (P(AXIS), cache_specs), model=model, capacity=capacity(0))
        n_cache = min(n, T - Pmax)
    else:
        logits = placement.run(window_start, (params, recent, length), (None, 0, 0), P(AXIS), model=model)
        n_cache = 0
    state = SamplingState(
        logits=logits, recent=recent, length=length, rule_state=rule_state,
        done=placement.put(np.zeros((Bb,), bool)), stop_state=placement.put(np.zeros((Bb,), np.int32)),
        step=placement.put(np.int32(0), None), cstate=cstate)
    state_axes, state_specs = None, None
    if placement.split:
        axes = SamplingState(logits=0, recent=0, length=0, rule_state=rule_axes, done=0, stop_state=0, step=None,
                             cstate=None if cstate is None else 0)
        state_axes = _axes_list(axes, state)
        state_specs = spec_tree(placement, state_axes, state)
    common = (rule_b, key, row_ids_b, stop_dev)
    common_axes = (0, key_axis, 0, None)

    outs, taken = [], 0
    while taken < n:
        valid = min(chunk, (n_cache if taken < n_cache else n) - taken)
        # a numpy scalar on one device: a jnp one costs a dispatch of its own
        step_end = placement.scalar(np.int32(taken + valid))
        if taken < n_cache:
            if model.capacity(cache) < capacity(taken):
                cache = placement.run(grow, (cache,), (cache_axes,), cache_specs, model=model,
                                      capacity=capacity(taken))
            state, cache, out = placement.run(
                cache_chunk, (params, state, cache) + common + (step_end, con, budget),
                (None, state_axes, cache_axes) + common_axes + (None, None, 0),
                (state_specs, cache_specs, _OUT), donate=(2,), model=model, chunk=chunk, greedy=greedy)
        else:
            cache = None
            state, out = placement.run(
                window_chunk, (params, state) + common + (step_end, con, budget),
                (None, state_axes) + common_axes + (None, None, 0),
                (state_specs, _OUT), model=model, chunk=chunk, greedy=greedy)
        out, done = placement.fetch((out, state.done))
        out = StepOutput(*(np.asarray(a)[:valid, :B].T for a in out))  # [B, valid]
        outs.append(out)
        taken += valid
        if on_chunk is not None:
            on_chunk(out.token, out.emitted)
        if (stop_dev is not None or con is not None) and bool(np.all(np.asarray(done)[:B])):
            break  # every row has stopped

    cat = lambda i: np.concatenate([o[i] for o in outs], axis=1)
    tokens, mlp, slp, emitted = cat(0), cat(1), cat(2), cat(3)
    counts = emitted.sum(axis=1).astype(np.int32)
    stopped = np.asarray(done)[:B]
    return TokenResult(tokens.astype(np.int32), mlp.astype(np.float32), slp.astype(np.float32),
                       counts, stopped)


_OUT = StepOutput(*([P(None, AXIS)] * 4))  # a chunk's outputs [chunk, B]: rows on the second axis


def _axes_list(state_axes: SamplingState, state: SamplingState) -> list:
    """The loop state's per-leaf batch axes, in its leaves' order."""
    out = []
    for field, ax in zip(state, state_axes):
        n = len(jax.tree_util.tree_leaves(field))
        out.extend(ax if isinstance(ax, list) else [ax] * n)
    return out


def generate(lm, prompts: str | Sequence[str], params: DecodeParams | int | None = None, *,
             key: jax.Array | None = None, on_text: Callable[[int, str], None] | None = None,
             progress: bool | str = False, mesh=None, **overrides) -> list[Generation]:
    """Generate up to ``params.n`` tokens after each prompt with a loaded model ``lm``.

    ``params``: a :class:`~jaxdecode.decoding.params.DecodeParams` (None: the defaults; an int:
    the number of new tokens ``n``); keywords (any of its fields, ``rule=`` for an explicit
    chain) override it: ``generate(lm, prompts, n=200, top_p=0.9)``. Returns
    ``len(prompts) * num_samples`` :class:`Generation` objects, prompt-major.

    Seeds are per prompt, like a per-request seed: ``seed`` is one seed for every prompt or one
    per prompt, and sample ``j`` of a prompt is drawn with the key ``PRNGKey(seed)`` of its
    prompt and row id ``j``. So a prompt's samples depend only on the prompt, its seed, ``j`` and
    the settings: never on the other prompts of the request, its position among them, or how the
    request is split into batches (``memory_budget``, ``max_rows``: see :func:`sample_tokens`).
    ``key`` (instead of ``seed``): one key for every prompt.

    ``stop``: strings that end a sample once its text holds one, however the model spelled it in
    tokens; the text keeps the stop string (``include_stop=False``: cut, as OpenAI's API does).
    ``stop_token_ids`` end a sample too (the token stays in its text); ``min_tokens``: no end
    token or stop token before that many new tokens. ``logit_bias`` (``{token id: bias}``),
    ``allowed_token_ids`` and ``bad_words`` act on the model's logits before the rule chain
    (:func:`~jaxdecode.decoding.params.logit_controls`).

    ``on_text(row, new_text)`` streams text as chunks finish. ``constraint``: a
    :class:`jaxdecode.constraints.Constraint` (see :func:`sample_tokens`), or one per prompt.
    ``progress``: a bar on stderr. ``mesh``: a :class:`jax.sharding.Mesh` with a ``"data"`` axis
    (:func:`~jaxdecode.decoding.placement.make_mesh`): each batch is split over its devices, with
    the same texts, tokens and log-probabilities, on every process (see :func:`sample_tokens`).

    With neither a rule setting nor ``greedy``, a Hugging Face folder's ``generation_config.json``
    defaults apply (its temperature, top-k, top-p, repetition penalty, or greedy decoding, each
    where the request leaves it unset: see :func:`~jaxdecode.decoding.common.default_settings`);
    ``generation_config=False`` ignores them.
    """
    p = resolve(params, overrides, GENERATE)
    rule, greedy = p.rule(), p.greedy
    if p.chain is None and not greedy and p.generation_config:
        settings, greedy = default_settings(lm, p.rule_settings())
        rule = make_rule(**settings)
    num_samples = p.num_samples
    prompts, rows = encode_prompts(lm, prompts, num_samples)
    rule = with_controls(lm, p, rule, len(rows))
    stops = stop_automaton_for(lm, p)
    keys, row_ids = sample_keys(len(prompts), num_samples, list(p.seed) if isinstance(p.seed, tuple) else p.seed,
                                key)

    constraint = C.per_sample(p.constraint, len(prompts), num_samples)
    res = sample_tokens(lm.decoder, lm.params, rows, p.n, keys, rule=rule, greedy=greedy, stops=stops,
                        row_ids=row_ids, chunk=p.chunk, on_chunk=text_streamer(lm, on_text), constraint=constraint,
                        memory_budget=p.memory_budget, max_rows=p.max_rows, progress=progress, mesh=mesh)
    out = []
    for r in range(len(rows)):
        toks, text, reason = finish_text(lm, res.tokens[r, :res.counts[r]], res.stopped[r], p.stop, p.include_stop)
        c = len(toks)
        out.append(Generation(prompt=prompts[r // num_samples], text=text, tokens=toks,
                              model_logprobs=res.model_logprobs[r, :c],
                              sample_logprobs=res.sample_logprobs[r, :c], finish_reason=reason))
    return out
