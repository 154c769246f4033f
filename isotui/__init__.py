"""isotui: a terminal lab for the geometry (anisotropy) of neural representations.

The Python API (:mod:`isotui.api`) is reachable from here without importing torch: ``run``,
``experiment``, ``load``, ``Result``, ``Results`` and ``IsotuiError`` load on first use, as do
``register_metric``, ``unregister_metric`` and ``StreamingMetric`` (your own layer metrics:
:mod:`isotui.plugins`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from isotui.version import __version__

__all__ = [
    "IsotuiError",
    "Result",
    "Results",
    "StreamingMetric",
    "__version__",
    "experiment",
    "load",
    "register_metric",
    "run",
    "unregister_metric",
]

if TYPE_CHECKING:
    from isotui.api import Result, Results, experiment, load, run
    from isotui.core.plugin import StreamingMetric
    from isotui.errors import IsotuiError
    from isotui.plugins import register_metric, unregister_metric


def __getattr__(name: str) -> Any:
    """Lazy attributes: the API module loads on first use (``import isotui`` stays light)."""
    if name == "IsotuiError":
        from isotui.errors import IsotuiError

        return IsotuiError
    if name == "StreamingMetric":
        from isotui.core.plugin import StreamingMetric

        return StreamingMetric
    if name in ("register_metric", "unregister_metric"):
        from isotui import plugins

        return getattr(plugins, name)
    if name in ("run", "experiment", "load", "Result", "Results"):
        from isotui import api

        return getattr(api, name)
    raise AttributeError(f"module 'isotui' has no attribute {name!r}")
