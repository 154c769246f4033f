"""The lab's Token types tab: ``isotui experiment token-types`` on the selected model: per layer,
the token types that carry its mean direction and its top rogue dimension (the layer table, one
row per layer, its two or three largest carriers each), and the layer under the cursor in full
(its top types of each direction: share, count, share of the tokens). ``m`` shows the carriers'
shares as they are or divided by their share of the tokens (above 1: a type carries more than its
count)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import DataTable, Static

from isotui.render import shorten
from isotui.tui.lab_tab import PerModelLabTab
from isotui.tui.lab_tab import fmt as _f

if TYPE_CHECKING:
    from isotui.experiments.token_types import LayerTypes, TypeRow
    from isotui.spec import RunSpec

# types per direction in the layer table (the detail below lists them all): two in 80 columns,
# three from WIDE columns on
CARRIERS, WIDE = (2, 3), 110
VIEWS = ("share", "share ÷ share of tokens")  # what the layer table's numbers are (m: the next)


def token_text(row: TypeRow) -> Text:
    """A type as the CLI's table writes it (``'the'``), never read as markup (``[CLS]``)."""
    return Text(repr(row.token))


def lift(row: TypeRow) -> float:
    """A type's share over its share of the tokens (NaN where it has none)."""
    return row.share / row.freq_share if row.freq_share else math.nan


def carriers(rows: list[TypeRow], view: int, shown: int) -> Text:
    """A layer table cell: its ``shown`` largest carriers with their share (or lift),
    ``'the' 0.31  ',' 0.12``."""
    text = Text()
    for row in rows[:shown]:
        if text:
            text.append("  ")
        text.append(repr(row.token), style="bold")
        value = row.share if view == 0 else lift(row)
        text.append(f" {_f(value, 2 if view == 0 else 1)}")
    return text


class TypesTab(PerModelLabTab):
    """The token types carrying each layer's mean direction and top rogue dimension."""

    KIND = "token-types"
    TABLE = "#types-layers"
    KEY, NAME, TITLE, SHORT = "5", "types", "Token types", "Types"
    TOOLTIP = "tab: the token types carrying each layer's mean direction and top rogue dimension"
    WIDGET_KEYS = (("↑ ↓", "the layer whose token types show in full"),)
    DEFAULT_CSS = """
    #types-info { height: auto; max-height: 2; color: $text-muted; }
    #types-layers {
        height: 1fr;
        min-height: 4;
        border-top: solid $primary-darken-2;
        border-title-align: left;
    }
    #types-layers:focus { border-top: solid $accent; }
    #types-detail { height: auto; }
    #types-mean, #types-rogue {
        width: 1fr;
        height: auto;
        border-top: solid $primary-darken-2;
        border-title-align: left;
    }
    #types-rogue { border-left: solid $primary-darken-2; }
    """

    def __init__(self, title: str, *, id: str) -> None:
        super().__init__(title, id=id)
        self.metric = 0  # which of VIEWS the layer table shows
        self.groups: list[LayerTypes] = []  # the shown result's rows, per layer
        self.drawn_with = 0  # the carriers per direction the layer table was drawn with

    def compose(self) -> ComposeResult:
        yield Static(id="types-info")
        layers: DataTable[Any] = DataTable(id="types-layers", cursor_type="row", zebra_stripes=True)
        layers.add_columns("layer", "mean direction: carriers", "rogue dim", "its carriers")
        yield layers
        with Horizontal(id="types-detail"):
            for name in ("mean", "rogue"):
                detail: DataTable[Any] = DataTable(id=f"types-{name}", cursor_type="none", zebra_stripes=True)
                detail.add_columns("#", "token", "share", "count", "of tokens")
                yield detail

    def show(self) -> None:
        from isotui.experiments.token_types import by_layer

        result = self.result()
        info = self.query_one("#types-info", Static)
        table = self.query_one("#types-layers", DataTable)
        row = table.cursor_row
        table.clear()
        self.groups = by_layer(result.rows) if result is not None else []
        if result is None:
            who = self.host.selected or "no model selected (pick one on the main screen)"
            info.update(
                f"{who}: press r for the token types carrying each layer's mean direction and top "
                "rogue dimension"
            )
            table.border_title = None
            self.show_layer()
            return
        meta = result.meta
        source = "cache" if result.from_cache else f"{meta.get('seconds', 0):.1f} s"
        info.update(
            f"{shorten(result.model, 40)} · {meta.get('data')} · {meta.get('n_samples')} samples · "
            f"{source} · share: a type's part of the direction (all types' sum to 1); of tokens: "
            "its part of the tokens"
        )
        many = len({layer.component for layer in self.groups}) > 1
        shown = self.drawn_with = self.carriers_shown()
        for layer in self.groups:
            table.add_row(
                Text((f"{layer.component} " if many else "") + str(layer.layer), justify="right"),
                carriers(layer.mean, self.metric, shown),
                Text("-" if layer.rogue_dim is None else str(layer.rogue_dim), justify="right"),
                carriers(layer.rogue, self.metric, shown),
            )
        table.border_title = (
            f"per layer, the {shown} largest carriers' {VIEWS[self.metric]} (m: {VIEWS[1 - self.metric]})"
        )
        if self.groups:
            table.move_cursor(row=min(row, len(self.groups) - 1))
        self.show_layer()

    def show_layer(self) -> None:
        """The detail tables: the layer under the cursor's carriers of each direction."""
        table = self.query_one("#types-layers", DataTable)
        layer = self.groups[table.cursor_row] if 0 <= table.cursor_row < len(self.groups) else None
        for name in ("mean", "rogue"):
            detail = self.query_one(f"#types-{name}", DataTable)
            detail.clear()
            if layer is None:
                detail.border_title = "mean direction" if name == "mean" else "top rogue dimension"
                continue
            where = (f"{layer.component} " if layer.component != "model" else "") + f"layer {layer.layer}"
            detail.border_title = (
                f"{where}: mean direction" if name == "mean" else f"{where}: rogue dim {layer.rogue_dim}"
            )
            for row in layer.mean if name == "mean" else layer.rogue:
                detail.add_row(
                    str(row.rank),
                    token_text(row),
                    Text(_f(row.share), justify="right"),
                    Text(str(row.count), justify="right"),
                    Text(_f(row.freq_share), justify="right"),
                )

    def carriers_shown(self) -> int:
        """How many carriers per direction the layer table has room for (the terminal's width)."""
        return CARRIERS[1] if self.app.size.width >= WIDE else CARRIERS[0]

    def on_resize(self) -> None:
        """Redrawn when the room for carriers changes (a terminal made wider or narrower)."""
        if self.result() is not None and self.carriers_shown() != self.drawn_with:
            # after the resize is laid out: redrawn within it, the table kept its old column widths
            self.call_after_refresh(self.show)

    @on(DataTable.RowHighlighted, "#types-layers")
    def _row(self, _event: DataTable.RowHighlighted) -> None:
        self.show_layer()

    def request(self, spec: RunSpec) -> Any:
        from isotui.experiments.token_types import TokenTypesRequest

        return TokenTypesRequest(spec)

    def cycle(self) -> None:
        self.metric = 1 - self.metric
        self.show()
