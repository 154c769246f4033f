"""Drift correlation across a model's layers (Godey et al. 2024, Fig. 5 and 16).

Spearman's p is a permutation p, as ``scipy.stats.permutation_test`` defines it (one variable's
values permuted, the statistic rho on the average ranks of tied values, two-sided p =
min(1, 2 min(P(rho* <= rho), P(rho* >= rho)))): exact over all n! pairings when that is
computable, else a seeded Monte Carlo estimate with its standard error. Without ties the exact
count goes on beyond the whole distribution's reach wherever the observed tail can be counted in
about 1.5 s (a strong correlation over many layers: few permutations are as extreme, and each
moves every rank by at most sqrt(S); :func:`tail_count`). Where it cannot, a proven upper bound
(a Chernoff bound with the permanent bounded block by block, :func:`spearman_p_bound`) is given
instead of a Monte Carlo whenever it lies below anything the simulation could report, and
wherever it is smaller than what the simulation says (``spearman_p_method`` = ``bound``). A
Monte Carlo that sees no permutation as extreme gives a 95% upper bound, not a value
(``monte-carlo-bound``). Beside it: the Edgeworth series of AS 89 (Best & Roberts 1975, the
approximation R's ``cor.test`` uses beyond 9 points; no ties; NaN below 1e-3, where it fails),
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
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

# Without ties the null distribution of S = sum d^2 is counted exactly by a dynamic programme
# over the subsets of ranks used (2^n x n^3/6 counts: 60 MB at n = 14); with ties, all n!
# pairings are enumerated (3.6 million at n = 10). Beyond: the tail count, a proven bound, Monte Carlo.
EXACT_DP_MAX_N = 14
EXACT_ENUM_MAX_N = 10
_S_ROWS = 256  # rows of s_distribution's table added at once
# Beyond 14 layers (no ties), the observed tail {S' <= S} is counted exactly when tail_count
# stays under this many cell updates: about 1.5 s of one core at the 6-9 ns a cell update takes
# (benchmarks/spearman_tail.py measures it).
EXACT_TAIL_BUDGET = 200_000_000
# ... and its tables stay under this many cells (float64: 16 MB each, two held at once, 41 MB at
# its peak; it is computed after a run's finalisation, beside everything the run holds: issue 24).
EXACT_TAIL_TABLE = 2_000_000
# The permanent bound's blocks of rows (2^10 subsets each), done up to this many layers.
BOUND_BLOCK = 10
_BOUND_BLOCK_MAX_N = 400
_BOUND_BLOCK_FROM = math.log(1e4)  # blocks are tried below this row-sum bound (log p)
_TINY = math.ulp(0.0)  # the smallest positive double: a bound below it is said as this
# AS 89's Edgeworth p is given only down to here: below, it drifts off (at 16 layers 7% low at
# p = 5.2e-4, 2.6 times at 1.0e-4, then negative, clipped to 0), and further out it is off by
# orders of magnitude (tests/test_core.py).
EDGEWORTH_FLOOR = 1e-3
MC_PERMUTATIONS = 1_000_000
MC_SEED = 0
# Confidence of the upper bound given when no resample is as extreme as the observed rho.
MC_BOUND_LEVEL = 0.95
_CHUNK = 1 << 17


@dataclass(frozen=True)
class DriftCorrelation:
    """Spearman and Pearson correlation of drift norm vs average cosine over layers.

    ``spearman_p`` is the permutation p (``spearman_p_method``: ``exact``, ``monte-carlo``,
    whose standard error is ``spearman_p_se`` (0 when exact), ``monte-carlo-bound``: no
    resample as extreme, ``spearman_p`` is then a 95% upper bound and its SE NaN, or ``bound``:
    a proven upper bound, SE NaN); ``spearman_p_edgeworth`` is AS 89's Edgeworth approximation
    (NaN with ties, and below :data:`EDGEWORTH_FLOOR`, where the series is no approximation:
    it goes negative or is off by orders of magnitude) and ``spearman_p_t`` scipy's t
    approximation."""

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
        """Whether ``spearman_p`` is only an upper bound (no Monte Carlo resample as extreme, or a
        proven bound)."""
        return self.spearman_p_method in ("monte-carlo-bound", "bound")

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
    p: float  # the p-value, or its upper bound for "monte-carlo-bound" and "bound"
    method: str  # "exact", "monte-carlo", "monte-carlo-bound" or "bound"
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
    # a proven bound first: where it lies below anything a Monte Carlo can report (its floor
    # 2/(N+1)), the simulation could only say less
    proven = spearman_p_bound(rx, ry, gamma * scale)
    if proven < 2 / (n_resamples + 1):
        return PermutationP(proven, "bound", math.nan)
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
        # shows, an upper bound (the one-sided p's Clopper-Pearson bound for 0 of N, doubled),
        # or the proven bound where that is smaller
        bound = min(1.0, 2 * -math.expm1(math.log1p(-MC_BOUND_LEVEL) / n_resamples))
        if proven < bound:
            return PermutationP(proven, "bound", math.nan)
        return PermutationP(bound, "monte-carlo-bound", math.nan)
    # scipy's Monte Carlo p counts the observed pairing as one of the resamples
    one_sided = (min(less, greater) + 1) / (n_resamples + 1)
    p = min(1.0, 2 * one_sided)
    if proven < p:  # a few lucky resamples: the estimate lies above what is proven
        return PermutationP(proven, "bound", math.nan)
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


def lower_tail_count(n: int, s: int) -> float:
    """How many permutations pi of 1..n have S = sum_i (i - pi(i))^2 <= s, as a float64 (exact
    below 2^53, else to a few units in the last place). :func:`tail_count` without a budget."""
    count = tail_count(n, s)
    assert count is not None
    return count


def tail_count(
    n: int, s: int, budget: float = math.inf, table: float = math.inf, *, spent: list[int] | None = None
) -> float | None:
    """:func:`lower_tail_count`, or None when counting it would take more than ``budget`` cell
    updates (:data:`EXACT_TAIL_BUDGET`), a table of more than ``table`` cells
    (:data:`EXACT_TAIL_TABLE`), or a window wider than an int64 mask.

    Every permutation with S <= s moves each value by at most w = floor(sqrt(s)), so position by
    position only the 2w values around it are open: the state after i positions is which of them
    are used (a bit mask; every value further left is used, none further right) and the partial S.
    A mask is kept only while the cheapest way to finish it fits in s: its unused values taken in
    order by the next positions (the sorted matching, optimal for a convex cost) cost at least
    ``_finish_cost``, so of the C(2w, w) masks a few thousand remain (n = 40, s = 53: 2,252
    masks over all 40 steps). The count meets in the middle: S is unchanged by mirroring a
    permutation (i -> n + 1 - i, pi(i) -> n + 1 - pi(n + 1 - i)), so the first ceil(n/2) positions'
    table, read mirrored, is also the last positions' one, and the count is the sum over each
    middle mask of its partial sums a and its mirror's b with a + b <= s. Its cost, in cell updates
    (one partial sum of one kept transition), is what the budget counts; it is checked step by step
    against the steps left, so a count over budget stops early instead of running to it (the cell
    updates done are appended to ``spent`` when given: benchmarks/spearman_tail.py)."""
    w = math.isqrt(s)
    if 2 * w + 1 > 62:
        return None
    half = n - n // 2  # steps run: the last two tables are the two halves
    tables = _tail_steps(n, s, w, half, budget, table, spent)
    if tables is None:
        return None
    back_masks, back_f = tables[-1]
    if n // 2 == 0:
        return float(back_f.sum())
    front_masks, front_f = tables[-1] if n % 2 == 0 else tables[-2]
    # the front's window after n // 2 positions holds values h - w + 1 .. h + w (bit k: h - w + 1
    # + k); the mirrored back's after n - h positions holds the same values, bit k <-> 2w - 1 - k
    h = n // 2
    real = sum(1 << k for k in range(2 * w) if 1 <= h - w + 1 + k <= n)
    outside = ((1 << (2 * w)) - 1) ^ real  # values outside 1..n: marked used in both
    want = (~front_masks & real) | outside  # what the back half must have used
    mirrored = np.zeros_like(want)
    for k in range(2 * w):
        mirrored |= ((want >> k) & 1) << (2 * w - 1 - k)
    at = np.minimum(np.searchsorted(back_masks, mirrored), len(back_masks) - 1)
    hit = np.flatnonzero(back_masks[at] == mirrored)
    total = 0.0
    for lo in range(0, len(hit), _tail_rows(s)):  # in slices of rows: no table-sized copies
        rows = hit[lo : lo + _tail_rows(s)]
        within = np.cumsum(back_f[at[rows]], axis=1)[:, ::-1]  # [m, a]: the back's with b <= s - a
        total += float((front_f[rows] * within).sum())
    return total


def _tail_rows(s: int) -> int:
    """Rows of a (masks x (s + 1)) table handled at once: 1 MB slices of float64."""
    return max(1, (1 << 17) // (s + 1))


def _finish_cost(masks: npt.NDArray[np.int64], w: int) -> npt.NDArray[np.int64]:
    """The least S the positions after a window can still add: its unused values, in order, taken
    by the next positions in order (the j-th clear bit k_j moves by w + j - k_j)."""
    out = np.zeros(len(masks), dtype=np.int64)
    j = np.zeros(len(masks), dtype=np.int64)
    for k in range(2 * w):
        clear = ((masks >> k) & 1) == 0
        out += clear * (w + j - k) ** 2
        j += clear
    return out


def _tail_steps(
    n: int, s: int, w: int, steps: int, budget: float, table: float, spent_out: list[int] | None
) -> list[tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]] | None:
    """The last two (masks, counts) tables after ``steps`` positions, counts[m, a] the number of
    ways the positions so far use mask m's values at partial S = a; None when over budget."""
    # bit k: value i - w + 1 + k is used (values outside 1..n count as used: they cannot be chosen)
    masks = np.array([sum(1 << k for k in range(2 * w) if not 1 <= k - w + 1 <= n)], dtype=np.int64)
    f = np.zeros((1, s + 1))
    f[0, 0] = 1.0
    least = np.zeros(1, dtype=np.int64)  # each mask's smallest partial S held
    spent = 0
    previous: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]] = []
    for i in range(1, steps + 1):
        wide = masks | (int(i + w > n) << (2 * w))  # value i + w enters the window
        parts = []
        for k in range(2 * w + 1):  # position i takes value i - w + k: moved by w - k
            cost = (k - w) ** 2
            if cost > s:
                continue
            ok = (((wide >> k) & 1) == 0) & (least <= s - cost)
            if k:  # value i - w cannot be placed later: it must be used by now
                ok &= (wide & 1) == 1
            rows = np.flatnonzero(ok)
            parts.append((rows, (wide[rows] | (1 << k)) >> 1, least[rows] + cost, np.full(len(rows), k)))
        src, nxt, low, took = (np.concatenate(p) for p in zip(*parts, strict=True))
        unique, inverse = np.unique(nxt, return_inverse=True)
        keep = low + _finish_cost(unique, w)[inverse] <= s
        held = np.zeros(len(unique), dtype=bool)
        held[inverse[keep]] = True
        target = (np.cumsum(held) - 1)[inverse[keep]]
        src, low, took = src[keep], low[keep], took[keep]
        step_cost = len(target) * (s + 1)
        over = spent + step_cost * (steps - i + 1) > budget  # this step's width for every step left
        if over or len(unique[held]) * (s + 1) > table:
            if spent_out is not None:
                spent_out.append(spent)
            return None
        spent += step_cost
        masks = unique[held]
        least = np.full(len(masks), s + 1, dtype=np.int64)
        np.minimum.at(least, target, low)
        g = np.zeros((len(masks), s + 1))
        order = np.argsort(took, kind="stable")
        edges = np.searchsorted(took[order], np.arange(2 * w + 2))
        chunk = _tail_rows(s)
        for k in range(2 * w + 1):  # one value per source row: its targets are distinct
            cost = (k - w) ** 2
            for lo in range(edges[k], edges[k + 1], chunk):
                sel = order[lo : min(lo + chunk, edges[k + 1])]
                g[target[sel], cost:] += f[src[sel], : s + 1 - cost]
        if i == steps:
            if spent_out is not None:
                spent_out.append(spent)
            return [*previous, (masks, g)]
        previous = [(masks, g)] if i == steps - 1 else []  # the front half's, for an odd n
        f = g
    raise AssertionError("unreachable")


