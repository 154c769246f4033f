"""A checkpoint series, shared by every series experiment (qk-dynamics, checkpoints), the app's
series boxes, ``isotui sweep`` and the papers' figures: the series the user's ``--checkpoints``
names (:func:`resolve_checkpoints`; branch selectors and duplicate weights in
:mod:`isotui.experiments.revisions`), its name, and the loop over it: each checkpoint measured
(or read from the cache) on its own, with its own progress callback, a failure said and left out
or ending the series; the requests of a series experiment (:class:`SeriesRequest`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from isotui.errors import IsotuiError
from isotui.experiments.base import Attempt, Context, PartProgress, R, Request
from isotui.experiments.checkpoint import Checkpoint as Checkpoint  # importable from here too
from isotui.experiments.checkpoint import series_folder as series_folder
from isotui.experiments.checkpoint import step_of as step_of
from isotui.extract.progress import Progress, ProgressCallback, no_progress
from isotui.spec import RunSpec

T = TypeVar("T")  # one checkpoint's result
SeriesSpec = tuple[str | None, Sequence[Checkpoint], RunSpec]  # (series, checkpoints, base spec)


def resolve_checkpoints(
    model: str | None,
    checkpoints: str | Sequence[str],
    *,
    skip_duplicates: bool = False,
    notice: Callable[[str], None] | None = None,
    flag: str = "--checkpoints",
) -> list[Checkpoint]:
    """Turn the user's ``--checkpoints`` into a series (the CLI, the app, the Python API and
    ``isotui sweep`` all call this), in the order given.

    Each item is a hub revision of ``model`` (``step1000`` -> ``MODEL@step1000``), a model id,
    a checkpoint folder, a folder of checkpoint folders (expanded, ordered by step), a series
    recorded during training (:mod:`isotui.experiments.recorded`: its steps), or a selector
    of ``model``'s branches (``all``, ``every:N``, ``stepA..stepB``: see
    :mod:`isotui.experiments.revisions`; with one, the series is ordered by step). Checkpoints
    serving another step's weights get ``duplicate_of`` (before anything is downloaded; said
    through ``notice``); ``skip_duplicates`` leaves them out. ``flag`` is what a bad input's
    sentence names (a config file's key, say).
    """
    from isotui.experiments import revisions
    from isotui.experiments.recorded import recorded_series

    given = [checkpoints] if isinstance(checkpoints, str) else list(checkpoints)
    items = [t for chunk in given for t in re.split(r"[,\s]+", chunk) if t]
    if not items:
        raise IsotuiError(f"{flag} is empty: give revisions, model ids or checkpoint folders")
    out: list[Checkpoint] = []
    branches: list[Checkpoint] | None = None
    selected = False
    for item in items:
        selector = revisions.parse_selector(item, flag)
        if selector is not None:
            branches = branches or revisions.available(model, selector, flag, notice)
            out += revisions.pick(branches, selector, str(model), flag)
            selected = True
            continue
        path = Path(item).expanduser()
        if not path.exists() and _meant_as_folder(item, path):
            raise IsotuiError(
                f"{flag}: checkpoint folder {item} does not exist (in {path.parent.resolve()}); give "
                "checkpoint folders, a folder of them (isotui train-tiny output) or hub revisions"
            )
        recorded = recorded_series(path) if path.is_dir() else None
        if recorded is not None:
            if not recorded:
                raise IsotuiError(f"the series recorded in {item} has no step yet")
            out += recorded
            continue
        if path.is_dir() and not (path / "config.json").is_file():
            found = series_folder(path)
            if not found:
                raise IsotuiError(
                    f"checkpoint folder {item!r} holds no model folder (config.json); give checkpoint "
                    "folders or an isotui train-tiny output folder"
                )
            out += [Checkpoint(str(p), p.name, step_of(p.name)) for p in found]
        elif path.is_dir() or "/" in item or item.startswith(("random:", "timm:")) or model is None:
            label = path.name if path.is_dir() else item
            out.append(Checkpoint(str(path) if path.is_dir() else item, label, step_of(label)))
        else:  # a revision of --model
            out.append(Checkpoint(f"{model}@{item}", item, step_of(item)))
    if selected:
        out = revisions.union(out)
    _enough(out, flag)
    out = revisions.flag_duplicates(out, model, branches, notice)
    skip = "--skip-duplicates" if flag.startswith("--") else "skip_duplicates"
    if any(c.duplicate_of for c in out) and notice is not None:
        notice(revisions.duplicates_said(out, skip_duplicates, skip))
    if skip_duplicates:
        out = [c for c in out if not c.duplicate_of]
        _enough(out, flag, f" once {skip} left out the checkpoints serving another step's weights")
    return out


def _meant_as_folder(item: str, path: Path) -> bool:
    """Whether a ``--checkpoints`` item can only be a folder: written as a path (``./``, ``~``,
    ``/``), or inside a folder that exists here (``runs/nope`` beside ``runs/``), not a hub id."""
    if item.startswith(("/", "./", "../", "~")):
        return True
    return "/" in item and str(path.parent) not in ("", ".") and path.parent.is_dir()


def _enough(checkpoints: list[Checkpoint], flag: str, after: str = "") -> None:
    only = checkpoints[0].model if len(checkpoints) == 1 else ""
    if not after and "/" in only and "@" not in only and not Path(only).expanduser().is_dir():
        raise IsotuiError(
            f"{flag} names 1 checkpoint, {only}, which is no folder here (a folder of checkpoints, e.g. "
            "isotui train-tiny's output, gives a series); the dynamics need at least 2"
        )
    if len(checkpoints) < 2:
        raise IsotuiError(
            f"{flag} names {len(checkpoints)} checkpoint{after}; the dynamics need at least 2 (a series)"
        )


def series_name(checkpoints: list[Checkpoint]) -> str:
    """What to call a series without ``--model``: the folder holding its checkpoint folders, or
    the common start of its model ids (``google/multiberts-seed_0``)."""
    import os

    parents = {str(Path(c.model).parent) for c in checkpoints if Path(c.model).is_dir()}
    if len(parents) == 1 and all(Path(c.model).is_dir() for c in checkpoints):
        return Path(parents.pop()).name
    prefix = os.path.commonprefix([c.model for c in checkpoints])  # noqa: RUF071 (ids, not paths)
    prefix = re.sub(r"[-_@/]*(step)?[-_]*$", "", prefix, flags=re.IGNORECASE)
    return prefix or checkpoints[0].label


def measure_checkpoints(
    checkpoints: list[Checkpoint],
    measure_one: Callable[[Checkpoint, ProgressCallback], T],
    *,
    progress: PartProgress | None = None,
    attempt: Attempt | None = None,
) -> tuple[list[Checkpoint], list[T]]:
    """(checkpoints kept, their results): ``measure_one(checkpoint, on_progress)`` for each.

    ``progress(i, checkpoint)``, if given, is a context manager yielding that checkpoint's
    progress callback (a bar headless, job events in the app). ``attempt(label, fn)`` (e.g.
    :meth:`isotui.results.ModelFailures.attempt`): a checkpoint that fails is said and left out;
    without it the first failure ends the series. A failure names its checkpoint.
    """
    kept: list[Checkpoint] = []
    results: list[T] = []
    for i, ckpt in enumerate(checkpoints):
        with progress(i, ckpt) if progress else nullcontext(no_progress) as on_progress:

            def one(ckpt: Checkpoint = ckpt, on_progress: ProgressCallback = on_progress) -> T:
                try:
                    return measure_one(ckpt, on_progress)
                except IsotuiError as exc:
                    raise IsotuiError(f"checkpoint {ckpt.label}: {exc}") from None

            result = attempt(ckpt.label, one) if attempt is not None else one()
        if result is not None:
            kept.append(ckpt)
            results.append(result)
    return kept, results


def unpack_series(spec: SeriesSpec) -> tuple[str | None, tuple[Checkpoint, ...], RunSpec]:
    """A series experiment's (series, checkpoints, spec) triple, its checkpoints as a tuple."""
    series, ckpts, base = spec
    return series, tuple(ckpts), base


def series_progress(on_progress: ProgressCallback, n: int) -> PartProgress:
    """Per checkpoint i of n, a context giving its progress callback: one bar for the whole series
    (checkpoint i's samples come after those before it)."""

    def for_checkpoint(i: int, _ckpt: Checkpoint) -> AbstractContextManager[ProgressCallback]:
        def post(p: Progress) -> None:
            if p.message:
                on_progress(p)
                return
            per = p.samples_total
            on_progress(replace(p, samples_done=i * per + p.samples_done, samples_total=n * per))

        return nullcontext(post)

    return for_checkpoint


@dataclass(frozen=True)
class SeriesRequest(Generic[R]):
    """A job over a checkpoint series: what the jobs pane shows and which lane it runs on. Its
    result is None when every checkpoint failed and the context's ``attempt`` said each."""

    series: str | None
    checkpoints: tuple[Checkpoint, ...]
    spec: RunSpec  # data and run options; its model is the first checkpoint

    @property
    def model(self) -> str:
        return self.series or series_name(list(self.checkpoints))

    @property
    def device(self) -> str:
        return self.spec.device

    def _parts(self) -> Sequence[Request[object]]:
        """The requests of its checkpoints, each cached on its own."""
        raise NotImplementedError

    def keys(self, cache_root: Path | None) -> list[str]:
        return [k for part in self._parts() for k in part.keys(cache_root)[:1]]

    def compute(self, context: Context) -> R | None:
        return self.measure(context)

    def measure(self, context: Context) -> R | None:
        raise NotImplementedError

    def _progress(self, context: Context) -> PartProgress:
        return context.part_progress or series_progress(context.on_progress, len(self.checkpoints))


class Failures(Protocol):
    """What the series functions take as ``failures``: an ``attempt`` (:class:`Attempts`,
    :class:`isotui.results.ModelFailures`)."""

    @property
    def attempt(self) -> Attempt: ...


@dataclass(frozen=True)
class Attempts:
    """A context's ``attempt`` where the series functions take ``failures`` (``.attempt``)."""

    attempt: Attempt
