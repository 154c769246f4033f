"""`isotui figure godey2024-fig11 ... fig23`: queries and keys along a real train-tiny series. Each
CSV is checked against `isotui experiment qk-dynamics --csv` (the per-head numbers) with the heads'
means recomputed here in numpy; PDF and SVG are deterministic; bad --layer/--head is one sentence."""

from __future__ import annotations

import csv
from collections import defaultdict

import numpy as np
import pytest

from isotui.cli import main

TRAJECTORIES = {11: "qk", 12: "qk", 19: "q", 20: "q", 21: "k", 22: "k"}
CURVES = {13: "cos_qk_bar", 14: "cos_qk_bar", 23: "dot_qk_bar", 15: "entropy"}


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    """A 2-step train-tiny run (3 checkpoints: the init, step 1, step 2), its cache and its
    qk-dynamics CSV (every head at every checkpoint)."""
    root = tmp_path_factory.mktemp("dyn")
    run = root / "tiny"
    train = ["train-tiny", "--out", str(run), "--steps", "2", "--save-every", "1", "--hidden", "32"]
    train += ["--layers", "2", "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--threads", "1", "-q"]
    assert main(train) == 0
    flags = ["-c", str(run), "--max-samples", "8", "--sample", "24", "--cache-dir", str(root / "cache")]
    reference = root / "dynamics.csv"
    assert main(["experiment", "qk-dynamics", *flags, "--csv", str(reference), "-q"]) == 0
    return {"flags": flags, "rows": read_csv(reference), "root": root}


def draw(series, tmp_path, number, *extra, suffix="pdf"):
    out = tmp_path / f"fig{number}.{suffix}"
    assert main(["figure", f"godey2024-fig{number}", *series["flags"], *extra, "--out", str(out), "-q"]) == 0
    return out


@pytest.mark.parametrize(("number", "basis"), sorted(TRAJECTORIES.items()))
def test_trajectories_are_the_series_coordinates_in_the_figures_basis(series, tmp_path, number, basis):
    out = draw(series, tmp_path, number)
    assert out.read_bytes().startswith(b"%PDF")
    rows = read_csv(out.with_suffix(".csv"))
    last = max(int(r["layer"]) for r in series["rows"])  # the default layer: the last
    expected = [r for r in series["rows"] if int(r["layer"]) == last]
    expected.sort(key=lambda r: (int(r["head"]), int(r["step"])))  # panel by panel, step by step
    assert len(rows) == len(expected) == 2 * 3  # 2 heads x 3 checkpoints
    for got, want in zip(rows, expected, strict=True):
        assert (got["head"], got["step"], got["basis"]) == (want["head"], want["step"], basis)
        for v in ("q_x", "q_y", "k_x", "k_y"):
            tag, axis = v.split("_")
            assert float(got[v]) == float(want[f"{tag}_{axis}_{basis}"])


def test_basis_layer_and_head_choose_the_panel(series, tmp_path):
    out = draw(series, tmp_path, 11, "--basis", "k", "--layer", "1", "--head", "1", suffix="svg")
    rows = read_csv(out.with_suffix(".csv"))
    want = [r for r in series["rows"] if r["layer"] == "1" and r["head"] == "1"]
    assert [r["checkpoint"] for r in rows] == [r["checkpoint"] for r in want]
    assert [float(r["k_y"]) for r in rows] == [float(r["k_y_k"]) for r in want]
    assert {r["basis"] for r in rows} == {"k"}
    svg = out.read_text()
    assert "head 1" in svg and "keys only" in svg


@pytest.mark.parametrize(("number", "attr"), sorted(CURVES.items()))
def test_layer_curves_are_the_heads_means(series, tmp_path, number, attr):
    out = draw(series, tmp_path, number)
    rows = read_csv(out.with_suffix(".csv"))
    per_head = defaultdict(list)
    for r in series["rows"]:
        per_head[(r["checkpoint"], r["layer"])].append(float(r[attr]))
    assert len(rows) == len(per_head) == 3 * 2
    for r in rows:
        values = np.array(per_head[(r["checkpoint"], r["layer"])])
        assert float(r[attr]) == pytest.approx(values[np.isfinite(values)].mean(), rel=1e-12)
        assert int(r["heads"]) == 2
    assert [int(r["step"]) for r in rows[::2]] == [0, 1, 2]


@pytest.mark.parametrize("number", [11, 15])
def test_pdf_and_svg_are_deterministic(series, tmp_path, number):
    for suffix in ("pdf", "svg"):
        first = draw(series, tmp_path / "a", number, suffix=suffix).read_bytes()
        second = draw(series, tmp_path / "b", number, suffix=suffix).read_bytes()
        assert first == second


def test_json_names_each_checkpoints_cached_run(series, tmp_path):
    import json

    out = draw(series, tmp_path, 13)
    runs = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert [r["step"] for r in runs] == [0, 1, 2]
    for r in runs:  # each key is an attention result in the cache (its file)
        assert (series["root"] / "cache" / "attention" / f"{r['key']}.safetensors").is_file()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [(["--layer", "7"], "--layer 7: no such layer"), (["--head", "5"], "--head 5: no such head")],
)
def test_bad_layer_or_head_is_one_sentence(series, tmp_path, capsys, extra, needle):
    out = tmp_path / "f.pdf"
    assert main(["figure", "godey2024-fig11", *series["flags"], *extra, "--out", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("extra", [["--basis", "q"], ["--layer", "1"], ["--head", "0"]])
def test_trajectory_flags_on_another_figure_are_refused_before_any_run(capsys, tmp_path, extra):
    out = tmp_path / "f.pdf"
    assert main(["figure", "godey2024-fig13", "-c", str(tmp_path / "none"), *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{extra[0]} is for the trajectory figures" in err and len(err.strip().splitlines()) == 1


def test_a_series_figure_needs_checkpoints(capsys, tmp_path):
    assert main(["figure", "godey2024-fig13", "--out", str(tmp_path / "f.pdf"), "-q"]) == 2
    assert "needs --checkpoints" in capsys.readouterr().err
