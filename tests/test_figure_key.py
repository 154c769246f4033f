"""The app's `F` key through Textual's pilot: the plot on screen (the layer view, each lab tab) as
PDF, PNG and the CSV of its numbers, in the export folder (or sent to the browser when served),
the full paths in a notification; the CSV is checked against the results on screen."""

from __future__ import annotations

import asyncio
import csv
import io
import math

import numpy as np
import pytest
from textual.widgets import TabbedContent

from isotui.tui.app import IsotuiApp
from isotui.tui.lab import LabScreen
from isotui.tui.lab_dynamics import DynamicsTab

from .test_snapshots import fixture_result
from .test_tui import _wait, fake_backend


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _app(tmp_path, notes):
    app = IsotuiApp(
        cache_root=tmp_path / "cache", export_dir=tmp_path / "exports", backend_factory=fake_backend([])
    )
    app.notify = lambda message, **_kw: notes.append(message)  # type: ignore[method-assign]
    return app


async def _saved(pilot, folder, what, notes=()):
    """Press F and wait for the three files of ``what`` (``notes``: said when it times out)."""
    await pilot.press("F")
    done = lambda: bool(list(folder.glob(f"isotui-*-figure-{what}.csv")))  # noqa: E731
    await _wait(pilot, done, why=lambda: str(list(notes)[-2:]))
    await pilot.pause()
    return [sorted(folder.glob(f"isotui-*-figure-{what}.{s}"))[-1] for s in ("pdf", "png", "csv")]


def test_main_screen_saves_the_metric_on_screen(tmp_path):
    results = [fixture_result("minilm", 7, 384, 0.22), fixture_result("random:gpt2", 5, 768, 0.6)]

    async def scenario():
        notes: list[str] = []
        app = _app(tmp_path, notes)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.press("F")  # nothing run yet: one sentence, no file
            await pilot.pause()
            assert notes[-1] == "no plot to save yet: run a model (r)"
            for result in results:
                app.add_result(result)
            await pilot.press("m", "m", "n")  # the third metric, by depth
            assert app.metric == "avg_cos_centered" and app.depth
            pdf, png, table = await _saved(pilot, tmp_path / "exports", "layers")
        return notes, pdf, png, table

    notes, pdf, png, table = asyncio.run(scenario())
    assert pdf.read_bytes().startswith(b"%PDF") and png.read_bytes().startswith(b"\x89PNG")
    assert all(p.is_absolute() for p in (pdf, png, table))
    assert f"wrote {pdf}\nwrote {png}\nwrote {table}" in notes
    rows = read_csv(table)
    want = [(r.model, row) for r in results for row in r.rows]
    assert [(g["model"], int(g["layer"])) for g in rows] == [(m, row.layer) for m, row in want]
    assert [float(g["avg_cos_centered"]) for g in rows] == [row.avg_cos_centered for _, row in want]
    n = {m: sum(1 for mm, _ in want if mm == m) for m, _ in want}
    for got, (model, row) in zip(rows, want, strict=True):  # x: the normalised depth, as on screen
        assert float(got["x"]) == pytest.approx(row.layer / (n[model] - 1))


def test_served_app_sends_the_three_files_to_the_browser(tmp_path, monkeypatch):
    from .test_serve import _Delivered

    monkeypatch.setattr(IsotuiApp, "is_web", property(lambda self: True))

    async def scenario():
        notes: list[str] = []
        app = _app(tmp_path, notes)
        delivered = _Delivered()
        app.deliver_binary = delivered  # type: ignore[method-assign]
        async with app.run_test(size=(120, 36)) as pilot:
            app.add_result(fixture_result("minilm", 7, 384, 0.22))
            await pilot.press("F")
            await _wait(pilot, lambda: len(delivered.files) == 3)
            await pilot.pause()
        return notes, delivered

    notes, delivered = asyncio.run(scenario())
    (pdf_name, pdf, _), (png_name, png, _), (csv_name, table, _) = delivered.files
    assert pdf.startswith(b"%PDF") and png.startswith(b"\x89PNG") and csv_name.endswith("-figure-layers.csv")
    rows = list(csv.DictReader(io.StringIO(table.decode())))
    assert [float(r["avg_cos"]) for r in rows] == [
        r.avg_cos for r in fixture_result("minilm", 7, 384, 0.22).rows
    ]
    assert (
        f"sent {pdf_name} to your browser\nsent {png_name} to your browser\nsent {csv_name} to your browser"
        in notes
    )
    assert not (tmp_path / "exports").exists()


