"""What ``serve`` hands the decoding explorer (``docs/server.md``): its model, and speculative
runs with every pass recorded (the server's layer does not import the drafts)."""

from __future__ import annotations

import threading


def make_explorer(options: dict, lm=None):
    """The explorer of a server started with ``serve``'s ``options``: on ``lm`` where the server's
    process already holds the model, else on a copy loaded at the first request."""
    def load():
        if lm is not None:
            return lm
        from argparse import Namespace

        from jaxdecode.cli.common import load_model

        return load_model(Namespace(ckpt=options.get("ckpt"), dtype=options.get("dtype"), weights=options.get("weights")))

    from jaxdecode.server.explore import Explorer

    return Explorer(load, speculate=speculate)


# ----------------------------------------------------------------------------- speculative runs

_passes: list = []  # the passes the running speculative run recorded (one run at a time: the explorer's lock)
_record_lock = threading.Lock()
_registered = False


def _record(proposals, accepted, token, active):
    import numpy as np

    _passes.append((np.asarray(proposals), np.asarray(accepted), np.asarray(token), np.asarray(active)))


class RecordingDraft:
    """A draft that proposes as ``inner`` does and records, at each pass's commit, what the loop
    decided: the proposals, how many it accepted, the token after them, and which rows ran."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def vocab(self):
        return getattr(self.inner, "vocab", None)

    def check(self, target, need):
        return self.inner.check(target, need)

    def init(self, prompt, lengths, capacity):
        return self.inner.init(prompt, lengths, capacity)

    def propose(self, state, noise, gamma, process, span):
        return self.inner.propose(state, noise, gamma, process, span)

    def commit(self, state, tokens, n_accepted, token, active):
        import jax

        jax.debug.callback(_record, tokens, n_accepted, token, active, ordered=True)
        return self.inner.commit(state, tokens, n_accepted, token, active)



def speculate(lm, prompt: str, n: int, *, draft: str, gamma: int, seed: int, greedy: bool, rule) -> dict:
    """A speculative run of ``n`` tokens with the named draft: its text, every pass's proposals
    marked accepted or rejected, the token the target added, and the run's counts."""
    import jax
    import numpy as np

    from jaxdecode.speculative import DRAFTS, make_draft, speculative_generate

    global _registered
    if not _registered:  # a pytree, as a draft is: the loop takes it as a jitted argument
        jax.tree_util.register_pytree_node(RecordingDraft, lambda d: ((d.inner,), None),
                                           lambda _, children: RecordingDraft(children[0]))
        _registered = True

    if draft not in ("lookup", "draft"):
        raise ValueError(f"draft must be 'lookup' or 'draft' (those that need no corpus), got {draft!r}; "
                         f"the library has {', '.join(DRAFTS)}")
    inner = make_draft(draft, lm)
    with _record_lock:
        _passes.clear()
        g = speculative_generate(lm, prompt, n, draft=RecordingDraft(inner), gamma=gamma, seed=seed, rule=rule,
                                 greedy=greedy)[0]
        jax.effects_barrier()
        passes = list(_passes)
    out, made = [], 0
    for proposals, accepted, token, active in passes:
        if not bool(active[0]) or made >= len(g.tokens):
            continue
        a = int(accepted[0])
        props = [{"token": int(t), "text": lm.vocab.decode([int(t)]), "accepted": j < a}
                 for j, t in enumerate(proposals[0])]
        out.append({"proposals": props, "examined": min(a + 1, gamma), "accepted": a,
                    "token": int(token[0]), "text": lm.vocab.decode([int(token[0])])})
        made += a + 1
    stats = g.stats.as_dict()
    return {"draft": draft, "gamma": gamma, "seed": seed, "greedy": greedy, "text": g.text,
            "tokens": [int(t) for t in g.tokens], "passes": out,
            "stats": {k: (v if not isinstance(v, float) or np.isfinite(v) else None) for k, v in stats.items()}}
