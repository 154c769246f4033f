"""Figures drawn onto a plotext object: the global ``plotext`` module headless, or a
``PlotextPlot`` widget's own ``plt`` in the app, so both show the same picture."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def draw_trajectory(plt: Any, result: Any, site: int, head: int, basis: str = "qk", colours=None) -> None:
    """Q_bar and K_bar of one head, checkpoint after checkpoint, in the series' common 2-D basis
    (Godey et al. Figs. 11-15): a path per vector, its first and last checkpoints labelled."""
    from isotui.core.trajectory import BASES

    q, k = result.trajectory(site, head, basis)
    comp, layer, _ = result.sites[site]
    where = f"layer {layer}" if comp == "model" else f"{comp} {layer}"
    name = {"qk": "queries+keys", "q": "queries", "k": "keys"}[basis] if basis in BASES else basis
    plt.title(f"{where} head {head}: mean Q and K (SVD: {name})")
    q_colour, k_colour = colours or ("cyan", "orange")
    steps = result.steps()
    finite = np.concatenate([q, k])[:, 0] if len(q) + len(k) else np.zeros(0)
    finite = finite[np.isfinite(finite)]
    mid = float((finite.min() + finite.max()) / 2) if len(finite) else 0.0
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
            # written away from the nearer edge, so no label is cut at the frame
            plt.text(text, x, y, color=colour, alignment="left" if x <= mid else "right")
    # plotext prints a y label under the plot: both axes are named on the x axis
    plt.xlabel("x: 1st singular direction, y: 2nd")


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


def draw_histogram(
    plt: Any, counts: np.ndarray, edges: np.ndarray, colour, title: str, *, log: bool = False
) -> None:
    """A score histogram as bars over its central mass, with short tick labels; ``log`` draws
    log10(1 + count) (empty bars stay empty), so the tails show beside a tall peak."""
    centres, sums = histogram_bars(counts, edges)
    plt.title(title + (" · log10(1+count)" if log else ""))
    if not centres:
        return
    heights = [math.log10(1 + c) for c in sums] if log else sums
    plt.bar(centres, heights, color=colour, width=0.9)
    # three ticks: labels of up to 8 characters never collide in a 40-column plot (plotext drops
    # colliding ones, and which it drops varied from one draw to the next)
    ticks = np.linspace(centres[0], centres[-1], 3).tolist()
    plt.xticks(ticks, [f"{t:.3g}" for t in ticks])
