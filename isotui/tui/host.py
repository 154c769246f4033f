"""What the app offers the screens and panes above it (a protocol: they need not import the app,
and a type checker sees every use)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, Protocol

from textual.binding import Binding
from textual.theme import Theme

from isotui.spec import RunSpec

if TYPE_CHECKING:
    from textual.screen import Screen

    from isotui.backend import Backend
    from isotui.results import ModelResult
    from isotui.store.cache import ResultCache
    from isotui.sweep import SweepResult
    from isotui.tui.figure_export import ScreenFigure
    from isotui.tui.jobs import JobsTable

RGB = tuple[int, int, int]


class AppHost(Protocol):
    BINDINGS: ClassVar[list[Binding]]
    selected: str | None
    # the lab's results: attention per model, the latest dynamics, drift block and checkpoints
    lab_results: dict[str, Any]
    lab_inputs: dict[str, str]  # the lab's settings boxes, kept across visits
    spec_defaults: dict[str, Any]

    @property
    def current_theme(self) -> Theme: ...

    def model_colours(self) -> list[RGB]: ...

    def spec_for(self, model: str, overrides: dict[str, Any] | None = None) -> RunSpec: ...

    def submit_request(self, request: Any) -> None: ...

    def save_session(self) -> None: ...

    def export_file(self, what: str, suffix: str, write: Callable[[Path], object]) -> str: ...

    def key_bindings(self, bindings: list[Binding] | None = None) -> list[tuple[str, str, str]]: ...

    def notify(self, message: str, *, markup: bool = False, **kwargs: Any) -> None: ...


class LabHost(Protocol):
    """What the lab screen offers its tabs (isotui/tui/lab.py, which imports them)."""

    log_counts: bool  # the score histograms' counts on a log10 scale

    def status(self, text: str, kind: str | None = None) -> None: ...

    def app_colours(self) -> list[RGB]: ...


class MainView(Protocol):
    """What the app's helpers ask of the layer view (isotui/tui/main_screen.py)."""

    def show_table(self) -> None: ...

    def reopened(self, found: list[ModelResult], gone: list[str], selected: str | None) -> None: ...

    def screen_figure(self) -> ScreenFigure | str: ...

    def jobs(self) -> JobsTable: ...


class LabStatus(Protocol):
    """What the job events ask of the lab screen, when it is open (isotui/tui/lab.py)."""

    def status(self, text: str, kind: str | None = None) -> None: ...


class Launching(Protocol):
    """What the layer view asks of the app's launcher (isotui/tui/launch.py)."""

    def run_selected(self) -> None: ...

    def run_preset(self, name: str) -> None: ...

    def run_config(self, path: Path, name: str | None = None) -> None: ...


class Reopening(Protocol):
    """What the layer view asks of the last session (isotui/tui/last_session.py)."""

    def reopen(self) -> None: ...


class AppState(AppHost, Protocol):
    """The app as the helpers it builds see it (its exports, job events, last session, launcher
    and layer view): its state, its parts and the Textual services they call. A protocol, so
    that none of them imports the app that imports them all."""

    cache: ResultCache
    backend: Backend | None
    results: dict[str, ModelResult]  # each model's result
    comparison: list[str]  # the comparison set, in order
    metric: str  # the plotted metric
    depth: bool  # its x axis: depth 0..1 (else the layer index)

    @property
    def main_screen(self) -> MainView: ...

    @property
    def launcher(self) -> Launching: ...

    @property
    def last_session(self) -> Reopening: ...

    @property
    def is_web(self) -> bool: ...

    @property
    def screen(self) -> Screen[object]: ...

    @property
    def screen_stack(self) -> list[Screen[Any]]: ...

    def lab_screen(self) -> LabStatus | None: ...

    def add_result(self, result: ModelResult) -> None: ...

    def add_sweep_result(self, sweep: SweepResult) -> None: ...

    def add_lab_result(self, kind: str, result: Any) -> None: ...

    def refresh_models(self) -> None: ...

    def call_from_thread(self, callback: Callable[..., object], *args: Any, **kwargs: Any) -> object: ...

    def run_worker(
        self,
        work: Callable[[], object],
        *,
        group: str = "default",
        exclusive: bool = False,
        thread: bool = False,
    ) -> object: ...

    def push_screen(
        self,
        screen: Screen[dict[str, Any] | None],
        callback: Callable[[dict[str, Any] | None], None] | None = None,
    ) -> object: ...

    def deliver_binary(
        self, path_or_file: BinaryIO, *, save_filename: str | None = None, name: str | None = None
    ) -> str | None: ...

    def export_screenshot(self) -> str: ...
