"""The papers' figures of queries and keys along training (Godey et al. 2024, sec. 5.2 and App. C),
drawn with matplotlib from a ``qk-dynamics`` result (a checkpoint series).

- Figs. 11-12 (queries and keys), 19-20 (queries only) and 21-22 (keys only): the trajectories of a
  head's mean query Q̄ and mean key K̄ in the series' shared 2-D SVD basis; one panel per head of
  one layer (``--layer``, default the last), or one head (``--head``).
- Figs. 13-14: cos(Q̄, K̄) along training; Fig. 23: Q̄ · K̄; Fig. 15: the attention entropy. One
  line per layer (heads averaged), as the papers' per-layer curves.

The papers draw two series with each layout (MultiBERT and Pythia): the figure numbers that share
a layout share a drawing here; the series is what ``-c`` gives. Each drawing returns the rows of
exactly the numbers it plots. Also here: the app's ``F`` key figures of what its screens show.
matplotlib is imported inside the functions only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from isotui.errors import IsotuiError
from isotui.figure_style import MARKERS, NULL_COLOUR, OKABE_ITO, Drawing, Rows, short_names

BASIS_NAMES = {"qk": "queries and keys", "q": "queries only", "k": "keys only"}
Q_COLOUR, K_COLOUR = OKABE_ITO[0], OKABE_ITO[3]
Q_LABEL, K_LABEL = r"$\bar{Q}$", r"$\bar{K}$"
MAX_COLUMNS = {"single": 3, "double": 4}  # panels per row of a head grid
PANEL_ROW = 1.15  # inches: one row of head panels
LEGEND_LAYERS = 4  # up to this many layers the curves have a legend, beyond it a colour bar


def site_labels(result: Any) -> list[str]:
    """A name per attention module: ``3``; ``encoder 3``/``decoder 3 (cross)`` when several stacks."""
    many = len({s[0] for s in result.sites}) > 1
    return [
        (f"{c} " if many else "") + str(layer) + (" (cross)" if a == "cross" else "")
        for c, layer, a in result.sites
    ]


def pick_site(result: Any, layer: int | None) -> int:
    """The module of ``--layer`` (its self-attention; the first stack's when several have it),
    default the last self-attention module."""
    selfs = [i for i, s in enumerate(result.sites) if s[2] == "self"] or list(range(len(result.sites)))
    if layer is None:
        return selfs[-1]
    found = [i for i in selfs if result.sites[i][1] == layer]
    if not found:
        layers = sorted({result.sites[i][1] for i in selfs})
        raise IsotuiError(f"--layer {layer}: no such layer in the series; layers are {layers}")
    return found[0]


def heads_of(result: Any, site: int) -> list[int]:
    return sorted({r.head for r in result.rows if (r.component, r.layer, r.attention) == result.sites[site]})


def _series_runs(result: Any) -> list[dict[str, Any]]:
    keys = result.meta.get("keys") or [None] * len(result.checkpoints)
    return [
        {"model": c.model, "checkpoint": c.label, "step": s, "key": k}
        for c, s, k in zip(result.checkpoints, result.steps(), keys, strict=True)
    ]


# --- Figs. 11-12, 19-22: Q̄ and K̄ trajectories ----------------------------------------------------


def trajectory_rows(result: Any, site: int, head: int, basis: str) -> Rows:
    """A head's Q̄ and K̄ coordinates at each checkpoint (the CSV rows of a trajectory panel)."""
    comp, layer, att = result.sites[site]
    q, k = result.trajectory(site, head, basis)
    return [
        {
            "series": result.series,
            "checkpoint": c.label,
            "step": s,
            "component": comp,
            "layer": layer,
            "attention": att,
            "head": head,
            "basis": basis,
            "q_x": float(qp[0]),
            "q_y": float(qp[1]),
            "k_x": float(kp[0]),
            "k_y": float(kp[1]),
        }
        for c, s, qp, kp in zip(result.checkpoints, result.steps(), q, k, strict=True)
    ]


def trajectory_panel(ax: Any, rows: Rows, *, axis_labels: tuple[bool, bool] = (True, True)) -> None:
    """One head's paths: Q̄ and K̄ checkpoint after checkpoint, an open marker at the first and a
    filled one at the last, and the origin (where the SVD's directions start) as a cross."""
    for tag, colour, marker in (("q", Q_COLOUR, "o"), ("k", K_COLOUR, "s")):
        xy = np.array([[r[f"{tag}_x"], r[f"{tag}_y"]] for r in rows], dtype=np.float64)
        ok = np.all(np.isfinite(xy), axis=1)
        if not ok.any():
            continue
        path = xy[ok]
        ax.plot(path[:, 0], path[:, 1], color=colour, linewidth=0.9, marker=marker, markersize=1.8, zorder=2)
        ax.plot(*path[0], marker=marker, markersize=4.5, markerfacecolor="white", color=colour, zorder=3)
        ax.plot(*path[-1], marker=marker, markersize=4.5, color=colour, zorder=3)
    ax.plot(0, 0, marker="+", color=NULL_COLOUR, markersize=5, linestyle="none", zorder=1)
    from matplotlib.ticker import MaxNLocator

    ax.margins(0.12)
    ax.tick_params(labelsize=7, length=2, pad=1)
    # few ticks: a narrow panel's labels (up to five characters, as -0.75) never run together
    ax.xaxis.set_major_locator(MaxNLocator(nbins=3))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=4))
    if axis_labels[0]:
        ax.set_xlabel("SVD direction 1", fontsize=7)
    if axis_labels[1]:
        ax.set_ylabel("SVD direction 2", fontsize=7)


