"""ablate's views: ``isotui figure ablation`` (its CSV against the experiment's own --json,
recomputed here row by row), the terminal table (80 columns) and the lab tab (key 6) through
Textual's pilot, each from a real run of a tiny untrained GPT-2 with its LM head."""

from __future__ import annotations

import asyncio
import csv
import io
import json

import pytest

from isotui.cli import main

from .conftest import corpus

GPT2 = "random:gpt2:n_layer=2,n_embd=32,n_head=2"
RUN = ["-m", GPT2, "--max-samples", "8"]


def _reference(tmp_path, *remove: str) -> dict:
    """The result as ``isotui experiment ablate --json`` gives it."""
    out = tmp_path / "ablate.json"
    assert main(["experiment", "ablate", *RUN, "--remove", *remove, "--json", str(out), "-q"]) == 0
    (result,) = json.loads(out.read_text())["results"]
    return result


def test_figure_plots_the_results_numbers(tmp_path):
    from PIL import Image

    out = tmp_path / "ablation.png"
    argv = ["figure", "ablation", *RUN, "--remove", "mean", "pc:2", "--dpi", "100", "--out", str(out), "-q"]
    assert main(argv) == 0
    with Image.open(out) as image:
        assert image.size == (330, 240)
    with open(out.with_suffix(".csv"), newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    meta = json.loads(out.with_suffix(".json").read_text())
    result = _reference(tmp_path, "mean", "pc:2")  # from the cache the figure filled
    assert [r["model"] for r in meta["runs"]] == [GPT2] and len(meta["runs"][0]["key"]) == 32
    by_panel: dict[str, list[dict]] = {}
    for row in rows:
        by_panel.setdefault(row["panel"], []).append(row)
    assert set(by_panel) == {"clean_loss", "delta_loss", "avg_cos"}
    (clean,) = by_panel["clean_loss"]
    assert float(clean["value"]) == pytest.approx(result["rows"][0]["loss"], rel=1e-12)
    want = [
        (r["site"], r["layer"], r["remove"], r["loss_ablated"] - r["loss"], r["loss_random"] - r["loss"])
        for r in result["rows"]
    ]
    got = [
        (r["site"], int(r["site_layer"]), r["remove"], float(r["value"]), float(r["random"]))
        for r in by_panel["delta_loss"]
    ]
    assert (
        [g[:3] for g in got]
        == [w[:3] for w in want]
        == [
            ("transformer.h.0", 1, "mean"),
            ("transformer.h.0", 1, "pc:2"),
            ("transformer.h.1", -1, "mean"),  # ln_f follows the last block: no hidden state is its own
            ("transformer.h.1", -1, "pc:2"),
        ]
    )
    for g, w in zip(got, want, strict=True):
        assert g[3:] == pytest.approx(w[3:], rel=1e-9, abs=1e-12)
    curves = by_panel["avg_cos"]
    n = len(result["avg_cos"])
    assert n == 3 and len(curves) == n * (1 + len(result["rows"]))
    assert [float(r["value"]) for r in curves[:n]] == pytest.approx(result["avg_cos"], rel=1e-12)
    assert {r["remove"] for r in curves[:n]} == {"clean"}
    for k, (row, curve) in enumerate(zip(result["rows"], result["curves"], strict=True)):
        mine = curves[n * (k + 1) : n * (k + 2)]
        assert {(r["site"], r["remove"]) for r in mine} == {(row["site"], row["remove"])}
        assert [int(r["layer"]) for r in mine] == list(range(n))
        assert [float(r["value"]) for r in mine] == pytest.approx(curve["avg_cos"], rel=1e-12)


def test_figure_sites_and_bad_flags(tmp_path, capsys, monkeypatch):
    out = tmp_path / "one.svg"
    assert main(["figure", "ablation", *RUN, "--modules", "transformer.h.1", "--out", str(out), "-q"]) == 0
    with open(out.with_suffix(".csv"), newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["panel"] == "delta_loss"]
    assert [(r["site"], r["remove"]) for r in rows] == [("transformer.h.1", "mean")]  # the default removal
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    for args, needle in (
        (["figure", "godey2024-fig1", "-m", GPT2, "--remove", "mean", "--out", "f.pdf"], "--remove is for"),
        (["figure", "ablation", "-m", GPT2, "-m", "minilm", "--out", "f.pdf"], "give at most one --model"),
        (["figure", "ablation", "-m", GPT2, "--remove", "pc:0", "--out", "f.pdf"], "pc:0"),
    ):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert not list(tmp_path.glob("f.*"))


def test_terminal_view_fits_80_columns(tmp_path):
    from rich.console import Console

    from isotui.experiments.ablate.result import AblationResult, from_payload
    from isotui.render import shorten
    from isotui.views import result_tables, show

    result = from_payload(_reference(tmp_path, "mean", "pc:2", "dims:0,5"), {})
    assert isinstance(result, AblationResult)
    result.rows[0].site = "model.decoder.layers.11.self_attn.out_proj"  # long names: shortened
    result.rows[1].remove = "dims:0,1,2,3,4,5,6,7"
    console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    show(result_tables("ablate", [result], None, 80), console)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "Δ loss" in line)
    assert all(h in header for h in ("site", "remove", "random", "final", "recovery"))
    assert "loss" not in header.replace("Δ loss", "")  # the clean loss is said once, above
    text = "\n".join(lines)
    assert f"clean loss {result.rows[0].loss:.3f}" in text
    body = [line for line in lines if "│" in line and "Δ loss" not in line]
    assert len(body) == len(result.rows) == 6
    for line, row in zip(body, result.rows, strict=True):
        cells = [c.strip() for c in line.strip("│").split("│")]
        assert cells[1] == shorten(row.remove, 12) and len(cells[1]) <= 12
        assert cells[2:] == [
            f"{row.delta_loss:+.4f}",
            f"{row.delta_loss_random:+.4f}",
            f"{row.final_change:.4f}",
            f"{row.recovery:.3f}",
        ]
    assert body[0].split("│")[1].strip().startswith("model.dec") and "…" in body[0]


