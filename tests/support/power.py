"""The power of ``exact.chisquare_pvalue`` against a named wrong distribution, on the cells it
actually tests: shared by the statistical tests (``docs/statistical_tests.md``)."""

import numpy as np


def pooled_chi2_power(t, w, samples: int, outside: float, alpha: float = 1e-3):
    """``t``: the true cell probabilities, ascending and summing to 1; ``w``: the wrong
    distribution's on the same cells; ``outside``: its mass off the true support (a draw there
    rejects on its own). Cells are pooled as ``chisquare_pvalue`` pools them (expected count below
    5, smallest first); the power is the noncentral chi-square's on the pooled cells. Returns
    ``(power, noncentrality, degrees of freedom)``."""
    from scipy import stats

    t, w = np.asarray(t, float), np.asarray(w, float)
    e = t * samples
    cut, pooled = 0, 0.0
    while cut < len(e) and (e[cut] < 5 or 0 < pooled < 5):
        pooled += e[cut]
        cut += 1
    if cut:
        t = np.concatenate([[t[:cut].sum()], t[cut:]])
        w = np.concatenate([[w[:cut].sum()], w[cut:]])
    df = len(t) - 1
    lam = samples * float(np.sum((w - t) ** 2 / t))
    chi = float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, lam)) if df > 0 else 0.0
    return 1 - (1 - outside) ** samples * (1 - chi), lam, df
