"""`isotui figure`: every named figure from small real runs, its CSV against the results (or an
independent computation), deterministic PDF/SVG, PNG sizes, bad input, and matplotlib kept lazy."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from xml.etree import ElementTree

import numpy as np
import pytest

from isotui.cli import main

from .conftest import corpus


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(8)) + "\n", encoding="utf-8")
    return path


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def layer_results(args, tmp_path):
    """The layer runs the figure used, as `isotui run --json` gives them (from the same cache)."""
    out = tmp_path / "runs.json"
    assert main(["run", *args, "--json", str(out), "-q"]) == 0
    return json.loads(out.read_text())["results"]


def isotropic_density(c: np.ndarray, d: int) -> np.ndarray:
    """Closed form: Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) (1 - c^2)^((d-3)/2)."""
    log_norm = math.lgamma(d / 2) - 0.5 * math.log(math.pi) - math.lgamma((d - 1) / 2)
    with np.errstate(divide="ignore"):
        return np.exp(log_norm + (d - 3) / 2 * np.log1p(-(c**2)))


def test_list_names_every_figure(capsys):
    assert main(["figure", "--list"]) == 0
    out = capsys.readouterr().out
    names = [f"godey2024-fig{n}" for n in range(1, 11)] + ["godey2024-fig16"]
    names += ["godey2024-fig1", "godey2024-fig5", "godey2024-fig6", "godey2024-fig17", "godey2024-fig18"]
    names += [f"godey2024-fig{n}" for n in (11, 12, 13, 14, 15, 19, 20, 21, 22, 23)]
    names += ["machina2024-heatmap", "machina2024-curves"]
    assert all(name in out for name in names)


def test_fig1_csv_is_the_runs_avg_cos_and_json_has_keys(tiny_models, data, tmp_path):
    run = ["-m", str(tiny_models["bert"]), "-m", str(tiny_models["gpt2"]), "--data", f"text:{data}"]
    out = tmp_path / "fig1.pdf"
    assert main(["figure", "godey2024-fig1", *run, "--out", str(out), "-q"]) == 0
    results = layer_results(run, tmp_path)
    rows = read_csv(out.with_suffix(".csv"))
    expected = [(r["model"], row) for r in results for row in r["rows"]]
    assert len(rows) == len(expected)
    for got, (model, row) in zip(rows, expected, strict=True):
        assert got["model"] == model and int(got["layer"]) == row["layer"]
        assert float(got["avg_cos"]) == row["avg_cos"] and float(got["null_p95"]) == row["null_p95"]
        assert float(got["x"]) == row["layer"]
    meta = json.loads(out.with_suffix(".json").read_text())
    assert [r["key"] for r in meta["runs"]] == [r["key"] for r in results]
    assert meta["command"].startswith("isotui figure godey2024-fig1 -m ") and meta["width_in"] == 3.3
    assert out.read_bytes().startswith(b"%PDF")
    depth = tmp_path / "depth.svg"
    assert main(["figure", "godey2024-fig1", *run, "--depth", "--out", str(depth), "-q"]) == 0
    bert = str(tiny_models["bert"])
    xs = [float(r["x"]) for r in read_csv(depth.with_suffix(".csv")) if r["model"] == bert]
    n = len(results[0]["rows"])
    assert xs == pytest.approx([i / (n - 1) for i in range(n)])


def test_figs_2_to_4_draw_fig1s_layout_for_their_models(tmp_path):
    """Figs. 2-4 are Fig. 1's layout for other models (here a vision Transformer on images, as
    Fig. 3): the CSV is the layer run's avg_cos, and --list names them in figure order."""
    vit = (
        "random:vit:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,"
        "image_size=32,patch_size=8"
    )
    run = ["-m", vit, "--data", "synthetic:images", "--max-samples", "6"]
    out = tmp_path / "fig3.png"
    assert main(["figure", "godey2024-fig3", *run, "--out", str(out), "-q", "--dpi", "50"]) == 0
    results = layer_results(run, tmp_path)
    rows = read_csv(out.with_suffix(".csv"))
    assert [float(r["avg_cos"]) for r in rows] == [row["avg_cos"] for row in results[0]["rows"]]
    from isotui.paper_figures import FIGURES

    godey = [int(n.removeprefix("godey2024-fig")) for n in FIGURES if n.startswith("godey2024-fig")]
    assert godey == sorted(godey) and godey[:5] == [1, 2, 3, 4, 5]


