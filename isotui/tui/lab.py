"""The attention lab (key ``A``): inside self-attention, one tab per experiment.

- Heads: ``isotui experiment attention`` on the selected model: cos(Q̄,K̄), Q̄·K̄, norms and the
  softmax's sharpness per layer (heads averaged, each head as a point), and the pre-softmax
  score histogram of the layer under the cursor (Godey et al. Figs. 7, 11-15).
- Dynamics: ``isotui experiment qk-dynamics`` over a checkpoint series: checkpoints x layers,
  the trajectories of Q̄ and K̄ of one head in the series' common SVD basis, per-layer curves.
- Drift block: ``isotui experiment drift-block``, the untrained block under a drift of norm N
  (Figs. 6-10).
- Checkpoints: ``isotui experiment checkpoints``, any layer metric along a checkpoint series as a
  shaded layer x step heatmap (Machina & Mercer 2024).

Each tab is a widget that owns its state (the metric or figure shown, the head, the basis) and
knows its experiment: run it, show its result, export its table. The screen's keys go to the tab
shown. Jobs go through the app's backend like layer runs (the jobs pane on the main screen shows
them); results come back to :meth:`LabScreen.refresh_all` on the UI thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, cast

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static, TabbedContent, TabPane

from isotui.render import shorten
from isotui.tui.host import RGB, AppHost
from isotui.tui.plots import FitPlot, draw_head_metric, draw_score_histogram

# Q-mean, K-mean: the mean query and key of a head (the papers' Q̄, K̄; a combining macron is
# drawn as its own cell by plotext and some terminals, so the app spells it out)
HEAD_METRICS = (
    ("cos_qk_bar", "cos(Q-mean, K-mean)"),
    ("dot_qk_bar", "Q-mean·K-mean"),
    ("q_bar_norm", "|Q-mean|"),
    ("k_bar_norm", "|K-mean|"),
    ("q_avg_cos", "query avg_cos"),
    ("k_avg_cos", "key avg_cos"),
    ("softmax_max", "softmax row max"),
    ("entropy", "attention entropy (nats)"),
)
DYN_METRICS = (
    ("cos_qk_bar", "cos(Q-mean, K-mean)"),
    ("entropy", "entropy (nats)"),
    ("dot_qk_bar", "Q-mean·K-mean"),
)
BASES = ("qk", "q", "k")


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


class LabTab(TabPane):
    """One tab of the lab: its experiment, its state, its view."""

    KIND = ""  # the experiment (its results in the app's ``lab_results``; its CSV's name)
    BOX: str | None = None  # its settings box, focused while nothing has run
    TABLE = ""  # its table, focused once something has

    @property
    def host(self) -> AppHost:
        return cast(AppHost, self.app)

    @property
    def lab(self) -> LabScreen:
        return cast(LabScreen, self.screen)

    def result(self) -> Any:
        return self.host.lab_results.get(self.KIND)

    def show(self) -> None:
        """Draw the tab from the current result."""

    def run(self) -> bool:
        """Queue the tab's experiment; False (and one sentence) when refused."""
        return False

    def cycle(self) -> None:
        """The next metric or figure."""

    def replot(self) -> None:
        """Draw the plots again (log or linear counts), the table's cursor kept."""
        self.show()

    def focus_target(self) -> str:
        return self.BOX if self.BOX is not None and self.result() is None else self.TABLE

    @on(Input.Changed)
    def _box_changed(self, event: Input.Changed) -> None:
        self.host.lab_inputs[event.input.id or ""] = event.value

    # Enter in a settings box: queued, the table takes the cursor (the tab's keys work again);
    # refused, the cursor stays in the box (the next keys edit it, they fire no hotkey).
    @on(Input.Submitted)
    def _box_submitted(self, _event: Input.Submitted) -> None:
        self.host.save_session()
        if self.run():
            self.query_one(self.TABLE, DataTable).focus()

    def submit_series(self, text: str, make_request: Callable[..., Any], what: str) -> bool:
        """Queue ``make_request(series, checkpoints, spec)`` for the checkpoints typed in ``text``
        (a bad series is one sentence); the series is named after the selected model when every
        checkpoint is one of its revisions."""
        from isotui.errors import IsotuiError
        from isotui.experiments.qk_dynamics import resolve_checkpoints

        host = self.host
        try:
            checkpoints = resolve_checkpoints(host.selected, [text])
            spec = host.spec_for(checkpoints[0].model)
        except IsotuiError as exc:
            from isotui.tui.wording import in_box_terms

            host.notify(in_box_terms(str(exc)), severity="error")
            return False
        prefix = f"{host.selected}@"
        selected = host.selected
        series = selected if selected and all(c.model.startswith(prefix) for c in checkpoints) else None
        host.submit_request(make_request(series, tuple(checkpoints), spec))
        self.lab.status(f"queued {what} over {len(checkpoints)} checkpoints (jobs: main screen)")
        return True


