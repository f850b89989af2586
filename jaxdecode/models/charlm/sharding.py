"""How the reference character transformer's parameters are split over a mesh's ``"model"`` axis.

The same rules as the Hugging Face decoder's (:mod:`jaxdecode.models.hf.sharding`), on the Flax
tree: the attention's fused q/k/v projection and the first feed-forward layer split by columns,
the attention's output projection and the second feed-forward layer by rows (one all-reduce
after each), the token embedding (tied to the output layer) by vocabulary; layer norms, the
biases of row-split layers and the learned positions replicated. A logical axis whose units the
model axis does not divide (heads; the feed-forward's ``4d`` units; the vocabulary) is replicated.

The fused projection's columns are q, then k, then v (each ``heads x head_dim``), so a split by
columns does not hand each device whole heads of all three: the partitioner regroups the new
positions' q, k and v by head (a small exchange of activations, never of weights).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdecode.models.hf.sharding import MODEL, ShardingError, check_mesh

# the last two names of a parameter's path -> its logical axes
LOGICAL = {
    ("tok", "embedding"): ("vocab", None), ("pos", "embedding"): (None, None),
    ("qkv", "kernel"): (None, "heads3"), ("qkv", "bias"): ("heads3",),
    ("proj", "kernel"): ("heads", None), ("proj", "bias"): (None,),
    ("ff1", "kernel"): (None, "mlp"), ("ff1", "bias"): ("mlp",),
    ("ff2", "kernel"): ("mlp", None), ("ff2", "bias"): (None,),
    ("ln1", "scale"): (None,), ("ln1", "bias"): (None,), ("ln2", "scale"): (None,), ("ln2", "bias"): (None,),
    ("ln", "scale"): (None,), ("ln", "bias"): (None,),
}


def axis_rules(cfg, ways: int) -> dict[str, str | None]:
    units = {"vocab": cfg.V, "heads": cfg.heads, "heads3": 3 * cfg.heads, "mlp": 4 * cfg.d}
    return {k: MODEL if ways > 1 and n % ways == 0 else None for k, n in units.items()}


def param_specs(params, cfg, ways: int):
    rules = axis_rules(cfg, ways)

    def spec(path, leaf):
        names = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)[-2:]
        if names not in LOGICAL:
            raise ShardingError(f"parameter {'/'.join(map(str, names))} has no sharding rule")
        return P(*(None if a is None else rules[a] for a in LOGICAL[names]))

    return jax.tree_util.tree_map_with_path(spec, params)


def place(params, cfg, mesh):
    """``params`` placed on ``mesh`` by the rules."""
    specs = param_specs(params, cfg, check_mesh(mesh))
    return jax.device_put(params, jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                                         is_leaf=lambda x: isinstance(x, P)))


__all__ = ["LOGICAL", "axis_rules", "param_specs", "place"]
