"""The lab's Checkpoints tab: any layer metric along a checkpoint series as a layer x step
heatmap (Machina & Mercer 2024), each cell shaded by its value within the grid."""

from __future__ import annotations

import math
from typing import Any

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.color import Color
from textual.widgets import DataTable, Input, Static

from isotui.render import DUPLICATE_MARK, duplicates_caption, shorten
from isotui.tui.lab_tab import LabTab, SettingsBox
from isotui.tui.layer_table import SHADE_MAX, shade_fraction


def compose_checkpoints() -> ComposeResult:
    yield SettingsBox(
        placeholder="checkpoints: step0 step1000 (revisions of the selected model), model ids, or "
        "folders; enter runs each as a layer run",
        id="ckpt-input",
    )
    yield Static(id="ckpt-info")
    yield DataTable(id="ckpt-table", cursor_type="cell", zebra_stripes=False)


def show_checkpoints(tab: CheckpointsTab) -> None:
    """The heatmap of the tab's metric for the series' result (or what to do to get one)."""
    from isotui.experiments.checkpoints import METRICS

    result = tab.result()
    table = tab.query_one("#ckpt-table", DataTable)
    info = tab.query_one("#ckpt-info", Static)
    table.clear(columns=True)
    metric = METRICS[tab.metric % len(METRICS)]
    if result is None:
        info.update(f"{metric} by layer and step: give checkpoints above (m: next metric)")
        return
    labels, values = result.grid(metric)
    finite = [v for v in values.flat if math.isfinite(v)]
    bounds = (min(finite), max(finite)) if finite else None
    theme = tab.host.current_theme
    low = Color.parse(theme.surface or theme.background or "#202020")
    high = Color.parse(theme.primary)
    marks = [DUPLICATE_MARK if c.duplicate_of else "" for c in result.checkpoints]
    table.add_columns("layer", *(f"{s}{m}" for s, m in zip(result.steps(), marks, strict=True)))
    for label, row in zip(labels, values, strict=True):
        cells = [Text(label, justify="right")]
        for v in row:
            text = Text("-" if not math.isfinite(v) else f"{v:.3f}", justify="right")
            frac = shade_fraction(v, bounds)
            if frac is not None:
                text.stylize(Style(bgcolor=low.blend(high, SHADE_MAX * frac).rich_color))
            cells.append(text)
        table.add_row(*cells)
    meta = result.results[0].meta
    span = f"{bounds[0]:.3f} .. {bounds[1]:.3f}" if bounds else "-"
    info.update(
        f"{shorten(result.series, 40)} · {metric} by layer (rows) and step (columns), {span} · "
        f"{meta.get('data')}, {meta.get('n_samples')} samples · m: next metric"
        + duplicates_caption(result.checkpoints)
    )


class CheckpointsTab(LabTab):
    """Any layer metric along a checkpoint series (its view in :mod:`isotui.tui.lab_checkpoints`)."""

    KIND = "checkpoints"
    BOX = "#ckpt-input"
    TABLE = "#ckpt-table"
    KEY, NAME, TITLE, SHORT = "4", "ckpt", "Checkpoints", "Ckpts"
    TOOLTIP = "tab: layer metrics along checkpoints"

    def __init__(self, title: str, *, id: str) -> None:
        super().__init__(title, id=id)
        self.metric = 0  # which layer metric the heatmap shows

    def compose(self) -> ComposeResult:
        yield from compose_checkpoints()

    def show(self) -> None:
        show_checkpoints(self)

    def run(self) -> bool:
        from isotui.experiments.checkpoints import CheckpointsRequest

        text = self.query_one("#ckpt-input", Input).value
        return self.submit_series(text, CheckpointsRequest, "checkpoints")

    def cycle(self) -> None:
        self.metric += 1
        self.show()

    def figure(self) -> Any:
        """The heatmap as ``isotui figure machina2024-heatmap`` draws it, of the metric shown."""
        from isotui.experiments.checkpoints import METRICS
        from isotui.tui.figure_export import ScreenFigure

        result = self.result()
        if result is None:
            return "no plot to save yet: run the checkpoints (r)"
        options = {"metric": METRICS[self.metric % len(METRICS)]}
        return ScreenFigure("checkpoints", "isotui.paper_figures:draw_heatmap", [result], options)