def _exact_tail_no_ties(rx: np.ndarray, ry: np.ndarray) -> PermutationP | None:
    """The exact p counted over the observed tail alone, or None when that is not cheap."""
    n = len(rx)
    s = _observed_tail_s(rx, ry)
    count = tail_count(n, s, EXACT_TAIL_BUDGET, EXACT_TAIL_TABLE)
    if count is None or not math.isfinite(count):
        return None
    p = math.exp(math.log(2 * count) - math.lgamma(n + 1))
    if p == 0.0:  # below the smallest double (n > 170): say so as a bound, never as 0
        return PermutationP(_TINY, "bound", math.nan)
    return PermutationP(min(1.0, p), "exact", 0.0)


def spearman_p_bound(rx: np.ndarray, ry: np.ndarray, tolerance: float = 0.0) -> float:
    """A proven upper bound on the two-sided permutation p of Spearman's rho (any ranks, ties
    too): twice a Chernoff bound on the tail in rho's direction, P(rho* >= rho) for rho >= 0.

    With S* = sum_i (x_i - y_pi(i))^2 over a uniform permutation pi (x, y the ranks; y reversed
    when rho < 0, which maps rho to -rho) and any theta > 0, Markov's inequality gives
    P(S* <= s) <= e^{theta s} E e^{-theta S*} = e^{theta s} perm(A) / n!, A_ij = e^{-theta (x_i -
    y_j)^2} (Chernoff 1952). The permanent is bounded by splitting the rows into blocks of
    :data:`BOUND_BLOCK` consecutive rows: a permutation restricted to a block is an injection of
    the block's rows into the columns, and distinct permutations restrict to distinct tuples of
    injections, so perm(A) <= prod over blocks of the sum over the block's injections (counted
    exactly over subsets of the block's rows; with blocks of one row this is the product of the
    row sums). theta is searched on a log scale; every theta tried gives a valid bound, the least
    is kept, and it is raised by 1e-9 of itself against rounding. ``tolerance`` widens the tail as
    ``scipy.stats.permutation_test`` does (rho* within it of rho counts as extreme), in units of
    sum (x - mean)(y - mean).

    Concentration inequalities for linear permutation statistics were tried first and are no use
    here: Chatterjee (2007, Prop. 1.1), P(|T - ET| >= t) <= 2 exp(-t^2 / (4 ET + 2t)) for T = sum
    a_{i,pi(i)} with a in [0, 1], needs a = (i - j)^2 / (n - 1)^2, whose ET ~ n/6 caps the exponent
    at about n/36: at rho = 1 over 80 layers it bounds p by 0.2 (the exact p is 2/80! = 2.8e-119).
    This bound gives 1e-11 at 80 layers and rho = 0.95, where 10^6 Monte Carlo resamples can only
    say p < 6e-6 (tests/test_core.py checks it against exact counts)."""
    x = np.asarray(rx, dtype=np.float64)
    y = np.asarray(ry, dtype=np.float64)
    n = len(x)
    if ((x - x.mean()) @ (y - y.mean())) < 0:
        y = y.max() + y.min() - y  # reversed: rho -> -rho, the same ranks' spread
    s = float(((x - y) ** 2).sum()) + 2 * tolerance  # S* <= s <=> rho* >= rho - tolerance
    x, y = np.sort(x), np.sort(y)  # perm(A) is the same for any order of rows and of columns
    d2 = (x[:, None] - y[None, :]) ** 2
    log_n_fact = math.lgamma(n + 1)

    def rows(theta: float) -> float:  # log(e^{theta s} prod of row sums)
        logw = -theta * d2
        top = logw.max(axis=1)
        return theta * s + float((top + np.log(np.exp(logw - top[:, None]).sum(axis=1))).sum())

    # the row-sum bound is cheap: its best theta first (it is convex in theta), then blocks near
    # it, where they can help: they gain 4-7 decades at 20-80 layers and 0.86 < rho < 0.97, so from
    # a row-sum bound above 1e4 they cannot reach what a Monte Carlo resolves (no use: skipped)
    lo, hi = math.log(1e-3 / max(float(d2.max()), 1.0)), math.log(50.0)
    best, at = _golden(rows, lo, hi, 80)
    if 1 < n <= _BOUND_BLOCK_MAX_N and math.log(2.0) + best - log_n_fact < _BOUND_BLOCK_FROM:
        blocks = _Blocks(x, y, BOUND_BLOCK)
        got, _ = _golden(lambda t: t * s + blocks.log_permanent_bound(t), at - 2.0, at + 2.0, 12)
        best = min(best, got)
    log_p = math.log(2.0) + best - log_n_fact + 1e-9
    return min(1.0, max(_TINY, math.exp(log_p)))


