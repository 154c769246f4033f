"""Drift correlation across a model's layers (Godey et al. 2024, Fig. 5 and 16)."""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np

# Up to this many layers, Spearman's p is exact (all n! orderings); scipy's t approximation is
# far off for so few points (it gives p = 0 for a perfect rank correlation over 3 layers).
EXACT_SPEARMAN_MAX_N = 9


@dataclass(frozen=True)
class DriftCorrelation:
    """Spearman and Pearson correlation of drift norm vs average cosine over layers."""

    n_layers: int
    spearman_rho: float
    spearman_p: float
    pearson_r: float
    pearson_p: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def drift_correlation(drift_norm: list[float], avg_cos: list[float]) -> DriftCorrelation:
    """Correlate per-layer drift norm with per-layer avg cosine (NaN when undefined)."""
    from scipy.stats import pearsonr, spearmanr

    x = np.asarray(drift_norm, dtype=np.float64)
    y = np.asarray(avg_cos, dtype=np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    nan = math.nan
    if len(x) < 3 or np.ptp(x) == 0.0 or np.ptp(y) == 0.0:
        return DriftCorrelation(len(x), nan, nan, nan, nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = spearmanr(x, y)
        p = pearsonr(x, y)
    spearman_p = spearman_exact_p(x, y) if len(x) <= EXACT_SPEARMAN_MAX_N else float(s.pvalue)
    return DriftCorrelation(len(x), float(s.statistic), spearman_p, float(p.statistic), float(p.pvalue))


def spearman_exact_p(x: np.ndarray, y: np.ndarray) -> float:
    """Two-sided p of Spearman's rho under independence, over every ordering of ``y``'s ranks."""
    from scipy.stats import rankdata

    rx, ry = rankdata(x), rankdata(y)
    rxc = rx - rx.mean()
    perms = np.array(list(itertools.permutations(range(len(ry)))))
    ryc = ry[perms] - ry.mean()
    rhos = (ryc @ rxc) / (np.linalg.norm(rxc) * np.linalg.norm(ryc, axis=1))
    observed = float(rxc @ (ry - ry.mean())) / (np.linalg.norm(rxc) * np.linalg.norm(ry - ry.mean()))
    return float(np.mean(np.abs(rhos) >= abs(observed) - 1e-12))
