"""Trajectories of the mean query and key across training checkpoints (Godey et al. 2024,
section 5.2 and App. C): one 2-D basis shared by every checkpoint, from a singular value
decomposition of their queries and keys together (or of the queries only, or the keys only)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

BASES = ("qk", "q", "k")  # the union of queries and keys (the paper's main view), or one side


def common_basis(samples: list[npt.NDArray[np.float64]], k: int = 2) -> npt.NDArray[np.float64]:
    """The top ``k`` right singular vectors (k x d) of all ``samples`` stacked, uncentered (the
    mean directions are what the trajectories follow). Each vector's sign is fixed so that its
    largest-magnitude component is positive: the same data always gives the same picture."""
    rows = [s for s in samples if s.size]
    if not rows:
        return np.zeros((0, 0))
    x = np.concatenate(rows).astype(np.float64)
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    basis = vt[:k]
    pivot = np.argmax(np.abs(basis), axis=1)
    signs = np.sign(basis[np.arange(len(basis)), pivot])
    return basis * np.where(signs == 0, 1.0, signs)[:, None]


def project(vectors: npt.ArrayLike, basis: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Coordinates (..., k) of ``vectors`` (..., d) in ``basis`` (k x d, orthonormal rows)."""
    coords: npt.NDArray[np.float64] = np.asarray(vectors, dtype=np.float64) @ basis.T
    return coords
