"""isotui's terminal app: pick a model, run it, read its layer table, compare curves, export.

Everything slow happens in :class:`isotui.backend.Backend` worker threads; their events come
back as :class:`BackendMessage` and only the UI thread touches widgets. Nothing here imports
torch or transformers: the first frame draws before they load (in the backend, on first use).
"""

from __future__ import annotations

import gc
import io
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from textual import events, on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.color import Color
from textual.containers import Container, Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, OptionList

from isotui.backend import Backend, JobEvent, Post
from isotui.config import load_run_config
from isotui.errors import IsotuiError
from isotui.experiments import layerwise
from isotui.models.naming import check_name
from isotui.paths import cache_dir, config_dir, resource_dir
from isotui.presets import find_preset
from isotui.render import amount
from isotui.results import LAYER_METRICS, ModelResult
from isotui.settings import load_settings
from isotui.spec import SPEC_OPTIONS, RunSpec, make_spec
from isotui.store.cache import CacheProblem, ResultCache
from isotui.store.export import write_csv
from isotui.sweep import SweepRequest, SweepResult
from isotui.tui.drift_pane import DriftPane
from isotui.tui.help import HelpScreen, binding_rows
from isotui.tui.job_events import BackendMessage, EventRelay, JobEventView
from isotui.tui.jobs import JobsTable
from isotui.tui.lab_tabs import LabResults, tab_of
from isotui.tui.layer_table import LayerTable
from isotui.tui.model_list import Entry
from isotui.tui.models_pane import ModelsPane
from isotui.tui.options import OptionsScreen, check_options
from isotui.tui.plots import RGB, FitPlot, PlotLegend, draw_metric_curves
from isotui.tui.session import Session, load_session, save_session, session_path
from isotui.tui.sysinfo import describe_devices, query_gpus
from isotui.tui.themes import load_themes, starting_theme
from isotui.tui.wording import in_options_terms

if TYPE_CHECKING:
    from isotui.tui.figure_export import ScreenFigure
    from isotui.tui.lab import LabScreen

PLOT_METRICS = LAYER_METRICS  # the cycle of `m`: results.METRICS, declared once
DEVICE_REFRESH_S = 10.0
# app keys that belong to the main screen: hidden and inert in the attention lab
MAIN_ONLY_ACTIONS = frozenset(
    {"focus_input", "toggle_compare", "toggle_depth", "sort", "lab", "export_table", "run", "cycle_metric"}
)
EXPORT_DELIVERY = "isotui-export"  # the name of an export's delivery to the browser (isotui serve)
QUIT_WAIT_S = 15.0  # how long quitting waits for a running job to stop at a safe point
__all__ = ["BackendMessage", "IsotuiApp", "run_app"]


