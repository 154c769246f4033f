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

Each tab is a widget (:class:`~isotui.tui.lab_tab.LabTab`; Heads in ``lab_heads``, Dynamics in
``lab_dynamics``, Checkpoints in ``lab_checkpoints``, Drift block here, its view in ``lab_drift``)
that owns its state (the metric or figure shown, the head, the basis) and knows its experiment:
run it, show its result, export its table. The screen's keys go to the tab shown. Jobs go
through the app's backend like layer runs (the jobs pane on the main screen shows them); results
come back to :meth:`LabScreen.refresh_all` on the UI thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static, TabbedContent

from isotui.tui.host import RGB, AppHost
from isotui.tui.lab_checkpoints import CheckpointsTab
from isotui.tui.lab_dynamics import DynamicsTab
from isotui.tui.lab_heads import HeadsTab
from isotui.tui.lab_tab import LabTab

if TYPE_CHECKING:
    from isotui.tui.figure_export import ScreenFigure


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

    def figure(self) -> ScreenFigure | str:
        """The drift block's figure on screen as ``isotui figure godey2024-fig6`` ... ``fig10`` draw it
        (Figs. 7 and 9 at the table cursor's N, as ``--at-norm``)."""
        from textual.widgets import DataTable

        from isotui.tui.figure_export import ScreenFigure

        result = self.result()
        if result is None:
            return "no plot to save yet: run the drift block (r)"
        shown = self.lab.drift_figure
        norms = result.norms.tolist()
        row = min(max(self.lab.query_one("#drift-table", DataTable).cursor_row, 0), len(norms) - 1)
        draw, options = DRIFT_FIGURES[shown], {}
        if shown in (1, 3):
            options["at_norm"] = repr(float(norms[row]))
        return ScreenFigure(f"drift-block-fig{6 + shown}", draw, [result], options)


# the drift block tab's figures (lab_drift.FIGURES, in order) as isotui figure draws them
DRIFT_FIGURES = (
    "isotui.paper_figures:draw_drift_block",
    "isotui.paper_figures_probes:draw_scores",
    "isotui.paper_figures_probes:draw_qk",
    "isotui.paper_figures_probes:draw_softmax",
    "isotui.paper_figures_probes:draw_softmax_extremes",
)


HEAD_KEYS = Binding.Group("Head", compact=True)


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
        # one footer entry for both (``[] Head``): the Dynamics footer was cut at 80 columns
        Binding(
            "left_square_bracket",
            "head(-1)",
            "Head-",
            id="lab_head_prev",
            tooltip="Dynamics: previous head",
            group=HEAD_KEYS,
        ),
        Binding(
            "right_square_bracket",
            "head(1)",
            "Head+",
            id="lab_head_next",
            tooltip="Dynamics: next head",
            group=HEAD_KEYS,
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
    APP_KEYS = ("options", "cancel", "screenshot", "figure", "theme", "quit")
    TAB_ACTIONS: ClassVar[dict[str, tuple[str, ...]]] = {
        "head": ("tab-dynamics",),
        "basis": ("tab-dynamics",),
        "log_counts": ("tab-heads", "tab-drift"),
    }

    def __init__(self) -> None:
        super().__init__()
        self.log_counts = False  # the score histograms (Heads, Drift block Fig. 7): log10 counts
        self.drift_figure = 0  # the Drift block tab's figure (kept by isotui.tui.lab_drift)
        self.statuses: dict[str, str] = {}  # each tab's status line (shown with its tab only)

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

    def status(self, text: str, kind: str | None = None) -> None:
        """The status line of the tab of experiment ``kind`` (else of the tab shown): each tab
        has its own, so "qk-dynamics ready" does not stay on the Heads tab."""
        tab = next((t.id for t in self.query(LabTab) if kind == t.KIND), None) if kind else None
        tab = tab or self.tab
        self.statuses[tab] = text
        if tab == self.tab:
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
        self.query_one("#lab-status", Static).update(self.statuses.get(self.tab, ""))

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

    def screen_figure(self) -> ScreenFigure | str:
        """The app's ``F``: the figure of the tab shown (or why it has none)."""
        return self.active_tab().figure()

    def action_export(self) -> None:
        from isotui.errors import IsotuiError
        from isotui.store.export import write_dicts_csv, write_rows_csv

        tab = self.active_tab()
        result = tab.result()
        if result is None:
            self.app.notify("nothing to export yet: run this tab's experiment (r)", severity="warning")
            return
        rows = result.rows
        write = write_dicts_csv if rows and isinstance(rows[0], dict) else write_rows_csv
        try:
            where = self.host.export_file(tab.KIND, "csv", lambda path: write(rows, path))
        except IsotuiError as exc:
            self.app.notify(str(exc), severity="error")
            return
        self.app.notify(where)
