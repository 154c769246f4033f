"""ablate's lab tab (key 6): the removals typed in its box run on the selected model; one row per
site and removal (the loss it costs beside a random edit of its size, the final state's change,
what the last layer's avg_cos keeps), and the row under the cursor's curve by layer, clean
against edited and random (``m``: avg_cos or drift).

The app's widget beside its experiment (imported by name by the lab alone: the import contracts
let ``isotui.experiments.*.tab`` import the app)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import DataTable, Input, Static

from isotui.tui.lab_tab import PerModelLabTab, SettingsBox
from isotui.tui.plots import FitPlot, PlotLegend, clear

if TYPE_CHECKING:
    from isotui.experiments.ablate.experiment import AblateRequest
    from isotui.experiments.ablate.removal import Removal
    from isotui.experiments.ablate.result import AblationResult
    from isotui.spec import RunSpec
    from isotui.tui.figure_export import ScreenFigure

CURVES = (("avg_cos", "avg_cos"), ("drift_norm", "drift (mean norm)"))  # m: the next
SITE_WIDTH = 20  # a site's name in the table, shortened in its middle (80 columns)
COLUMNS = ("site", "layer", "remove", "Δ loss", "random", "final", "recovery")
NUMBERS = (1, 3, 4, 5, 6)  # the columns right-aligned (their header too)


def shorten(name: str, width: int) -> str:
    """A long name keeps its start and its end (``transf…h.11``), as the CLI's tables shorten."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return name[:head] + "…" + name[-(width - 1 - head) :]


def right(column: list[str]) -> list[str]:
    """A column's cells padded to one width: right-aligned numbers (the tab's cells are plain
    strings: an experiment's tab imports no rich)."""
    width = max(map(len, column), default=0)
    return [c.rjust(width) for c in column]


def _signed(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:+.4f}"


def _plain(value: float, digits: int) -> str:
    return "-" if not math.isfinite(value) else f"{value:.{digits}f}"


def parse_box(text: str) -> tuple[tuple[Removal, ...], tuple[str, ...]]:
    """The box's words: removals as ``--remove`` takes them (none: the mean), and the sites as
    ``modules=GLOB,GLOB`` (none: every block's output); a bad word is one sentence."""
    from isotui.experiments.ablate.experiment import parse_removals, parse_sites
    from isotui.experiments.ablate.removal import Removal

    removals: list[str] = []
    sites: list[str] = []
    for word in text.split():
        name, sep, value = word.partition("=")
        if sep and name == "modules":
            sites += [v for v in value.split(",") if v]
        else:
            removals.append(word)
    remove = parse_removals(removals) if removals else (Removal("mean"),)
    return remove, parse_sites(sites)


def table_cells(result: AblationResult | None) -> list[tuple[str, ...]]:
    """The table as shown, its header first: one row per site and removal, the numbers
    right-aligned under their headers."""
    from isotui.experiments.ablate.result import site_names

    columns: list[list[str]] = [[h] for h in COLUMNS]
    rows = result.rows if result is not None else []
    names = site_names([r.site for r in rows], SITE_WIDTH)
    for r in rows:
        cells = (
            names[r.site],
            "-" if r.layer < 0 else str(r.layer),
            r.remove,
            _signed(r.delta_loss),
            _signed(r.delta_loss_random),
            _plain(r.final_change, 4),
            _plain(r.recovery, 3),
        )
        for column, cell in zip(columns, cells, strict=True):
            column.append(cell)
    columns = [right(c) if i in NUMBERS else c for i, c in enumerate(columns)]
    return list(zip(*columns, strict=True))


