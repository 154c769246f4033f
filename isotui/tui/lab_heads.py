"""The lab's Heads tab: ``isotui experiment attention`` on the selected model: cos(Q̄,K̄), Q̄·K̄,
norms and the softmax's sharpness per layer (heads averaged, each head as a point), and the
pre-softmax score histogram of the layer under the cursor (Godey et al. Figs. 7, 11-15)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import DataTable, Static

from isotui.render import shorten
from isotui.tui.lab_tab import PerModelLabTab
from isotui.tui.lab_tab import fmt as _f
from isotui.tui.plots import FitPlot, draw_head_metric, draw_score_histogram

if TYPE_CHECKING:
    from isotui.spec import RunSpec

# Q-mean, K-mean: the mean query and key of a head (the papers' Q̄, K̄; a combining macron is
# drawn as its own cell by plotext and some terminals, so the app spells it out)
HEAD_METRICS = (
    ("cos_qk_bar", "cos(Q-mean, K-mean)"),
    ("dot_qk_bar", "Q-mean·K-mean"),
    ("q_bar_norm", "|Q-mean|"),
    ("k_bar_norm", "|K-mean|"),
    ("q_avg_cos", "query avg_cos"),
    ("k_avg_cos", "key avg_cos"),
    ("softmax_max", "softmax row max"),
    ("entropy", "attention entropy (nats)"),
)


class HeadsTab(PerModelLabTab):
    """Queries, keys and attention per layer and head of the selected model."""

    KIND = "attention"
    TABLE = "#heads-table"
    KEY, NAME, TITLE, SHORT = "1", "heads", "Heads", "Heads"
    TOOLTIP = "tab: queries and keys per head"
    LAB_KEYS = ("log_counts",)
    WIDGET_KEYS = (("↑ ↓", "the layer whose score histogram shows"),)

    def __init__(self, title: str, *, id: str) -> None:
        super().__init__(title, id=id)
        self.metric = 0  # which of HEAD_METRICS the plot shows

    def compose(self) -> ComposeResult:
        yield Static(id="heads-info")
        table: DataTable[str] = DataTable(id="heads-table", cursor_type="row", zebra_stripes=True)
        table.add_columns(
            "layer", "heads", "cos(Qm,Km)", "range", "Qm·Km", "|Qm|", "|Km|", "p max", "p med", "entropy"
        )
        yield table
        with Horizontal(classes="lab-charts"):
            yield FitPlot(id="heads-plot")
            yield FitPlot(id="hist-plot")

    def show(self) -> None:
        from isotui.experiments.attention import summarize

        result = self.result()
        info = self.query_one("#heads-info", Static)
        table = self.query_one("#heads-table", DataTable)
        table.clear()
        if result is None:
            who = self.host.selected or "no model selected (pick one on the main screen)"
            info.update(f"{who}: press r to measure queries, keys and attention per layer and head")
            self.plot(None, [])
            return
        source = "cache" if result.from_cache else f"{result.meta.get('seconds', 0):.1f} s"
        info.update(
            f"{shorten(result.model, 50)} · {result.meta.get('data')} · {result.meta.get('n_samples')} "
            f"samples · {source} · Qm, Km: a head's mean query, key · range: lowest..highest "
            "over heads · layer L: block whose output is row L"
        )
        summary = summarize(result)
        many = len({s.component for s in summary}) > 1
        for s in summary:
            label = (
                (f"{s.component} " if many else "") + str(s.layer) + (" x" if s.attention == "cross" else "")
            )
            table.add_row(
                label,
                str(s.heads),
                _f(s.cos_qk_bar),
                f"{_f(s.cos_qk_bar_min, 2)}..{_f(s.cos_qk_bar_max, 2)}",
                _f(s.dot_qk_bar, 2),
                _f(s.q_bar_norm, 2),
                _f(s.k_bar_norm, 2),
                _f(s.softmax_max),
                _f(s.softmax_median, 4),
                _f(s.entropy, 2),
            )
        self.plot(result, summary)

    def plot(self, result: Any, summary: list[Any]) -> None:
        plot = self.query_one("#heads-plot", FitPlot)
        hist = self.query_one("#hist-plot", FitPlot)
        colours = self.lab.app_colours()
        row = self.query_one("#heads-table", DataTable).cursor_row
        draw_head_metric(plot, result, summary, HEAD_METRICS[self.metric], colours)
        draw_score_histogram(hist, result, summary, row, colours, log=self.lab.log_counts)

    @on(DataTable.RowHighlighted, "#heads-table")
    def _row(self, _event: DataTable.RowHighlighted) -> None:
        from isotui.experiments.attention import summarize

        result = self.result()
        if result is not None:
            self.plot(result, summarize(result))

    def request(self, spec: RunSpec) -> Any:
        from isotui.experiments.attention import AttentionRequest

        return AttentionRequest(spec)

    def cycle(self) -> None:
        self.metric = (self.metric + 1) % len(HEAD_METRICS)
        self.show()

    def figure(self) -> Any:
        """The metric by layer, heads averaged and each head (the histogram beside it: not yet)."""
        from isotui.tui.figure_export import ScreenFigure

        result = self.result()
        if result is None:
            return "no plot to save yet: run the attention experiment (r)"
        options = {"metric": HEAD_METRICS[self.metric]}
        return ScreenFigure("heads", "isotui.paper_figures_dynamics:draw_head_metric", [result], options)
