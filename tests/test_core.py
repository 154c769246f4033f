"""Core numerics on synthetic vectors, against brute force, the isoscore package and scipy."""

from __future__ import annotations

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


def test_spearman_tail_count_is_every_permutation_in_the_tail():
    from isotui.core.correlation import lower_tail_count

    for n in range(1, 8):  # every permutation, every threshold
        perms = list(itertools.permutations(range(n)))
        for s in range(n * (n * n - 1) // 3 + 1):
            want = sum(1 for p in perms if sum((i - k) ** 2 for i, k in enumerate(p)) <= s)
            assert lower_tail_count(n, s) == want
    for n, s in ((16, 10), (20, 8), (24, 6)):  # beyond the whole distribution's reach
        assert lower_tail_count(n, s) == _count_near_identity(n, s)


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
    rng = np.random.default_rng(3)
    drift = np.arange(24.0)
    cos = drift + 3 * rng.normal(size=24)  # rho ~ 0.96: too far for the tail count, too rare for 1e6
    got = drift_correlation(list(drift), list(cos))
    assert got.spearman_p_method == "monte-carlo-bound" and got.spearman_p_floored
    assert math.isnan(got.spearman_p_se)
    # 0 of N: the one-sided p's exact 95% (Clopper-Pearson) upper bound is 1 - 0.05^(1/N), doubled
    assert got.spearman_p == pytest.approx(2 * (1 - 0.05 ** (1 / 1_000_000)), rel=1e-9)
    assert got.spearman_p == pytest.approx(6.0e-6, rel=2e-3)
    # scipy's own Monte Carlo sees none either: its p is its floor 2/(N+1), not an estimate
    assert exact_spearman_p(drift, cos, n_resamples=50_000) == pytest.approx(2 / 50_001)
    assert got.spearman_p_t < got.spearman_p  # the t approximation is not bound by the simulation


def test_spearman_edgeworth_is_as89_as_r_computes_it():
    from isotui.core.correlation import as89_upper, spearman_edgeworth_p

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
    y[[2, 3]] = y[[3, 2]]
    assert spearman_edgeworth_p(x, y) == pytest.approx(2 * as89_upper(14, top - 2))
    assert math.isnan(spearman_edgeworth_p(np.r_[x[:-1], x[0]], y))  # ties: not defined


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
