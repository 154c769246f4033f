"""The app's settings file (TOML): theme, keys, default run options, cache folder.

``$ISOTUI_CONFIG`` names the file; by default it is ``config.toml`` in isotui's config directory.
A missing file means defaults; a bad value is reported by file and name and the rest still apply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isotui.config import RUN_SETTINGS, read_toml
from isotui.errors import IsotuiError
from isotui.paths import config_dir
from isotui.spec import RUN_OPTIONS

# [run] may set the run options declared for it (remote code stays explicit: not from a file).
RUN_KEYS = tuple(o.name for o in RUN_OPTIONS if o.in_settings)
TOP_KEYS = ("theme", "cache_dir", "export_dir", "run", "keys")


@dataclass
class Settings:
    """What the settings file asked for, plus one sentence per problem found in it."""

    path: Path
    theme: str | None = None
    cache_dir: str | None = None
    export_dir: Path | None = None  # the app's CSV and screenshot folder (default: the current one)
    run: dict[str, Any] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def settings_path() -> Path:
    env = os.environ.get("ISOTUI_CONFIG")
    return Path(env).expanduser() if env else config_dir() / "config.toml"


def load_settings(path: Path | None = None, binding_ids: tuple[str, ...] = ()) -> Settings:
    """Read and check the settings file; each bad entry is skipped and reported."""
    path = path or settings_path()
    settings = Settings(path)
    if not path.exists():
        if os.environ.get("ISOTUI_CONFIG"):
            settings.problems.append(f"settings file {path} (from ISOTUI_CONFIG) does not exist")
        return settings
    try:
        data = read_toml(path, "settings file")
    except IsotuiError as exc:
        settings.problems.append(str(exc))
        return settings
    where = f"settings file {path}"
    for key, value in data.items():
        if key not in TOP_KEYS:
            settings.problems.append(f"{where}: unknown setting {key!r} (known: {', '.join(TOP_KEYS)})")
        elif key == "export_dir":
            if isinstance(value, str) and value.strip():  # relative: to the settings file's folder
                settings.export_dir = path.parent / Path(value).expanduser()
            else:
                settings.problems.append(f"{where}: export_dir must be a folder name (got {value!r})")
        elif key in ("theme", "cache_dir"):
            if isinstance(value, str) and value.strip():
                setattr(settings, key, value)
            else:
                settings.problems.append(f"{where}: {key} must be a non-empty string (got {value!r})")
        elif not isinstance(value, dict):
            settings.problems.append(f"{where}: [{key}] must be a table")
        elif key == "run":
            _check_run(value, settings, where)
        else:
            _check_keys(value, settings, where, binding_ids)
    return settings


def _check_run(table: dict[str, Any], settings: Settings, where: str) -> None:
    from isotui.spec import make_spec

    for key, value in table.items():
        if key not in RUN_KEYS:
            settings.problems.append(f"{where}: [run] has no setting {key!r} (known: {', '.join(RUN_KEYS)})")
            continue
        allowed = RUN_SETTINGS[key]
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
            settings.problems.append(f"{where}: [run] {key} has the wrong type (got {value!r})")
            continue
        try:
            make_spec("minilm", base_dir=settings.path.parent, **{**settings.run, key: value})
        except IsotuiError as exc:
            settings.problems.append(f"{where}: [run] {exc}")
            continue
        settings.run[key] = value


def _check_keys(table: dict[str, Any], settings: Settings, where: str, binding_ids: tuple[str, ...]) -> None:
    for action, keys in table.items():
        if binding_ids and action not in binding_ids:
            settings.problems.append(
                f"{where}: [keys] has no action {action!r} (known: {', '.join(binding_ids)})"
            )
        elif not isinstance(keys, str) or not keys.strip():
            settings.problems.append(f'{where}: [keys] {action} must be a key name such as "c" or "ctrl+r"')
        else:
            settings.keys[action] = keys.replace(" ", "")
