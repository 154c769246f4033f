"""The probes' figures: the rest of the drift block (Godey et al. 2024 Figs. 7-10), the Pearson
p-values (Fig. 16), the final norm per dimension (Machina & Mercer 2024), the gradients' energy
in the activations' top principal directions and what an ablation costs (``ablate``).

Drawn as :mod:`isotui.paper_figures` draws (its defaults, palette and :class:`Drawing`); each
function returns the figure and the rows of exactly the numbers it plots. matplotlib is imported
only inside the functions.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from isotui.errors import IsotuiError
from isotui.figure_style import (
    NULL_COLOUR,
    OKABE_ITO,
    Drawing,
    Rows,
    _layer_runs,
    drift_row,
    pvalue_axis,
    short_names,
)

SCORE_PANELS = 4  # Fig. 7: at most this many N, evenly spread over the sweep (first and last kept)
DEFAULT_KS = (1, 2, 4, 8, 16)  # gradients: the subspace sizes k
TOP_DIMS = 3  # final norm: the dimensions named beside their points (largest share of avg cos)


# --- Godey et al. 2024, Figs. 7-10: the drift block ----------------------------------------------


def _drift_runs(result: Any) -> list[dict[str, Any]]:
    return [{"seed": s, "key": k} for s, k in zip(result.seeds, result.keys, strict=True)]


def _band(ax: Any, x: np.ndarray, mean: np.ndarray, std: np.ndarray, **style: Any) -> None:
    """A curve of the mean over seeds, with a one-std band when there are several seeds."""
    (line,) = ax.plot(x, mean, **style)
    if np.isfinite(std).any():
        ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2, linewidth=0)


def _curve_rows(result: Any, names: tuple[str, ...]) -> Rows:
    """One row per N: the mean over seeds of each metric and its sample std (NaN for one seed)."""
    rows: Rows = []
    means = {name: result.mean(name) for name in names}
    stds = {name: result.std(name) for name in names}
    for j, n in enumerate(np.asarray(result.norms, dtype=np.float64)):
        row: dict[str, Any] = {"norm": float(n), "n_seeds": len(result.seeds)}
        for name in names:
            row[name] = float(means[name][j])
            row[f"{name}_std"] = float(stds[name][j])
        rows.append(row)
    return rows


def score_panels(n_norms: int) -> list[int]:
    """Fig. 7's N (indices into the sweep): up to SCORE_PANELS, evenly spread, first and last kept."""
    return sorted({round(v) for v in np.linspace(0, n_norms - 1, min(n_norms, SCORE_PANELS))})


def draw_scores(fig: Any, results: list[Any], options: Any) -> Drawing:
    """Fig. 7: the pre-softmax score histogram (heads and seeds pooled) at a few N of the sweep,
    one panel each on the range its own scores take (the central 99.8%, exact bin sums);
    ``--log-counts`` for a log count axis; ``--at-norm N``: one panel, at that N (the app's view)."""
    from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter

    from isotui.experiments.drift_block.view import score_bars

    result = results[0]
    log = bool(getattr(options, "log_counts", False))
    at = parse_at_norm(getattr(options, "at_norm", None), result.norms)
    picked = score_panels(len(result.norms)) if at is None else [at]
    ncols = 2 if len(picked) > 1 else 1
    nrows = math.ceil(len(picked) / ncols)
    fig.set_figheight(fig.get_figheight() * (1.0 if nrows == 1 else 1.45))
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    rows: Rows = []
    for i, (ax, index) in enumerate(zip(axes, picked, strict=False)):
        norm = float(result.norms[index])
        counts, edges = score_bars(result, index)
        bars = counts[1:-1]
        ax.stairs(bars, edges, fill=True, color=OKABE_ITO[0], alpha=0.85, linewidth=0)
        rows += [
            {"norm": norm, "bar": b, "left": float(edges[b]), "right": float(edges[b + 1]), "count": int(c)}
            for b, c in enumerate(bars)
        ]
        ax.set_title(f"N = {norm:g}", fontsize=8, pad=2)
        if log:
            ax.set_yscale("log")
            # labels at powers of ten only: over less than a decade matplotlib labelled the minor
            # ticks too (2x10^2 ... 6x10^3), one over the other in a small panel
            ax.yaxis.set_major_locator(LogLocator(base=10, numticks=4))
            ax.yaxis.set_minor_formatter(NullFormatter())
        else:
            ax.set_ylim(bottom=0)
            ax.yaxis.set_major_locator(MaxNLocator(3))
        ax.xaxis.set_major_locator(MaxNLocator(3))
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
        if not log:
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        if i % ncols == 0:
            ax.set_ylabel("count")
    for ax in axes[len(picked) :]:
        ax.set_visible(False)
    fig.supxlabel("pre-softmax score q·k/√d_k (central 99.8%)", fontsize=8)
    return Drawing(fig, rows, _drift_runs(result))


