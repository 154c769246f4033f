"""The help screen: every key as currently bound (remapped keys included), and what it does."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

# Keys the widgets themselves handle (not remappable from the settings file).
WIDGET_KEYS = (
    ("up / down, page up / down", "move in the focused list or table"),
    ("enter", "models list: run the highlighted model, or every model of a preset"),
    ("tab / shift+tab", "move focus: model box, models, layer table, jobs"),
    ("left / right", "layer table: pick the column that s sorts by"),
    ("ctrl+p", "command palette: every action by name"),
    ("mouse", "click to focus or select; click a layer-table header to sort"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape,q,question_mark,f1", "close", "Close", id="help_close"),
    ]

    def __init__(self, keys: list[tuple[str, str, str]]) -> None:
        """``keys``: (key, action id, description) of the app's bindings as bound now."""
        super().__init__()
        self.keys = keys

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static("isotui keys (esc closes; remap them in the settings file's [keys])")
            table = DataTable(id="help-keys", cursor_type="none", zebra_stripes=True)
            table.add_columns("key", "id", "what it does")
            for key, action_id, what in self.keys:
                table.add_row(key, action_id, what)
            for key, what in WIDGET_KEYS:
                table.add_row(key, "", what)
            yield table

    def action_close(self) -> None:
        self.dismiss(None)
