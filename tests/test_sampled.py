"""The reservoir metrics' exact second pass (--exact) against plain all-vectors numpy, and their
standard errors from disjoint sub-samples against the spread over independent reservoirs."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from scipy.special import logsumexp

from isotui.errors import IsotuiError


def _mean_cos(v):
    """Mean cosine over all ordered pairs i != j, zero vectors left out."""
    v = v[np.linalg.norm(v, axis=1) > 0]
    u = v / np.linalg.norm(v, axis=1, keepdims=True)
    g = u @ u.T
    n = len(u)
    return (g.sum() - np.trace(g)) / (n * (n - 1))


def _iw(x, vecs):
    """min over max of Z(c) = sum_i exp(c . x_i), c the columns of ``vecs`` and their negatives."""
    proj = x @ vecs
    log_z = np.concatenate([logsumexp(proj, axis=0), logsumexp(-proj, axis=0)])
    return np.exp(log_z.min() - log_z.max())


def _all_vectors(x):
    """Every reservoir metric over all rows of ``x``, in plain numpy float64."""
    mean = x.mean(0)
    v = x - mean
    _, vecs = np.linalg.eigh(x.T @ x)
    _, vecs_c = np.linalg.eigh(v.T @ v)
    top = vecs_c[:, ::-1][:, : max(1, int(np.ceil(x.shape[1] / 100)))]
    std = x.std(0, ddof=1)
    return {
        "avg_cos_centered": _mean_cos(v),
        "iw": _iw(x, vecs),
        "iw_centered": _iw(v, vecs_c),
        "avg_cos_abtt": _mean_cos(v - v @ top @ top.T),
        "avg_cos_std": _mean_cos(v[:, std > 0] / std[std > 0]),
    }


SAMPLED = ("avg_cos_centered", "iw", "iw_centered", "avg_cos_abtt", "avg_cos_std")


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_exact_pass_equals_every_vector(tiny_models, arch):
    from isotui.experiments.layer_pass import prepare
    from isotui.experiments.layerwise import measure
    from isotui.spec import make_spec

    from .conftest import corpus
    from .reference import hidden_vectors

    texts = corpus(12)
    folder = str(tiny_models[arch])
    kw = {"max_samples": 12, "max_length": 64, "reservoir": 40, "batch_size": 5}
    exact = measure(make_spec(folder, "builtin", exact=True, **kw), None)
    sampled = measure(make_spec(folder, "builtin", **kw), None)
    layers, _ = hidden_vectors(tiny_models[arch], texts, max_length=64)
    differs = 0
    for row, plain, x in zip(exact.rows, sampled.rows, layers, strict=True):
        assert row.n_sample == 40 < row.n_vectors == len(x)  # the reservoir holds a part only
        want = _all_vectors(x)
        for name in SAMPLED:
            assert getattr(row, name) == pytest.approx(want[name], rel=1e-5, abs=1e-9), (row.layer, name)
            assert getattr(row, f"{name}_se") == 0.0
            se = getattr(plain, f"{name}_se")
            assert np.isfinite(se) and se > 0, (row.layer, name)
            differs += getattr(plain, name) != pytest.approx(want[name], rel=1e-5, abs=1e-9)
    assert differs  # the reservoir alone would not have given these
    assert any("--exact" in note for note in exact.meta["notes"]) and exact.meta["exact"] is True
    assert any("standard errors" in note for note in sampled.meta["notes"])
    # the cache key changes only when --exact is on
    assert prepare(make_spec(folder, "builtin", exact=True, **kw)).key != sampled.key


def _accumulate(x, reservoir, seed):
    """A layer accumulator fed ``x`` in batches of 1,000 (one sample per batch row block)."""
    import torch

    from isotui.core.accumulator import LayerAccumulator, sample_keys

    acc = LayerAccumulator(x.shape[1], torch.device("cpu"), full_cov=True, reservoir=reservoir)
    xt = torch.from_numpy(x)
    for start in range(0, len(x), 1000):
        rows = torch.arange(start, min(start + 1000, len(x)))
        ids = torch.zeros(len(rows), dtype=torch.long)
        keys = sample_keys(seed, rows // 50, rows % 50)
        acc.commit(acc.partial(xt[rows], ids, keys))
    return acc.finalize()


def test_standard_errors_are_finite_shrink_and_match_the_spread_over_reservoirs():
    rng = np.random.default_rng(0)
    d = 24
    x = rng.normal(size=(20_000, d)) * np.linspace(0.2, 0.03, d) + 0.1 * rng.normal(size=d)
    x[:, 3] *= 1 + (rng.random(20_000) < 0.05) * 8  # a heavy-tailed rogue dimension
    small = _accumulate(x, 256, seed=1)
    large = _accumulate(x, 4096, seed=1)
    for name in SAMPLED:
        se_small, se_large = getattr(small, f"{name}_se"), getattr(large, f"{name}_se")
        assert np.isfinite(se_small) and np.isfinite(se_large) and se_small > 0
        assert se_large < se_small, name
    # the reported SE against the spread of the estimate over independent reservoirs
    runs = [_accumulate(x, 512, seed=s) for s in range(2, 22)]
    for name in SAMPLED:
        spread = np.std([getattr(r, name) for r in runs], ddof=1)
        reported = np.mean([getattr(r, f"{name}_se") for r in runs])
        assert 1 / 3 < reported / spread < 3.0, (name, reported, spread)


def test_csv_keeps_its_columns_and_appends_the_errors(tmp_path):
    from isotui.results import SE_FIELDS, LayerRow
    from isotui.store.export import RUN_COLUMNS, write_csv

    from .test_snapshots import fixture_result

    result = fixture_result("m", 3, 8, 0.1)

    path = write_csv([result], tmp_path / "x.csv")
    with path.open() as f:
        header = next(csv.reader(f))
    names = LayerRow.columns()
    n = names.index(SE_FIELDS[0])  # what came before the standard errors keeps its place
    assert header[:n] == names[:n]
    assert header[n : n + len(RUN_COLUMNS)] == list(RUN_COLUMNS)
    later = header[n + len(RUN_COLUMNS) :]  # the errors, then what was added after them
    assert later[: len(SE_FIELDS)] == list(SE_FIELDS) == [f"{m}_se" for m in SAMPLED]
    assert later == names[n:]


def test_exact_setting_is_checked():
    from isotui.spec import make_spec

    assert make_spec("minilm", exact=True).exact is True
    with pytest.raises(IsotuiError, match="exact must be true or false"):
        make_spec("minilm", exact="yes")


def test_exact_in_config_files_and_settings(tmp_path, capsys):
    from isotui.cli import main
    from isotui.config import load_run_config
    from isotui.settings import load_settings

    good = tmp_path / "good.toml"
    good.write_text("exact = true\n")
    assert load_run_config(good)["exact"] is True
    bad = tmp_path / "bad.toml"
    bad.write_text('exact = "yes"\nmodel = "minilm"\n')
    assert main(["run", str(bad), "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "setting 'exact' must be a bool" in err and "Traceback" not in err
    settings = tmp_path / "isotui.toml"
    settings.write_text("[run]\nexact = true\n")
    loaded = load_settings(settings)
    assert loaded.run == {"exact": True} and not loaded.problems


def test_app_plot_band_is_one_standard_error_each_side(tiny_models, tmp_path):
    """The app draws a sampled metric with its ±1 SE band; an exact metric (SE 0) has none."""
    from isotui.experiments.layerwise import measure
    from isotui.spec import make_spec
    from isotui.tui.plots import se_band

    from .conftest import corpus

    data = tmp_path / "t.txt"
    data.write_text("\n".join(corpus(20)) + "\n", encoding="utf-8")
    result = measure(make_spec(str(tiny_models["bert"]), f"text:{data}", reservoir=40), None)
    lower, upper = se_band(result.rows, "avg_cos_centered")
    for row, lo, hi in zip(result.rows, lower, upper, strict=True):
        assert row.avg_cos_centered_se > 0
        assert lo == pytest.approx(row.avg_cos_centered - row.avg_cos_centered_se)
        assert hi == pytest.approx(row.avg_cos_centered + row.avg_cos_centered_se)
    assert se_band(result.rows, "avg_cos") is None  # exact over all pairs: no band
    full = measure(make_spec(str(tiny_models["bert"]), f"text:{data}"), None)  # reservoir holds all
    assert se_band(full.rows, "avg_cos_centered") is None


def _plain_jackknife(x, centred, parts):
    """The delete-a-group jackknife SEs of I(W), centred I(W) and all-but-the-top as first
    written: each group's rest summed and decomposed afresh (eigh of rest^T rest, or the rows'
    SVD and a null direction when there are fewer rows than dims), in plain numpy."""

    def principal(v):
        if v.shape[1] <= len(v):
            return np.linalg.eigh(v.T @ v)[1][:, ::-1], False
        return np.linalg.svd(v, full_matrices=False)[2].T, True

    def iw(v, vecs, null):
        proj = v @ vecs
        log_z = np.concatenate([logsumexp(proj, axis=0), logsumexp(-proj, axis=0)])
        if null:
            log_z = np.append(log_z, np.log(len(v)))
        return np.exp(log_z.min() - log_z.max())

    top = max(1, int(np.ceil(x.shape[1] / 100)))
    theta = {"iw": [], "iw_centered": [], "avg_cos_abtt": []}
    for idx in parts:
        keep = np.ones(len(x), dtype=bool)
        keep[idx] = False
        rest, rest_c = x[keep], centred[keep]
        vecs_c, null_c = principal(rest_c)
        theta["iw"].append(iw(rest, *principal(rest)))
        theta["iw_centered"].append(iw(rest_c, vecs_c, null_c))
        pcs = vecs_c[:, :top]
        theta["avg_cos_abtt"].append(_mean_cos(rest_c - rest_c @ pcs @ pcs.T))
    g = len(parts)
    return {
        f"{m}_se": np.sqrt((g - 1) / g * ((np.array(v) - np.mean(v)) ** 2).sum()) for m, v in theta.items()
    }


@pytest.mark.parametrize(("n", "d"), [(900, 24), (600, 130), (40, 48)])
def test_eigen_jackknife_equals_the_plain_formula(n, d):
    """The rest's d x d sums taken as the whole's minus the group's change only rounding: the
    SEs stay within 1e-9 of summing and decomposing each rest afresh (and the SVD path, more dims
    than rows, is the plain one)."""
    import torch

    from isotui.core.sampled import eigen_jackknife_se, key_groups

    rng = np.random.default_rng(n + d)
    x = rng.normal(size=(n, d)) * np.linspace(0.3, 0.05, d) + 0.05 * rng.normal(size=d)
    x[:, 1] *= 1 + (rng.random(n) < 0.05) * 6  # a heavy-tailed rogue dimension
    centred = x - x.mean(0) + 0.01 * rng.normal(size=d)  # the exact mean is not the sample's
    parts = key_groups(torch.from_numpy(rng.random(n)))
    got = eigen_jackknife_se(torch.from_numpy(x), torch.from_numpy(centred), parts)
    want = _plain_jackknife(x, centred, [p.numpy() for p in parts])
    for name, value in want.items():
        assert value > 0 and got[name] == pytest.approx(value, rel=1e-9, abs=0), name


def _cloud_population(rng, n: int, d: int, top_sd: float) -> np.ndarray:
    """A centred Gaussian cloud whose per-direction sd falls from ``top_sd`` by e every d/5."""
    sd = top_sd * np.exp(-np.arange(d) / (d / 5))
    basis, _ = np.linalg.qr(rng.normal(size=(d, d)))
    x = (rng.normal(size=(n, d)) * sd) @ basis.T
    return x - x.mean(0)


@pytest.mark.parametrize("top_sd", [0.25, 1.0], ids=["nearly-isotropic", "anisotropic"])
def test_centred_iw_intervals_cover_at_a_256_vector_reservoir(top_sd):
    """Centred I(W) over exact directions from a 256-vector reservoir (issue 37: 90.5% coverage
    for a nominal 95% on MiniLM): value ± t(0.975, 7)·SE holds the all-vectors value (plain
    numpy over the 20,000 rows) in >= 93% of 300 reservoirs. I(W) is a min over a max of 128
    noisy sums; where directions are near-tied the jackknife alone misses that selection (its
    intervals cover < 90% here), the bootstrap's bias widening does not."""
    import torch

    from isotui.core.sampled import held_iw_jackknife, jackknife_t, key_groups

    rng = np.random.default_rng(7)
    x = _cloud_population(rng, 20_000, 64, top_sd)
    vecs = np.linalg.eigh(x.T @ x)[1]
    truth = _iw(x, vecs)
    t = jackknife_t()
    covered, jackknife_covered = 0, 0
    for _ in range(300):
        rows = x[rng.choice(len(x), 256, replace=False)]
        proj = torch.from_numpy(rows @ vecs)
        parts = key_groups(torch.from_numpy(rng.random(256)))
        value, se = held_iw_jackknife(proj, parts)
        covered += abs(value - truth) <= t * se
        per_group = [
            np.concatenate([logsumexp(rows[p] @ vecs, 0), logsumexp(-rows[p] @ vecs, 0)]) for p in parts
        ]
        theta = [np.exp((lz := logsumexp(np.delete(per_group, g, 0), 0)).min() - lz.max()) for g in range(8)]
        jk = np.sqrt(7 / 8 * ((np.array(theta) - np.mean(theta)) ** 2).sum())
        assert value == pytest.approx(_iw(rows, vecs), rel=1e-9) and se >= jk * (1 - 1e-9)
        jackknife_covered += abs(value - truth) <= t * jk
    assert covered / 300 >= 0.93, (covered, jackknife_covered)
    if top_sd < 0.5:
        assert jackknife_covered / 300 < 0.90, jackknife_covered  # what the issue found