def _two_panels(fig: Any, result: Any, panels: list[tuple[str, list[tuple[str, str]]]]) -> None:
    """Side-by-side panels against N: (y label, [(metric, legend label), ...]) each; colours and
    styles in order (the first curve blue and solid, the second vermillion and dashed)."""
    norms = np.asarray(result.norms, dtype=np.float64)
    styles = ((OKABE_ITO[0], "-"), (OKABE_ITO[3], "--"), (OKABE_ITO[2], "-."))
    axes = fig.subplots(1, len(panels))
    for ax, (label, curves) in zip(axes, panels, strict=True):
        for (metric, name), (colour, style) in zip(curves, styles, strict=False):
            _band(
                ax, norms, result.mean(metric), result.std(metric), color=colour, linestyle=style, label=name
            )
        ax.set_xlabel("bias norm N")
        ax.set_ylabel(label)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside upper center", ncols=3, handlelength=1.6)


QK_CURVES = ("q_avg_cos", "k_avg_cos", "q_mean_norm", "k_mean_norm")


def draw_qk(fig: Any, results: list[Any], _options: Any) -> Drawing:
    """Fig. 8: the queries' and keys' avg cos (left) and mean norm (right) against N, mean over
    the seeds (one-std band)."""
    result = results[0]
    _two_panels(
        fig,
        result,
        [
            ("avg cos", [("q_avg_cos", "queries"), ("k_avg_cos", "keys")]),
            ("mean norm", [("q_mean_norm", "queries"), ("k_mean_norm", "keys")]),
        ],
    )
    return Drawing(fig, _curve_rows(result, QK_CURVES), _drift_runs(result))


def _softmax_drawing(fig: Any, result: Any, curves: list[tuple[str, str]], ylabel: str) -> Drawing:
    """Softmax statistics (``curves``: metric and label) against N on a log axis, the uniform
    row's 1/T as a grey line; its rows: the curves per N, with that 1/T beside them."""
    norms = np.asarray(result.norms, dtype=np.float64)
    ax = fig.add_subplot()
    styles = ((OKABE_ITO[3], "-", "o"), (OKABE_ITO[0], "--", "s"), (OKABE_ITO[2], "-.", "^"))
    for (metric, label), (colour, style, marker) in zip(curves, styles, strict=False):
        _band(
            ax,
            norms,
            result.mean(metric),
            result.std(metric),
            color=colour,
            linestyle=style,
            marker=marker,
            markersize=2.5,
            label=label,
        )
    uniform = 1.0 / result.config.seq_len
    ax.axhline(uniform, color=NULL_COLOUR, linewidth=0.8, linestyle=":", label="uniform 1/T")
    values = np.concatenate([result.mean(m) for m, _ in curves] + [np.array([uniform])])
    values = values[np.isfinite(values) & (values > 0)]
    if values.size and values.max() / values.min() > 10:  # a log axis only where it spans decades
        ax.set_yscale("log")
    else:
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3), useOffset=False)
    ax.set_xlabel("bias norm N")
    ax.set_ylabel(ylabel)
    fig.legend(loc="outside upper center", ncols=len(curves) + 1, handlelength=1.8, columnspacing=1.0)
    rows = _curve_rows(result, tuple(metric for metric, _ in curves))
    for row in rows:
        row["uniform"] = uniform
    return Drawing(fig, rows, _drift_runs(result))


