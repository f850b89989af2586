"""The rule interface, its pytree registration, composition (:func:`chain`) and the building blocks
the rules share: :func:`rule_class`, :func:`check_setting`, :func:`column`, :func:`truncate`, ..."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -jnp.inf


class RuleError(ValueError):
    """A rule's setting lies outside its allowed range."""


# ----------------------------------------------------------------------------- base and helpers


class Rule:
    """Base class: stateless by default; subclasses override :meth:`apply` (and the state pair)."""

    def init(self, prompt, lengths, V: int, max_new: int):
        """State for a batch of right-padded prompts ``[B, P]`` with ``lengths`` ``[B]``."""
        return ()

    def apply(self, logits, state):
        """Transform next-token logits ``[B, V]`` float32; removed tokens become ``-inf``."""
        raise NotImplementedError

    def update(self, state, token):
        """The state after each row appended ``token`` ``[B]`` int32."""
        return state


def rule_class(cls):
    """Make ``cls`` a frozen dataclass and a pytree: fields marked ``static`` are metadata.

    Registered with ``register_pytree_with_keys`` rather than ``register_dataclass``: with the
    latter, two rule classes with the same field layout (``MinP(ratio)``, ``Epsilon(eps)``) get
    tree structures that compare equal, so a jitted function could reuse one rule's program for
    the other.
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if not f.metadata.get("static", False))
    meta = tuple(f.name for f in fields if f.metadata.get("static", False))

    def flatten_with_keys(rule):
        children = [(jax.tree_util.GetAttrKey(n), getattr(rule, n)) for n in data]
        return children, tuple(getattr(rule, n) for n in meta)

    def flatten(rule):
        return [getattr(rule, n) for n in data], tuple(getattr(rule, n) for n in meta)

    def unflatten(aux, children):
        return cls(**dict(zip(data, children)), **dict(zip(meta, aux)))

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


def static_field():
    """A :func:`rule_class` field that is static (tree metadata), for settings that change shapes."""
    return dataclasses.field(metadata={"static": True})


def is_tracer(x) -> bool:
    """Whether ``x`` is traced (its value is unknown, so it cannot be checked)."""
    return isinstance(x, jax.core.Tracer)


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def check_setting(rule: str, name: str, value, ok, allowed: str, *, integer: bool = False):
    """Validate a concrete setting and return it as a float32 (int32) array of shape [] or [B].

    ``ok(values)`` is a numpy predicate over float64 values; ``allowed`` completes the message
    "``rule``: ``name`` must ``allowed``, got ...". NaN is always rejected.
    """
    dtype = jnp.int32 if integer else jnp.float32
    if is_tracer(value):
        return jnp.asarray(value, dtype)
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - anything numpy cannot read is a bad setting
        raise RuleError(f"{rule}: {name} must be a number, got {value!r}") from None
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer)
                                 or np.issubdtype(arr.dtype, np.floating)):
        raise RuleError(f"{rule}: {name} must be a number, got {value!r}")
    if arr.ndim > 1:
        raise RuleError(f"{rule}: {name} must be a scalar or a [B] vector, got shape {arr.shape}")
    vals = arr.astype(np.float64).reshape(-1)
    good = ~np.isnan(vals) & ok(vals)
    if integer:
        good &= np.isfinite(vals) & (vals == np.round(vals))
    if not good.all():
        bad = vals[~good][0]
        raise RuleError(f"{rule}: {name} must {allowed}, got {_fmt(bad)}")
    limit = np.iinfo(np.int32).max if integer else float(np.finfo(np.float32).max)
    over = np.isfinite(vals) & (np.abs(vals) > limit)  # (float32 would make it infinite: NaN logits)
    if over.any():
        raise RuleError(f"{rule}: {name} must lie within {'int32' if integer else 'float32'}'s range "
                        f"(at most {_fmt(limit)} in size), got {_fmt(vals[over][0])}")
    return jnp.asarray(arr, dtype)


def column(x):
    """A setting of shape [] or [B] as a column [1, 1] or [B, 1] against [B, V] logits."""
    return jnp.reshape(x, (-1, 1))


def is_first_max(logits):
    """[B, V] bool: the (first) argmax of each row."""
    V = logits.shape[-1]
    return jnp.arange(V)[None, :] == jnp.argmax(logits, axis=-1)[:, None]


def truncate(logits, keep):
    """``logits`` with the tokens not in ``keep`` removed (``-inf``)."""
    return jnp.where(keep, logits, NEG_INF)


def unless_neutral(neutral, logits, apply):
    """``apply(logits)``, or the logits as they are where ``neutral`` holds for every row. A rule at
    its neutral setting leaves the logits exactly unchanged, so skipping its work changes no bit;
    the engine's batches carry each rule at its neutral setting in the rows that set none, and this
    spares them the work (the sorts of top-k and top-p) when no row uses it. One compiled program
    either way (``lax.cond``). Settings known at trace time (or no trace: the explorer applies rules
    eagerly) decide in Python, with no conditional to compile."""
    if not is_tracer(neutral):
        return logits if bool(np.all(np.asarray(neutral))) else apply(logits)
    return jax.lax.cond(jnp.all(neutral), lambda x: x, apply, logits)


def softmax(logits):
    """Probabilities of each row of processed logits (removed tokens: 0)."""
    return jnp.exp(processed_logprobs(logits))


def entropy(logp):
    """Entropy in nats of each row of log-probabilities [B, V] (removed tokens contribute 0)."""
    p = jnp.exp(logp)
    return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)


def _canonical_zero(x):
    # lax.sort orders -0.0 before 0.0; make equal values sort as ties
    return jnp.where(x == 0, 0.0, x)


PAIRWISE_RANK_MAX_V = 512  # up to here ranks come from comparing pairs ([B, V, V]), beyond from sorting


def _descending_rank(logits):
    """[B, V] int32: each token's place when the row is sorted by decreasing logit, ties by index
    (the order of a stable ``argsort(-logits)``), counted by comparing every pair."""
    key = _canonical_zero(logits)
    V = key.shape[-1]
    mine, other = key[:, :, None], key[:, None, :]  # [B, i, j]
    earlier = (jnp.arange(V)[None, :] < jnp.arange(V)[:, None])[None]  # [1, i, j]: j < i
    return jnp.sum((other > mine) | ((other == mine) & earlier), axis=-1, dtype=jnp.int32)


def rank_and_sorted(logits, values):
    """Each token's descending rank (see :func:`_descending_rank`) and ``values`` in rank order.
    For vocabularies of a few hundred tokens by comparing pairs, several times faster than XLA's
    sort on CPU (and exact: one nonzero term per sum); larger ones, where [B, V, V] would not fit,
    sort."""
    V = logits.shape[-1]
    if V > PAIRWISE_RANK_MAX_V:
        order = jnp.argsort(-_canonical_zero(logits), axis=-1, stable=True)
        return jnp.argsort(order, axis=-1).astype(jnp.int32), jnp.take_along_axis(values, order, axis=-1)
    rank = _descending_rank(logits)
    hit = rank[:, :, None] == jnp.arange(V)[None, None, :]
    return rank, jnp.sum(jnp.where(hit, values[:, :, None], 0.0), axis=1)


def processed_logprobs(logits):
    """``log_softmax`` over the last axis that maps ``-inf`` entries to ``-inf`` without NaN."""
    logits = jnp.asarray(logits)
    finite = jnp.isfinite(logits)
    m = jnp.max(jnp.where(finite, logits, NEG_INF), axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    shifted = logits - m
    lse = jnp.log(jnp.sum(jnp.where(logits == NEG_INF, 0.0, jnp.exp(shifted)), axis=-1,
                          keepdims=True))
    return jnp.where(logits == NEG_INF, NEG_INF, shifted - lse)


def per_row(rule, B: int):
    """``rule`` with every numeric setting broadcast to shape ``[B]`` (one value per row); a setting
    with a value per token (:mod:`jaxdecode.rules.controls`) to ``[B, ...]``."""
    if isinstance(rule, Chain):
        return Chain(tuple(per_row(r, B) for r in rule.rules))
    if hasattr(rule, "per_row"):
        return rule.per_row(B)
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(jnp.asarray(x), (B,)), rule)


# ----------------------------------------------------------------------------- composition


@rule_class
class Chain(Rule):
    rules: tuple  # of Rule

    def init(self, prompt, lengths, V, max_new):
        return tuple(r.init(prompt, lengths, V, max_new) for r in self.rules)

    def apply(self, logits, state):
        for r, s in zip(self.rules, state, strict=True):
            logits = r.apply(logits, s)
        return logits

    def update(self, state, token):
        return tuple(r.update(s, token) for r, s in zip(self.rules, state, strict=True))


def chain(*rules: Rule) -> Chain:
    """Apply ``rules`` in order; the state is the tuple of their states (as ``optax.chain``)."""
    for i, r in enumerate(rules):
        if not isinstance(r, Rule):
            raise RuleError(f"chain: argument {i} must be a Rule, got {type(r).__name__}")
    return Chain(tuple(rules))
