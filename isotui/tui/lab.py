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
- Token types: ``isotui experiment token-types`` on the selected model, the token types carrying
  each layer's mean direction and top rogue dimension.

Each tab is a widget (:class:`~isotui.tui.lab_tab.LabTab`; Heads in ``lab_heads``, Dynamics in
``lab_dynamics``, Drift block in ``lab_drift``, Checkpoints in ``lab_checkpoints``, Token types in
``lab_types``) that owns its
state (the metric or figure shown, the head, the basis) and knows its experiment: run it, show its
result, export its table. The lab knows none of them: the experiment registry names each tab
(``Experiment.lab_tab``), and the lab composes its tabs, their keys and its help from what the
tabs declare (:mod:`isotui.tui.lab_tabs`). The screen's keys go to the tab shown. Jobs go
through the app's backend like layer runs (the jobs pane on the main screen shows them); results
come back to :meth:`LabScreen.refresh_all` on the UI thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingsMap
from textual.screen import Screen
from textual.widgets import Footer, Input, Static, TabbedContent

from isotui.tui.host import RGB, AppHost
from isotui.tui.lab_tab import LabTab
from isotui.tui.lab_tabs import lab_tabs, widget_key_rows

if TYPE_CHECKING:
    from isotui.tui.figure_export import ScreenFigure

# The lab's own keys, around the keys its tabs bring (each tab's key, then each tab's own keys).
OPENING_KEYS = (Binding("escape", "close", "Back", id="lab_close", tooltip="back to the layer view"),)
TAB_KEYS = (
    Binding("r", "run", "Run", id="lab_run", tooltip="run this tab's experiment"),
    Binding("m", "cycle", "Figure", id="lab_figure", tooltip="next metric or figure in this tab"),
)
SHARED_KEYS = (  # offered on the tabs whose LAB_KEYS take them
    Binding(
        "l",
        "log_counts",
        "Log",
        id="lab_log",
        tooltip="score histograms (Heads, Drift block Fig. 7): log or linear counts",
    ),
)
CLOSING_KEYS = (
    *SHARED_KEYS,
    Binding("e", "export", "CSV", id="lab_export", tooltip="CSV of this tab's table"),
    Binding("question_mark,f1", "help", "Help", id="lab_help", tooltip="the lab's keys"),
)
# keys the lab's widgets handle themselves, after the tabs' own (help)
LAB_WIDGET_KEYS = (
    ("enter", "in a settings box: run what it says (a mistake keeps the cursor there)"),
    ("tab, shift+tab", "move focus between a tab's settings box and its table"),
    ("mouse", "click a tab to show it, a row or cell to pick it"),
)


def lab_keys(tabs: list[type[LabTab]]) -> list[Binding]:
    """The lab screen's bindings: back, each tab's key, run and figure, each tab's own keys (once
    each), then the shared keys, export and help."""
    own: dict[str | None, Binding] = {}
    for tab in tabs:
        for binding in tab.KEYS:
            own.setdefault(binding.id, binding)
    return [*OPENING_KEYS, *(tab.binding() for tab in tabs), *TAB_KEYS, *own.values(), *CLOSING_KEYS]


def tab_actions(tabs: list[type[LabTab]]) -> dict[str, tuple[str, ...]]:
    """The actions only some tabs take, each with the ids of those tabs (a tab's own keys and the
    lab's shared keys it takes)."""
    actions: dict[str, list[str]] = {}
    for tab in tabs:
        for action in (*(b.action.partition("(")[0] for b in tab.KEYS), *tab.LAB_KEYS):
            if tab.tab_id() not in actions.setdefault(action, []):
                actions[action].append(tab.tab_id())
    for binding in SHARED_KEYS:
        actions.setdefault(binding.action, [])
    return {action: tuple(ids) for action, ids in actions.items()}


class LabScreen(Screen[None]):
    """The attention lab; see the module docstring. Esc goes back to the layer view. Its tabs and
    their keys come from the experiment registry (:mod:`isotui.tui.lab_tabs`)."""

    # the app keys that work in the lab too (shown in its help)
    APP_KEYS = ("options", "cancel", "screenshot", "figure", "theme", "quit")

    def __init__(self) -> None:
        super().__init__()
        self.tabs = lab_tabs()
        # The tab keys (1-5) are written on the tabs themselves, so the footer keeps to this tab's keys.
        self.keys = lab_keys(self.tabs)
        # a screen's own bindings (focus, copy) first, then the lab's, as for a class's BINDINGS
        own = BindingsMap(self.keys).key_to_bindings
        self._bindings = BindingsMap.from_keys({**self._bindings.key_to_bindings, **own})
        self.tab_actions = tab_actions(self.tabs)
        self.log_counts = False  # the score histograms (Heads, Drift block Fig. 7): log10 counts
        self.statuses: dict[str, str] = {}  # each tab's status line (shown with its tab only)

    @property
    def host(self) -> AppHost:
        return cast(AppHost, self.app)

    def compose(self) -> ComposeResult:
        with TabbedContent(id="lab-tabs"):
            for tab in self.tabs:
                yield tab(f"{tab.KEY} {tab.TITLE}", id=tab.tab_id())
        yield Static(id="lab-status")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        boxes = {tab.BOX for tab in self.tabs}
        for box, text in self.host.lab_inputs.items():  # what was typed last time (this run or the last)
            if f"#{box}" in boxes:  # (a box of a tab no longer registered: left alone)
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
        tabs = self.tab_actions.get(action)
        if tabs is not None and self.is_mounted:
            return self.tab in tabs
        return True

    if not TYPE_CHECKING:  # (hidden from the type checker: every other attribute stays checked)

        def __getattr__(self, name: str) -> Any:
            """``action_NAME`` of a key a tab brings (:attr:`LabTab.KEYS`): the shown tab's own."""
            action = name.removeprefix("action_")
            if action != name and action in self.__dict__.get("tab_actions", ()) and self.is_mounted:
                return getattr(self.active_tab(), name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @on(TabbedContent.TabActivated)
    def _tab_shown(self, _event: TabbedContent.TabActivated) -> None:
        self.refresh_bindings()
        self.query_one("#lab-status", Static).update(self.statuses.get(self.tab, ""))

    def action_help(self) -> None:
        from isotui.tui.help import HelpScreen

        host = self.host
        shared = [b for b in host.BINDINGS if b.id in self.APP_KEYS]
        keys = host.key_bindings(self.keys) + host.key_bindings(shared)
        tab_keys = ", ".join(tab.KEY for tab in self.tabs)
        empty_box = (
            tab_keys,
            "in an empty settings box: show that tab; once typed, digits are text (a space first types one)",
        )
        widget_keys = (*widget_key_rows(self.tabs), *LAB_WIDGET_KEYS, empty_box)
        self.app.push_screen(HelpScreen(keys, title="attention lab keys", widget_keys=widget_keys))

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
