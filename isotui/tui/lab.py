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

Jobs go through the app's backend like layer runs (the jobs pane on the main screen shows them);
results come back to :meth:`LabScreen.show` on the UI thread.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static, TabbedContent, TabPane
from textual_plotext import PlotextPlot

from isotui.render import shorten
from isotui.tui.plots import FitPlot

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


def _f(value: float, digits: int = 3) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


class LabScreen(Screen):
    """The attention lab; see the module docstring. Esc goes back to the layer view."""

    # The tab keys 1-4 are written on the tabs themselves, so the footer keeps to this tab's keys.
    BINDINGS: ClassVar[list[Binding]] = [
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
        self.head_metric = 0
        self.dyn_metric = 0
        self.head = 0
        self.basis = 0
        self.log_counts = False

    def compose(self) -> ComposeResult:
        with TabbedContent(id="lab-tabs"):
            with TabPane("1 Heads", id="tab-heads"):
                yield Static(id="heads-info")
                yield DataTable(id="heads-table", cursor_type="row", zebra_stripes=True)
                with Horizontal(classes="lab-charts"):
                    yield FitPlot(id="heads-plot")
                    yield FitPlot(id="hist-plot")
            with TabPane("2 Dynamics", id="tab-dynamics"):
                yield Input(
                    placeholder="checkpoints: step1000 step2000 (revisions of the selected model), "
                    "model ids, or folders; enter runs",
                    id="dyn-input",
                )
                yield DataTable(id="dyn-table", cursor_type="cell", zebra_stripes=True)
                with Horizontal(classes="lab-charts"):
                    yield FitPlot(id="dyn-plot")
                    yield FitPlot(id="dyn-lines")
            with TabPane("3 Drift block", id="tab-drift"):
                yield from self.compose_drift()
            with TabPane("4 Checkpoints", id="tab-ckpt"):
                from isotui.tui.lab_checkpoints import compose_checkpoints

                yield from compose_checkpoints()
        yield Static(id="lab-status")
        yield Footer(compact=True, show_command_palette=False)

    def compose_drift(self) -> ComposeResult:
        from isotui.tui.lab_drift import compose_drift

        yield from compose_drift()

    def on_mount(self) -> None:
        app: Any = self.app
        for box, text in app.lab_inputs.items():  # what was typed last time (this run or the last)
            self.query_one(f"#{box}", Input).value = text
        self.query_one("#heads-table", DataTable).add_columns(
            "layer", "heads", "cos(Qm,Km)", "range", "Qm·Km", "|Qm|", "|Km|", "p max", "p med", "entropy"
        )
        self.refresh_all()

    # -- state from the app ------------------------------------------------------------------

    @property
    def tab(self) -> str:
        return self.query_one("#lab-tabs", TabbedContent).active

    def refresh_all(self) -> None:
        self.show_heads()
        self.show_dynamics()
        from isotui.tui.lab_checkpoints import show_checkpoints
        from isotui.tui.lab_drift import show_drift

        show_drift(self)
        show_checkpoints(self)

    def status(self, text: str) -> None:
        self.query_one("#lab-status", Static).update(text)

    # -- heads ---------------------------------------------------------------------------------

    def heads_result(self):
        app: Any = self.app
        return app.lab_results["attention"].get(app.selected or "")

    def show_heads(self) -> None:
        from isotui.experiments.attention import summarize

        app: Any = self.app
        result = self.heads_result()
        info = self.query_one("#heads-info", Static)
        table = self.query_one("#heads-table", DataTable)
        table.clear()
        if result is None:
            who = app.selected or "no model selected (pick one on the main screen)"
            info.update(f"{who}: press r to measure queries, keys and attention per layer and head")
            self.plot_heads(None, [])
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
        self.plot_heads(result, summary)

    def plot_heads(self, result, summary) -> None:
        from isotui.figures import draw_histogram

        plot = self.query_one("#heads-plot", PlotextPlot)
        hist = self.query_one("#hist-plot", PlotextPlot)
        for p in (plot, hist):
            p.plt.clear_data()
            p.plt.clear_figure()
        attr, name = HEAD_METRICS[self.head_metric]
        colours = self.app_colours()
        if result is None:
            plot.plt.title(f"{name} per layer: run the attention experiment (r)")
            hist.plt.title("pre-softmax scores of a layer")
        else:
            sites = [s for s in summary if s.attention == "self"]
            xs = list(range(1, len(sites) + 1))
            plot.plt.title(f"{name} by layer (dots: heads)")
            heads_x, heads_y = [], []
            for i, s in enumerate(sites):
                for r in result.rows:
                    if (r.component, r.layer, r.attention) == (s.component, s.layer, s.attention):
                        v = getattr(r, attr)
                        if math.isfinite(v):
                            heads_x.append(i + 1)
                            heads_y.append(v)
            plot.plt.scatter(heads_x, heads_y, color=colours[1], marker="dot")
            plot.plt.plot(xs, [getattr(s, attr) for s in sites], color=colours[0], marker="braille")
            if len(xs) > 1:
                step = max(1, -(-len(xs) // 8))
                plot.plt.xticks(xs[::step], [str(x) for x in xs[::step]])
            row = self.query_one("#heads-table", DataTable).cursor_row
            row = min(max(row, 0), len(summary) - 1)
            edges = np.asarray(result.meta["score_edges"])
            s = summary[row]
            draw_histogram(
                hist.plt,
                result.arrays[f"hist.{row}"].sum(0),
                edges,
                colours[0],
                f"QKᵀ/√d, layer {s.layer}{' (cross)' if s.attention == 'cross' else ''}, all heads",
                log=self.log_counts,
            )
        plot.refresh()
        hist.refresh()

    @on(DataTable.RowHighlighted, "#heads-table")
    def _heads_row(self, _event) -> None:
        from isotui.experiments.attention import summarize

        result = self.heads_result()
        if result is not None:
            self.plot_heads(result, summarize(result))

    # -- dynamics ------------------------------------------------------------------------------

    def dyn_result(self):
        app: Any = self.app
        return app.lab_results.get("qk-dynamics")

    def show_dynamics(self) -> None:
        result = self.dyn_result()
        table = self.query_one("#dyn-table", DataTable)
        table.clear(columns=True)
        if result is None:
            self.plot_dynamics()
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
        self.plot_dynamics()

    def dyn_site(self, result) -> int:
        col = self.query_one("#dyn-table", DataTable).cursor_column - 2
        return min(max(col, 0), len(result.sites) - 1)

    def plot_dynamics(self) -> None:
        from isotui.figures import draw_layer_series, draw_trajectory

        result = self.dyn_result()
        traj = self.query_one("#dyn-plot", PlotextPlot)
        lines = self.query_one("#dyn-lines", PlotextPlot)
        for p in (traj, lines):
            p.plt.clear_data()
            p.plt.clear_figure()
        colours = self.app_colours()
        if result is None:
            traj.plt.title("Q-mean and K-mean along training: give checkpoints above")
            lines.plt.title("per-layer curves over checkpoints")
        else:
            site = self.dyn_site(result)
            heads = sorted(
                {r.head for r in result.rows if (r.component, r.layer, r.attention) == result.sites[site]}
            )
            self.head = min(self.head, len(heads) - 1)
            draw_trajectory(
                traj.plt, result, site, heads[self.head], BASES[self.basis], (colours[0], colours[1])
            )
            attr, name = DYN_METRICS[self.dyn_metric]
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
    def _dyn_cell(self, _event) -> None:
        self.plot_dynamics()

    @on(DataTable.RowHighlighted, "#drift-table")
    def _drift_row(self, _event) -> None:
        from isotui.tui.lab_drift import plot_drift

        plot_drift(self)

    @on(Input.Changed, "#dyn-input, #drift-input, #ckpt-input")
    def _box_changed(self, event: Input.Changed) -> None:
        app: Any = self.app
        app.lab_inputs[event.input.id or ""] = event.value

    @on(Input.Submitted, "#dyn-input, #drift-input, #ckpt-input")
    def _box_submitted(self, _event: Input.Submitted) -> None:
        app: Any = self.app
        app.save_session()

    # Enter in a settings box: queued, the table takes the cursor (the tab's keys work again);
    # refused, the cursor stays in the box (the next keys edit it, they fire no hotkey).

    @on(Input.Submitted, "#drift-input")
    def _drift_submit(self, _event) -> None:
        from isotui.tui.lab_drift import run_drift

        if run_drift(self):
            self.query_one("#drift-table", DataTable).focus()

    @on(Input.Submitted, "#ckpt-input")
    def _ckpt_submit(self, event: Input.Submitted) -> None:
        from isotui.tui.lab_checkpoints import run_checkpoints

        if run_checkpoints(self, event.value):
            self.query_one("#ckpt-table", DataTable).focus()

    @on(Input.Submitted, "#dyn-input")
    def _dyn_submit(self, event: Input.Submitted) -> None:
        if self.run_dynamics(event.value):
            self.query_one("#dyn-table", DataTable).focus()

    def run_dynamics(self, text: str) -> bool:
        from isotui.experiments.qk_dynamics import DEFAULT_SAMPLE
        from isotui.experiments.requests import DynamicsRequest

        return self.submit_series(text, lambda *args: DynamicsRequest(*args, DEFAULT_SAMPLE), "qk-dynamics")

    def submit_series(self, text: str, make_request, what: str) -> bool:
        """Queue ``make_request(series, checkpoints, spec)`` for the checkpoints typed in ``text``
        (a bad series is one sentence); the series is named after the selected model when every
        checkpoint is one of its revisions."""
        from isotui.errors import IsotuiError
        from isotui.experiments.qk_dynamics import resolve_checkpoints

        app: Any = self.app
        try:
            checkpoints = resolve_checkpoints(app.selected, [text])
            spec = app.spec_for(checkpoints[0].model)
        except IsotuiError as exc:
            from isotui.tui.wording import in_box_terms

            app.notify(in_box_terms(str(exc)), severity="error")
            return False
        prefix = f"{app.selected}@"
        series = (
            app.selected if app.selected and all(c.model.startswith(prefix) for c in checkpoints) else None
        )
        app.submit_request(make_request(series, tuple(checkpoints), spec))
        self.status(f"queued {what} over {len(checkpoints)} checkpoints (jobs: main screen)")
        return True

    # -- actions -------------------------------------------------------------------------------

    def app_colours(self) -> list:
        app: Any = self.app
        return [*app.model_colours(), (200, 200, 200)]

    def action_close(self) -> None:
        self.app.pop_screen()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A key that only one tab uses is offered (and works) in that tab only."""
        tabs = self.TAB_ACTIONS.get(action)
        if tabs is not None and self.is_mounted:
            return self.tab in tabs
        return True

    @on(TabbedContent.TabActivated)
    def _tab_shown(self, _event) -> None:
        self.refresh_bindings()

    def action_help(self) -> None:
        from isotui.tui.help import LAB_WIDGET_KEYS, HelpScreen

        app: Any = self.app
        shared = [b for b in app.BINDINGS if b.id in self.APP_KEYS]
        keys = app.key_bindings(self.BINDINGS) + app.key_bindings(shared)
        self.app.push_screen(HelpScreen(keys, title="attention lab keys", widget_keys=LAB_WIDGET_KEYS))

    def action_log_counts(self) -> None:
        from isotui.tui.lab_drift import plot_drift

        self.log_counts = not self.log_counts
        if self.tab == "tab-heads":
            self.show_heads()
        else:
            plot_drift(self)
        self.status(f"score histograms: {'log10' if self.log_counts else 'linear'} counts")

    def action_run(self) -> None:
        from isotui.errors import IsotuiError
        from isotui.experiments.requests import AttentionRequest

        app: Any = self.app
        tab = self.tab
        if tab == "tab-dynamics":
            self.run_dynamics(self.query_one("#dyn-input", Input).value)
            return
        if tab == "tab-drift":
            from isotui.tui.lab_drift import run_drift

            run_drift(self)
            return
        if tab == "tab-ckpt":
            from isotui.tui.lab_checkpoints import run_checkpoints

            run_checkpoints(self, self.query_one("#ckpt-input", Input).value)
            return
        if not app.selected:
            self.app.notify("select a model on the main screen first", severity="warning")
            return
        try:
            spec = app.spec_for(app.selected)
        except IsotuiError as exc:
            self.app.notify(str(exc), severity="error")
            return
        app.submit_request(AttentionRequest(spec))
        self.status(f"queued attention of {app.selected} (jobs: main screen)")

    def action_cycle(self) -> None:
        tab = self.tab
        if tab == "tab-heads":
            self.head_metric = (self.head_metric + 1) % len(HEAD_METRICS)
            self.show_heads()
        elif tab == "tab-dynamics":
            self.dyn_metric = (self.dyn_metric + 1) % len(DYN_METRICS)
            self.plot_dynamics()
        elif tab == "tab-ckpt":
            from isotui.tui.lab_checkpoints import show_checkpoints

            self.ckpt_metric = getattr(self, "ckpt_metric", 0) + 1
            show_checkpoints(self)
        else:
            from isotui.tui.lab_drift import cycle_drift

            cycle_drift(self)

    def action_tab(self, tab: str) -> None:
        """Show ``tab``; a tab with nothing run yet puts the cursor in its settings box."""
        self.query_one("#lab-tabs", TabbedContent).active = tab
        app: Any = self.app
        if tab == "tab-dynamics":
            target = "#dyn-input" if app.lab_results.get("qk-dynamics") is None else "#dyn-table"
        elif tab == "tab-drift":
            target = "#drift-input" if app.lab_results.get("drift-block") is None else "#drift-table"
        elif tab == "tab-ckpt":
            target = "#ckpt-input" if app.lab_results.get("checkpoints") is None else "#ckpt-table"
        else:
            target = "#heads-table"
        self.call_after_refresh(self.query_one(target).focus)  # once the tab is shown

    def action_head(self, delta: int) -> None:
        self.head = max(0, self.head + delta)
        self.plot_dynamics()

    def action_basis(self) -> None:
        self.basis = (self.basis + 1) % len(BASES)
        self.plot_dynamics()

    def action_export(self) -> None:
        from isotui.errors import IsotuiError
        from isotui.store.export import write_dicts_csv, write_rows_csv

        app: Any = self.app
        tab = self.tab
        if tab == "tab-heads":
            result, what = self.heads_result(), "attention"
        elif tab == "tab-dynamics":
            result, what = self.dyn_result(), "qk-dynamics"
        elif tab == "tab-ckpt":
            result, what = app.lab_results.get("checkpoints"), "checkpoints"
        else:
            result, what = app.lab_results.get("drift-block"), "drift-block"
        if result is None:
            self.app.notify("nothing to export yet: run this tab's experiment (r)", severity="warning")
            return
        try:
            path = app.export_path(what, "csv")
            rows = result.rows
            if rows and isinstance(rows[0], dict):
                write_dicts_csv(rows, path)
            else:
                write_rows_csv(rows, path)
        except IsotuiError as exc:
            self.app.notify(str(exc), severity="error")
            return
        self.app.notify(f"wrote {path}")
