"""The app's exports: the comparison's or the shown table's CSV (``e``, ``E``), a screenshot
(``S``) and the plot on screen as PDF, PNG and CSV (``F``), each handed to the user who asked: a
file in the export folder (settings ``export_dir``) in a terminal, a download in a browser
(``isotui serve``: the server's disk is not where that user is)."""

from __future__ import annotations

import io
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isotui.errors import IsotuiError
from isotui.results import ModelResult
from isotui.store.export import write_csv

if TYPE_CHECKING:
    from isotui.tui.figure_export import ScreenFigure
    from isotui.tui.host import AppState

EXPORT_DELIVERY = "isotui-export"  # the name of an export's delivery to the browser (isotui serve)


class Exports:
    """Writes (or sends) the app's exports; every outcome is one notification."""

    def __init__(self, app: AppState, folder: Path) -> None:
        self.app = app
        self.folder = folder

    def name(self, what: str, suffix: str) -> str:
        return f"isotui-{time.strftime('%Y%m%d-%H%M%S')}{'-' + what if what else ''}.{suffix}"

    def path(self, what: str, suffix: str) -> Path:
        """A new file in the export folder (made if missing), absolute, so the notification says
        exactly where it went."""
        folder = self.folder.expanduser().resolve()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise IsotuiError(f"cannot make the export folder {folder}: {exc.strerror or exc}") from None
        return folder / self.name(what, suffix)

    def file(self, what: str, suffix: str, write: Callable[[Path], object]) -> str:
        """Write an export with ``write(path)`` and hand it to the user who asked; returns what
        happened, for the notification. In a terminal it is a file in the export folder. Served in
        a browser the file goes to the browser as a download (Textual's delivery API)."""
        if not self.app.is_web:
            path = self.path(what, suffix)
            _write_export(write, path)
            return f"wrote {path}"
        name = self.name(what, suffix)
        with tempfile.TemporaryDirectory(prefix="isotui-export-") as tmp:
            path = Path(tmp) / name
            _write_export(write, path)
            data = path.read_bytes()
        self.app.deliver_binary(io.BytesIO(data), save_filename=name, name=EXPORT_DELIVERY)
        return f"sent {name} to your browser"

    def results_csv(self, chosen: list[ModelResult], what: str) -> None:
        """The CSV of layer runs (``what``: comparison, table)."""
        if not chosen:
            self.app.notify("nothing to export yet: run a model", severity="warning")
            return
        try:
            where = self.file(what, "csv", lambda path: write_csv(chosen, path))
        except IsotuiError as exc:
            self.app.notify(str(exc), severity="error")
            return
        self.app.notify(f"{where} ({len(chosen)} model{'s' * (len(chosen) != 1)})")

    def screenshot(self) -> None:
        svg = self.app.export_screenshot()
        try:
            where = self.file("", "svg", lambda path: path.write_text(svg, encoding="utf-8"))
        except IsotuiError as exc:
            self.app.notify(str(exc), severity="error")
            return
        self.app.notify(where)

    def figure(self) -> None:
        """The plot on screen as PDF, PNG and CSV (drawn off the UI thread; matplotlib loads on
        the first press): a lab tab's, else the layer view's."""
        app = self.app
        maker = getattr(app.screen, "screen_figure", app.main_screen.screen_figure)
        figure: ScreenFigure | str = maker()
        if isinstance(figure, str):
            app.notify(figure, severity="warning")
            return
        app.notify("drawing the figure...", timeout=2)
        app.run_worker(lambda: self._draw_figure(figure), thread=True, group="figure")

    def _draw_figure(self, figure: ScreenFigure) -> None:
        from isotui.tui.figure_export import render_files

        app = self.app
        try:
            pdf, png, rows = render_files(figure)
        except IsotuiError as exc:
            app.call_from_thread(app.notify, str(exc), severity="error")
            return
        except Exception as exc:  # a drawing's bug must not end the app: one sentence, nothing lost
            app.call_from_thread(app.notify, f"could not draw the figure: {exc}", severity="error")
            return
        app.call_from_thread(self._write_figure, figure.what, pdf, png, rows)

    def _write_figure(self, what: str, pdf: bytes, png: bytes, rows: list[dict[str, Any]]) -> None:
        from isotui.store.export import write_dicts_csv

        name = f"figure-{what}"
        try:
            said = [
                self.file(name, "pdf", lambda path: path.write_bytes(pdf)),
                self.file(name, "png", lambda path: path.write_bytes(png)),
                self.file(name, "csv", lambda path: write_dicts_csv(rows, path)),
            ]
        except IsotuiError as exc:
            self.app.notify(str(exc), severity="error")
            return
        self.app.notify("\n".join(said), title="figure", timeout=10)


def _write_export(write: Callable[[Path], object], path: Path) -> None:
    try:
        write(path)
    except OSError as exc:
        raise IsotuiError(f"cannot write {path}: {exc.strerror or exc}") from None
