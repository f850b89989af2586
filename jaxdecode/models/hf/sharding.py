"""How a Hugging Face decoder's parameters are split over a mesh's ``"model"`` axis.

Sharding as data, as in MaxText's logical axis rules: every parameter names a logical axis per
dimension (:data:`LOGICAL`), and a table of rules (:data:`RULES`) maps each logical name to a mesh
axis or to none (replicated). The decoder's code never names a device: the parameters are placed
with :class:`~jax.sharding.NamedSharding` and XLA's partitioner (GSPMD) derives the rest, inserting
the collectives itself.

The rules are Megatron's: q, k, v and the MLP's gate and up split by columns (heads, units); o and
down by rows (one all-reduce of ``B x d`` values after each: two per layer); the embedding and the
output layer by vocabulary (or by hidden size with ``embedding="hidden"``); a mixture's experts by
expert; norms, the router and learned positions replicated. A logical axis is split only where
the ``"model"`` size divides its number of units; otherwise it is replicated (so with fewer
key/value heads than shards, k, v and the KV cache are replicated). An int8 matrix is split as
its float matrix, its scales with its columns. The table, its reasons and its measured costs:
``docs/scaling.md`` (The rules).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MODEL = "model"
EMBEDDINGS = ("vocab", "hidden")

# parameter -> its logical axes, one per dimension (None: never split)
LOGICAL: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "table"), "head": ("table", "vocab"), "pos": (None, None),
    "norm_w": (None,), "norm_b": (None,),
    "norm1_w": (None,), "norm1_b": (None,), "norm2_w": (None,), "norm2_b": (None,),
    "norm_pa": (None,), "norm_pf": (None,),
    "wq": (None, "heads"), "wk": (None, "kv_heads"), "wv": (None, "kv_heads"),
    "bq": ("heads",), "bk": ("kv_heads",), "bv": ("kv_heads",),
    "wo": ("heads", None), "bo": (None,),
    "w_gate": (None, "mlp"), "w_up": (None, "mlp"), "w_down": ("mlp", None),
    "b_gate": ("mlp",), "b_up": ("mlp",), "b_down": (None,),
    "router": (None, None), "e_gu": ("experts", None, None), "e_down": ("experts", None, None),
    "s_gate": (None, "shared_mlp"), "s_up": (None, "shared_mlp"), "s_down": ("shared_mlp", None),
    "s_router": (None, None),
}
# q/k norms: per head ([hd], replicated) or over the whole projection (split as q or k)
QK_NORMS = {"head": {"q_norm": (None,), "k_norm": (None,)},
            "all": {"q_norm": ("heads",), "k_norm": ("kv_heads",)}}

# logical axis -> mesh axis (None: replicated), for each choice of the embedding's split
RULES: dict[str, tuple[tuple[str, str | None], ...]] = {
    "vocab": (("vocab", MODEL), ("table", None), ("heads", MODEL), ("kv_heads", MODEL), ("mlp", MODEL),
              ("shared_mlp", MODEL), ("experts", MODEL)),
    "hidden": (("vocab", None), ("table", MODEL), ("heads", MODEL), ("kv_heads", MODEL), ("mlp", MODEL),
               ("shared_mlp", MODEL), ("experts", MODEL)),
}


class ShardingError(ValueError):
    """A model that cannot be placed on the mesh asked for (one line naming the problem)."""


def units(cfg) -> dict[str, int]:
    """How many indivisible units each logical axis holds (a head is split whole, never within)."""
    return {"vocab": cfg.V, "table": cfg.d, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
            "mlp": cfg.ffn, "shared_mlp": cfg.shared_ffn or 1, "experts": cfg.experts or 1}


def axis_rules(cfg, ways: int, embedding: str = "vocab") -> dict[str, str | None]:
    """Logical axis -> mesh axis for a ``"model"`` axis of ``ways`` devices: :data:`RULES`, with
    an axis whose units ``ways`` does not divide replicated."""
    if embedding not in EMBEDDINGS:
        raise ShardingError(f"embedding must be split by one of {', '.join(EMBEDDINGS)}, got {embedding!r}")
    n = units(cfg)
    return {name: axis if ways > 1 and axis is not None and n[name] % ways == 0 else None
            for name, axis in RULES[embedding]}


def logical_axes(cfg, name: str) -> tuple[str | None, ...]:
    table = QK_NORMS.get(cfg.qk_norm, {})
    if name in table:
        return table[name]
    if name not in LOGICAL:
        raise ShardingError(f"parameter {name!r} has no sharding rule")
    return LOGICAL[name]


def _spec(axes, rules) -> P:
    return P(*(None if a is None else rules[a] for a in axes))


def param_specs(params: dict, cfg, ways: int, embedding: str = "vocab") -> dict:
    """A tree of :class:`~jax.sharding.PartitionSpec` shaped like ``params`` (an int8 matrix's
    ``q`` as its matrix, its ``scale`` as the matrix's columns)."""
    rules = axis_rules(cfg, ways, embedding)

    def spec(name, value):
        axes = logical_axes(cfg, name)
        if isinstance(value, dict):
            if "packed" in value:
                raise ShardingError("a model packed for the native CPU layer runs on one device: load it "
                                    "with backend='portable' to place it on a mesh")
            if set(value) != {"q", "scale"}:
                raise ShardingError(f"matrix {name!r} is kept in a form that runs on one device (int8, "
                                    f"bfloat16 and float32 matrices split over a mesh)")
            return {"q": _spec(axes, rules), "scale": _spec(axes[-1:], rules)}
        if len(axes) != value.ndim:
            raise ShardingError(f"parameter {name!r} has {value.ndim} dimensions, its rule names {len(axes)}")
        return _spec(axes, rules)

    out = {k: spec(k, v) for k, v in params.items() if k != "layers"}
    out["layers"] = tuple({k: spec(k, v) for k, v in layer.items()} for layer in params["layers"])
    return out


def cache_spec(cfg, ways: int) -> P:
    """The KV cache's leaves ``[B, KV, capacity, hd]``: split by key/value head where k and v are."""
    return P(None, axis_rules(cfg, ways)["kv_heads"], None, None)


def cache_sharding(cfg, mesh: Mesh, ndim: int = 4):
    """:func:`cache_spec` on ``mesh`` (its first ``ndim`` axes: an int8 block's scales have no
    ``hd`` axis; inside a program manual over the batch axis, on the abstract
    mesh of that program, where only ``"model"`` is left to the partitioner)."""
    spec = P(*tuple(cache_spec(cfg, model_ways(mesh)))[:ndim])
    inner = jax.sharding.get_abstract_mesh()
    if not inner.empty and inner.manual_axes:
        return NamedSharding(inner, spec)
    return NamedSharding(mesh, spec)


def model_ways(mesh: Mesh | None) -> int:
    return 1 if mesh is None else dict(mesh.shape).get(MODEL, 1)


def check_mesh(mesh) -> int:
    """``mesh``'s model axis size, after checking it is a mesh with a ``"model"`` axis."""
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"mesh must be a jax.sharding.Mesh (see jaxdecode.make_mesh), got {type(mesh).__name__}")
    if MODEL not in mesh.axis_names:
        raise ShardingError(f"the mesh has no {MODEL!r} axis to split the model along (axes "
                            f"{mesh.axis_names}; build one with make_mesh(data=..., model=...))")
    return model_ways(mesh)


def shardings(params: dict, cfg, mesh: Mesh, embedding: str = "vocab") -> dict:
    """Each parameter's :class:`~jax.sharding.NamedSharding` on ``mesh`` (replicated over every
    axis but ``"model"``)."""
    specs = param_specs(params, cfg, check_mesh(mesh), embedding)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def place(params: dict, cfg, mesh: Mesh, embedding: str = "vocab") -> dict:
    """``params`` placed on ``mesh`` by the rules (``jax.device_put``: each device receives only
    its slice of a split parameter)."""
    return jax.device_put(params, shardings(params, cfg, mesh, embedding))


__all__ = ["EMBEDDINGS", "LOGICAL", "MODEL", "QK_NORMS", "RULES", "ShardingError", "axis_rules", "cache_sharding", "cache_spec",
           "check_mesh", "logical_axes", "model_ways", "param_specs", "place", "shardings", "units"]
