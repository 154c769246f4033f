"""Presets: the TOML files in ``sample_configs/`` (one per paper figure or common task)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from isotui.config import load_run_config
from isotui.errors import IsotuiError
from isotui.paths import resource_dir


@dataclass(frozen=True)
class Preset:
    name: str
    path: Path
    description: str
    models: tuple[str, ...]
    data: str


def presets() -> list[Preset]:
    """Every preset that parses; a broken one is listed with its problem as description."""
    out = []
    for path in sorted(resource_dir("sample_configs").glob("*.toml")):
        try:
            cfg = load_run_config(path)
        except IsotuiError as exc:
            out.append(Preset(path.stem, path, f"(broken: {exc})", (), ""))
            continue
        out.append(
            Preset(
                cfg.get("name", path.stem),
                path,
                cfg.get("description", ""),
                tuple(cfg.get("models", ["minilm"])),
                cfg.get("data", "builtin"),
            )
        )
    return out


def config_or_preset(config: Path) -> Path:
    """``isotui run CONFIG``: the file ``config``, else the bundled preset of that name; when
    neither exists, one sentence with the preset nearest in spelling, if any, and where presets
    are listed."""
    from isotui.suggest import did_you_mean

    text = str(config)
    if config.is_dir() and (config / "config.json").is_file():  # a model's folder, not a config
        raise IsotuiError(f"{text} is a model's folder, not a config file: isotui run -m {text}")
    if config.exists():
        return config
    found = find_preset(text)
    if found is not None:
        return found
    model = model_meant(text)
    if model:
        raise IsotuiError(f"no config file or preset named {text!r}; {model}: isotui run -m {text}")
    if "/" in text or text.endswith(".toml"):  # meant as a file
        raise IsotuiError(f"config file {config} does not exist")
    names = [p.stem for p in sorted(resource_dir("sample_configs").glob("*.toml"))]
    guess = did_you_mean(text, names)
    raise IsotuiError(
        f"no config file or preset named {text!r}; "
        + (f"{guess} (`isotui models` lists the presets)" if guess else "`isotui models` lists the presets")
    )


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?")


def model_meant(text: str) -> str | None:
    """What ``text``, given where a config is expected, names as a model isotui knows (a bundled
    name, ``random:``/``timm:``, a Hugging Face-looking ``org/name``), in words; None otherwise."""
    from isotui.paths import BUNDLED

    if text.lower() in BUNDLED:
        return f"{text!r} is a bundled model"
    if text.startswith(("random:", "timm:")):
        return f"{text!r} names a model"
    if not text.endswith(".toml") and HUB_ID.fullmatch(text):
        return f"{text!r} looks like a Hugging Face model id"
    return None


def find_preset(name: str) -> Path | None:
    """The bundled preset called ``name`` (file stem, with or without .toml), if there is one."""
    stem = name.removesuffix(".toml")
    path = resource_dir("sample_configs") / f"{stem}.toml"
    return path if "/" not in name and path.is_file() else None
