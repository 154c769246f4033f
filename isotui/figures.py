"""Figures drawn onto a plotext object: the global ``plotext`` module headless, or a
``PlotextPlot`` widget's own ``plt`` in the app, so both show the same picture."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def draw_trajectory(
    plt: Any,
    result: Any,
    site: int,
    head: int,
    basis: str = "qk",
    colours=None,
    size: tuple[int, int] = (100, 24),
) -> None:
    """Q_bar and K_bar of one head, checkpoint after checkpoint, in the series' common 2-D basis
    (Godey et al. Figs. 11-15): a path per vector, its first and last checkpoints labelled.
    ``size``: the figure's (columns, rows), so labels that would share cells are moved apart."""
    from isotui.core.trajectory import BASES

    q, k = result.trajectory(site, head, basis)
    comp, layer, _ = result.sites[site]
    where = f"layer {layer}" if comp == "model" else f"{comp} {layer}"
    name = {"qk": "queries+keys", "q": "queries", "k": "keys"}[basis] if basis in BASES else basis
    plt.title(f"{where} head {head}: mean Q and K (SVD: {name})")
    q_colour, k_colour = colours or ("cyan", "orange")
    steps = result.steps()
    both = np.concatenate([q, k]) if len(q) + len(k) else np.zeros((0, 2))
    both = both[np.all(np.isfinite(both), axis=1)]
    lo, hi = (both.min(0), both.max(0)) if len(both) else (np.zeros(2), np.ones(2))
    labels = LabelPlacer(lo, hi, size)
    # one cell per character: a combining macron (Q̄) is drawn as a cell of its own by plotext
    # (no legend: it covers the paths' first points; each path's ends are labelled Q:step, K:step)
    for path, colour, tag in ((q, q_colour, "Q"), (k, k_colour, "K")):
        ok = np.all(np.isfinite(path), axis=1) if len(path) else np.zeros(0, bool)
        if not ok.any():
            continue
        xs, ys = path[ok, 0].tolist(), path[ok, 1].tolist()
        plt.plot(xs, ys, color=colour, marker="dot")
        first, last = (s for s, good in zip((steps[0], steps[-1]), (ok[0], ok[-1]), strict=True))
        for text, x, y in (
            (f"{tag}:{first}" if ok[0] else tag, xs[0], ys[0]),
            (f"{tag}:{last}" if ok[-1] else tag, xs[-1], ys[-1]),
        ):
            # written away from the nearer edge, so no label is cut at the frame; a row up or
            # down where another label holds the cells (K:60 and K:0 ran together as K:60K:0)
            alignment = "left" if x <= (lo[0] + hi[0]) / 2 else "right"
            plt.text(text, x, labels.place(text, x, y, alignment), color=colour, alignment=alignment)
    # plotext prints a y label under the plot: both axes are named on the x axis
    plt.xlabel("x: 1st singular direction, y: 2nd")


class LabelPlacer:
    """Where text labels go on a plotext canvas of ``size`` (columns, rows) over the data box
    ``lo``..``hi``: a label that would share cells with one placed before (or touch it) moves
    to the nearest free row, so no two labels run together."""

    def __init__(self, lo: np.ndarray, hi: np.ndarray, size: tuple[int, int]) -> None:
        # less the y ticks and frame (about 9 columns), the title, frame, x ticks and x label
        columns, rows = max(size[0] - 9, 10), max(size[1] - 5, 3)
        self.lo, self.hi = lo, hi
        self.cell = (hi[0] - lo[0]) / columns if hi[0] > lo[0] else 1.0
        self.row = (hi[1] - lo[1]) / (rows - 1) if hi[1] > lo[1] else 1.0
        self.rows = rows
        self.taken: list[tuple[int, float, float]] = []  # (row, first cell, last cell)

    def place(self, text: str, x: float, y: float, alignment: str) -> float:
        """The y to draw ``text`` at (``y`` itself when its cells are free)."""
        start = (x - self.lo[0]) / self.cell - (len(text) - 1 if alignment == "right" else 0)
        row = round((y - self.lo[1]) / self.row)
        for shift in (0, 1, -1, 2, -2, 3, -3):
            r = row + shift
            if not 0 <= r < self.rows:
                continue
            if all(r != t or start > b + 1 or start + len(text) < a - 1 for t, a, b in self.taken):
                self.taken.append((r, start, start + len(text) - 1))
                return float(y + shift * self.row)
        self.taken.append((row, start, start + len(text) - 1))
        return float(y)


