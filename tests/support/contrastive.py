"""Contrastive search as a plain loop from the paper: the reference of tests/decoding/test_contrastive.py
and of the Hugging Face families' contrastive tests."""

import numpy as np


def reference_contrastive(full, prompt, n, k, alpha):
    """Su et al. 2022 as a plain loop: at each step the k most probable tokens, each scored by one
    full forward of the context plus that token; the degeneration penalty is the largest cosine
    similarity between the candidate's final hidden state and the hidden state of every earlier
    position (each kept as computed when its position was added: past T, from its own window)."""
    unit = lambda h: h / np.linalg.norm(h, axis=-1, keepdims=True)
    seq = list(prompt)
    logits, hidden = full(seq)
    history = list(unit(hidden))
    out = []
    for _ in range(n):
        z = logits[-1]
        p = np.exp(z - z.max())
        p /= p.sum()
        cand = np.argsort(-p, kind="stable")[:k]
        best = None
        for v in cand:
            cand_logits, cand_hidden = full(seq + [int(v)])
            h = unit(cand_hidden[-1])
            score = (1 - alpha) * p[v] - alpha * max(float(h @ g) for g in history)
            if best is None or score > best[0]:
                best = (score, int(v), cand_logits, h)
        _, v, logits, h = best
        seq.append(v)
        history.append(h)
        out.append(v)
    return out
