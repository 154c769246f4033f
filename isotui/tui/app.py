"""isotui's terminal app, the shell: its screens (the layer view at the bottom, the attention lab,
the dialogs), its keys, its theme, the header's device line, quitting; the app's state (the
results and the comparison set, the lab's results, the next jobs' options) lives here and the
screens and panes show it.

- :mod:`isotui.tui.main_screen`: the layer view and what its keys and picks do;
- :mod:`isotui.tui.lab`: the attention lab, its tabs from the experiment registry;
- :mod:`isotui.tui.launch`: what starts and stops jobs; :mod:`isotui.tui.job_events`: their events;
- :mod:`isotui.tui.exports`: CSV, screenshots and figures; :mod:`isotui.tui.last_session`: the
  last session.

Everything slow happens in :class:`isotui.backend.Backend` worker threads; their events come
back as :class:`BackendMessage` and only the UI thread touches widgets. Nothing here imports
torch or transformers: the first frame draws before they load (in the backend, on first use).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from textual import events, on, work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.color import Color
from textual.css.query import NoMatches
from textual.screen import Screen

from isotui.backend import Backend, JobEvent, Post
from isotui.paths import cache_dir, config_dir, resource_dir
from isotui.results import METRICS, ModelResult
from isotui.settings import load_settings
from isotui.spec import RunSpec
from isotui.store.cache import ResultCache
from isotui.sweep import SweepResult
from isotui.tui.exports import EXPORT_DELIVERY, Exports
from isotui.tui.help import HelpScreen, binding_rows
from isotui.tui.job_events import BackendMessage, EventRelay, JobEventView
from isotui.tui.keys import APP_KEYS, MAIN_ONLY_ACTIONS
from isotui.tui.lab_tabs import LabResults, tab_of
from isotui.tui.last_session import LastSession
from isotui.tui.launch import Launcher
from isotui.tui.main_screen import PLOT_METRICS, MainScreen
from isotui.tui.model_list import Entry
from isotui.tui.plots import RGB
from isotui.tui.session import session_path
from isotui.tui.sysinfo import describe_devices, query_gpus
from isotui.tui.themes import load_themes, starting_theme

if TYPE_CHECKING:
    from isotui.tui.lab import LabScreen

DEVICE_REFRESH_S = 10.0
QUIT_WAIT_S = 15.0  # how long quitting waits for a running job to stop at a safe point
__all__ = ["EXPORT_DELIVERY", "PLOT_METRICS", "BackendMessage", "IsotuiApp", "run_app"]


class IsotuiApp(App[None]):
    """The keyboard-driven lab. ``spec_defaults`` are the data and run options for new jobs."""

    TITLE = "isotui"
    CSS_PATH = Path(__file__).with_name("app.tcss")
    AUTO_FOCUS = "#models"
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-narrow"), (120, "-wide")]  # type: ignore[misc]
    VERTICAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-short"), (30, "-tall")]  # type: ignore[misc]
    BINDINGS: ClassVar[list[Binding]] = APP_KEYS  # type: ignore[assignment]  # Bindings only: help reads ids

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
        self.exports = Exports(self, export_dir or self.settings.export_dir or Path.cwd())
        self.last_session = LastSession(self, session_path(self.settings.path), fresh=fresh)
        self.launcher = Launcher(self)
        self.lab_inputs: dict[str, str] = {}  # the lab's settings boxes, kept across visits
        self.device_probe = device_probe or (lambda: describe_devices(query_gpus(), self.own_pids()))
        self.device_line = ""
        self.backend_factory = backend_factory  # tests pass a backend with a fake, slow model
        self.backend: Backend | None = None
        self._stopping = False  # quitting: waiting for the running job to stop
        # the layer view's state: each model's result, the comparison set (in order), the model
        # selected, the plotted metric and its x axis (layer index or depth 0..1)
        self.results: dict[str, ModelResult] = {}
        self.comparison: list[str] = []
        self.selected: str | None = None
        self.metric = PLOT_METRICS[0]
        self.depth = False
        # the attention lab's results, a slot per lab tab (attention per model, the latest
        # dynamics, drift block, checkpoints...)
        self.lab_results: dict[str, Any] = LabResults()
        self._relay = EventRelay(self.post_message)  # backend threads -> the UI thread
        self._job_events = JobEventView(self)

    def get_default_screen(self) -> MainScreen:
        return MainScreen()

    def on_mount(self) -> None:
        """Settings, theme, the last session's state and the backend; then the main screen
        mounts and draws them (:meth:`MainScreen.on_mount`)."""
        self._apply_settings()
        self.last_session.restore()
        self.backend = self.backend_factory(self.cache, self._post_event)
        self.show_header()
        self.probe_device()
        self.set_interval(DEVICE_REFRESH_S, self.probe_device)
        self.call_after_refresh(settle_memory)

    @property
    def main_screen(self) -> MainScreen:
        """The layer view, always the bottom screen: its widgets are updated (a job ending,
        the list refreshed) while the lab or a dialog is shown on top of it."""
        if not self.screen_stack:
            raise NoMatches("the app is closing")
        screen = self.screen_stack[0]
        assert isinstance(screen, MainScreen)
        return screen

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

    # -- settings and theme --------------------------------------------------------------------

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

    def action_cycle_theme(self) -> None:
        """Next isotui theme (bundled and user themes, in name order)."""
        if not self.theme_names:
            return
        current = self.theme_names.index(self.theme) if self.theme in self.theme_names else -1
        self.theme = self.theme_names[(current + 1) % len(self.theme_names)]
        self.notify(f"theme: {self.theme}", timeout=2)

    def watch_theme(self, _: str) -> None:
        if self.screen_stack and self.main_screen.is_mounted:  # shades and line colours: the theme's
            main = self.main_screen
            main.show_table()
            main.replot()
            main.show_drift()

    def model_colours(self) -> list[RGB]:
        """One line colour per compared model, from the theme (so plots follow it)."""
        t = self.current_theme
        names = [t.primary, t.secondary, t.accent, t.success, t.warning, t.error]
        return [Color.parse(n).rgb for n in names if n] or [(255, 255, 255)]

    # -- header --------------------------------------------------------------------------------

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

    # -- keys, help, command palette -----------------------------------------------------------

    def key_bindings(self, bindings: list[Binding] | None = None) -> list[tuple[str, str, str]]:
        """(key as bound now, id, what it does) for every app key (or ``bindings``), remaps included."""
        return binding_rows(self, self.BINDINGS if bindings is None else bindings, self.settings.keys)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The main screen's keys do nothing (and are not offered) on a screen above it (the lab)."""
        stack = self.screen_stack
        return not (action in MAIN_ONLY_ACTIONS and stack and self.screen is not stack[0])

    def action_help(self) -> None:
        sort_key = next(k for k, i, _ in self.key_bindings() if i == "sort")
        columns: tuple[tuple[str, str], ...] = (
            ("layer", "the row: 0 is the embeddings; a --modules row names its module"),
            ("n", "vectors kept (padding and, by default, special tokens left out)"),
            *((m.header, m.definition) for m in METRICS if m.header),
        )
        self.push_screen(
            HelpScreen(self.key_bindings(), sort_key, title="isotui keys: models and layers", columns=columns)
        )

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        """Every isotui action in the command palette (ctrl+p), beside Textual's own."""
        yield from super().get_system_commands(screen)
        for (key, _, what), b in zip(self.key_bindings(), self.BINDINGS, strict=True):
            if b.action in ("quit",):
                continue
            yield SystemCommand(
                f"isotui: {b.description}", f"{what} (key {key})", getattr(self, f"action_{b.action}")
            )

    # -- the keys' actions: the screen, launcher or exports they belong to ---------------------

    def action_run(self) -> None:
        self.launcher.run_selected()

    def action_focus_input(self) -> None:
        self.main_screen.focus_input()

    def action_toggle_compare(self) -> None:
        self.main_screen.toggle_compare()

    def action_cycle_metric(self) -> None:
        self.main_screen.cycle_metric()

    def action_toggle_depth(self) -> None:
        self.main_screen.toggle_depth()

    def action_sort(self) -> None:
        self.main_screen.sort()

    def action_lab(self) -> None:
        from isotui.tui.lab import LabScreen

        self.push_screen(LabScreen())

    def action_options(self) -> None:
        self.launcher.options()

    def action_cancel(self) -> None:
        self.launcher.cancel()

    def action_toggle_jobs(self) -> None:
        self.main_screen.toggle_jobs()

    def action_export(self) -> None:
        """The comparison set (or the shown model when the set is empty)."""
        chosen = [self.results[m] for m in self.comparison if m in self.results]
        if not chosen and self.selected in self.results:
            chosen = [self.results[self.selected]]
        self.exports.results_csv(chosen, "comparison")

    def action_export_table(self) -> None:
        result = self.results.get(self.selected or "")
        self.exports.results_csv([result] if result else [], "table")

    def action_screenshot(self) -> None:  # type: ignore[override]  # the key takes no arguments
        self.exports.screenshot()

    def action_save_figure(self) -> None:
        """``F``: the plot on screen as PDF, PNG and CSV, written where the other exports go."""
        self.exports.figure()

    @on(events.DeliveryFailed)
    def _export_not_delivered(self, event: events.DeliveryFailed) -> None:
        if event.name == EXPORT_DELIVERY:
            self.notify(f"the export did not reach the browser: {event.exception}", severity="error")

    # -- what the screens, the lab's tabs and the job events ask of the app --------------------

    def spec_for(self, model: str, overrides: dict[str, Any] | None = None) -> RunSpec:
        return self.launcher.spec_for(model, overrides)

    def submit(self, model: str, overrides: dict[str, Any] | None = None) -> None:
        self.launcher.submit(model, overrides)

    def submit_request(self, request: Any) -> None:
        self.launcher.submit_request(request)

    def run_config(self, path: Path, name: str | None = None) -> None:
        self.launcher.run_config(path, name)

    def export_file(self, what: str, suffix: str, write: Callable[[Path], object]) -> str:
        return self.exports.file(what, suffix, write)

    def save_session(self) -> None:
        self.last_session.save()

    def select(self, model: str) -> None:
        self.main_screen.select(model)

    @property
    def entries(self) -> list[Entry]:
        """What the models pane lists (empty until its worker has scanned)."""
        try:
            return self.main_screen.entries
        except NoMatches:
            return []

    def refresh_models(self) -> None:
        self.main_screen.refresh_models()

    def add_result(self, result: ModelResult) -> None:
        self.main_screen.add_result(result)

    def add_sweep_result(self, sweep: SweepResult) -> None:
        self.main_screen.add_sweep_result(sweep)

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

    # -- backend events ------------------------------------------------------------------------

    def _post_event(self, ev: JobEvent) -> None:
        """The backend's callback (from its threads): see :class:`EventRelay`."""
        self._relay(ev)

    def on_backend_message(self, message: BackendMessage) -> None:
        self._job_events.handle(self._relay.newest(message.event))


def settle_memory() -> None:
    """After the first frame: collect once, then freeze what exists (the app's widgets, themes,
    modules) out of the garbage collector's sight. A full collection then walks only what was made
    since: without this one took 50-220 ms every few dozen keys, the app's worst key latency
    (issue 12)."""
    gc.collect()
    gc.freeze()


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
