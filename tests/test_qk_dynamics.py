"""Query/key dynamics over a checkpoint series: trajectories against a numpy SVD done in the test."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from isotui.cli import main
from isotui.errors import IsotuiError
from isotui.experiments.attention import attention_cache, measure_attention
from isotui.experiments.qk_dynamics import resolve_checkpoints, run_dynamics, series_name
from isotui.spec import make_spec


@pytest.fixture(scope="module")
def series(tiny_models, tmp_path_factory):
    """Three 'checkpoints' of the tiny BERT: its weights, then with a growing shared drift added
    to the query and key biases (so Q_bar and K_bar move), saved as step_0, step_10, step_20."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    root = tmp_path_factory.mktemp("series") / "tiny-run"
    tok = AutoTokenizer.from_pretrained(str(tiny_models["bert"]))
    gen = torch.Generator().manual_seed(3)
    direction = torch.randn(32, generator=gen)
    for i, step in enumerate((0, 10, 20)):
        model = AutoModel.from_pretrained(str(tiny_models["bert"]))
        with torch.no_grad():
            for layer in model.encoder.layer:
                layer.attention.self.query.bias += 0.5 * i * direction
                layer.attention.self.key.bias += 0.5 * i * direction
        folder = root / f"step_{step}"
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    return root


def test_resolve_checkpoints(series):
    folder = resolve_checkpoints(None, [str(series)])
    assert [c.label for c in folder] == ["step_0", "step_10", "step_20"] and [c.step for c in folder] == [
        0,
        10,
        20,
    ]
    revs = resolve_checkpoints("EleutherAI/pythia-70m", ["step1000,step2000", "step3000"])
    assert [c.model for c in revs] == [f"EleutherAI/pythia-70m@step{s}" for s in (1000, 2000, 3000)]
    ids = resolve_checkpoints(None, ["google/multiberts-seed_0-step_20k google/multiberts-seed_0-step_40k"])
    assert [c.step for c in ids] == [20000, 40000]
    assert series_name(ids) == "google/multiberts-seed_0"
    assert series_name(folder) == "tiny-run"
    with pytest.raises(IsotuiError, match="at least 2"):
        resolve_checkpoints("m", ["step1"])
    with pytest.raises(IsotuiError, match="holds no model folder"):
        resolve_checkpoints(None, [str(series.parent)])


def test_trajectories_match_numpy_svd(series, tmp_path):
    checkpoints = resolve_checkpoints(None, [str(series)])
    base = make_spec(checkpoints[0].model, "builtin", max_samples=16, max_length=20)
    cache = attention_cache(tmp_path / "cache")
    result = run_dynamics(None, checkpoints, base, cache, sample_size=40)
    per = [measure_attention(base.with_model(c.model), cache, sample_size=40) for c in checkpoints]
    assert all(p.from_cache for p in per)  # each checkpoint was cached on its own
    # the subsample is the same tokens at every checkpoint: only the query bias moved, so each
    # sampled query moved by exactly that shift
    shift = per[1].arrays["q_sample.0"] - per[0].arrays["q_sample.0"]
    assert per[0].arrays["q_sample.0"].shape == (4, 40, 8)
    np.testing.assert_allclose(shift, np.broadcast_to(shift[:, :1], shift.shape), atol=1e-4)
    for i, _site in enumerate(result.sites):
        for head in range(4):
            qs = [p.arrays[f"q_sample.{i}"][head] for p in per]
            ks = [p.arrays[f"k_sample.{i}"][head] for p in per]
            for basis, pool in (("qk", qs + ks), ("q", qs), ("k", ks)):
                _, _, vt = np.linalg.svd(np.concatenate(pool).astype(np.float64), full_matrices=False)
                q_path, k_path = result.trajectory(i, head, basis)
                for t, p in enumerate(per):
                    want_q = vt[:2] @ p.arrays[f"q_bar.{i}"][head]
                    want_k = vt[:2] @ p.arrays[f"k_bar.{i}"][head]
                    np.testing.assert_allclose(np.abs(q_path[t]), np.abs(want_q), rtol=1e-6, atol=1e-9)
                    np.testing.assert_allclose(np.abs(k_path[t]), np.abs(want_k), rtol=1e-6, atol=1e-9)
                    row = next(
                        r
                        for r in result.rows
                        if r.checkpoint == checkpoints[t].label
                        and r.head == head
                        and r.layer == result.sites[i][1]
                    )
                    assert row.cos_qk_bar == p.module_rows(i)[head].cos_qk_bar
    # the shared bias drift aligns Q_bar and K_bar along training: cos rises at every layer
    cos = result.layer_means("cos_qk_bar")
    assert np.all(cos[-1] > cos[0]) and not np.isnan(cos).any()


def test_cli_table_csv_and_plot(series, tmp_path, capsys):
    out = tmp_path / "dyn.csv"
    args = ["experiment", "qk-dynamics", "-c", str(series), "--max-samples", "8", "--sample", "16"]
    assert main([*args, "--csv", str(out), "--plot", "2:1", "-q"]) == 0
    text = capsys.readouterr().out
    assert "cos(Q̄,K̄) per layer" in text and "step_20" in text and "layer 2 head 1" in text
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 3 * 2 * 4
    assert {r["checkpoint"] for r in rows} == {"step_0", "step_10", "step_20"}
    assert all(math.isfinite(float(r["q_x_qk"])) for r in rows)
    assert main([*args, "--plot", "9", "-q"]) == 2
    assert "no such layer" in capsys.readouterr().err


def test_a_series_of_two_architectures_is_one_sentence(tiny_models, tmp_path, capsys):
    """Same layer count, other heads: the dynamics and the heatmap both refuse, in one sentence."""
    import shutil

    mixed = tmp_path / "mixed"
    shutil.copytree(tiny_models["bert"], mixed / "step_0")
    from transformers import AutoTokenizer, BertConfig, BertModel

    other = BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    BertModel(other).save_pretrained(mixed / "step_10")
    AutoTokenizer.from_pretrained(str(tiny_models["bert"])).save_pretrained(mixed / "step_10")
    assert main(["experiment", "qk-dynamics", "-c", str(mixed), "--max-samples", "4", "-q"]) == 2
    assert "a series must be checkpoints of one architecture" in capsys.readouterr().err  # heads differ
    # the heatmap compares layers and widths: the same here, so it runs; a deeper model is refused
    assert main(["experiment", "checkpoints", "-c", str(mixed), "--max-samples", "4", "-q"]) == 0
    BertModel(BertConfig(**{**other.to_dict(), "num_hidden_layers": 3})).save_pretrained(mixed / "step_20")
    AutoTokenizer.from_pretrained(str(tiny_models["bert"])).save_pretrained(mixed / "step_20")
    assert main(["experiment", "checkpoints", "-c", str(mixed), "--max-samples", "4", "-q"]) == 2
    assert "one architecture" in capsys.readouterr().err
