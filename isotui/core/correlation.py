"""Drift correlation across a model's layers (Godey et al. 2024, Fig. 5 and 16).

Spearman's p is a permutation p, as ``scipy.stats.permutation_test`` defines it (one variable's
values permuted, the statistic rho on the average ranks of tied values, two-sided p =
min(1, 2 min(P(rho* <= rho), P(rho* >= rho)))): exact over all n! pairings when that is
computable, else a seeded Monte Carlo estimate with its standard error. Without ties the exact
count goes on beyond the whole distribution's reach wherever the observed tail is cheap to count
(a strong correlation over many layers: few permutations are as extreme, and each moves every
rank by at most sqrt(S)). A Monte Carlo that sees no permutation as extreme gives an upper bound,
not a value (``spearman_p_method`` = ``monte-carlo-bound``). Beside it: the Edgeworth series of
AS 89 (Best & Roberts 1975, the approximation R's ``cor.test`` uses beyond 9 points; no ties),
and scipy's t approximation, accurate only for hundreds of points (``spearman_p_t``).

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
from typing import Any

import numpy as np
import numpy.typing as npt

# Without ties the null distribution of S = sum d^2 is counted exactly by a dynamic programme
# over the subsets of ranks used (2^n x n^3/6 counts: 60 MB at n = 14); with ties, all n!
# pairings are enumerated (3.6 million at n = 10). Beyond: Monte Carlo.
EXACT_DP_MAX_N = 14
EXACT_ENUM_MAX_N = 10
_S_ROWS = 256  # rows of s_distribution's table added at once
# Beyond 14 layers (no ties), the observed tail {S' <= S} is counted exactly when the band
# dynamic programme below stays under this many cell updates (about a second of CPU).
EXACT_TAIL_BUDGET = 100_000_000
MC_PERMUTATIONS = 1_000_000
MC_SEED = 0
# Confidence of the upper bound given when no resample is as extreme as the observed rho.
MC_BOUND_LEVEL = 0.95
_CHUNK = 1 << 17


@dataclass(frozen=True)
class DriftCorrelation:
    """Spearman and Pearson correlation of drift norm vs average cosine over layers.

    ``spearman_p`` is the permutation p (``spearman_p_method``: ``exact``, ``monte-carlo``,
    whose standard error is ``spearman_p_se`` (0 when exact), or ``monte-carlo-bound``: no
    resample as extreme, ``spearman_p`` is then a 95% upper bound and its SE NaN);
    ``spearman_p_edgeworth`` is AS 89's Edgeworth approximation (NaN with ties) and
    ``spearman_p_t`` scipy's t approximation."""

    n_layers: int
    spearman_rho: float
    spearman_p: float
    pearson_r: float
    pearson_p: float
    spearman_p_t: float = math.nan
    spearman_p_method: str = ""
    spearman_p_se: float = math.nan
    spearman_p_edgeworth: float = math.nan

    @property
    def spearman_p_floored(self) -> bool:
        """Whether ``spearman_p`` is only an upper bound (no Monte Carlo resample as extreme)."""
        return self.spearman_p_method == "monte-carlo-bound"

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
        spearman_p_edgeworth=spearman_edgeworth_p(x, y),
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
    p: float  # the p-value, or its upper bound for "monte-carlo-bound"
    method: str  # "exact", "monte-carlo" or "monte-carlo-bound"
    se: float  # standard error of a Monte Carlo p (0 when exact, NaN for a bound)


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
    if not ties:
        tail = _exact_tail_no_ties(rx, ry)
        if tail is not None:
            return tail
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
    if min(less, greater) == 0:
        # none as extreme: scipy would say 2/(N+1) whatever the truth; give what the simulation
        # shows, an upper bound (the one-sided p's Clopper-Pearson bound for 0 of N, doubled)
        bound = 2 * -math.expm1(math.log1p(-MC_BOUND_LEVEL) / n_resamples)
        return PermutationP(min(1.0, bound), "monte-carlo-bound", math.nan)
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


def _observed_tail_s(rx: np.ndarray, ry: np.ndarray) -> int:
    """S' such that the smaller one-sided p is P(S <= S') (no ties): S itself for rho >= 0, else
    the S of the reversed ranks, (n^3 - n)/3 - S (reversing one variable maps rho to -rho)."""
    n = len(rx)
    ranks = ry[np.argsort(rx)].astype(np.int64)
    s = int(((np.arange(1, n + 1) - ranks) ** 2).sum())
    top = n * (n * n - 1) // 3
    return min(s, top - s)


def tail_cost(n: int, s: int) -> int:
    """Cell updates of :func:`lower_tail_count` (an upper bound): C(2w, w) windows x (s + 1) sums
    x (2w + 1) moves x n positions, w = floor(sqrt(s))."""
    w = math.isqrt(s)
    return math.comb(2 * w, w) * (s + 1) * (2 * w + 1) * n


def lower_tail_count(n: int, s: int) -> float:
    """How many permutations pi of 1..n have S = sum_i (i - pi(i))^2 <= s, as a float64.

    Every such permutation moves each value by at most w = floor(sqrt(s)), so position by position
    only the values within w of it are open: the state is which of the 2w values around the
    position are used (exactly w of them; every value further left is used, none further right)
    and the partial S, at most C(2w, w) x (s + 1) counts (:func:`tail_cost`)."""
    w = math.isqrt(s)
    # bit k: value i - w + k is used (values outside 1..n count as used: they cannot be chosen)
    masks = np.array([sum(1 << k for k in range(2 * w) if not 1 <= k - w + 1 <= n)], dtype=np.int64)
    f = np.zeros((1, s + 1))
    f[0, 0] = 1.0
    for i in range(1, n + 1):
        wide = masks | (int(i + w > n) << (2 * w))  # value i + w enters the window
        new_masks, new_f = [], []
        for k in range(2 * w + 1):
            cost = (k - w) ** 2
            if cost > s:
                continue
            free = (wide >> k) & 1 == 0
            m = wide[free] | (1 << k)
            done = (m & 1) == 1  # value i - w cannot be placed later: it must be used by now
            g = np.zeros((int(done.sum()), s + 1))
            g[:, cost:] = f[free][done][:, : s + 1 - cost]
            new_masks.append(m[done] >> 1)
            new_f.append(g)
        masks, inverse = np.unique(np.concatenate(new_masks), return_inverse=True)
        f = np.zeros((len(masks), s + 1))
        np.add.at(f, inverse, np.concatenate(new_f))
    return float(f.sum())


