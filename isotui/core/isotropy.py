"""Isotropy metrics beyond the mean cosine, each by its published definition (float64; torch,
so that they run on the accumulators' device).

- IsoScore* (Rudman & Eickhoff 2024): IsoScore of the shrunk covariance (1 - zeta) C + zeta C0,
  with C0 = (tr(C) / d) I, the isotropic covariance of the same total variance (the target of
  Ledoit & Wolf's shrinkage). Its eigenvalues are (1 - zeta) lambda + zeta mean(lambda), so it
  comes from the same spectrum as IsoScore and, like IsoScore, does not change when the vectors
  are scaled (C0 = I, the package's suggestion, would: 0.9997 / 0.575 / 0.254 for one cloud
  times 0.1 / 1 / 10).
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
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import numpy.typing as npt

from isotui.core.spectrum import isoscore_from_eigenvalues

if TYPE_CHECKING:
    import torch

# rows of vectors (or a vector) as numpy or torch: ``_t`` makes either a float64 tensor
Vectors: TypeAlias = "npt.ArrayLike | torch.Tensor"

ISOSCORE_STAR_ZETA = 0.2


def isoscore_star(eigenvalues: npt.NDArray[np.float64], zeta: float = ISOSCORE_STAR_ZETA) -> float:
    """IsoScore* with C0 = (tr(C) / d) I, from the covariance eigenvalues (all d of them): the
    target has the data's own scale, so scaling the vectors leaves the score unchanged."""
    vals = np.asarray(eigenvalues, dtype=np.float64)
    if not np.all(np.isfinite(vals)):
        return math.nan
    return isoscore_from_eigenvalues((1.0 - zeta) * vals + zeta * vals.mean())


def _t(x: Vectors, device: torch.device | None = None) -> torch.Tensor:
    """float64 torch tensor (on ``x``'s own device when it is one: a GPU does the eigh in ms)."""
    import torch

    return torch.as_tensor(x, dtype=torch.float64, device=device)


def _principal(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Principal directions of the rows of ``x`` (torch float64): the eigenvectors of x^T x as
    columns (``eigh``, never ``eig``), largest eigenvalue first; when d > n, the n right singular
    vectors, plus a flag that the other d - n directions (a null space) exist."""
    import torch

    n, d = x.shape
    if d <= n:
        _, vecs = torch.linalg.eigh(x.T @ x)
        return vecs.flip(1), False
    _, _, vt = torch.linalg.svd(x, full_matrices=False)
    return vt.T, True


def _iw(x: torch.Tensor, vecs: torch.Tensor, null: bool) -> float:
    """min over max of Z(c) = sum_i exp(c . x_i) over the directions (both signs), in log space;
    a null-space direction has Z = n."""
    import torch

    log_z = log_partition(x @ vecs)
    if null:
        log_z = torch.cat([log_z, log_z.new_tensor([math.log(len(x))])])
    return _iw_of_log_z(log_z)


def log_partition(proj: torch.Tensor) -> torch.Tensor:
    """log Z(c) for each direction c (the columns of ``proj`` = x @ directions) and each sign:
    the first d entries for +c, the next d for -c."""
    import torch

    # each sign on its own: the same sums as over [proj, -proj], without that copy (half the time)
    return torch.cat([torch.logsumexp(proj, dim=0), torch.logsumexp(-proj, dim=0)])


def partition_isotropy(x: Vectors, *, centered: bool = False) -> float:
    """I(W) of the rows of ``x`` (numpy or torch): min_c Z(c) / max_c Z(c) over the eigenvectors
    c of X^T X, computed as exp(min log Z - max log Z)."""
    x = _t(x)
    if len(x) < 2:
        return math.nan
    if centered:
        x = x - x.mean(0)
    return _iw(x, *_principal(x))


def _iw_of_log_z(log_z: torch.Tensor) -> float:
    """min over max of Z, from log Z (never overflows)."""
    import torch

    return float(torch.exp(log_z.min() - log_z.max()))


def _mean_cos(v: torch.Tensor) -> float:
    import torch

    norms = torch.linalg.vector_norm(v, dim=1)
    keep = norms > 0
    n = int(keep.sum())
    if n < 2:
        return math.nan
    # every row kept (the usual case): no masked copy of v first (the same values and sums)
    s = (v / norms[:, None]).sum(0) if n == len(v) else (v[keep] / norms[keep, None]).sum(0)
    return float((s @ s - n) / (n * (n - 1)))


def abtt_components(d: int) -> int:
    """How many top components all-but-the-top removes: ceil(d / 100), as Mu & Viswanath."""
    return max(1, math.ceil(d / 100))


def abtt_avg_cos(x: Vectors, mean: Vectors, top: int | None = None) -> float:
    """avg_cos of ``x`` after subtracting ``mean`` and the top principal components of the result."""
    v = _t(x) - _t(mean, _t(x).device)
    if len(v) < 2:
        return math.nan
    return _abtt(v, _principal(v)[0], top)


def _abtt(v: torch.Tensor, vecs: torch.Tensor, top: int | None = None) -> float:
    """avg_cos of the centred rows ``v`` without their projections on the top principal
    directions ``vecs`` (columns, largest first)."""
    return _mean_cos(_abtt_rows(v, vecs, top))


def _abtt_rows(v: torch.Tensor, vecs: torch.Tensor, top: int | None = None) -> torch.Tensor:
    """The centred rows ``v`` without their projections on the top directions of ``vecs``."""
    top = abtt_components(v.shape[1]) if top is None else top
    pcs = vecs[:, :top]
    return v - (v @ pcs) @ pcs.T


def standardized_avg_cos(x: Vectors, mean: Vectors, std: Vectors) -> float:
    """avg_cos of ``x`` with every dimension z-scored; constant dimensions (std 0) are dropped."""
    x = _t(x)
    std = _t(std, x.device)
    live = std > 0
    return _mean_cos((x[:, live] - _t(mean, x.device)[live]) / std[live])