def test_fig1_concatenates_encoder_and_decoder(tmp_path):
    t5 = "random:t5:num_layers=2,d_model=32,num_heads=2,d_ff=64,d_kv=16"
    run = ["-m", t5, "--max-samples", "6"]
    out = tmp_path / "t5.png"
    assert main(["figure", "godey2024-fig1", *run, "--depth", "--out", str(out), "-q"]) == 0
    rows = read_csv(out.with_suffix(".csv"))
    (result,) = layer_results(run, tmp_path)
    assert [r["component"] for r in rows] == [r["component"] for r in result["rows"]]
    assert {r["component"] for r in rows} == {"encoder", "decoder"}
    assert [float(r["x"]) for r in rows] == pytest.approx(np.linspace(0, 1, len(rows)).tolist())


def test_fig5_pvalues_are_the_drift_statistics(tiny_models, data, tmp_path):
    from scipy.stats import pearsonr

    run = ["-m", str(tiny_models["bert"]), "-m", "minilm", "--data", f"text:{data}"]
    out = tmp_path / "fig5.svg"
    assert main(["figure", "godey2024-fig5", *run, "--out", str(out), "-q"]) == 0
    rows = read_csv(out.with_suffix(".csv"))
    results = layer_results(run, tmp_path)
    assert [r["model"] for r in rows] == [r["model"] for r in results]
    for got, result in zip(rows, results, strict=True):
        drift = result["drift"][got["component"]]
        assert float(got["spearman_p"]) == drift["spearman_p"]
        assert float(got["pearson_p"]) == drift["pearson_p"]
        x = [row["drift_norm"] for row in result["rows"]]
        y = [row["avg_cos"] for row in result["rows"]]
        assert float(got["pearson_p"]) == pytest.approx(pearsonr(x, y).pvalue, rel=1e-9)
    assert "0.05" in out.read_text()


def test_fig6_is_the_drift_blocks_mean_over_seeds(tmp_path):
    block = ["--hidden", "32", "--heads", "4", "--intermediate", "64", "--vocab", "100", "--batch", "2"]
    block += ["--seq-len", "16", "--norms", "0:12:5", "--seeds", "0,1"]
    out = tmp_path / "f6.pdf"
    assert main(["figure", "godey2024-fig6", *block, "--out", str(out), "-q"]) == 0
    ref = tmp_path / "block.csv"
    assert main(["experiment", "drift-block", *block, "--csv", str(ref), "-q"]) == 0
    per_seed = read_csv(ref)
    rows = read_csv(out.with_suffix(".csv"))
    assert [float(r["norm"]) for r in rows] == [0.0, 3.0, 6.0, 9.0, 12.0]
    for name in ("in_avg_cos", "out_avg_cos", "in_mean_norm", "out_mean_norm"):
        values = np.array([float(r[name]) for r in per_seed]).reshape(2, 5)  # seed by seed
        assert [float(r[name]) for r in rows] == pytest.approx(values.mean(axis=0).tolist(), rel=1e-12)
        assert [float(r[f"{name}_std"]) for r in rows] == pytest.approx(values.std(axis=0, ddof=1).tolist())
    n_star = np.mean([float(r["n_star"]) for r in per_seed])
    assert float(rows[0]["n_star"]) == pytest.approx(n_star, rel=1e-12)
    assert [r["seed"] for r in json.loads(out.with_suffix(".json").read_text())["runs"]] == [0, 1]