class IsotuiApp(App[None]):
    """The keyboard-driven lab. ``spec_defaults`` are the data and run options for new jobs."""

    TITLE = "isotui"
    CSS_PATH = Path(__file__).with_name("app.tcss")
    AUTO_FOCUS = "#models"
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-narrow"), (120, "-wide")]  # type: ignore[misc]
    VERTICAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-short"), (30, "-tall")]  # type: ignore[misc]
    BINDINGS: ClassVar[list[Binding]] = [  # type: ignore[assignment]  # Bindings only: help reads ids
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
            "F",
            "save_figure",
            "PDF",
            id="figure",
            tooltip="save the plot on screen as PDF, PNG and the CSV of its numbers",
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
        spec_defaults: dict[str, Any] | None = None,
        export_dir: Path | None = None,
        theme_dirs: list[Path] | None = None,
        settings_file: Path | None = None,
        device_probe: Callable[[], str] | None = None,
        backend_factory: Callable[[ResultCache, Post], Backend] = Backend,
        fresh: bool = False,
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
        self.export_dir = export_dir or self.settings.export_dir or Path.cwd()
        self.session_file = session_path(self.settings.path)
        self.fresh = fresh  # start without the last session (it is overwritten on the next change)
        self._session_unwritable = False  # said once
        self.lab_inputs: dict[str, str] = {}  # the lab's settings boxes, kept across visits
        self.device_probe = device_probe or (lambda: describe_devices(query_gpus(), self.own_pids()))
        self.device_line = ""
        self.backend_factory = backend_factory  # tests pass a backend with a fake, slow model
        self.backend: Backend | None = None
        self._stopping = False  # quitting: waiting for the running job to stop
        self.results: dict[str, ModelResult] = {}
        # the attention lab's results, a slot per lab tab (attention per model, the latest
        # dynamics, drift block, checkpoints...)
        self.lab_results: dict[str, Any] = LabResults()
        self._relay = EventRelay(self.post_message)  # backend threads -> the UI thread
        self._job_events = JobEventView(self)
        self.comparison: list[str] = []
        self.selected: str | None = None
        self.metric = PLOT_METRICS[0]
        self.depth = False

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="body"):
            yield ModelsPane(
                self.cache,
                selected=lambda: self.selected,
                restore=self.select,
                marks=self.compared_marks,
                id="left",
            )
            with Vertical(id="main"):
                yield LayerTable(id="layers")
                with Horizontal(id="charts"):
                    with Container(id="plot-box"):  # the plot, its legend under it (beside: narrow)
                        yield FitPlot(id="plot")
                        yield PlotLegend(id="plot-legend")
                    yield DriftPane(id="drift-pane")
        yield JobsTable(id="jobs")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self._apply_settings()
        session = self._read_session()
        self.backend = self.backend_factory(self.cache, self._post_event)
        self.refresh_models()
        self.show_header()
        self.probe_device()
        self.set_interval(DEVICE_REFRESH_S, self.probe_device)
        self.replot()
        self.show_drift()
        if session.comparison:
            self.reopen_comparison(session)
        self.call_after_refresh(settle_memory)

    # -- the last session ----------------------------------------------------------------------

    def _read_session(self) -> Session:
        """The last session's options, lab boxes and view (the comparison reopens on a worker);
        a damaged file or a bad value is one notification, and the rest starts clean."""
        if self.fresh:
            return Session()
        try:
            session = load_session(self.session_file)
        except IsotuiError as exc:
            self.notify(f"{exc}; starting a new session", severity="warning", timeout=10)
            return Session()
        if session.options:
            options = {**self.spec_defaults, **session.options}
            try:
                check_options(options)
                self.spec_defaults = options
            except IsotuiError as exc:
                self.notify(
                    f"last session's options not restored: {in_options_terms(str(exc))}", severity="warning"
                )
        self.lab_inputs = dict(session.lab)
        if session.metric in PLOT_METRICS:
            self.metric = session.metric
        self.depth = session.depth
        # a model that never gave a result (a typo that failed) is not selected again
        self.selected = session.selected if session.selected in {m for m, _ in session.comparison} else None
        return session

    @work(thread=True, exclusive=True, group="session")
    def reopen_comparison(self, session: Session) -> None:
        """The last comparison set from the result cache (file reads, off the UI thread)."""
        found, gone = [], []
        for model, key in session.comparison:
            try:
                result = layerwise.read(self.cache, key)
            except CacheProblem:
                result = None
            if result is None:
                gone.append(model)
                continue
            result.model, result.from_cache = model, True
            for row in result.rows:
                row.model = model
            found.append(result)
        self.call_from_thread(self._reopened, found, gone, session.selected)

    def _reopened(self, found: list[ModelResult], gone: list[str], selected: str | None) -> None:
        if not self.screen_stack:
            return
        for result in found:
            self.results[result.model] = result
            if result.model not in self.comparison:
                self.comparison.append(result.model)
        if selected in self.results:
            self.selected = selected
        self.show_table()
        self.replot()
        self.show_drift()
        self.show_marks()
        if gone:
            self.notify(
                f"last session: {', '.join(gone)} no longer in the result cache (run again with r)",
                severity="warning",
            )

    def session(self) -> Session:
        options = {k: v for k, v in self.spec_defaults.items() if k in SPEC_OPTIONS and k != "base_dir"}
        return Session(
            comparison=[(m, self.results[m].key) for m in self.comparison if m in self.results],
            selected=self.selected if self.selected in self.results else None,  # not a failed name
            metric=self.metric,
            depth=self.depth,
            options=options,
            lab=dict(self.lab_inputs),
        )

    def save_session(self) -> None:
        """Write the session now (atomically); a folder that cannot be written is said once."""
        try:
            save_session(self.session_file, self.session())
        except OSError as exc:
            if not self._session_unwritable:
                self._session_unwritable = True
                self.notify(
                    f"cannot write the session file {self.session_file}: {exc.strerror or exc}",
                    severity="warning",
                )

    def _apply_settings(self) -> None:
        themes, problems = load_themes(self.theme_dirs)
        for theme in themes:
            self.register_theme(theme)
        self.theme_names = [t.name for t in themes]
        wanted = starting_theme(self.settings.theme, os.environ, web=self.is_web)
        if wanted in self.available_themes:
            self.theme = wanted
        else:
            problems.append(f"settings file {self.settings.path}: no theme named {wanted!r}")
        if self.settings.keys:
            self.set_keymap(self.settings.keys)
        problems.extend(self.settings.problems)
        if problems:
            self.notify("\n".join(problems), title="settings skipped", severity="warning", timeout=15)

    @property
    def main_screen(self) -> Screen[Any]:
        """The layer view, always the bottom screen: its widgets are updated (a job ending,
        the list refreshed) while the lab or a dialog is shown on top of it."""
        if not self.screen_stack:
            raise NoMatches("the app is closing")
        return self.screen_stack[0]

    def notify(self, message: str, *, markup: bool = False, **kwargs: Any) -> None:
        """Notifications show text as written: paths and ``[keys]`` are not Rich markup."""
        super().notify(message, markup=markup, **kwargs)

    def on_unmount(self) -> None:
        self.save_session()
        if self.backend is not None:
            self.backend.close(wait=False)

    async def action_quit(self) -> None:
        """Quit; with a job in flight, cancel it and wait (at most :data:`QUIT_WAIT_S`) for its
        worker to reach a safe point: leaving while a torch thread computes aborts the process."""
        if self.backend is None or not self.backend.busy():
            self.exit()
            return
        if self._stopping:
            return  # already on its way out
        self._stopping = True
        self.notify(
            f"stopping... cancelling the running job (at most {QUIT_WAIT_S:.0f} s)",
            title="quitting",
            timeout=60,
        )
        self.backend.close(wait=False)
        self._exit_when_idle()

    @work(thread=True, group="quit")
    def _exit_when_idle(self) -> None:
        if self.backend is not None and not self.backend.wait_idle(QUIT_WAIT_S):
            self.backend.terminate()  # the last resort: kill a worker process that did not stop
        self.call_from_thread(self.exit)

    def action_help_quit(self) -> None:
        """Ctrl+C: say how to quit, in plain text (notifications here are not Rich markup)."""
        for key, active in self.active_bindings.items():
            if active.binding.action in ("quit", "app.quit"):
                self.notify(f"Press {key} to quit the app", title="Do you want to quit?")
                return

    # -- header ------------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="device")
    def probe_device(self) -> None:
        line = self.device_probe()
        self.call_from_thread(self._set_device_line, line)

    def own_pids(self) -> set[int]:
        """The app's process and its workers: the header tells their GPU use from others'."""
        return {os.getpid(), *(self.backend.worker_pids() if self.backend is not None else ())}

    def _set_device_line(self, line: str) -> None:
        self.device_line = line
        self.show_header()

    def show_header(self) -> None:
        self.sub_title = f"{self.device_line or 'looking for GPUs…'} · cache {self.cache.root}"

    # -- models pane -------------------------------------------------------------------------

    @property
    def models_pane(self) -> ModelsPane:
        return self.main_screen.query_one(ModelsPane)

    @property
    def entries(self) -> list[Entry]:
        """What the models pane lists (empty until its worker has scanned)."""
        try:
            return self.models_pane.entries
        except NoMatches:
            return []

    def refresh_models(self) -> None:
        """List presets, the HF cache and cached runs again (on a worker thread)."""
        self.models_pane.refresh_entries()

    @on(OptionList.OptionHighlighted, "#models")
    def _highlight(self, event: OptionList.OptionHighlighted) -> None:
        kind, _, value = (event.option.id or "").partition(":")
        if kind == "model" and self.screen_stack:  # (not while the app closes)
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
        if name.endswith(".toml") and Path(name).expanduser().is_file():  # a config file: its runs
            self.run_config(Path(name).expanduser())
        elif name:
            try:  # what the name alone tells, at once: its form, a missing folder, a typo offline
                check_name(name)
            except IsotuiError as exc:
                self.notify(str(exc), severity="error")
                return
            self.select(name)
            self.action_run()
            self.main_screen.query_one("#models", OptionList).focus()

    def select(self, model: str) -> None:
        self.selected = model
        self.show_table()
        self.show_drift()

    def open_cached(self, key: str) -> None:
        """Show a cached result at once (a file read: no model, no torch)."""
        try:
            result = layerwise.read(self.cache, key)
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
        """The spec of a job from the app: its max length is a ceiling, capped at the model's
        limit (said in a notice) where the CLI refuses an explicit ``--max-length``."""
        try:
            spec = make_spec(model, **{**self.spec_defaults, **(overrides or {})})
        except IsotuiError as exc:
            raise IsotuiError(in_options_terms(str(exc))) from None
        return replace(spec, cap_max_length=True)

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

    def lab_screen(self) -> LabScreen | None:
        from isotui.tui.lab import LabScreen

        return next((s for s in self.screen_stack if isinstance(s, LabScreen)), None)

    def add_lab_result(self, kind: str, result: Any) -> None:
        """Keep an experiment's result and show it if the lab is open; say where it is if not."""
        tab = tab_of(kind)
        if tab is not None:
            tab.keep(self, result)
        else:  # (no tab shows it; kept all the same)
            self.lab_results[kind] = result
        lab = self.lab_screen()
        if lab is not None:
            lab.refresh_all()
            lab.status(tab.ready(result) if tab is not None else f"{kind} ready", kind)
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
        if path is None:
            self.notify(f"preset {name} is gone from {resource_dir('sample_configs')}", severity="error")
            return
        self.run_config(path, name)

    def run_config(self, path: Path, name: str | None = None) -> None:
        """A config file (a preset, or a typed ``.toml`` path): with a ``[sweep]`` table, one sweep
        job over its tasks (its runs join the comparison when it ends); else a run per model."""
        name = name or path.stem
        try:
            cfg = load_run_config(path)
        except IsotuiError as exc:
            self.notify(str(exc), severity="error")
            return
        if "sweep" in cfg:
            if self.backend is not None:
                self.backend.submit(SweepRequest(path.resolve()))
                self.notify(f"sweep {name}: queued; its tasks show as one job (x cancels it)")
            return
        overrides = {k: cfg[k] for k in SPEC_OPTIONS if k in cfg}
        models = cfg.get("models", ["minilm"])
        for model in models:
            self.submit(model, overrides)
        self.selected = models[0]
        self.show_table()
        self.notify(f"preset {name}: queued {', '.join(models)}")

    def action_focus_input(self) -> None:
        self.main_screen.query_one("#model-input", Input).focus()

    def action_toggle_compare(self) -> None:
        if not self.selected:
            self.notify("select a model first", severity="warning")
            return
        model = self.selected
        if model in self.comparison:
            self.comparison.remove(model)
            self.notify(f"{model} left the comparison ({self.compared_count()})")
        elif model in self.results:
            self.comparison.append(model)
            self.notify(f"{model} added to the comparison ({self.compared_count()}; e exports them)")
        else:
            self.notify(f"run {model} first (r): only measured models can be compared", severity="warning")
            return
        self.replot()
        self.show_drift()
        self.show_marks()
        self.save_session()

    def compared_count(self) -> str:
        n = len(self.comparison)
        return f"{n} model{'s' * (n != 1)} compared"

    def show_marks(self) -> None:
        """Mark the compared models (and their cached runs) in the models pane."""
        self.models_pane.show_marks()

    def compared_marks(self) -> set[str]:
        return {f"model:{m}" for m in self.comparison} | {
            f"run:{self.results[m].key}" for m in self.comparison if m in self.results
        }

    def action_cycle_metric(self) -> None:
        self.metric = PLOT_METRICS[(PLOT_METRICS.index(self.metric) + 1) % len(PLOT_METRICS)]
        self.replot()
        self.save_session()

    def action_toggle_depth(self) -> None:
        self.depth = not self.depth
        self.replot()
        self.show_drift()
        self.save_session()

    def action_sort(self) -> None:
        self.main_screen.query_one("#layers", LayerTable).sort_cursor_column()

    def action_cycle_theme(self) -> None:
        """Next isotui theme (bundled and user themes, in name order)."""
        if not self.theme_names:
            return
        current = self.theme_names.index(self.theme) if self.theme in self.theme_names else -1
        self.theme = self.theme_names[(current + 1) % len(self.theme_names)]
        self.notify(f"theme: {self.theme}", timeout=2)

    def watch_theme(self, _: str) -> None:
        if self.screen_stack:  # shades and line colours come from the theme
            self.show_table()
            self.replot()
            self.show_drift()

    def action_options(self) -> None:
        def done(options: dict[str, Any] | None) -> None:
            if options is not None:
                self.spec_defaults = options
                self.notify("options set for the next jobs: " + self.options_summary())
                self.save_session()

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
        try:
            where = self.export_file(what, "csv", lambda path: write_csv(chosen, path))
        except IsotuiError as exc:
            self.notify(str(exc), severity="error")
            return
        self.notify(f"{where} ({len(chosen)} model{'s' * (len(chosen) != 1)})")

    def export_name(self, what: str, suffix: str) -> str:
        return f"isotui-{time.strftime('%Y%m%d-%H%M%S')}{'-' + what if what else ''}.{suffix}"

    def export_path(self, what: str, suffix: str) -> Path:
        """A new file in the export folder (settings ``export_dir``; made if missing), absolute,
        so the notification says exactly where it went."""
        folder = self.export_dir.expanduser().resolve()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise IsotuiError(f"cannot make the export folder {folder}: {exc.strerror or exc}") from None
        return folder / self.export_name(what, suffix)

    def export_file(self, what: str, suffix: str, write: Callable[[Path], object]) -> str:
        """Write an export (CSV, screenshot, figure) with ``write(path)`` and hand it to the user
        who asked; returns what happened, for the notification. In a terminal it is a file in the
        export folder. Served in a browser (``isotui serve``) the server's disk is not where that
        user is: the file goes to the browser as a download (Textual's delivery API)."""
        if not self.is_web:
            path = self.export_path(what, suffix)
            _write_export(write, path)
            return f"wrote {path}"
        name = self.export_name(what, suffix)
        with tempfile.TemporaryDirectory(prefix="isotui-export-") as tmp:
            path = Path(tmp) / name
            _write_export(write, path)
            data = path.read_bytes()
        self.deliver_binary(io.BytesIO(data), save_filename=name, name=EXPORT_DELIVERY)
        return f"sent {name} to your browser"

    @on(events.DeliveryFailed)
    def _export_not_delivered(self, event: events.DeliveryFailed) -> None:
        if event.name == EXPORT_DELIVERY:
            self.notify(f"the export did not reach the browser: {event.exception}", severity="error")

    def action_export(self) -> None:
        """The comparison set (or the shown model when the set is empty)."""
        chosen = [self.results[m] for m in self.comparison if m in self.results]
        if not chosen and self.selected in self.results:
            chosen = [self.results[self.selected]]
        self._export(chosen, "comparison")

    def action_export_table(self) -> None:
        result = self.results.get(self.selected or "")
        self._export([result] if result else [], "table")

    def action_screenshot(self) -> None:  # type: ignore[override]  # the key takes no arguments
        svg = self.export_screenshot()
        try:
            where = self.export_file("", "svg", lambda path: path.write_text(svg, encoding="utf-8"))
        except IsotuiError as exc:
            self.notify(str(exc), severity="error")
            return
        self.notify(where)

    def screen_figure(self) -> ScreenFigure | str:
        """The figure of the plot on screen (a lab tab's, else the layer view's), or why there is none."""
        from isotui.tui.figure_export import ScreenFigure

        maker = getattr(self.screen, "screen_figure", None)
        if maker is not None:
            figure: ScreenFigure | str = maker()
            return figure
        if not self.comparison:
            return "no plot to save yet: run a model (r)"
        options = {"metric": self.metric, "depth": self.depth}
        draw = "isotui.paper_figures_dynamics:draw_metric_by_layer"
        return ScreenFigure("layers", draw, self.compared(), options)

    def action_save_figure(self) -> None:
        """``F``: the plot on screen as PDF, PNG and CSV (drawn off the UI thread; matplotlib loads
        on the first press), written where the other exports go."""
        figure = self.screen_figure()
        if isinstance(figure, str):
            self.notify(figure, severity="warning")
            return
        self.notify("drawing the figure...", timeout=2)
        self._draw_figure(figure)

    @work(thread=True, group="figure")
    def _draw_figure(self, figure: ScreenFigure) -> None:
        from isotui.tui.figure_export import render_files

        try:
            pdf, png, rows = render_files(figure)
        except IsotuiError as exc:
            self.call_from_thread(self.notify, str(exc), severity="error")
            return
        except Exception as exc:  # a drawing's bug must not end the app: one sentence, nothing lost
            self.call_from_thread(self.notify, f"could not draw the figure: {exc}", severity="error")
            return
        self.call_from_thread(self._write_figure, figure.what, pdf, png, rows)

    def _write_figure(self, what: str, pdf: bytes, png: bytes, rows: list[dict[str, Any]]) -> None:
        from isotui.store.export import write_dicts_csv

        name = f"figure-{what}"
        try:
            said = [
                self.export_file(name, "pdf", lambda path: path.write_bytes(pdf)),
                self.export_file(name, "png", lambda path: path.write_bytes(png)),
                self.export_file(name, "csv", lambda path: write_dicts_csv(rows, path)),
            ]
        except IsotuiError as exc:
            self.notify(str(exc), severity="error")
            return
        self.notify("\n".join(said), title="figure", timeout=10)

    def action_cancel(self) -> None:
        jobs = self.main_screen.query_one("#jobs", JobsTable)
        job = jobs.chosen_job() if jobs.has_focus else None
        if job is None or not jobs.records[job].active:
            job = jobs.latest_active()
        if job is None or self.backend is None or not self.backend.cancel(job):
            self.notify("no job in flight to cancel", severity="warning")
            return
        jobs.mark_cancelling(job)
        self.notify(f"cancelling job {job} ({jobs.records[job].model})")

    def key_bindings(self, bindings: list[Binding] | None = None) -> list[tuple[str, str, str]]:
        """(key as bound now, id, what it does) for every app key (or ``bindings``), remaps included."""
        return binding_rows(self, self.BINDINGS if bindings is None else bindings, self.settings.keys)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The main screen's keys do nothing (and are not offered) on a screen above it (the lab)."""
        stack = self.screen_stack
        return not (action in MAIN_ONLY_ACTIONS and stack and self.screen is not stack[0])

    def action_help(self) -> None:
        sort_key = next(k for k, i, _ in self.key_bindings() if i == "sort")
        self.push_screen(HelpScreen(self.key_bindings(), sort_key, title="isotui keys: models and layers"))

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        """Every isotui action in the command palette (ctrl+p), beside Textual's own."""
        yield from super().get_system_commands(screen)
        for (key, _, what), b in zip(self.key_bindings(), self.BINDINGS, strict=True):
            if b.action in ("quit",):
                continue
            yield SystemCommand(
                f"isotui: {b.description}", f"{what} (key {key})", getattr(self, f"action_{b.action}")
            )

    # -- backend events ------------------------------------------------------------------------

    def _post_event(self, ev: JobEvent) -> None:
        """The backend's callback (from its threads): see :class:`EventRelay`."""
        self._relay(ev)

    def on_backend_message(self, message: BackendMessage) -> None:
        self._job_events.handle(self._relay.newest(message.event))

    def add_sweep_result(self, sweep: SweepResult) -> None:
        """A finished sweep: each merged run joins the comparison as a finished run does."""
        for result in sweep.results:
            self.add_result(result)
        if sweep.results:
            self.selected = sweep.results[0].model
            self.show_table()
        if not sweep.from_cache:
            self.refresh_models()  # new cached runs to list
        failed = f"; {len(sweep.failed)} failed: {', '.join(sweep.failed)}" if sweep.failed else ""
        runs = f"{len(sweep.results)} run{'' if len(sweep.results) == 1 else 's'}"
        self.notify(
            f"sweep {sweep.name}: {runs} added to the comparison{failed}",
            severity="warning" if sweep.failed else "information",
        )

    def add_result(self, result: ModelResult) -> None:
        model = result.model
        self.results[model] = result
        new = model not in self.comparison
        if new:
            self.comparison.append(model)
        if self.selected is None:
            self.selected = model
        self.show_table()
        self.replot()
        self.show_drift()
        if new:
            self.show_marks()
        self.save_session()

    # -- views -----------------------------------------------------------------------------

    def show_table(self) -> None:
        table = self.main_screen.query_one("#layers", LayerTable)
        result = self.results.get(self.selected or "")
        if result is None:
            table.show(None)
            # the title is set once (each change repaints the table)
            waiting = f"{self.selected} (not run yet: press r)"
            table.border_title = waiting if self.selected else "no model selected"
            return
        table.show(result)
        source = "cache" if result.from_cache else f"{result.meta.get('seconds', 0):.1f} s"
        table.border_title = f"{result.model} · {result.meta.get('data')} · {amount(result.meta)} · {source}"

    def model_colours(self) -> list[RGB]:
        """One line colour per compared model, from the theme (so plots follow it)."""
        t = self.current_theme
        names = [t.primary, t.secondary, t.accent, t.success, t.warning, t.error]
        return [Color.parse(n).rgb for n in names if n] or [(255, 255, 255)]

    def compared(self) -> list[ModelResult]:
        return [self.results[m] for m in self.comparison]

    def show_drift(self) -> None:
        """The drift pane: the compared models, and the selected one's curves."""
        self.main_screen.query_one(DriftPane).show(
            self.compared(), self.results.get(self.selected or ""), self.depth, self.model_colours()
        )

    def replot(self) -> None:
        screen = self.main_screen
        legend = draw_metric_curves(
            screen.query_one("#plot", FitPlot), self.compared(), self.metric, self.depth, self.model_colours()
        )
        screen.query_one("#plot-legend", PlotLegend).show(legend)


def settle_memory() -> None:
    """After the first frame: collect once, then freeze what exists (the app's widgets, themes,
    modules) out of the garbage collector's sight. A full collection then walks only what was made
    since: without this one took 50-220 ms every few dozen keys, the app's worst key latency
    (issue 12)."""
    gc.collect()
    gc.freeze()


def _write_export(write: Callable[[Path], object], path: Path) -> None:
    try:
        write(path)
    except OSError as exc:
        raise IsotuiError(f"cannot write {path}: {exc.strerror or exc}") from None


def run_app(app: IsotuiApp | None = None, *, fresh: bool = False, **run_kwargs: Any) -> None:
    """Entry point of ``isotui`` with no arguments (``--fresh``: without the last session;
    ``run_kwargs``: e.g. headless with a pilot)."""
    app = app or IsotuiApp(fresh=fresh)
    app.run(**run_kwargs)
    if app.backend is not None and not app.backend.wait_idle(0) and not app.backend.terminate():
        # An in-process worker still inside torch past the bounded wait: leave without the
        # interpreter's teardown, which would abort ("terminate called without an active
        # exception", 134). Worker processes are simply killed.
        import os
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
