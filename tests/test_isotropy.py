"""The extra isotropy metrics against direct computations: the isoscore package's IsoScore*,
I(W) evaluated directly in float64 (and its stability where that overflows), all-but-the-top and
standardised avg_cos over all pairs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from isotui.core.isotropy import (
    abtt_avg_cos,
    abtt_components,
    isoscore_star,
    partition_isotropy,
    standardized_avg_cos,
)
from isotui.core.spectrum import eigenvalues


def _cloud(n=300, d=12, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) * np.linspace(3, 0.2, d)  # anisotropic
    return x + rng.normal(size=d) * 2  # with a drift


def _all_pairs(v):
    u = v / np.linalg.norm(v, axis=1, keepdims=True)
    g = u @ u.T
    n = len(u)
    return (g.sum() - np.trace(g)) / (n * (n - 1))


def test_isoscore_star_matches_the_package():
    """The package's IsoScore* given isotui's target C0 = (tr(C) / d) I."""
    import torch
    from IsoScore import IsoScore

    x = _cloud()
    d = x.shape[1]
    c0 = torch.eye(d, dtype=torch.float64) * float(np.trace(np.cov(x, rowvar=False))) / d
    for zeta in (0.0, 0.2, 0.7):
        want = float(IsoScore.IsoScore_star(x, c0, zeta))
        # the package takes sqrt(d) of an integer tensor, in float32: agreement to ~1e-8
        assert isoscore_star(eigenvalues(np.cov(x, rowvar=False)), zeta) == pytest.approx(want, abs=1e-7)


def _isoscore_numpy(cov):
    """IsoScore of a covariance by the paper's steps, written out in numpy."""
    d = len(cov)
    lam = np.linalg.eigvalsh(cov)
    lam = lam * np.sqrt(d) / np.linalg.norm(lam)
    defect = np.linalg.norm(lam - 1) / np.sqrt(2 * (d - np.sqrt(d)))
    return ((d - defect**2 * (d - np.sqrt(d))) ** 2 - d) / (d * (d - 1))


def test_isoscore_star_does_not_depend_on_the_scale():
    x = _cloud(n=400, d=16)
    scores = []
    for scale in (0.1, 1.0, 10.0):
        c = np.cov(x * scale, rowvar=False)
        shrunk = 0.8 * c + 0.2 * np.trace(c) / len(c) * np.eye(len(c))  # explicit construction
        got = isoscore_star(eigenvalues(c))
        assert got == pytest.approx(_isoscore_numpy(shrunk), abs=1e-10)
        scores.append(got)
    assert scores[0] == pytest.approx(scores[1], abs=1e-12) and scores[2] == pytest.approx(
        scores[1], abs=1e-12
    )
    assert 0.0 < scores[1] < 1.0


def test_partition_isotropy_direct_and_overflow():
    x = _cloud() * 0.1
    _vals, vecs = np.linalg.eigh(x.T @ x)
    z = np.array([np.exp(x @ c).sum() for c in np.concatenate([vecs.T, -vecs.T])])  # columns!
    assert partition_isotropy(x) == pytest.approx(z.min() / z.max(), rel=1e-10)
    xc = x - x.mean(0)
    _, vc = np.linalg.eigh(xc.T @ xc)
    zc = np.array([np.exp(xc @ c).sum() for c in np.concatenate([vc.T, -vc.T])])
    assert partition_isotropy(x, centered=True) == pytest.approx(zc.min() / zc.max(), rel=1e-10)
    # far out: the direct sum overflows to inf; log space still gives the ratio (a tiny number)
    big = x * 4000
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.exp(big @ np.linalg.eigh(big.T @ big)[1]).sum(0)).all()
    got = partition_isotropy(big)
    assert 0 <= got < 1e-6 and math.isfinite(got)
    # an isotropic cloud is close to 1, the anisotropic one is not
    iso = np.random.default_rng(1).normal(size=(20000, 4)) * 0.05
    assert partition_isotropy(iso) > 0.95 > partition_isotropy(x)
    # d > n: the null-space directions (Z = n) count too
    wide = np.random.default_rng(2).normal(size=(5, 40)) * 0.1
    _, _, vt = np.linalg.svd(wide, full_matrices=False)
    zw = [np.exp(wide @ c).sum() for c in np.concatenate([vt, -vt])] + [5.0]
    assert partition_isotropy(wide) == pytest.approx(min(zw) / max(zw), rel=1e-10)