class HeadsTab(LabTab):
    """Queries, keys and attention per layer and head of the selected model."""

    KIND = "attention"
    TABLE = "#heads-table"

    def __init__(self, title: str, *, id: str) -> None:
        super().__init__(title, id=id)
        self.metric = 0  # which of HEAD_METRICS the plot shows

    def compose(self) -> ComposeResult:
        yield Static(id="heads-info")
        table: DataTable[str] = DataTable(id="heads-table", cursor_type="row", zebra_stripes=True)
        table.add_columns(
            "layer", "heads", "cos(Qm,Km)", "range", "Qm·Km", "|Qm|", "|Km|", "p max", "p med", "entropy"
        )
        yield table
        with Horizontal(classes="lab-charts"):
            yield FitPlot(id="heads-plot")
            yield FitPlot(id="hist-plot")

    def result(self) -> Any:
        return self.host.lab_results["attention"].get(self.host.selected or "")

    def show(self) -> None:
        from isotui.experiments.attention import summarize

        result = self.result()
        info = self.query_one("#heads-info", Static)
        table = self.query_one("#heads-table", DataTable)
        table.clear()
        if result is None:
            who = self.host.selected or "no model selected (pick one on the main screen)"
            info.update(f"{who}: press r to measure queries, keys and attention per layer and head")
            self.plot(None, [])
            return
        source = "cache" if result.from_cache else f"{result.meta.get('seconds', 0):.1f} s"
        info.update(
            f"{shorten(result.model, 50)} · {result.meta.get('data')} · {result.meta.get('n_samples')} "
            f"samples · {source} · Qm, Km: a head's mean query and key · layer L: the block "
            "whose output is row L"
        )
        summary = summarize(result)
        many = len({s.component for s in summary}) > 1
        for s in summary:
            label = (
                (f"{s.component} " if many else "") + str(s.layer) + (" x" if s.attention == "cross" else "")
            )
            table.add_row(
                label,
                str(s.heads),
                _f(s.cos_qk_bar),
                f"{_f(s.cos_qk_bar_min, 2)}..{_f(s.cos_qk_bar_max, 2)}",
                _f(s.dot_qk_bar, 2),
                _f(s.q_bar_norm, 2),
                _f(s.k_bar_norm, 2),
                _f(s.softmax_max),
                _f(s.softmax_median, 4),
                _f(s.entropy, 2),
            )
        self.plot(result, summary)

    def plot(self, result: Any, summary: list[Any]) -> None:
        plot = self.query_one("#heads-plot", FitPlot)
        hist = self.query_one("#hist-plot", FitPlot)
        colours = self.lab.app_colours()
        row = self.query_one("#heads-table", DataTable).cursor_row
        draw_head_metric(plot, result, summary, HEAD_METRICS[self.metric], colours)
        draw_score_histogram(hist, result, summary, row, colours, log=self.lab.log_counts)

    @on(DataTable.RowHighlighted, "#heads-table")
    def _row(self, _event: DataTable.RowHighlighted) -> None:
        from isotui.experiments.attention import summarize

        result = self.result()
        if result is not None:
            self.plot(result, summarize(result))

    def run(self) -> bool:
        from isotui.errors import IsotuiError
        from isotui.experiments.requests import AttentionRequest

        host = self.host
        if not host.selected:
            host.notify("select a model on the main screen first", severity="warning")
            return False
        try:
            spec = host.spec_for(host.selected)
        except IsotuiError as exc:
            host.notify(str(exc), severity="error")
            return False
        host.submit_request(AttentionRequest(spec))
        self.lab.status(f"queued attention of {host.selected} (jobs: main screen)")
        return True

    def cycle(self) -> None:
        self.metric = (self.metric + 1) % len(HEAD_METRICS)
        self.show()


