"""Drift correlation across a model's layers (Godey et al. 2024, Fig. 5 and 16).

Spearman's p is a permutation p, as ``scipy.stats.permutation_test`` defines it (one variable's
values permuted, the statistic rho on the average ranks of tied values, two-sided p =
min(1, 2 min(P(rho* <= rho), P(rho* >= rho)))): exact over all n! pairings when that is
computable, else a seeded Monte Carlo estimate with its standard error. scipy's t approximation,
accurate only for hundreds of points, is kept beside it (``spearman_p_t``).

Spearman's and Pearson's coefficients and t/beta p-values are computed here exactly as
``scipy.stats.spearmanr``, ``pearsonr`` and ``rankdata`` compute them (the same operations, so the
same bits: tests/test_core.py compares them with scipy), from ``scipy.special`` alone: importing
``scipy.stats`` costs about half a second of every ``isotui run`` (issue 15).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt

# Without ties the null distribution of S = sum d^2 is counted exactly by a dynamic programme
# over the subsets of ranks used (2^n x n^3/6 counts: 60 MB at n = 14); with ties, all n!
# pairings are enumerated (3.6 million at n = 10). Beyond: Monte Carlo.
EXACT_DP_MAX_N = 14
EXACT_ENUM_MAX_N = 10
MC_PERMUTATIONS = 1_000_000
MC_SEED = 0
_CHUNK = 1 << 17


@dataclass(frozen=True)
class DriftCorrelation:
    """Spearman and Pearson correlation of drift norm vs average cosine over layers.

    ``spearman_p`` is the permutation p (``spearman_p_method``: ``exact`` or ``monte-carlo``,
    whose standard error is ``spearman_p_se``; 0 when exact); ``spearman_p_t`` is scipy's
    t approximation."""

    n_layers: int
    spearman_rho: float
    spearman_p: float
    pearson_r: float
    pearson_p: float
    spearman_p_t: float = math.nan
    spearman_p_method: str = ""
    spearman_p_se: float = math.nan

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def drift_correlation(drift_norm: list[float], avg_cos: list[float]) -> DriftCorrelation:
    """Correlate per-layer drift norm with per-layer avg cosine (NaN when undefined)."""
    x = np.asarray(drift_norm, dtype=np.float64)
    y = np.asarray(avg_cos, dtype=np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    nan = math.nan
    if len(x) < 3 or np.ptp(x) == 0.0 or np.ptp(y) == 0.0:
        return DriftCorrelation(len(x), nan, nan, nan, nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rho, rho_p = spearman(x, y)
        r, r_p = pearson(x, y)
    perm = spearman_permutation_p(x, y)
    return DriftCorrelation(
        len(x),
        rho,
        perm.p,
        r,
        r_p,
        spearman_p_t=rho_p,
        spearman_p_method=perm.method,
        spearman_p_se=perm.se,
    )


def rankdata(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Ranks 1..n of ``x``, tied values sharing their average rank (``scipy.stats.rankdata``)."""
    order = np.argsort(x, kind="mergesort")
    inverse = np.empty(len(x), dtype=np.intp)
    inverse[order] = np.arange(len(x))
    xs = x[order]
    first = np.r_[True, xs[1:] != xs[:-1]]  # where each run of equal values starts
    dense = np.cumsum(first)[inverse]
    count = np.r_[np.nonzero(first)[0], len(first)]
    ranks: npt.NDArray[np.float64] = 0.5 * (count[dense] + count[dense - 1] + 1)
    return ranks


