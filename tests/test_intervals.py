"""The standard errors' degrees of freedom and 95% intervals, and the mean cosine's own isotropic
null (issue 28, items 4 and 5), against scipy and a simulation."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy import stats

from isotui.core.null import null_mean_quantile, null_mean_sd
from isotui.results import LayerRow, ModelResult

from .conftest import same


def _row(**over) -> LayerRow:
    required = [
        f for f in dataclasses.fields(LayerRow) if f.default is f.default_factory is dataclasses.MISSING
    ]
    base = {f.name: 0.0 for f in required}
    base |= {"model": "m", "component": "model", "layer": 0, "n_vectors": 1000, "n_zero": 0, "dim": 64}
    base |= {"above_null": False, "final_norm": False, "rogue_dims": "", "spectrum_from": "all"}
    base |= {"top_rogue_dim": 0, "n_sample": 1000, "self_sim_types": 0}
    return LayerRow(**(base | over))


@pytest.mark.parametrize(
    ("n", "d"),
    [(40, 8), pytest.param(200, 64, marks=pytest.mark.slow), pytest.param(60, 384, marks=pytest.mark.slow)],
)
def test_mean_cosine_null_against_a_simulation(n, d):
    rng = np.random.default_rng(n + d)
    reps = 20_000
    means = np.empty(reps)
    for start in range(0, reps, 2000):
        u = rng.normal(size=(2000, n, d))
        u /= np.linalg.norm(u, axis=2, keepdims=True)
        s = u.sum(axis=1)
        means[start : start + 2000] = ((s * s).sum(1) - n) / (n * (n - 1))
    # the variance 2 / (n (n - 1) d) exactly (sd of a sample variance: sqrt(2 / (reps - 1)))
    assert means.var() / null_mean_sd(n, d) ** 2 == pytest.approx(1.0, abs=4 * math.sqrt(2 / reps))
    q = np.quantile(means, 0.95)  # the 95th percentile, within the simulation's own noise
    assert null_mean_quantile(n, d) == pytest.approx(q, rel=0.05)
    # one pair's 95th percentile is a different, far larger threshold
    pair = 2 * stats.beta.ppf(0.95, (d - 1) / 2, (d - 1) / 2) - 1
    assert null_mean_quantile(n, d) < pair / 4


def test_rows_carry_the_mean_null_and_an_old_cached_row_gets_it():
    old = dataclasses.asdict(_row(avg_cos=0.004, n_vectors=5000, n_zero=10, dim=384))
    del old["null_mean_p95"], old["above_null_mean"]  # an entry written before they existed
    row = LayerRow(**old)
    want = null_mean_sd(4990, 384) * (stats.chi2.ppf(0.95, 384) - 384) / math.sqrt(2 * 384)
    assert row.null_mean_p95 == pytest.approx(want, rel=1e-12)
    assert row.above_null_mean  # 0.004 is ~ 180 null sds above 0, though far below one pair's p95
    assert not _row(avg_cos=1e-6).above_null_mean
    assert LayerRow(**(old | {"null_mean_p95": None})).null_mean_p95 == pytest.approx(want)


def test_json_intervals_are_t_with_seven_degrees_of_freedom():
    rows = [
        _row(avg_cos_centered=0.01, avg_cos_centered_se=0.002, iw=0.5, iw_se=0.0, avg_cos_abtt=0.3),
        _row(
            layer=1, spectrum_from="sample:4096", iw=0.2, iw_se=0.01, avg_cos_abtt=0.1, avg_cos_abtt_se=0.02
        ),
    ]
    got = ModelResult("m", "k", rows, {}, {}).to_json()["intervals"]
    t = stats.t.ppf(0.975, 7)
    assert got["dof"] == 7 and got["groups"] == 8 and got["t"] == pytest.approx(t, rel=1e-12)
    assert got["t"] == pytest.approx(2.3646, abs=1e-4)
    first, second = got["rows"]
    assert first["avg_cos_centered"] == pytest.approx([0.01 - t * 0.002, 0.01 + t * 0.002])
    assert first["iw"] == [0.5, 0.5]  # exact: SE 0
    assert first["avg_cos_abtt"] is None  # SE unknown (NaN)
    assert second["avg_cos_abtt"] == pytest.approx([0.1 - t * 0.02, 0.1 + t * 0.02])
    # the reservoir's own directions (d x d not held): bias as large as the SE, said per layer
    assert got["biased"] == [{"component": "model", "layer": 1}]
    assert same(ModelResult.from_json(ModelResult("m", "k", rows, {}, {}).to_json(), {}).rows, rows)


def test_a_cached_floored_monte_carlo_p_is_recomputed_on_load():
    rows = [_row(layer=k, drift_norm=float(k), avg_cos=0.01 * k) for k in range(24)]
    old = {  # as a cache entry written before issue 28 holds it: the Monte Carlo's floor
        "n_layers": 24,
        "spearman_rho": 1.0,
        "spearman_p": 2 / (1_000_000 + 1),
        "pearson_r": 1.0,
        "pearson_p": 0.0,
        "spearman_p_t": 0.0,
        "spearman_p_method": "monte-carlo",
        "spearman_p_se": 2e-6,
    }
    data = ModelResult("m", "k", rows, {}, {}).to_json() | {"drift": {"model": old}}
    got = ModelResult.from_json(data, {}).drift["model"]
    assert got.spearman_p_method == "exact"
    assert got.spearman_p == pytest.approx(2 / math.factorial(24), rel=1e-12)
    kept = ModelResult.from_json(data | {"drift": {"model": old | {"spearman_p": 0.01}}}, {})
    assert kept.drift["model"].spearman_p == 0.01  # a p off the floor loads as stored


def test_the_table_says_the_degrees_of_freedom_the_bias_and_the_bound():
    from isotui.core.correlation import drift_correlation
    from isotui.render import result_table

    rows = [
        _row(layer=0, avg_cos=0.05, avg_cos_centered_se=0.001),
        _row(layer=1, avg_cos=1e-7, spectrum_from="sample:4096", iw=0.2, iw_se=0.01),
    ]
    deep = drift_correlation(  # rho 0.87 over 30 layers: no count, no resample as extreme
        list(range(30)), list(np.arange(30) + 6 * np.random.default_rng(0).normal(size=30))
    )
    caption = str(result_table(ModelResult("m", "k", rows, {"model": deep}, {}), width=400).caption)
    assert "8 groups of the reservoir (7 degrees of freedom): a 95% interval is ±2.36 SE" in caption
    assert "layer 1: I(W) and all-but-the-top from the reservoir's own directions" in caption
    assert "--exact removes it" in caption
    assert "1 of 2 layers above it" in caption  # the mean's own null: 0.05 is, 1e-7 is not
    assert "p=<6e-06 Monte Carlo, none of 1,000,000 as extreme" in caption
