"""isotui's terminal app: pick a model, run it, read its layer table, compare curves, export.

Everything slow happens in :class:`isotui.backend.Backend` worker threads; their events come
back as :class:`BackendMessage` and only the UI thread touches widgets.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import DataTable, Footer, Header, Input, ListItem, ListView, Static
from textual_plotext import PlotextPlot

from isotui.backend import (
    Backend,
    JobCancelled,
    JobEvent,
    JobFailed,
    JobFinished,
    JobNotice,
    JobProgress,
    JobQueued,
    JobStarted,
)
from isotui.errors import IsotuiError
from isotui.models.hub import cached_models
from isotui.models.naming import BUNDLED
from isotui.paths import cache_dir, config_dir, resource_dir
from isotui.presets import presets
from isotui.render import COLUMNS
from isotui.results import ModelResult
from isotui.settings import load_settings
from isotui.spec import RunSpec, make_spec
from isotui.store.cache import ResultCache
from isotui.store.export import write_csv
from isotui.tui.themes import load_themes

DEFAULT_THEME = "isotui-dark"
PLOT_METRICS = (
    "avg_cos",
    "drift_norm",
    "mean_norm",
    "avg_cos_centered",
    "isoscore",
    "eff_rank",
    "top_pc_share",
)


DRIFT_COLUMNS = ("model", "layers", "spearman rho", "p", "pearson r", "p ")


def _num(value: float, digits: int) -> str:
    return f"{value:.{digits}f}" if value == value else "-"


def _pvalue(p: float) -> str:
    """The p-value, marked significant (*) at 0.05."""
    if p != p:
        return "-"
    return f"{p:.2g}" + (" *" if p < 0.05 else "")


class BackendMessage(Message):
    """A backend event, delivered on the UI thread."""

    def __init__(self, event: JobEvent) -> None:
        super().__init__()
        self.event = event


class IsotuiApp(App):
    """The keyboard-driven lab. ``spec_defaults`` are the data and run options for new jobs."""

    TITLE = "isotui"
    CSS_PATH = Path(__file__).with_name("app.tcss")
    AUTO_FOCUS = "#models"
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("r", "run", "Run", id="run"),
        Binding("slash", "focus_input", "Type model", id="type_model"),
        Binding("a", "toggle_compare", "Compare", id="compare"),
        Binding("m", "cycle_metric", "Metric", id="metric"),
        Binding("n", "toggle_depth", "Depth", id="depth"),
        Binding("e", "export", "Export CSV", id="export"),
        Binding("x", "cancel", "Cancel job", id="cancel"),
        Binding("t", "cycle_theme", "Theme", id="theme"),
        Binding("q", "quit", "Quit", id="quit"),
    ]

    def __init__(
        self,
        *,
        cache_root: Path | None = None,
        spec_defaults: dict | None = None,
        export_dir: Path | None = None,
        theme_dirs: list[Path] | None = None,
        settings_file: Path | None = None,
    ) -> None:
        super().__init__()
        self.settings = load_settings(settings_file, tuple(b.id for b in self.BINDINGS if b.id))
        # bundled themes, then the user's own (same name: the user's wins)
        self.theme_dirs = theme_dirs or [resource_dir("themes"), config_dir() / "themes"]
        self.theme_names: list[str] = []
        self.cache = ResultCache(cache_root or cache_dir(self.settings.cache_dir))
        self.spec_defaults = {
            "data": "builtin",
            "max_samples": 2000,
            "max_length": 128,
            "base_dir": self.settings.path.parent,
            **self.settings.run,
            **(spec_defaults or {}),
        }
        self.export_dir = export_dir or Path.cwd()
        self.backend: Backend | None = None
        self.results: dict[str, ModelResult] = {}
        self.comparison: list[str] = []
        self.selected: str | None = None
        self.metric = PLOT_METRICS[0]
        self.depth = False
        self.jobs: dict[int, str] = {}
        self.last_job: int | None = None

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield Input(placeholder="model: HF id, ./dir, random:TYPE", id="model-input")
                yield ListView(id="models")
            with Vertical(id="main"):
                yield DataTable(id="layers", zebra_stripes=True, cursor_type="row")
                yield PlotextPlot(id="plot")
                yield DataTable(id="drift", cursor_type="none")
        yield Static("no jobs", id="jobs")
        yield Footer()

    def on_mount(self) -> None:
        themes, problems = load_themes(self.theme_dirs)
        for theme in themes:
            self.register_theme(theme)
        self.theme_names = [t.name for t in themes]
        wanted = self.settings.theme or DEFAULT_THEME
        if wanted in self.available_themes:
            self.theme = wanted
        else:
            problems.append(f"settings file {self.settings.path}: no theme named {wanted!r}")
        if self.settings.keys:
            self.set_keymap(self.settings.keys)
        problems.extend(self.settings.problems)
        if problems:
            self.notify("\n".join(problems), title="settings skipped", severity="warning", timeout=15)
        self.backend = Backend(self.cache, lambda ev: self.post_message(BackendMessage(ev)))
        table = self.query_one("#layers", DataTable)
        for label, _, _ in COLUMNS:  # the same columns as the headless table
            table.add_column(label, key=label)
        drift = self.query_one("#drift", DataTable)
        drift.border_title = "drift norm vs avg_cos across layers (Godey et al. 2024, Fig. 5)"
        for label in DRIFT_COLUMNS:
            drift.add_column(label, key=label)
        names = list(BUNDLED)
        for preset in presets():
            names.extend(m for m in preset.models if m not in names)
        names.extend(m.repo_id for m in cached_models() if m.repo_id not in names)
        models = self.query_one("#models", ListView)
        models.extend(ListItem(Static(n), name=n) for n in names)
        models.index = 0
        self.sub_title = f"cache: {self.cache.root}"
        self.replot()

    def on_unmount(self) -> None:
        if self.backend is not None:
            self.backend.close(wait=False)

    # -- selection ---------------------------------------------------------------------------

    @on(ListView.Highlighted, "#models")
    def _highlight(self, event: ListView.Highlighted) -> None:
        if event.item is not None and event.item.name:
            self.select(event.item.name)

    @on(ListView.Selected, "#models")
    def _chosen(self, event: ListView.Selected) -> None:
        if event.item.name:
            self.select(event.item.name)
            self.action_run()

    @on(Input.Submitted, "#model-input")
    def _typed(self, event: Input.Submitted) -> None:
        name = event.value.strip()
        if name:
            self.select(name)
            self.action_run()
            self.query_one("#models", ListView).focus()

    def select(self, model: str) -> None:
        self.selected = model
        self.show_table()

    # -- actions -----------------------------------------------------------------------------

    def spec_for(self, model: str) -> RunSpec:
        return make_spec(model, **self.spec_defaults)

    def action_run(self) -> None:
        if not self.selected or self.backend is None:
            self.notify("select or type a model first", severity="warning")
            return
        try:
            spec = self.spec_for(self.selected)
        except IsotuiError as exc:
            self.notify(str(exc), severity="error")
            return
        job = self.backend.submit(spec)
        self.jobs[job] = spec.model
        self.last_job = job

    def action_focus_input(self) -> None:
        self.query_one("#model-input", Input).focus()

    def action_toggle_compare(self) -> None:
        if not self.selected:
            return
        if self.selected in self.comparison:
            self.comparison.remove(self.selected)
        elif self.selected in self.results:
            self.comparison.append(self.selected)
        else:
            self.notify(f"run {self.selected} first", severity="warning")
        self.replot()
        self.show_drift()

    def action_cycle_metric(self) -> None:
        self.metric = PLOT_METRICS[(PLOT_METRICS.index(self.metric) + 1) % len(PLOT_METRICS)]
        self.replot()

    def action_cycle_theme(self) -> None:
        """Next isotui theme (bundled and user themes, in name order)."""
        if not self.theme_names:
            return
        current = self.theme_names.index(self.theme) if self.theme in self.theme_names else -1
        self.theme = self.theme_names[(current + 1) % len(self.theme_names)]
        self.notify(f"theme: {self.theme}", timeout=2)

    def action_toggle_depth(self) -> None:
        self.depth = not self.depth
        self.replot()

    def action_export(self) -> None:
        chosen = [self.results[m] for m in self.comparison if m in self.results]
        if not chosen and self.selected in self.results:
            chosen = [self.results[self.selected]]
        if not chosen:
            self.notify("nothing to export yet: run a model", severity="warning")
            return
        path = self.export_dir / f"isotui-{time.strftime('%Y%m%d-%H%M%S')}.csv"
        try:
            write_csv(chosen, path)
        except IsotuiError as exc:
            self.notify(str(exc), severity="error")
            return
        self.notify(f"wrote {path}")

    def action_cancel(self) -> None:
        if self.backend is not None and self.last_job is not None and self.backend.cancel(self.last_job):
            self.notify(f"cancelling {self.jobs.get(self.last_job)}")

    # -- backend events ------------------------------------------------------------------------

    def on_backend_message(self, message: BackendMessage) -> None:
        ev = message.event
        model = ev.spec.model
        if isinstance(ev, JobQueued):
            self.set_jobs(f"{model}: queued")
        elif isinstance(ev, JobStarted):
            self.set_jobs(f"{model}: loading on {ev.device}")
        elif isinstance(ev, JobProgress) and not ev.progress.message:
            p = ev.progress
            self.set_jobs(f"{model}: {p.samples_done}/{p.samples_total} samples, {p.tokens_per_s:.0f} tok/s")
        elif isinstance(ev, JobProgress):  # one-off news such as an out-of-memory back-off
            self.notify(f"{model}: {ev.progress.message}", severity="warning")
        elif isinstance(ev, JobNotice):
            self.notify(f"{model}: {ev.text}", severity="warning")
        elif isinstance(ev, JobFinished):
            self.results[model] = ev.result
            if model not in self.comparison:
                self.comparison.append(model)
            self.set_jobs(f"{model}: done" + (" (from cache)" if ev.result.from_cache else ""))
            if self.selected is None:
                self.selected = model
            self.show_table()
            self.replot()
            self.show_drift()
        elif isinstance(ev, JobFailed):
            self.set_jobs(f"{model}: failed")
            self.notify(ev.message, severity="error", timeout=10)
        elif isinstance(ev, JobCancelled):
            self.set_jobs(f"{model}: cancelled")

    def set_jobs(self, text: str) -> None:
        self.query_one("#jobs", Static).update(text)

    # -- views -----------------------------------------------------------------------------

    def show_table(self) -> None:
        table = self.query_one("#layers", DataTable)
        table.clear()
        result = self.results.get(self.selected or "")
        table.border_title = self.selected or ""
        if result is None:
            return
        for row in result.rows:
            table.add_row(*(cell(row) for _, cell, _ in COLUMNS))

    def show_drift(self) -> None:
        """Per model in the comparison set: Spearman and Pearson, significant at 0.05 or not."""
        table = self.query_one("#drift", DataTable)
        table.clear()
        for model in self.comparison:
            for component, d in self.results[model].drift.items():
                label = model if component == "model" else f"{model} ({component})"
                table.add_row(
                    label[-40:],
                    str(d.n_layers),
                    _num(d.spearman_rho, 3),
                    _pvalue(d.spearman_p),
                    _num(d.pearson_r, 3),
                    _pvalue(d.pearson_p),
                )

    def replot(self) -> None:
        plot = self.query_one("#plot", PlotextPlot)
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title(f"{self.metric} by {'depth' if self.depth else 'layer'}")
        for model in self.comparison:
            rows = self.results[model].rows
            last = max(len(rows) - 1, 1)
            xs = [r.layer / last if self.depth else r.layer for r in rows]
            ys = [getattr(r, self.metric) for r in rows]
            plt.plot(xs, ys, label=model[-24:], marker="braille")
        plot.refresh()


def run_app() -> None:
    """Entry point of ``isotui`` with no arguments."""
    IsotuiApp().run()