class DynamicsTab(LabTab):
    """Queries and keys along a checkpoint series: the table, one head's trajectory, the curves."""

    KIND = "qk-dynamics"
    BOX = "#dyn-input"
    TABLE = "#dyn-table"

    def __init__(self, title: str, *, id: str) -> None:
        super().__init__(title, id=id)
        self.metric = 0  # which of DYN_METRICS the curves show
        self.head = 0  # the head whose trajectory shows (of the cursor's layer)
        self.basis = 0  # the trajectory's SVD basis, one of BASES

    def compose(self) -> ComposeResult:
        yield Input(
            placeholder="checkpoints: step1000 step2000 (revisions of the selected model), "
            "model ids, or folders; enter runs",
            id="dyn-input",
        )
        yield DataTable(id="dyn-table", cursor_type="cell", zebra_stripes=True)
        with Horizontal(classes="lab-charts"):
            yield FitPlot(id="dyn-plot")
            yield FitPlot(id="dyn-lines")

    def show(self) -> None:
        result = self.result()
        table = self.query_one("#dyn-table", DataTable)
        table.clear(columns=True)
        if result is None:
            self.plot()
            return
        many = len({s[0] for s in result.sites}) > 1
        labels = [
            (f"{c} " if many else "") + str(layer) + (" x" if a == "cross" else "")
            for c, layer, a in result.sites
        ]
        table.add_columns("checkpoint", "step", *labels)
        cos = result.layer_means("cos_qk_bar")
        for i, (ckpt, step) in enumerate(zip(result.checkpoints, result.steps(), strict=True)):
            table.add_row(shorten(ckpt.label, 24), str(step), *(_f(v) for v in cos[i]))
        table.border_title = f"{shorten(result.series, 40)}: cos(Q-mean, K-mean) per layer, heads averaged"
        self.plot()

    def site(self, result: Any) -> int:
        col = self.query_one("#dyn-table", DataTable).cursor_column - 2
        return min(max(col, 0), len(result.sites) - 1)

    def plot(self) -> None:
        from isotui.figures import draw_layer_series, draw_trajectory

        result = self.result()
        traj = self.query_one("#dyn-plot", FitPlot)
        lines = self.query_one("#dyn-lines", FitPlot)
        for p in (traj, lines):
            p.plt.clear_data()
            p.plt.clear_figure()
        colours = self.lab.app_colours()
        if result is None:
            traj.plt.title("Q-mean and K-mean along training: give checkpoints above")
            lines.plt.title("per-layer curves over checkpoints")
        else:
            site = self.site(result)
            heads = sorted(
                {r.head for r in result.rows if (r.component, r.layer, r.attention) == result.sites[site]}
            )
            self.head = min(self.head, len(heads) - 1)
            draw_trajectory(
                traj.plt, result, site, heads[self.head], BASES[self.basis], (colours[0], colours[1])
            )
            attr, name = DYN_METRICS[self.metric]
            labels = [str(s[1]) for s in result.sites]
            draw_layer_series(
                lines.plt,
                result.steps(),
                result.layer_means(attr),
                labels,
                f"{name} per layer over steps",
                colours,
            )
        traj.refresh()
        lines.refresh()

    @on(DataTable.CellHighlighted, "#dyn-table")
    def _cell(self, _event: DataTable.CellHighlighted) -> None:
        self.plot()

    def run(self) -> bool:
        from isotui.experiments.qk_dynamics import DEFAULT_SAMPLE
        from isotui.experiments.requests import DynamicsRequest

        def request(series: str | None, ckpts: tuple[Any, ...], spec: Any) -> DynamicsRequest:
            return DynamicsRequest(series, ckpts, spec, DEFAULT_SAMPLE)

        return self.submit_series(self.query_one("#dyn-input", Input).value, request, "qk-dynamics")

    def cycle(self) -> None:
        self.metric = (self.metric + 1) % len(DYN_METRICS)
        self.plot()

    def step_head(self, delta: int) -> None:
        self.head = max(0, self.head + delta)
        self.plot()

    def next_basis(self) -> None:
        self.basis = (self.basis + 1) % len(BASES)
        self.plot()


