"""The app's plots: a PlotextPlot whose title and x label always show, and what the plots draw.

plotext leaves out a label that does not fit its width (``check_space``): a long title was blank
on an 80-column terminal and, before the first layout, on first display. Here each is cut to the
widget's width at every render instead (the full text stays set, so a wider window shows it all).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
from rich.text import Text
from textual.geometry import Size
from textual.widget import Widget
from textual_plotext import PlotextPlot

from isotui.render import distinct_names, shorten
from isotui.results import NULL_METRICS, SE_FIELDS, ModelResult


def fit(text: str | None, width: int) -> str | None:
    """``text`` cut to ``width`` cells with an ellipsis (plotext counts one cell per character)."""
    if not text or len(text) <= width:
        return text
    return text[: max(width - 1, 0)] + "…" if width > 1 else None


Sized = Callable[[Any, tuple[int, int]], None]  # draws onto a plotext figure of (columns, rows)


class FitPlot(PlotextPlot):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sized: Sized | None = None
        self._sized_at: tuple[int, int] | None = None

    def draw_sized(self, draw: Sized) -> None:
        """A figure that depends on the plot's size (where labels fit, what a row is worth):
        drawn at each render whose size differs from the last, so the first draw, made before
        the layout, is not kept at a size of 0. :func:`clear` ends it."""
        self._sized, self._sized_at = draw, None
        self.refresh()

    def render(self) -> Any:
        if self._sized is not None and self._sized_at != (self.size.width, self.size.height):
            self._sized_at = (self.size.width, self.size.height)
            self.plt.clear_data()
            self.plt.clear_figure()
            self._sized(self.plt, self._sized_at)
        monitor = cast(Any, self.plt).monitor  # plotext keeps its figure state here
        title, xlabel = monitor.title, list(monitor.xlabel)
        width = self.size.width - 6  # plotext keeps a margin either side of a centred label
        monitor.title = fit(title, width)
        monitor.xlabel = [fit(label, width) for label in xlabel]
        try:
            return super().render()
        finally:
            monitor.title, monitor.xlabel = title, xlabel


# -- what the app's plots draw (the widgets pass in what to show; nothing here reads the app) --

RGB = tuple[int, int, int]
LEGEND_NAME = 22  # a legend entry's name, shortened to this many cells (under its plot)
LEGEND_NAME_BESIDE = 16  # (beside it, where each cell is the plot's)
SWATCH = "━━ "


class PlotLegend(Widget):
    """A plot's legend outside its canvas: plotext draws its own over the curves' top-left
    corner, one row per curve, which at 80x24 covered the whole plot (issue 29). Entries go
    left to right and wrap at the widget's width: beside the plot (its width the longest entry)
    that is one per row, under it a line or two. Names too long for it are cut to what tells them
    apart (:func:`isotui.render.distinct_names`): two untrained models never read the same."""

    DEFAULT_CSS = "PlotLegend { height: auto; } PlotLegend.-empty { display: none; }"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.entries: list[tuple[str, RGB]] = []

    def show(self, entries: Sequence[tuple[str, RGB]]) -> None:
        """(label, colour) per curve; none hides the legend."""
        self.entries = list(entries)
        self.set_class(not self.entries, "-empty")
        self.refresh(layout=True)

    @property
    def beside(self) -> bool:
        """Beside its plot (the box around both lays them out side by side): one entry a row."""
        return (
            self.parent is not None
            and self.parent.styles.layout is not None
            and (self.parent.styles.layout.name == "horizontal")
        )

    def lines(self, width: int) -> list[Text]:
        out: list[Text] = []
        line = Text()
        beside = self.beside
        names = distinct_names(
            [label for label, _ in self.entries], LEGEND_NAME_BESIDE if beside else LEGEND_NAME
        )
        for name, (_, (r, g, b)) in zip(names, self.entries, strict=True):
            entry = Text.assemble((SWATCH, f"rgb({r},{g},{b})"), name)
            if line.cell_len and (beside or line.cell_len + 2 + entry.cell_len > width):
                out.append(line)
                line = Text()
            if line.cell_len:
                line.append("  ")
            line.append_text(entry)
        return [*out, line] if line.cell_len else out

    def get_content_width(self, container: Size, viewport: Size) -> int:
        return max((line.cell_len for line in self.lines(container.width)), default=0)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self.lines(width))

    def render(self) -> Text:
        return Text("\n").join(self.lines(self.content_region.width))


def clear(plot: PlotextPlot) -> Any:
    """The plot's plotext figure, emptied (and no longer drawn by size: :meth:`FitPlot.draw_sized`)."""
    if isinstance(plot, FitPlot):
        plot._sized = None
    plt = plot.plt
    plt.clear_data()
    plt.clear_figure()
    return plt


