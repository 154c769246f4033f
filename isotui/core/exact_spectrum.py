"""A layer's exact covariance and second moment, each decomposed once on the accumulators' device.

Where a layer's d x d sums are held (:class:`~isotui.core.accumulator.LayerAccumulator` with
``full_cov``), one float64 ``eigh`` of the centred scatter gives the spectrum metrics (IsoScore,
IsoScore*, effective rank, top-PC share: functions of the covariance's eigenvalues) and the
principal directions that all-but-the-top removes and centred I(W) ranges over; one ``eigh`` of
the uncentred second moment X^T X gives I(W)'s directions. Both are exact: every vector is in them.

What stays per-vector (the reservoir, or ``--exact``'s second pass), and why: I(W)'s partition
function Z(c) = sum_i exp(c . x_i) depends on every moment of the data along c, not only on the
second; avg_cos_centered, all-but-the-top and standardised avg_cos are mean cosines, which
normalise each vector *after* centring, projecting or z-scoring it by quantities known only once
every vector has been seen (||x_i - x_bar|| is not a function of the sums). Only their directions,
mean and std come from the sums, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ExactEigen:
    """The exact eigendecompositions of one layer (torch float64, on the accumulators' device)."""

    values: torch.Tensor  # the covariance's eigenvalues (scatter / (n - 1)), descending, >= 0
    # their eigenvectors as columns, largest first (ABTT, centred I(W)), and X^T X's (I(W)); None
    # where no metric uses directions (eigenvalues alone: ``directions=False`` below)
    vecs_c: torch.Tensor | None
    vecs: torch.Tensor | None


def moments(
    gram: torch.Tensor, shift: torch.Tensor, sum_xs: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(X^T X, the centred scatter sum_i (x_i - x_bar)(x_i - x_bar)^T) of ``n`` vectors from their
    sums shifted by ``shift`` (gram = sum (x - s)(x - s)^T, sum_xs = sum (x - s)), in float64:
    X^T X = gram + s sum_xs^T + sum_xs s^T + n s s^T, scatter = gram - n m_s m_s^T with m_s the
    shifted mean, small whatever the data's common mean (no cancellation of large terms)."""
    import torch

    cross = torch.outer(shift, sum_xs)
    second = gram + cross + cross.T + n * torch.outer(shift, shift)
    ms = sum_xs / n
    scatter = gram - n * torch.outer(ms, ms)
    return second, scatter


def exact_eigen(
    gram: torch.Tensor, shift: torch.Tensor, sum_xs: torch.Tensor, n: int, *, directions: bool = True
) -> ExactEigen:
    """The two ``eigh`` (never ``eig``: both matrices are symmetric) of :func:`moments`, on the
    sums' own device (a GPU decomposes a d = 4,096 matrix in well under a second). Without
    ``directions`` (no metric reads them: wider than the reservoir metrics go, or no reservoir),
    the covariance's eigenvalues alone: one ``eigvalsh``, no eigenvectors and no X^T X, a
    fraction of the time at the widths where it matters (d = 16,384)."""
    import torch

    second, scatter = moments(gram, shift, sum_xs, n)
    if not directions:
        return ExactEigen((torch.linalg.eigvalsh(scatter).flip(0) / (n - 1)).clamp_min(0.0), None, None)
    vals_c, vecs_c = torch.linalg.eigh(scatter)
    vecs = torch.linalg.eigh(second)[1]
    values = (vals_c.flip(0) / (n - 1)).clamp_min(0.0)
    return ExactEigen(values, vecs_c.flip(1), vecs.flip(1))


def exact_eigens(
    sums: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]], *, directions: bool = True
) -> list[ExactEigen]:
    """:func:`exact_eigen` of several layers of one d on one device in one batched ``eigh`` (a
    stack of every layer's scatter and X^T X): on a GPU one call instead of 2 L, each of which
    would wait for the device to say it converged. ``sums``: (gram, shift, sum_xs, n) per layer;
    without ``directions``, one batched ``eigvalsh`` of the scatters."""
    import torch

    if len(sums) == 1:
        return [exact_eigen(*sums[0], directions=directions)]
    if not directions:
        scatters = torch.stack([moments(*s)[1] for s in sums])
        vals = torch.linalg.eigvalsh(scatters)
        return [
            ExactEigen((v.flip(0) / (n - 1)).clamp_min(0.0), None, None)
            for v, (_, _, _, n) in zip(vals, sums, strict=True)
        ]
    mats = []
    for gram, shift, sum_xs, n in sums:
        second, scatter = moments(gram, shift, sum_xs, n)
        mats += [scatter, second]
    vals, vecs = torch.linalg.eigh(torch.stack(mats))
    del mats
    out = []
    for i, (_, _, _, n) in enumerate(sums):
        values = (vals[2 * i].flip(0) / (n - 1)).clamp_min(0.0)
        out.append(ExactEigen(values, vecs[2 * i].flip(1), vecs[2 * i + 1].flip(1)))
    return out
