"""The experiments' terminal views: the rich tables and plotext figures the CLI prints (and the
Python API's ``Result.tables``), one :class:`View` per registered experiment, found by the name
its :class:`~isotui.experiments.base.Experiment` gives (``view``), so experiments never import
rich, plotext or the CLI.

A view turns one request's result (and the parsed flags: ``--heads``, ``--metric``, ``--plot``...)
into renderables; optionally closes with tables over every result (``run --wide``), says a line
on stderr per result, or draws its own progress bar.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from isotui.errors import IsotuiError
from isotui.figures import draw_trajectory
from isotui.render import DUPLICATE_MARK, _f, duplicates_caption, shorten
from isotui.terminal import literal, markup, plain

if TYPE_CHECKING:
    from isotui.experiments.ablate.result import AblationResult
    from isotui.experiments.checkpoints import CheckpointSeries
    from isotui.experiments.final_norm import FinalNormResult
    from isotui.experiments.gradients import GradientResult
    from isotui.experiments.qk_dynamics import DynamicsResult

TOP = 5  # final-norm: the dimensions listed by their share of avg_cos
# ablate: a site's name and a removal's, shortened in their middle (the table fits 80 columns)
SITE_WIDTH, REMOVE_WIDTH = 22, 12


@dataclass(frozen=True)
class View:
    """How the CLI shows one experiment's results.

    ``tables(result, args, width)``: the renderables of one request's result, in print order;
    ``closing(results, args, width)``: more after every result (None: nothing);
    ``note(result, args)``: a line for stderr once the result is there (None: nothing);
    ``progress(err, name, args)``: a context manager yielding the progress callback (None: the
    CLI's bar); ``highlight``: rich's highlighting of printed text; ``blank_line``: a blank line
    after each table (never after a figure: a :class:`rich.text.Text`).
    """

    tables: Callable[[Any, Any, int], list[Any]]
    closing: Callable[[list[Any], Any, int], list[Any]] | None = None
    note: Callable[[Any, Any], str | None] | None = None
    progress: Callable[[Any, str, Any], Any] | None = None
    highlight: bool = True
    blank_line: bool = True
    whole: bool = False  # tables() takes a request's whole list of results (final-norm)


# --- layers (isotui run) ----------------------------------------------------------------------------


def _layer_tables(result: Any, _args: Any, width: int) -> list[Any]:
    from isotui.render import result_table

    return [result_table(result, width)]


def _wide(results: list[Any], args: Any, width: int) -> list[Any]:
    """``--wide METRIC``: one layer x model table after the models' own."""
    from isotui.render import wide_table

    metric = getattr(args, "wide", None)
    return [wide_table(results, metric, width)] if metric else []


def _layer_note(result: Any, args: Any) -> str | None:
    """``--verbose``: where the result came from and where the time went."""
    from isotui.render import timing_note

    if not getattr(args, "verbose", False):
        return None
    note = timing_note(result.meta, result.write_seconds)
    where = "from the cache" if result.from_cache else "computed"
    return f"{result.model}: {where}" + (f"; {note}" if note and not result.from_cache else "")


# --- attention and qk-dynamics ----------------------------------------------------------------------


def _attention_tables(result: Any, args: Any, width: int) -> list[Any]:
    from isotui.render_attention import attention_table

    return [attention_table(result, width, per_head=bool(getattr(args, "heads", False)))]


def _dynamics_tables(result: Any, args: Any, width: int) -> list[Any]:
    """The tables, then the trajectory figure (``--plot``) as one more renderable."""
    from isotui.experiments.qk_dynamics import parse_plot
    from isotui.render_attention import dynamics_tables

    tables: list[Any] = list(dynamics_tables(result))
    plot = parse_plot(getattr(args, "plot", None))
    if plot is not None:
        from rich.text import Text

        basis = getattr(args, "basis", "qk")
        tables.append(Text.from_ansi(trajectory_text(result, *plot, basis=basis, width=min(width, 100))))
    return tables


# --- checkpoints, final-norm, gradients --------------------------------------------------------------


def heatmap(result: CheckpointSeries, metric: str) -> Any:
    """A rich table: layers down, checkpoints across, each cell shaded by its value (dark to light
    over the grid's range)."""
    from rich.style import Style
    from rich.text import Text

    from isotui.render import Table

    labels, values = result.grid(metric)
    finite = values[np.isfinite(values)]
    lo, hi = (float(finite.min()), float(finite.max())) if len(finite) else (0.0, 1.0)
    meta = result.results[0].meta
    table = Table.titled(
        markup(
            f"[bold]{literal(shorten(result.series, 50))}[/]  {metric} by layer (rows) and step (columns)  "
            f"{literal(meta.get('data'))}, {meta.get('n_samples')} samples",
            style="table.title",
        )
    )
    table.add_column("layer", justify="right")
    for step, ckpt in zip(result.steps(), result.checkpoints, strict=True):
        table.add_column(f"{step}{DUPLICATE_MARK if ckpt.duplicate_of else ''}", justify="right")
    for i, label in enumerate(labels):
        cells = []
        for v in values[i]:
            if not math.isfinite(v):
                cells.append(Text("-"))
                continue
            t = (v - lo) / (hi - lo) if hi > lo else 0.5
            grey = int(40 + 170 * t)
            fg = "black" if t > 0.55 else "white"
            cells.append(Text(f"{v:.3f}", style=Style(bgcolor=f"rgb({grey},{grey},{grey})", color=fg)))
        table.add_row(label, *cells)
    caption = f"darker = lower, lighter = higher ({lo:.3f} .. {hi:.3f}); columns: " + ", ".join(
        f"{s}={shorten(c.label, 24)}" for s, c in zip(result.steps(), result.checkpoints, strict=True)
    )
    return table.captioned(plain(caption + duplicates_caption(result.checkpoints), style="table.caption"))


def _source(result: FinalNormResult) -> str:
    """Where the numbers came from: ``cache``, or the seconds they took."""
    return "cache" if result.from_cache else f"{result.meta.get('seconds', 0):.1f} s"


def final_norm_table(result: FinalNormResult) -> Any:
    """Before/after metrics, then the dimensions that carry avg_cos before the norm."""
    from rich.console import Group

    from isotui.experiments.final_norm import gain_correlation, signed
    from isotui.render import Table

    metrics = Table.titled(
        markup(
            f"[bold]{literal(result.model)}[/]  {literal(result.module)} ({result.kind})  "
            f"{literal(result.meta.get('data'))}, {result.meta.get('n_samples')} samples  "
            f"({_source(result)})",
            style="table.title",
        )
    )
    for h in ("", "n", "avg_cos", "centered", "drift", "norm", "isoscore", "erank", "top_pc"):
        metrics.add_column(h, justify="right")
    for label, s in (("before", result.before), ("after", result.after)):
        metrics.add_row(
            label,
            str(s.n_vectors),
            _f(s.avg_cos),
            _f(s.avg_cos_centered),
            _f(s.drift_norm, 3),
            _f(s.mean_norm, 3),
            _f(s.isoscore),
            _f(s.eff_rank, 1),
            _f(s.top_pc_share, 3),
        )
    dims = Table.titled(f"top {TOP} dimensions by share of avg_cos before the norm")
    for h in ("dim", "x̄ before", "x̄ after", "gain γ", "bias β", "share before", "share after"):
        dims.add_column(h, justify="right")
    for r in sorted(result.dims, key=lambda r: -r.share_before)[:TOP]:
        dims.add_row(
            str(r.dim),  # a small value keeps its sign: -0.0004, not -0.000
            *(
                signed(v, 3)
                for v in (r.mean_before, r.mean_after, r.gain, r.bias, r.share_before, r.share_after)
            ),
        )
    if math.isfinite(result.rho_mean_gain) or math.isfinite(result.rho_share_gain):
        correlations = (
            f"{gain_correlation(result.rho_mean_gain, result.p_mean_gain, 'Spearman(|x̄_k|, γ_k)', 3)}; "
            f"{gain_correlation(result.rho_share_gain, result.p_share_gain, 'Spearman(share_k, γ_k)', 3)}"
        )
    else:  # an untrained norm: said once, in the verdict below
        correlations = "Spearman(|x̄_k|, γ_k), Spearman(share_k, γ_k): none (every γ_k the same)"
    return Group(metrics, dims.captioned(correlations + "\n" + result.verdict()))


def per_block_table(results: list[FinalNormResult]) -> Any:
    """One row per block output norm: what it does to avg_cos and IsoScore, and its top dims."""

    from isotui.experiments.final_norm import signed
    from isotui.render import Table

    first = results[0]
    table = Table.titled(
        markup(
            f"[bold]{literal(first.model)}[/]  every block's output norm  "
            f"{literal(first.meta.get('data'))}, {first.meta.get('n_samples')} samples  ({_source(first)})",
            style="table.title",
        )
    )
    for h in (
        "layer",
        "avg_cos before",
        "after",
        "isoscore before",
        "after ",
        "top dim",
        "share",
        "→",
        "gain",
    ):
        table.add_column(h, justify="right")
    for i, r in enumerate(results, 1):
        top = max(r.dims, key=lambda d: d.share_before)
        table.add_row(
            str(i),
            _f(r.before.avg_cos),
            _f(r.after.avg_cos),
            _f(r.before.isoscore),
            _f(r.after.isoscore),
            str(top.dim),
            signed(top.share_before, 3),
            signed(top.share_after, 3),
            signed(top.gain, 4),
        )
    return table.captioned(
        "layer L: the norm that ends block L (its output is hidden-state row L); top dim: the dimension "
        "carrying most of avg_cos before the norm, its share before and after, and its gain γ"
    )


def token_types_table(result: Any) -> Any:
    """One row per layer and direction: the token types carrying it, largest share first."""
    from isotui.render import Table

    m = result.meta
    table = Table.titled(
        markup(
            f"[bold]{literal(result.model)}[/]  {literal(m.get('data'))}, {m.get('n_samples')} samples  "
            f"({'cache' if result.from_cache else format(m.get('seconds', 0), '.1f') + ' s'})",
            style="table.title",
        )
    )
    for h, justify in (
        ("layer", "right"),
        ("direction", "left"),
        ("token types: share (count, share of tokens)", "left"),
    ):
        table.add_column(h, justify=justify)  # type: ignore[arg-type]
    groups: dict[tuple[str, int, str], list[Any]] = {}
    for r in result.rows:
        groups.setdefault((r.component, r.layer, r.direction), []).append(r)
    for (component, layer, direction), rows in groups.items():
        where = str(layer) if component == "model" else f"{component} {layer}"
        types = "  ".join(
            f"{literal(repr(r.token))} {_f(r.share, 3)} ({r.count}, {_f(r.freq_share, 3)})" for r in rows
        )
        table.add_row(where, direction, markup(types))
    return table.captioned(
        "share: the type's part of the layer's mean direction (sum of its tokens' projections on it) "
        "or of its top rogue dimension K (sum of its tokens' unit-vector coordinate K); all types' "
        "shares sum to 1: a share well above the type's share of tokens marks a carrier"
    )


def gradients_table(result: GradientResult) -> Any:
    """One row per layer: the gradients' geometry, then where their energy lies."""

    from isotui.render import Table

    m = result.meta
    k = result.rows[0].top_k if result.rows else 0
    table = Table.titled(
        markup(
            f"[bold]{literal(result.model)}[/]  {m.get('lm_class')} ({result.objective} LM)  "
            f"{literal(m.get('data'))}, {m.get('n_samples')} samples, "
            f"loss {_f(m.get('loss_per_token', math.nan), 3)} nats/token "
            f"over {m.get('loss_tokens')} targets  "
            f"({'cache' if result.from_cache else format(m.get('seconds', 0), '.1f') + ' s'})",
            style="table.title",
        )
    )
    for h in ("layer", "n", "zero", "grad cos", "grad drift", "grad norm", "act cos"):
        table.add_column(h, justify="right")
    for h in (f"top-{k} share", "random", "k/d", f"act var top-{k}", "best"):
        table.add_column(h, justify="right")
    for r in result.rows:
        table.add_row(
            str(r.layer),
            str(r.n_vectors),
            str(r.n_zero),
            _f(r.grad_avg_cos),
            _g(r.grad_drift_norm),
            _g(r.grad_mean_norm),
            _f(r.act_avg_cos),
            _f(r.top_share, 3),
            _f(r.random_share, 3),
            _f(r.expected_share, 3),
            _f(r.act_top_var, 3),
            _f(r.grad_top_share, 3),
        )
    return table.captioned(plain("\n".join(result.notes), style="table.caption"))


def _signed(x: float, digits: int) -> str:
    """A change keeps its sign (``+0.0085``, ``-0.0021``); ``-`` where there is none."""
    return "-" if x is None or not math.isfinite(x) else f"{x:+.{digits}f}"


def ablation_table(result: AblationResult) -> Any:
    """One row per site and removal: the loss it costs beside a random edit of its size, the
    final state's change and the last layer's avg_cos kept; the clean loss said once, in the
    title, so the table fits 80 columns (every column, the random edit's final change too:
    ``--csv``)."""
    from isotui.render import Table

    m = result.meta
    loss = result.rows[0].loss if result.rows else math.nan
    said = (
        f"clean loss {_f(loss, 3)} nats/token over {m.get('loss_tokens')} targets ({result.objective} LM)"
        if math.isfinite(loss)
        else "no LM head: no loss"
    )
    source = "cache" if result.from_cache else format(m.get("seconds", 0), ".1f") + " s"
    table = Table.titled(
        markup(
            f"[bold]{literal(result.model)}[/]  {literal(m.get('data'))}, {m.get('n_samples')} samples, "
            f"{said}  ({source})",
            style="table.title",
        )
    )
    table.add_column("site", justify="left", no_wrap=True)
    table.add_column("remove", justify="left", no_wrap=True)
    for h in ("Δ loss", "random", "final", "recovery"):
        table.add_column(h, justify="right", no_wrap=True)
    from isotui.experiments.ablate.result import site_names

    names = site_names([r.site for r in result.rows], SITE_WIDTH)
    for r in result.rows:
        table.add_row(
            literal(names[r.site]),
            literal(shorten(r.remove, REMOVE_WIDTH)),
            _signed(r.delta_loss, 4),
            _signed(r.delta_loss_random, 4),
            _f(r.final_change, 4),
            _f(r.recovery, 3),
        )
    return table.captioned(
        plain(
            "Δ loss: the loss with the site's direction removed minus the clean loss; random: the same "
            "edit along random directions of its size; final: mean 1 - cos of the last hidden state, "
            "clean against edited; recovery: the last layer's avg_cos after the edit over its clean "
            "value" + "".join(f"\n{note}" for note in result.notes),
            style="table.caption",
        )
    )


def _g(x: float) -> str:
    """Gradient norms span decades: three significant digits."""
    return "-" if x is None or not math.isfinite(x) else f"{x:.3g}"


def trajectory_text(result: DynamicsResult, layer: int, head: int, *, basis: str, width: int = 100) -> str:
    """The trajectories of one head as a plotext figure (a string), for the headless command."""
    import plotext as plt

    sites = [i for i, s in enumerate(result.sites) if s[1] == layer and s[2] == "self"]
    if not sites:
        raise IsotuiError(f"--plot {layer}: no such layer; layers are {sorted({s[1] for s in result.sites})}")
    heads = {r.head for r in result.rows if r.layer == layer}
    if head not in heads:
        raise IsotuiError(f"--plot {layer}:{head}: no such head; heads are 0..{max(heads)}")
    plt.clear_figure()
    plt.plotsize(width, 24)
    draw_trajectory(plt, result, sites[0], head, basis, size=(width, 24))
    return str(plt.build())


# --- drift-block ------------------------------------------------------------------------------------


def _drift_tables(result: Any, _args: Any, width: int) -> list[Any]:
    from isotui.experiments.drift_block.view import result_table

    return [result_table(result, width)]


def _drift_note(result: Any, args: Any) -> str | None:
    """How many seeds came from the cache, and how long the rest took (not with ``--quiet``)."""
    if getattr(args, "quiet", False):
        return None
    cached = sum(result.from_cache)
    parts = [f"{cached} of {len(result.seeds)} seeds from the cache"] if cached else []
    if cached < len(result.seeds):
        parts.append(f"{result.seconds:.1f} s computing on {result.device}")
    return ", ".join(parts)


def _drift_progress(err: Any, _name: str, args: Any) -> Any:
    """A bar counting (seed, N) steps."""
    from contextlib import contextmanager

    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    @contextmanager
    def bar_context() -> Any:
        columns = (
            TextColumn("[bold]drift-block"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} (seed, N)"),
            TimeElapsedColumn(),
        )
        with Bar(*columns, console=err, transient=True, disable=bool(args.quiet)) as bar:
            task = bar.add_task("drift-block", total=None)

            def on_progress(ev: Any) -> None:
                bar.update(task, completed=ev.samples_done, total=ev.samples_total)

            yield on_progress

    return bar_context()


VIEWS: dict[str, View] = {
    "layers": View(_layer_tables, closing=_wide, note=_layer_note),
    "attention": View(_attention_tables),
    "qk-dynamics": View(_dynamics_tables),
    "checkpoints": View(lambda result, args, _width: [heatmap(result, args.metric)]),
    "final-norm": View(
        lambda found, args, _width: [
            per_block_table(found) if args.every_layer else final_norm_table(found[0])
        ],
        whole=True,
    ),
    "gradients": View(lambda result, _args, _width: [gradients_table(result)]),
    "token-types": View(lambda result, _args, _width: [token_types_table(result)]),
    "ablate": View(lambda result, _args, _width: [ablation_table(result)]),
    "drift-block": View(
        _drift_tables, note=_drift_note, progress=_drift_progress, highlight=False, blank_line=False
    ),
}


def view_of(name: str) -> View:
    """The view an experiment names (a registered experiment without one is a bug)."""
    return VIEWS[name]


def view_for(experiment: Any) -> View:
    """The view of ``experiment``: the one it names in :data:`VIEWS` (its own name when it names
    none), else its CSV rows as a table (so a new experiment prints, exports and shows in
    ``isotui show`` with no view of its own: one may be added here later)."""
    found = VIEWS.get(experiment.view or experiment.name)
    if found is not None:
        return found

    def tables(result: Any, _args: Any, width: int) -> list[Any]:
        return [
            rows_table(
                experiment.name, experiment.rows(result if isinstance(result, list) else [result]), width
            )
        ]

    return View(tables)


def rows_table(title: str, rows: list[dict[str, Any]], _width: int) -> Any:
    """Rows (dicts in column order) as a table: numbers to 4 significant digits (the table
    folds its columns to the console's width)."""
    from isotui.render import Table

    table = Table(title=title, title_justify="left")
    columns = list(rows[0]) if rows else []
    for column in columns:
        table.add_column(column, justify="right" if isinstance(rows[0][column], int | float) else "left")
    for row in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else literal(str(v)) for v in row.values()))
    return table


def result_tables(command: str, results: list[Any], options: Any, width: int) -> list[Any]:
    """What the CLI prints for the results of ``command`` (``run`` or an experiment's name),
    in order: each result's tables, then the closing ones; ``options``: the experiment's
    parameters (or the parsed flags). The Python API's ``Result.tables``."""
    from isotui.experiments.registry import get

    experiment = get(command)
    view = view_for(experiment)
    # a view of a request's whole list (final-norm): the results of one request, as one
    groups = [results] if view.whole else results
    tables = [t for group in groups for t in view.tables(group, options, width)]
    if results and view.closing:
        tables += view.closing(results, options, width)
    return tables


def show(tables: list[Any], console: Any = None) -> None:
    """Print ``tables`` (to ``console``, default a new rich console)."""
    from isotui.terminal import console as new_console

    out = console or new_console()
    for table in tables:
        out.print(table)


def html(tables: list[Any]) -> str:
    """``tables`` as HTML, coloured as in the terminal (Jupyter's display)."""
    import io

    from isotui.terminal import console as new_console

    out = new_console(record=True, width=200, file=io.StringIO())
    show(tables, out)
    return str(out.export_html(inline_styles=True))
