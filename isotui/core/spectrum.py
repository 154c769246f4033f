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


def sample_eigenvalues(sample: np.ndarray) -> np.ndarray:
    """The sample covariance's eigenvalues for n vectors of d > n dims, through the n x n Gram
    matrix of the centred vectors (same non-zero eigenvalues as the d x d covariance, whose
    other d - n + 1 are 0); descending, length d."""
    x = np.asarray(sample, dtype=np.float64)
    xc = x - x.mean(axis=0)
    gram = (xc @ xc.T) / (len(x) - 1)
    vals = eigenvalues(gram)
    out = np.zeros(x.shape[1])
    out[: len(vals)] = vals
    return out


def spectrum_metrics(cov: np.ndarray) -> Spectrum:
    """IsoScore, effective rank (exp of the entropy of normalised eigenvalues), top-PC share."""
    return spectrum_from_eigenvalues(eigenvalues(cov))


def spectrum_from_eigenvalues(vals: np.ndarray) -> Spectrum:
    """:func:`spectrum_metrics` from the descending eigenvalues themselves."""
    total = float(vals.sum())
    if total <= 0.0:
        return Spectrum(float("nan"), float("nan"), float("nan"))
    p = vals[vals > 0] / total
    eff_rank = float(np.exp(-(p * np.log(p)).sum()))
    return Spectrum(isoscore_from_eigenvalues(vals), eff_rank, float(vals[0] / total))
