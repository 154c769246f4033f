"""Covariance-spectrum metrics: IsoScore, effective rank, top-component share (numpy only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Spectrum:
    """Eigenvalue-derived isotropy metrics of one covariance matrix."""

    isoscore: float
    eff_rank: float
    top_pc_share: float


def eigenvalues(cov: np.ndarray) -> np.ndarray:
    """Eigenvalues of a symmetric PSD covariance, descending, tiny negatives clipped to 0.

    ``eigh`` (not ``eig``): the matrix is symmetric, so this is exact and real.
    """
    vals = np.linalg.eigvalsh(np.asarray(cov, dtype=np.float64))
    return np.clip(vals[::-1], 0.0, None)


def isoscore_from_eigenvalues(vals: np.ndarray) -> float:
    """IsoScore (Rudman et al. 2022) from covariance eigenvalues; 1 = isotropic, 0 = one direction.

    Same steps as the ``isoscore`` package: normalise the principal-component variances to
    norm sqrt(d), measure their distance to the all-ones vector, rescale to [0, 1].
    """
    d = float(len(vals))
    norm = float(np.linalg.norm(vals))
    if d < 2 or norm == 0.0:
        return float("nan")
    scaled = vals * np.sqrt(d) / norm
    defect = np.linalg.norm(scaled - 1.0) / np.sqrt(2.0 * (d - np.sqrt(d)))
    return float(((d - defect**2 * (d - np.sqrt(d))) ** 2 - d) / (d * (d - 1.0)))


def spectrum_metrics(cov: np.ndarray) -> Spectrum:
    """IsoScore, effective rank (exp of the entropy of normalised eigenvalues), top-PC share."""
    vals = eigenvalues(cov)
    total = float(vals.sum())
    if total <= 0.0:
        return Spectrum(float("nan"), float("nan"), float("nan"))
    p = vals[vals > 0] / total
    eff_rank = float(np.exp(-(p * np.log(p)).sum()))
    return Spectrum(isoscore_from_eigenvalues(vals), eff_rank, float(vals[0] / total))
