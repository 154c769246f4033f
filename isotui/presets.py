"""Presets: the TOML files in ``sample_configs/`` (one per paper figure or common task)."""

from __future__ import annotations

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


def find_preset(name: str) -> Path | None:
    """The bundled preset called ``name`` (file stem, with or without .toml), if there is one."""
    stem = name.removesuffix(".toml")
    path = resource_dir("sample_configs") / f"{stem}.toml"
    return path if "/" not in name and path.is_file() else None
