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
- :class:`~isotui.core.exact_pass.ExactPass` (``--exact``): a second pass over the data with
  the first pass's mean, per-dimension std and the eigenvectors of the exact second moment and
  covariance, summing over every vector: unit-vector sums for the three mean cosines, a running
  logsumexp per direction (both signs) for I(W). Where a layer's d x d covariance was not held
  (very wide layers), I(W) and all-but-the-top stay the sample's.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import numpy.typing as npt

from isotui.core.isotropy import (
    Vectors,
    _abtt,
    _abtt_rows,
    _iw,
    _iw_of_log_z,
    _mean_cos,
    _principal,
    _t,
    log_partition,
)

if TYPE_CHECKING:
    import torch

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
    """I(W) of the rows and its SE over directions held fixed (the exact covariance's, not the
    sample's), from ``proj`` = rows @ directions (``parts`` cover every row): the jackknife from
    each group's log Z per direction and sign once, the whole's and each rest's as the logsumexp
    of the groups' (O(K d) after the projection, no eigh), widened by the bootstrap's measure of
    the min/max selection bias (:func:`selection_widened_se`)."""
    import torch

    per_group = torch.stack([log_partition(proj[idx]) for idx in parts])  # G x 2d
    theta = [
        _iw_of_log_z(torch.logsumexp(torch.cat([per_group[:g], per_group[g + 1 :]]), dim=0))
        for g in range(len(parts))
    ]
    value = _iw_of_log_z(torch.logsumexp(per_group, dim=0))
    boot = iw_bootstrap(proj, torch.cat(parts))
    return value, selection_widened_se(value, jackknife_se(np.asarray(theta)), boot)


# I(W) = min_c Z(c) / max_c Z(c) over 2d directions: from a sample, the smallest and largest of 2d
# noisy estimates, biased low where directions are near-tied (a nearly isotropic layer) in a way
# the jackknife, made for smooth statistics, does not see: at K = 256 its 95% intervals covered
# centred I(W) 76-87% of the time in simulations (issue 37: 90.5% on MiniLM). A row bootstrap
# sees the selection: BOOTSTRAP resamples of the reservoir, drawn with a fixed seed (the same
# reservoir gives the same SE).
BOOTSTRAP = 100
BOOTSTRAP_SEED = 0


