"""The main screen's metric plot: the compared models' curves of the metric chosen with ``m``
(by layer, or by depth 0..1 with ``n``), and their legend under it (beside it when narrow)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Container

from isotui.results import ModelResult
from isotui.tui.plots import RGB, FitPlot, PlotLegend, draw_metric_curves


class MetricPlot(Container):
    """The plot and its legend."""

    def compose(self) -> ComposeResult:
        yield FitPlot(id="plot")
        yield PlotLegend(id="plot-legend")

    def show(self, compared: list[ModelResult], metric: str, depth: bool, colours: list[RGB]) -> None:
        legend = draw_metric_curves(self.query_one("#plot", FitPlot), compared, metric, depth, colours)
        self.query_one("#plot-legend", PlotLegend).show(legend)
