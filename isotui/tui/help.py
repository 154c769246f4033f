"""The help screen: each screen's keys as currently bound (remapped keys included), and what they do.

Help is per screen: the main screen lists its keys, the attention lab its own (plus the app keys
that still work there, and its widgets' keys: :mod:`isotui.tui.lab`), each with the keys its
widgets handle themselves.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

# Keys the main screen's widgets handle themselves (not remappable from the settings file).
WIDGET_KEYS = (
    ("↑ ↓, page up/down", "move in the focused list or table"),
    ("enter", "models: run a model, run a preset's models, open a cached run"),
    ("tab, shift+tab", "move focus: filter box, models, layer table, jobs"),
    ("← →", "layer table: pick the column that {sort} sorts by"),
    ("ctrl+p", "command palette: every action by name"),
    ("mouse", "click to focus or pick; click a layer-table header to sort"),
)


def binding_rows(
    app: App[Any], bindings: list[Binding], keymap: dict[str, str]
) -> list[tuple[str, str, str]]:
    """(key as bound now, id, what it does) for ``bindings``, remaps in ``keymap`` included."""
    out = []
    for b in bindings:
        keys = keymap.get(b.id or "", b.key)
        shown = ", ".join(app.get_key_display(Binding(k.strip(), b.action)) for k in keys.split(","))
        out.append((shown, b.id or "", b.tooltip or b.description))
    return out


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[Binding]] = [  # type: ignore[assignment]  # Bindings only
        Binding("escape,q,question_mark,f1", "close", "Close", id="help_close"),
    ]

    def __init__(
        self,
        keys: list[tuple[str, str, str]],
        sort_key: str = "s",
        *,
        title: str = "isotui keys",
        widget_keys: tuple[tuple[str, str], ...] = WIDGET_KEYS,
        columns: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """``keys``: (key, action id, description) of the screen's bindings as bound now;
        ``columns``: (header, what it is) of the screen's table, whose short headers (``erank``,
        ``xctx``) are explained nowhere else on screen."""
        super().__init__()
        self.keys = keys
        self.sort_key = sort_key
        self.title = title
        self.widget_keys = widget_keys
        self.columns = columns

    def rows(self) -> list[tuple[str, str, str]]:
        """(key, id, what) for every key of the screen, then its widgets' own keys."""
        widget = [(key, "", what.format(sort=self.sort_key)) for key, what in self.widget_keys]
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
            yield Static(Text(f"{self.title} (esc closes; remap them in the settings file's [keys] by id)"))
            yield Static(table, id="help-keys")
            if self.columns:
                legend = Table(box=None, header_style="bold", expand=True, pad_edge=False)
                legend.add_column("column", no_wrap=True)
                legend.add_column("what it shows", ratio=1)
                for header, what in self.columns:
                    legend.add_row(header, what)
                yield Static(
                    Text("\nthe layer table's columns (What is measured in the docs has each formula)")
                )
                yield Static(legend, id="help-columns")

    def on_mount(self) -> None:
        self.query_one("#help-box").focus()  # ↑ ↓ and page keys scroll what an 80x24 screen cuts

    def action_close(self) -> None:
        self.dismiss(None)
