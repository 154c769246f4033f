"""The base of the attention lab's tabs: a tab is a widget that owns its state and knows its
experiment (run it, show its result, export its table); the lab screen's keys go to the tab shown."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from textual import on
from textual.widgets import DataTable, Input, TabPane

from isotui.tui.host import AppHost

if TYPE_CHECKING:
    from isotui.tui.figure_export import ScreenFigure
    from isotui.tui.lab import LabScreen


def fmt(value: float | None, digits: int = 3) -> str:
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
        return cast("LabScreen", self.screen)

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

    def figure(self) -> ScreenFigure | str:
        """The app's ``F``: what this tab's plot shows as a figure, or why there is none."""
        return "this tab has no plot to save"

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
        from isotui.experiments.series import resolve_checkpoints

        host = self.host
        try:
            checkpoints = resolve_checkpoints(
                host.selected, [text], notice=lambda said: host.notify(said, severity="warning")
            )
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
