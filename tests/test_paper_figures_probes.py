"""`isotui figure` for the probes: the drift block's Figs. 7-10, Fig. 16's Pearson p-values, the
final norm per dimension and the gradients' energy share. Each from a small real run; its CSV
against the experiment's own --json output and numbers recomputed here; deterministic PDF/SVG;
PNG sizes; bad input in one sentence."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from isotui.cli import main

from .conftest import corpus

BLOCK = ["--hidden", "32", "--heads", "4", "--intermediate", "64", "--vocab", "100", "--batch", "2"]
BLOCK += ["--seq-len", "16", "--norms", "0:12:5", "--seeds", "0,1"]
GPT2 = "random:gpt2:n_layer=2,n_embd=32,n_head=2"


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def floats(rows, name):
    return np.array([float(r[name]) for r in rows])


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(8)) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def block(tmp_path):
    """The sweep as `isotui experiment drift-block --json` gives it (cached for the figures)."""
    out = tmp_path / "block.json"
    assert main(["experiment", "drift-block", *BLOCK, "--json", str(out), "-q"]) == 0
    return json.loads(out.read_text())


def figure(tmp_path, name, *args, suffix="pdf"):
    out = tmp_path / f"{name}.{suffix}"
    assert main(["figure", name, *args, "--out", str(out), "-q"]) == 0
    return out, read_csv(out.with_suffix(".csv")), json.loads(out.with_suffix(".json").read_text())


def per_seed(block, name):
    """(seeds, N) of one metric from the rows, seed by seed."""
    return np.array([r[name] for r in block["rows"]], dtype=float).reshape(len(block["seeds"]), -1)


def test_list_names_the_probe_figures(capsys):
    assert main(["figure", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("godey2024-fig7", "godey2024-fig8", "godey2024-fig9", "godey2024-fig10", "godey2024-fig16"):
        assert name in out
    assert "machina2024-final-norm" in out and "gradient-energy" in out


def test_fig7_bars_are_sums_of_the_stored_score_bins(block, tmp_path):
    _, rows, meta = figure(tmp_path, "godey2024-fig7", *BLOCK)
    norms = np.array(block["norms"])
    shown = sorted({float(r["norm"]) for r in rows})
    assert shown == [0.0, 3.0, 9.0, 12.0]  # 4 of the 5 N, evenly spread, first and last kept
    hist = np.array(block["score_hist"], dtype=np.int64)  # [seed][N][head][bin]
    for norm in shown:
        i = int(np.flatnonzero(norms == norm)[0])
        edges = np.array(block["score_edges"][i])
        pooled = hist[:, i].sum(axis=(0, 1))[1:-1]  # seeds and heads pooled, the in-range bins
        bars = [r for r in rows if float(r["norm"]) == norm]
        for bar in bars:
            inside = (edges[:-1] >= float(bar["left"]) - 1e-15) & (edges[1:] <= float(bar["right"]) + 1e-15)
            assert int(bar["count"]) == int(pooled[inside].sum())
        lefts = [float(b["left"]) for b in bars]
        assert lefts == sorted(lefts) and len(bars) <= 60
        shown_total = sum(int(b["count"]) for b in bars)
        assert shown_total >= 0.997 * pooled.sum()  # the central 99.8%, bars of whole bins
    assert [r["seed"] for r in meta["runs"]] == [0, 1]
    log = tmp_path / "log.svg"
    assert main(["figure", "godey2024-fig7", *BLOCK, "--log-counts", "--out", str(log), "-q"]) == 0
    assert log.with_suffix(".csv").read_text() == (tmp_path / "godey2024-fig7.csv").read_text()


def test_fig8_is_the_queries_and_keys_mean_over_seeds(block, tmp_path):
    _, rows, _ = figure(tmp_path, "godey2024-fig8", *BLOCK)
    assert floats(rows, "norm").tolist() == [0.0, 3.0, 6.0, 9.0, 12.0]
    for name in ("q_avg_cos", "k_avg_cos", "q_mean_norm", "k_mean_norm"):
        values = per_seed(block, name)
        assert floats(rows, name) == pytest.approx(values.mean(axis=0), rel=1e-12)
        assert floats(rows, f"{name}_std") == pytest.approx(values.std(axis=0, ddof=1), rel=1e-9)


def test_fig9_and_fig10_are_the_softmax_rows_and_their_extremes(block, tmp_path):
    position = np.array(block["softmax_position"])  # [seed][N][stat: max, median, min][t]
    _, rows, _ = figure(tmp_path, "godey2024-fig9", *BLOCK)
    for s, name in enumerate(("softmax_max", "softmax_median", "softmax_min")):
        mean_over_rows = position[:, :, s, :].mean(axis=2)  # every position has the same rows
        assert floats(rows, name) == pytest.approx(mean_over_rows.mean(axis=0), rel=1e-9)
    assert floats(rows, "uniform") == pytest.approx([1 / 16] * 5)
    assert floats(rows, "softmax_max").min() >= 1 / 16 >= floats(rows, "softmax_min").max()
    _, rows, _ = figure(tmp_path, "godey2024-fig10", *BLOCK, suffix="svg")
    peak = position[:, :, 0, :].max(axis=2).mean(axis=0)
    floor = position[:, :, 2, :].min(axis=2).mean(axis=0)
    assert floats(rows, "softmax_max_peak") == pytest.approx(peak, rel=1e-12)
    assert floats(rows, "softmax_min_floor") == pytest.approx(floor, rel=1e-12)
    assert floats(rows, "softmax_max_peak_std") == pytest.approx(
        position[:, :, 0, :].max(axis=2).std(0, ddof=1)
    )


def test_fig9_at_one_norm_is_the_per_position_rows(block, tmp_path):
    position = np.array(block["softmax_position"])  # [seed][N][stat: max, median, min][t]
    _, rows, _ = figure(tmp_path, "godey2024-fig9", *BLOCK, "--at-norm", "9", suffix="svg")
    assert [int(r["position"]) for r in rows] == list(range(16)) and {r["norm"] for r in rows} == {"9.0"}
    for s, name in enumerate(("softmax_max", "softmax_median", "softmax_min")):
        at = position[:, 3, s, :]  # N = 9 is the sweep's fourth
        assert floats(rows, name) == pytest.approx(at.mean(axis=0), rel=1e-12)
        assert floats(rows, f"{name}_std") == pytest.approx(at.std(axis=0, ddof=1), rel=1e-9)


def test_fig16_is_pearsons_p_per_model(tiny_models, data, tmp_path):
    from scipy.stats import pearsonr

    run = ["-m", str(tiny_models["bert"]), "-m", "minilm", "--data", f"text:{data}"]
    _, rows, meta = figure(tmp_path, "godey2024-fig16", *run, suffix="svg")
    ref = tmp_path / "runs.json"
    assert main(["run", *run, "--json", str(ref), "-q"]) == 0
    results = json.loads(ref.read_text())["results"]
    assert [r["model"] for r in rows] == [r["model"] for r in results]
    assert "spearman_p" not in rows[0]  # Fig. 16 is Pearson's alone
    for got, result in zip(rows, results, strict=True):
        x = [row["drift_norm"] for row in result["rows"]]
        y = [row["avg_cos"] for row in result["rows"]]
        assert float(got["pearson_p"]) == pytest.approx(pearsonr(x, y).pvalue, rel=1e-9)
        assert float(got["pearson_r"]) == pytest.approx(pearsonr(x, y).statistic, rel=1e-9)
        assert int(got["n_layers"]) == len(x)
    assert [r["key"] for r in meta["runs"]] == [r["key"] for r in results]
    assert "0.05" in (tmp_path / "godey2024-fig16.svg").read_text()


def test_final_norm_figure_is_the_dimension_table(tmp_path):
    run = ["-m", "minilm", "--max-samples", "12"]
    _, rows, meta = figure(tmp_path, "machina2024-final-norm", *run, suffix="png")
    ref = tmp_path / "dims.json"
    assert main(["experiment", "final-norm", *run, "--json", str(ref), "-q"]) == 0
    (result,) = json.loads(ref.read_text())["results"]
    dims = result["dims"]
    assert [int(r["dim"]) for r in rows] == [d["dim"] for d in dims] == list(range(384))
    assert floats(rows, "gain") == pytest.approx([d["gain"] for d in dims], rel=1e-12)
    assert floats(rows, "abs_mean_before") == pytest.approx([abs(d["mean_before"]) for d in dims], rel=1e-12)
    assert floats(rows, "abs_mean_after") == pytest.approx([abs(d["mean_after"]) for d in dims], rel=1e-12)
    share = floats(rows, "share_before")
    assert share == pytest.approx([d["share_before"] for d in dims], rel=1e-12)
    assert share.sum() == pytest.approx(1.0, abs=1e-9)  # the dimensions' shares of avg cos add up to 1
    assert floats(rows, "share_after").sum() == pytest.approx(1.0, abs=1e-9)
    named = {int(r["dim"]) for r in rows if r["named"] == "True"}
    assert named == set(np.argsort(-share)[:3].tolist())
    assert [r["model"] for r in meta["runs"]] == ["minilm"] and len(meta["runs"][0]["key"]) == 32
    assert (tmp_path / "cache" / "final-norm" / f"{meta['runs'][0]['key']}.safetensors").is_file()


def test_gradient_energy_is_one_gradients_run_per_k(tmp_path):
    run = ["-m", GPT2, "--max-samples", "6"]
    _, rows, meta = figure(tmp_path, "gradient-energy", *run, "--ks", "3,1", suffix="svg")
    assert sorted({int(r["k"]) for r in rows}) == [1, 3]
    for k in (1, 3):
        ref = tmp_path / f"grads{k}.json"
        assert main(["experiment", "gradients", *run, "--top-k", str(k), "--json", str(ref), "-q"]) == 0
        (result,) = json.loads(ref.read_text())["results"]
        mine = [r for r in rows if int(r["k"]) == k]
        assert [int(r["layer"]) for r in mine] == [r["layer"] for r in result["rows"]]
        assert floats(mine, "top_share") == pytest.approx([r["top_share"] for r in result["rows"]], rel=1e-12)
        assert floats(mine, "random_share") == pytest.approx(
            [r["random_share"] for r in result["rows"]], rel=1e-12
        )
        assert floats(mine, "k_over_d") == pytest.approx([k / 32] * len(mine), rel=1e-12)
        assert ((floats(mine, "top_share") >= 0) & (floats(mine, "top_share") <= 1)).all()
    assert [(r["top_k"], len(r["key"])) for r in meta["runs"]] == [(1, 32), (3, 32)]
    for r in meta["runs"]:
        assert (tmp_path / "cache" / "gradients" / f"{r['key']}.safetensors").is_file()


@pytest.mark.parametrize("name", ["godey2024-fig7", "godey2024-fig9"])
def test_drift_figures_pdf_and_svg_are_deterministic(block, tmp_path, name):
    for suffix in ("pdf", "svg"):
        files = []
        for i in range(2):
            out = tmp_path / f"{i}.{suffix}"
            assert main(["figure", name, *BLOCK, "--out", str(out), "-q"]) == 0
            files.append(out.read_bytes())
        assert files[0] == files[1]
    pdf = (tmp_path / "0.pdf").read_bytes()
    assert b"/FontFile2" in pdf and b"CreationDate" not in pdf


@pytest.mark.parametrize(
    ("name", "run"),
    [
        ("gradient-energy", ["-m", GPT2, "--max-samples", "4", "--ks", "1,2"]),
        ("machina2024-final-norm", ["-m", "minilm", "--max-samples", "4"]),
    ],
)
def test_model_figures_pdf_and_svg_are_deterministic(tmp_path, name, run):
    for suffix in ("pdf", "svg"):
        files = []
        for i in range(2):
            out = tmp_path / f"{i}.{suffix}"
            assert main(["figure", name, *run, "--out", str(out), "-q"]) == 0
            files.append(out.read_bytes())
        assert files[0] == files[1]
    assert b"/FontFile2" in (tmp_path / "0.pdf").read_bytes()
    assert "<text" in (tmp_path / "0.svg").read_text()


@pytest.mark.parametrize(
    ("name", "width", "dpi"), [("godey2024-fig7", "single", 100), ("godey2024-fig8", "double", 80)]
)
def test_png_has_the_requested_width_and_the_recorded_height(block, tmp_path, name, width, dpi):
    from PIL import Image

    out = tmp_path / "f.png"
    assert main(["figure", name, *BLOCK, "--width", width, "--dpi", str(dpi), "--out", str(out), "-q"]) == 0
    meta = json.loads(out.with_suffix(".json").read_text())
    with Image.open(out) as image:
        assert image.size == (
            round({"single": 3.3, "double": 6.9}[width] * dpi),
            round(meta["height_in"] * dpi),
        )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["figure", "gradient-energy", "--ks", "0,2", "--out", "f.pdf"], "every k must be at least 1"),
        (["figure", "gradient-energy", "--ks", "a", "--out", "f.pdf"], "is not a list of whole numbers"),
        (["figure", "gradient-energy", "-m", "a", "-m", "b", "--out", "f.pdf"], "give at most one --model"),
        (["figure", "machina2024-final-norm", "-c", "a,b", "--out", "f.pdf"], "takes one model (-m)"),
        (["figure", "godey2024-fig7", "-m", "minilm", "--out", "f.pdf"], "takes no -m or -c"),
        (["figure", "godey2024-fig9", "--at-norm", "2.5", "--out", "f.pdf"], "the sweep has no N = 2.5"),
        (["figure", "godey2024-fig9", "--at-norm", "x", "--out", "f.pdf"], "--at-norm 'x' is not a number"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(args, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not list(tmp_path.glob("f.*"))


@pytest.mark.parametrize(
    ("ks", "needle"), [("2,64", "every k must be below the hidden size 32"), ("64", "k = 64 of --ks")]
)
def test_a_k_the_model_cannot_take_is_said_in_terms_of_ks(ks, needle, capsys, tmp_path):
    out = tmp_path / "f.pdf"
    args = [
        "figure",
        "gradient-energy",
        "-m",
        GPT2,
        "--max-samples",
        "4",
        "--ks",
        ks,
        "--out",
        str(out),
        "-q",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and "--top-k" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_every_probe_figure_is_in_the_docs_and_the_gallery():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "experiments" / "figures.md").read_text(encoding="utf-8")
    gallery = (root / "scripts" / "figure_gallery.py").read_text(encoding="utf-8")
    for name in ("godey2024-fig7", "godey2024-fig8", "godey2024-fig9", "godey2024-fig10", "godey2024-fig16"):
        assert f"| `{name}` |" in page and f"(../figures/{name}.png)" in page and f'"{name}"' in gallery
        assert (root / "docs" / "figures" / f"{name}.png").is_file()
    for name in ("machina2024-final-norm", "gradient-energy"):
        assert f"| `{name}` |" in page and f"isotui figure {name} " in page and f'"{name}"' in gallery
        assert (root / "docs" / "figures" / f"{name}.png").is_file()


def _drawn(monkeypatch) -> list:
    """The matplotlib figures `isotui figure` draws, kept for their artists."""
    import isotui.paper_figures as paper_figures

    drawn = []
    render = paper_figures.render

    def keep(*args, **kwargs):
        data, drawing = render(*args, **kwargs)
        drawn.append(drawing.figure)
        return data, drawing

    monkeypatch.setattr(paper_figures, "render", keep)
    return drawn


def _overlaps(labels) -> list[tuple[str, str]]:
    boxes = [(t.get_text(), t.get_window_extent()) for t in labels if t.get_visible() and t.get_text()]
    return [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1 :] if box.overlaps(other)]


def test_fig7_log_counts_tick_labels_never_overlap(tmp_path, monkeypatch):
    """With --log-counts a panel whose counts span under a decade had its minor ticks labelled
    (6x10^3 over 4x10^3 over 3x10^3, issue 29): y labels are powers of ten, none overlap."""
    drawn = _drawn(monkeypatch)
    wide = ["--hidden", "64", "--heads", "4", "--intermediate", "256", "--batch", "2"]
    wide += ["--seq-len", "64", "--norms", "0:30:16", "--seeds", "0,1", "--log-counts"]  # as in the docs
    figure(tmp_path, "godey2024-fig7", *wide, suffix="png")
    (fig,) = drawn
    fig.canvas.draw()
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 4
    narrow = 0
    for ax in panels:
        low, high = ax.get_ylim()
        narrow += np.log10(high / low) < 2  # the case in question: a panel under two decades
        labels = [
            t
            for t in ax.get_yticklabels(which="both")
            if t.get_visible() and t.get_text() and low <= t.get_position()[1] <= high
        ]
        for t in labels:
            assert np.log10(t.get_position()[1]) % 1 == 0, (ax.get_title(), t.get_text())
        assert not _overlaps(labels), ax.get_title()
    assert narrow
