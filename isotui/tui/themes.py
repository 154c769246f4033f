"""Theme files (TOML) turned into Textual themes: the bundled ``themes/`` and the user's own.

A broken file is reported (file, field, what is wrong) and skipped; it never stops the app.
"""

from __future__ import annotations

from collections.abc import Mapping
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
TRUECOLOR_THEME = "isotui-dark"  # the default where 24-bit colour is announced
THEME_256 = "isotui-256"  # exact xterm-256 colours: the default where it is not (plain SSH)
TRUECOLOR_VALUES = ("truecolor", "24bit")


def announces_truecolor(environ: Mapping[str, str]) -> bool:
    """Whether the terminal says it shows 24-bit colour: ``COLORTERM`` (which SSH does not
    forward unless ``SendEnv``/``SetEnv`` ask), or Textual's own ``TEXTUAL_COLOR_SYSTEM`` (which
    ``textual-serve`` sets for the browser)."""
    return (
        environ.get("COLORTERM", "").strip().lower() in TRUECOLOR_VALUES
        or environ.get("TEXTUAL_COLOR_SYSTEM", "").strip().lower() == "truecolor"
    )


def starting_theme(setting: str | None, environ: Mapping[str, str], *, web: bool = False) -> str:
    """The theme the app starts with: the settings file's, else ``isotui-dark`` where truecolor
    is announced (or in a browser), else ``isotui-256``, whose colours a 256-colour terminal
    shows exactly instead of Textual's nearest-colour approximations of the dark theme."""
    if setting:
        return setting
    return TRUECOLOR_THEME if web or announces_truecolor(environ) else THEME_256


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