def draw_layer_series(plt: Any, steps: list[int], values: np.ndarray, labels: list[str], title: str, palette):
    """One line per layer over checkpoints (values: checkpoints x layers)."""
    plt.title(title)
    for j, label in enumerate(labels):
        col = values[:, j]
        ok = np.isfinite(col)
        if ok.any():
            plt.plot(
                [s for s, good in zip(steps, ok, strict=True) if good],
                col[ok].tolist(),
                color=palette[j % len(palette)],
                marker="dot",
                label=label,
            )


def histogram_bars(
    counts: np.ndarray, edges: np.ndarray, max_bars: int = 60, tail: float = 0.001
) -> tuple[list[float], list[int]]:
    """Bar centres and counts for drawing a fine histogram: its central mass (the ``tail`` share on
    each side is left out, so a few far scores do not squash the picture; the tables give the exact
    min and max) on ``max_bars`` bars of equal width, each fine bin counted in the bar holding its
    centre. Under/overflow are dropped."""
    inner = np.asarray(counts[1:-1], dtype=np.float64)
    total = inner.sum()
    if total <= 0:
        return [], []
    cdf = np.cumsum(inner) / total
    lo = int(np.searchsorted(cdf, tail, side="left"))
    hi = int(np.searchsorted(cdf, 1 - tail, side="left")) + 1
    inner, e = inner[lo:hi], np.asarray(edges[lo : hi + 1], dtype=np.float64)
    centres = (e[:-1] + e[1:]) / 2
    bars = min(max_bars, len(inner))
    grid = np.linspace(e[0], e[-1], bars + 1)
    which = np.clip(np.searchsorted(grid, centres, side="right") - 1, 0, bars - 1)
    sums = np.bincount(which, weights=inner, minlength=bars)
    mids = (grid[:-1] + grid[1:]) / 2
    return [float(m) for m in mids], [round(v) for v in sums]


def nice_ticks(lo: float, hi: float, most: int = 3) -> list[float]:
    """At most ``most`` ticks at round values (multiples of 1, 2, 2.5 or 5 times a power of 10)
    in ``lo``..``hi``: 0 is one of them whenever the range holds it."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    power = 10.0 ** math.floor(math.log10((hi - lo) / most))
    for m in (1, 2, 2.5, 5, 10, 20, 25, 50):
        step = m * power
        first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
        if last - first + 1 <= most:
            return [round(i * step, 12) + 0.0 for i in range(first, last + 1)]
    return [lo, hi]


def draw_histogram(
    plt: Any, counts: np.ndarray, edges: np.ndarray, colour, title: str, *, log: bool = False, rows: int = 16
) -> None:
    """A score histogram as bars over its central mass, with short tick labels at round values;
    ``log`` draws log10(1 + count) (empty bars stay empty), so the tails show beside a tall peak.
    ``rows``: the plot's height; plotext draws any bar above 0 as at least one full row, so in
    linear counts a bar under half a row is left out (else the tails' few scores filled the
    bottom row across the whole range; ``l`` shows them)."""
    centres, sums = histogram_bars(counts, edges)
    plt.title(title + (" · log10(1+count)" if log else ""))
    if not centres:
        return
    if log:
        heights: list[float] = [math.log10(1 + c) for c in sums]
    else:
        half_row = max(sums) / max(rows - 5, 1) / 2  # the axes and title take about 5 rows
        heights = [c if c >= half_row else 0 for c in sums]
    plt.bar(centres, heights, color=colour, width=0.9)
    # at most three ticks: labels of up to 8 characters never collide in a 40-column plot
    # (plotext drops colliding ones, and which it drops varied from one draw to the next)
    ticks = nice_ticks(centres[0], centres[-1])
    plt.xticks(ticks, [f"{t:.3g}" for t in ticks])
