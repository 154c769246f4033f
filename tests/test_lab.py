"""The attention lab (key A) through Textual's pilot, with real tiny models and the real backend."""

from __future__ import annotations

import asyncio

from textual.widgets import DataTable, Input, TabbedContent

from isotui.experiments.attention import summarize
from isotui.tui.lab import LabScreen

from .test_tui import _app, _wait


def test_lab_heads_and_dynamics(tmp_path, tiny_models):
    import torch
    from transformers import AutoModel, AutoTokenizer

    series = tmp_path / "series"
    for i, step in enumerate((0, 5)):
        model = AutoModel.from_pretrained(str(tiny_models["bert"]))
        with torch.no_grad():
            model.encoder.layer[0].attention.self.query.bias += 0.3 * i
        model.save_pretrained(series / f"step_{step}")
        AutoTokenizer.from_pretrained(str(tiny_models["bert"])).save_pretrained(series / f"step_{step}")

    async def scenario():
        app = _app(tmp_path)
        async with app.run_test(size=(120, 36)) as pilot:
            app.selected = str(tiny_models["bert"])
            await pilot.press("A")
            await pilot.pause()
            assert isinstance(app.screen, LabScreen)
            await pilot.press("r")
            await _wait(pilot, lambda: app.selected in app.lab_results["attention"])
            result = app.lab_results["attention"][app.selected]
            table = app.screen.query_one("#heads-table", DataTable)
            assert table.row_count == 2  # two blocks' attention
            assert table.get_row_at(0)[2] == f"{summarize(result)[0].cos_qk_bar:.3f}"
            assert "ready" in str(app.screen.query_one("#lab-status").render())
            await pilot.press("m")  # next metric: Q·K
            assert app.screen.head_metric == 1
            await pilot.press("e")
            await pilot.pause()
            assert list(tmp_path.glob("isotui-*-attention.csv"))
            # dynamics: the series folder, typed into the tab's box
            app.screen.query_one("#lab-tabs", TabbedContent).active = "tab-dynamics"
            await pilot.pause()
            box = app.screen.query_one("#dyn-input", Input)
            box.focus()
            box.value = str(series)
            await pilot.press("enter")
            await _wait(pilot, lambda: app.lab_results["qk-dynamics"] is not None, timeout=180)
            dyn = app.screen.query_one("#dyn-table", DataTable)
            assert dyn.row_count == 2 and dyn.get_row_at(1)[:2] == ["step_5", "5"]
            await pilot.press("b")  # basis q only
            assert app.screen.basis == 1
            # a bad series is one sentence, nothing queued
            box.value = str(tmp_path / "nowhere")
            await pilot.press("enter")
            await pilot.pause()
            # the same series as a heatmap of layer runs
            await pilot.press("4")
            await pilot.pause()
            ckpt = app.screen.query_one("#ckpt-input", Input)
            assert app.screen.query_one("#lab-tabs", TabbedContent).active == "tab-ckpt", app.focused
            assert ckpt.has_focus, app.focused
            ckpt.value = str(series)
            await pilot.press("enter")
            await _wait(pilot, lambda: app.lab_results["checkpoints"] is not None, timeout=180)
            heat = app.screen.query_one("#ckpt-table", DataTable)
            series_result = app.lab_results["checkpoints"]
            assert heat.row_count == 3 and [str(c.label) for c in heat.columns.values()] == [
                "layer",
                "0",
                "5",
            ]
            assert heat.get_row_at(2)[2].plain == f"{series_result.results[1].rows[2].avg_cos:.3f}"
            await pilot.press("m")
            assert "avg_cos_xctx by layer" in str(app.screen.query_one("#ckpt-info").render())
            await pilot.press("e")
            await pilot.pause()
            assert list(tmp_path.glob("isotui-*-checkpoints.csv"))
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, LabScreen)

    asyncio.run(scenario())


def test_lab_drift_block_tab(tmp_path):
    from isotui.experiments.drift_block import DriftBlockConfig, drift_cache, run_drift_block

    settings = "hidden=32 heads=4 intermediate=64 vocab=200 batch=2 seq_len=16 norms=0:20:5 seeds=0,1"

    async def scenario():
        app = _app(tmp_path)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.press("A", "3")
            box = app.screen.query_one("#drift-input", Input)
            assert box.has_focus  # nothing run yet: the settings box takes the cursor
            box.value = "hidden=32 heads=5"
            await pilot.press("enter")
            await pilot.pause()
            assert app.lab_results["drift-block"] is None  # 5 heads do not divide 32: one sentence
            box.value = settings
            box.focus()
            await pilot.press("enter")
            await _wait(pilot, lambda: app.lab_results["drift-block"] is not None, timeout=120)
            result = app.lab_results["drift-block"]
            table = app.screen.query_one("#drift-table", DataTable)
            assert table.row_count == 5
            want = DriftBlockConfig(
                hidden=32,
                heads=4,
                intermediate=64,
                vocab=200,
                batch=2,
                seq_len=16,
                norms=(0.0, 5.0, 10.0, 15.0, 20.0),
                seeds=(0, 1),
            )
            cached = run_drift_block(want, drift_cache(tmp_path / "cache"))
            assert all(cached.from_cache)  # the app's job stored both seeds
            assert table.get_row_at(2)[2].startswith(f"{cached.mean('out_avg_cos')[2]:.3f}±")
            assert result.config == want
            for _ in range(5):  # every figure draws
                await pilot.press("m")
                await pilot.pause()
            assert app.screen.drift_figure == 0

    asyncio.run(scenario())


def test_drift_lookup_never_computes(tmp_path):
    """A damaged cached seed is not recomputed on the lookup thread: lookup says 'not cached'."""
    from isotui.experiments.drift_block import DriftBlockConfig, drift_cache, run_drift_block
    from isotui.experiments.requests import DriftBlockRequest

    config = DriftBlockConfig(
        hidden=16, heads=2, intermediate=32, vocab=50, batch=2, seq_len=8, norms=(0.0, 5.0)
    )
    run_drift_block(config, drift_cache(tmp_path))
    request = DriftBlockRequest(config)
    assert request.lookup(tmp_path, print) is not None
    drift_cache(tmp_path).path_for(config.key(0)).write_bytes(b"garbage")
    assert request.lookup(tmp_path, print) is None
