"""The lab's Dynamics tab: ``isotui experiment qk-dynamics`` over a checkpoint series:
checkpoints x layers, the trajectories of Q̄ and K̄ of one head in the series' common SVD basis,
per-layer curves."""

from __future__ import annotations

from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import DataTable, Input

from isotui.render import DUPLICATE_MARK, shorten
from isotui.tui.lab_tab import LabTab, SettingsBox
from isotui.tui.lab_tab import fmt as _f
from isotui.tui.plots import FitPlot, clear, sized

DYN_METRICS = (
    ("cos_qk_bar", "cos(Q-mean, K-mean)"),
    ("entropy", "entropy (nats)"),
    ("dot_qk_bar", "Q-mean·K-mean"),
)
BASES = ("qk", "q", "k")
HEAD_KEYS = Binding.Group("Head", compact=True)


class DynamicsTab(LabTab):
    """Queries and keys along a checkpoint series: the table, one head's trajectory, the curves."""

    KIND = "qk-dynamics"
    BOX = "#dyn-input"
    TABLE = "#dyn-table"
    KEY, NAME, TITLE, SHORT = "2", "dynamics", "Dynamics", "Dynamics"
    TOOLTIP = "tab: checkpoint series"
    KEYS = (
        # one footer entry for both (``[] Head``): the Dynamics footer was cut at 80 columns
        Binding(
            "left_square_bracket",
            "head(-1)",
            "Head-",
            id="lab_head_prev",
            tooltip="Dynamics: previous head",
            group=HEAD_KEYS,
        ),
        Binding(
            "right_square_bracket",
            "head(1)",
            "Head+",
            id="lab_head_next",
            tooltip="Dynamics: next head",
            group=HEAD_KEYS,
        ),
        Binding(
            "b", "basis", "Basis", id="lab_basis", tooltip="Dynamics: the trajectory's SVD basis (qk, q or k)"
        ),
    )
    WIDGET_KEYS = (("← →", "the layer (column) whose trajectory shows"),)

    def __init__(self, title: str, *, id: str) -> None:
        super().__init__(title, id=id)
        self.metric = 0  # which of DYN_METRICS the curves show
        self.head = 0  # the head whose trajectory shows (of the cursor's layer)
        self.basis = 0  # the trajectory's SVD basis, one of BASES

    def compose(self) -> ComposeResult:
        yield SettingsBox(
            placeholder="checkpoints: step1000 step2000 (revisions of the selected model), "
            "model ids, or folders; enter runs",
            id="dyn-input",
        )
        yield DataTable(id="dyn-table", cursor_type="cell", zebra_stripes=True)
        with Horizontal(classes="lab-charts"):
            yield FitPlot(id="dyn-plot")
            yield FitPlot(id="dyn-lines")

    def show(self) -> None:
        result = self.result()
        table = self.query_one("#dyn-table", DataTable)
        table.clear(columns=True)
        if result is None:
            self.plot()
            return
        many = len({s[0] for s in result.sites}) > 1
        labels = [
            (f"{c} " if many else "") + str(layer) + (" x" if a == "cross" else "")
            for c, layer, a in result.sites
        ]
        table.add_columns("checkpoint", "step", *labels)
        cos = result.layer_means("cos_qk_bar")
        for i, (ckpt, step) in enumerate(zip(result.checkpoints, result.steps(), strict=True)):
            mark = DUPLICATE_MARK if ckpt.duplicate_of else ""  # serves a later step's weights
            table.add_row(shorten(ckpt.label, 24) + mark, str(step), *(_f(v) for v in cos[i]))
        table.border_title = f"{shorten(result.series, 40)}: cos(Q-mean, K-mean) per layer, heads averaged"
        self.plot()

    def site(self, result: Any) -> int:
        col = self.query_one("#dyn-table", DataTable).cursor_column - 2
        return min(max(col, 0), len(result.sites) - 1)

    def plot(self) -> None:
        from isotui.figures import draw_layer_series, draw_trajectory

        result = self.result()
        traj = self.query_one("#dyn-plot", FitPlot)
        lines = self.query_one("#dyn-lines", FitPlot)
        for p in (traj, lines):
            clear(p)
        colours = self.lab.app_colours()
        if result is None:
            traj.plt.title("Q-mean and K-mean along training: give checkpoints above")
            lines.plt.title("per-layer curves over checkpoints")
        else:
            site = self.site(result)
            heads = sorted(
                {r.head for r in result.rows if (r.component, r.layer, r.attention) == result.sites[site]}
            )
            self.head = min(self.head, len(heads) - 1)
            head, basis = heads[self.head], BASES[self.basis]

            def trajectory(plt: Any, size: tuple[int, int]) -> None:
                draw_trajectory(plt, result, site, head, basis, (colours[0], colours[1]), size=size)

            sized(traj, trajectory)
            attr, name = DYN_METRICS[self.metric]
            labels = [str(s[1]) for s in result.sites]
            draw_layer_series(
                lines.plt,
                result.steps(),
                result.layer_means(attr),
                labels,
                f"{name} per layer over steps",
                colours,
            )
        traj.refresh()
        lines.refresh()

    @on(DataTable.CellHighlighted, "#dyn-table")
    def _cell(self, _event: DataTable.CellHighlighted) -> None:
        self.plot()

    def run(self) -> bool:
        from isotui.experiments.qk_dynamics import DEFAULT_SAMPLE, DynamicsRequest

        def request(series: str | None, ckpts: tuple[Any, ...], spec: Any) -> DynamicsRequest:
            return DynamicsRequest(series, ckpts, spec, DEFAULT_SAMPLE)

        return self.submit_series(self.query_one("#dyn-input", Input).value, request, "qk-dynamics")

    def cycle(self) -> None:
        self.metric = (self.metric + 1) % len(DYN_METRICS)
        self.plot()

    def figure(self) -> Any:
        """The head's trajectory and the per-layer curves, as shown (a double-column figure)."""
        from isotui.tui.figure_export import ScreenFigure

        result = self.result()
        if result is None:
            return "no plot to save yet: run the dynamics over checkpoints (r)"
        site = self.site(result)
        heads = sorted(
            {r.head for r in result.rows if (r.component, r.layer, r.attention) == result.sites[site]}
        )
        options = {
            "site": site,
            "head": heads[min(self.head, len(heads) - 1)],
            "basis": BASES[self.basis],
            "metric": DYN_METRICS[self.metric][0],
            "width": "double",
        }
        return ScreenFigure("dynamics", "isotui.paper_figures_dynamics:draw_dynamics_view", [result], options)

    def action_head(self, delta: int) -> None:
        self.head = max(0, self.head + delta)
        self.plot()

    def action_basis(self) -> None:
        self.basis = (self.basis + 1) % len(BASES)
        self.plot()