def spearman(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> tuple[float, float]:
    """(rho, two-sided t-approximation p) as ``scipy.stats.spearmanr(x, y)`` computes them, for
    finite, non-constant x and y of length >= 3."""
    from scipy.special import stdtr

    ranked = np.column_stack((rankdata(x), rankdata(y)))
    rs = np.asarray(np.corrcoef(ranked, rowvar=False))
    dof = len(x) - 2
    with np.errstate(divide="ignore"):
        t = rs * np.sqrt((dof / ((rs + 1.0) * (1.0 - rs))).clip(0))
    p = 2 * stdtr(dof, -np.abs(t))
    return float(rs[1, 0]), float(p[1, 0])


def pearson(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> tuple[float, float]:
    """(r, two-sided p from r's beta null) as ``scipy.stats.pearsonr(x, y)`` computes them, for
    finite, non-constant x and y of length >= 3."""
    from scipy.special import betaincc

    def unit(v: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        vm = v - np.mean(v, axis=-1, keepdims=True)
        vmax = np.max(np.abs(vm), axis=-1, keepdims=True)  # scaled first: no overflow
        out: npt.NDArray[np.float64] = vm / (vmax * np.linalg.norm(vm / vmax, ord=2, axis=-1, keepdims=True))
        return out

    r = np.clip(np.dot(unit(x), unit(y)), -1.0, 1.0)  # np.vecdot's bits; np.vecdot is numpy 2.0+
    ab = np.asarray(np.float64(len(x)) / 2 - 1, dtype=np.float64)
    p = 2 * betaincc(ab, ab, (np.abs(r) - -1) / 2)
    return float(r), float(p)


@dataclass(frozen=True)
class PermutationP:
    p: float
    method: str  # "exact" or "monte-carlo"
    se: float  # standard error of a Monte Carlo p (0 when exact)


def spearman_permutation_p(
    x: np.ndarray, y: np.ndarray, *, n_resamples: int = MC_PERMUTATIONS, seed: int = MC_SEED
) -> PermutationP:
    """Two-sided permutation p of Spearman's rho under independence, as
    ``scipy.stats.permutation_test(..., permutation_type="pairings")`` defines it."""
    rx, ry = rankdata(x), rankdata(y)
    n = len(rx)
    ties = len(np.unique(rx)) < n or len(np.unique(ry)) < n
    if not ties and n <= EXACT_DP_MAX_N:
        return _exact_no_ties(rx, ry)
    a, b = rx - rx.mean(), ry - ry.mean()
    scale = np.linalg.norm(a) * np.linalg.norm(b)
    observed = float(a @ b) / scale
    gamma = abs(observed) * np.finfo(np.float64).eps * 100  # scipy's tolerance for equal values
    if n <= EXACT_ENUM_MAX_N:
        less = greater = 0
        for perms in _permutation_chunks(n):
            rho = (b[perms] @ a) / scale
            less += int(np.count_nonzero(rho <= observed + gamma))
            greater += int(np.count_nonzero(rho >= observed - gamma))
        total = math.factorial(n)
        return PermutationP(min(1.0, 2 * min(less, greater) / total), "exact", 0.0)
    rng = np.random.default_rng(seed)
    less = greater = 0
    done = 0
    buf = np.tile(b, (min(_CHUNK, n_resamples), 1))
    while done < n_resamples:
        m = min(_CHUNK, n_resamples - done)
        # shuffled in place: a uniform shuffle of any ordering is a uniform ordering
        rng.permuted(buf, axis=1, out=buf)
        rho = (buf[:m] @ a) / scale
        less += int(np.count_nonzero(rho <= observed + gamma))
        greater += int(np.count_nonzero(rho >= observed - gamma))
        done += m
    # scipy's Monte Carlo p counts the observed pairing as one of the resamples
    one_sided = (min(less, greater) + 1) / (n_resamples + 1)
    p = min(1.0, 2 * one_sided)
    se = 2 * math.sqrt(one_sided * (1 - one_sided) / n_resamples) if p < 1.0 else 0.0
    return PermutationP(p, "monte-carlo", se)


def _permutation_chunks(n: int) -> Iterator[npt.NDArray[np.int8]]:
    """Every permutation of range(n) as rows of int8 arrays, in chunks of whole prefixes (the
    first element fixed per chunk, at most (n-1)! rows each)."""
    rest = _all_permutations(n - 1)
    for first in range(n):
        others = np.array([k for k in range(n) if k != first], dtype=np.int8)
        for start in range(0, len(rest), _CHUNK):
            block = others[rest[start : start + _CHUNK]]
            yield np.concatenate([np.full((len(block), 1), first, dtype=np.int8), block], axis=1)


def _all_permutations(n: int) -> np.ndarray:
    """All n! permutations of range(n) as an (n!, n) int8 array, built by inserting the largest
    element into every position of the permutations of range(n - 1)."""
    perms = np.zeros((1, 0), dtype=np.int8)
    for k in range(n):
        m = len(perms)
        out = np.empty((m * (k + 1), k + 1), dtype=np.int8)
        for pos in range(k + 1):
            block = out[pos * m : (pos + 1) * m]
            block[:, :pos] = perms[:, :pos]
            block[:, pos] = k
            block[:, pos + 1 :] = perms[:, pos:]
        perms = out
    return perms


def _exact_no_ties(rx: np.ndarray, ry: np.ndarray) -> PermutationP:
    """Exact p without ties, from the count of permutations per value of S = sum d^2."""
    n = len(rx)
    order = np.argsort(rx)
    ranks = ry[order].astype(np.int64)  # y's ranks in x's order: rho = 1 - 6 S / (n^3 - n)
    observed = int(((np.arange(1, n + 1) - ranks) ** 2).sum())
    counts = s_distribution(n)
    # rho <= observed rho  <=>  S >= observed S
    less = int(counts[observed:].sum())
    greater = int(counts[: observed + 1].sum())
    total = math.factorial(n)
    return PermutationP(min(1.0, 2 * min(less, greater) / total), "exact", 0.0)


@functools.lru_cache(maxsize=4)
def s_distribution(n: int) -> npt.NDArray[np.int64]:
    """counts[s] = how many permutations pi of 1..n have sum (i - pi(i))^2 = s.

    Position by position over the sets of values already used: at step k only the C(n, k) sets
    of k values are held (a 3,432 x 911 table at n = 14), never all n! permutations."""
    top = n * (n * n - 1) // 3
    size = 1 << n
    popcount = np.array([bin(m).count("1") for m in range(size)])
    row = np.zeros(size, dtype=np.int64)  # mask -> its row in its layer's table
    masks = np.array([0])
    f = np.zeros((1, top + 1), dtype=np.int64)
    f[0, 0] = 1
    for k in range(n):  # position k + 1 takes a value j + 1 not used yet
        nxt_masks = np.flatnonzero(popcount == k + 1)
        row[nxt_masks] = np.arange(len(nxt_masks))
        nxt = np.zeros((len(nxt_masks), top + 1), dtype=np.int64)
        for j in range(n):
            free = (masks >> j) & 1 == 0
            step = (k - j) ** 2
            target = row[masks[free] | (1 << j)]
            nxt[target, step:] += f[free, : top + 1 - step]
        masks, f = nxt_masks, nxt
    f.setflags(write=False)  # cached: shared by every caller
    counts: npt.NDArray[np.int64] = f[0]
    return counts
