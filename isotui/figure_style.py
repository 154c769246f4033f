"""What every paper figure shares (:mod:`isotui.paper_figures` and the figures of its two
sibling modules, which it lists): the palette and markers, the drawing record, model names as a
legend shows them, the legend's placement, the layers' x positions and a p-value axis over
models. matplotlib is never imported here: the functions take its objects.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
NULL_COLOUR = "#777777"
SIGNIFICANCE = 0.05
LEGEND_ROW = 0.16  # inches: one row of 8 pt legend entries

Rows = list[dict[str, Any]]


@dataclass
class Drawing:
    """A drawn figure: the matplotlib Figure, the plotted numbers (CSV rows) and the runs it came from."""

    figure: Any
    rows: Rows
    runs: list[dict[str, Any]] = field(default_factory=list)


def short_name(model: str) -> str:
    """A model's name as a legend shows it: the last part of a hub id or a folder path;
    ``random:TYPE[:k=v,...]`` whole, its settings being what tells two untrained models apart."""
    if model.startswith("random:"):
        return wrap_settings(model.rstrip("/"))
    return model.rstrip("/").split("/")[-1] or model


def wrap_settings(name: str, width: int = 34) -> str:
    """``random:t5:num_layers=3,d_model=64,...`` on lines of at most ``width`` characters,
    broken after a comma (a legend entry wider than the figure was cut at its edges)."""
    lines = [""]
    for part in re.findall(r"[^,]+,?", name):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(lines)


def short_names(models: list[str]) -> list[str]:
    """Each model's :func:`short_name`, numbered where two would read the same."""
    names = [short_name(m) for m in models]
    return [f"{n} ({i + 1})" if names.count(n) > 1 else n for i, n in enumerate(names)]


LONG_LABEL = 24  # characters: a legend with a longer entry goes below the axes, one per row


def _legend(fig: Any, ax: Any, n: int) -> None:
    """A legend that keeps off the data: inside (best corner) for up to 3 short entries, else
    below the axes, outside, in as many columns as the width takes (one for long entries)."""
    labels = ax.get_legend_handles_labels()[1]
    long = any(len(line) > LONG_LABEL for label in labels for line in label.splitlines())
    if n <= 3 and not long:
        ax.legend(loc="best", handlelength=1.6)
    else:
        ncols = 1 if long else min(n, 2 if fig.get_figwidth() < 5 else 5)
        fig.legend(loc="outside lower center", ncols=ncols, handlelength=1.6, columnspacing=1.2)
        lines = sum(label.count("\n") + 1 for label in labels) if long else n
        rows = math.ceil(lines / ncols)
        if rows > 2:  # the axes keep their height: the figure grows by the legend's extra rows
            fig.set_figheight(fig.get_figheight() + LEGEND_ROW * (rows - 2))


def layer_positions(n: int, depth: bool) -> list[float]:
    """x of a model's rows, concatenated over its components: the index, or i / (n - 1) (--depth)."""
    if not depth:
        return [float(i) for i in range(n)]
    return [i / (n - 1) if n > 1 else 0.0 for i in range(n)]


def _layer_runs(results: list[Any]) -> list[dict[str, Any]]:
    return [{"model": r.model, "key": r.key} for r in results]


def pvalue_axis(fig: Any, ax: Any, pvalues: list[float], names: list[str]) -> None:
    """A log p-value axis over models (one x per name, at 0, 1...): the 0.05 line, room below
    the smallest p, and the names slanted where they would not fit side by side."""
    ax.axhline(SIGNIFICANCE, color=NULL_COLOUR, linewidth=0.8, linestyle="--", label="p = 0.05")
    ax.set_yscale("log")
    finite = [p for p in pvalues if math.isfinite(p) and p > 0]
    ax.set_ylim(min([*finite, SIGNIFICANCE]) / 3, 2.0)
    slanted = sum(len(n) + 2 for n in names) * 0.06 > fig.get_figwidth() * 0.8  # 8 pt: ~0.06 in a letter
    at = range(len(names))
    ax.set_xticks(at, names, rotation=30 if slanted else 0, ha="right" if slanted else "center")
    ax.set_xlim(-0.6, len(names) - 0.4)


def drift_key(result: Any) -> str:
    """The drift correlation a model's figure uses: over all its layers (encoder+decoder
    concatenated for an encoder-decoder, as the paper's T5)."""
    return max(result.drift, key=lambda k: k.count("+"))


def drift_row(result: Any, *names: str) -> dict[str, Any]:
    """A model's row of a drift-correlation figure's data: the model, the correlation it uses
    (:func:`drift_key`), its number of layers and the statistics ``names``, in that order."""
    key = drift_key(result)
    d = result.drift[key]
    row = {"model": result.model, "component": key, "n_layers": d.n_layers}
    return row | {n: getattr(d, n) for n in names}
