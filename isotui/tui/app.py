"""isotui's terminal app: pick a model, run it, read its layer table, compare curves, export.

Everything slow happens in :class:`isotui.backend.Backend` worker threads; their events come
back as :class:`BackendMessage` and only the UI thread touches widgets. Nothing here imports
torch or transformers: the first frame draws before they load (in the backend, on first use).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.color import Color
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, OptionList
from textual_plotext import PlotextPlot

from isotui.backend import Backend, JobEvent, JobFailed, JobFinished, JobNotice, JobProgress, Post
from isotui.config import load_run_config
from isotui.errors import IsotuiError
from isotui.paths import cache_dir, config_dir, resource_dir
from isotui.presets import find_preset
from isotui.render import amount, shorten
from isotui.results import LAYER_METRICS, ModelResult
from isotui.settings import load_settings
from isotui.spec import SPEC_OPTIONS, RunSpec, make_spec
from isotui.store.cache import CacheProblem, ResultCache
from isotui.store.export import write_csv
from isotui.tui.help import HelpScreen
from isotui.tui.jobs import JobsTable
from isotui.tui.layer_table import LayerTable
from isotui.tui.model_list import Entry, build_options, first_enabled, gather_entries
from isotui.tui.options import OptionsScreen
from isotui.tui.sysinfo import describe_devices, query_gpus
from isotui.tui.themes import load_themes

DEFAULT_THEME = "isotui-dark"
PLOT_METRICS = LAYER_METRICS
# comparable to the isotropic null
NULL_METRICS = ("avg_cos", "avg_cos_xctx", "avg_cos_centered", "avg_cos_abtt", "avg_cos_std", "avg_cos_types")
DRIFT_COLUMNS = ("model", "layers", "spearman rho", "p", "pearson r", "p ", "spearman p (t)")
DEVICE_REFRESH_S = 10.0


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


class ModelFilter(Input):
    """The models pane's box: typing filters the list; enter runs exactly what was typed."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("down", "to_list", show=False)]

    def action_to_list(self) -> None:
        self.app.query_one("#models", OptionList).focus()


