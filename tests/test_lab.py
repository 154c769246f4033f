"""The attention lab (key A) through Textual's pilot, with real tiny models and the real backend."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from textual.widgets import DataTable, Input, TabbedContent

from isotui.experiments.attention import summarize
from isotui.tui.lab import LabScreen
from isotui.tui.lab_dynamics import DynamicsTab
from isotui.tui.lab_heads import HeadsTab
from isotui.tui.lab_types import TypesTab

from .test_tui import _app, _wait


@pytest.mark.slow
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
            await _wait(pilot, lambda: app.entries)  # the list (a worker) picks its first model
            await pilot.pause()
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
            assert app.screen.query_one(HeadsTab).metric == 1
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
            await _wait(pilot, lambda: app.lab_results["qk-dynamics"] is not None)
            dyn = app.screen.query_one("#dyn-table", DataTable)
            assert dyn.row_count == 2 and dyn.get_row_at(1)[:2] == ["step_5", "5"]
            await pilot.press("b")  # basis q only
            assert app.screen.query_one(DynamicsTab).basis == 1
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
            await _wait(pilot, lambda: app.lab_results["checkpoints"] is not None)
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


def test_lab_token_types_tab(tmp_path, tiny_models):
    """Tab 5: token-types on the selected model through the app's backend; one row per layer, and
    for the layer under the cursor (moved with the keys) each direction's carriers as numpy finds
    them over the same tokens; m shows the carriers' shares over their share of the tokens."""
    import csv

    from .conftest import corpus
    from .test_token_types import expected

    folder = str(tiny_models["bert"])

    async def scenario():
        app = _app(tmp_path)  # its data: corpus(10), max length 64
        async with app.run_test(size=(80, 24)) as pilot:
            await _wait(pilot, lambda: app.entries)
            await pilot.pause()
            app.selected = folder
            await pilot.press("A")
            await pilot.pause()
            await pilot.press("5")
            await pilot.pause()
            lab = app.screen
            assert lab.query_one("#lab-tabs", TabbedContent).active == "tab-types"
            await pilot.press("r")
            await _wait(pilot, lambda: folder in app.lab_results["token-types"])
            table = lab.query_one("#types-layers", DataTable)
            await _wait(pilot, lambda: table.row_count == 3)  # the embeddings and two blocks
            assert table.has_focus and "token-types ready" in str(lab.query_one("#lab-status").render())
            want = expected(folder, corpus(10), top=5, max_length=64)
            tab = lab.query_one(TypesTab)
            tok = app.lab_results["token-types"][folder]
            for press, layer in (("down", 1), ("down", 2), ("up", 1)):
                await pilot.press(press)
                await pilot.pause()
                assert table.cursor_row == layer
                group = tab.groups[layer]
                (k,) = {int(d.split(":")[1]) for lay, d in want if lay == layer and d != "mean"}
                assert group.layer == layer and group.rogue_dim == k
                for name, rows, direction in (
                    ("mean", group.mean, "mean"),
                    ("rogue", group.rogue, f"rogue:{k}"),
                ):
                    numpy_rows = want[layer, direction]
                    assert [(r.token_id, r.count) for r in rows] == [(t, c) for t, c, _ in numpy_rows]
                    np.testing.assert_allclose(
                        [r.share for r in rows], [s for *_, s in numpy_rows], rtol=1e-5, atol=1e-6
                    )
                    detail = lab.query_one(f"#types-{name}", DataTable)
                    assert f"layer {layer}" in str(detail.border_title)
                    shown = [[str(c) for c in detail.get_row_at(i)] for i in range(detail.row_count)]
                    assert shown == [
                        [str(r.rank), repr(r.token), f"{r.share:.3f}", str(r.count), f"{r.freq_share:.3f}"]
                        for r in rows
                    ]
                assert f"rogue dim {k}" in str(lab.query_one("#types-rogue", DataTable).border_title)
            first = tab.groups[1].mean[0]
            assert f"{first.token!r} {first.share:.2f}" in table.get_row_at(1)[1].plain
            await pilot.press("m")  # shares over the types' shares of the tokens
            await pilot.pause()
            assert f"{first.token!r} {first.share / first.freq_share:.1f}" in table.get_row_at(1)[1].plain
            assert table.cursor_row == 1  # the layer stays under the cursor
            third = tab.groups[1].mean[2]
            assert f"{third.token!r} " not in table.get_row_at(1)[1].plain  # two carriers in 80 columns
            await pilot.resize_terminal(120, 36)
            await pilot.pause()
            await pilot.pause()
            lifted = f"{third.token!r} {third.share / third.freq_share:.1f}"
            assert lifted in table.get_row_at(1)[1].plain  # three from 110 on
            for i in (1, 3):  # and the columns widened to them (the redraw within the resize kept 80's)
                widest = max(len(table.get_row_at(r)[i].plain) for r in range(table.row_count))
                assert table.ordered_columns[i].content_width >= widest
            await pilot.press("e")
            await pilot.pause()
            (written,) = tmp_path.glob("isotui-*-token-types.csv")
            with open(written, newline="", encoding="utf-8") as f:
                assert len(list(csv.DictReader(f))) == len(tok.rows) == sum(len(r) for r in want.values())

    asyncio.run(scenario())


