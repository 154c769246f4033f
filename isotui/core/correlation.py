"""Drift correlation across a model's layers (Godey et al. 2024, Fig. 5 and 16)."""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np


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
    return DriftCorrelation(len(x), float(s.statistic), float(s.pvalue), float(p.statistic), float(p.pvalue))
