"""The reservoir-sampled metrics' uncertainty, and their exact values from a second pass.

avg_cos_centered, I(W), centred I(W), all-but-the-top and standardised avg_cos need the final
mean (and std, and principal directions) before they can look at a vector, so one streaming pass
computes them on the reservoir sample. Two ways to know how far that is from every vector:

- standard errors from disjoint sub-samples (:func:`key_groups`): the reservoir, sorted by its
  keys (uniform and independent of the data), is cut into G = :data:`SE_GROUPS` groups, and each
  metric gets the delete-a-group jackknife, SE^2 = (G - 1) / G sum_g (theta_(g) - mean)^2 with
  theta_(g) the metric without group g. The mean cosines come from per-group unit-vector sums;
  I(W), centred I(W) and all-but-the-top are recomputed without each group over the exact
  covariance's directions where the d x d sums are held (:func:`held_iw_jackknife`: the
  directions are not estimated from the sample, so they are held), else over the rest's own
  principal directions, found again (:func:`eigen_jackknife_se`). Why the jackknife rather
  than batch means (sd of the groups' own values / sqrt(G)):
  a mean cosine of centred vectors is close to a degenerate U-statistic, whose variance falls as
  1 / K^2, not 1 / K (batch means: sqrt(8) = 2.8x too high; the jackknife at most ~1.5x), and
  I(W) on K / G vectors is far from I(W) on K. They measure sampling noise, not a small sample's
  bias, and are 0 when the reservoir holds every vector.
- :class:`ExactPass` (``--exact``): a second pass over the data with the first pass's mean,
  per-dimension std and the eigenvectors of the exact second moment and covariance, summing over
  every vector: unit-vector sums for the three mean cosines, a running logsumexp per direction
  (both signs) for I(W). Where a layer's d x d covariance was not held (very wide layers), I(W)
  and all-but-the-top stay the sample's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import numpy.typing as npt

from isotui.core.isotropy import abtt_components

if TYPE_CHECKING:
    import torch

    from isotui.core.accumulator import LayerAccumulator, LayerStats

# disjoint groups of reservoir row indices (index tensors), from :func:`key_groups`
Groups: TypeAlias = "tuple[torch.Tensor, ...]"

SE_GROUPS = 8
SAMPLED = ("avg_cos_centered", "iw", "iw_centered", "avg_cos_abtt", "avg_cos_std")
EIGEN_METRICS = ("iw", "iw_centered", "avg_cos_abtt")  # need the covariance's eigenvectors
# wider and without the exact covariance: no SE for those three (2 G eigendecompositions per layer)
EIGEN_JACKKNIFE_MAX_DIM = 1024


def se_name(metric: str) -> str:
    return f"{metric}_se"


def key_groups(keys: torch.Tensor, groups: int = SE_GROUPS) -> Groups | None:
    """The reservoir's row indices cut into ``groups`` disjoint groups in key order (each a
    uniform sample, the keys being independent of the data); None when a group would be tiny."""
    import torch

    if len(keys) < 2 * groups:
        return None
    return torch.tensor_split(torch.argsort(keys), groups)


def jackknife_se(theta: npt.NDArray[np.float64]) -> float:
    """The delete-a-group jackknife SE from the G leave-one-group-out values."""
    g = len(theta)
    if not np.all(np.isfinite(theta)):
        return math.nan
    return float(math.sqrt((g - 1) / g * ((theta - theta.mean()) ** 2).sum()))


def cos_jackknife_se(v: torch.Tensor, parts: Groups) -> float:
    """Jackknife SE of the mean pairwise cosine of the rows of ``v`` (zero rows left out), from
    each group's sum of unit vectors: O(d) per group."""
    import torch

    norms = torch.linalg.vector_norm(v, dim=1)
    keep = norms > 0
    u = (v / torch.where(keep, norms, 1.0)[:, None]).masked_fill_(~keep[:, None], 0.0)  # one n x d copy
    sums = torch.stack([u[idx].sum(0) for idx in parts]).cpu().numpy()
    counts = np.array([int(keep[idx].sum()) for idx in parts], dtype=np.float64)
    rest = sums.sum(0) - sums
    n_rest = counts.sum() - counts
    if np.any(n_rest < 2):
        return math.nan
    return jackknife_se((np.einsum("gd,gd->g", rest, rest) - n_rest) / (n_rest * (n_rest - 1)))


