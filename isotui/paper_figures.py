"""The papers' figures as files (``isotui figure NAME --out PATH``), drawn with matplotlib.

Each named figure turns measured results (a layer run per model, or a checkpoint series) into a
matplotlib figure and the rows of exactly the numbers it plots (the CSV written beside it).
Paper defaults: a journal column's width (3.3 in single, 6.9 in double), 8 pt text (9 pt titles),
the Okabe-Ito colour-blind-safe palette (viridis for heatmaps), TrueType fonts embedded in PDF
(``pdf.fonttype`` 42) and text kept as text in SVG (``svg.fonttype`` none: editable; a user's
``--style`` may set ``path``), and no dates in the files, so the same numbers give the same bytes.

matplotlib is imported only here, inside the functions: ``isotui run`` and the app never load it.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from isotui import paper_figures_dynamics, paper_figures_probes
from isotui.errors import IsotuiError
from isotui.figure_style import (
    MARKERS,
    NULL_COLOUR,
    OKABE_ITO,
    Drawing,
    Rows,
    _layer_runs,
    _legend,
    drift_key,
    drift_row,
    layer_positions,
    pvalue_axis,
    short_names,
)

WIDTHS = {"single": 3.3, "double": 6.9}  # inches: one column, the full page of a two-column paper
HEIGHTS = {"single": 2.4, "double": 2.6}  # grown by a long legend's extra rows (JSON: height_in)
FORMATS = (".pdf", ".svg", ".png")
DEFAULT_DIMS = (8, 32, 128, 768)
# A PNG's pixels are drawn into one RGBA buffer (4 bytes each) before they are encoded: 2**28
# pixels (16,384 x 16,384, 1 GiB) is far beyond print (a 6.9 in figure at 1,200 dpi is 8,280
# pixels wide) and still drawn in seconds; --dpi 100000 asked for 79 billion (an internal
# MemoryError, issue 30).
MAX_PIXELS = 2**28


@dataclass(frozen=True)
class PaperFigure:
    """One named figure: what it shows, the experiment its results come from (``layers``,
    ``checkpoints`` or None: computed from formulas alone) and how it is drawn."""

    name: str
    help: str
    experiment: str | None
    draw: Callable[[Any, list[Any], Any], Drawing]  # (Figure, results, options) -> Drawing


def rc_params(dpi: int) -> dict[str, Any]:
    """The paper defaults as matplotlib settings (a ``--style`` file is applied on top)."""
    from cycler import cycler

    return {
        "pdf.fonttype": 42,
        "ps.fonttype": 42,
        "svg.fonttype": "none",
        "svg.hashsalt": "isotui",
        "font.size": 8,
        "axes.titlesize": 9,
        "axes.labelsize": 8,
        "xtick.labelsize": 8,
        "ytick.labelsize": 8,
        "legend.fontsize": 8,
        "legend.frameon": False,
        "axes.prop_cycle": cycler(color=list(OKABE_ITO)),
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.linewidth": 0.6,
        "xtick.major.width": 0.6,
        "ytick.major.width": 0.6,
        "lines.linewidth": 1.2,
        "lines.markersize": 3.5,
        "image.cmap": "viridis",
        "figure.dpi": dpi,
        "savefig.dpi": dpi,
    }


# --- Godey et al. 2024, Fig. 1-4: layer-wise avg_cos per model ----------------------------------


def draw_layers(fig: Any, results: list[Any], options: Any) -> Drawing:
    """avg_cos by layer, one line per model (encoder then decoder for encoder-decoders), and the
    isotropic null's 95th percentile for each hidden size shown."""
    depth = bool(getattr(options, "depth", False))
    ax = fig.add_subplot()
    rows: Rows = []
    nulls: dict[int, float] = {}
    names = short_names([r.model for r in results])
    two_parts = two_parts_said = False
    for i, result in enumerate(results):
        xs = layer_positions(len(result.rows), depth)
        components = list(dict.fromkeys(r.component for r in result.rows))
        for x, r in zip(xs, result.rows, strict=True):
            rows.append(
                {
                    "model": result.model,
                    "component": r.component,
                    "layer": r.layer,
                    "x": x,
                    "avg_cos": r.avg_cos,
                    "dim": r.dim,
                    "null_p95": r.null_p95,
                }
            )
            nulls.setdefault(r.dim, r.null_p95)
        label = names[i]
        two_parts = two_parts or len(components) > 1
        ax.plot(xs, [r.avg_cos for r in result.rows], marker=MARKERS[i % len(MARKERS)], label=label)
        if len(components) > 1:  # where the decoder starts, said at the top of the line
            first = next(j for j, r in enumerate(result.rows) if r.component == components[1])
            divider = xs[first] - (xs[1] - xs[0]) / 2
            ax.axvline(divider, color=NULL_COLOUR, linewidth=0.5, linestyle=":")
            if not two_parts_said:
                two_parts_said = True
                at_top = ax.get_xaxis_transform()  # x in data, y in axes fraction
                side = {"transform": at_top, "va": "top", "fontsize": 6.5, "color": NULL_COLOUR}
                ax.text(divider, 0.99, f"{components[0]} ", ha="right", **side)
                ax.text(divider, 0.99, f" {components[1]}", ha="left", **side)
    styles = ("--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)))
    for k, (dim, p95) in enumerate(sorted(nulls.items())):  # one line per hidden size shown
        label = "isotropic p95" + (f" (d={dim})" if len(nulls) > 1 else "")
        style = styles[k % len(styles)]
        ax.axhline(p95, color=NULL_COLOUR, linewidth=0.8, linestyle=style, label=label, zorder=1)
    where = "normalised depth" if depth else "layer"
    ax.set_xlabel(f"{where} (encoder, then decoder)" if two_parts else where)
    ax.set_ylabel("avg cos")
    if not depth:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(fig, ax, len(results) + len(nulls))
    return Drawing(fig, rows, _layer_runs(results))


# --- Godey et al. 2024, Fig. 5 and 16: drift vs avg_cos p-values per model -----------------------


def draw_pvalues(fig: Any, results: list[Any], _options: Any) -> Drawing:
    """Spearman (permutation) and Pearson p-values of drift norm vs avg_cos over layers, per model,
    on a log scale with the 0.05 line. Spearman's marker says how its p was found: filled where
    exact, hollow where a Monte Carlo estimate, a down-pointing triangle at the bound where no
    Monte Carlo resample was as extreme (hollow) or where a proven bound stands in for an exact
    count out of reach (filled): the true p lies below it."""
    ax = fig.add_subplot()
    names = short_names([r.model for r in results])
    stats = ("spearman_rho", "spearman_p", "spearman_p_method", "pearson_r", "pearson_p")
    rows: Rows = [
        drift_row(r, *stats) | {"spearman_p_bound": r.drift[drift_key(r)].spearman_p_floored} for r in results
    ]
    spearman, pearson = [r["spearman_p"] for r in rows], [r["pearson_p"] for r in rows]
    methods = [r["spearman_p_method"] for r in rows]
    x = np.arange(len(results), dtype=float)
    colour = OKABE_ITO[0]
    hollow = {"facecolors": "none", "edgecolors": colour}
    kinds: dict[str, tuple[str, dict[str, Any]]] = {
        "exact": ("Spearman", {"marker": "o", "color": colour}),
        "monte-carlo": ("Spearman (Monte Carlo)", {"marker": "o", **hollow}),
        "monte-carlo-bound": ("Spearman (upper bound)", {"marker": "v", **hollow}),
        "bound": ("Spearman (proven bound)", {"marker": "v", "color": colour}),
    }
    for method, (label, style) in kinds.items():
        at = [i for i, m in enumerate(methods) if (m if m in kinds else "exact") == method]
        if at:
            ax.scatter(x[at] - 0.12, [spearman[i] for i in at], label=label, zorder=3, **style)
    ax.scatter(x + 0.12, pearson, marker="s", color=OKABE_ITO[1], label="Pearson", zorder=3)
    pvalue_axis(fig, ax, spearman + pearson, names)
    ax.set_ylabel("p-value (drift vs avg cos)")
    fig.legend(loc="outside upper center", ncols=3, handlelength=1.2)
    return Drawing(fig, rows, _layer_runs(results))


# --- Godey et al. 2024, Fig. 6: the drift block's input and output, and N* ----------------------

DRIFT_BLOCK_CURVES = ("in_avg_cos", "out_avg_cos", "in_mean_norm", "out_mean_norm")


def draw_drift_block(fig: Any, results: list[Any], _options: Any) -> Drawing:
    """The drift block's avg cos (left) and mean norm (right) of its input and output against the
    bias norm N, mean over the seeds (a band of one std for several), and the fixed point N*."""
    result = results[0]
    norms = np.asarray(result.norms, dtype=np.float64)
    columns = {name: (result.mean(name), result.std(name)) for name in DRIFT_BLOCK_CURVES}
    rows: Rows = []
    for j, n in enumerate(norms):
        row: dict[str, Any] = {"norm": float(n)}
        for name, (mean, std) in columns.items():
            row[name] = float(mean[j])
            row[f"{name}_std"] = float(std[j])
        row["n_star"] = result.n_star
        rows.append(row)
    left, right = fig.subplots(1, 2)
    for ax, what, label in ((left, "avg_cos", "avg cos"), (right, "mean_norm", "mean norm")):
        for side, colour, style in (("in", OKABE_ITO[0], "-"), ("out", OKABE_ITO[3], "--")):
            mean, std = columns[f"{side}_{what}"]
            ax.plot(norms, mean, color=colour, linestyle=style, label="input" if side == "in" else "output")
            if np.isfinite(std).any():
                ax.fill_between(norms, mean - std, mean + std, color=colour, alpha=0.2, linewidth=0)
        if math.isfinite(result.n_star):
            ax.axvline(result.n_star, color=NULL_COLOUR, linewidth=0.8, linestyle=":", label="N*")
        ax.set_xlabel("bias norm N")
        ax.set_ylabel(label)
    fig.legend(*left.get_legend_handles_labels(), loc="outside upper center", ncols=3, handlelength=1.6)
    runs = [{"seed": s, "key": k} for s, k in zip(result.seeds, result.keys, strict=True)]
    return Drawing(fig, rows, runs)


# --- Godey et al. 2024, Fig. 17 and 18: the isotropic null ---------------------------------------


def null_density(cos: np.ndarray, dim: int) -> np.ndarray:
    """Density of cos(u, v) for independent uniform u, v on the sphere in R^dim: (cos + 1) / 2 is
    Beta((d-1)/2, (d-1)/2) (Godey et al. 2024, App. B)."""
    from scipy.stats import beta

    a = (dim - 1) / 2.0
    return np.asarray(beta.pdf((cos + 1.0) / 2.0, a, a) / 2.0, dtype=np.float64)


def parse_dims(text: str | None) -> tuple[int, ...]:
    """``--dims 8,32,768`` (each at least 2); the default when not given."""
    if not text:
        return DEFAULT_DIMS
    try:
        dims = tuple(int(d) for d in text.replace(" ", ",").split(",") if d)
    except ValueError:
        raise IsotuiError(f"--dims {text!r} is not a list of whole numbers (e.g. 8,32,768)") from None
    if not dims or min(dims) < 2:
        raise IsotuiError(f"--dims {text!r}: every dimension must be at least 2")
    return dims


def draw_null_density(fig: Any, _results: list[Any], options: Any) -> Drawing:
    """The isotropic cosine density for several d (--dims)."""
    ax = fig.add_subplot()
    cos = np.linspace(-1.0, 1.0, 801)
    rows: Rows = []
    for i, dim in enumerate(parse_dims(getattr(options, "dims", None))):
        density = null_density(cos, dim)
        rows += [{"d": dim, "cos": float(c), "density": float(p)} for c, p in zip(cos, density, strict=True)]
        ax.plot(cos, density, color=OKABE_ITO[i % len(OKABE_ITO)], label=f"d = {dim}")
    ax.set_xlabel("cosine of two isotropic vectors")
    ax.set_ylabel("density")
    ax.set_xlim(-1, 1)
    ax.set_xticks([-1.0, -0.5, 0.0, 0.5, 1.0])
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", handlelength=1.6)
    return Drawing(fig, rows)


def draw_null_p95(fig: Any, results: list[Any], _options: Any) -> Drawing:
    """The isotropic null's 95th percentile against d, with each measured model's avg_cos (mean
    over its layers of that hidden size) as a point at its d."""
    from isotui.core.null import null_cos_quantile

    ax = fig.add_subplot()
    names = short_names([r.model for r in results])
    dims = [m.dim for r in results for m in r.rows] or [768]
    top = max(4096, 2 * max(dims))
    spaced = np.geomspace(2, top, 160).round().astype(int)
    grid = np.unique(np.concatenate([spaced, dims]))  # the models' own d on the curve too
    p95 = [null_cos_quantile(int(d)) for d in grid]
    rows: Rows = [
        {"series": "isotropic p95", "model": "", "d": int(d), "avg_cos": v}
        for d, v in zip(grid, p95, strict=True)
    ]
    ax.plot(grid, p95, color=NULL_COLOUR, linestyle="--", label="isotropic p95")
    for i, result in enumerate(results):
        by_dim: dict[int, list[float]] = {}
        for r in result.rows:
            if math.isfinite(r.avg_cos):
                by_dim.setdefault(r.dim, []).append(r.avg_cos)
        points = [(d, float(np.mean(v))) for d, v in sorted(by_dim.items())]
        rows += [{"series": "model", "model": result.model, "d": d, "avg_cos": v} for d, v in points]
        ax.scatter(
            [d for d, _ in points],
            [v for _, v in points],
            marker=MARKERS[i % len(MARKERS)],
            color=OKABE_ITO[i % len(OKABE_ITO)],
            label=names[i],
            zorder=3,
        )
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator([2**k for k in range(1, int(math.log2(top)) + 1, 2)]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(lambda v, _pos: f"{int(v)}")
    ax.set_xlabel("dimension d")
    ax.set_ylabel("avg cos")
    ax.set_ylim(bottom=min(0.0, *(v for r in rows for v in [r["avg_cos"]] if math.isfinite(v))))
    _legend(fig, ax, len(results) + 1)
    return Drawing(fig, rows, _layer_runs(results))


# --- Machina & Mercer 2024: a layer metric along training ---------------------------------------


def _thin(n: int, most: int) -> list[int]:
    """Evenly spaced tick positions of ``n`` columns (every one, or every k-th from the first),
    at most ``most``."""
    return list(range(0, n, math.ceil(n / most)))


def draw_heatmap(fig: Any, results: list[Any], options: Any) -> Drawing:
    """A layer metric (--metric) of a checkpoint series as a layer x step heatmap."""
    metric = getattr(options, "metric", "avg_cos")
    series = results[0]
    labels, grid, steps, rows = _heatmap_rows(series, metric)
    ax = fig.add_subplot()
    image = ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest")
    cols = _thin(len(steps), 7)
    ticks = [f"{steps[j]:,}" for j in cols]
    slanted = sum(len(t) + 2 for t in ticks) * 0.06 > fig.get_figwidth() * 0.6  # 8 pt: ~0.06 in a letter
    ax.set_xticks(cols, ticks, rotation=30 if slanted else 0, ha="right" if slanted else "center")
    layer_ticks = _thin(len(labels), 10)
    ax.set_yticks(layer_ticks, [labels[i] for i in layer_ticks])
    ax.set_xlabel("training step")
    ax.set_ylabel("layer")
    ax.spines[["top", "right"]].set_visible(True)
    _hatch_duplicates(ax, series.checkpoints, len(labels))
    fig.colorbar(image, ax=ax, label=metric.replace("_", " "), fraction=0.08, pad=0.03)
    return Drawing(fig, rows, _series_runs(series))


def _hatch_duplicates(ax: Any, checkpoints: list[Any], n_layers: int) -> None:
    """Hatch the columns of checkpoints that serve a later step's weights (``duplicate_of``:
    EleutherAI/pythia #205), and say so under the axes."""
    from matplotlib.patches import Rectangle

    flagged = [j for j, c in enumerate(checkpoints) if c.duplicate_of]
    for j in flagged:
        ax.add_patch(
            Rectangle(
                (j - 0.5, -0.5),
                1,
                n_layers,
                fill=False,
                hatch="///",
                edgecolor="white",
                linewidth=0,
                gid=f"duplicate:{checkpoints[j].label}",
            )
        )
    if flagged:
        ax.set_title(f"hatched: {len(flagged)} checkpoints serving a later step's weights", fontsize="small")


def _heatmap_rows(series: Any, metric: str) -> tuple[list[str], np.ndarray, list[int], Rows]:
    """A series' grid of ``metric`` (layers x checkpoints), its steps and its CSV rows."""
    labels, grid = series.grid(metric)
    steps = series.steps()
    rows: Rows = [
        {
            "series": series.series,
            "checkpoint": ckpt.label,
            "step": step,
            "duplicate_of": ckpt.duplicate_of or "",
            "layer": label,
            metric: float(v),
        }
        for j, (ckpt, step) in enumerate(zip(series.checkpoints, steps, strict=True))
        for label, v in zip(labels, grid[:, j], strict=True)
    ]
    return labels, grid, steps, rows


def _series_runs(series: Any) -> list[dict[str, Any]]:
    return [
        {"model": c.model, "checkpoint": c.label, "step": s, "key": r.key}
        for c, s, r in zip(series.checkpoints, series.steps(), series.results, strict=True)
    ]


def draw_curves(fig: Any, results: list[Any], options: Any) -> Drawing:
    """A layer metric (--metric) of a checkpoint series against the step, one line per layer,
    coloured from the first layer (dark) to the last (light)."""
    import matplotlib

    metric = getattr(options, "metric", "avg_cos")
    series = results[0]
    labels, grid, steps, rows = _heatmap_rows(series, metric)
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["viridis"]
    norm = matplotlib.colors.Normalize(0, max(len(labels) - 1, 1))
    for i in range(len(labels)):
        ax.plot(steps, grid[i], color=cmap(norm(i)), marker="o", markersize=2, linewidth=1.0)
    positive = [s for s in steps if s > 0]
    if positive and max(positive) >= 100 * min(positive):  # Pythia's 0, 1, 2, 4 ... 143000
        ax.set_xscale("symlog", linthresh=min(positive))
    ax.set_xlabel("training step")
    ax.set_ylabel(metric.replace("_", " "))
    colorbar = fig.colorbar(
        matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, fraction=0.08, pad=0.03, label="layer"
    )
    ticks = _thin(len(labels), 8)
    colorbar.set_ticks(ticks, labels=[labels[i] for i in ticks])
    return Drawing(fig, rows, _series_runs(series))


def _probe(name: str) -> Callable[[Any, list[Any], Any], Drawing]:
    """A draw function of :mod:`isotui.paper_figures_probes`."""
    drawing: Callable[[Any, list[Any], Any], Drawing] = getattr(paper_figures_probes, name)
    return drawing


def _dynamics(maker: str, arg: str) -> Callable[[Any, list[Any], Any], Drawing]:
    """A drawing of :mod:`isotui.paper_figures_dynamics`."""
    drawer: Callable[[Any, list[Any], Any], Drawing] = getattr(paper_figures_dynamics, maker)(arg)
    return drawer


def _dynamics_figures() -> list[PaperFigure]:
    """Godey et al. 2024 Figs. 11-15, 19-23: queries and keys along a checkpoint series
    (drawn in :mod:`isotui.paper_figures_dynamics`; each paper number with its own basis or curve)."""
    out = []
    for numbers, basis, what in (
        ((11, 12), "qk", "the SVD of queries and keys"),
        ((19, 20), "q", "the SVD of queries only"),
        ((21, 22), "k", "the SVD of keys only"),
    ):
        for n in numbers:
            text = f"Godey et al. 2024 Fig. {n}: Q-mean/K-mean trajectories per head in {what} (-c, --layer)"
            out.append(
                PaperFigure(f"godey2024-fig{n}", text, "qk-dynamics", _dynamics("trajectory_drawer", basis))
            )
    for n, attr, what in (
        (13, "cos_qk_bar", "cos(Q-mean, K-mean)"),
        (14, "cos_qk_bar", "cos(Q-mean, K-mean)"),
        (23, "dot_qk_bar", "Q-mean . K-mean"),
        (15, "entropy", "attention entropy"),
    ):
        text = f"Godey et al. 2024 Fig. {n}: {what} per layer (heads averaged) along a checkpoint series (-c)"
        out.append(
            PaperFigure(f"godey2024-fig{n}", text, "qk-dynamics", _dynamics("layer_curves_drawer", attr))
        )
    return sorted(out, key=lambda f: int(f.name.removeprefix("godey2024-fig")))


def _order(name: str) -> tuple[int, int, str]:
    """--list order: Godey et al. by figure number, then the others by name."""
    number = name.removeprefix("godey2024-fig")
    return (0, int(number), "") if number.isdigit() else (1, 0, name)


FIGURES: dict[str, PaperFigure] = {
    f.name: f
    for f in (
        PaperFigure(
            "godey2024-fig1",
            "Godey et al. 2024 Fig. 1: layer-wise avg cos per model, the isotropic null (--depth)",
            "layers",
            draw_layers,
        ),
        *(
            PaperFigure(
                f"godey2024-fig{n}", f"Godey et al. 2024 Fig. {n}: as fig1, {what}", "layers", draw_layers
            )
            for n, what in (
                (2, "for character and byte models (preset godey2024_fig2_characters)"),
                (3, "for vision and speech Transformers (presets godey2024_fig3_vision, _speech)"),
                (4, "for convolutional networks (preset godey2024_fig4_cnn)"),
            )
        ),
        PaperFigure(
            "godey2024-fig5",
            "Godey et al. 2024 Fig. 5: Spearman and Pearson p of drift vs avg cos per model",
            "layers",
            draw_pvalues,
        ),
        PaperFigure(
            "godey2024-fig6",
            "Godey et al. 2024 Fig. 6: the drift block's input and output avg cos and norm against N, N*",
            "drift-block",
            draw_drift_block,
        ),
        PaperFigure(
            "godey2024-fig7",
            "Godey et al. 2024 Fig. 7: the drift block's score histograms at a few N (--log-counts)",
            "drift-block",
            _probe("draw_scores"),
        ),
        PaperFigure(
            "godey2024-fig8",
            "Godey et al. 2024 Fig. 8: the drift block's query and key avg cos and mean norms against N",
            "drift-block",
            _probe("draw_qk"),
        ),
        PaperFigure(
            "godey2024-fig9",
            "Godey et al. 2024 Fig. 9: the drift block's softmax row max, median, min against N (--at-norm)",
            "drift-block",
            _probe("draw_softmax"),
        ),
        PaperFigure(
            "godey2024-fig10",
            "Godey et al. 2024 Fig. 10: the drift block's softmax extremes over the sequence against N",
            "drift-block",
            _probe("draw_softmax_extremes"),
        ),
        PaperFigure(
            "godey2024-fig16",
            "Godey et al. 2024 Fig. 16: Pearson p of drift vs avg cos per model, the 0.05 line",
            "layers",
            _probe("draw_pearson"),
        ),
        PaperFigure(
            "godey2024-fig17",
            "Godey et al. 2024 Fig. 17: the isotropic cosine density for several d (--dims)",
            None,
            draw_null_density,
        ),
        PaperFigure(
            "godey2024-fig18",
            "Godey et al. 2024 Fig. 18: the isotropic p95 against d, the models' avg cos as points",
            "layers",
            draw_null_p95,
        ),
        PaperFigure(
            "machina2024-heatmap",
            "Machina & Mercer 2024: a layer metric (--metric) along a checkpoint series, layer x step",
            "checkpoints",
            draw_heatmap,
        ),
        PaperFigure(
            "machina2024-curves",
            "Machina & Mercer 2024: a layer metric (--metric) along a checkpoint series, a line per layer",
            "checkpoints",
            draw_curves,
        ),
        PaperFigure(
            "machina2024-final-norm",
            "Machina & Mercer 2024: the final norm per dimension, |x̄_k| and avg cos share against γ_k",
            "final-norm",
            _probe("draw_final_norm"),
        ),
        PaperFigure(
            "gradient-energy",
            "gradients' energy share in the activations' top-k PCs against k (--ks), random k-subspace, k/d",
            "gradients",
            _probe("draw_gradient_share"),
        ),
        PaperFigure(
            "ablation",
            "ablate: the loss each removal (--remove) costs per site beside a random edit of its size, "
            "and avg cos by layer after each",
            "ablate",
            _probe("draw_ablation"),
        ),
        *_dynamics_figures(),
    )
}
FIGURES = dict(sorted(FIGURES.items(), key=lambda item: _order(item[0])))


def find(name: str) -> PaperFigure:
    """The named figure, or one sentence naming the way to list them."""
    if name not in FIGURES:
        from isotui.suggest import did_you_mean

        guess = did_you_mean(name, FIGURES)
        raise IsotuiError(
            f"unknown figure {name!r}; {guess + ' (' if guess else ''}`isotui figure --list` names them"
            + (")" if guess else "")
        )
    return FIGURES[name]


def check_out(path: str) -> Path:
    """``--out``: a .pdf, .svg or .png in a folder that can be written, said before any run."""
    import os

    out = Path(path).expanduser()
    if out.suffix.lower() not in FORMATS:
        raise IsotuiError(f"--out {path} must end in .pdf, .svg or .png")
    if out.is_dir():
        raise IsotuiError(f"--out {path} is a folder; give a file name")
    folder = out.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise IsotuiError(f"cannot write --out {path}: {folder} is not a folder isotui can write to")
    from isotui.store.files import check_output

    check_output(out, "--out")  # a socket, a block device: refused as the CSV export refuses them
    return out


SIDECAR_DIGESTS = "sha256"  # the JSON's record of the bytes isotui wrote: {"csv": hex, "json": hex}


def sidecar_bytes(rows: list[dict[str, Any]], payload: dict[str, Any]) -> tuple[bytes, bytes]:
    """PATH.csv and PATH.json as written: the plotted rows, and the payload with the SHA-256 of
    the CSV and of the JSON itself (with that one digest written as ``""``), so that a redraw can
    tell the files isotui wrote from the same files changed since (:func:`check_sidecars`)."""
    import csv
    import hashlib
    import json

    from isotui.store.export import _clean

    if not rows:
        raise IsotuiError("the figure plots no numbers: nothing to write beside it")
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    csv_data = text.getvalue().encode("utf-8")
    record = _clean({**payload, SIDECAR_DIGESTS: {"csv": hashlib.sha256(csv_data).hexdigest(), "json": ""}})
    unsigned = json.dumps(record, indent=2).encode("utf-8")
    record[SIDECAR_DIGESTS]["json"] = hashlib.sha256(unsigned).hexdigest()
    return csv_data, json.dumps(record, indent=2).encode("utf-8")


def _changed_since_written(path: Path, recorded: Any, json_bytes: bytes | None = None) -> bool:
    """Whether ``path`` (a regular file) is not byte-identical to what an earlier figure wrote
    there, as its JSON recorded (``recorded``: the hex digest; the JSON's own is taken over its
    bytes with that digest as ``""``). No digest recorded (a JSON of an isotui before digests):
    not changed, as such files were treated before."""
    import hashlib

    if not isinstance(recorded, str) or not recorded:
        return False
    try:
        data = path.read_bytes() if json_bytes is None else json_bytes
    except OSError:
        return True  # unreadable: not known to be isotui's
    if json_bytes is not None:
        quoted = f'"{recorded}"'.encode()
        if data.count(quoted) != 1:
            return True
        data = data.replace(quoted, b'""')
    return hashlib.sha256(data).hexdigest() != recorded


def check_sidecars(out: Path, force: bool = False) -> None:
    """PATH.csv and PATH.json go beside the figure: before any run (so before anything is
    written), refuse in one sentence a sidecar that cannot be written (a folder, a socket...), a
    sidecar that is the figure itself (a symlink), and, unless ``force`` (``--force``), replacing
    a regular file there that is not exactly what an earlier ``isotui figure`` wrote: a file of
    the user's (no figure's JSON names it), or an earlier figure's CSV or JSON changed since (a
    line appended: its bytes differ from the SHA-256 that figure's JSON recorded). A FIFO or a
    device there is written through, as exports are."""
    import json
    import os
    import stat

    from isotui.store.files import OutputRefused, check_distinct, check_output

    csv_path, json_path = out.with_suffix(".csv"), out.with_suffix(".json")
    beside = f"--out {out} writes its numbers beside it to {csv_path.name} and {json_path.name}, and"
    for path in (csv_path, json_path):
        try:
            check_output(path)
        except OutputRefused as exc:
            raise IsotuiError(
                f"{beside} {path} cannot be written ({exc.reason}): move it or choose another --out"
            ) from None
    sidecars: list[tuple[str, str | os.PathLike[str] | None]] = [
        ("--out", out),
        ("the CSV beside it", csv_path),
        ("the JSON beside it", json_path),
    ]
    check_distinct(sidecars, advice="move that link, or choose another --out")
    if force:
        return
    try:
        json_bytes = json_path.read_bytes()
        earlier = json.loads(json_bytes)
        ours = isinstance(earlier, dict) and "figure" in earlier and earlier.get("csv") == csv_path.name
    except (OSError, ValueError):
        json_bytes, earlier, ours = b"", None, False
    digests = earlier.get(SIDECAR_DIGESTS) if ours and isinstance(earlier, dict) else None
    digests = digests if isinstance(digests, dict) else {}
    for path in (csv_path, json_path):
        try:
            regular = stat.S_ISREG(os.stat(path).st_mode)
        except OSError:
            continue  # not there (or a dangling link): nothing to lose
        if not regular:
            continue
        if not ours:
            raise IsotuiError(
                f"{beside} {path} is a file of yours, not an earlier figure's: move it, choose another "
                "--out, or give --force to replace it"
            )
        is_json = path == json_path
        if _changed_since_written(path, digests.get(path.suffix[1:]), json_bytes if is_json else None):
            raise IsotuiError(
                f"{beside} {path} was changed after an earlier figure wrote it (it is not the file "
                "isotui wrote there): move it, choose another --out, or give --force to replace it"
            )


def check_pixels(width_in: float, height_in: float, dpi: int, out_format: str) -> None:
    """Refuse a PNG of more than :data:`MAX_PIXELS` pixels, saying the largest ``--dpi`` that
    fits (a PDF or SVG is drawn as vectors: ``--dpi`` does not size it)."""
    if out_format != "png":
        return
    wide, high = math.ceil(width_in * dpi), math.ceil(height_in * dpi)
    if wide * high <= MAX_PIXELS:
        return
    largest = math.floor(math.sqrt(MAX_PIXELS / (width_in * height_in)))
    while math.ceil(width_in * largest) * math.ceil(height_in * largest) > MAX_PIXELS:
        largest -= 1
    raise IsotuiError(
        f"--dpi {dpi:,} makes a PNG of {wide:,} x {high:,} pixels ({wide * high * 4 / 2**30:,.1f} GiB to "
        f"draw), more than isotui draws ({MAX_PIXELS / 1e6:,.0f} million pixels); the largest --dpi "
        f"that fits this {width_in:g} x {height_in:g} in figure is {largest:,}"
    )


def render(figure: PaperFigure, results: list[Any], options: Any, out_format: str) -> tuple[bytes, Drawing]:
    """Draw ``figure`` from ``results`` and save it as ``out_format`` (pdf, svg, png): the file's
    bytes (no dates: same numbers, same bytes) and the drawing (its rows and runs)."""
    import matplotlib
    import matplotlib.style
    from matplotlib.figure import Figure

    from isotui import __version__

    width = getattr(options, "width", "single")
    dpi = int(getattr(options, "dpi", 300))
    style = getattr(options, "style", None)
    if style and not Path(style).expanduser().is_file():
        raise IsotuiError(f"--style {style} is not a file; give a matplotlib style file (.mplstyle)")
    with matplotlib.rc_context(rc_params(dpi)):  # type: ignore[arg-type]
        if style:
            try:
                matplotlib.style.use(str(Path(style).expanduser()))
            except (OSError, ValueError) as exc:
                raise IsotuiError(f"--style {style} could not be read as a matplotlib style: {exc}") from None
        fig = Figure(figsize=(WIDTHS[width], HEIGHTS[width]), dpi=dpi, layout="constrained")
        check_pixels(fig.get_figwidth(), fig.get_figheight(), dpi, out_format)  # before the drawing
        drawing = figure.draw(fig, results, options)
        check_pixels(fig.get_figwidth(), fig.get_figheight(), dpi, out_format)  # a legend made it taller
        metadata: dict[str, Any] = {"Creator": f"isotui {__version__}", "CreationDate": None}
        if out_format == "svg":
            metadata = {"Creator": f"isotui {__version__}", "Date": None}
        elif out_format == "png":
            metadata = {"Software": f"isotui {__version__}"}
        buffer = io.BytesIO()
        fig.savefig(buffer, format=out_format, dpi=dpi, metadata=metadata)
    return buffer.getvalue(), drawing
