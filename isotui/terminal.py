"""Text as typed, through rich: the consoles isotui prints with, and user-supplied strings kept
literal in them.

Rich reads console markup (``[bold]``) and emoji codes (``:llama:``) in every string it prints, so
``random:llama:num_hidden_layers=2`` would print as ``random🦙num_hidden_layers=2`` and a name with
``[bold]`` in it would lose it. isotui's consoles never replace emoji codes (:func:`console`); its
own markup wraps what users typed (model names, paths, data sources, messages) escaped
(:func:`literal`); and renderables that leave isotui (the Python API's tables, printed by a
notebook's own console) are :class:`~rich.text.Text` already rendered without emoji
(:func:`markup`), so no console can rewrite them.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text


def console(console_class: type[Console] = Console, **options: Any) -> Console:
    """A rich console as isotui prints: emoji codes stay text (``emoji=False``)."""
    return console_class(emoji=False, **options)


def literal(text: object) -> str:
    """``text`` for isotui's markup strings: square brackets escaped, so it prints as typed (the
    console's ``emoji=False`` keeps its colons)."""
    return escape(str(text))


def markup(text: str, style: str = "") -> Text:
    """isotui's markup (user text in it escaped with :func:`literal`) rendered now, without emoji
    codes: a table title or cell that prints the same on any console."""
    return Text.from_markup(text, style=style, emoji=False)


def plain(text: object, style: str = "") -> Text:
    """User text as one renderable, no markup and no emoji read in it."""
    return Text(str(text), style=style)
