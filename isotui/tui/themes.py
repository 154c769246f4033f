"""Theme files (TOML) turned into Textual themes: the bundled ``themes/`` and the user's own.

A broken file is reported (file, field, what is wrong) and skipped; it never stops the app.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from isotui.config import read_toml
from isotui.errors import IsotuiError

if TYPE_CHECKING:
    from textual.theme import Theme

COLOURS = (
    "primary",
    "secondary",
    "accent",
    "foreground",
    "background",
    "surface",
    "panel",
    "success",
    "warning",
    "error",
)
REQUIRED = ("name", "primary")


def load_theme(path: Path) -> Theme:
    """One theme file; :class:`IsotuiError` naming the file and field if it is not valid."""
    from textual.color import Color, ColorParseError
    from textual.theme import Theme

    data = read_toml(path, "theme file")
    for key in REQUIRED:
        if key not in data:
            raise IsotuiError(f"theme file {path}: missing setting {key!r}")
    unknown = sorted(set(data) - {"name", "dark", *COLOURS})
    if unknown:
        raise IsotuiError(
            f"theme file {path}: unknown setting {unknown[0]!r} (known: name, dark, {', '.join(COLOURS)})"
        )
    if not isinstance(data["name"], str) or not data["name"].strip():
        raise IsotuiError(f"theme file {path}: 'name' must be a non-empty string")
    if not isinstance(data.get("dark", True), bool):
        raise IsotuiError(f"theme file {path}: 'dark' must be true or false")
    colours = {}
    for key in COLOURS:
        if key in data:
            try:
                Color.parse(data[key])
            except (ColorParseError, TypeError):
                raise IsotuiError(
                    f'theme file {path}: {key} = {data[key]!r} is not a colour (use e.g. "#4C9BE8")'
                ) from None
            colours[key] = data[key]
    return Theme(name=data["name"], dark=data.get("dark", True), **colours)


def load_themes(folders: list[Path]) -> tuple[list[Theme], list[str]]:
    """Every theme in ``folders`` (later folders override earlier names), and the problems found."""
    themes: dict[str, Theme] = {}
    problems: list[str] = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.toml")):
            try:
                theme = load_theme(path)
            except IsotuiError as exc:
                problems.append(str(exc))
                continue
            themes[theme.name] = theme
    return list(themes.values()), problems