def trajectory_legend(fig: Any, first: str, last: str) -> None:
    """Q̄, K̄, what the open and filled markers mean and the origin's cross, below the panels."""
    from matplotlib.lines import Line2D

    mark: dict[str, Any] = {"color": NULL_COLOUR, "linestyle": "none"}
    handles = [
        Line2D([], [], color=Q_COLOUR, marker="o", markersize=3, label=Q_LABEL),
        Line2D([], [], color=K_COLOUR, marker="s", markersize=3, label=K_LABEL),
        Line2D([], [], marker="o", markerfacecolor="white", label=first, **mark),
        Line2D([], [], marker="o", label=last, **mark),
        Line2D([], [], marker="+", markersize=5, label="origin", **mark),
    ]
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncols=5,
        handlelength=1.2,
        handletextpad=0.4,
        columnspacing=0.8,
    )


def trajectory_drawer(default_basis: str) -> Callable[[Any, list[Any], Any], Drawing]:
    """The trajectory figure with the paper figure's own basis (``--basis`` overrides it)."""

    def draw(fig: Any, results: list[Any], options: Any) -> Drawing:
        return draw_trajectories(fig, results, options, default_basis)

    draw.__doc__ = f"Q̄/K̄ trajectories per head, SVD of {BASIS_NAMES[default_basis]} (--basis overrides)."
    return draw


def draw_trajectories(fig: Any, results: list[Any], options: Any, default_basis: str = "qk") -> Drawing:
    """Q̄ and K̄ of each head of one layer (``--layer``, default the last; ``--head``: that head
    only), one panel per head, in the series' shared 2-D basis (``--basis``)."""
    result = results[0]
    basis = getattr(options, "basis", None) or default_basis
    site = pick_site(result, getattr(options, "layer", None))
    heads = heads_of(result, site)
    head = getattr(options, "head", None)
    if head is not None:
        if head not in heads:
            raise IsotuiError(f"--head {head}: no such head in that layer; heads are 0..{max(heads)}")
        heads = [head]
    width = "double" if fig.get_figwidth() > 5 else "single"
    ncols = min(math.ceil(math.sqrt(len(heads))), MAX_COLUMNS[width])
    nrows = math.ceil(len(heads) / ncols)
    if len(heads) > 1:  # the figure's height follows the rows of panels
        fig.set_figheight(0.7 + PANEL_ROW * nrows)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    rows: Rows = []
    for i, (ax, h) in enumerate(zip(axes, heads, strict=False)):
        panel = trajectory_rows(result, site, h, basis)
        rows += panel
        last_row = i >= len(heads) - ncols
        trajectory_panel(ax, panel, axis_labels=(last_row, i % ncols == 0))
        if len(heads) > 1:
            ax.set_title(f"head {h}", fontsize=7, pad=2)
    for ax in axes[len(heads) :]:
        ax.set_visible(False)
    steps = result.steps()
    where = site_labels(result)[site]
    one = f", head {heads[0]}" if len(heads) == 1 else ""
    fig.suptitle(f"layer {where}{one}: SVD of {BASIS_NAMES[basis]}", fontsize=8)
    trajectory_legend(fig, f"step {steps[0]:,}", f"step {steps[-1]:,}")
    return Drawing(fig, rows, _series_runs(result))


