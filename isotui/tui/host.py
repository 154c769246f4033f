"""What the app offers the screens and panes above it (a protocol: they need not import the app,
and a type checker sees every use)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

from textual.binding import Binding
from textual.theme import Theme

from isotui.spec import RunSpec

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
