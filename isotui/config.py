"""Run settings from a TOML file (``isotui run CONFIG.toml``); command-line flags win over it."""

from __future__ import annotations

import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any

from isotui.errors import IsotuiError
from isotui.spec import RUN_OPTIONS

# Setting name -> the Python types a TOML value may have: the run options (isotui.spec), the
# models, the outputs and the file's own name and description.
RUN_SETTINGS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "description": (str,),
    "model": (str,),
    "models": (list,),
    **{o.name: o.toml for o in RUN_OPTIONS},
    "cache_dir": (str,),
    "csv": (str,),
    "json": (str,),
}
PATH_SETTINGS = ("cache_dir", "csv", "json")
OUTPUT_SETTINGS = ("csv", "json")  # files a run writes: kept inside the config file's folder


def read_toml(path: Path, what: str = "config file") -> dict[str, Any]:
    """Parse a TOML file; a missing or malformed file is one sentence naming it."""
    if path.is_dir():
        raise IsotuiError(f"{what} {path} is a folder; give a TOML file (or a preset name)")
    if not path.is_file():
        raise IsotuiError(f"{what} {path} does not exist")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise IsotuiError(f"{what} {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise IsotuiError(f"{what} {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise IsotuiError(f"{what} {path} cannot be read: {exc.strerror}") from None


def load_run_config(path: Path, given: Collection[str] = ()) -> dict[str, Any]:
    """Validated run settings from ``path``; relative paths are made relative to its folder.

    A config file is data, not a command: it cannot turn on a model's own code (only the
    ``--trust-remote-code`` flag can) and its outputs stay inside its own folder, unless the
    command line names them (``given``: the settings the command line sets, which win anyway).
    """
    data = read_toml(path)
    sweep = data.pop("sweep", None)  # `isotui sweep`'s own table (isotui.cli.sweep); a run ignores it
    if sweep is not None and not isinstance(sweep, dict):
        raise IsotuiError(f"config file {path}: 'sweep' must be a table ([sweep]), got {sweep!r}")
    for key, value in data.items():
        if key not in RUN_SETTINGS:
            known = ", ".join(sorted(RUN_SETTINGS))
            raise IsotuiError(f"config file {path}: unknown setting {key!r} (known: {known})")
        allowed = RUN_SETTINGS[key]
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
            want = " or ".join(t.__name__ for t in allowed)
            raise IsotuiError(f"config file {path}: setting {key!r} must be a {want} (got {value!r})")
    models = data.pop("models", None)
    if models is not None:
        if not models or not all(isinstance(m, str) for m in models):
            raise IsotuiError(f"config file {path}: setting 'models' must be a non-empty list of model names")
        if "model" in data:
            raise IsotuiError(f"config file {path}: give 'model' or 'models', not both")
        data["models"] = models
    elif "model" in data:
        data["models"] = [data.pop("model")]
    if data.get("trust_remote_code") and "trust_remote_code" not in given:
        raise IsotuiError(
            f"config file {path} sets trust_remote_code = true, but a config file cannot run a "
            "model's own code; pass --trust-remote-code on the command line if you trust it"
        )
    base = path.resolve().parent
    for key in PATH_SETTINGS:
        if key in data:
            data[key] = str((base / Path(data[key]).expanduser()).resolve())
            if key in OUTPUT_SETTINGS and key not in given and not Path(data[key]).is_relative_to(base):
                raise IsotuiError(
                    f"config file {path}: {key} = {data[key]!r} is outside the config file's folder "
                    f"{base}; name it with --{key} on the command line instead"
                )
    for i, m in enumerate(data.get("models", [])):
        prefix, rest = ("random:", m[7:]) if m.startswith("random:") else ("", m)
        if rest.startswith(("./", "../")):  # a folder next to the config file
            data["models"][i] = prefix + str((base / rest).resolve())
    tokenizer = data.get("tokenizer", "")
    if tokenizer.startswith(("./", "../")):  # a tokenizer folder next to the config file
        data["tokenizer"] = str((base / tokenizer).resolve())
    data["base_dir"] = base
    if sweep is not None:
        data["sweep"] = sweep
    return data