# --- Figs. 13-15 and 23: per-layer curves along training ------------------------------------------

LAYER_CURVES = {
    "cos_qk_bar": r"cos($\bar{Q}$, $\bar{K}$)",
    "dot_qk_bar": r"$\bar{Q} \cdot \bar{K}$",
    "entropy": "attention entropy (nats)",
}
AXIS_LABELS = {  # the app's Heads metrics in the papers' notation (others keep the app's name)
    **LAYER_CURVES,
    "q_bar_norm": r"$\|\bar{Q}\|$",
    "k_bar_norm": r"$\|\bar{K}\|$",
}


def layer_curve_rows(result: Any, attr: str) -> Rows:
    """``attr`` averaged over each layer's heads (finite values), per checkpoint and layer."""
    means = result.layer_means(attr)
    counts: dict[tuple[str, tuple[Any, ...]], int] = {}
    for r in result.rows:
        if math.isfinite(getattr(r, attr)):
            key = (r.checkpoint, (r.component, r.layer, r.attention))
            counts[key] = counts.get(key, 0) + 1
    return [
        {
            "series": result.series,
            "checkpoint": c.label,
            "step": s,
            "component": site[0],
            "layer": site[1],
            "attention": site[2],
            "heads": counts.get((c.label, tuple(site)), 0),
            attr: float(means[i, j]),
        }
        for i, (c, s) in enumerate(zip(result.checkpoints, result.steps(), strict=True))
        for j, site in enumerate(result.sites)
    ]


def layer_curves_panel(fig: Any, ax: Any, result: Any, attr: str, *, colorbar: bool = True) -> Rows:
    """One line per layer of ``attr`` (heads averaged) against the training step, coloured from the
    first layer (dark) to the last (light); a symlog step axis when steps span two decades."""
    import matplotlib

    rows = layer_curve_rows(result, attr)
    steps = result.steps()
    labels = site_labels(result)
    grid = np.array([r[attr] for r in rows], dtype=np.float64).reshape(len(steps), len(labels))
    cmap = matplotlib.colormaps["viridis"]
    norm = matplotlib.colors.Normalize(0, max(len(labels) - 1, 1))
    for j in range(len(labels)):
        ok = np.isfinite(grid[:, j])
        xs = [s for s, good in zip(steps, ok, strict=True) if good]
        ax.plot(xs, grid[ok, j], color=cmap(norm(j)), marker="o", markersize=2, linewidth=1.0)
    positive = [s for s in steps if s > 0]
    if positive and max(positive) >= 100 * min(positive):
        ax.set_xscale("symlog", linthresh=min(positive))
    ax.set_xlabel("training step")
    ax.set_ylabel(LAYER_CURVES[attr])
    ax.yaxis.get_major_formatter().set_useOffset(False)  # the values themselves, not "1e-5 + 2.76"
    if attr in ("cos_qk_bar", "dot_qk_bar"):  # the sign matters: aligned or opposed
        ax.axhline(0.0, color=NULL_COLOUR, linewidth=0.5, linestyle=":", zorder=1)
    if len(labels) <= LEGEND_LAYERS:  # a few layers: named in a legend
        for j, label in enumerate(labels):
            ax.plot([], [], color=cmap(norm(j)), marker="o", markersize=2, label=f"layer {label}")
        ax.legend(loc="best", handlelength=1.4, fontsize=7)
    elif colorbar:
        bar = fig.colorbar(
            matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, fraction=0.08, pad=0.03, label="layer"
        )
        ticks = list(range(0, len(labels), math.ceil(len(labels) / 8)))
        bar.set_ticks(ticks, labels=[labels[i] for i in ticks])
    return rows


def layer_curves_drawer(attr: str) -> Callable[[Any, list[Any], Any], Drawing]:
    def draw(fig: Any, results: list[Any], _options: Any) -> Drawing:
        ax = fig.add_subplot()
        rows = layer_curves_panel(fig, ax, results[0], attr)
        return Drawing(fig, rows, _series_runs(results[0]))

    draw.__doc__ = f"{attr} per layer (heads averaged) along a checkpoint series."
    return draw


# --- the app's F key: the figure of what a screen shows -------------------------------------------


