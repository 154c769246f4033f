"""The main screen's drift pane: how drift norm and anisotropy go together across layers
(Godey et al. Figs. 5, 16): Spearman and Pearson per compared model, significant at 0.05 or not,
and the selected model's two curves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable

from isotui.render import distinct_names, p_bound
from isotui.results import ModelResult
from isotui.tui.plots import RGB, FitPlot, PlotLegend, draw_drift_curves

DRIFT_COLUMNS = ("model", "layers", "spearman rho", "p", "pearson r", "p ", "spearman p (t)")


def _num(value: float, digits: int) -> str:
    return f"{value:.{digits}f}" if value == value else "-"


def _pvalue(p: float, bound: bool = False) -> str:
    """The p-value, marked significant (*) at 0.05; an upper bound as ``<3.1e-12`` (rounded up),
    and an approximation that underflowed to 0 as ``<1e-300``, never 0."""
    if p != p:
        return "-"
    text = p_bound(p) if bound else f"{p:.2g}" if p > 0 else "<1e-300"
    return text + (" *" if p < 0.05 else "")


class DriftPane(Vertical):
    """The drift table and curves. Each is redrawn only when what it shows changed: moving through
    the models list redraws nothing for a model with no result (a key answers faster; issue 12)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._shown_table: tuple[ModelResult, ...] | None = None
        self._shown_curves: tuple[ModelResult | None, bool, tuple[RGB, ...]] | None = None

    def compose(self) -> ComposeResult:
        drift: DataTable[str] = DataTable(id="drift", cursor_type="none")
        drift.can_focus = False  # nothing to pick in it
        drift.border_title = "drift vs avg_cos (Godey et al. Fig. 5)"
        for label in DRIFT_COLUMNS:
            drift.add_column(label, key=label)
        yield drift
        yield FitPlot(id="drift-plot")
        yield PlotLegend(id="drift-legend")

    def show(
        self,
        compared: Sequence[ModelResult],
        selected: ModelResult | None,
        depth: bool,
        colours: Sequence[RGB],
    ) -> None:
        """The table for ``compared``, the curves of ``selected``."""
        if not same(self._shown_table, tuple(compared)):
            self._shown_table = tuple(compared)
            self._fill_table(compared)
        curves = (selected, depth, tuple(colours))
        if self._shown_curves is None or not (
            self._shown_curves[0] is selected and self._shown_curves[1:] == curves[1:]
        ):
            self._shown_curves = curves
            legend = draw_drift_curves(self.query_one("#drift-plot", FitPlot), selected, depth, colours)
            self.query_one("#drift-legend", PlotLegend).show(legend)

    def _fill_table(self, compared: Sequence[ModelResult]) -> None:
        table = self.query_one("#drift", DataTable)
        table.clear()
        names = distinct_names([r.model for r in compared], 32)  # told apart, as in the legend
        for name, result in zip(names, compared, strict=True):
            for component, d in result.drift.items():
                table.add_row(
                    name if component == "model" else f"{name} ({component})",
                    str(d.n_layers),
                    _num(d.spearman_rho, 3),
                    _pvalue(d.spearman_p, bound=d.spearman_p_floored),
                    _num(d.pearson_r, 3),
                    _pvalue(d.pearson_p),
                    _pvalue(d.spearman_p_t),  # scipy's t approximation, beside the permutation p
                )


def same(shown: tuple[ModelResult, ...] | None, now: tuple[ModelResult, ...]) -> bool:
    """The same result objects in the same order (identity: a rerun is a new object)."""
    if shown is None or len(shown) != len(now):
        return False
    return all(a is b for a, b in zip(shown, now, strict=True))
