"""The backend's events in the app: delivered on the UI thread, a burst of progress drawn once,
and one handler per event type.

Backend threads call :class:`EventRelay`; it posts a :class:`BackendMessage` (a plain progress
report only when none of its job's is waiting to be drawn; the waiting one then draws the newest).
On the UI thread :meth:`JobEventView.handle` folds the event into the jobs pane and dispatches on
its type.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import singledispatchmethod
from typing import TYPE_CHECKING, Any

from textual.css.query import NoMatches
from textual.message import Message

from isotui.backend import JobEvent, JobFailed, JobFinished, JobNotice, JobProgress, job_kind
from isotui.render import shorten
from isotui.sweep import SweepResult
from isotui.tui.wording import in_options_terms

if TYPE_CHECKING:
    from isotui.tui.host import AppState


class BackendMessage(Message):
    """A backend event, delivered on the UI thread."""

    def __init__(self, event: JobEvent) -> None:
        super().__init__()
        self.event = event

    def can_replace(self, message: Message) -> bool:
        """A plain progress report is superseded by the next one of the same job queued behind it
        (only the newest is drawn: keys are not kept waiting behind a backlog of redraws)."""
        return plain_progress(self.event) and (
            isinstance(message, BackendMessage)
            and plain_progress(message.event)
            and message.event.job_id == self.event.job_id
        )


def plain_progress(ev: JobEvent) -> bool:
    return isinstance(ev, JobProgress) and not ev.progress.message


class EventRelay:
    """The backend's ``post`` callback (called from its threads): each event becomes a
    :class:`BackendMessage`, except a progress report while one of its job's waits to be drawn."""

    def __init__(self, post_message: Callable[[Message], Any]) -> None:
        self._post_message = post_message
        self._lock = threading.Lock()
        self._latest: dict[int, JobEvent] = {}  # per job: the newest report not yet drawn

    def __call__(self, ev: JobEvent) -> None:
        if plain_progress(ev):
            with self._lock:
                waiting = ev.job_id in self._latest
                self._latest[ev.job_id] = ev
            if waiting:
                return
        self._post_message(BackendMessage(ev))

    def newest(self, ev: JobEvent) -> JobEvent:
        """On the UI thread: the event to draw for ``ev`` (for a progress report, its job's newest)."""
        if not plain_progress(ev):
            return ev
        with self._lock:
            return self._latest.pop(ev.job_id, ev)


class JobEventView:
    """What each backend event changes in the app: the jobs pane always, then per type."""

    def __init__(self, app: AppState) -> None:
        self.app = app

    def handle(self, ev: JobEvent) -> None:
        try:
            self.app.main_screen.jobs().apply(ev)
        except NoMatches:  # the app is closing; the backend's last words have nowhere to go
            return
        self.on_event(ev)

    def _lab_status(self, ev: JobEvent, text: str) -> None:
        """A line in the lab's status bar about an experiment's job, when the lab is open."""
        lab = self.app.lab_screen()
        if lab is not None and job_kind(ev.spec) != "layers":
            lab.status(f"{ev.spec.kind} {shorten(ev.spec.model, 40)}{text}", ev.spec.kind)

    @singledispatchmethod
    def on_event(self, ev: JobEvent) -> None:
        """Queued, started, cancelled: the jobs pane says it all."""

    @on_event.register
    def _progress(self, ev: JobProgress) -> None:
        if ev.progress.message:  # e.g. an out-of-memory back-off
            self.app.notify(f"{ev.spec.model}: {in_options_terms(ev.progress.message)}", severity="warning")
        else:
            p = ev.progress
            self._lab_status(ev, f": {p.samples_done}/{p.samples_total}")

    @on_event.register
    def _notice(self, ev: JobNotice) -> None:
        self.app.notify(f"{ev.spec.model}: {in_options_terms(ev.text)}", severity="warning")

    @on_event.register
    def _finished(self, ev: JobFinished) -> None:
        if isinstance(ev.result, SweepResult):
            self.app.add_sweep_result(ev.result)
            return
        kind = job_kind(ev.spec)
        if kind != "layers":  # the lab's experiments; a layer run goes to the main screen's table
            self.app.add_lab_result(kind, ev.result)
            return
        self.app.add_result(ev.result)
        if not ev.result.from_cache:
            self.app.refresh_models()  # a new cached run to list

    @on_event.register
    def _failed(self, ev: JobFailed) -> None:
        self._lab_status(ev, f" failed: {in_options_terms(ev.message)}")
        self.app.notify(in_options_terms(ev.message), severity="error", timeout=10)
