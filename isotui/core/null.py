"""The isotropic null: how large a cosine two independent uniform directions in R^d reach."""

from __future__ import annotations

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
