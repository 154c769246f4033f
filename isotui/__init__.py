"""isotui: a terminal lab for the geometry (anisotropy) of neural representations.

The Python API (:mod:`isotui.api`) is reachable from here without importing torch: ``run``,
``experiment``, ``load``, ``Result``, ``Results`` and ``IsotuiError`` load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["IsotuiError", "Result", "Results", "__version__", "experiment", "load", "run"]

if TYPE_CHECKING:
    from isotui.api import Result, Results, experiment, load, run
    from isotui.errors import IsotuiError


def __getattr__(name: str) -> Any:
    """Lazy attributes: the API module loads on first use (``import isotui`` stays light)."""
    if name == "IsotuiError":
        from isotui.errors import IsotuiError

        return IsotuiError
    if name in ("run", "experiment", "load", "Result", "Results"):
        from isotui import api

        return getattr(api, name)
    raise AttributeError(f"module 'isotui' has no attribute {name!r}")
