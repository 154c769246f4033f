"""The loop over a checkpoint series, shared by every series experiment (qk-dynamics,
checkpoints): each checkpoint measured (or read from the cache) on its own, with its own progress
callback, a failure said and left out or ending the series."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from isotui.errors import IsotuiError
from isotui.experiments.base import Attempt, PartProgress
from isotui.extract.progress import ProgressCallback, no_progress


def measure_checkpoints(
    checkpoints: list[Any],
    measure_one: Callable[[Any, ProgressCallback], Any],
    *,
    progress: PartProgress | None = None,
    attempt: Attempt | None = None,
) -> tuple[list[Any], list[Any]]:
    """(checkpoints kept, their results): ``measure_one(checkpoint, on_progress)`` for each.

    ``progress(i, checkpoint)``, if given, is a context manager yielding that checkpoint's
    progress callback (a bar headless, job events in the app). ``attempt(label, fn)`` (e.g.
    :meth:`isotui.results.ModelFailures.attempt`): a checkpoint that fails is said and left out;
    without it the first failure ends the series. A failure names its checkpoint.
    """
    kept: list[Any] = []
    results: list[Any] = []
    for i, ckpt in enumerate(checkpoints):
        with progress(i, ckpt) if progress else nullcontext(no_progress) as on_progress:

            def one(ckpt: Any = ckpt, on_progress: ProgressCallback = on_progress) -> Any:
                try:
                    return measure_one(ckpt, on_progress)
                except IsotuiError as exc:
                    raise IsotuiError(f"checkpoint {ckpt.label}: {exc}") from None

            result = attempt(ckpt.label, one) if attempt is not None else one()
        if result is not None:
            kept.append(ckpt)
            results.append(result)
    return kept, results


def unpack_series(spec: Any) -> tuple[str | None, tuple[Any, ...], Any]:
    """A series experiment's (series, checkpoints, spec) triple, its checkpoints as a tuple."""
    series, ckpts, base = spec
    return series, tuple(ckpts), base
