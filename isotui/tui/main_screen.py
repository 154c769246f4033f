"""The main screen, the layer view: the models pane on the left, the selected model's layer table,
the comparison's metric plot and drift pane, the jobs pane; and what its keys and picks do to the
comparison set (the app's ``results``, ``comparison``, ``selected``, ``metric`` and ``depth``).

It is always the bottom screen (the app's default): its widgets are updated while the lab or a
dialog is shown on top of it (a job ending, the list refreshed).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, OptionList

from isotui.errors import IsotuiError
from isotui.models.naming import check_name
from isotui.results import LAYER_METRICS, ModelResult
from isotui.store.cache import CacheProblem
from isotui.sweep import SweepResult
from isotui.tui.drift_pane import DriftPane
from isotui.tui.jobs import JobsTable
from isotui.tui.layer_table import LayerTable
from isotui.tui.metric_plot import MetricPlot
from isotui.tui.model_list import Entry
from isotui.tui.models_pane import ModelsPane

if TYPE_CHECKING:
    from isotui.tui.figure_export import ScreenFigure
    from isotui.tui.host import AppState

PLOT_METRICS = LAYER_METRICS  # the cycle of `m`: results.METRICS, declared once


def plot_metrics(results: list[ModelResult]) -> tuple[str, ...]:
    """The cycle of `m` for these results: :data:`PLOT_METRICS`, then the plug-in metrics'
    columns their rows hold (isotui.core.plugin), in the order first seen."""
    extra = (c for r in results for row in r.rows for c in row.extra)
    return PLOT_METRICS + tuple(c for c in dict.fromkeys(extra) if c not in PLOT_METRICS)


class MainScreen(Screen[None]):
    """The layer view (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(id="_default")  # (the app's default screen)

    @property
    def host(self) -> AppState:
        return cast("AppState", self.app)

    def compose(self) -> ComposeResult:
        host = self.host
        yield Header(show_clock=False)
        with Horizontal(id="body"):
            yield ModelsPane(
                host.cache,
                selected=lambda: host.selected,
                restore=self.select,
                marks=self.compared_marks,
                id="left",
            )
            with Vertical(id="main"):
                yield LayerTable(id="layers")
                with Horizontal(id="charts"):
                    yield MetricPlot(id="plot-box")
                    yield DriftPane(id="drift-pane")
        yield JobsTable(id="jobs")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        """The list scanned, the table and plots drawn (in the theme the app set before its screen
        mounted), and the last session's comparison reopened."""
        jobs = self.query_one("#jobs", JobsTable)
        jobs.fold_key = next((k for k, i, _ in self.host.key_bindings() if i == "jobs"), jobs.fold_key)
        self.refresh_models()
        self.show_table()
        self.replot()
        self.show_drift()
        self.host.last_session.reopen()

    # -- views ---------------------------------------------------------------------------------

    def jobs(self) -> JobsTable:
        """The jobs pane (NoMatches while the app closes)."""
        return self.query_one("#jobs", JobsTable)

    def show_table(self) -> None:
        host = self.host
        self.query_one("#layers", LayerTable).show_selected(
            host.selected, host.results.get(host.selected or "")
        )

    def replot(self) -> None:
        host = self.host
        self.query_one(MetricPlot).show(self.compared(), host.metric, host.depth, host.model_colours())

    def show_drift(self) -> None:
        """The drift pane: the compared models, and the selected one's curves."""
        host = self.host
        self.query_one(DriftPane).show(
            self.compared(), host.results.get(host.selected or ""), host.depth, host.model_colours()
        )

    def show_marks(self) -> None:
        """Mark the compared models (and their cached runs) in the models pane."""
        self.models_pane.show_marks()

    def screen_figure(self) -> ScreenFigure | str:
        """The app's ``F`` here: the metric plot as a figure, or why there is none."""
        from isotui.tui.figure_export import ScreenFigure

        host = self.host
        if not host.comparison:
            return "no plot to save yet: run a model (r)"
        options = {"metric": host.metric, "depth": host.depth}
        draw = "isotui.paper_figures_dynamics:draw_metric_by_layer"
        return ScreenFigure("layers", draw, self.compared(), options)

    # -- the comparison set --------------------------------------------------------------------

    def compared(self) -> list[ModelResult]:
        host = self.host
        return [host.results[m] for m in host.comparison]

    def compared_count(self) -> str:
        n = len(self.host.comparison)
        return f"{n} model{'s' * (n != 1)} compared"

    def compared_marks(self) -> set[str]:
        host = self.host
        return {f"model:{m}" for m in host.comparison} | {
            f"run:{host.results[m].key}" for m in host.comparison if m in host.results
        }

    def add_result(self, result: ModelResult) -> None:
        host = self.host
        model = result.model
        host.results[model] = result
        new = model not in host.comparison
        if new:
            host.comparison.append(model)
        if host.selected is None:
            host.selected = model
        self.show_table()
        self.replot()
        self.show_drift()
        if new:
            self.show_marks()
        host.save_session()

    def add_sweep_result(self, sweep: SweepResult) -> None:
        """A finished sweep: each merged run joins the comparison as a finished run does."""
        host = self.host
        for result in sweep.results:
            self.add_result(result)
        if sweep.results:
            host.selected = sweep.results[0].model
            self.show_table()
        if not sweep.from_cache:
            self.refresh_models()  # new cached runs to list
        failed = f"; {len(sweep.failed)} failed: {', '.join(sweep.failed)}" if sweep.failed else ""
        runs = f"{len(sweep.results)} run{'' if len(sweep.results) == 1 else 's'}"
        host.notify(
            f"sweep {sweep.name}: {runs} added to the comparison{failed}",
            severity="warning" if sweep.failed else "information",
        )

    def reopened(self, found: list[ModelResult], gone: list[str], selected: str | None) -> None:
        """The last session's comparison set, read back from the result cache."""
        host = self.host
        if not host.screen_stack:
            return
        for result in found:
            host.results[result.model] = result
            if result.model not in host.comparison:
                host.comparison.append(result.model)
        if selected in host.results:
            host.selected = selected
        self.show_table()
        self.replot()
        self.show_drift()
        self.show_marks()
        if gone:
            host.notify(
                f"last session: {', '.join(gone)} no longer in the result cache (run again with r)",
                severity="warning",
            )

    def select(self, model: str) -> None:
        self.host.selected = model
        self.show_table()
        self.show_drift()

    def open_cached(self, key: str) -> None:
        """Show a cached result at once (a file read: no model, no torch)."""
        from isotui.experiments import layer_pass  # (not needed for the first frame)

        host = self.host
        try:
            result = layer_pass.read(host.cache, key)
        except CacheProblem as exc:
            host.notify(f"cached run {key[:12]}: {exc}", severity="error")
            return
        if result is None:
            host.notify(f"cached run {key[:12]} is gone (removed by `isotui cache rm`?)", severity="warning")
            self.refresh_models()
            return
        result.from_cache = True
        host.selected = result.model
        self.add_result(result)

    def toggle_compare(self) -> None:
        host = self.host
        if not host.selected:
            host.notify("select a model first", severity="warning")
            return
        model = host.selected
        if model in host.comparison:
            host.comparison.remove(model)
            host.notify(f"{model} left the comparison ({self.compared_count()})")
        elif model in host.results:
            host.comparison.append(model)
            host.notify(f"{model} added to the comparison ({self.compared_count()}; e exports them)")
        else:
            host.notify(f"run {model} first (r): only measured models can be compared", severity="warning")
            return
        self.replot()
        self.show_drift()
        self.show_marks()
        host.save_session()

    def cycle_metric(self) -> None:
        host = self.host
        cycle = plot_metrics(self.compared())
        at = cycle.index(host.metric) if host.metric in cycle else -1
        host.metric = cycle[(at + 1) % len(cycle)]
        self.replot()
        host.save_session()

    def toggle_depth(self) -> None:
        host = self.host
        host.depth = not host.depth
        self.replot()
        self.show_drift()
        host.save_session()

    def toggle_jobs(self) -> None:
        """Unfold the jobs pane (folded to its summary line on a short screen), or fold it."""
        self.query_one("#jobs", JobsTable).toggle_fold()

    def sort(self) -> None:
        self.query_one("#layers", LayerTable).sort_cursor_column()

    # -- the models pane -----------------------------------------------------------------------

    @property
    def models_pane(self) -> ModelsPane:
        return self.query_one(ModelsPane)

    @property
    def entries(self) -> list[Entry]:
        """What the models pane lists (empty until its worker has scanned)."""
        try:
            return self.models_pane.entries
        except NoMatches:
            return []

    def refresh_models(self) -> None:
        """List presets, the HF cache and cached runs again (on a worker thread)."""
        self.models_pane.refresh_entries()

    def focus_input(self) -> None:
        self.query_one("#model-input", Input).focus()

    @on(OptionList.OptionHighlighted, "#models")
    def _highlight(self, event: OptionList.OptionHighlighted) -> None:
        kind, _, value = (event.option.id or "").partition(":")
        if kind == "model" and self.host.screen_stack:  # (not while the app closes)
            self.select(value)

    @on(OptionList.OptionSelected, "#models")
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        kind, _, value = (event.option.id or "").partition(":")
        if kind == "model":
            self.select(value)
            self.host.launcher.run_selected()
        elif kind == "preset":
            self.host.launcher.run_preset(value)
        elif kind == "run":
            self.open_cached(value)

    @on(Input.Submitted, "#model-input")
    def _typed(self, event: Input.Submitted) -> None:
        host = self.host
        name = event.value.strip()
        if name.endswith(".toml") and Path(name).expanduser().is_file():  # a config file: its runs
            host.launcher.run_config(Path(name).expanduser())
        elif name:
            try:  # what the name alone tells, at once: its form, a missing folder, a typo offline
                check_name(name)
            except IsotuiError as exc:
                host.notify(str(exc), severity="error")
                return
            self.select(name)
            host.launcher.run_selected()
            self.query_one("#models", OptionList).focus()