def eigen_jackknife_se(x: torch.Tensor, centred: torch.Tensor, parts: Groups) -> dict[str, float]:
    """Jackknife SEs of I(W), centred I(W) and all-but-the-top where the exact covariance is not
    held (else :func:`held_iw_jackknife`), the principal directions found again without each
    group (their estimation is most of these metrics' sampling noise: holding
    them fixed gave a third of the spread between reservoirs on MiniLM). 2 G eigendecompositions:
    skipped (NaN) above :data:`EIGEN_JACKKNIFE_MAX_DIM` dims, where ``--exact`` is the answer.

    The d x d sums without group g are the whole sample's minus group g's, each group's summed
    once: 2 K d^2 products in all rather than 2 (G - 1) K d^2 for a sum per group and variant
    (MiniLM's 4,096-vector reservoir: a fifth of the jackknife's time). Only the last bits of the
    sums' rounding differ from summing the rest directly (tests/test_sampled.py holds the values
    to 1e-9 of that)."""
    import torch

    from isotui.core.isotropy import _abtt, _iw, _principal

    n, d = x.shape
    if d > EIGEN_JACKKNIFE_MAX_DIM:
        return {se_name(m): math.nan for m in EIGEN_METRICS}
    by_sums = d <= n - max(len(idx) for idx in parts)  # else _principal takes the rows' SVD
    grams = [(x[idx].T @ x[idx], centred[idx].T @ centred[idx]) for idx in parts] if by_sums else []
    whole = sum((g for g, _ in grams), torch.zeros(d, d, dtype=x.dtype, device=x.device))
    whole_c = sum((g for _, g in grams), torch.zeros(d, d, dtype=x.dtype, device=x.device))
    theta: dict[str, list[float]] = {m: [] for m in EIGEN_METRICS}
    for g, idx in enumerate(parts):
        keep = torch.ones(n, dtype=torch.bool, device=x.device)
        keep[idx] = False
        # the rest's rows one copy at a time (x's, then the centred ones): the same numbers
        rest = x[keep]
        if by_sums:  # as _principal does with the rest's own x^T x: eigh, largest first
            vecs, null = torch.linalg.eigh(whole - grams[g][0])[1].flip(1), False
        else:
            vecs, null = _principal(rest)
        theta["iw"].append(_iw(rest, vecs, null))
        del rest
        rest_c = centred[keep]
        if by_sums:
            vecs_c, null_c = torch.linalg.eigh(whole_c - grams[g][1])[1].flip(1), False
        else:
            vecs_c, null_c = _principal(rest_c)
        theta["iw_centered"].append(_iw(rest_c, vecs_c, null_c))
        theta["avg_cos_abtt"].append(_abtt(rest_c, vecs_c))
        del rest_c
    return {se_name(m): jackknife_se(np.asarray(v)) for m, v in theta.items()}


def held_iw_jackknife(proj: torch.Tensor, parts: Groups) -> tuple[float, float]:
    """I(W) of the rows and its jackknife SE over directions held fixed (the exact covariance's,
    not the sample's), from ``proj`` = rows @ directions (``parts`` cover every row): each
    group's log Z per direction and sign once; the whole's and each rest's as the logsumexp of
    the groups' (O(K d) after the projection, no eigh)."""
    import torch

    from isotui.core.isotropy import _iw_of_log_z, log_partition

    per_group = torch.stack([log_partition(proj[idx]) for idx in parts])  # G x 2d
    theta = [
        _iw_of_log_z(torch.logsumexp(torch.cat([per_group[:g], per_group[g + 1 :]]), dim=0))
        for g in range(len(parts))
    ]
    return _iw_of_log_z(torch.logsumexp(per_group, dim=0)), jackknife_se(np.asarray(theta))