def x_values(rows: Sequence[Any], depth: bool) -> list[float]:
    """Layer index, or depth 0..1 (encoder, then decoder)."""
    last = max(len(rows) - 1, 1)
    return [i / last if depth else i for i in range(len(rows))]


def integer_ticks(plt: Any, rows: Sequence[Any], depth: bool) -> None:
    """Whole layer numbers on a layer axis (at most 7 ticks); depth keeps plotext's own."""
    if depth or len(rows) < 2:
        return
    last = len(rows) - 1
    step = max(1, -(-last // 6))
    ticks = list(range(0, last + 1, step))
    plt.xticks(ticks, [str(t) for t in ticks])


def se_band(rows: Sequence[Any], metric: str) -> tuple[list[float], list[float]] | None:
    """(metric - SE, metric + SE) per layer for a metric with a standard error (the reservoir's
    sampled metrics), or None when it has none or every SE is 0 (exact, or ``--exact``)."""
    name = f"{metric}_se"
    if name not in SE_FIELDS or not rows:
        return None
    values = [getattr(r, metric) for r in rows]
    errors = [getattr(r, name) for r in rows]
    if not any(math.isfinite(e) and e > 0 for e in errors):
        return None
    errors = [e if math.isfinite(e) else 0.0 for e in errors]
    return [v - e for v, e in zip(values, errors, strict=True)], [
        v + e for v, e in zip(values, errors, strict=True)
    ]


def draw_metric_curves(
    plot: PlotextPlot, curves: Sequence[ModelResult], metric: str, depth: bool, colours: Sequence[RGB]
) -> list[tuple[str, RGB]]:
    """One line per compared model of ``metric`` by layer (or depth), with its null line and
    its ±1 SE band where it has them; returns the legend's (model, colour) entries (the plot has
    no legend of its own: see :class:`PlotLegend`)."""
    plt = clear(plot)
    axis = "depth (0..1)" if depth else "layer"
    if not curves:
        plt.title(f"{metric} by {axis}: run models to compare them")
        plot.refresh()
        return []
    nulls = metric in NULL_METRICS
    band = any(se_band(r.rows, metric) is not None for r in curves)
    plt.title(
        f"{metric} by {'depth' if depth else 'layer'}"
        + (" (— null p95)" if nulls else "")
        + (" (dots: ±1 SE)" if band else "")
    )
    legend = []
    for i, result in enumerate(curves):
        rows = result.rows
        colour = colours[i % len(colours)]
        legend.append((result.model, colour))
        # getattr with NaN: a plug-in column that only some compared models have
        ys = [getattr(r, metric, math.nan) for r in rows]
        plt.plot(x_values(rows, depth), ys, color=colour, marker="braille")
        edges = se_band(rows, metric)
        if edges is not None:  # a sampled metric: ±1 standard error, dotted
            for edge in edges:
                plt.plot(x_values(rows, depth), edge, color=colour, marker="dot")
        if nulls and rows:
            plt.hline(rows[0].null_p95, colour)
    integer_ticks(plt, max((r.rows for r in curves), key=len), depth)
    plot.refresh()
    return legend


def draw_drift_curves(
    plot: PlotextPlot, result: ModelResult | None, depth: bool, colours: Sequence[RGB]
) -> list[tuple[str, RGB]]:
    """Drift norm (left axis) and avg cosine (right) per layer of one model (Godey et al. Fig. 5);
    returns the legend's entries (plotext marks a right-axis curve's legend entry with ``L`` and
    ``⅃`` glyphs, so the legend is drawn beside it: :class:`PlotLegend`)."""
    plt = clear(plot)
    plot.border_title = shorten(result.model, 30) if result else ""  # whose curves these are
    if result is None or not result.rows:
        plt.title("drift norm and avg_cos per layer: run a model")
        plot.refresh()
        return []
    xs = x_values(result.rows, depth)
    integer_ticks(plt, result.rows, depth)
    drift, cos = colours[0], colours[1 % len(colours)]
    plt.plot(xs, [r.drift_norm for r in result.rows], color=drift, marker="braille")
    plt.plot(xs, [r.avg_cos for r in result.rows], color=cos, marker="braille", yside="right")
    plot.refresh()
    return [("drift (left)", drift), ("avg_cos (right)", cos)]


def draw_head_metric(
    plot: PlotextPlot, result: Any, summary: Sequence[Any], metric: tuple[str, str], colours: Sequence[RGB]
) -> None:
    """The lab's Heads plot: ``metric`` (attribute, name) by layer, heads averaged, each head a dot."""
    plt = clear(plot)
    attr, name = metric
    if result is None:
        plt.title(f"{name} per layer: run the attention experiment (r)")
        plot.refresh()
        return
    sites = [s for s in summary if s.attention == "self"]
    xs = list(range(1, len(sites) + 1))
    plt.title(f"{name} by layer (dots: heads)")
    heads_x, heads_y = [], []
    for i, s in enumerate(sites):
        for r in result.rows:
            if (r.component, r.layer, r.attention) == (s.component, s.layer, s.attention):
                v = getattr(r, attr)
                if math.isfinite(v):
                    heads_x.append(i + 1)
                    heads_y.append(v)
    plt.scatter(heads_x, heads_y, color=colours[1], marker="dot")
    plt.plot(xs, [getattr(s, attr) for s in sites], color=colours[0], marker="braille")
    if len(xs) > 1:
        step = max(1, -(-len(xs) // 8))
        plt.xticks(xs[::step], [str(x) for x in xs[::step]])
    plot.refresh()


def draw_score_histogram(
    plot: PlotextPlot, result: Any, summary: Sequence[Any], row: int, colours: Sequence[RGB], *, log: bool
) -> None:
    """The lab's Heads histogram: pre-softmax scores of the layer in table row ``row``, all heads."""
    from isotui.figures import draw_histogram

    plt = clear(plot)
    if result is None:
        plt.title("pre-softmax scores of a layer")
        plot.refresh()
        return
    row = min(max(row, 0), len(summary) - 1)
    s = summary[row]
    title = f"QKᵀ/√d, layer {s.layer}{' (cross)' if s.attention == 'cross' else ''}, all heads"
    counts, edges = result.arrays[f"hist.{row}"].sum(0), np.asarray(result.meta["score_edges"])

    def draw(plt: Any, size: tuple[int, int]) -> None:
        draw_histogram(plt, counts, edges, colours[0], title, log=log, rows=size[1])

    sized(plot, draw)


def sized(plot: PlotextPlot, draw: Sized) -> None:
    """``draw`` at the plot's size: redrawn when it changes (:meth:`FitPlot.draw_sized`)."""
    if isinstance(plot, FitPlot):
        plot.draw_sized(draw)
    else:
        draw(plot.plt, (plot.size.width, plot.size.height))
        plot.refresh()
