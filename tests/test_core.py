"""Core numerics on synthetic vectors, against brute force, the isoscore package and scipy."""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
import torch
from IsoScore import IsoScore
from scipy import stats

from isotui.core.accumulator import LayerAccumulator, sample_keys
from isotui.core.correlation import drift_correlation, s_distribution
from isotui.core.null import null_cos_quantile
from isotui.core.spectrum import isoscore_from_eigenvalues


def _stream(x: np.ndarray, labels: np.ndarray, batches: int, *, full_cov=True, reservoir=10_000):
    acc = LayerAccumulator(x.shape[1], torch.device("cpu"), full_cov=full_cov, reservoir=reservoir)
    for chunk in np.array_split(np.unique(labels), batches):
        rows = np.isin(labels, chunk)
        ids = torch.as_tensor(np.searchsorted(chunk, labels[rows]))
        xs = torch.as_tensor(x[rows], dtype=torch.float32)
        keys = sample_keys(0, torch.as_tensor(labels[rows]), torch.arange(int(rows.sum())))
        acc.commit(acc.partial(xs, ids, keys))
    return acc.finalize()


@pytest.fixture
def cloud():
    rng = np.random.default_rng(0)
    d, n = 16, 300
    x = rng.normal(size=(n, d)) * np.linspace(0.2, 3.0, d) + 2.0 * rng.normal(size=d)  # drifted
    x[5] = 0.0  # a zero vector: counted, skipped for directions
    labels = np.sort(rng.integers(0, 40, size=n))
    return x.astype(np.float32).astype(np.float64), labels


def test_stream_equals_brute_force(cloud):
    x, labels = cloud
    s = _stream(x, labels, batches=7)
    nz = np.linalg.norm(x, axis=1) > 0
    u = x[nz] / np.linalg.norm(x[nz], axis=1, keepdims=True)
    lab = labels[nz]
    n = len(u)
    g = u @ u.T
    off = ~np.eye(n, dtype=bool)
    assert s.n_vectors == len(x) and s.n_zero == 1
    assert s.avg_cos == pytest.approx(g[off].mean(), rel=1e-12)
    assert s.avg_cos_xctx == pytest.approx(g[lab[:, None] != lab[None, :]].mean(), rel=1e-12)
    assert s.drift_norm == pytest.approx(np.linalg.norm(x.mean(0)), rel=1e-12)
    assert s.mean_norm == pytest.approx(np.linalg.norm(x, axis=1).mean(), rel=1e-12)
    per_dim = np.array([(np.outer(u[:, k], u[:, k])[off]).mean() for k in range(x.shape[1])])
    np.testing.assert_allclose(s.dim_contrib, per_dim, rtol=1e-10, atol=1e-14)
    assert s.dim_contrib.sum() == pytest.approx(s.avg_cos, rel=1e-10)
    v = x - x.mean(0)
    uc = v / np.linalg.norm(v, axis=1, keepdims=True)
    assert s.avg_cos_centered == pytest.approx((uc @ uc.T)[~np.eye(len(x), dtype=bool)].mean(), rel=1e-10)
    assert s.isoscore == pytest.approx(float(IsoScore.IsoScore(x)), rel=1e-6)  # package: float32 sqrt(d)
    vals = np.linalg.eigvalsh(np.cov(x, rowvar=False))[::-1]
    p = vals / vals.sum()
    assert s.eff_rank == pytest.approx(np.exp(-(p * np.log(p)).sum()), rel=1e-7)
    assert s.top_pc_share == pytest.approx(vals[0] / vals.sum(), rel=1e-7)


def test_batching_does_not_change_anything(cloud):
    x, labels = cloud
    a, b = _stream(x, labels, batches=1), _stream(x, labels, batches=13)
    for name in ("avg_cos", "avg_cos_xctx", "avg_cos_centered"):
        assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-12)
    for name in ("isoscore", "eff_rank", "top_pc_share"):  # per-batch products are float32
        assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-7)


