"""The app's last session, restored at start and written as it changes (the file's format is
:mod:`isotui.tui.session`): the data and run options, the lab's settings boxes, the plotted metric
and axis, the selected model and the comparison set, reopened from the result cache on a worker
(file reads: nothing is computed). A damaged file or a bad value is one notification, and the rest
starts clean."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from isotui.errors import IsotuiError
from isotui.spec import SPEC_OPTIONS
from isotui.store.cache import CacheProblem
from isotui.tui.main_screen import PLOT_METRICS
from isotui.tui.options import check_options
from isotui.tui.session import Session, load_session, save_session
from isotui.tui.wording import in_options_terms

if TYPE_CHECKING:
    from isotui.results import ModelResult
    from isotui.tui.host import AppState


class LastSession:
    """``fresh``: start without the last session (it is overwritten on the next change)."""

    def __init__(self, app: AppState, path: Path, *, fresh: bool = False) -> None:
        self.app = app
        self.path = path
        self.fresh = fresh
        self._unwritable = False  # said once
        self.restored = Session()  # what restore() read

    def restore(self) -> None:
        """Put the last session's options, lab boxes and view into the app (its comparison set
        is reopened by :meth:`reopen`, once the main screen is there to show it)."""
        if not self.fresh:
            self.restored = self._load()

    def _load(self) -> Session:
        app = self.app
        try:
            session = load_session(self.path)
        except IsotuiError as exc:
            app.notify(f"{exc}; starting a new session", severity="warning", timeout=10)
            return Session()
        if session.options:
            options = {**app.spec_defaults, **session.options}
            try:
                check_options(options)
                app.spec_defaults = options
            except IsotuiError as exc:
                app.notify(
                    f"last session's options not restored: {in_options_terms(str(exc))}", severity="warning"
                )
        app.lab_inputs = dict(session.lab)
        if session.metric in PLOT_METRICS:
            app.metric = session.metric
        app.depth = session.depth
        # a model that never gave a result (a typo that failed) is not selected again
        app.selected = session.selected if session.selected in {m for m, _ in session.comparison} else None
        return session

    def reopen(self) -> None:
        """The restored comparison set from the result cache, on a worker thread; the main
        screen shows it when read."""
        session = self.restored
        if session.comparison:
            self.app.run_worker(lambda: self._read(session), thread=True, exclusive=True, group="session")

    def _read(self, session: Session) -> None:
        from isotui.experiments import layer_pass  # (after the first frame, on a worker thread)

        app = self.app
        found: list[ModelResult] = []
        gone: list[str] = []
        for model, key in session.comparison:
            try:
                result = layer_pass.read(app.cache, key)
            except CacheProblem:
                result = None
            if result is None:
                gone.append(model)
                continue
            result.model, result.from_cache = model, True
            for row in result.rows:
                row.model = model
            found.append(result)
        app.call_from_thread(app.main_screen.reopened, found, gone, session.selected)

    def current(self) -> Session:
        """The session as it stands."""
        app = self.app
        options = {k: v for k, v in app.spec_defaults.items() if k in SPEC_OPTIONS and k != "base_dir"}
        return Session(
            comparison=[(m, app.results[m].key) for m in app.comparison if m in app.results],
            selected=app.selected if app.selected in app.results else None,  # not a failed name
            metric=app.metric,
            depth=app.depth,
            options=options,
            lab=dict(app.lab_inputs),
        )

    def save(self) -> None:
        """Write the session now (atomically); a folder that cannot be written is said once."""
        try:
            save_session(self.path, self.current())
        except OSError as exc:
            if not self._unwritable:
                self._unwritable = True
                self.app.notify(
                    f"cannot write the session file {self.path}: {exc.strerror or exc}",
                    severity="warning",
                )