def test_lab_tab_runs_the_box_and_shows_the_rows(tmp_path):
    """Tab 6: the removals typed in its box run on the selected model through the app's backend;
    one row per site and removal as the result has them; ↓ moves the curve shown; m shows the
    drift; a bad removal is one sentence and the cursor stays in the box; e exports the rows."""
    from textual.widgets import DataTable, Input, TabbedContent

    from isotui.experiments.ablate.tab import AblateTab
    from isotui.tui.app import IsotuiApp

    from .test_tui import _wait

    data = tmp_path / "samples.txt"
    data.write_text("\n".join(corpus(8)) + "\n", encoding="utf-8")

    async def scenario():
        app = IsotuiApp(
            cache_root=tmp_path / "cache",
            spec_defaults={"data": f"text:{data}", "max_samples": None, "max_length": 32},
            export_dir=tmp_path,
        )
        notes: list[str] = []
        async with app.run_test(size=(80, 24)) as pilot:
            await _wait(pilot, lambda: app.entries)
            await pilot.pause()
            app.notify = lambda message, **_kw: notes.append(message)
            app.selected = GPT2
            await pilot.press("A", "6")
            await pilot.pause()
            await pilot.pause()
            lab = app.screen
            assert lab.query_one("#lab-tabs", TabbedContent).active == "tab-ablate"
            box = lab.query_one("#ablate-input", Input)
            assert box.has_focus
            box.value = "mean pc:K"
            await pilot.press("enter")
            await pilot.pause()
            assert box.has_focus and notes and notes[-1].startswith("'pc:K' is not one of"), notes
            box.value = "mean dims:0,5 modules=transformer.h.1"
            await pilot.press("enter")
            await _wait(pilot, lambda: GPT2 in app.lab_results["ablate"], timeout=120)
            result = app.lab_results["ablate"][GPT2]
            table = lab.query_one("#ablate-table", DataTable)
            await _wait(pilot, lambda: table.row_count == 2)
            assert table.has_focus and "ablate ready" in str(lab.query_one("#lab-status").render())
            assert [(r.site, r.remove) for r in result.rows] == [
                ("transformer.h.1", "mean"),
                ("transformer.h.1", "dims:0,5"),
            ]
            for i, r in enumerate(result.rows):
                shown = [str(c).strip() for c in table.get_row_at(i)]
                assert shown == [
                    r.site,
                    str(r.layer) if r.layer >= 0 else "-",  # no hidden state of its own
                    r.remove,
                    f"{r.delta_loss:+.4f}",
                    f"{r.delta_loss_random:+.4f}",
                    f"{r.final_change:.4f}",
                    f"{r.recovery:.3f}",
                ]
            tab = lab.query_one(AblateTab)
            assert "transformer.h.1 mean" in tab.plot_title  # the cursor's row
            await pilot.press("down")
            await pilot.pause()
            assert "transformer.h.1 dims:0,5" in tab.plot_title
            await pilot.press("m")
            await pilot.pause()
            assert tab.metric == 1
            assert tab.plot_title.startswith("drift")
            await pilot.press("e")
            await pilot.pause()
            (written,) = tmp_path.glob("isotui-*-ablate.csv")
            with open(written, newline="", encoding="utf-8") as f:
                exported = list(csv.DictReader(f))
            assert [float(r["delta_loss"]) for r in exported] == pytest.approx(
                [r.delta_loss for r in result.rows], rel=1e-12
            )

    asyncio.run(scenario())


def test_sites_alike_but_for_their_middle_stay_apart_in_every_view(tmp_path):
    """norm_in's or mlp_out's sites differ in the middle of their names: the terminal table, the
    lab tab and the figure's ticks each name every site apart (the part all share dropped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.console import Console

    from isotui.experiments.ablate.result import from_payload
    from isotui.experiments.ablate.tab import table_cells
    from isotui.paper_figures_probes import draw_ablation
    from isotui.views import result_tables, show

    result = from_payload(_reference(tmp_path, "mean"), {})
    assert len(result.rows) == 2
    for rows, names in (
        (result.rows, [f"bert.encoder.layer.{i}.attention.output.LayerNorm (input)" for i in (0, 1)]),
        (result.rows, [f"transformer.h.{i}.mlp" for i in (0, 1)]),
    ):
        for row, name in zip(rows, names, strict=True):
            row.site, row.layer = name, -1
        console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
        show(result_tables("ablate", [result], None, 80), console)
        body = [line for line in console.export_text().splitlines() if "│" in line and "Δ loss" not in line]
        shown = [line.strip("│").split("│")[0].strip() for line in body]
        assert len(set(shown)) == 2, shown
        tab = [cells[0].strip() for cells in table_cells(result)[1:]]
        assert len(set(tab)) == 2, tab
        fig = plt.figure(figsize=(3.3, 2.4))
        draw_ablation(fig, [result], None)
        ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
        plt.close(fig)
        assert len(set(ticks)) == 2, ticks
