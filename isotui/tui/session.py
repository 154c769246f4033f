"""The app's last session (``session.toml`` beside the settings file): the comparison set (as
result-cache keys, reopened without computing), the selected model, the plotted metric, the
data and run options, and what was typed into the attention lab's settings boxes.

Written atomically (a temporary file renamed over the old one) when these change and on exit;
``isotui --fresh`` starts without it. A damaged file is reported once and ignored: the app starts
clean and overwrites it on the next change.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isotui.config import read_toml
from isotui.errors import IsotuiError

SESSION_FILE = "session.toml"
VERSION = 1


@dataclass
class Session:
    """What the app restores. ``comparison``: (model, result key) in the set's order."""

    comparison: list[tuple[str, str]] = field(default_factory=list)
    selected: str | None = None
    metric: str | None = None
    depth: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    lab: dict[str, str] = field(default_factory=dict)


def session_path(settings_file: Path) -> Path:
    return settings_file.parent / SESSION_FILE


def _string(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise IsotuiError(f"{what} must be a string (got {value!r})")
    return value


def load_session(path: Path) -> Session:
    """The session in ``path`` (an empty one if there is none); a damaged file is one
    :class:`IsotuiError` sentence naming it."""
    if not path.exists():
        return Session()
    data = read_toml(path, "session file")
    try:
        if data.get("version") != VERSION:
            raise IsotuiError(f"version must be {VERSION} (got {data.get('version')!r})")
        comparison = []
        for item in data.get("comparison", []):
            if not isinstance(item, dict):
                raise IsotuiError("each [[comparison]] needs a model and a key")
            comparison.append((_string(item.get("model"), "model"), _string(item.get("key"), "key")))
        options = data.get("options", {})
        lab = data.get("lab", {})
        if not isinstance(options, dict) or not isinstance(lab, dict):
            raise IsotuiError("[options] and [lab] must be tables")
        return Session(
            comparison=comparison,
            selected=_string(data["selected"], "selected") if "selected" in data else None,
            metric=_string(data["metric"], "metric") if "metric" in data else None,
            depth=bool(data.get("depth", False)),
            # an empty string stands for "none" (all samples, auto): TOML has no null
            options={k: (None if v == "" else v) for k, v in options.items()},
            # each lab tab's settings box by its id (the lab fills in those of its tabs)
            lab={k: _string(v, f"lab {k}") for k, v in lab.items()},
        )
    except IsotuiError as exc:
        raise IsotuiError(f"session file {path} is damaged: {exc}") from None


def _value(value: object) -> str:
    """A TOML value (JSON's string escapes are valid TOML basic strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps("" if value is None else str(value))


def dump_session(session: Session) -> str:
    lines = [
        "# isotui's last session: rewritten by the app; `isotui --fresh` starts without it",
        f"version = {VERSION}",
    ]
    if session.selected is not None:
        lines.append(f"selected = {_value(session.selected)}")
    if session.metric is not None:
        lines.append(f"metric = {_value(session.metric)}")
    lines.append(f"depth = {_value(session.depth)}")
    lines.append("")
    lines.append("[options]")
    lines += [f"{k} = {_value(v)}" for k, v in session.options.items()]
    lines.append("")
    lines.append("[lab]")
    lines += [f"{_value(k)} = {_value(v)}" for k, v in session.lab.items()]
    for model, key in session.comparison:
        lines += ["", "[[comparison]]", f"model = {_value(model)}", f"key = {_value(key)}"]
    return "\n".join(lines) + "\n"


def save_session(path: Path, session: Session) -> None:
    """Write atomically: a reader (or a crash) never sees half a file. OSError is the caller's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".session-", suffix=".toml", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dump_session(session))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
