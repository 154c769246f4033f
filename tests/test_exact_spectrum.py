"""Finalisation from the exact covariance (issue 15): where a layer's d x d sums are held, the
spectrum metrics and the directions of I(W), centred I(W) and all-but-the-top come from every
vector, checked against plain numpy over all vectors and the isoscore package on the full data,
on shifted, anisotropic clouds (a large common mean, where unshifted float32 sums fail). The
per-vector parts stay on the reservoir: checked against numpy over the reservoir's own rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import logsumexp

RESERVOIR = 96


def _mean_cos(v):
    """Mean cosine over all ordered pairs i != j (numpy, every pair), zero rows left out."""
    v = v[np.linalg.norm(v, axis=1) > 0]
    u = v / np.linalg.norm(v, axis=1, keepdims=True)
    g = u @ u.T
    n = len(u)
    return (g.sum() - np.trace(g)) / (n * (n - 1))


def _iw(x, vecs):
    """min over max of Z(c) = sum_i exp(c . x_i) over the columns c of ``vecs`` and -c."""
    proj = x @ vecs
    log_z = np.concatenate([logsumexp(proj, axis=0), logsumexp(-proj, axis=0)])
    return np.exp(log_z.min() - log_z.max())


def _cloud(n, d, mean_norm, seed):
    """An anisotropic cloud (well separated variances, rotated off the axes) around a common mean
    of norm ``mean_norm``."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    z = rng.normal(size=(n, d)) * np.geomspace(1.0, 0.05, d)
    z[:, 0] *= 1 + (rng.random(n) < 0.03) * 5  # a heavy tail along the top direction
    mean = rng.normal(size=d)
    return z @ q.T + mean * (mean_norm / np.linalg.norm(mean))