def draw_metric_by_layer(fig: Any, results: list[Any], options: Any) -> Drawing:
    """The app's main plot: ``options.metric`` by layer (or ``options.depth``) per compared model,
    the isotropic null's p95 for the cosine metrics (one line per hidden size)."""
    from isotui.figure_style import _legend, layer_positions
    from isotui.results import NULL_METRICS

    metric = getattr(options, "metric", "avg_cos")
    depth = bool(getattr(options, "depth", False))
    ax = fig.add_subplot()
    rows: Rows = []
    nulls: dict[int, float] = {}
    names = short_names([r.model for r in results])
    for i, result in enumerate(results):
        xs = layer_positions(len(result.rows), depth)
        values = [float(getattr(r, metric, math.nan)) for r in result.rows]  # NaN: a plug-in column it lacks
        for x, r, v in zip(xs, result.rows, values, strict=True):
            row = {"model": result.model, "component": r.component, "layer": r.layer, "x": x, metric: v}
            if metric in NULL_METRICS:
                row["null_p95"] = r.null_p95
                nulls.setdefault(r.dim, r.null_p95)
            rows.append(row)
        colour = OKABE_ITO[i % len(OKABE_ITO)]
        ax.plot(xs, values, marker=MARKERS[i % len(MARKERS)], color=colour, label=names[i])
    for k, (dim, p95) in enumerate(sorted(nulls.items())):
        label = "isotropic p95" + (f" (d={dim})" if len(nulls) > 1 else "")
        ax.axhline(p95, color=NULL_COLOUR, linewidth=0.8, linestyle=("--", ":", "-.")[k % 3], label=label)
    ax.set_xlabel("normalised depth" if depth else "layer")
    ax.set_ylabel(metric.replace("_", " "))
    if not depth:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(fig, ax, len(results) + len(nulls))
    return Drawing(fig, rows, [{"model": r.model, "key": r.key} for r in results])


def draw_head_metric(fig: Any, results: list[Any], options: Any) -> Drawing:
    """The lab's Heads plot: ``options.metric`` (attribute, axis name) by layer, heads averaged
    (the line) and each head (the dots)."""
    from isotui.experiments.attention import summarize

    result = results[0]
    attr, name = options.metric
    summary = [s for s in summarize(result) if s.attention == "self"]
    ax = fig.add_subplot()
    rows: Rows = []
    xs, means = [], []
    for s in summary:
        for r in result.rows:
            if (r.component, r.layer, r.attention) == (s.component, s.layer, s.attention):
                rows.append(
                    {
                        "model": result.model,
                        "component": s.component,
                        "layer": s.layer,
                        "head": r.head,
                        attr: float(getattr(r, attr)),
                    }
                )
        xs.append(s.layer)
        means.append(float(getattr(s, attr)))
    hx = [r["layer"] for r in rows]
    ax.scatter(hx, [r[attr] for r in rows], s=6, color=OKABE_ITO[5], label="heads", zorder=2)
    ax.plot(xs, means, color=OKABE_ITO[0], marker="o", label="mean over heads", zorder=3)
    rows += [
        {"model": result.model, "component": s.component, "layer": s.layer, "head": "mean", attr: m}
        for s, m in zip(summary, means, strict=True)
    ]
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel(AXIS_LABELS.get(attr, name))
    ax.legend(loc="best", handlelength=1.4)
    return Drawing(fig, rows, [{"model": result.model, "key": result.key}])


def draw_dynamics_view(fig: Any, results: list[Any], options: Any) -> Drawing:
    """The lab's Dynamics tab: one head's trajectory (left) and the per-layer curves of the
    tab's metric (right), as the tab shows them."""
    result = results[0]
    left, right = fig.subplots(1, 2, width_ratios=(1, 1.25))
    rows = trajectory_rows(result, options.site, options.head, options.basis)
    trajectory_panel(left, rows)
    where = site_labels(result)[options.site]
    left.set_title(f"layer {where}, head {options.head}: SVD of {BASIS_NAMES[options.basis]}", fontsize=7)
    curves = layer_curves_panel(fig, right, result, options.metric)
    steps = result.steps()
    trajectory_legend(fig, f"step {steps[0]:,}", f"step {steps[-1]:,}")
    out = [{"panel": "trajectory", **r} for r in rows] + [{"panel": options.metric, **r} for r in curves]
    columns = list(dict.fromkeys(k for r in out for k in r))  # one CSV: both panels' columns
    return Drawing(fig, [{k: r.get(k, "") for k in columns} for r in out], _series_runs(result))