def test_fig17_density_is_the_closed_form(tmp_path):
    out = tmp_path / "f17.svg"
    assert main(["figure", "godey2024-fig17", "--dims", "3,16,300", "--out", str(out), "-q"]) == 0
    rows = read_csv(out.with_suffix(".csv"))
    for d in (3, 16, 300):
        mine = [r for r in rows if int(r["d"]) == d]
        c = np.array([float(r["cos"]) for r in mine])
        got = np.array([float(r["density"]) for r in mine])
        inner = np.abs(c) < 1
        assert got[inner] == pytest.approx(isotropic_density(c[inner], d), rel=1e-9)
        area = float(np.sum((got[1:] + got[:-1]) / 2 * np.diff(c)))  # the trapezoid rule (numpy 1.x too)
        assert area == pytest.approx(1.0, abs=2e-3)
    assert json.loads(out.with_suffix(".json").read_text())["runs"] == []


def test_fig18_p95_curve_and_model_points(tiny_models, data, tmp_path):
    run = ["-m", str(tiny_models["gpt2"]), "--data", f"text:{data}"]
    out = tmp_path / "f18.png"
    assert main(["figure", "godey2024-fig18", *run, "--out", str(out), "-q"]) == 0
    rows = read_csv(out.with_suffix(".csv"))
    curve = {int(r["d"]): float(r["avg_cos"]) for r in rows if r["series"] == "isotropic p95"}
    grid = np.linspace(-1, 1, 2_000_001)
    assert curve[2] == pytest.approx(math.cos(0.05 * math.pi), abs=1e-12)  # d = 2: the angle is uniform
    assert curve[3] == pytest.approx(0.9, abs=1e-12)  # d = 3: the cosine is uniform on [-1, 1]
    assert 32 in curve  # the model's own d is on the curve
    for d in (32, max(curve)):  # the 95th percentile of the closed-form density, integrated numerically
        density = isotropic_density(grid, d)
        cdf = np.concatenate([[0], np.cumsum((density[1:] + density[:-1]) / 2 * np.diff(grid))])
        assert curve[d] == pytest.approx(grid[np.searchsorted(cdf / cdf[-1], 0.95)], abs=2e-3)
    (point,) = [r for r in rows if r["series"] == "model"]
    (result,) = layer_results(run, tmp_path)
    assert int(point["d"]) == 32
    mean = np.mean([r["avg_cos"] for r in result["rows"]])
    assert float(point["avg_cos"]) == pytest.approx(mean, rel=1e-12)


@pytest.fixture(scope="module")
def series(tiny_models, tmp_path_factory):
    """Three checkpoints of the tiny BERT, its embeddings shifted a little more at each."""
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


def test_heatmap_csv_is_the_checkpoint_grid(series, data, tmp_path):
    run = ["-c", str(series), "--data", f"text:{data}"]
    out = tmp_path / "heat.pdf"
    assert main(["figure", "machina2024-heatmap", *run, "--metric", "isoscore", "--out", str(out), "-q"]) == 0
    ref = tmp_path / "series.json"
    assert main(["experiment", "checkpoints", *run, "--json", str(ref), "-q"]) == 0
    payload = json.loads(ref.read_text())
    expected = [
        (c["label"], str(row["layer"]), row["isoscore"])
        for c, r in zip(payload["checkpoints"], payload["results"], strict=True)
        for row in r["rows"]
    ]
    rows = read_csv(out.with_suffix(".csv"))
    assert [(r["checkpoint"], r["layer"], float(r["isoscore"])) for r in rows] == expected
    assert [r["step"] for r in rows[::3]] == ["0", "100", "200"]
    meta = json.loads(out.with_suffix(".json").read_text())
    assert [r["key"] for r in meta["runs"]] == [r["key"] for r in payload["results"]]
    curves = tmp_path / "curves.svg"
    args = [*run, "--metric", "isoscore", "--out", str(curves), "-q"]
    assert main(["figure", "machina2024-curves", *args]) == 0
    assert curves.with_suffix(".csv").read_text() == out.with_suffix(".csv").read_text()