def _exact_tail_no_ties(rx: np.ndarray, ry: np.ndarray) -> PermutationP | None:
    """The exact p counted over the observed tail alone, or None when that is not cheap."""
    n = len(rx)
    s = _observed_tail_s(rx, ry)
    if tail_cost(n, s) > EXACT_TAIL_BUDGET:
        return None
    log_p = math.log(2 * lower_tail_count(n, s)) - math.lgamma(n + 1)
    return PermutationP(min(1.0, math.exp(log_p)), "exact", 0.0)


# AS 89's Edgeworth coefficients (Best & Roberts 1975; R's prho.c)
_AS89 = (0.2274, 0.2531, 0.1745, 0.0758, 0.1033, 0.3932, 0.0879, 0.0151, 0.0072, 0.0831, 0.0131, 4.6e-4)


def as89_upper(n: int, s: int) -> float:
    """P(S >= s) under independence by AS 89's Edgeworth series (n > 9 in R; no ties)."""
    from scipy.special import ndtr

    c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12 = _AS89
    b = 1.0 / n
    x = (6.0 * (s - 1) * b / (n * n - 1.0) - 1.0) * math.sqrt(n - 1.0)
    y = x * x
    u = (
        x
        * b
        * (
            c1
            + b * (c2 + c3 * b)
            + y
            * (-c4 + b * (c5 + c6 * b) - y * b * (c7 + c8 * b - y * (c9 - c10 * b + y * b * (c11 - c12 * y))))
        )
    )
    p = u / math.exp(y / 2) + float(ndtr(-x))
    return min(1.0, max(0.0, p))


def spearman_edgeworth_p(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> float:
    """Two-sided p of Spearman's rho by AS 89's Edgeworth series (as R's ``cor.test`` beyond 9
    points), NaN with ties. The smaller tail P(S <= S') is taken as the upper tail of the
    reversed ranks, P(S >= (n^3 - n)/3 - S'), so no 1 - p cancels."""
    rx, ry = rankdata(x), rankdata(y)
    n = len(rx)
    if len(np.unique(rx)) < n or len(np.unique(ry)) < n:
        return math.nan
    s = _observed_tail_s(rx, ry)
    top = n * (n * n - 1) // 3
    return min(1.0, 2 * as89_upper(n, top - s))


def _count_dtype(most: int) -> type[np.integer[Any]]:
    """The narrowest integer type that holds counts up to ``most``."""
    if most <= np.iinfo(np.uint16).max:
        return np.uint16
    if most <= np.iinfo(np.uint32).max:
        return np.uint32
    return np.int64


@functools.lru_cache(maxsize=4)
def s_distribution(n: int) -> npt.NDArray[np.int64]:
    """counts[s] = how many permutations pi of 1..n have sum (i - pi(i))^2 = s.

    Position by position over the sets of values already used: at step k only the C(n, k) sets
    of k values are held, never all n! permutations. The table is kept small (it is computed
    after a run's finalisation, beside everything the run holds): a count after k positions is
    at most k!, so it is stored in the narrowest integer type that holds k! (16 bits up to k = 8,
    32 up to k = 12); a partial sum after k positions is at most the sum of each position's
    largest step, so no wider columns are made; and each set's row is added in slices of rows,
    so the copies fancy indexing makes stay small. At n = 13 that is 3.6 MB at most instead of
    31 (72 at n = 14)."""
    top = n * (n * n - 1) // 3
    size = 1 << n
    popcount = np.array([bin(m).count("1") for m in range(size)])
    row = np.zeros(size, dtype=np.int64)  # mask -> its row in its layer's table
    masks = np.array([0])
    f: npt.NDArray[Any] = np.ones((1, 1), dtype=np.uint16)  # the empty assignment, S = 0
    width = 1  # columns 0..width - 1 can be non-zero after k positions
    for k in range(n):  # position k + 1 takes a value j + 1 not used yet
        nxt_masks = np.flatnonzero(popcount == k + 1)
        row[nxt_masks] = np.arange(len(nxt_masks))
        nxt_width = min(top + 1, width + max((k - j) ** 2 for j in range(n)))
        nxt = np.zeros((len(nxt_masks), nxt_width), dtype=_count_dtype(math.factorial(k + 1)))
        for j in range(n):
            free = np.flatnonzero((masks >> j) & 1 == 0)
            step = (k - j) ** 2
            cols = min(width, nxt_width - step)
            for lo in range(0, len(free), _S_ROWS):
                rows = free[lo : lo + _S_ROWS]
                target = row[masks[rows] | (1 << j)]  # distinct: one row per set, j added
                nxt[target, step : step + cols] += f[rows, :cols]
        masks, f, width = nxt_masks, nxt, nxt_width
    counts: npt.NDArray[np.int64] = np.zeros(top + 1, dtype=np.int64)
    counts[:width] = f[0]
    counts.setflags(write=False)  # cached: shared by every caller
    return counts