@pytest.mark.slow
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
            await _wait(pilot, lambda: app.lab_results["drift-block"] is not None)
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
    from isotui.experiments.drift_block.experiment import DriftBlockRequest

    config = DriftBlockConfig(
        hidden=16, heads=2, intermediate=32, vocab=50, batch=2, seq_len=8, norms=(0.0, 5.0)
    )
    run_drift_block(config, drift_cache(tmp_path))
    request = DriftBlockRequest(config)
    assert request.lookup(tmp_path, print) is not None
    drift_cache(tmp_path).path_for(config.key(0)).write_bytes(b"garbage")
    assert request.lookup(tmp_path, print) is None


class _FakeSeries:
    """A two-checkpoint series: just what draw_trajectory reads."""

    sites = (("model", 1, "self"),)

    def trajectory(self, site, head, basis):
        return np.array([[-0.8, -0.1], [0.3, -0.4]]), np.array([[-0.5, 0.2], [0.2, 0.1]])

    def steps(self):
        return [0, 1000]


def test_trajectory_labels_are_one_cell_per_character():
    """Q̄/K̄ (a combining macron, drawn as a cell of its own) garbled the labels and displaced the
    frame; the y label printed under the plot. Every line of the figure is the plot's width."""
    import plotext as plt

    from isotui.figures import draw_trajectory

    plt.clf()
    plt.plotsize(60, 16)
    draw_trajectory(plt, _FakeSeries(), 0, 0, "qk", ("red", "blue"))
    out = plt.uncolorize(plt.build())
    plt.clf()
    assert "\u0304" not in out
    for label in ("Q:0", "Q:1000", "K:0", "K:1000"):
        assert label in out
    lines = out.splitlines()
    assert "layer 1 head 0" in lines[0]  # the title shows
    assert all(len(line) == 60 for line in lines), [len(line) for line in lines]
    assert lines[-1].strip() == "x: 1st singular direction, y: 2nd"  # no lone "2nd" under the plot


def test_histogram_log_counts():
    """l: log10(1 + count) per bar (checked against numpy on the same bars)."""
    from isotui.figures import draw_histogram, histogram_bars

    edges = np.linspace(-1, 1, 11)
    counts = np.array([0, 1, 5, 100, 10_000, 3, 0, 0, 2, 40, 7, 0])
    drawn = {}

    class Recorder:
        def title(self, text):
            drawn["title"] = text

        def bar(self, xs, ys, **_kw):
            drawn["ys"] = ys

        def xticks(self, *_a):
            pass

    draw_histogram(Recorder(), counts, edges, "red", "scores", log=True)
    _, sums = histogram_bars(counts, edges)
    assert np.allclose(drawn["ys"], np.log10(1 + np.asarray(sums, dtype=float)))
    assert "log10" in drawn["title"]
    draw_histogram(Recorder(), counts, edges, "red", "scores", rows=100_000)  # a row per count: all drawn
    assert drawn["ys"] == sums