def parse_at_norm(text: str | None, norms: Any) -> int | None:
    """``--at-norm N``: the index of that N in the sweep (None when not given); a value the sweep
    does not have is said with the ones it has."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise IsotuiError(f"--at-norm {text!r} is not a number (a bias norm N of the sweep)") from None
    found = np.flatnonzero(np.isclose(np.asarray(norms, dtype=np.float64), value, rtol=0, atol=1e-9))
    if found.size == 0:
        have = ", ".join(f"{n:g}" for n in norms)
        raise IsotuiError(f"--at-norm {text}: the sweep has no N = {value:g} (it has {have})")
    return int(found[0])


def _softmax_positions(fig: Any, result: Any, index: int) -> Drawing:
    """Fig. 9 at one N (``--at-norm``): the softmax row max, median and min at each query
    position, averaged over the batch and heads, then over the seeds (a one-std band)."""
    from isotui.experiments.drift_block.result import SOFTMAX_STATS

    position = np.asarray(result.softmax_position[:, index], dtype=np.float64)  # (S, 3, T)
    mean = position.mean(axis=0)
    std = position.std(axis=0, ddof=1) if position.shape[0] > 1 else np.full_like(mean, np.nan)
    t = np.arange(mean.shape[-1])
    ax = fig.add_subplot()
    styles = ((OKABE_ITO[3], "-"), (OKABE_ITO[0], "--"), (OKABE_ITO[2], "-."))
    for s, (stat, (colour, style)) in enumerate(zip(SOFTMAX_STATS, styles, strict=True)):
        _band(ax, t, mean[s], std[s], color=colour, linestyle=style, label=stat)
    uniform = 1.0 / result.config.seq_len
    ax.axhline(uniform, color=NULL_COLOUR, linewidth=0.8, linestyle=":", label="uniform 1/T")
    values = mean[np.isfinite(mean) & (mean > 0)]
    if values.size and max(values.max(), uniform) / min(values.min(), uniform) > 10:
        ax.set_yscale("log")
    else:
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3), useOffset=False)
    ax.set_xlabel(f"query position (N = {float(result.norms[index]):g})")
    ax.set_ylabel("softmax row value (mean)")
    fig.legend(loc="outside upper center", ncols=4, handlelength=1.8, columnspacing=1.0)
    norm = float(result.norms[index])
    rows: Rows = []
    for j in t:
        row: dict[str, Any] = {"norm": norm, "position": int(j), "n_seeds": position.shape[0]}
        for s, stat in enumerate(SOFTMAX_STATS):
            row[f"softmax_{stat}"] = float(mean[s, j])
            row[f"softmax_{stat}_std"] = float(std[s, j])
        row["uniform"] = uniform
        rows.append(row)
    return Drawing(fig, rows, _drift_runs(result))


def draw_softmax(fig: Any, results: list[Any], options: Any) -> Drawing:
    """Fig. 9: each softmax row's max, median and min, averaged over rows (batch, heads, query
    positions), against N; log scale, the uniform 1/T line. ``--at-norm N``: at that N, against
    the query position."""
    result = results[0]
    index = parse_at_norm(getattr(options, "at_norm", None), result.norms)
    if index is not None:
        return _softmax_positions(fig, result, index)
    curves = [("softmax_max", "max"), ("softmax_median", "median"), ("softmax_min", "min")]
    return _softmax_drawing(fig, result, curves, "softmax row value (mean)")


def draw_softmax_extremes(fig: Any, results: list[Any], _options: Any) -> Drawing:
    """Fig. 10: the softmax extremes over the sequence against N: the largest per-position mean
    row max and the smallest per-position mean row min; log scale, the uniform 1/T line."""
    result = results[0]
    curves = [("softmax_max_peak", "largest max"), ("softmax_min_floor", "smallest min")]
    return _softmax_drawing(fig, result, curves, "softmax value (over positions)")


# --- Godey et al. 2024, Fig. 16: Pearson p-values per model ---------------------------------------


def draw_pearson(fig: Any, results: list[Any], _options: Any) -> Drawing:
    """Fig. 16: Pearson's p of drift norm vs avg cos over layers, per model, log scale, 0.05 line."""
    ax = fig.add_subplot()
    names = short_names([r.model for r in results])
    rows: Rows = [drift_row(result, "pearson_r", "pearson_p") for result in results]
    pvalues = [r["pearson_p"] for r in rows]
    x = np.arange(len(results), dtype=float)
    ax.scatter(x, pvalues, marker="s", color=OKABE_ITO[1], label="Pearson", zorder=3)
    pvalue_axis(fig, ax, pvalues, names)
    ax.set_ylabel("Pearson p (drift vs avg cos)")
    fig.legend(loc="outside upper center", ncols=2, handlelength=1.2)
    return Drawing(fig, rows, _layer_runs(results))