class DriftTab(LabTab):
    """The untrained block under drift (its view lives in :mod:`isotui.tui.lab_drift`)."""

    KIND = "drift-block"
    BOX = "#drift-input"
    TABLE = "#drift-table"

    def compose(self) -> ComposeResult:
        from isotui.tui.lab_drift import compose_drift

        yield from compose_drift()

    def show(self) -> None:
        from isotui.tui.lab_drift import show_drift

        show_drift(self.lab)

    @on(DataTable.RowHighlighted, "#drift-table")
    def _row(self, _event: DataTable.RowHighlighted) -> None:
        from isotui.tui.lab_drift import plot_drift

        plot_drift(self.lab)

    def run(self) -> bool:
        from isotui.tui.lab_drift import run_drift

        return bool(run_drift(self.lab))

    def cycle(self) -> None:
        from isotui.tui.lab_drift import cycle_drift

        cycle_drift(self.lab)

    def replot(self) -> None:
        from isotui.tui.lab_drift import plot_drift

        plot_drift(self.lab)


class CheckpointsTab(LabTab):
    """Any layer metric along a checkpoint series (its view in :mod:`isotui.tui.lab_checkpoints`)."""

    KIND = "checkpoints"
    BOX = "#ckpt-input"
    TABLE = "#ckpt-table"

    def __init__(self, title: str, *, id: str) -> None:
        super().__init__(title, id=id)
        self.metric = 0  # which layer metric the heatmap shows

    def compose(self) -> ComposeResult:
        from isotui.tui.lab_checkpoints import compose_checkpoints

        yield from compose_checkpoints()

    def show(self) -> None:
        from isotui.tui.lab_checkpoints import show_checkpoints

        show_checkpoints(self)

    def run(self) -> bool:
        from isotui.experiments.requests import CheckpointsRequest

        text = self.query_one("#ckpt-input", Input).value
        return self.submit_series(text, CheckpointsRequest, "checkpoints")

    def cycle(self) -> None:
        self.metric += 1
        self.show()


