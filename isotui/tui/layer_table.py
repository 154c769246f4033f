"""The per-layer table: the headless table's columns, sortable, each cell shaded by its value.

Shading runs per column from the theme's surface colour (the column's lowest value) towards its
primary colour (the highest), so a layer that stands out reads at a glance, in any theme; under
NO_COLOR Textual turns the shades into greys, which still order.
"""

from __future__ import annotations

import math

from rich.style import Style
from rich.text import Text
from textual.color import Color
from textual.widgets import DataTable

from isotui.render import COLUMNS, Column, amount, layer_columns, null_note
from isotui.results import METRIC, ModelResult

SHADE_MAX = 0.55  # the strongest blend towards the primary colour: text stays readable
UNSHADED = tuple(c.field for c in COLUMNS if c.field not in METRIC)  # the layer and its count


def column_range(values: list[float]) -> tuple[float, float] | None:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return (min(finite), max(finite)) if finite else None


def shade_fraction(value: float, bounds: tuple[float, float] | None) -> float | None:
    """Where ``value`` lies between the column's lowest and highest value (0..1); None: no shade."""
    if bounds is None or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    low, high = bounds
    return 0.5 if high == low else (value - low) / (high - low)


class LayerTable(DataTable):
    """Press the sort key on a column (or click its header) to sort; again to reverse."""

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="cell", zebra_stripes=False, **kwargs)
        self.result: ModelResult | None = None
        self.sort_field: str | None = None
        self.sort_reverse = False
        self._theme = ""
        self._drawn = False  # redraw() has run since mount
        self.shown_columns: list[Column] = list(COLUMNS)  # with the result's plug-in columns, if any

    def on_mount(self) -> None:
        for c in COLUMNS:  # the same columns as the headless table
            self.add_column(c.header, key=c.field)

    def _set_columns(self, columns: list[Column]) -> None:
        """The columns of the result shown: the built-in ones, then its plug-in metrics' columns
        (isotui.core.plugin); rebuilt only when they change."""
        if [c.field for c in columns] == [c.field for c in self.shown_columns]:
            return
        self.clear(columns=True)
        for c in columns:
            self.add_column(c.header, key=c.field)
        self.shown_columns = columns

    def show(self, result: ModelResult | None) -> None:
        """Show ``result``; the same result under the same theme is already shown (moving through
        the models list past models with no result redraws nothing)."""
        shown = (self.result, self._theme)
        self.result, self._theme = result, self.app.theme
        if self._drawn and shown[0] is result and shown[1] == self._theme:
            return
        self.redraw()

    def show_selected(self, selected: str | None, result: ModelResult | None) -> None:
        """The selected model's result, named in the table's title (or what to do to get one)."""
        if result is None:
            self.show(None)
            # the title is set once (each change repaints the table)
            waiting = f"{selected} (not run yet: press r)"
            self.border_title = waiting if selected else "no model selected"
            return
        self.show(result)
        source = "cache" if result.from_cache else f"{result.meta.get('seconds', 0):.1f} s"
        self.border_title = f"{result.model} · {result.meta.get('data')} · {amount(result.meta)} · {source}"

    def toggle_sort(self, field: str) -> None:
        if self.sort_field == field:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_field, self.sort_reverse = field, field not in UNSHADED  # metrics: high first
        self.redraw()

    def sort_cursor_column(self) -> None:
        self.toggle_sort(self.shown_columns[self.cursor_column].field)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.toggle_sort(str(event.column_key.value))

    def redraw(self) -> None:
        self._drawn = True
        cursor = self.cursor_coordinate
        self.clear()
        result = self.result
        if result is None:
            self.border_subtitle = ""
            return
        self._set_columns(layer_columns(result.rows))
        columns = self.shown_columns
        rows = list(enumerate(result.rows))
        if self.sort_field is not None and self.sort_field != "layer":
            field = self.sort_field

            def key(item: tuple[int, object]) -> tuple[int, float]:
                v = getattr(item[1], field, math.nan)  # a plug-in column another result lacks
                ok = isinstance(v, (int, float)) and math.isfinite(v)
                return (0 if ok else 1, v if ok else 0.0)  # NaN last either way

            rows.sort(key=key, reverse=self.sort_reverse)
            if self.sort_reverse:  # keep NaN rows last
                rows.sort(key=lambda item: key(item)[0])
        elif self.sort_reverse:
            rows.reverse()
        bounds = {
            c.field: column_range([getattr(r, c.field) for r in result.rows])
            for c in columns
            if c.field not in UNSHADED
        }
        theme = self.app.current_theme
        low = Color.parse(theme.surface or theme.background or "#202020")
        high = Color.parse(theme.primary)
        for index, row in rows:
            cells = [self._cell(c, row, bounds.get(c.field), low, high) for c in columns]
            self.add_row(*cells, key=str(index))
        self.move_cursor(row=min(cursor.row, self.row_count - 1), column=cursor.column, animate=False)
        notes = (
            [
                null_note(result.rows).replace(
                    "* avg_cos above the isotropic null's 95th percentile", "avg_cos* > null p95"
                )
            ]
            if result.rows
            else []
        )
        if self.sort_field is not None:
            notes.append(f"sorted by {self.sort_field} {'↓' if self.sort_reverse else '↑'}")
        self.border_subtitle = " · ".join(notes)

    @staticmethod
    def _cell(column: Column, row, bounds, low: Color, high: Color) -> Text:
        content = column.cell(row)
        text = content.copy() if isinstance(content, Text) else Text(str(content))
        text.justify = "left" if column.field == "top_rogue_share" else "right"
        frac = shade_fraction(getattr(row, column.field), bounds)
        if frac is not None:
            text.stylize(Style(bgcolor=low.blend(high, SHADE_MAX * frac).rich_color))
        return text