# --- Machina & Mercer 2024: the final norm per dimension -----------------------------------------


def _one_model(results: list[Any], what: str) -> Any:
    models = list(dict.fromkeys(r.model for r in results))
    if len(models) != 1:
        raise IsotuiError(f"{what} draws one model: give one --model")
    return results[0]


def draw_final_norm(fig: Any, results: list[Any], options: Any) -> Drawing:
    """The final norm per hidden dimension k: |x̄_k| before and after it (left) and the
    dimension's share of avg cos before and after (right), against its gain γ_k; the dimensions
    with the largest share before are named."""
    result = _one_model(results, "machina2024-final-norm")
    dims = result.dims
    gain = np.array([d.gain for d in dims])
    panels = (
        (
            r"$|\bar{x}_k|$ (mean component)",
            [abs(d.mean_before) for d in dims],
            [abs(d.mean_after) for d in dims],
        ),
        ("share of avg cos", [d.share_before for d in dims], [d.share_after for d in dims]),
    )
    axes = fig.subplots(1, 2)
    for ax, (label, before, after) in zip(axes, panels, strict=True):
        ax.scatter(
            gain, before, s=4, marker="o", color=OKABE_ITO[0], label="before the norm", linewidths=0, zorder=3
        )
        ax.scatter(gain, after, s=4, marker="s", color=OKABE_ITO[3], label="after", linewidths=0, zorder=2)
        ax.set_xlabel(r"gain $\gamma_k$")
        ax.set_ylabel(label)
    top = sorted(range(len(dims)), key=lambda k: -dims[k].share_before)[:TOP_DIMS]
    for k in top:
        axes[1].annotate(
            str(dims[k].dim),
            (gain[k], dims[k].share_before),
            xytext=(3, 0),
            textcoords="offset points",
            fontsize=7,
            va="center",
        )
    magnitudes = np.abs([d.mean_before for d in dims])
    positive = magnitudes[magnitudes > 0]
    if positive.size and positive.max() / np.median(positive) > 100:  # rogue dimensions: log above a floor
        floor = 10.0 ** math.floor(math.log10(float(np.median(positive))))
        axes[0].set_yscale("symlog", linthresh=floor, linscale=0.5)
        axes[0].set_ylim(bottom=0)
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside upper center",
        ncols=2,
        handlelength=1.0,
        markerscale=2,
    )
    rows: Rows = [
        {
            "model": d.model,
            "module": d.module,
            "dim": d.dim,
            "gain": d.gain,
            "abs_mean_before": abs(d.mean_before),
            "abs_mean_after": abs(d.mean_after),
            "share_before": d.share_before,
            "share_after": d.share_after,
            "named": d.dim in {dims[k].dim for k in top},
        }
        for d in dims
    ]
    return Drawing(fig, rows, list(getattr(options, "probe_runs", [])))


# --- gradients: energy share in the activations' top-k principal directions ---------------------


def parse_ks(text: str | None) -> tuple[int, ...]:
    """``--ks 1,2,4,8`` (each a positive whole number; sorted, duplicates dropped)."""
    if not text:
        return DEFAULT_KS
    try:
        ks = sorted({int(k) for k in text.replace(" ", ",").split(",") if k})
    except ValueError:
        raise IsotuiError(f"--ks {text!r} is not a list of whole numbers (e.g. 1,2,4,8)") from None
    if not ks or ks[0] < 1:
        raise IsotuiError(f"--ks {text!r}: every k must be at least 1")
    return tuple(ks)