def test_lab_focus_stays_on_error_help_is_the_labs_and_main_keys_are_inert(tmp_path):
    """A rejected Enter keeps the cursor in the box (the next keys edit it, fire no hotkey);
    ? lists the lab's keys; the main screen's a (compare) is neither offered nor active."""
    from isotui.tui.help import HelpScreen

    async def scenario():
        app = _app(tmp_path)
        notes: list[str] = []
        app.notify = lambda message, **_kw: notes.append(message)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("A", "2")
            await pilot.pause()
            box = app.screen.query_one("#dyn-input", Input)
            assert box.has_focus
            box.value = str(tmp_path / "nowhere")
            await pilot.press("enter")
            await pilot.pause()
            assert box.has_focus and notes and "--" not in notes[-1]
            await pilot.press("m", "b")  # typed into the box, not the figure or basis keys
            dynamics = app.screen.query_one(DynamicsTab)
            assert box.value.endswith("nowheremb") and dynamics.metric == 0 and dynamics.basis == 0
            box.value = ""
            await pilot.press("3")  # into the drift box too: a rejected setting keeps focus
            await pilot.pause()
            app.screen.query_one("#lab-tabs", TabbedContent).active = "tab-drift"
            await pilot.pause()
            drift_box = app.screen.query_one("#drift-input", Input)
            drift_box.focus()
            drift_box.value = "hidden=32 heads=5"
            await pilot.press("enter")
            await pilot.pause()
            assert drift_box.has_focus
            assert notes[-1].startswith("heads=5 does not divide hidden=32"), notes[-1]
            app.screen.query_one("#drift-table", DataTable).focus()
            # main-screen keys: not offered, inert
            assert app.check_action("toggle_compare", ()) is False
            assert app.screen.check_action("basis", ()) is False  # a Dynamics key, on the Drift tab
            shown = {b.binding.action for b in app.screen.active_bindings.values() if b.enabled}
            assert "toggle_compare" not in shown and "lab" not in shown
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            ids = {row[1] for row in app.screen.rows() if row[1]}
            assert {"lab_run", "lab_head_prev", "lab_head_next", "lab_basis", "lab_log", "options"} <= ids
            assert "compare" not in ids and "lab" not in ids
            keys = {row[1]: row[0] for row in app.screen.rows()}
            assert keys["lab_head_prev"] == "[" and keys["lab_head_next"] == "]" and keys["lab_basis"] == "b"
            await pilot.press("escape")
            await pilot.press("escape")
            await pilot.pause()
            await pilot.press("question_mark")
            await pilot.pause()
            ids = {row[1] for row in app.screen.rows() if row[1]}
            assert "compare" in ids and "lab_run" not in ids  # the main screen's own help

    asyncio.run(scenario())


