"""The models pane's list: bundled models, presets, the local HF cache and cached runs.

Each entry's option id says what choosing it does: ``model:NAME`` runs a model, ``preset:NAME``
runs every model of a preset on its data, ``run:KEY`` opens a cached result (no computation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.text import Text
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from isotui.models.hub import cached_models
from isotui.paths import BUNDLED
from isotui.presets import presets
from isotui.render import shorten
from isotui.store.cache import ResultCache


@dataclass(frozen=True)
class Entry:
    section: str
    option_id: str
    label: str
    search: str  # what the filter box matches against


def gather_entries(cache: ResultCache, hub: bool = True) -> list[Entry]:
    """Everything the list offers, in display order (reads files only: no torch); ``hub=False``
    leaves out the Hugging Face cache, whose scan (and its import) the first frame need not wait
    for."""
    out = [Entry("bundled", f"model:{n}", n, f"{n} {what}") for n, what in BUNDLED.items()]
    out.append(Entry("bundled", "model:random:gpt2", "random:gpt2", "random:gpt2 untrained random init"))
    for p in presets():
        n = len(p.models)
        out.append(
            Entry(
                "presets",
                f"preset:{p.path.stem}",
                f"{p.path.stem} ({n} model{'s' * (n != 1)})",
                f"{p.path.stem} {' '.join(p.models)} {p.data} {p.description}",
            )
        )
    seen = {e.option_id for e in out}
    for m in cached_models() if hub else ():
        if f"model:{m.repo_id}" not in seen:
            out.append(Entry("Hugging Face cache", f"model:{m.repo_id}", m.repo_id, m.repo_id))
    for e in cache.entries():
        if e.model == "(unreadable)":
            continue
        length = f" · len {e.max_length}" if e.max_length else ""
        label = f"{shorten(e.model, 28)} · {shorten(e.data, 24)} · n {e.n_samples}{length}"
        search = f"{e.model} {e.data} {e.n_samples} {e.max_length} {e.created}"
        out.append(Entry("cached runs", f"run:{e.key}", label, search))
    return out


COMPARED = "● "  # before a model (or cached run) in the comparison set
# where a label may wrap: after a space, or after _ / - : in a name (never inside a part)
PARTS = re.compile(r"[^\s_/:-]*(?:[_/:-]+|\s+|$)")


class Label:
    """A list entry that wraps between the parts of a name (``godey2024_fig2_`` / ``characters``),
    not mid-word as the pane's width would cut it; a part wider than the pane is folded."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.parts = [m for m in PARTS.findall(text) if m]

    def __str__(self) -> str:
        return self.text

    def lines(self, width: int) -> list[str]:
        out: list[str] = []
        line = ""
        for part in self.parts:
            if line and len(line) + len(part.rstrip()) > width:
                out.append(line.rstrip())
                line = ""
            while len(part.rstrip()) > width:  # longer than the pane: cut where it must
                out.append(part[:width])
                part = part[width:]
            line += part if line or not part.isspace() else ""
        return [*out, line.rstrip()] if line.strip() else out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text("\n".join(self.lines(max(options.max_width, 1))), no_wrap=True, overflow="crop")

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(max((len(p.rstrip()) for p in self.parts), default=1), len(self.text))


def build_options(
    entries: list[Entry], query: str = "", marked: set[str] | frozenset[str] = frozenset()
) -> list[Option]:
    """Options for the entries matching ``query`` (all words, any case), under section headers;
    those whose option id is in ``marked`` (the comparison set) carry a dot."""
    words = query.lower().split()
    options: list[Option] = []
    section = None
    for e in entries:
        if not all(w in e.search.lower() for w in words):
            continue
        if e.section != section:
            section = e.section
            options.append(Option(Text(section, style="bold italic"), id=f"header:{section}", disabled=True))
        label = COMPARED + e.label if e.option_id in marked else e.label
        options.append(Option(Label(label), id=e.option_id))
    if not options:
        options.append(Option(Text("no match: enter runs what you typed", style="italic"), disabled=True))
    return options


def first_enabled(option_list: OptionList) -> int | None:
    for index in range(option_list.option_count):
        if not option_list.get_option_at_index(index).disabled:
            return index
    return None
