"""Isotropy metrics beyond the mean cosine (numpy only), each by its published definition.

- IsoScore* (Rudman & Eickhoff 2024): IsoScore of the shrunk covariance (1 - zeta) C + zeta C0.
  With C0 = I (the default) its eigenvalues are (1 - zeta) lambda + zeta, so it comes from the
  same spectrum as IsoScore.
- I(W) (Mu & Viswanath 2018): min over max of the partition function Z(c) = sum_i exp(c . x_i)
  over the eigenvectors c of the uncentered second moment X^T X (columns of ``eigh``'s matrix,
  both signs, since an eigenvector's sign is arbitrary), in log space so it never overflows.
- All-but-the-top (Mu & Viswanath 2018): avg_cos after removing the mean and the projections on
  the top D principal components (D = ceil(d / 100) by default).
- Standardised avg_cos: avg_cos after z-scoring every dimension (mean 0, variance 1), which
  removes the rogue dimensions' weight (Timkey & van Schijndel 2021).
"""

from __future__ import annotations

import math

import numpy as np

from isotui.core.spectrum import isoscore_from_eigenvalues

ISOSCORE_STAR_ZETA = 0.2


def isoscore_star(eigenvalues: np.ndarray, zeta: float = ISOSCORE_STAR_ZETA) -> float:
    """IsoScore* with C0 = I, from the covariance eigenvalues (all d of them)."""
    vals = np.asarray(eigenvalues, dtype=np.float64)
    if not np.all(np.isfinite(vals)):
        return math.nan
    return isoscore_from_eigenvalues((1.0 - zeta) * vals + zeta)


def _logsumexp(a: np.ndarray, axis: int = 0) -> np.ndarray:
    top = a.max(axis=axis, keepdims=True)
    return (top + np.log(np.exp(a - top).sum(axis=axis, keepdims=True))).squeeze(axis)


def partition_isotropy(x: np.ndarray, *, centered: bool = False) -> float:
    """I(W) of the rows of ``x``: min_c Z(c) / max_c Z(c), computed as exp(min log Z - max log Z)."""
    x = np.asarray(x, dtype=np.float64)
    if len(x) < 2:
        return math.nan
    if centered:
        x = x - x.mean(axis=0)
    n, d = x.shape
    if d <= n:
        _, vecs = np.linalg.eigh(x.T @ x)  # columns are the eigenvectors
        log_z = _logsumexp(np.concatenate([x @ vecs, -(x @ vecs)], axis=1), axis=0)
    else:  # d > n: the n right singular vectors, plus the null space where c . x = 0 (Z = n)
        _, _, vt = np.linalg.svd(x, full_matrices=False)
        proj = x @ vt.T
        log_z = np.append(_logsumexp(np.concatenate([proj, -proj], axis=1), axis=0), math.log(n))
    return float(math.exp(log_z.min() - log_z.max()))


def _mean_cos(v: np.ndarray) -> float:
    norms = np.linalg.norm(v, axis=1)
    keep = norms > 0
    n = int(keep.sum())
    if n < 2:
        return math.nan
    s = (v[keep] / norms[keep, None]).sum(axis=0)
    return float((s @ s - n) / (n * (n - 1)))


def abtt_components(d: int) -> int:
    """How many top components all-but-the-top removes: ceil(d / 100), as Mu & Viswanath."""
    return max(1, math.ceil(d / 100))


def abtt_avg_cos(x: np.ndarray, mean: np.ndarray, top: int | None = None) -> float:
    """avg_cos of ``x`` after subtracting ``mean`` and the top principal components of the result."""
    v = np.asarray(x, dtype=np.float64) - mean
    if len(v) < 2:
        return math.nan
    top = abtt_components(v.shape[1]) if top is None else top
    _, _, vt = np.linalg.svd(v, full_matrices=False)
    pcs = vt[:top]
    return _mean_cos(v - (v @ pcs.T) @ pcs)


def standardized_avg_cos(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> float:
    """avg_cos of ``x`` with every dimension z-scored; constant dimensions (std 0) are dropped."""
    std = np.asarray(std, dtype=np.float64)
    live = std > 0
    v = (np.asarray(x, dtype=np.float64)[:, live] - mean[live]) / std[live]
    return _mean_cos(v)
