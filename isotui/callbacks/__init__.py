"""Measure during training: a callback that probes a fixed probe set every N steps.

A front end beside the command line, the app and the Python API: it stands on the API's
model-object path (``isotui.run(model, tokenizer=...)``, :mod:`isotui.models.given`: the same
extraction and numbers as a run of the step's saved checkpoint) and never imports the command
line or the app.

- :class:`~isotui.callbacks.probe.Probe`: when a step is due, what is measured, the scalars it
  logs (``isotui/avg_cos/layer_3``), the series it writes (:mod:`isotui.experiments.recorded`),
  the model's train/eval flags and the random number generators kept as they were;
- :class:`IsotuiCallback` (``isotui.callbacks.IsotuiCallback``, :mod:`isotui.callbacks.trainer`):
  the transformers ``Trainer``'s ``TrainerCallback`` (transformers is imported on first use);
- :class:`IsotuiLightningCallback` (:mod:`isotui.callbacks.lightning`): Lightning's ``Callback``
  (lightning is imported on first use; ``pip install isotui[lightning]``).
"""

from __future__ import annotations

from typing import Any

from isotui.callbacks.probe import (
    DEFAULT_AT_END,
    DEFAULT_EVERY,
    DEFAULT_METRICS,
    DEFAULT_SAMPLES,
    Probe,
    kept_rng,
)

__all__ = [
    "DEFAULT_AT_END",
    "DEFAULT_EVERY",
    "DEFAULT_METRICS",
    "DEFAULT_SAMPLES",
    "IsotuiCallback",
    "IsotuiLightningCallback",
    "Probe",
    "kept_rng",
]


def __getattr__(name: str) -> Any:
    if name == "IsotuiCallback":  # imports transformers: only when asked for
        from isotui.callbacks.trainer import IsotuiCallback

        return IsotuiCallback
    if name == "IsotuiLightningCallback":  # imports lightning: only when asked for
        from isotui.callbacks.lightning import IsotuiLightningCallback

        return IsotuiLightningCallback
    raise AttributeError(f"module 'isotui.callbacks' has no attribute {name!r}")