class IsotuiApp(App):
    """The keyboard-driven lab. ``spec_defaults`` are the data and run options for new jobs."""

    TITLE = "isotui"
    CSS_PATH = Path(__file__).with_name("app.tcss")
    AUTO_FOCUS = "#models"
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-narrow"), (120, "-wide")]
    VERTICAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-short"), (30, "-tall")]
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("r", "run", "Run", id="run", tooltip="run the selected model on the current options"),
        Binding(
            "slash",
            "focus_input",
            "Find",
            id="type_model",
            show=False,
            tooltip="filter the list or type a model",
        ),
        Binding(
            "a", "toggle_compare", "Compare", id="compare", tooltip="add/remove it from the comparison set"
        ),
        Binding("m", "cycle_metric", "Metric", id="metric", tooltip="cycle the plotted metric"),
        Binding(
            "n", "toggle_depth", "Depth", id="depth", show=False, tooltip="x axis: layer index or depth 0..1"
        ),
        Binding(
            "s", "sort", "Sort", id="sort", show=False, tooltip="sort the layer table by the cursor's column"
        ),
        Binding(
            "A",
            "lab",
            "Lab",
            id="lab",
            tooltip="attention lab: queries and keys per head, checkpoint dynamics, the drift block",
        ),
        Binding("o", "options", "Options", id="options", tooltip="data and run options"),
        Binding("e", "export", "CSV", id="export", tooltip="CSV of the whole comparison set"),
        Binding(
            "E",
            "export_table",
            "Export table",
            id="export_table",
            show=False,
            tooltip="CSV of the shown table",
        ),
        Binding(
            "S", "screenshot", "Screenshot", id="screenshot", show=False, tooltip="save an SVG screenshot"
        ),
        Binding(
            "x",
            "cancel",
            "Cancel",
            id="cancel",
            tooltip="cancel the job picked in the jobs pane, else the newest",
        ),
        Binding("t", "cycle_theme", "Theme", id="theme", show=False, tooltip="next theme"),
        Binding("question_mark,f1", "help", "Help", id="help", tooltip="every key"),
        Binding("q", "quit", "Quit", id="quit", show=False, tooltip="quit (running jobs are cancelled)"),
    ]

    def __init__(
        self,
        *,
        cache_root: Path | None = None,
        spec_defaults: dict | None = None,
        export_dir: Path | None = None,
        theme_dirs: list[Path] | None = None,
        settings_file: Path | None = None,
        device_probe: Callable[[], str] | None = None,
        backend_factory: Callable[[ResultCache, Post], Backend] = Backend,
    ) -> None:
        super().__init__()
        self.settings = load_settings(settings_file, tuple(b.id for b in self.BINDINGS if b.id))
        # bundled themes, then the user's own (same name: the user's wins)
        self.theme_dirs = theme_dirs or [resource_dir("themes"), config_dir() / "themes"]
        self.theme_names: list[str] = []
        self.cache = ResultCache(cache_root or cache_dir(self.settings.cache_dir))
        self.spec_defaults: dict[str, Any] = {
            "data": "builtin",
            "max_samples": 2000,
            "max_length": 128,
            "base_dir": self.settings.path.parent,
            **self.settings.run,
            **(spec_defaults or {}),
        }
        self.export_dir = export_dir or Path.cwd()
        self.device_probe = device_probe or (lambda: describe_devices(query_gpus()))
        self.device_line = ""
        self.backend_factory = backend_factory  # tests pass a backend with a fake, slow model
        self.backend: Backend | None = None
        self.entries: list[Entry] = []
        self.results: dict[str, ModelResult] = {}
        # the attention lab's results: attention per model, the latest dynamics and drift block
        self.lab_results: dict[str, Any] = {
            "attention": {},
            "qk-dynamics": None,
            "drift-block": None,
            "checkpoints": None,
        }
        self.comparison: list[str] = []
        self.selected: str | None = None
        self.metric = PLOT_METRICS[0]
        self.depth = False

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield ModelFilter(placeholder="filter, or type a model + enter", id="model-input")
                yield OptionList(id="models")
            with Vertical(id="main"):
                yield LayerTable(id="layers")
                with Horizontal(id="charts"):
                    yield PlotextPlot(id="plot")
                    with Vertical(id="drift-pane"):
                        drift = DataTable(id="drift", cursor_type="none")
                        drift.can_focus = False  # nothing to pick in it
                        yield drift
                        yield PlotextPlot(id="drift-plot")
        yield JobsTable(id="jobs")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self._apply_settings()
        self.backend = self.backend_factory(self.cache, lambda ev: self.post_message(BackendMessage(ev)))
        drift = self.query_one("#drift", DataTable)
        drift.border_title = "drift vs avg_cos (Godey et al. Fig. 5)"
        for label in DRIFT_COLUMNS:
            drift.add_column(label, key=label)
        self.refresh_models()
        self.show_header()
        self.probe_device()
        self.set_interval(DEVICE_REFRESH_S, self.probe_device)
        self.replot()
        self.show_drift()

    def _apply_settings(self) -> None:
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

    def notify(self, message: str, *, markup: bool = False, **kwargs) -> None:
        """Notifications show text as written: paths and ``[keys]`` are not Rich markup."""
        super().notify(message, markup=markup, **kwargs)

    def on_unmount(self) -> None:
        if self.backend is not None:
            self.backend.close(wait=False)

    # -- header ------------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="device")
    def probe_device(self) -> None:
        line = self.device_probe()
        self.call_from_thread(self._set_device_line, line)

    def _set_device_line(self, line: str) -> None:
        self.device_line = line
        self.show_header()

    def show_header(self) -> None:
        self.sub_title = f"{self.device_line or 'looking for GPUs…'} · cache {self.cache.root}"

    # -- models pane -------------------------------------------------------------------------

    def refresh_models(self) -> None:
        """Re-read presets, the HF cache and cached runs, keeping the filter."""
        self.entries = gather_entries(self.cache)
        self.filter_models(self.query_one("#model-input", Input).value)

    def filter_models(self, query: str) -> None:
        models = self.query_one("#models", OptionList)
        models.clear_options()
        models.add_options(build_options(self.entries, query))
        models.highlighted = first_enabled(models)

    @on(Input.Changed, "#model-input")
    def _filter(self, event: Input.Changed) -> None:
        self.filter_models(event.value)

    @on(OptionList.OptionHighlighted, "#models")
    def _highlight(self, event: OptionList.OptionHighlighted) -> None:
        kind, _, value = (event.option.id or "").partition(":")
        if kind == "model":
            self.select(value)

    @on(OptionList.OptionSelected, "#models")
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        kind, _, value = (event.option.id or "").partition(":")
        if kind == "model":
            self.select(value)
            self.action_run()
        elif kind == "preset":
            self.run_preset(value)
        elif kind == "run":
            self.open_cached(value)

    @on(Input.Submitted, "#model-input")
    def _typed(self, event: Input.Submitted) -> None:
        name = event.value.strip()
        if name:
            self.select(name)
            self.action_run()
            self.query_one("#models", OptionList).focus()

    def select(self, model: str) -> None:
        self.selected = model
        self.show_table()
        self.show_drift()

    def open_cached(self, key: str) -> None:
        """Show a cached result at once (a file read: no model, no torch)."""
        try:
            result = self.cache.get(key)
        except CacheProblem as exc:
            self.notify(f"cached run {key[:12]}: {exc}", severity="error")
            return
        if result is None:
            self.notify(f"cached run {key[:12]} is gone (removed by `isotui cache rm`?)", severity="warning")
            self.refresh_models()
            return
        result.from_cache = True
        self.selected = result.model
        self.add_result(result)

    # -- actions -----------------------------------------------------------------------------

    def spec_for(self, model: str, overrides: dict[str, Any] | None = None) -> RunSpec:
        return make_spec(model, **{**self.spec_defaults, **(overrides or {})})

    def submit(self, model: str, overrides: dict[str, Any] | None = None) -> None:
        if self.backend is None:
            return
        try:
            spec = self.spec_for(model, overrides)
        except IsotuiError as exc:
            self.notify(str(exc), severity="error")
            return
        self.backend.submit(spec)

    def submit_request(self, request: Any) -> None:
        """Queue an attention-lab experiment (see :mod:`isotui.experiments.requests`)."""
        if self.backend is not None:
            self.backend.submit(request)

    def action_lab(self) -> None:
        from isotui.tui.lab import LabScreen

        self.push_screen(LabScreen())

    def lab_screen(self):
        from isotui.tui.lab import LabScreen

        return next((s for s in self.screen_stack if isinstance(s, LabScreen)), None)

    def add_lab_result(self, kind: str, result: Any) -> None:
        """Keep an experiment's result and show it if the lab is open; say where it is if not."""
        if kind == "attention":
            self.lab_results["attention"][result.model] = result
            self.selected = result.model
        else:
            self.lab_results[kind] = result
        lab = self.lab_screen()
        if lab is not None:
            lab.refresh_all()
            lab.status(
                f"{kind} ready" + (" (from the cache)" if kind == "attention" and result.from_cache else "")
            )
        else:
            self.notify(f"{kind} ready: press A for the attention lab")

    def action_run(self) -> None:
        if not self.selected:
            self.notify("select or type a model first", severity="warning")
            return
        self.submit(self.selected)

    def run_preset(self, name: str) -> None:
        """Every model of the preset, on the preset's own data settings (defaults unchanged)."""
        path = find_preset(name)
        try:
            if path is None:
                raise IsotuiError(f"preset {name} is gone from {resource_dir('sample_configs')}")
            cfg = load_run_config(path)
        except IsotuiError as exc:
            self.notify(str(exc), severity="error")
            return
        overrides = {k: cfg[k] for k in SPEC_OPTIONS if k in cfg}
        models = cfg.get("models", ["minilm"])
        for model in models:
            self.submit(model, overrides)
        self.selected = models[0]
        self.show_table()
        self.notify(f"preset {name}: queued {', '.join(models)}")

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

    def action_toggle_depth(self) -> None:
        self.depth = not self.depth
        self.replot()
        self.show_drift()

    def action_sort(self) -> None:
        self.query_one("#layers", LayerTable).sort_cursor_column()

    def action_cycle_theme(self) -> None:
        """Next isotui theme (bundled and user themes, in name order)."""
        if not self.theme_names:
            return
        current = self.theme_names.index(self.theme) if self.theme in self.theme_names else -1
        self.theme = self.theme_names[(current + 1) % len(self.theme_names)]
        self.notify(f"theme: {self.theme}", timeout=2)

    def watch_theme(self, _: str) -> None:
        if self.is_mounted:  # shades and line colours come from the theme
            self.show_table()
            self.replot()
            self.show_drift()

    def action_options(self) -> None:
        def done(options: dict[str, Any] | None) -> None:
            if options is not None:
                self.spec_defaults = options
                self.notify("options set for the next jobs: " + self.options_summary())

        self.push_screen(OptionsScreen(self.spec_defaults), done)

    def options_summary(self) -> str:
        o = self.spec_defaults
        return (
            f"data {o.get('data')}, samples {o.get('max_samples') or 'all'}, "
            f"max length {o.get('max_length') or 'auto'}, batch size {o.get('batch_size') or 'auto'}, "
            f"device {o.get('device', 'auto')}, dtype {o.get('dtype', 'auto')}, "
            f"special tokens {o.get('special_tokens', 'exclude')}, map units {o.get('map_units', 'auto')}"
            + (", exact (2nd pass)" if o.get("exact") else "")
        )

    def _export(self, chosen: list[ModelResult], what: str) -> None:
        if not chosen:
            self.notify("nothing to export yet: run a model", severity="warning")
            return
        path = self.export_dir / f"isotui-{time.strftime('%Y%m%d-%H%M%S')}-{what}.csv"
        try:
            write_csv(chosen, path)
        except IsotuiError as exc:
            self.notify(str(exc), severity="error")
            return
        self.notify(f"wrote {path} ({len(chosen)} model{'s' * (len(chosen) != 1)})")

    def action_export(self) -> None:
        """The comparison set (or the shown model when the set is empty)."""
        chosen = [self.results[m] for m in self.comparison if m in self.results]
        if not chosen and self.selected in self.results:
            chosen = [self.results[self.selected]]
        self._export(chosen, "comparison")

    def action_export_table(self) -> None:
        result = self.results.get(self.selected or "")
        self._export([result] if result else [], "table")

    def action_screenshot(self) -> None:
        name = f"isotui-{time.strftime('%Y%m%d-%H%M%S')}.svg"
        try:
            path = self.save_screenshot(name, str(self.export_dir))
        except OSError as exc:
            self.notify(f"cannot write the screenshot in {self.export_dir}: {exc.strerror}", severity="error")
            return
        self.notify(f"wrote {path}")

    def action_cancel(self) -> None:
        jobs = self.query_one("#jobs", JobsTable)
        job = jobs.chosen_job() if jobs.has_focus else None
        if job is None or not jobs.records[job].active:
            job = jobs.latest_active()
        if job is None or self.backend is None or not self.backend.cancel(job):
            self.notify("no job in flight to cancel", severity="warning")
            return
        jobs.mark_cancelling(job)
        self.notify(f"cancelling job {job} ({jobs.records[job].model})")

    def key_bindings(self) -> list[tuple[str, str, str]]:
        """(key as bound now, id, what it does) for every app key, remaps included."""
        out = []
        for b in self.BINDINGS:
            keys = self.settings.keys.get(b.id or "", b.key)
            shown = ", ".join(self.get_key_display(Binding(k.strip(), b.action)) for k in keys.split(","))
            out.append((shown, b.id or "", b.tooltip or b.description))
        return out

    def action_help(self) -> None:
        sort_key = next(k for k, i, _ in self.key_bindings() if i == "sort")
        self.push_screen(HelpScreen(self.key_bindings(), sort_key))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Every isotui action in the command palette (ctrl+p), beside Textual's own."""
        yield from super().get_system_commands(screen)
        for (key, _, what), b in zip(self.key_bindings(), self.BINDINGS, strict=True):
            if b.action in ("quit",):
                continue
            yield SystemCommand(
                f"isotui: {b.description}", f"{what} (key {key})", getattr(self, f"action_{b.action}")
            )

    # -- backend events ------------------------------------------------------------------------

    def on_backend_message(self, message: BackendMessage) -> None:
        ev = message.event
        try:
            self.query_one("#jobs", JobsTable).apply(ev)
        except NoMatches:  # the app is closing; the backend's last words have nowhere to go
            return
        model = ev.spec.model
        lab = self.lab_screen() if not isinstance(ev.spec, RunSpec) else None
        if lab is not None and isinstance(ev, JobProgress) and not ev.progress.message:
            p = ev.progress
            lab.status(f"{ev.spec.kind} {shorten(model, 40)}: {p.samples_done}/{p.samples_total}")
        elif lab is not None and isinstance(ev, JobFailed):
            lab.status(f"{ev.spec.kind} {shorten(model, 40)} failed: {ev.message}")
        if isinstance(ev, JobProgress) and ev.progress.message:  # e.g. an out-of-memory back-off
            self.notify(f"{model}: {ev.progress.message}", severity="warning")
        elif isinstance(ev, JobNotice):
            self.notify(f"{model}: {ev.text}", severity="warning")
        elif isinstance(ev, JobFinished) and not isinstance(ev.spec, RunSpec):
            self.add_lab_result(ev.spec.kind, ev.result)
        elif isinstance(ev, JobFinished):
            self.add_result(ev.result)
            if not ev.result.from_cache:
                self.refresh_models()  # a new cached run to list
        elif isinstance(ev, JobFailed):
            self.notify(ev.message, severity="error", timeout=10)

    def add_result(self, result: ModelResult) -> None:
        model = result.model
        self.results[model] = result
        if model not in self.comparison:
            self.comparison.append(model)
        if self.selected is None:
            self.selected = model
        self.show_table()
        self.replot()
        self.show_drift()

    # -- views -----------------------------------------------------------------------------

    def show_table(self) -> None:
        table = self.query_one("#layers", LayerTable)
        result = self.results.get(self.selected or "")
        table.border_title = self.selected or "no model selected"
        if result is None:
            table.show(None)
            if self.selected:
                table.border_title += " (not run yet: press r)"
            return
        table.show(result)
        source = "cache" if result.from_cache else f"{result.meta.get('seconds', 0):.1f} s"
        table.border_title = f"{result.model} · {result.meta.get('data')} · {amount(result.meta)} · {source}"

    def model_colours(self) -> list[tuple[int, int, int]]:
        """One line colour per compared model, from the theme (so plots follow it)."""
        t = self.current_theme
        names = [t.primary, t.secondary, t.accent, t.success, t.warning, t.error]
        return [Color.parse(n).rgb for n in names if n] or [(255, 255, 255)]

    def x_values(self, rows) -> list[float]:
        last = max(len(rows) - 1, 1)
        return [i / last if self.depth else i for i in range(len(rows))]  # encoder, then decoder

    def show_drift(self) -> None:
        """Per compared model: Spearman and Pearson (significant at 0.05 or not), and a plot of
        drift norm and avg cosine per layer for the selected model (Godey et al. Fig. 5, 16)."""
        table = self.query_one("#drift", DataTable)
        table.clear()
        for model in self.comparison:
            for component, d in self.results[model].drift.items():
                label = model if component == "model" else f"{model} ({component})"
                table.add_row(
                    shorten(label, 32),
                    str(d.n_layers),
                    _num(d.spearman_rho, 3),
                    _pvalue(d.spearman_p),
                    _num(d.pearson_r, 3),
                    _pvalue(d.pearson_p),
                    _pvalue(d.spearman_p_t),  # scipy's t approximation, beside the permutation p
                )
        plot = self.query_one("#drift-plot", PlotextPlot)
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        result = self.results.get(self.selected or "")
        plot.border_title = shorten(result.model, 30) if result else ""  # whose curves these are
        if result is not None and result.rows:
            colours = self.model_colours()
            xs = self.x_values(result.rows)
            plt.title(f"{shorten(result.model, 20)}: drift (left), avg_cos (right)")
            self.integer_ticks(plt, result.rows)
            plt.plot(
                xs, [r.drift_norm for r in result.rows], label="drift", color=colours[0], marker="braille"
            )
            plt.plot(
                xs,
                [r.avg_cos for r in result.rows],
                label="avg_cos",
                color=colours[1 % len(colours)],
                marker="braille",
                yside="right",
            )
        else:
            plt.title("drift norm and avg_cos per layer: run a model")
        plot.refresh()

    def replot(self) -> None:
        plot = self.query_one("#plot", PlotextPlot)
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        axis = "depth (0..1)" if self.depth else "layer"
        if not self.comparison:
            plt.title(f"{self.metric} by {axis}: run models to compare them")
            plot.refresh()
            return
        nulls = self.metric in NULL_METRICS
        plt.title(
            f"{self.metric} by {'depth' if self.depth else 'layer'}" + (" (— null p95)" if nulls else "")
        )
        colours = self.model_colours()
        for i, model in enumerate(self.comparison):
            rows = self.results[model].rows
            colour = colours[i % len(colours)]
            plt.plot(
                self.x_values(rows),
                [getattr(r, self.metric) for r in rows],
                label=shorten(model, 24),
                color=colour,
                marker="braille",
            )
            if nulls and rows:
                plt.hline(rows[0].null_p95, colour)
        longest = max((self.results[m].rows for m in self.comparison), key=len)
        self.integer_ticks(plt, longest)
        plot.refresh()

    def integer_ticks(self, plt, rows) -> None:
        """Whole layer numbers on a layer axis (at most 7 ticks); depth keeps plotext's own."""
        if self.depth or len(rows) < 2:
            return
        last = len(rows) - 1
        step = max(1, -(-last // 6))
        ticks = list(range(0, last + 1, step))
        plt.xticks(ticks, [str(t) for t in ticks])


def run_app() -> None:
    """Entry point of ``isotui`` with no arguments."""
    IsotuiApp().run()
