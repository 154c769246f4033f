"""The help screen: every key as currently bound (remapped keys included), and what it does."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

# Keys the widgets themselves handle (not remappable from the settings file).
WIDGET_KEYS = (
    ("↑ ↓, page up/down", "move in the focused list or table"),
    ("enter", "models: run a model, run a preset's models, open a cached run"),
    ("tab, shift+tab", "move focus: filter box, models, layer table, jobs"),
    ("← →", "layer table: pick the column that {sort} sorts by"),
    ("ctrl+p", "command palette: every action by name"),
    ("mouse", "click to focus or pick; click a layer-table header to sort"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape,q,question_mark,f1", "close", "Close", id="help_close"),
    ]

    def __init__(self, keys: list[tuple[str, str, str]], sort_key: str = "s") -> None:
        """``keys``: (key, action id, description) of the app's bindings as bound now."""
        super().__init__()
        self.keys = keys
        self.sort_key = sort_key

    def rows(self) -> list[tuple[str, str, str]]:
        """(key, id, what) for every app key, then the widgets' own keys."""
        widget = [(key, "", what.format(sort=self.sort_key)) for key, what in WIDGET_KEYS]
        return [*self.keys, *widget]

    def compose(self) -> ComposeResult:
        # A Rich table in a Static: its cells wrap, so nothing is cut on an 80-column terminal.
        table = Table(box=None, header_style="bold", expand=True, pad_edge=False)
        table.add_column("key", no_wrap=True)
        table.add_column("id", no_wrap=True)
        table.add_column("what it does", ratio=1)
        for row in self.rows():
            table.add_row(*row)
        with VerticalScroll(id="help-box"):
            yield Static(Text("isotui keys (esc closes; remap them in the settings file's [keys] by id)"))
            yield Static(table, id="help-keys")

    def action_close(self) -> None:
        self.dismiss(None)