def test_pdf_and_svg_are_deterministic_with_truetype_fonts(tmp_path, tiny_models, data):
    run = ["-m", str(tiny_models["bert"]), "--data", f"text:{data}"]
    for suffix in ("pdf", "svg"):
        files = []
        for i in range(2):
            out = tmp_path / f"{i}.{suffix}"
            assert main(["figure", "godey2024-fig1", *run, "--out", str(out), "-q"]) == 0
            files.append(out.read_bytes())
        assert files[0] == files[1]
    pdf = (tmp_path / "0.pdf").read_bytes()
    assert b"/FontFile2" in pdf and b"/Type3" not in pdf and b"CreationDate" not in pdf
    assert pdf.startswith(b"%PDF-") and pdf.rstrip().endswith(b"%%EOF")
    svg = (tmp_path / "0.svg").read_text()
    assert "<text" in svg and "<dc:date>" not in svg  # svg.fonttype none: text stays text
    root = ElementTree.fromstring(svg.encode())  # well-formed XML
    assert root.tag == "{http://www.w3.org/2000/svg}svg" and root.get("width") == "237.6pt"  # 3.3 in


def test_style_file_applies_over_the_defaults(tmp_path):
    style = tmp_path / "paths.mplstyle"
    style.write_text("svg.fonttype: path\n", encoding="utf-8")
    out = tmp_path / "f.svg"
    assert main(["figure", "godey2024-fig17", "--style", str(style), "--out", str(out), "-q"]) == 0
    assert "<text" not in out.read_text()


