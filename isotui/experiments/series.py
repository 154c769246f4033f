"""The loop over a checkpoint series, shared by every series experiment (qk-dynamics,
checkpoints): each checkpoint measured (or read from the cache) on its own, with its own progress
callback, a failure said and left out or ending the series."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from isotui.errors import IsotuiError
from isotui.experiments.base import Attempt, Context, Notice, PartProgress
from isotui.extract.progress import Progress, ProgressCallback, StopCheck, no_progress
from isotui.spec import RunSpec


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


def series_progress(on_progress: ProgressCallback, n: int) -> PartProgress:
    """Per checkpoint i of n, a context giving its progress callback: one bar for the whole series
    (checkpoint i's samples come after those before it)."""

    def for_checkpoint(i: int, _ckpt: Any) -> AbstractContextManager[ProgressCallback]:
        def post(p: Progress) -> None:
            if p.message:
                on_progress(p)
                return
            per = p.samples_total
            on_progress(replace(p, samples_done=i * per + p.samples_done, samples_total=n * per))

        return nullcontext(post)

    return for_checkpoint


@dataclass(frozen=True)
class SeriesRequest:
    """A job over a checkpoint series: what the jobs pane shows and which lane it runs on."""

    series: str | None
    checkpoints: tuple[Any, ...]  # of qk_dynamics.Checkpoint
    spec: RunSpec  # data and run options; its model is the first checkpoint

    @property
    def model(self) -> str:
        from isotui.experiments.qk_dynamics import series_name

        return self.series or series_name(list(self.checkpoints))

    @property
    def device(self) -> str:
        return self.spec.device

    def _parts(self) -> list[Any]:
        """The requests of its checkpoints, each cached on its own."""
        raise NotImplementedError

    def keys(self, cache_root: Path | None) -> list[str]:
        return [k for part in self._parts() for k in part.keys(cache_root)[:1]]

    def compute(
        self,
        cache_root: Path | None,
        *,
        on_progress: ProgressCallback,
        should_stop: StopCheck,
        notice: Notice,
    ) -> Any:
        return self.measure(Context(cache_root, on_progress, should_stop, notice))

    def measure(self, context: Context) -> Any:
        raise NotImplementedError

    def _progress(self, context: Context) -> PartProgress:
        return context.part_progress or series_progress(context.on_progress, len(self.checkpoints))


@dataclass(frozen=True)
class Attempts:
    """A context's ``attempt`` where the series functions take ``failures`` (``.attempt``)."""

    attempt: Any
