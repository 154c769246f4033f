"""Numbers the docs quote from a run are the run's (issue 37 item 5): each is produced here by the
command the page describes, formatted as the page writes it, and found in the page."""

from __future__ import annotations

from pathlib import Path

import pytest

import isotui

ROOT = Path(__file__).resolve().parents[1]


def _page(name: str) -> str:
    return " ".join((ROOT / "docs" / name).read_text(encoding="utf-8").split())


@pytest.mark.slow
def test_final_norm_numbers_on_minilm_are_the_runs():
    """docs/experiments/training.md: the last output norm of MiniLM on 200 built-in sentences,
    then --every-layer (blocks counted from 1 in the prose, as the table's rows)."""
    page = _page("experiments/training.md")
    last = isotui.experiment("final-norm", model="minilm", max_samples=200, cache=False, progress=False)
    x = last.results[0]
    top = sorted(x.dims, key=lambda d: -d.share_before)[:3]
    assert max(abs(d.gain) for d in top) < 1e-8
    said = (
        f"the last output LayerNorm takes avg_cos from {x.before.avg_cos:.2f} to {x.after.avg_cos:.2f} "
        f"and IsoScore from {x.before.isoscore:.3f} to {x.after.isoscore:.2f}: dimensions "
        f"{top[0].dim}, {top[1].dim} and {top[2].dim} carry {sum(d.share_before for d in top):.0%} of "
        "avg_cos before it and their gains are all below 1e-8 in magnitude."
    )
    assert said in page, said
    every = isotui.experiment(
        "final-norm", model="minilm", max_samples=200, every_layer=True, cache=False, progress=False
    ).results
    assert all(y.after.avg_cos < y.before.avg_cos for y in every)  # "lower avg_cos in every block"
    shares = [next(d for d in y.dims if d.dim == 223).share_before for y in every[2:5]]
    said = (
        f"in every block ({every[4].before.avg_cos:.2f} -> {every[4].after.avg_cos:.2f} in block 5), and "
        f"dimension 223 carries {min(shares):.0%}-{max(shares):.0%} of avg_cos going into blocks 3-5"
    )
    assert said in page, said


NAMES = {
    "avg_cos_centered": "centred avg_cos",
    "iw": "I(W)",
    "iw_centered": "centred I(W)",
    "avg_cos_abtt": "all-but-the-top",
    "avg_cos_std": "standardised avg_cos",
}


@pytest.mark.slow
def test_sampled_against_exact_numbers_are_the_benchmarks():
    """docs/metrics.md: benchmarks/sampled_vs_exact.py's summary on MiniLM over the built-in corpus
    (1,000 samples, reservoir 4,096): how many layer-metrics lie within 1.5 SE, the farthest, and
    layer 0's all-but-the-top."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "sampled_vs_exact", ROOT / "benchmarks" / "sampled_vs_exact.py"
    )
    bench = importlib.util.module_from_spec(spec)
    sys.modules["sampled_vs_exact"] = bench  # a NamedTuple's module is looked up by name
    spec.loader.exec_module(bench)
    gaps, n_sample = bench.compare("minilm", 1000)
    assert n_sample == 4096
    far = max(gaps, key=lambda g: g.z)
    abtt = next(g for g in gaps if g.layer == 0 and g.metric == "avg_cos_abtt")
    within = sum(g.z <= 1.5 for g in gaps)
    said = (
        f"within 1.5 SE of the all-vectors ones for {within} of the {len(gaps)} layer-metrics, the "
        f"farthest {far.z:.1f} SE (layer {far.layer}'s {NAMES[far.metric]}: {far.value:.3g} ± {far.se:.2g} "
        f"against {far.exact:.3g} exact; layer 0's all-but-the-top: {abtt.value:.2g} ± {abtt.se:.5f} "
        f"against {abtt.exact:.2g};"
    )
    assert said in _page("metrics.md"), said