def test_spectrum_from_the_reservoir_when_covariance_is_not_streamed(cloud):
    x, labels = cloud
    exact = _stream(x, labels, batches=5, full_cov=False, reservoir=10_000)
    assert exact.spectrum_from == "all"
    assert exact.isoscore == pytest.approx(float(IsoScore.IsoScore(x)), rel=1e-6)
    sampled = _stream(x, labels, batches=5, full_cov=False, reservoir=120)
    assert sampled.spectrum_from == "sample:120" and sampled.n_sample == 120
    assert sampled.isoscore == pytest.approx(exact.isoscore, abs=0.1)


def test_reservoir_is_uniform_over_vectors():
    keys = sample_keys(0, torch.arange(20_000) // 50, torch.arange(20_000) % 50).numpy()
    assert keys.min() >= 0 and keys.max() < 1
    assert stats.kstest(keys, "uniform").pvalue > 1e-3
    assert len(np.unique(keys)) == len(keys)


def test_isoscore_extremes():
    assert isoscore_from_eigenvalues(np.ones(10)) == pytest.approx(1.0)
    assert isoscore_from_eigenvalues(np.array([1.0] + [0.0] * 9)) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("dim", [4, 32, 384])
def test_isotropic_null_matches_monte_carlo(dim):
    rng = np.random.default_rng(dim)
    a = rng.normal(size=(200_000, dim)) if dim < 100 else rng.normal(size=(40_000, dim))
    b = rng.normal(size=a.shape)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert null_cos_quantile(dim) == pytest.approx(np.quantile(cos, 0.95), abs=0.01)


def test_drift_correlation_matches_scipy_and_handles_degenerate():
    drift, cos = [1.0, 2.5, 2.0, 4.0, 3.5], [0.1, 0.3, 0.2, 0.5, 0.35]
    got = drift_correlation(drift, cos)
    assert got.spearman_rho == pytest.approx(stats.spearmanr(drift, cos).statistic)
    assert got.pearson_p == pytest.approx(stats.pearsonr(drift, cos).pvalue)
    assert np.isnan(drift_correlation([1.0, 2.0], [0.1, 0.2]).spearman_rho)
    assert np.isnan(drift_correlation([1.0, 1.0, 1.0], [0.1, 0.2, 0.3]).pearson_r)


def test_correlations_and_null_are_scipy_stats_own_bits_without_importing_it():
    """Spearman, Pearson (with their p), ranks and the null quantile come from scipy.special
    (importing scipy.stats costs ~0.5 s of every run) and must equal scipy.stats exactly."""
    import subprocess
    import sys
    import warnings

    from isotui.core.correlation import pearson, rankdata, spearman

    rng = np.random.default_rng(7)
    for trial in range(400):
        n = int(rng.integers(3, 40))
        x = rng.normal(size=n) * 10 ** rng.uniform(-4, 4)
        y = rng.normal(size=n) + (x * rng.normal() if trial % 3 == 1 else 0)
        if trial % 3 == 2:  # ties and an offset, as a plateau of drift norms
            x, y = np.round(x * 3) / 3 + 100, np.round(y)
        if np.ptp(x) == 0 or np.ptp(y) == 0:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s, p = stats.spearmanr(x, y), stats.pearsonr(x, y)
        assert spearman(x, y) == (float(s.statistic), float(s.pvalue))
        assert pearson(x, y) == (float(p.statistic), float(p.pvalue))
        assert np.array_equal(rankdata(x), stats.rankdata(x))
    for dim in (2, 3, 384, 4096, 150528):
        for q in (0.5, 0.95, 0.99):
            a = (dim - 1) / 2
            assert null_cos_quantile(dim, q) == float(2 * stats.beta.ppf(q, a, a) - 1)
    code = (
        "import sys\nfrom isotui.core.correlation import drift_correlation\n"
        "from isotui.core.null import null_cos_quantile\n"
        "drift_correlation([1.0, 2.5, 2.0, 4.0], [0.1, 0.3, 0.2, 0.5]); null_cos_quantile(384)\n"
        "print('scipy.stats' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _rho_statistic(y):
    """Spearman's rho of each resample of x against ``y``, vectorised (average ranks for ties)."""
    ry = stats.rankdata(y)
    ryc = ry - ry.mean()

    def statistic(a, axis=-1):
        ra = stats.rankdata(a, axis=axis)
        rac = ra - ra.mean(axis=axis, keepdims=True)
        return (rac * ryc).sum(axis=axis) / np.sqrt((rac * rac).sum(axis=axis) * (ryc @ ryc))

    return statistic


def exact_spearman_p(x, y, n_resamples=np.inf):
    """scipy's permutation test of Spearman's rho (every pairing unless ``n_resamples``)."""
    return stats.permutation_test(
        (np.asarray(x, dtype=float),),
        _rho_statistic(y),
        permutation_type="pairings",
        n_resamples=n_resamples,
        vectorized=True,
        random_state=1,
    ).pvalue


def _layers(n, ties, seed):
    rng = np.random.default_rng(seed)
    drift = rng.normal(size=n)
    cos = drift + 1.5 * rng.normal(size=n)
    if ties:  # repeated values in both, as in a plateau of drift norms
        drift[1] = drift[0]
        cos[-1] = cos[0]
    return drift, cos


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("n", range(3, 13))
def test_spearman_p_is_scipys_permutation_p(n, ties):
    drift, cos = _layers(n, ties, seed=n)
    assert ties == (len(np.unique(drift)) < n or len(np.unique(cos)) < n)
    got = drift_correlation(list(drift), list(cos))
    assert got.spearman_p_t == pytest.approx(stats.spearmanr(drift, cos).pvalue)
    if n <= 9:  # scipy enumerates every pairing
        assert got.spearman_p_method == "exact" and got.spearman_p_se == 0.0
        assert got.spearman_p == pytest.approx(exact_spearman_p(drift, cos), rel=1e-9)
    else:  # scipy's Monte Carlo; ours is exact (no ties) or Monte Carlo with 1e6 (ties, n > 10)
        m = 200_000
        want = exact_spearman_p(drift, cos, n_resamples=m)
        want_se = 2 * np.sqrt(want / 2 * (1 - want / 2) / m)
        assert got.spearman_p_method == ("exact" if n <= 10 or not ties else "monte-carlo")
        assert abs(got.spearman_p - want) <= 4 * np.hypot(want_se, got.spearman_p_se) + 1e-12


def test_spearman_p_is_exact_for_a_perfect_order_over_12_layers():
    got = drift_correlation(list(range(12)), [0.1 * k for k in range(12)])
    assert got.spearman_p == pytest.approx(2 / math.factorial(12), rel=1e-12)  # 2 of the 12! orders
    assert got.spearman_p_t == 0.0  # scipy's t approximation: what was printed before
    perfect = drift_correlation([1.0, 2.0, 3.0], [0.1, 0.2, 0.3])
    assert perfect.spearman_p == pytest.approx(1 / 3)  # 2 of the 6 orderings are as extreme


def test_spearman_s_distribution_counts_every_permutation():
    for n in range(2, 8):
        want = np.zeros(n * (n * n - 1) // 3 + 1, dtype=np.int64)
        for perm in itertools.permutations(range(n)):
            want[sum((i - k) ** 2 for i, k in enumerate(perm))] += 1
        assert np.array_equal(s_distribution(n), want)


def test_spearman_p_monte_carlo_beyond_exact_with_its_standard_error():
    drift, cos = _layers(40, ties=False, seed=7)
    cos = drift + 6 * np.random.default_rng(8).normal(size=40)
    got = drift_correlation(list(drift), list(cos))
    assert got.spearman_p_method == "monte-carlo"
    want = exact_spearman_p(drift, cos, n_resamples=200_000)
    want_se = 2 * np.sqrt(want / 2 * (1 - want / 2) / 200_000)
    assert 0 < got.spearman_p_se < 1e-3
    half = got.spearman_p / 2
    assert got.spearman_p_se == pytest.approx(2 * np.sqrt(half * (1 - half) / 1e6), rel=1e-3)
    assert abs(got.spearman_p - want) <= 4 * np.hypot(want_se, got.spearman_p_se)
    assert drift_correlation(list(drift), list(cos)) == got  # seeded


def test_reservoir_holds_the_smallest_keys_whatever_the_batching(cloud):
    x, labels = cloud
    positions = np.concatenate([np.arange((labels == s).sum()) for s in np.unique(labels)])
    all_keys = sample_keys(0, torch.as_tensor(labels), torch.as_tensor(positions)).numpy()
    want = np.sort(all_keys)[:50]
    for batches in (1, 4, 11):
        acc = LayerAccumulator(x.shape[1], torch.device("cpu"), full_cov=True, reservoir=50)
        with torch.inference_mode():  # as in extraction: reservoir tensors are inference tensors
            for chunk in np.array_split(np.unique(labels), batches):
                rows = np.isin(labels, chunk)
                ids = torch.as_tensor(np.searchsorted(chunk, labels[rows]))
                keys = torch.as_tensor(all_keys[rows])
                acc.commit(acc.partial(torch.as_tensor(x[rows], dtype=torch.float32), ids, keys))
        np.testing.assert_array_equal(np.sort(acc.res_keys.numpy()), want)
        held = {tuple(v) for v in acc.res.numpy().round(5)}
        expected = {tuple(v) for v in x[np.argsort(all_keys)[:50]].astype(np.float32).round(5)}
        assert held == expected


def _count_near_identity(n, s):
    """Plain recursion: permutations of range(n) with sum (i - pi(i))^2 <= s (every value moved
    by at most sqrt(s), so the search stays small)."""
    used = [False] * n

    def go(i, acc):
        if i == n:
            return 1
        total = 0
        for v in range(n):
            c = acc + (i - v) ** 2
            if not used[v] and c <= s:
                used[v] = True
                total += go(i + 1, c)
                used[v] = False
        return total

    return go(0, 0)


def _all_s(n):
    """S = sum (i - pi(i))^2 of every permutation of range(n), by brute force."""
    perms = np.array(list(itertools.permutations(range(n))), dtype=np.int64).reshape(-1, n)
    return ((perms - np.arange(n)) ** 2).sum(axis=1)


def test_spearman_tail_count_is_every_permutation_in_the_tail():
    from isotui.core.correlation import lower_tail_count

    for n in range(1, 10):  # every permutation; every threshold up to 7, the tails and a spread at 8-9
        counts = np.cumsum(np.bincount(_all_s(n), minlength=n * (n * n - 1) // 3 + 1))
        top = len(counts) - 1
        thresholds = range(top + 1) if n <= 7 else [*range(0, 61), *range(61, top + 1, 17), top]
        for s in thresholds:
            assert lower_tail_count(n, s) == counts[s], (n, s)
    for n, s in ((16, 10), (20, 8), (24, 6)):  # beyond the whole distribution's reach
        assert lower_tail_count(n, s) == _count_near_identity(n, s)


@functools.cache
def _count_tail_memoised(n, s):
    """Permutations pi of range(n) with sum (i - pi(i))^2 <= s as an exact integer, by a plain
    memoised recursion over (position, the used values a later position could still take, S left):
    another programme than the one under test (no masks, no pruning by the cost to finish, no
    meeting in the middle, no floats)."""
    w = math.isqrt(s)

    @functools.cache
    def go(i, used, left):
        if i == n:
            return 1
        total = 0
        for v in range(max(0, i - w), min(n, i + w + 1)):
            cost = (i - v) ** 2
            if v in used or cost > left:
                continue
            now = used | {v}
            if i - w >= 0 and i - w not in now:  # no later position can reach value i - w
                continue
            total += go(i + 1, frozenset(u for u in now if u > i - w), left - cost)
        return total

    return go(0, frozenset(), s)


def _with_s(n, pairs):
    """cos values over n layers whose ranks are the identity with the given pairs swapped."""
    cos = list(range(n))
    for a, b in pairs:
        cos[a], cos[b] = cos[b], cos[a]
    return [0.1 * v for v in cos]


# issue 37's deep models: S from disjoint swaps (a swap of i and i + d adds 2 d^2)
DEEP = [  # and the p docs/metrics.md quotes
    (18, [(0, 6), (8, 9), (11, 12)], 76, 2.7e-7),  # rho 0.922 (the audit's 2.7e-7)
    (33, [(0, 5), (7, 9), (11, 12)], 60, 1.6e-24),  # rho 0.990
    (40, [(0, 5), (7, 8)], 52, 1.3e-34),  # rho 0.995
]


@pytest.mark.parametrize(("n", "pairs", "s", "quoted"), DEEP)
def test_spearman_exact_p_for_deep_models_is_a_memoised_count(n, pairs, s, quoted):
    """Issue 37: these printed p<6e-06 (a Monte Carlo bound); counted, they are 1e-7 to 1e-34."""
    from isotui.core.correlation import lower_tail_count

    want = _count_tail_memoised(n, s)
    assert lower_tail_count(n, s) == pytest.approx(want, rel=1e-13)
    got = drift_correlation(list(range(n)), _with_s(n, pairs))
    assert got.spearman_rho == pytest.approx(1 - 6 * s / (n**3 - n), rel=1e-12)
    assert got.spearman_p_method == "exact" and got.spearman_p_se == 0.0
    assert got.spearman_p == pytest.approx(2 * want / math.factorial(n), rel=1e-12)
    assert f"{got.spearman_p:.2g}" == f"{quoted:.2g}"
    assert math.isnan(got.spearman_p_edgeworth)  # far below where the series holds: not 0.0


def test_spearman_tail_count_stops_early_over_its_budget():
    from isotui.core.correlation import EXACT_TAIL_BUDGET, EXACT_TAIL_TABLE, tail_count

    spent = []
    assert tail_count(80, 900, EXACT_TAIL_BUDGET, EXACT_TAIL_TABLE, spent=spent) is None
    assert spent[0] < EXACT_TAIL_BUDGET / 10  # the steps left are foreseen: stopped early
    spent.clear()
    assert tail_count(80, 900, EXACT_TAIL_BUDGET, spent=spent) is None  # the budget alone
    assert spent[0] < EXACT_TAIL_BUDGET
    assert tail_count(40, 52, EXACT_TAIL_BUDGET, EXACT_TAIL_TABLE) == _count_tail_memoised(40, 52)
    assert tail_count(30, 1000) is None  # a window of 2 x 31 values is wider than an int64 mask


def test_spearman_p_bound_is_above_every_exact_p():
    """The proven bound (Chernoff, the permanent bounded block by block) against the exact p: every
    value of rho over 7 ranks (with and without ties), the deep models above, rho = 1 (where it is
    nearly exact); and never 0."""
    from scipy.stats import rankdata

    from isotui.core.correlation import lower_tail_count, spearman_p_bound

    n = 7
    perms = np.array(list(itertools.permutations(range(n))))
    for x_ranks in (np.arange(1.0, n + 1), rankdata([1, 1, 2, 3, 3, 3, 4])):
        a = x_ranks - x_ranks.mean()
        t = (perms + 1.0 - (n + 1) / 2) @ a  # every pairing of the ranks 1..n with x's
        values, first = np.unique(np.round(t, 9), return_index=True)
        for v, at in zip(values, first, strict=True):
            below, above = np.mean(t <= v + 1e-9), np.mean(t >= v - 1e-9)
            p = min(1.0, 2 * min(below, above))  # scipy.stats.permutation_test's two-sided p
            assert spearman_p_bound(x_ranks, perms[at] + 1.0) >= p * (1 - 1e-12), v
    for n, pairs, s, _ in DEEP:
        ranks = rankdata(_with_s(n, pairs))
        exact = 2 * _count_tail_memoised(n, s) / math.factorial(n)
        bound = spearman_p_bound(np.arange(1.0, n + 1), ranks)
        assert exact <= bound < 1e-2
    # loose where it is needed least (docs/metrics.md): 30 layers at S = 300, rho 0.933; the
    # bound depends on S alone, so the identity with S widened by the tolerance stands for it
    up = np.arange(1.0, 31)
    exact = 2 * lower_tail_count(30, 300) / math.factorial(30)
    assert f"{exact:.2g}" == "8.8e-13"
    assert f"{spearman_p_bound(up, up, tolerance=150):.2g}" == "2.2e-06"
    for n in (15, 30, 80):  # rho = 1: 2/n! exactly, the bound within 1e-8 of it (and reversed)
        up = np.arange(1.0, n + 1)
        want = 2 / math.factorial(n)
        assert want <= spearman_p_bound(up, up) <= want * (1 + 1e-8)
        assert want <= spearman_p_bound(up, up[::-1]) <= want * (1 + 1e-8)
    assert spearman_p_bound(np.arange(1.0, 201), np.arange(1.0, 201)) > 0.0  # 2/200! < 1e-370


def test_spearman_p_bound_where_neither_exact_nor_monte_carlo_resolves_it():
    """80 layers at rho ~ 0.99: too wide to count, too rare for 10^6 resamples (which could only
    say p < 6e-6); the proven bound says p < 1e-40. Chatterjee's (2007) inequality, the first
    choice, bounds even rho = 1 over 80 layers by 0.2 (a in [0, 1] forces a = (i-j)^2/(n-1)^2)."""
    rng = np.random.default_rng(0)
    drift = np.arange(80.0)
    cos = drift + 0.9 * np.sqrt(80) / 3 * rng.normal(size=80)
    got = drift_correlation(list(drift), list(cos))
    assert got.spearman_p_method == "bound" and got.spearman_p_floored
    assert math.isnan(got.spearman_p_se)
    assert 0.0 < got.spearman_p < 1e-40 and got.spearman_rho > 0.99
    cos = drift + 8.0 * np.random.default_rng(2).normal(size=80)
    got = drift_correlation(list(drift), list(cos))  # weaker: still a bound (docs/metrics.md)
    assert f"{got.spearman_rho:.3f}" == "0.944" and got.spearman_p_method == "bound"
    assert f"{got.spearman_p:.2g}" == "6.2e-09"
    n = 80
    expected_t = n * (n + 1) / (6 * (n - 1))  # E sum (i - pi(i))^2 / (n - 1)^2
    assert 2 * math.exp(-(expected_t**2) / (4 * expected_t + 2 * expected_t)) > 0.2
    # a correlation too weak for the bound and too strong for the simulation: its 95% bound
    cos = drift + 12.0 * np.random.default_rng(0).normal(size=80)
    weaker = drift_correlation(list(drift), list(cos))
    assert 0.9 < weaker.spearman_rho < 0.93
    assert weaker.spearman_p_method == "monte-carlo-bound"


def test_spearman_p_never_says_0():
    """Over 200 layers in order the exact p, 2/200!, is below the smallest double: a bound."""
    got = drift_correlation(list(range(200)), [0.1 * k for k in range(200)])
    assert got.spearman_p_method == "bound" and got.spearman_p == math.ulp(0.0)


@pytest.mark.parametrize("n", [15, 24, 40])
def test_spearman_p_is_exact_for_a_perfect_order_over_deep_models(n):
    up = drift_correlation(list(range(n)), [0.1 * k**2 for k in range(n)])
    down = drift_correlation(list(range(n)), [-0.1 * k for k in range(n)])
    for got in (up, down):  # 2 of the n! orders are as extreme: 2/24! = 3.2e-24
        assert got.spearman_p_method == "exact"
        assert got.spearman_p == pytest.approx(2 / math.factorial(n), rel=1e-12)


def test_spearman_exact_tail_beyond_14_layers_counts_near_orders():
    # 16 layers, two neighbours swapped twice: S = 4, rho = 1 - 24/4080
    cos = [0.1 * k for k in range(16)]
    cos[3], cos[4], cos[9], cos[10] = cos[4], cos[3], cos[10], cos[9]
    got = drift_correlation(list(range(16)), cos)
    assert got.spearman_p_method == "exact"
    want = 2 * _count_near_identity(16, 4) / math.factorial(16)
    assert got.spearman_p == pytest.approx(want, rel=1e-12)


def test_spearman_monte_carlo_bound_when_no_resample_is_as_extreme():
    rng = np.random.default_rng(0)
    drift = np.arange(30.0)
    cos = drift + 6 * rng.normal(size=30)  # rho ~ 0.87: too far to count, too rare for 1e6, too
    got = drift_correlation(list(drift), list(cos))  # weak for the proven bound to beat 6e-6
    assert got.spearman_p_method == "monte-carlo-bound" and got.spearman_p_floored
    assert math.isnan(got.spearman_p_se)
    # 0 of N: the one-sided p's exact 95% (Clopper-Pearson) upper bound is 1 - 0.05^(1/N), doubled
    assert got.spearman_p == pytest.approx(2 * (1 - 0.05 ** (1 / 1_000_000)), rel=1e-9)
    assert got.spearman_p == pytest.approx(6.0e-6, rel=2e-3)
    # scipy's own Monte Carlo sees none either: its p is its floor 2/(N+1), not an estimate
    assert exact_spearman_p(drift, cos, n_resamples=50_000) == pytest.approx(2 / 50_001)
    assert got.spearman_p_t < got.spearman_p  # the t approximation is not bound by the simulation


def test_spearman_edgeworth_is_as89_as_r_computes_it():
    from isotui.core.correlation import as89_upper, lower_tail_count, spearman_edgeworth_p

    # R's pspearman documentation (package pspearman): P(S <= 36) at n = 10, exact 0.005265377
    # and by AS 89 0.005825634; the lower tail is the reversed ranks' upper tail, 330 - 36
    assert as89_upper(10, 330 - 36) == pytest.approx(0.005825634, abs=5e-10)
    assert s_distribution(10)[:37].sum() / math.factorial(10) == pytest.approx(0.005265377, abs=5e-10)
    # its accuracy against the exact distribution at 14 layers, as docs/metrics.md states it
    counts = s_distribution(14).astype(float)
    tail = np.cumsum(counts) / counts.sum()
    top = 14 * (14 * 14 - 1) // 3
    ratios = {}
    for s in range(0, top // 2 + 1, 2):
        p = 2 * tail[s]
        ratios.setdefault("1e-2" if p >= 1e-2 else "1e-3" if p >= 1e-3 else "below", []).append(
            2 * as89_upper(14, top - s) / p
        )
    assert max(abs(r - 1) for r in ratios["1e-2"] if r) < 0.015  # within 1.5% for 0.01 <= p
    assert max(abs(r - 1) for r in ratios["1e-3"]) < 0.035  # 3.4% for 0.001 <= p < 0.01
    assert min(ratios["below"]) == 0.0  # and useless further out: the series goes negative (0)
    x = np.arange(14.0)
    y = x.copy()
    y[[0, 13]] = y[[13, 0]]  # S = 2 x 13^2 = 338: rho 0.26
    assert spearman_edgeworth_p(x, y) == pytest.approx(2 * as89_upper(14, top - 338))
    assert math.isnan(spearman_edgeworth_p(np.r_[x[:-1], x[0]], y))  # ties: not defined
    y = x.copy()
    y[[2, 3]] = y[[3, 2]]  # S = 2: the series is clipped from below 0 to 0; given as NaN, not 0.0
    assert 2 * as89_upper(14, top - 2) == 0.0 and math.isnan(spearman_edgeworth_p(x, y))
    # at 16 layers (exact counts) the series drifts off below p = 1e-3, the floor it is given to
    top = 16 * (16 * 16 - 1) // 3
    exact = {s: 2 * lower_tail_count(16, s) / math.factorial(16) for s in (100, 110, 146, 164)}
    edgeworth = {s: 2 * as89_upper(16, top - s) for s in exact}
    assert exact[164] == pytest.approx(1.0e-3, rel=0.01) and edgeworth[164] / exact[164] > 0.99
    assert exact[146] == pytest.approx(5.2e-4, rel=0.01) and 0.9 < edgeworth[146] / exact[146] < 0.95
    assert exact[110] == pytest.approx(1.04e-4, rel=0.01) and edgeworth[110] / exact[110] < 0.4
    assert exact[100] == pytest.approx(6.0e-5, rel=0.01) and edgeworth[100] == 0.0


def test_spearman_s_distribution_stays_smaller_than_one_int64_table():
    """Issue 24: the exact null distribution is computed after a run's finalisation, beside
    everything the run holds; at n = 13 (a 12-block model) the old table took 31 MB at its peak,
    three times the C(13, 6) x (top + 1) int64 table of its widest step. Now less than one."""
    import tracemalloc

    n = 13
    widest = math.comb(n, n // 2) * (n * (n * n - 1) // 3 + 1) * 8
    s_distribution.cache_clear()
    tracemalloc.start()
    try:
        counts = s_distribution(n)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert int(counts.sum()) == math.factorial(n)
    assert peak < widest, f"s_distribution({n}) peaked at {peak / 1e6:.1f} MB, a table {widest / 1e6:.1f}"


def test_the_table_says_a_bound_rounded_up_and_no_approximation_as_0():
    from isotui.core.correlation import DriftCorrelation
    from isotui.render import _spearman_p, p_bound, result_table
    from isotui.results import ModelResult

    # an upper bound printed in two digits is rounded up, never to nearest (checked on decimals)
    for value, text in (
        (3.14e-12, "<3.2e-12"),
        (3.1e-12, "<3.1e-12"),
        (2.99e-54, "<3e-54"),
        (5e-324, "<1e-300"),
    ):
        assert p_bound(value) == text
    proven = DriftCorrelation(80, 0.99, 3.14e-54, 0.99, 1e-60, 0.0, "bound", math.nan)
    assert _spearman_p(proven) == "<3.2e-54 proven bound; t approx. <1e-300"
    exact = DriftCorrelation(18, 0.92, 2.7e-7, 0.9, 1e-6, 1e-8, "exact", 0.0)
    assert _spearman_p(exact) == "2.7e-07 exact; t approx. 1e-08"
    perfect = drift_correlation(list(range(12)), [0.1 * k for k in range(12)])
    assert perfect.pearson_p == 0.0 and perfect.spearman_p_t == 0.0  # both underflow
    caption = str(result_table(ModelResult("m", "k", [], {"model": perfect}, {}), width=400).caption)
    assert "(p=4.2e-09 exact; t approx. <1e-300), Pearson r=1.000 (p=<1e-300)" in caption


def test_a_cached_edgeworth_p_of_0_loads_as_nan():
    """Issue 37: a cache written before the Edgeworth floor holds 0.0 where the series went
    negative; it loads as NaN (null in the JSON export), a value above the floor as stored."""
    from isotui.results import ModelResult

    old = drift_correlation(list(range(16)), [0.1 * k for k in range(16)]).to_dict()
    data = ModelResult("m", "k", [], {}, {}).to_json()
    got = ModelResult.from_json(data | {"drift": {"model": old | {"spearman_p_edgeworth": 0.0}}}, {})
    assert math.isnan(got.drift["model"].spearman_p_edgeworth)
    kept = ModelResult.from_json(data | {"drift": {"model": old | {"spearman_p_edgeworth": 0.2}}}, {})
    assert kept.drift["model"].spearman_p_edgeworth == 0.2
    assert kept.drift["model"].spearman_p == old["spearman_p"]


def test_spearman_exact_reach_is_what_docs_say():
    """docs/metrics.md's reach of the exact count (benchmarks/spearman_tail.py --reach finds it):
    per layer count, the largest S counted within budget and tables, its rho and its p. The
    budget is in cell updates, so this holds on any machine."""
    from isotui.core.correlation import EXACT_TAIL_BUDGET, EXACT_TAIL_TABLE, tail_count

    reach = {16: (333, 0.045), 20: (275, 5.7e-5), 24: (265, 4.1e-8), 30: (263, 1.8e-13)}
    reach |= {40: (263, 5.3e-24), 60: (253, 8.7e-50), 80: (235, 2.1e-80)}
    for n, (s, p) in reach.items():
        count = tail_count(n, s, EXACT_TAIL_BUDGET, EXACT_TAIL_TABLE)
        assert count is not None and tail_count(n, s + 1, EXACT_TAIL_BUDGET, EXACT_TAIL_TABLE) is None
        assert f"{2 * count / math.factorial(n):.2g}" == f"{p:.2g}"
    rho = {n: 1 - 6 * s / (n**3 - n) for n, (s, _) in reach.items()}
    assert [round(rho[n], 3) for n in (16, 20, 24, 30, 40, 60, 80)] == [
        0.51,
        0.793,
        0.885,
        0.941,
        0.975,
        0.993,
        0.997,
    ]


def test_spearman_tail_count_stays_within_its_tables():
    """Like the whole distribution's table (issue 24), the tail count runs beside everything a
    run holds: two tables of EXACT_TAIL_TABLE float64 cells at most, 41 MB at its peak at the
    edge of its reach (docs/guide/options.md)."""
    import tracemalloc

    from isotui.core.correlation import EXACT_TAIL_BUDGET, EXACT_TAIL_TABLE, tail_count

    tracemalloc.start()
    try:
        count = tail_count(30, 263, EXACT_TAIL_BUDGET, EXACT_TAIL_TABLE)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count is not None
    assert 2 * EXACT_TAIL_TABLE * 8 < peak < 42e6
