"""The app's ``F`` key: the plot on screen as a paper figure (PDF, PNG) and the CSV of exactly the
numbers it plots, drawn by the same matplotlib code as ``isotui figure``.

A screen (the layer view, each lab tab) says what it shows as a :class:`ScreenFigure`: the
drawing (a function of :mod:`isotui.paper_figures` or :mod:`isotui.paper_figures_dynamics`, by
name, so matplotlib and the drawings load only when ``F`` is pressed), the results and the
options (the metric, the head, the basis... as the screen has them). :func:`render_files` draws it
(on a worker thread: the first draw imports matplotlib); the app writes the files where its other
exports go.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

FIGURE_DPI = 200  # the PNG's resolution


@dataclass
class ScreenFigure:
    """What a screen's plot shows: ``module:function`` of the drawing, its results and options."""

    what: str  # the file name's part: isotui-DATE-TIME-figure-WHAT.pdf
    draw: str  # "isotui.paper_figures_dynamics:draw_metric_by_layer"
    results: list[Any]
    options: dict[str, Any] = field(default_factory=dict)


def render_files(figure: ScreenFigure) -> tuple[bytes, bytes, list[dict[str, Any]]]:
    """The figure as PDF and PNG bytes (the paper defaults of ``isotui figure``) and its CSV rows."""
    import importlib

    from isotui.paper_figures import PaperFigure, render

    module, name = figure.draw.split(":")
    draw = getattr(importlib.import_module(module), name)
    paper = PaperFigure(figure.what, "", None, draw)
    options = SimpleNamespace(**{"width": "single", "dpi": FIGURE_DPI, "style": None, **figure.options})
    pdf, drawing = render(paper, figure.results, options, "pdf")
    png, _ = render(paper, figure.results, options, "png")
    return pdf, png, drawing.rows