def bootstrap_counts(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """BOOTSTRAP x ``k`` float32: how often each of ``k`` rows is drawn in each resample (one
    resample's draws at a time: 4 B k bytes in all, the plan's count)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(BOOTSTRAP_SEED)
    counts = torch.empty(BOOTSTRAP, k, dtype=torch.float32, device=device)
    for b in range(BOOTSTRAP):
        draws = torch.randint(0, k, (k,), generator=gen, device=device)
        counts[b] = torch.bincount(draws, minlength=k)
    return counts


def iw_bootstrap(proj: torch.Tensor, order: torch.Tensor | None = None) -> npt.NDArray[np.float64]:
    """I(W) of each bootstrap resample of the rows of ``proj`` (= rows @ directions): Z per
    direction and sign as the resample's counts times exp(projection - its largest), (B x K) @
    (K x block) float32 products over column blocks of a quarter of the directions (each term in
    (0, 1]; float32 is ample for a bias), so its working copies stay within a third of ``proj``.
    ``order``: the rows in the order the draws are dealt to (the reservoir's key order, so that a
    merged or streamed reservoir, whose rows come in another order, gives the same numbers)."""
    import torch

    counts = bootstrap_counts(len(proj), proj.device)
    rows = None if order is None else order.to(proj.device)
    block = max(1, -(-proj.shape[1] // 4))
    log_z: dict[float, list[torch.Tensor]] = {1.0: [], -1.0: []}
    for start in range(0, proj.shape[1], block):
        # the rows in key order: the same products summed in the same order, whatever order a
        # merged or streamed reservoir holds them in; one reordered copy serves both signs
        columns = proj[:, start : start + block]
        part = columns if rows is None else columns.index_select(0, rows)
        for sign in (1.0, -1.0):
            top = part.max(dim=0).values if sign > 0 else part.min(dim=0).values.neg_()
            # sign * part - top, as (part - top) or (-part - top): negation is exact
            shifted = part - top if sign > 0 else part.neg().sub_(top)
            z = counts @ shifted.exp_().to(torch.float32)
            del shifted
            log_z[sign].append(torch.log(z.to(top.dtype)) + top)
        del part
    both = torch.cat(log_z[1.0] + log_z[-1.0], dim=1)  # B x 2d
    return torch.exp(both.min(dim=1).values - both.max(dim=1).values).cpu().numpy().astype(np.float64)


def selection_widened_se(value: float, se: float, boot: npt.NDArray[np.float64]) -> float:
    """An SE whose interval value ± t·SE (t of the jackknife's 7 dof) holds the bias-corrected
    interval too: SE + |bias| / t with the bootstrap's bias (mean of the resamples minus the
    value) and the larger of the jackknife's and the bootstrap's spread. In simulations at K =
    256 (tests/test_sampled.py) this covers 93-100% where the jackknife alone covered 76-93%;
    a partition function set by a few extreme vectors (heavy tails) is still beyond any sample
    (use --exact)."""
    if not (math.isfinite(value) and math.isfinite(se)) or not np.all(np.isfinite(boot)):
        return se
    bias = float(boot.mean()) - value
    return abs(bias) / jackknife_t() + max(se, float(boot.std(ddof=1)))


# the jackknife's degrees of freedom: G groups give G - 1 (a 95% interval is t(0.975, 7) x SE)
SE_DOF = SE_GROUPS - 1


@functools.cache
def jackknife_t(level: float = 0.95, dof: int = SE_DOF) -> float:
    """Student's t quantile for a two-sided ``level`` interval with the jackknife's ``dof``:
    2.3646 for 95% and 7 degrees of freedom."""
    from scipy.special import stdtrit

    return float(stdtrit(dof, 0.5 + level / 2))


def sample_metrics(
    x: Vectors,
    mean: Vectors,
    std: Vectors,
    groups: Groups | None = None,
    directions: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, float]:
    """I(W), centred I(W), all-but-the-top and standardised avg_cos of the rows of ``x`` given the
    exact ``mean`` and per-dimension ``std``; the centred eigendecomposition serves both the
    centred I(W) and all-but-the-top. ``directions``: the eigenvectors (columns, largest first) of
    the exact X^T X and covariance over every vector (:mod:`isotui.core.exact_spectrum`), which
    then replace the sample's own. With ``groups`` (disjoint row indices), also their jackknife
    standard errors (``*_se``, above)."""
    x = _t(x)
    if len(x) < 2:
        return {}
    centred = x - _t(mean, x.device)
    if directions is not None:
        return _exact_direction_metrics(x, centred, std, groups, *directions)
    # one n x d working copy at a time beside x and centred (the plan's finalisation workspace,
    # isotui.extract.memory_plan.finalisation_workspace_bytes): each is freed before the next
    z = _standardized(centred, std)
    out = {"avg_cos_std": _mean_cos(z)}
    if groups is not None:
        out["avg_cos_std_se"] = cos_jackknife_se(z, groups)
    del z
    vecs, null = _principal(x)
    vecs_c, null_c = _principal(centred)
    out |= {
        "iw": _iw(x, vecs, null),
        "iw_centered": _iw(centred, vecs_c, null_c),
        "avg_cos_abtt": _abtt(centred, vecs_c),
    }
    if groups is not None:
        out |= eigen_jackknife_se(x, centred, groups)
    return out


def _standardized(centred: torch.Tensor, std: Vectors) -> torch.Tensor:
    """The centred rows z-scored, constant dimensions (std 0) dropped: the same numbers as
    :func:`standardized_avg_cos` makes from the rows, made once for the metric and its SE."""
    std_t = _t(std, centred.device)
    live = std_t > 0
    return centred[:, live] / std_t[live]


def _exact_direction_metrics(
    x: torch.Tensor,
    centred: torch.Tensor,
    std: Vectors,
    groups: Groups | None,
    vecs: torch.Tensor,
    vecs_c: torch.Tensor,
) -> dict[str, float]:
    """:func:`sample_metrics` over the exact directions ``vecs`` (X^T X) and ``vecs_c`` (the
    covariance): no decomposition of the sample, and standard errors with the directions held
    (they are not estimated from the sample, so only Z's and the mean cosines' sampling is left)."""
    # one n x d working copy at a time beside x and centred (the plan's finalisation workspace,
    # isotui.extract.memory_plan.finalisation_workspace_bytes): each is freed before the next
    out: dict[str, float] = {}
    for name, rows, directions in (("iw", x, vecs), ("iw_centered", centred, vecs_c)):
        proj = rows @ directions
        if groups is None:
            out[name] = _iw_of_log_z(log_partition(proj))
        else:
            out[name], out[f"{name}_se"] = held_iw_jackknife(proj, groups)
        del proj
    _add_mean_cos(out, "avg_cos_abtt", _abtt_rows(centred, vecs_c), groups)
    _add_mean_cos(out, "avg_cos_std", _standardized(centred, std), groups)
    return out


def _add_mean_cos(out: dict[str, float], name: str, rows: torch.Tensor, groups: Groups | None) -> None:
    """``out[name]``: the mean cosine of ``rows``, and with ``groups`` its jackknife SE."""
    out[name] = _mean_cos(rows)
    if groups is not None:
        out[f"{name}_se"] = cos_jackknife_se(rows, groups)