def _accumulate(x, reservoir, full_cov=True, seed=0):
    import torch

    from isotui.core.accumulator import LayerAccumulator, sample_keys

    acc = LayerAccumulator(x.shape[1], torch.device("cpu"), full_cov=full_cov, reservoir=reservoir)
    xt = torch.from_numpy(x)
    for start in range(0, len(x), 500):
        rows = torch.arange(start, min(start + 500, len(x)))
        acc.commit(acc.partial(xt[rows], rows // 20 - start // 20, sample_keys(seed, rows // 20, rows % 20)))
    return acc


@pytest.mark.parametrize(("mean_norm", "d"), [(0.0, 24), (4.0, 40), (3000.0, 32)])
def test_exact_covariance_gives_the_spectrum_and_the_directions(mean_norm, d):
    from IsoScore import IsoScore

    from isotui.core.isotropy import abtt_components

    x = _cloud(3000, d, mean_norm, seed=d)
    acc = _accumulate(x, RESERVOIR)
    stats = acc.finalize()
    assert stats.n_sample == RESERVOIR < stats.n_vectors == len(x) and stats.spectrum_from == "all"

    # the spectrum over every vector: numpy's covariance, the isoscore package on all points
    cov = np.cov(x, rowvar=False)
    lam = np.linalg.eigvalsh(cov)[::-1]
    # each batch's product is formed in float32 (then summed in float64): ~1e-7 of the largest
    np.testing.assert_allclose(stats.eigenvalues, lam, rtol=1e-6, atol=1e-7 * lam[0])
    p = lam / lam.sum()
    assert stats.eff_rank == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-7)
    assert stats.top_pc_share == pytest.approx(lam[0] / lam.sum(), rel=1e-7)
    assert stats.isoscore == pytest.approx(float(IsoScore.IsoScore(x)), rel=1e-6)

    # the directions over every vector (numpy float64), Z and the cosines over the reservoir
    mean, std = x.mean(0), x.std(0, ddof=1)
    vecs = np.linalg.eigh(x.T @ x)[1]
    vecs_c = np.linalg.eigh((x - mean).T @ (x - mean))[1][:, ::-1]
    top = vecs_c[:, : abtt_components(d)]
    res = acc.res.numpy().astype(np.float64)
    v = res - mean
    if mean_norm < 100:  # Z(c) along a mean of norm 3,000 is exp(3,000): I(W) is 0 either way
        assert stats.iw == pytest.approx(_iw(res, vecs), rel=1e-5)
    else:
        assert stats.iw == pytest.approx(_iw(res, vecs), abs=1e-300)
    assert stats.iw_centered == pytest.approx(_iw(v, vecs_c), rel=1e-5)
    assert stats.avg_cos_abtt == pytest.approx(_mean_cos(v - v @ top @ top.T), rel=1e-6, abs=1e-9)
    assert stats.avg_cos_std == pytest.approx(_mean_cos(v / std), rel=1e-6, abs=1e-9)
    assert stats.avg_cos_centered == pytest.approx(_mean_cos(v), rel=1e-6, abs=1e-9)


def test_eigenvalues_alone_where_no_metric_reads_the_directions(monkeypatch):
    """Wider than the reservoir metrics go (SAMPLE_METRICS_MAX_DIM, here lowered to 16 so that a
    24-wide cloud is wider), finalisation decomposes the covariance's eigenvalues alone, one layer
    or several at once, and the spectrum is numpy's and the isoscore package's over every vector;
    within that width the directions are there."""
    import torch
    from IsoScore import IsoScore

    from isotui.core import accumulator
    from isotui.core.exact_spectrum import exact_eigens

    monkeypatch.setattr(accumulator, "SAMPLE_METRICS_MAX_DIM", 16)
    clouds = [_cloud(3000, 24, mean_norm, seed=7) for mean_norm in (0.0, 4.0)]
    accs = [_accumulate(x, RESERVOIR) for x in clouds]
    assert not any(acc.needs_directions() for acc in accs)
    alone = [acc.exact_eigen(directions=False) for acc in accs]
    together = exact_eigens([acc.exact_eigen_inputs() for acc in accs], directions=False)
    eighs: list[tuple[int, ...]] = []
    real_eigh = torch.linalg.eigh

    def counting(a, *args, **kwargs):
        eighs.append(tuple(a.shape))
        return real_eigh(a, *args, **kwargs)

    for x, acc, one, both in zip(clouds, accs, alone, together, strict=True):
        assert one.vecs is None and one.vecs_c is None and both.vecs is None
        lam = np.linalg.eigvalsh(np.cov(x, rowvar=False))[::-1]
        for values in (one.values, both.values):
            np.testing.assert_allclose(values.numpy(), lam, rtol=1e-6, atol=1e-7 * lam[0])
        eighs.clear()
        monkeypatch.setattr(torch.linalg, "eigh", counting)
        stats = acc.finalize()
        monkeypatch.setattr(torch.linalg, "eigh", real_eigh)
        assert eighs == []  # finalisation decomposed with eigenvectors nowhere
        assert stats.spectrum_from == "all" and math.isnan(stats.iw)  # no reservoir metric this wide
        np.testing.assert_allclose(stats.eigenvalues, lam, rtol=1e-6, atol=1e-7 * lam[0])
        assert stats.isoscore == pytest.approx(float(IsoScore.IsoScore(x)), rel=1e-6)
    monkeypatch.setattr(accumulator, "SAMPLE_METRICS_MAX_DIM", 24)
    assert accs[0].needs_directions()
    eigen = accs[0].exact_eigen(directions=accs[0].needs_directions())
    assert eigen is not None and eigen.vecs is not None and eigen.vecs_c is not None
    top = float(alone[0].values[0])  # the same eigenvalues either way, to float64 rounding
    np.testing.assert_allclose(eigen.values.numpy(), alone[0].values.numpy(), rtol=0, atol=1e-12 * top)


def test_the_sample_own_directions_differ():
    """Without the exact covariance the reservoir's own directions serve (the old way), and they
    give other values: what the exact path changes."""
    x = _cloud(3000, 40, 4.0, seed=40)
    exact = _accumulate(x, RESERVOIR).finalize()
    sampled = _accumulate(x, RESERVOIR, full_cov=False).finalize()
    assert sampled.spectrum_from == f"sample:{RESERVOIR}"
    assert sampled.iw_centered != pytest.approx(exact.iw_centered, rel=1e-3)
    assert sampled.avg_cos_abtt != pytest.approx(exact.avg_cos_abtt, rel=1e-3)
    assert sampled.avg_cos_std == pytest.approx(exact.avg_cos_std, rel=1e-12)  # no directions


def _iw_weighted(rows, vecs, counts):
    """I(W) of a resample: each row counted ``counts`` times, in float64 numpy."""
    proj = rows @ vecs
    both = np.concatenate([proj, -proj], axis=1)
    top = both.max(0)
    log_z = np.log(counts @ np.exp(both - top)) + top
    return np.exp(log_z.min() - log_z.max())


def _jackknife(theta):
    g = len(theta)
    return np.sqrt((g - 1) / g * ((np.asarray(theta) - np.mean(theta)) ** 2).sum())


def test_standard_errors_hold_the_exact_directions():
    """The SEs of I(W), centred I(W) and all-but-the-top: each group left out in turn, the
    directions the exact ones (not re-estimated), by the plain formula in numpy."""
    from isotui.core.isotropy import abtt_components
    from isotui.core.sampled import bootstrap_counts, jackknife_t, key_groups

    x = _cloud(3000, 24, 4.0, seed=7)
    acc = _accumulate(x, 256)
    stats = acc.finalize()
    res = acc.res.numpy().astype(np.float64)
    parts = [p.numpy() for p in key_groups(acc.res_keys)]
    mean = x.mean(0)
    vecs = np.linalg.eigh(x.T @ x)[1]
    vecs_c = np.linalg.eigh((x - mean).T @ (x - mean))[1][:, ::-1]
    top = vecs_c[:, : abtt_components(24)]
    theta = {"iw": [], "iw_centered": [], "avg_cos_abtt": []}
    for idx in parts:
        keep = np.ones(len(res), dtype=bool)
        keep[idx] = False
        rest = res[keep]
        v = rest - mean
        theta["iw"].append(_iw(rest, vecs))
        theta["iw_centered"].append(_iw(v, vecs_c))
        theta["avg_cos_abtt"].append(_mean_cos(v - v @ top @ top.T))
    drawn = bootstrap_counts(len(res)).numpy().astype(np.float64)  # the resamples' draws, dealt
    counts = np.empty_like(drawn)  # to the rows in the reservoir's key order
    counts[:, np.concatenate(parts)] = drawn
    rows = {"iw": (res, vecs), "iw_centered": (res - mean, vecs_c)}
    for name, values in theta.items():
        want = _jackknife(values)
        if name in rows:  # I(W)'s min/max selection: widened by a row bootstrap's bias and spread
            boot = np.array([_iw_weighted(*rows[name], c) for c in counts])
            value = _iw(*rows[name])
            want = abs(boot.mean() - value) / jackknife_t() + max(want, boot.std(ddof=1))
            assert getattr(stats, f"{name}_se") >= _jackknife(values) > 0
        assert want > 0 and getattr(stats, f"{name}_se") == pytest.approx(want, rel=1e-4), name


def test_exact_pass_uses_the_same_decomposition():
    """--exact's second pass takes its directions from the same function as finalisation."""
    import torch

    from isotui.core.exact_pass import ExactPass

    x = _cloud(2000, 16, 4.0, seed=3)
    acc = _accumulate(x, RESERVOIR)
    second = ExactPass(acc)
    second.commit(second.partial(torch.from_numpy(x)))
    got = second.values()
    mean = x.mean(0)
    vecs = np.linalg.eigh(x.T @ x)[1]
    vecs_c = np.linalg.eigh((x - mean).T @ (x - mean))[1]
    assert got["iw"] == pytest.approx(_iw(x, vecs), rel=1e-5)
    assert got["iw_centered"] == pytest.approx(_iw(x - mean, vecs_c), rel=1e-5)


def test_run_notes_say_the_directions_are_exact(tiny_models):
    """A layer run whose reservoir holds a part only: the note says the directions are exact, and
    the spectrum is every vector's (numpy over the reference loop's vectors)."""
    from isotui.experiments.layerwise import measure
    from isotui.spec import make_spec

    from .conftest import corpus
    from .reference import hidden_vectors

    kw = {"max_samples": 12, "max_length": 64, "reservoir": 40, "batch_size": 5}
    result = measure(make_spec(str(tiny_models["bert"]), "builtin", **kw), None)
    notes = " ".join(result.meta["notes"])
    assert "directions are exact" in notes and "only their sums over vectors are sampled" in notes
    layers, _ = hidden_vectors(tiny_models["bert"], corpus(12), max_length=64)
    for row, x in zip(result.rows, layers, strict=True):
        assert row.spectrum_from == "all" and row.n_sample == 40 < row.n_vectors == len(x)
        cov = np.cov(x, rowvar=False)
        lam = np.linalg.eigvalsh(cov)[::-1]
        p = lam[lam > 0] / lam.sum()
        assert row.eff_rank == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-5)
