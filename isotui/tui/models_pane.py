"""The main screen's models pane: a filter box over the list of bundled models, presets, local
models and cached runs. It owns the list: what is listed (scanned on a worker thread: a large
cache takes a while), the filter, the marks of compared models. What picking an entry means
(select, run, open a cached run) is the app's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import Input, OptionList
from textual.widgets.option_list import OptionDoesNotExist

from isotui.store.cache import ResultCache
from isotui.tui.model_list import Entry, build_options, first_enabled, gather_entries


class ModelFilter(Input):
    """The models pane's box: typing filters the list; enter runs exactly what was typed."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("down", "to_list", show=False)]  # type: ignore[assignment]

    def action_to_list(self) -> None:
        self.app.query_one("#models", OptionList).focus()


class ModelsPane(Vertical):
    """``restore``: called with the model to show when the list first appears (the last
    session's, given by ``selected``), after its entry is highlighted without being picked.
    ``marks``: the option ids to mark as compared (models and their cached runs)."""

    def __init__(
        self,
        cache: ResultCache,
        *,
        selected: Callable[[], str | None],
        restore: Callable[[str], None],
        marks: Callable[[], set[str]],
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self.cache = cache
        self._selected = selected
        self._restore = restore
        self._marks = marks
        self.entries: list[Entry] = []
        self._unlisted: str | None = None  # the last session's model, not in the list shown yet

    def compose(self) -> ComposeResult:
        yield ModelFilter(placeholder="filter, or type a model + enter", id="model-input")
        yield OptionList(id="models")

    @work(thread=True, exclusive=True, group="models")
    def refresh_entries(self) -> None:
        """Re-read presets, the HF cache and cached runs, then show them, keeping the filter: all
        but the HF cache first, then with it (its scan is the slow part)."""
        self.app.call_from_thread(self._listed, gather_entries(self.cache, hub=False))
        self.app.call_from_thread(self._listed, gather_entries(self.cache))

    def _listed(self, entries: list[Entry]) -> None:
        self.entries = entries
        # A worker's answer that came after quitting: the pane, or while the app closes, its
        # list (children go first) is already gone.
        lists = self.query("#models").results(OptionList)
        models = next(lists, None) if self.is_attached else None
        if models is None:
            return
        restoring = self._selected() if models.option_count == 0 else None  # the last session's
        if restoring is None:
            untouched = models.highlighted == first_enabled(models)
            self.filter(keep_cursor=True)
            unlisted, self._unlisted = self._unlisted, None
            if unlisted is not None and untouched:  # a model of the HF cache: listed second
                with models.prevent(OptionList.OptionHighlighted), contextlib.suppress(OptionDoesNotExist):
                    models.highlighted = models.get_option_index(f"model:{unlisted}")
            return
        with models.prevent(OptionList.OptionHighlighted):  # the list's first entry is not picked
            self.filter()
            try:
                models.highlighted = models.get_option_index(f"model:{restoring}")
            except OptionDoesNotExist:
                self._unlisted = restoring
        self._restore(restoring)

    def filter(self, keep_cursor: bool = False) -> None:
        """List the entries that match the box."""
        query = self.query_one("#model-input", Input).value
        models = self.query_one("#models", OptionList)
        index = models.highlighted
        current = models.get_option_at_index(index).id if keep_cursor and index is not None else None
        # the cursor stays where the user left it, and a list read again picks nothing on its way
        # (it went through the first entry, which picked that model)
        with models.prevent(OptionList.OptionHighlighted):
            models.clear_options()
            models.add_options(build_options(self.entries, query, self._marks()))
            kept = None
            if current is not None:
                with contextlib.suppress(OptionDoesNotExist):
                    kept = models.get_option_index(current)
            if kept is not None:
                models.highlighted = kept
        if kept is None:
            models.highlighted = first_enabled(models)

    def show_marks(self) -> None:
        """Mark the compared models, once anything is listed (a restored comparison can come back
        before the worker that lists the models)."""
        if self.entries:
            self.filter(keep_cursor=True)

    @on(Input.Changed, "#model-input")
    def _filter(self, _event: Input.Changed) -> None:
        self.filter()
