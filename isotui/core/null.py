"""The isotropic null: how large a cosine two independent uniform directions in R^d reach, and how
large the mean cosine of n of them does."""

from __future__ import annotations

import math
from functools import lru_cache


@lru_cache(maxsize=256)
def null_cos_quantile(dim: int, q: float = 0.95) -> float:
    """Quantile of cos(u, v) for independent uniform u, v on the sphere in R^dim.

    cos = 2B - 1 with B ~ Beta((d-1)/2, (d-1)/2) (Godey et al. 2024, App. B). The inverse of
    the regularised incomplete beta function is ``scipy.stats.beta.ppf``'s own (the same bits),
    from ``scipy.special``: importing ``scipy.stats`` costs about half a second of a run.
    """
    from scipy.special import betaincinv

    if dim < 2:
        raise ValueError(f"the isotropic null needs a dimension of at least 2, got {dim}")
    a = (dim - 1) / 2.0
    return float(2.0 * betaincinv(a, a, q) - 1.0)


def null_mean_sd(n: int, dim: int) -> float:
    """Standard deviation of ``avg_cos`` over n independent uniform directions in R^dim.

    avg_cos = 2 / (n (n - 1)) sum_{i<j} u_i . u_j. Each pair's cosine has mean 0 and variance 1/d
    (E[(u . v)^2] = E[u^T (v v^T) u] = tr(I/d)/d), and two different pairs are uncorrelated
    (E[(u_i . u_j)(u_i . u_k)] = E[u_j]^T E[u_i u_i^T] E[u_k] = 0 for j != k; pairs sharing no
    vector are independent), so Var(avg_cos) = (2 / (n (n - 1)))^2 n (n - 1) / 2 / d
    = 2 / (n (n - 1) d)."""
    return math.sqrt(2.0 / (n * (n - 1.0) * dim))


@lru_cache(maxsize=4096)
def null_mean_quantile(n: int, dim: int, q: float = 0.95) -> float:
    """Quantile of ``avg_cos`` over n independent uniform directions in R^dim (the test of a
    layer's mean cosine against its own isotropic null, not one pair's).

    n (n - 1) avg_cos = ||S||^2 - n with S = sum u_i, a sum of n independent vectors of
    covariance I/d: for many vectors S ~ N(0, (n/d) I) and ||S||^2 ~ (n/d) chi^2_d. The quantile
    is that chi^2_d's, standardised and put on the exact scale of :func:`null_mean_sd`:
    sd * (chi^2_{d,q} - d) / sqrt(2d) (mean and variance exact, the shape the limit's;
    tests/test_core.py checks it against a simulation)."""
    from scipy.special import chdtri

    if dim < 2 or n < 2:
        raise ValueError(f"the mean's isotropic null needs n >= 2 vectors and d >= 2, got n={n}, d={dim}")
    chi = float(chdtri(dim, 1.0 - q))
    return null_mean_sd(n, dim) * (chi - dim) / math.sqrt(2.0 * dim)