def _golden(fn: Callable[[float], float], lo: float, hi: float, steps: int) -> tuple[float, float]:
    """(least value seen, its log theta) of ``fn(exp(t))`` by golden-section search over t in
    [lo, hi]; every value seen is a valid bound, so only the least matters."""
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = fn(math.exp(a)), fn(math.exp(b))
    best = min((fa, a), (fb, b))
    for _ in range(steps):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = fn(math.exp(a))
            best = min(best, (fa, a))
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = fn(math.exp(b))
            best = min(best, (fb, b))
    return best


class _Blocks:
    """The rows (x sorted) cut into blocks of at most ``size`` consecutive rows (sizes differing by
    one at most: two groups of equal sizes, each done as one array), for the permanent bound. A
    block's injections are counted over the columns (y sorted) near its rows; each row's weight on
    every other column is summed into one column of its own (``far``), which relaxes injectivity
    there only: still an upper bound, and the count costs k + 2 x reach columns instead of n."""

    def __init__(self, x: npt.NDArray[np.float64], y: npt.NDArray[np.float64], size: int) -> None:
        n = len(x)
        count = -(-n // size)
        small, extra = divmod(n, count)  # `extra` blocks of small + 1 rows, the rest of `small`
        self.x, self.y = x, y
        self.d2 = (x[:, None] - y[None, :]) ** 2
        self.groups = []
        start = 0
        for k, many in ((small + 1, extra), (small, count - extra)):
            if many:
                self.groups.append((k, start + np.arange(many * k).reshape(many, k)))
                start += many * k

    def log_permanent_bound(self, theta: float) -> float:
        """log of the product over blocks of each block's sum over injections (inf where a sum
        comes out too small to trust: never a bound lowered by underflow)."""
        n = len(self.x)
        logw = -theta * self.d2
        top = logw.max(axis=1)
        a = np.exp(logw - top[:, None])  # each row scaled to a largest weight of 1
        left = np.cumsum(a, axis=1)  # left[i, j]: row i's weight on columns 0..j
        right = np.cumsum(a[:, ::-1], axis=1)[:, ::-1]  # right[i, j]: on columns j..n-1
        reach = math.sqrt(40.0 / theta)  # beyond, a weight is below e^-40 of the nearest one's
        total = float(top.sum())
        for k, idx in self.groups:
            lo = np.searchsorted(self.y, self.x[idx[:, 0]] - reach, side="left")
            hi = np.searchsorted(self.y, self.x[idx[:, -1]] + reach, side="right")
            width = int((hi - lo).max())
            cols = np.minimum(lo[:, None] + np.arange(width), n - 1)  # (blocks, width)
            near = a[idx[:, :, None], cols[:, None, :]] * (cols < hi[:, None])[:, None, :]
            far = np.where(lo[:, None] > 0, left[idx, np.maximum(lo - 1, 0)[:, None]], 0.0) + np.where(
                hi[:, None] < n, right[idx, np.minimum(hi, n - 1)[:, None]], 0.0
            )
            subsets = np.arange(1 << k)
            without = [subsets[((subsets >> r) & 1) == 0] for r in range(k)]
            f = np.zeros((len(idx), 1 << k))
            f[:, 0] = 1.0  # f[b, T]: weight of the injections of block b's rows T into columns so far
            for j in range(width):
                g = f.copy()
                for r in range(k):
                    g[:, without[r] | (1 << r)] += f[:, without[r]] * near[:, r, j][:, None]
                f = g
            for r in range(k):  # row r's column of its own: everything beyond its reach
                g = f.copy()
                g[:, without[r] | (1 << r)] += f[:, without[r]] * far[:, r][:, None]
                f = g
            full = f[:, -1]
            if not np.all(full > 1e-250):
                return math.inf
            total += float(np.log(full).sum())
        return total


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
    points), NaN with ties and below :data:`EDGEWORTH_FLOOR` (there the series drifts off: 2.6
    times too low at p = 1e-4 over 16 layers, further out negative, clipped to 0 as R does, or off
    by orders of magnitude: 7e-7 where the exact p is 3.2e-24). The smaller tail P(S <= S') is taken as the
    upper tail of the reversed ranks, P(S >= (n^3 - n)/3 - S'), so no 1 - p cancels."""
    rx, ry = rankdata(x), rankdata(y)
    n = len(rx)
    if len(np.unique(rx)) < n or len(np.unique(ry)) < n:
        return math.nan
    s = _observed_tail_s(rx, ry)
    top = n * (n * n - 1) // 3
    p = min(1.0, 2 * as89_upper(n, top - s))
    return p if p >= EDGEWORTH_FLOOR else math.nan


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
