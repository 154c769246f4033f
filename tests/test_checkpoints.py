"""Layer metrics along a checkpoint series: the layer x step grid against all-pairs references."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from isotui.cli import main
from isotui.experiments.checkpoints import run_series
from isotui.experiments.series import resolve_checkpoints
from isotui.spec import make_spec
from isotui.store.cache import ResultCache

from .conftest import corpus
from .reference import hidden_vectors, reference_layer


@pytest.fixture(scope="module")
def series(tiny_models, tmp_path_factory):
    """The tiny BERT at step 0, then with its embeddings shifted along one direction (more drift)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    root = tmp_path_factory.mktemp("ckpts") / "run"
    tok = AutoTokenizer.from_pretrained(str(tiny_models["bert"]))
    direction = torch.randn(32, generator=torch.Generator().manual_seed(5))
    for i, step in enumerate((0, 100, 200)):
        model = AutoModel.from_pretrained(str(tiny_models["bert"]))
        with torch.no_grad():
            model.embeddings.word_embeddings.weight += 0.05 * i * direction
        model.save_pretrained(root / f"step_{step}")
        tok.save_pretrained(root / f"step_{step}")
    return root


def test_grid_matches_all_pairs_reference(series, tmp_path):
    texts = corpus(8)
    data = tmp_path / "t.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    checkpoints = resolve_checkpoints(None, [str(series)])
    base = make_spec(checkpoints[0].model, f"text:{data}", max_length=64)
    result = run_series(None, checkpoints, base, ResultCache(tmp_path / "cache"))
    labels, grid = result.grid("avg_cos")
    assert labels == ["0", "1", "2"] and grid.shape == (3, 3) and result.steps() == [0, 100, 200]
    for j, ckpt in enumerate(checkpoints):
        layers, sample_labels = hidden_vectors(ckpt.model, texts, max_length=64)
        for i, x in enumerate(layers):
            ref = reference_layer(x, sample_labels)
            assert grid[i, j] == pytest.approx(ref.avg_cos, abs=1e-6)
    _, drift = result.grid("drift_norm")
    assert np.all(np.diff(drift[0]) > 0)  # the shifted embeddings drift more at every step
    again = run_series(None, checkpoints, base, ResultCache(tmp_path / "cache"))
    assert all(r.from_cache for r in again.results)


def test_cli_heatmap_and_csv(series, tmp_path, capsys):
    out = tmp_path / "ck.csv"
    args = ["experiment", "checkpoints", "-c", str(series), "--max-samples", "6", "--metric", "isoscore"]
    assert main([*args, "--csv", str(out), "-q"]) == 0
    text = capsys.readouterr().out
    assert "isoscore by layer" in text and "200=step_200" in text
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 3 * 3 and rows[0]["checkpoint"] == "step_0" and rows[-1]["step"] == "200"
    assert {"avg_cos", "isoscore", "drift_norm", "layer"} <= set(rows[0])
    assert main(["experiment", "checkpoints", "-c", str(series / "step_0"), "-q"]) == 2
    assert "at least 2" in capsys.readouterr().err