@pytest.fixture(scope="module")
def lab_results(tiny_models, tmp_path_factory):
    """Real results for the lab's tabs: attention of the tiny BERT, a two-checkpoint series (its
    query biases shifted) as dynamics and as layer runs, and a small drift block."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from isotui.experiments.attention import attention_cache, measure_attention
    from isotui.experiments.checkpoints import run_series
    from isotui.experiments.drift_block import DriftBlockConfig, run_drift_block
    from isotui.experiments.qk_dynamics import resolve_checkpoints, run_dynamics
    from isotui.spec import make_spec
    from isotui.store.cache import ResultCache

    root = tmp_path_factory.mktemp("lab-figures")
    series = root / "series"
    for i, step in enumerate((0, 5)):
        model = AutoModel.from_pretrained(str(tiny_models["bert"]))
        with torch.no_grad():
            model.encoder.layer[0].attention.self.query.bias += 0.3 * i
        model.save_pretrained(series / f"step_{step}")
        AutoTokenizer.from_pretrained(str(tiny_models["bert"])).save_pretrained(series / f"step_{step}")
    checkpoints = resolve_checkpoints(None, [str(series)])
    base = make_spec(checkpoints[0].model, "builtin", max_samples=8, max_length=20)
    cache = attention_cache(root / "cache")
    config = DriftBlockConfig(
        hidden=32, heads=4, intermediate=64, vocab=200, batch=2, seq_len=16, norms=(0.0, 10.0)
    )
    return {
        "model": str(tiny_models["bert"]),
        "attention": measure_attention(base.with_model(str(tiny_models["bert"])), cache, sample_size=16),
        "qk-dynamics": run_dynamics(None, checkpoints, base, cache, sample_size=16),
        "checkpoints": run_series(None, checkpoints, base, ResultCache(root / "cache")),
        "drift-block": run_drift_block(config, None),
    }


@pytest.mark.slow
def test_each_lab_tab_saves_its_plot(tmp_path, lab_results):
    out = tmp_path / "exports"

    async def scenario():
        notes: list[str] = []
        app = _app(tmp_path, notes)
        app.selected = lab_results["model"]
        app.lab_results["attention"][lab_results["model"]] = lab_results["attention"]
        for kind in ("qk-dynamics", "checkpoints", "drift-block"):
            app.lab_results[kind] = lab_results[kind]
        files = {}
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            app.selected = lab_results["model"]
            await pilot.press("A")
            await pilot.pause()
            assert isinstance(app.screen, LabScreen)
            await pilot.press("m")  # Heads: the second metric, Q-mean . K-mean
            files["heads"] = await _saved(pilot, out, "heads", notes)
            tabs = app.screen.query_one("#lab-tabs", TabbedContent)
            tabs.active = "tab-dynamics"
            await pilot.pause()
            app.screen.query_one("#dyn-table").focus()
            await pilot.press("right", "right", "right", "]", "b", "m")  # layer 2, head 1, q basis, entropy
            await pilot.pause()
            tab = app.screen.query_one(DynamicsTab)
            assert (tab.head, tab.basis, tab.metric) == (1, 1, 1)
            files["dynamics"] = await _saved(pilot, out, "dynamics", notes)
            tabs.active = "tab-ckpt"
            await pilot.pause()
            app.screen.query_one("#ckpt-table").focus()
            await pilot.press("m")  # the heatmap's second metric
            files["checkpoints"] = await _saved(pilot, out, "checkpoints", notes)
            tabs.active = "tab-drift"
            await pilot.pause()
            app.screen.query_one("#drift-table").focus()
            files["drift-block"] = await _saved(pilot, out, "drift-block-fig6", notes)
            await pilot.press("down", "m")  # Fig. 7 at the cursor's N (the sweep's second, 10)
            files["fig7"] = await _saved(pilot, out, "drift-block-fig7", notes)
            await pilot.press("m", "m", "m")  # Fig. 10
            files["fig10"] = await _saved(pilot, out, "drift-block-fig10", notes)
        return files

    files = asyncio.run(scenario())
    for pdf, png, _ in files.values():
        assert pdf.read_bytes().startswith(b"%PDF") and png.read_bytes().startswith(b"\x89PNG")

    heads = read_csv(files["heads"][2])
    attention = lab_results["attention"]
    per_head = [r for r in heads if r["head"] != "mean"]
    assert [float(r["dot_qk_bar"]) for r in per_head] == [r.dot_qk_bar for r in attention.rows]
    for layer in {r.layer for r in attention.rows}:
        mean = next(r for r in heads if r["head"] == "mean" and int(r["layer"]) == layer)
        values = np.array([r.dot_qk_bar for r in attention.rows if r.layer == layer])
        assert float(mean["dot_qk_bar"]) == pytest.approx(values.mean(), rel=1e-9)

    dyn = lab_results["qk-dynamics"]
    rows = read_csv(files["dynamics"][2])
    path = [r for r in rows if r["panel"] == "trajectory"]
    site = next(i for i, s in enumerate(dyn.sites) if s[1] == 2)
    q, k = dyn.trajectory(site, 1, "q")
    assert {(r["layer"], r["head"], r["basis"]) for r in path} == {("2", "1", "q")}
    assert [[float(r["q_x"]), float(r["q_y"])] for r in path] == q.tolist()
    assert [[float(r["k_x"]), float(r["k_y"])] for r in path] == k.tolist()
    curves = [r for r in rows if r["panel"] == "entropy"]
    for r in curves:
        values = [
            x.entropy for x in dyn.rows if x.checkpoint == r["checkpoint"] and x.layer == int(r["layer"])
        ]
        assert float(r["entropy"]) == pytest.approx(np.mean(values), rel=1e-12)

    series = lab_results["checkpoints"]
    heat = read_csv(files["checkpoints"][2])
    want = [row.avg_cos_xctx for res in series.results for row in res.rows]
    assert [float(r["avg_cos_xctx"]) for r in heat] == pytest.approx(want, rel=1e-12)

    block = lab_results["drift-block"]
    fig6 = read_csv(files["drift-block"][2])
    assert [float(r["norm"]) for r in fig6] == [0.0, 10.0]
    got = [float(r["out_avg_cos"]) for r in fig6]
    assert got == [float(v) for v in block.mean("out_avg_cos")] and all(math.isfinite(v) for v in got)
    fig7 = read_csv(files["fig7"][2])
    assert {float(r["norm"]) for r in fig7} == {10.0}  # one panel: the N under the table's cursor
    assert sum(int(r["count"]) for r in fig7) > 0
    fig10 = read_csv(files["fig10"][2])
    assert sorted({float(r["norm"]) for r in fig10}) == [0.0, 10.0]  # against N, as the tab shows


def test_f_is_listed_in_the_main_and_the_lab_help(tmp_path):
    from isotui.tui.help import HelpScreen

    async def scenario():
        app = _app(tmp_path, [])
        seen = []
        async with app.run_test(size=(120, 36)) as pilot:
            for keys in (["question_mark"], ["escape", "A", "question_mark"]):
                await pilot.press(*keys)
                await pilot.pause()
                assert isinstance(app.screen, HelpScreen)
                seen.append({row[0]: row[1] for row in app.screen.rows() if row[1]})
        return seen

    main_keys, lab_keys = asyncio.run(scenario())
    assert main_keys["F"] == "figure" and lab_keys["F"] == "figure"