class AblateTab(PerModelLabTab):
    """Each removal at each site of the selected model: what the loss and the geometry lose."""

    KIND = "ablate"
    BOX = "#ablate-input"
    TABLE = "#ablate-table"
    KEY, NAME, TITLE, SHORT = "6", "ablate", "Ablate", "Ablate"
    TOOLTIP = "tab: remove a direction at each site, the loss and the geometry after"
    WIDGET_KEYS = (("↑ ↓", "the site and removal whose curve shows"),)
    DEFAULT_CSS = """
    #ablate-info { height: auto; max-height: 2; color: $text-muted; }
    #ablate-table {
        height: 1fr;
        min-height: 4;
        border-top: solid $primary-darken-2;
        border-title-align: left;
    }
    #ablate-table:focus { border-top: solid $accent; }
    #ablate-plot { width: 1fr; }
    #ablate-legend { width: auto; padding: 1 0 0 1; }
    .-short #ablate-input { border: none; height: 1; padding: 0 1; }
    .-short #ablate-input:focus { background: $accent 30%; }
    """

    def __init__(self, title: str, *, id: str) -> None:
        super().__init__(title, id=id)
        self.metric = 0  # which of CURVES the plot shows
        self.removals: tuple[Removal, ...] = ()  # what the box said when r was last pressed
        self.sites: tuple[str, ...] = ()
        self.plot_title = ""  # what the plot shows (its title)

    def compose(self) -> ComposeResult:
        yield SettingsBox(
            placeholder="remove (default mean): mean pc:K rogue:K dims:I,J; sites: modules=GLOB,... "
            "(default every block); enter runs on the selected model",
            id="ablate-input",
        )
        yield Static(id="ablate-info")
        table: DataTable[Any] = DataTable(id="ablate-table", cursor_type="row", zebra_stripes=True)
        table.add_columns(*table_cells(None)[0])
        yield table
        with Horizontal(classes="lab-charts"):
            yield FitPlot(id="ablate-plot")
            yield PlotLegend(id="ablate-legend")  # plotext's own covers the curves at 80x24

    def show(self) -> None:
        result: AblationResult | None = self.result()
        info = self.query_one("#ablate-info", Static)
        table = self.query_one("#ablate-table", DataTable)
        row = table.cursor_row
        cells = table_cells(result)
        table.clear(columns=True)  # the headers padded as their numbers are
        table.add_columns(*cells[0])
        if result is None:
            who = self.host.selected or "no model selected (pick one on the main screen)"
            info.update(f"{who}: type removals above (or keep the mean) and press enter")
            table.border_title = None
            self.plot()
            return
        meta = result.meta
        source = "cache" if result.from_cache else f"{meta.get('seconds', 0):.1f} s"
        loss = result.rows[0].loss if result.rows else math.nan
        said = f"clean loss {loss:.3f}" if math.isfinite(loss) else "no LM head: no loss"
        info.update(
            f"{shorten(result.model, 40)} · {meta.get('data')} · {meta.get('n_samples')} samples · "
            f"{source} · {said} · random: an edit of the same size along random directions"
        )
        for line in cells[1:]:
            table.add_row(*line)
        table.border_title = "site x removal · final: last state's 1-cos · recovery: its avg_cos kept"
        if result.rows:
            table.move_cursor(row=min(row, len(result.rows) - 1))
        self.plot()

    def plot(self) -> None:
        """The cursor row's curve by layer: clean, after the edit, after the random edit."""
        plot = self.query_one("#ablate-plot", FitPlot)
        legend = self.query_one("#ablate-legend", PlotLegend)
        plt = clear(plot)
        result: AblationResult | None = self.result()
        field, label = CURVES[self.metric]
        row = self.query_one("#ablate-table", DataTable).cursor_row
        if result is None or not 0 <= row < len(result.rows):
            self.plot_title = f"{label} by layer: clean, edited, random (run first)"
            plt.title(self.plot_title)
            legend.show([])
            plot.refresh()
            return
        r, curve = result.rows[row], result.curves[row]
        colours = self.lab.app_colours()
        layers = list(range(len(result.avg_cos)))
        series = (
            ("clean", getattr(result, field), "braille"),
            (r.remove, getattr(curve, field), "braille"),
            ("random", getattr(curve, f"{field}_random"), "dot"),
        )
        shown = list(zip(series, (colours * 3)[:3], strict=True))
        for (_name, ys, marker), colour in shown:
            plt.plot(layers, ys, color=colour, marker=marker)
        legend.show([(name, colour) for (name, _, _), colour in shown])
        if r.layer >= 0:
            plt.vline(r.layer, "gray")
        self.plot_title = f"{label} by layer, {shorten(r.site, 24)} {r.remove} (| the site)"
        plt.title(self.plot_title)
        last = len(layers) - 1
        step = max(1, -(-last // 6))
        ticks = list(range(0, last + 1, step))
        plt.xticks(ticks, [str(t) for t in ticks])
        plot.refresh()

    @on(DataTable.RowHighlighted, "#ablate-table")
    def _row(self, _event: DataTable.RowHighlighted) -> None:
        self.plot()

    def run(self) -> bool:
        """The box's removals and sites, checked before anything is queued."""
        from isotui.errors import IsotuiError

        try:
            self.removals, self.sites = parse_box(self.query_one("#ablate-input", Input).value)
        except IsotuiError as exc:
            from isotui.tui.wording import in_box_terms

            said = str(exc).replace("remove '", "'", 1)  # the box's words, not the keyword's
            self.host.notify(in_box_terms(said), severity="error")
            return False
        return super().run()

    def request(self, spec: RunSpec) -> AblateRequest:
        from isotui.experiments.ablate.experiment import AblateRequest

        return AblateRequest(spec, remove=self.removals, modules=self.sites)

    def cycle(self) -> None:
        self.metric = (self.metric + 1) % len(CURVES)
        self.plot()

    def figure(self) -> ScreenFigure | str:
        """The result as ``isotui figure ablation`` draws it."""
        from isotui.tui.figure_export import ScreenFigure

        result = self.result()
        if result is None:
            return "no plot to save yet: run the ablation (r)"
        return ScreenFigure("ablation", "isotui.paper_figures_probes:draw_ablation", [result])
