"""The lab's Drift block tab: the untrained block under a drift of norm N (Godey et al. Figs. 6-10).

Settings are typed as ``key=value`` pairs (``hidden=256 heads=4 norms=0:30:16 seeds=0,1
block=pre-ln``); the table has one row per N (mean ± std over the seeds); ``m`` cycles the
figures; the table cursor picks the N that Figs. 7 and 9 show. The figure shown is kept on the lab
screen (``drift_figure``), as the score histograms' log counts are (``log_counts``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import DataTable, Input, Static
from textual_plotext import PlotextPlot

from isotui.tui.lab_tab import LabTab, SettingsBox
from isotui.tui.plots import FitPlot, clear, sized

if TYPE_CHECKING:
    from isotui.experiments.drift_block import DriftBlockConfig
    from isotui.tui.figure_export import ScreenFigure

FIGURES = (
    "Fig. 6: input and output mean norm and avg_cos",
    "Fig. 7: pre-softmax scores at the cursor's N",
    "Fig. 8: query and key avg_cos and mean norms",
    "Fig. 9: softmax max, median, min per position at the cursor's N",
    "Fig. 10: softmax extremes over the sequence",
)
COLUMNS = (
    ("N", "norm"),
    ("in avg_cos", "in_avg_cos"),
    ("out avg_cos", "out_avg_cos"),
    ("in norm", "in_mean_norm"),
    ("out norm", "out_mean_norm"),
    ("q avg_cos", "q_avg_cos"),
    ("k avg_cos", "k_avg_cos"),
    ("cos(Qm,Km)", "cos_qk_bar"),
    ("p max", "softmax_max"),
    ("p min", "softmax_min"),
    ("entropy", "entropy"),
)


def compose_drift() -> ComposeResult:
    yield SettingsBox(
        placeholder="settings (BERT-base default): hidden=768 heads=12 intermediate=3072 init_std=0.02 "
        "batch=16 seq_len=512 norms=0:30:31 seeds=0; enter runs",
        id="drift-input",
    )
    yield Static(id="drift-info")
    yield DataTable(id="drift-table", cursor_type="row", zebra_stripes=True)
    with Horizontal(classes="lab-charts"):
        yield FitPlot(id="drift-fig")


def parse_settings(text: str) -> DriftBlockConfig:
    """A :class:`DriftBlockConfig` from ``key=value`` pairs; a bad pair is one sentence."""
    from isotui.errors import IsotuiError
    from isotui.experiments.drift_block import DriftBlockConfig, parse_norms, parse_seeds
    from isotui.experiments.drift_block.config import SETTINGS

    values: dict[str, Any] = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        name = name.replace("-", "_")
        if not sep or name not in SETTINGS:
            raise IsotuiError(
                f"drift-block setting {item!r} is not NAME=VALUE with NAME one of {', '.join(SETTINGS)}"
            )
        try:
            if name == "norms":
                values[name] = parse_norms(value)
            elif name == "seeds":
                values[name] = parse_seeds(value)
            elif name == "init_std":
                values[name] = float(value)
            elif name in ("block", "measure"):
                values[name] = value
            else:
                values[name] = int(value)
        except ValueError:
            raise IsotuiError(f"drift-block setting {item!r}: {value!r} is not a number") from None
    return DriftBlockConfig(**values)


def run_drift(screen: Any) -> bool:
    """Queue the settings in the box; False (and one sentence in ``key=value`` words) if refused."""
    from isotui.errors import IsotuiError
    from isotui.experiments.drift_block.experiment import DriftBlockRequest

    app: Any = screen.app
    text = screen.query_one("#drift-input", Input).value
    try:
        config = parse_settings(text)
        if app.spec_defaults.get("device", "auto") != "auto":
            from dataclasses import replace

            config = replace(config, device=app.spec_defaults["device"])
    except IsotuiError as exc:
        from isotui.tui.wording import in_box_terms

        app.notify(in_box_terms(str(exc)), severity="error")
        return False
    app.submit_request(DriftBlockRequest(config))
    screen.status(
        f"queued drift-block: d={config.hidden}, {config.heads} heads, {len(config.norms)} norms, "
        f"{len(config.seeds)} seed(s) (jobs: main screen)"
    )
    return True


def cycle_drift(screen: Any) -> None:
    screen.drift_figure = (getattr(screen, "drift_figure", 0) + 1) % len(FIGURES)
    plot_drift(screen)


def _cell(mean: float, std: float, digits: int) -> str:
    if not math.isfinite(mean):
        return "-"
    text = f"{mean:.{digits}f}"
    return text + (f"±{std:.{digits}f}" if math.isfinite(std) else "")


def show_drift(screen: Any) -> None:
    app: Any = screen.app
    result = app.lab_results.get("drift-block")
    table = screen.query_one("#drift-table", DataTable)
    info = screen.query_one("#drift-info", Static)
    table.clear(columns=True)
    if result is None:
        info.update("the untrained block under drift: type settings above (or keep the defaults) and press r")
        plot_drift(screen)
        return
    c = result.config
    star = "no crossing in the sweep" if not math.isfinite(result.n_star) else f"{result.n_star:.2f}"
    if math.isfinite(result.n_star_std):
        star += f" ± {result.n_star_std:.2f}"
    source = "cache" if all(result.from_cache) else f"{result.seconds:.1f} s"
    info.update(
        f"d={c.hidden}, {c.heads} heads, init std {c.init_std}, {c.batch}x{c.seq_len} tokens, "
        f"{c.describe_block()}, seeds {', '.join(map(str, result.seeds))} · fixed point N* = {star} "
        f"· {source}" + "".join(f"\n{note}" for note in result.notes)
    )
    table.add_columns(*(label for label, _ in COLUMNS))
    for i, norm in enumerate(result.norms):
        cells = [f"{norm:g}"]
        for _, name in COLUMNS[1:]:
            digits = 2 if "norm" in name or name == "entropy" else 3
            cells.append(_cell(result.mean(name)[i], result.std(name)[i], digits))
        table.add_row(*cells)
    plot_drift(screen)


def plot_drift(screen: Any) -> None:
    from isotui.figures import draw_histogram

    app: Any = screen.app
    result = app.lab_results.get("drift-block")
    plot = screen.query_one("#drift-fig", PlotextPlot)
    plt = clear(plot)
    figure = getattr(screen, "drift_figure", 0)
    colours = screen.app_colours()
    plt.title(FIGURES[figure] + ("" if result else ": run it (r)"))
    if result is not None:
        norms = result.norms.tolist()
        row = min(max(screen.query_one("#drift-table", DataTable).cursor_row, 0), len(norms) - 1)

        def line(name: str, label: str, colour: str, side: str = "left") -> None:
            plt.plot(
                norms, result.mean(name).tolist(), label=label, color=colour, marker="braille", yside=side
            )

        if figure == 0:
            line("in_mean_norm", "in norm", colours[0])
            line("out_mean_norm", "out norm", colours[1])
            line("in_avg_cos", "in avg_cos", colours[2], "right")
            line("out_avg_cos", "out avg_cos", colours[3 % len(colours)], "right")
            if math.isfinite(result.n_star):
                plt.vline(result.n_star, colours[-1])
        elif figure == 1:
            from isotui.experiments.drift_block.view import score_bars

            counts, edges = score_bars(result, row)  # the range of this N's scores
            title = f"{FIGURES[1]} (N={norms[row]:g}, heads and seeds pooled)"
            log = getattr(screen, "log_counts", False)

            def histogram(plt: Any, size: tuple[int, int]) -> None:
                draw_histogram(plt, counts, edges, colours[0], title, log=log, rows=size[1])

            sized(plot, histogram)
            return
        elif figure == 2:
            line("q_avg_cos", "q avg_cos", colours[0])
            line("k_avg_cos", "k avg_cos", colours[1])
            line("q_mean_norm", "q norm", colours[2], "right")
            line("k_mean_norm", "k norm", colours[3 % len(colours)], "right")
        elif figure == 3:
            pos = result.softmax_position_mean()[row]  # (3, T)
            xs = list(range(pos.shape[1]))
            plt.title(f"{FIGURES[3]} (N={norms[row]:g})")
            for k, (label, colour) in enumerate(zip(("max", "median", "min"), colours, strict=False)):
                plt.plot(xs, pos[k].tolist(), label=label, color=colour, marker="braille")
            if np.all(pos > 0):  # the minimum is orders of magnitude below the maximum
                plt.yscale("log")
        else:
            line("softmax_max_peak", "max over positions", colours[0])
            line("softmax_max", "row max (mean)", colours[1])
            line("softmax_min", "row min (mean)", colours[2], "right")
            line("softmax_min_floor", "min over positions", colours[3 % len(colours)], "right")
    plot.refresh()


# the drift block tab's figures (FIGURES, in order) as isotui figure draws them
DRIFT_FIGURES = (
    "isotui.paper_figures:draw_drift_block",
    "isotui.paper_figures_probes:draw_scores",
    "isotui.paper_figures_probes:draw_qk",
    "isotui.paper_figures_probes:draw_softmax",
    "isotui.paper_figures_probes:draw_softmax_extremes",
)


class DriftTab(LabTab):
    """The untrained block under drift (its view: the functions above)."""

    KIND = "drift-block"
    BOX = "#drift-input"
    TABLE = "#drift-table"
    KEY, NAME, TITLE, SHORT = "3", "drift", "Drift block", "Drift"
    TOOLTIP = "tab: the untrained block under drift"
    LAB_KEYS = ("log_counts",)
    WIDGET_KEYS = (("↑ ↓", "the N of Figs. 7 and 9"),)

    def compose(self) -> ComposeResult:
        yield from compose_drift()

    def show(self) -> None:
        show_drift(self.lab)

    @on(DataTable.RowHighlighted, "#drift-table")
    def _row(self, _event: DataTable.RowHighlighted) -> None:
        plot_drift(self.lab)

    def run(self) -> bool:
        return bool(run_drift(self.lab))

    def cycle(self) -> None:
        cycle_drift(self.lab)

    def replot(self) -> None:
        plot_drift(self.lab)

    def figure(self) -> ScreenFigure | str:
        """The drift block's figure on screen as ``isotui figure godey2024-fig6`` ... ``fig10`` draw it
        (Figs. 7 and 9 at the table cursor's N, as ``--at-norm``)."""
        from isotui.tui.figure_export import ScreenFigure

        result = self.result()
        if result is None:
            return "no plot to save yet: run the drift block (r)"
        shown = getattr(self.lab, "drift_figure", 0)
        norms = result.norms.tolist()
        row = min(max(self.query_one("#drift-table", DataTable).cursor_row, 0), len(norms) - 1)
        draw, options = DRIFT_FIGURES[shown], {}
        if shown in (1, 3):
            options["at_norm"] = repr(float(norms[row]))
        return ScreenFigure(f"drift-block-fig{6 + shown}", draw, [result], options)