class ExactPass:
    """One layer's second pass: every vector, the first pass's mean, std and eigenvectors.

    Same two-phase interface as :class:`~isotui.core.accumulator.LayerAccumulator` (``partial``
    allocates, ``commit`` adds), so a batch that runs out of memory can be retried."""

    def __init__(self, acc: LayerAccumulator) -> None:
        import torch

        from isotui.core.products import split_right

        f64, dev = torch.float64, acc.device
        self.device = dev
        n = acc.n_all
        self.mean = acc.sum_x / n
        std = torch.as_tensor(acc.dim_std(n), dtype=f64, device=dev)
        self.live = torch.nonzero(std > 0).squeeze(1)  # indices, read once here: no mask per batch
        self.std = std[self.live]
        # full_cov holds the gram matrix; n >= 2 means a batch has set the shift
        exact = acc.exact_eigen()
        self.eigen = exact is not None
        if exact is not None:
            self.vecs, self.vecs_c = exact.vecs, exact.vecs_c  # largest first
            self.top = self.vecs_c[:, : abtt_components(acc.dim)]
            # the products with the centred vectors are float32 (see isotui.core.products), I(W)'s
            # split three ways (one float32 product moved it by 5e-6); x . w = (x - mean) . w +
            # mean . w, the second in float64 once per layer
            self.both = split_right(torch.cat([self.vecs, self.vecs_c], 1))
            self.offset = self.vecs.T @ self.mean
            self.log_z = torch.full((2 * acc.dim,), -math.inf, dtype=f64, device=dev)
            self.log_zc = torch.full((2 * acc.dim,), -math.inf, dtype=f64, device=dev)
        self.sums = {m: torch.zeros(acc.dim, dtype=f64, device=dev) for m in ("centered", "abtt")}
        self.sums["std"] = torch.zeros(len(self.live), dtype=f64, device=dev)
        # counts stay on the device until :meth:`values` (reading one would wait for it)
        self.counts = {m: torch.zeros((), dtype=torch.int64, device=dev) for m in self.sums}

    def partial(self, x: torch.Tensor, *_ignored: object) -> dict[str, Any]:
        """Sums of one batch's vectors ``x`` (m x d); nothing is read on the host (zero rows are
        masked, not dropped), and the d x d products are float32 (see isotui.core.products)."""
        import torch

        from isotui.core.products import mm32, mm_split

        x64 = x.to(self.device).to(torch.float64)
        v = x64 - self.mean
        parts = {"centered": v, "std": v.index_select(1, self.live) / self.std}
        out: dict[str, Any] = {}
        if self.eigen:
            d = self.top.shape[0]
            # m x d x k, k = d / 100, in float32: within 1e-9 of float64 on avg_cos_abtt
            parts["abtt"] = v - mm32(mm32(v, self.top), self.top.T)
            both = mm_split(v, self.both)  # logsumexp in float64: I(W) is a ratio of exps
            proj, proj_c = both[:, :d], both[:, d:]
            out["log_z"] = torch.cat([torch.logsumexp(proj, 0), torch.logsumexp(-proj, 0)])
            out["log_z"] += torch.cat([self.offset, -self.offset])
            out["log_zc"] = torch.cat([torch.logsumexp(proj_c, 0), torch.logsumexp(-proj_c, 0)])
        for name, rows in parts.items():
            norms = torch.linalg.vector_norm(rows, dim=1)
            keep = norms > 0
            out[name] = ((rows / torch.where(keep, norms, 1.0)[:, None]).sum(0), keep.sum())
        return out

    def commit(self, p: dict[str, Any]) -> None:
        import torch

        for name in self.sums:
            if name in p:
                self.sums[name].add_(p[name][0])
                self.counts[name].add_(p[name][1])
        if "log_z" in p and len(p["log_z"]):
            torch.logaddexp(self.log_z, p["log_z"], out=self.log_z)
            torch.logaddexp(self.log_zc, p["log_zc"], out=self.log_zc)

    def values(self) -> dict[str, float]:
        """The exact metrics (and their standard errors, 0)."""
        from isotui.core.accumulator import avg_cos_from_sums

        def mean_cos(name: str) -> float:
            return avg_cos_from_sums(self.sums[name].cpu().numpy(), int(self.counts[name]))

        out = {"avg_cos_centered": mean_cos("centered"), "avg_cos_std": mean_cos("std")}
        if self.eigen:
            out["avg_cos_abtt"] = mean_cos("abtt")
            out["iw"] = float(np.exp(float(self.log_z.min() - self.log_z.max())))
            out["iw_centered"] = float(np.exp(float(self.log_zc.min() - self.log_zc.max())))
        return out | {se_name(m): 0.0 for m in out}

    def apply(self, stats: LayerStats) -> LayerStats:
        """``stats`` with the sampled metrics replaced by the exact ones."""
        # mypy checks a **dict against every field; the keys are SAMPLED and their SEs (floats)
        return dataclasses.replace(stats, **self.values())  # type: ignore[arg-type]


# the jackknife's degrees of freedom: G groups give G - 1 (a 95% interval is t(0.975, 7) x SE)
SE_DOF = SE_GROUPS - 1


def jackknife_t(level: float = 0.95, dof: int = SE_DOF) -> float:
    """Student's t quantile for a two-sided ``level`` interval with the jackknife's ``dof``:
    2.3646 for 95% and 7 degrees of freedom."""
    from scipy.special import stdtrit

    return float(stdtrit(dof, 0.5 + level / 2))