def test_abtt_and_standardised_over_all_pairs():
    x = _cloud(n=200, d=150)
    mean = x.mean(0)
    v = x - mean
    _w, vecs = np.linalg.eigh(np.cov(x, rowvar=False))
    top = vecs[:, ::-1][:, : abtt_components(150)]  # 2 for d = 150
    assert abtt_components(150) == 2 and abtt_components(768) == 8
    want = _all_pairs(v - v @ top @ top.T)
    assert abtt_avg_cos(x, mean) == pytest.approx(want, abs=1e-10)
    z = (x - mean) / x.std(0)
    assert standardized_avg_cos(x, mean, x.std(0)) == pytest.approx(_all_pairs(z), abs=1e-12)


def test_layer_rows_carry_the_new_metrics(tiny_models):
    from isotui.experiments.layerwise import measure
    from isotui.spec import make_spec

    from .conftest import corpus
    from .reference import hidden_vectors

    texts = corpus(6)
    result = measure(make_spec(str(tiny_models["bert"]), "builtin", max_samples=6, max_length=64), None)
    layers, _ = hidden_vectors(tiny_models["bert"], texts, max_length=64)
    for row, x in zip(result.rows, layers, strict=True):
        mean = x.mean(0)
        assert row.iw == pytest.approx(partition_isotropy(x), rel=1e-6)
        assert row.avg_cos_abtt == pytest.approx(abtt_avg_cos(x, mean), abs=1e-6)
        assert row.avg_cos_std == pytest.approx(_all_pairs((x - mean) / x.std(0)), abs=1e-6)
        assert row.isoscore_star == pytest.approx(
            isoscore_star(eigenvalues(np.cov(x, rowvar=False))), abs=1e-6
        )


def test_type_uniform_view_over_all_pairs(tiny_models, tmp_path):
    """Every token type weighted equally: pairs weigh 1/(count_i count_j), checked over all pairs."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from isotui.experiments.layerwise import measure
    from isotui.spec import make_spec

    from .conftest import corpus

    texts = [*corpus(8), "the the the the the the the the the the"]  # one very frequent type
    data = tmp_path / "t.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    folder = tiny_models["bert"]
    result = measure(make_spec(str(folder), f"text:{data}", max_length=64, batch_size=3), None)
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder)).eval()
    per_layer, ids, owner = None, [], []
    for s_i, text in enumerate(texts):
        enc = tok(text, truncation=True, max_length=64, return_special_tokens_mask=True, return_tensors="pt")
        keep = enc["special_tokens_mask"][0] == 0
        with torch.no_grad():
            hs = model(input_ids=enc["input_ids"], output_hidden_states=True).hidden_states
        per_layer = per_layer or [[] for _ in hs]
        for layer, h in enumerate(hs):
            per_layer[layer].append(h[0][keep].double().numpy())
        ids += enc["input_ids"][0][keep].tolist()
        owner += [s_i] * int(keep.sum())
    ids = np.array(ids)
    _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    w = 1.0 / counts[inverse]
    pair_w = np.outer(w, w)
    np.fill_diagonal(pair_w, 0.0)
    for row, chunks in zip(result.rows, per_layer, strict=True):
        x = np.concatenate(chunks)
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        want = float((pair_w * (u @ u.T)).sum() / pair_w.sum())
        assert row.avg_cos_types == pytest.approx(want, abs=1e-7)  # float32 model, batched
        drift = np.linalg.norm((w[:, None] * x).sum(0) / w.sum())
        assert row.drift_norm_types == pytest.approx(drift, rel=1e-6)
        assert row.avg_cos_types != pytest.approx(row.avg_cos, abs=1e-6)  # "the" weighs less now
        # Ethayarajh 2019: self-similarity over types seen in two or more samples (pairs from
        # different samples), intra-sentence similarity to each sample's mean vector
        owner_a, cos = np.array(owner), u @ u.T
        sims = []
        for t in np.unique(ids):
            at = np.flatnonzero(ids == t)
            if len(np.unique(owner_a[at])) < 2:
                continue
            cross = owner_a[at][:, None] != owner_a[at][None, :]
            sims.append(cos[np.ix_(at, at)][cross].mean())
        assert row.self_sim_types == len(sims)
        assert row.self_sim == pytest.approx(np.mean(sims), abs=1e-7)
        intra = []
        for chunk in chunks:
            bar = chunk.mean(0)
            intra.append(np.mean(chunk @ bar / np.linalg.norm(chunk, axis=1) / np.linalg.norm(bar)))
        assert row.intra_sim == pytest.approx(np.mean(intra), abs=1e-7)
    t5 = measure(
        make_spec("random:t5:d_model=32,d_ff=64,num_layers=2,num_heads=2,d_kv=16", f"text:{data}"), None
    )
    assert all(math.isfinite(r.avg_cos_types) for r in t5.rows)
