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
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, LabScreen)

    asyncio.run(scenario())