@pytest.mark.parametrize(
    ("width", "dpi", "size"), [("single", 100, (330, 240)), ("double", 150, (1035, 390))]
)
def test_png_has_the_requested_size(tmp_path, width, dpi, size):
    from PIL import Image

    out = tmp_path / "f.png"
    args = ["--width", width, "--dpi", str(dpi), "--out", str(out), "-q"]
    assert main(["figure", "godey2024-fig17", *args]) == 0
    with Image.open(out) as image:
        assert image.size == size


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["figure", "no-such-figure", "--out", "f.pdf"], "unknown figure 'no-such-figure'"),
        (["figure", "godey2024-fig17", "--out", "f.jpeg"], "must end in .pdf, .svg or .png"),
        (["figure", "godey2024-fig17", "--out", "/proc/version/f.pdf"], "cannot write --out"),
        (["figure", "godey2024-fig17"], "give --out"),
        (["figure", "godey2024-fig17", "--dims", "1,8", "--out", "f.pdf"], "at least 2"),
        (["figure", "godey2024-fig17", "--style", "/no/such.mplstyle", "--out", "f.pdf"], "is not a file"),
        (["figure", "machina2024-heatmap", "--out", "f.pdf"], "needs --checkpoints"),
        (["figure", "godey2024-fig17", "-m", "minilm", "--out", "f.pdf"], "takes no -m or -c"),
        (["figure", "godey2024-fig1", "-c", "a,b", "--out", "f.pdf"], "takes models (-m)"),
        (["figure", "godey2024-fig6", "-m", "minilm", "--out", "f.pdf"], "takes no -m or -c"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(args, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not list(tmp_path.glob("f.*"))


@pytest.mark.slow
def test_run_and_the_apps_first_frame_do_not_import_matplotlib(tiny_models, data):
    probe = (
        "import sys\nfrom isotui.cli import main\n"
        f"code = main(['run', '-m', {str(tiny_models['bert'])!r}, '--data', 'text:{data}', '-q'])\n"
        "print('RUN', code, 'matplotlib' in sys.modules)\n"
        "import asyncio\nfrom isotui.tui.app import IsotuiApp\n"
        "async def first_frame():\n"
        "    async with IsotuiApp().run_test() as pilot:\n"
        "        await pilot.pause()\n"
        "        print('APP', 'matplotlib' in sys.modules)\n"
        "asyncio.run(first_frame())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert "RUN 0 False" in out.stdout and "APP False" in out.stdout, out.stderr[-2000:]


def test_figure_refuses_a_shard_instead_of_succeeding_empty(tmp_path, capsys):
    out = tmp_path / "fig1.png"
    code = main(
        [
            "figure",
            "godey2024-fig1",
            "-m",
            "minilm",
            "--max-samples",
            "4",
            "--shard",
            "1/2",
            "--out",
            str(out),
        ]
    )
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "--shard 1/2" in err and "isotui run" in err and "Traceback" not in err


def test_fig5_marks_monte_carlo_and_bounded_spearman_points():
    from types import SimpleNamespace

    from matplotlib.figure import Figure

    from isotui.core.correlation import DriftCorrelation, drift_correlation
    from isotui.paper_figures import draw_pvalues

    deep = drift_correlation(  # rho 0.87 over 30 layers: no count, no resample as extreme
        list(range(30)), list(np.arange(30) + 6 * np.random.default_rng(0).normal(size=30))
    )
    assert deep.spearman_p_method == "monte-carlo-bound"
    shallow = drift_correlation([1.0, 2.0, 3.0, 4.0, 6.0], [0.1, 0.3, 0.2, 0.5, 0.4])
    mc = DriftCorrelation(40, 0.3, 0.06, 0.3, 0.05, 0.05, "monte-carlo", 2e-4)
    proven = DriftCorrelation(80, 0.99, 3e-54, 0.99, 1e-60, 1e-70, "bound", math.nan)
    results = [
        SimpleNamespace(model=m, key=m, drift={"model": d})
        for m, d in (("a", shallow), ("b", mc), ("c", deep), ("d", proven))
    ]
    drawing = draw_pvalues(Figure(), results, None)
    assert [r["spearman_p_bound"] for r in drawing.rows] == [False, False, True, True]
    labels = {t.get_text() for t in drawing.figure.legends[0].get_texts()}
    want = {"Spearman", "Spearman (Monte Carlo)", "Spearman (upper bound)", "Spearman (proven bound)"}
    assert want <= labels
    collections = drawing.figure.axes[0].collections
    (bound,) = [c for c in collections if c.get_label() == "Spearman (upper bound)"]
    assert bound.get_offsets()[0][1] == pytest.approx(deep.spearman_p)
    (bound,) = [c for c in collections if c.get_label() == "Spearman (proven bound)"]
    assert bound.get_offsets()[0][1] == pytest.approx(3e-54)


def test_fig1_legend_keeps_random_settings_and_the_divider_is_labelled(data, tmp_path, monkeypatch):
    """Two untrained models of one type read the same in the legend (``random:gpt2``), and the
    encoder/decoder divider had no label (issue 29): the legend keeps the settings (broken after
    a comma to fit the figure), the divider says which side is which."""
    import isotui.paper_figures as paper_figures

    drawn = []
    render = paper_figures.render

    def keep(*args, **kwargs):
        out, drawing = render(*args, **kwargs)
        drawn.append(drawing.figure)
        return out, drawing

    monkeypatch.setattr(paper_figures, "render", keep)
    models = [
        "random:gpt2:n_layer=2,n_embd=32,n_head=2",
        "random:gpt2:n_layer=3,n_embd=32,n_head=2",
        "random:t5:num_layers=2,d_model=32,d_ff=64,num_heads=2,d_kv=16",
    ]
    out = tmp_path / "fig1.png"
    args = ["figure", "godey2024-fig1", *(a for m in models for a in ("-m", m)), "--data", f"text:{data}"]
    assert main([*args, "--max-samples", "8", "--max-length", "16", "--out", str(out), "-q"]) == 0
    (fig,) = drawn
    (legend,) = fig.legends or [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    entries = [t.get_text() for t in legend.get_texts()]
    assert [e.replace("\n", "") for e in entries[:3]] == models  # each model as written
    fig.canvas.draw()
    width = fig.bbox.width
    for text in legend.get_texts():  # none wider than the figure (the long ones broken)
        box = text.get_window_extent()
        assert box.x0 >= 0 and box.x1 <= width, text.get_text()
    (ax,) = fig.axes
    said = sorted(t.get_text().strip() for t in ax.texts)
    assert said == ["decoder", "encoder"]
    divider = [
        line.get_xdata()[0]
        for line in ax.get_lines()
        if line.get_linestyle() == ":" and len(set(line.get_xdata())) == 1
    ]
    left, right = sorted(ax.texts, key=lambda t: t.get_position()[0] if t.get_ha() == "right" else 1e9)
    assert left.get_text().strip() == "encoder" and left.get_ha() == "right" and right.get_ha() == "left"
    assert left.get_position()[0] == right.get_position()[0] == divider[0]  # at the dotted line
