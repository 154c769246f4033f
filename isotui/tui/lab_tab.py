"""The base of the attention lab's tabs: a tab is a widget that owns its state and knows its
experiment (run it, show its result, export its table); the lab screen's keys go to the tab shown.

A tab is found through the experiment registry: an experiment names its tab's class in its
``lab_tab`` field (``"module:attr"``), and the lab (:mod:`isotui.tui.lab_tabs`) composes its tabs,
their keys, their help lines and the app's result slots from what each tab declares below. Adding
a tab is its module and that field; no file of the app changes (a new tab styles its widgets in
its own ``DEFAULT_CSS``; the built-in tabs' rules are in ``app.tcss``, with ``.lab-charts`` for a
row of plots).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, cast

from textual import events, on
from textual.binding import Binding
from textual.widgets import DataTable, Input, TabPane

from isotui.tui.host import AppHost, LabHost

if TYPE_CHECKING:
    from isotui.spec import RunSpec
    from isotui.tui.figure_export import ScreenFigure


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


class SettingsBox(Input):
    """A tab's settings box. While it is empty, a digit that shows a tab does that (the box takes
    the cursor when a tab with nothing run is shown, so browsing the tabs by their keys would
    otherwise type into it); once anything is typed, digits are text. A value that starts with
    such a digit is typed after a space (the boxes split on spaces)."""

    def check_consume_key(self, key: str, character: str | None) -> bool:
        """An empty box leaves the digits to the screen's keys (the tab keys among them)."""
        if not self.value and character is not None and character.isdigit():
            return False
        return super().check_consume_key(key, character)

    async def _on_key(self, event: events.Key) -> None:
        character = event.character or ""
        if not self.value and character.isdigit() and character in self.screen.active_bindings:
            event.prevent_default()  # not typed: the key goes on to the lab's tab keys
            return
        await super()._on_key(event)


class LabTab(TabPane):
    """One tab of the lab: its experiment, its state, its view."""

    KIND = ""  # the experiment (its results in the app's ``lab_results``; its CSV's name)
    BOX: str | None = None  # its settings box, focused while nothing has run
    TABLE = ""  # its table, focused once something has
    # how the lab shows it: the key that shows it (tabs are ordered by it), its name (the tab's id
    # is ``tab-NAME``, its key's binding id ``lab_NAME``), its title, its key's footer label
    # and help line
    KEY = ""
    NAME = ""
    TITLE = ""
    SHORT = ""
    TOOLTIP = ""
    # keys of its own: bindings on the lab screen, offered while it is shown; each runs the tab's
    # ``action_...`` method
    KEYS: ClassVar[tuple[Binding, ...]] = ()
    # the lab's shared keys it takes (e.g. ``log_counts``: log or linear score histograms)
    LAB_KEYS: ClassVar[tuple[str, ...]] = ()
    # keys its widgets handle themselves, for the lab's help: (key, what it does)
    WIDGET_KEYS: ClassVar[tuple[tuple[str, str], ...]] = ()

    @classmethod
    def tab_id(cls) -> str:
        return f"tab-{cls.NAME}"

    @classmethod
    def binding(cls) -> Binding:
        """The key that shows this tab (written on the tab itself, so not in the footer)."""
        return Binding(
            cls.KEY,
            f"tab('{cls.tab_id()}')",
            cls.SHORT,
            id=f"lab_{cls.NAME}",
            show=False,
            tooltip=cls.TOOLTIP,
        )

    @classmethod
    def no_result(cls) -> Any:
        """Its slot in the app's ``lab_results`` before anything has run."""
        return None

    @classmethod
    def keep(cls, host: AppHost, result: Any) -> None:
        """Keep a finished job's result in its slot (the lab need not be open)."""
        host.lab_results[cls.KIND] = result

    @classmethod
    def ready(cls, result: Any) -> str:
        """What the lab's status line says when a result arrives."""
        return f"{cls.KIND} ready"

    @property
    def host(self) -> AppHost:
        return cast(AppHost, self.app)

    @property
    def lab(self) -> LabHost:
        return cast("LabHost", self.screen)

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


class PerModelLabTab(LabTab):
    """A lab tab that runs its experiment on the selected model (``r``), keeps each model's result
    (the tab shows the selected model's) and selects the model of a result that arrives: the
    heads and the token types."""

    def request(self, spec: RunSpec) -> Any:
        """The job ``r`` submits for the selected model's run settings ``spec``."""
        raise NotImplementedError

    def run(self) -> bool:
        from isotui.errors import IsotuiError

        host = self.host
        if not host.selected:
            host.notify("select a model on the main screen first", severity="warning")
            return False
        try:
            spec = host.spec_for(host.selected)
        except IsotuiError as exc:
            host.notify(str(exc), severity="error")
            return False
        host.submit_request(self.request(spec))
        self.lab.status(f"queued {self.KIND} of {host.selected} (jobs: main screen)")
        return True

    @classmethod
    def no_result(cls) -> dict[str, Any]:
        return {}  # per model

    @classmethod
    def keep(cls, host: AppHost, result: Any) -> None:
        host.lab_results[cls.KIND][result.model] = result
        host.selected = result.model

    @classmethod
    def ready(cls, result: Any) -> str:
        return f"{cls.KIND} ready" + (" (from the cache)" if result.from_cache else "")

    def result(self) -> Any:
        return self.host.lab_results[self.KIND].get(self.host.selected or "")