def draw_gradient_share(fig: Any, results: list[Any], options: Any) -> Drawing:
    """The share of gradient energy Σ‖P_k g‖² / Σ‖g‖² in the top-k principal directions of the
    activations against k, one line per layer (first dark, last light), beside the same share in a
    seeded random k-dimensional subspace (grey) and k/d (dashed)."""
    import matplotlib

    _one_model(results, "gradient-energy")
    by_k = sorted(results, key=lambda r: r.rows[0].top_k)
    ks = [r.rows[0].top_k for r in by_k]
    layers = [(row.component, row.layer) for row in by_k[0].rows]
    names = [f"{c} {layer}" if c != "model" else str(layer) for c, layer in layers]
    rows: Rows = []
    top = np.full((len(layers), len(ks)), np.nan)
    rand = np.full_like(top, np.nan)
    expected = np.full_like(top, np.nan)
    for j, result in enumerate(by_k):
        for i, row in enumerate(result.rows):
            top[i, j], rand[i, j], expected[i, j] = row.top_share, row.random_share, row.expected_share
            rows.append(
                {
                    "model": row.model,
                    "component": row.component,
                    "layer": row.layer,
                    "dim": row.dim,
                    "k": row.top_k,
                    "top_share": row.top_share,
                    "random_share": row.random_share,
                    "k_over_d": row.expected_share,
                }
            )
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["viridis"]
    norm = matplotlib.colors.Normalize(0, max(len(layers) - 1, 1))
    for i in range(len(layers)):
        ax.plot(ks, rand[i], color=NULL_COLOUR, linewidth=0.6, marker=".", markersize=2, zorder=1)
    for i in range(len(layers)):
        ax.plot(ks, top[i], color=cmap(norm(i)), marker="o", markersize=2, linewidth=1.0, zorder=3)
    dims = sorted({row.dim for row in by_k[0].rows})
    for d in dims:
        ax.plot(ks, [k / d for k in ks], color="#000000", linestyle="--", linewidth=0.8, zorder=2)
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=cmap(0.5), marker="o", markersize=2, label="top-k PCs"),
        Line2D([], [], color=NULL_COLOUR, linewidth=0.6, marker=".", markersize=2, label="random k-subspace"),
        Line2D([], [], color="#000000", linestyle="--", linewidth=0.8, label="k/d"),
    ]
    fig.legend(handles=handles, loc="outside upper center", ncols=3, handlelength=1.6, columnspacing=1.0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("k (principal directions of the activations)")
    ax.set_ylabel("share of gradient energy")
    ax.set_ylim(0, 1.02)
    colorbar = fig.colorbar(
        matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, fraction=0.08, pad=0.03, label="layer"
    )
    ticks = list(range(0, len(layers), math.ceil(len(layers) / 8)))
    colorbar.set_ticks(ticks, labels=[names[i] for i in ticks])
    return Drawing(fig, rows, list(getattr(options, "probe_runs", [])))


# --- ablate: what removing a direction costs, and the geometry after ------------------------------


def _site_labels(rows: list[Any]) -> list[str]:
    """The x labels of the sites: the hidden state each gives where every site is a block's
    output (what the right panel's x axis counts), else the module names."""
    sites = list(dict.fromkeys(r.site for r in rows))
    layer = {r.site: r.layer for r in rows}
    if all(layer[s] >= 0 for s in sites):
        return [str(layer[s]) for s in sites]
    from isotui.experiments.ablate.result import site_names

    names = site_names(sites, 12, shared=False)  # tick labels: the part that differs
    return [names[s] for s in sites]


def draw_ablation(fig: Any, results: list[Any], options: Any) -> Drawing:
    """Left: the loss each removal costs at each site (filled) beside the same-size random edit
    (hollow, joined to it: the yardstick); right: avg cos by hidden state, clean and after each
    edit (the edited site marked). A model with no LM head has no loss: the left panel is the
    final state's change (1 - cos) instead."""
    from matplotlib.lines import Line2D

    result = _one_model(results, "ablation")
    if not result.rows:
        raise IsotuiError(f"the ablation of {result.model!r} has no rows (no site was removed)")
    has_loss = any(math.isfinite(r.delta_loss) for r in result.rows)
    panel, field = ("delta_loss", "delta_loss") if has_loss else ("final_change", "final_change")
    removals = list(dict.fromkeys(r.remove for r in result.rows))
    sites = list(dict.fromkeys(r.site for r in result.rows))
    colour = {rem: OKABE_ITO[j % len(OKABE_ITO)] for j, rem in enumerate(removals)}
    marker = {rem: ("o", "s", "^", "D", "v", "P")[j % 6] for j, rem in enumerate(removals)}
    width = 0.8 / len(removals)
    left, right = fig.subplots(1, 2)
    rows: Rows = []
    clean_loss = result.rows[0].loss
    if has_loss:
        rows.append(_ablation_row("clean_loss", result.model, value=clean_loss))
    for r in result.rows:
        x = sites.index(r.site) + (removals.index(r.remove) - (len(removals) - 1) / 2) * width
        value, random = getattr(r, field), getattr(r, f"{field}_random")
        c = colour[r.remove]
        left.plot([x, x], [random, value], color=c, linewidth=0.6, zorder=2)
        left.scatter([x], [random], marker=marker[r.remove], facecolors="none", edgecolors=c, zorder=3)
        left.scatter([x], [value], marker=marker[r.remove], color=c, zorder=4)
        rows.append(_ablation_row(panel, r.model, r.site, r.layer, r.remove, value=value, random=random))
    left.axhline(0.0, color=NULL_COLOUR, linewidth=0.6, zorder=1)
    labels = _site_labels(result.rows)
    slanted = sum(len(t) + 2 for t in labels) * 0.06 > fig.get_figwidth() * 0.4
    left.set_xticks(
        range(len(sites)), labels, rotation=30 if slanted else 0, ha="right" if slanted else "center"
    )
    left.set_xlim(-0.6, len(sites) - 0.4)
    by_layer = all(r.layer >= 0 for r in result.rows)
    left.set_xlabel("site (its layer)" if by_layer else "site")
    left.set_ylabel("Δ loss (nats/token)" if has_loss else "final change (1 − cos)")
    if has_loss:
        left.set_title(f"clean loss {clean_loss:.3f}", fontsize=7, pad=2)
    layers = list(range(len(result.avg_cos)))
    right.plot(layers, result.avg_cos, color="#000000", linewidth=1.4, zorder=3)
    rows += [
        _ablation_row("avg_cos", result.model, remove="clean", layer=h, value=v)
        for h, v in zip(layers, result.avg_cos, strict=True)
    ]
    for r, curve in zip(result.rows, result.curves, strict=True):
        c = colour[r.remove]
        right.plot(layers, curve.avg_cos, color=c, linewidth=0.8, alpha=0.85, zorder=2)
        if 0 <= r.layer < len(layers):
            right.scatter([r.layer], [curve.avg_cos[r.layer]], marker=marker[r.remove], color=c, zorder=4)
        rows += [
            _ablation_row("avg_cos", r.model, r.site, r.layer, r.remove, layer=h, value=v)
            for h, v in zip(layers, curve.avg_cos, strict=True)
        ]
    right.set_xlabel("layer (0: embeddings)" if fig.get_figwidth() > 5 else "layer")
    right.set_ylabel("avg cos")
    from matplotlib.ticker import MaxNLocator

    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles = [Line2D([], [], color="#000000", linewidth=1.4, label="clean")]
    handles += [
        Line2D([], [], color=colour[rem], marker=marker[rem], linewidth=0.8, label=rem) for rem in removals
    ]
    handles.append(
        Line2D([], [], color=NULL_COLOUR, marker="o", markerfacecolor="none", linewidth=0, label="random")
    )
    fig.legend(
        handles=handles,
        loc="outside upper center",
        ncols=min(len(handles), 4 if fig.get_figwidth() < 5 else 8),
        handlelength=1.4,
        columnspacing=1.0,
    )
    return Drawing(fig, rows, list(getattr(options, "probe_runs", [])))


def _ablation_row(
    panel: str,
    model: str,
    site: str = "",
    site_layer: int | str = "",
    remove: str = "",
    *,
    layer: int | str = "",
    value: float,
    random: float | str = "",
) -> dict[str, Any]:
    """One plotted number of the ablation figure (its CSV row): empty where the panel has none."""
    return {
        "panel": panel,
        "model": model,
        "site": site,
        "site_layer": site_layer,
        "remove": remove,
        "layer": layer,
        "value": value,
        "random": random,
    }