def test_tab_keys_pass_an_empty_settings_box_and_are_text_once_typed(tmp_path):
    """Browsing the tabs by their keys: a tab with nothing run puts the cursor in its settings box,
    and the next tab's key, pressed there, shows that tab (it was typed into the box, issue 38).
    Once something is typed, digits are text; a value that starts with a tab's digit is typed after
    a space; a digit no tab takes is typed."""

    async def scenario():
        app = _app(tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("A", "2")
            await pilot.pause()
            tabs = app.screen.query_one("#lab-tabs", TabbedContent)
            box = app.screen.query_one("#dyn-input", Input)
            assert tabs.active == "tab-dynamics" and box.has_focus and box.value == ""
            await pilot.press("3")
            await pilot.pause()
            await pilot.pause()
            drift_box = app.screen.query_one("#drift-input", Input)
            assert tabs.active == "tab-drift" and box.value == "" and drift_box.has_focus
            await pilot.press("2")
            await pilot.pause()
            await pilot.pause()
            assert tabs.active == "tab-dynamics" and box.has_focus
            await pilot.press("s", "t", "e", "p", "3")  # typed: a setting's digits
            assert tabs.active == "tab-dynamics" and box.value == "step3"
            box.value = ""
            await pilot.press("space", "1", "0")  # a leading digit, after a space
            assert tabs.active == "tab-dynamics" and box.value == " 10"
            box.value = ""
            await pilot.press("9")  # no tab's key
            assert tabs.active == "tab-dynamics" and box.value == "9"

    asyncio.run(scenario())


def test_status_line_is_its_tabs_and_every_footer_fits_80_columns(tmp_path):
    """Another tab's status ("qk-dynamics ready") no longer stays on Heads; each tab's footer
    shows all its keys within 80 columns (the Dynamics one was cut at ``F PDF x C``, issue 29)."""
    from textual.widgets import Static
    from textual.widgets._footer import FooterKey, FooterLabel

    async def scenario():
        app = _app(tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("A")
            await pilot.pause()
            lab = app.screen
            line = lab.query_one("#lab-status", Static)
            lab.status("qk-dynamics ready", "qk-dynamics")  # as a finished job says it
            await pilot.pause()
            assert str(line.render()) == ""  # the Heads tab is shown
            await pilot.press("l")
            assert "log10" in str(line.render())  # the shown tab's own news
            footers = {}
            for tab in ("tab-dynamics", "tab-drift", "tab-ckpt", "tab-types", "tab-heads"):
                lab.query_one("#lab-tabs", TabbedContent).active = tab  # (a box may hold the focus)
                await pilot.pause()
                await pilot.pause()
                said = str(line.render())
                assert said == {
                    "tab-dynamics": "qk-dynamics ready",
                    "tab-heads": "score histograms: log10 counts",
                }.get(tab, ""), (tab, said)
                footer = lab.query(FooterKey).results()
                keys = [k for k in footer if k.display]
                labels = [label for label in lab.query(FooterLabel).results() if label.display]
                right = max(w.region.right for w in [*keys, *labels])
                footers[tab] = (right, {k.key for k in keys})
                assert right <= 80, (tab, right)
            assert {"left_square_bracket", "right_square_bracket", "b", "x"} <= footers["tab-dynamics"][1]

    asyncio.run(scenario())


def test_trajectory_labels_never_run_together():
    """Two ends at one point (a head whose K did not move): K:0 and K:1000 were drawn over each
    other (``K:1000:0``); each label now has its own cells, a row away."""
    import plotext as plt

    from isotui.figures import draw_trajectory

    class Still(_FakeSeries):
        def trajectory(self, site, head, basis):
            return np.array([[-0.8, -0.1], [0.3, -0.4]]), np.array([[0.0, 0.0], [0.0, 0.0]])

    for size in ((40, 12), (60, 16), (100, 24)):
        plt.clf()
        plt.plotsize(*size)
        draw_trajectory(plt, Still(), 0, 0, "qk", ("red", "blue"), size=size)
        out = plt.uncolorize(plt.build())
        plt.clf()
        words = out.replace("│", " ").replace("┤", " ").replace("•", " ").split()
        for label in ("Q:0", "Q:1000", "K:0", "K:1000"):
            assert label in words, (label, out)


def test_histogram_ticks_are_round_and_small_bars_leave_the_bottom_row_empty():
    """The middle tick read 3.08 (the range's centre): ticks are round values and 0 when in range;
    in linear counts a bar under half a row is not drawn (plotext drew each as a full row, so the
    bottom row covered the whole range)."""
    from isotui.figures import draw_histogram, histogram_bars

    edges = np.linspace(-20.0, 40.0, 61)
    counts = np.zeros(62)
    counts[1:-1] = np.exp(-(((edges[:-1] + edges[1:]) / 2 - 6.0) ** 2) / 30) * 1000
    counts[2] = counts[55] = 1  # far scores: a count of 1 each
    drawn = {}

    class Recorder:
        def title(self, text):
            drawn["title"] = text

        def bar(self, xs, ys, **_kw):
            drawn["xs"], drawn["ys"] = xs, ys

        def xticks(self, ticks, labels):
            drawn["ticks"], drawn["labels"] = ticks, labels

    draw_histogram(Recorder(), counts, edges, "red", "scores", rows=15)
    centres, sums = histogram_bars(counts, edges)
    assert 0.0 in drawn["ticks"] and "0" in drawn["labels"]
    assert all(centres[0] <= t <= centres[-1] for t in drawn["ticks"]) and len(drawn["ticks"]) <= 3
    steps = np.diff(drawn["ticks"])
    assert np.allclose(steps, steps[0]) and steps[0] in (5, 10, 20, 25, 50)  # round values
    half_row = max(sums) / 10 / 2  # 15 rows less the 5 of the axes and title
    assert drawn["ys"] == [s if s >= half_row else 0 for s in sums]
    assert any(0 < s < half_row for s in sums)  # some bars were left out ...
    draw_histogram(Recorder(), counts, edges, "red", "scores", log=True, rows=15)
    assert np.allclose(drawn["ys"], np.log10(1 + np.asarray(sums, dtype=float)))  # ... not in log counts
