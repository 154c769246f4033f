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