class LabScreen(Screen[None]):
    """The attention lab; see the module docstring. Esc goes back to the layer view."""

    # The tab keys 1-4 are written on the tabs themselves, so the footer keeps to this tab's keys.
    BINDINGS: ClassVar[list[Binding]] = [  # type: ignore[assignment]  # Bindings only: help reads their ids
        Binding("escape", "close", "Back", id="lab_close", tooltip="back to the layer view"),
        Binding(
            "1",
            "tab('tab-heads')",
            "Heads",
            id="lab_heads",
            show=False,
            tooltip="tab: queries and keys per head",
        ),
        Binding(
            "2",
            "tab('tab-dynamics')",
            "Dynamics",
            id="lab_dynamics",
            show=False,
            tooltip="tab: checkpoint series",
        ),
        Binding(
            "3",
            "tab('tab-drift')",
            "Drift",
            id="lab_drift",
            show=False,
            tooltip="tab: the untrained block under drift",
        ),
        Binding(
            "4",
            "tab('tab-ckpt')",
            "Ckpts",
            id="lab_ckpt",
            show=False,
            tooltip="tab: layer metrics along checkpoints",
        ),
        Binding("r", "run", "Run", id="lab_run", tooltip="run this tab's experiment"),
        Binding("m", "cycle", "Figure", id="lab_figure", tooltip="next metric or figure in this tab"),
        Binding(
            "left_square_bracket", "head(-1)", "Head-", id="lab_head_prev", tooltip="Dynamics: previous head"
        ),
        Binding(
            "right_square_bracket", "head(1)", "Head+", id="lab_head_next", tooltip="Dynamics: next head"
        ),
        Binding(
            "b", "basis", "Basis", id="lab_basis", tooltip="Dynamics: the trajectory's SVD basis (qk, q or k)"
        ),
        Binding(
            "l",
            "log_counts",
            "Log",
            id="lab_log",
            tooltip="score histograms (Heads, Drift block Fig. 7): log or linear counts",
        ),
        Binding("e", "export", "CSV", id="lab_export", tooltip="CSV of this tab's table"),
        Binding("question_mark,f1", "help", "Help", id="lab_help", tooltip="the lab's keys"),
    ]
    # the app keys that work in the lab too (shown in its help)
    APP_KEYS = ("options", "cancel", "screenshot", "theme", "quit")
    TAB_ACTIONS: ClassVar[dict[str, tuple[str, ...]]] = {
        "head": ("tab-dynamics",),
        "basis": ("tab-dynamics",),
        "log_counts": ("tab-heads", "tab-drift"),
    }

    def __init__(self) -> None:
        super().__init__()
        self.log_counts = False  # the score histograms (Heads, Drift block Fig. 7): log10 counts
        self.drift_figure = 0  # the Drift block tab's figure (kept by isotui.tui.lab_drift)

    @property
    def host(self) -> AppHost:
        return cast(AppHost, self.app)

    def compose(self) -> ComposeResult:
        with TabbedContent(id="lab-tabs"):
            yield HeadsTab("1 Heads", id="tab-heads")
            yield DynamicsTab("2 Dynamics", id="tab-dynamics")
            yield DriftTab("3 Drift block", id="tab-drift")
            yield CheckpointsTab("4 Checkpoints", id="tab-ckpt")
        yield Static(id="lab-status")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        for box, text in self.host.lab_inputs.items():  # what was typed last time (this run or the last)
            self.query_one(f"#{box}", Input).value = text
        self.refresh_all()

    @property
    def tab(self) -> str:
        return self.query_one("#lab-tabs", TabbedContent).active

    def active_tab(self) -> LabTab:
        return self.query_one(f"#{self.tab}", LabTab)

    def refresh_all(self) -> None:
        for tab in self.query(LabTab):
            tab.show()

    def status(self, text: str) -> None:
        self.query_one("#lab-status", Static).update(text)

    def app_colours(self) -> list[RGB]:
        return [*self.host.model_colours(), (200, 200, 200)]

    # -- actions -------------------------------------------------------------------------------

    def action_close(self) -> None:
        self.app.pop_screen()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A key that only one tab uses is offered (and works) in that tab only."""
        tabs = self.TAB_ACTIONS.get(action)
        if tabs is not None and self.is_mounted:
            return self.tab in tabs
        return True

    @on(TabbedContent.TabActivated)
    def _tab_shown(self, _event: TabbedContent.TabActivated) -> None:
        self.refresh_bindings()

    def action_help(self) -> None:
        from isotui.tui.help import LAB_WIDGET_KEYS, HelpScreen

        host = self.host
        shared = [b for b in host.BINDINGS if b.id in self.APP_KEYS]
        keys = host.key_bindings(self.BINDINGS) + host.key_bindings(shared)
        self.app.push_screen(HelpScreen(keys, title="attention lab keys", widget_keys=LAB_WIDGET_KEYS))

    def action_log_counts(self) -> None:
        self.log_counts = not self.log_counts
        self.active_tab().replot()
        self.status(f"score histograms: {'log10' if self.log_counts else 'linear'} counts")

    def action_run(self) -> None:
        self.active_tab().run()

    def action_cycle(self) -> None:
        self.active_tab().cycle()

    def action_tab(self, tab: str) -> None:
        """Show ``tab``; a tab with nothing run yet puts the cursor in its settings box."""
        self.query_one("#lab-tabs", TabbedContent).active = tab
        target = self.query_one(f"#{tab}", LabTab).focus_target()
        self.call_after_refresh(self.query_one(target).focus)  # once the tab is shown

    def action_head(self, delta: int) -> None:
        self.query_one(DynamicsTab).step_head(delta)

    def action_basis(self) -> None:
        self.query_one(DynamicsTab).next_basis()

    def action_export(self) -> None:
        from isotui.errors import IsotuiError
        from isotui.store.export import write_dicts_csv, write_rows_csv

        tab = self.active_tab()
        result = tab.result()
        if result is None:
            self.app.notify("nothing to export yet: run this tab's experiment (r)", severity="warning")
            return
        try:
            path = self.host.export_path(tab.KIND, "csv")
            rows = result.rows
            if rows and isinstance(rows[0], dict):
                write_dicts_csv(rows, path)
            else:
                write_rows_csv(rows, path)
        except IsotuiError as exc:
            self.app.notify(str(exc), severity="error")
            return
        self.app.notify(f"wrote {path}")
