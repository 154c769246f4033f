"""The service every front end stands on: an experiment's requests made from what a user asked
(models, a checkpoint series or a configuration; the run options; the experiment's parameters),
then run one by one through the cache, with progress, cancellation and a failed model said and
the next one tried; the outcome's CSV rows and JSON payload.

The command line (:mod:`isotui.cli`), the Python API (:mod:`isotui.api`) and the app's backend
call it; it never imports a front end, argparse, rich or textual. What a front end shows (tables,
bars, notes) it hangs on the callbacks of :class:`Session`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isotui.errors import Cancelled, IsotuiError
from isotui.extract.progress import ProgressCallback, StopCheck, never_stop, no_progress

if TYPE_CHECKING:
    from isotui.experiments.base import Experiment
    from isotui.experiments.plans import ExperimentPlan
    from isotui.extract.memory_plan import MemoryPlan
    from isotui.results import Outcome
    from isotui.spec import RunSpec

Notice = Callable[[str], None]
Bar = Callable[[str], AbstractContextManager[ProgressCallback]]  # a job's name -> its progress


def no_bar(_name: str) -> AbstractContextManager[ProgressCallback]:
    """No progress shown."""
    return nullcontext(no_progress)


def _ignore(*_a: object) -> None:
    return None


@dataclass(frozen=True)
class Series:
    """A checkpoint series as asked: ``checkpoints`` as given (revisions of ``model``, model
    ids, folders, ``all``, ``every:N``, ``stepA..stepB``; comma- or space-separated)."""

    model: str | None
    checkpoints: tuple[str, ...]
    skip_duplicates: bool = False


@dataclass(frozen=True)
class Session:
    """Where and how requests run, and who hears of them.

    ``cache_root``: the result cache (None: read nothing, store nothing); ``bar(name)``: a
    context manager giving each job's progress callback; ``notice``: a sentence worth saying
    that is not a failure; ``on_result``: each request's result as soon as it is there (the
    CLI prints its tables); ``on_error(name, sentence)``: a model (or checkpoint) that failed;
    ``should_stop``: cancellation, polled between batches.
    """

    cache_root: Path | None = None
    bar: Bar = no_bar
    notice: Notice = _ignore
    on_result: Callable[[Any], None] = _ignore
    on_error: Callable[[str, str], None] | None = None
    should_stop: StopCheck = never_stop


def spec_for(
    experiment: Experiment, model: str, options: Mapping[str, Any], base_dir: Path | None = None
) -> RunSpec:
    """A validated :class:`~isotui.spec.RunSpec` of ``model`` from the run options ``options``
    gives (None or absent: the default) that ``experiment`` takes; missing data said first."""
    from isotui.data.sources import check_source
    from isotui.spec import given_options, make_spec, options_in

    spec = make_spec(model, base_dir=base_dir, **given_options(options, options_in(experiment.run_options)))
    check_source(spec.data)
    return spec


def make_requests(
    experiment: Experiment,
    params: Any,
    *,
    models: Sequence[str] = (),
    series: Series | None = None,
    options: Mapping[str, Any] | None = None,
    base_dir: Path | None = None,
    notice: Notice = _ignore,
    given: Any = None,
) -> list[Any]:
    """The requests a user's ask stands for: one per model (default ``minilm``), the one series,
    or the one configuration of the parameters; each bad setting one sentence, before any work.
    ``given``: a model object (:class:`isotui.models.given.GivenModel`) measured where it sits,
    under the one name in ``models`` (its label)."""
    experiment.check(params)
    options = options or {}
    if experiment.inputs == "config":
        return [experiment.request(None, params)]
    if experiment.inputs == "series":
        from isotui.experiments.series import resolve_checkpoints

        if series is None or not series.checkpoints:
            raise IsotuiError(f"{experiment.name} needs checkpoints: the series to measure")
        checkpoints = resolve_checkpoints(
            series.model, list(series.checkpoints), skip_duplicates=series.skip_duplicates, notice=notice
        )
        base = spec_for(experiment, checkpoints[0].model, options, base_dir)
        return [experiment.request((series.model, checkpoints, base), params)]
    names = list(models) or ["minilm"]
    base = spec_for(experiment, names[0], options, base_dir)
    if given is not None:
        base = replace(base, given=given)
    return [experiment.request(base.with_model(name), params) for name in names]


def plans(
    experiment: Experiment, requests: Sequence[Any]
) -> list[tuple[str, str, MemoryPlan | ExperimentPlan]]:
    """``--dry-run``: each request's memory plan from the config alone, as (label, heading,
    plan); a series is planned from its first checkpoint (all share one architecture, and run
    one at a time)."""
    if experiment.plan is None:
        raise IsotuiError(f"{experiment.name} streams no model: it has no memory plan")
    entries = []
    for request in requests:
        label = request.model
        what = "memory plan" if experiment.command == "run" else f"memory plan of {experiment.name}"
        heading = f"{request.model}: {what} (dry run, no weights read)"
        plan = experiment.plan(request)
        if experiment.inputs == "series":
            n = len(request.checkpoints)
            label = request.series or request.model
            heading += f"; each of its {n} checkpoint{'s' * (n != 1)} in turn holds this"
            heading += _hub_disk(request.checkpoints, plan)
        entries.append((label, heading, plan))
    return entries


def _hub_disk(checkpoints: Sequence[Any], plan: MemoryPlan | ExperimentPlan) -> str:
    """A series' disk: each hub revision it downloads stays in the hub cache (huggingface_hub
    keeps every revision; ``hf cache rm`` frees them)."""
    from isotui.extract.memory_plan import size_text
    from isotui.models.naming import parse_model

    hub = sum(1 for c in checkpoints if not c.recorded and parse_model(c.model).kind == "hub")
    weights = sum(plan.weights.values())
    if not hub or not weights:
        return ""
    return (
        f"; the {hub} hub revision{'s' * (hub != 1)} stay in the hub cache once downloaded: "
        f"{size_text(weights * hub)} of disk ({size_text(weights)} each; `hf cache rm` frees them)"
    )


def run(experiment: Experiment, requests: Sequence[Any], session: Session) -> Outcome:
    """Run ``requests`` (from :func:`make_requests`) in order through the cache: the results of
    those that succeeded, one sentence per model (or checkpoint) that failed, and the rows and
    payload of the results. A configuration's failure is the call's own (raised); Ctrl-C or a
    cancellation raises with ``partial_outcome`` holding what finished."""
    from isotui.experiments.base import Context, flatten
    from isotui.results import ModelFailures, Outcome

    series = experiment.inputs == "series"
    total = sum(len(r.checkpoints) for r in requests) if series else len(requests)
    name = "run" if experiment.command == "run" else experiment.name
    outcome = Outcome(name, [], [], {}, total=total, what=experiment.what)
    failures = ModelFailures(outcome, session.on_error)

    def one(request: Any) -> Any:
        with session.bar(request.model) as on_progress:
            context = Context(
                session.cache_root,
                on_progress=on_progress,
                should_stop=session.should_stop,
                notice=session.notice,
            )
            return experiment.run(request, context)

    def each() -> None:
        for request in requests:
            if session.should_stop():
                raise Cancelled("cancelled")
            if series:  # each checkpoint its own bar; a failed one said, the series built from the rest
                n = len(request.checkpoints)

                def part_progress(i: int, ckpt: Any, n: int = n) -> AbstractContextManager[ProgressCallback]:
                    return session.bar(f"{i + 1}/{n} {ckpt.label}")

                context = Context(
                    session.cache_root,
                    should_stop=session.should_stop,
                    notice=session.notice,
                    attempt=failures.attempt,
                    part_progress=part_progress,
                )
                result = experiment.run(request, context)
            elif experiment.inputs == "config":  # one configuration: its failure is the call's
                result = one(request)
            else:
                result = failures.attempt(request.model, one, request)
            if result is None:
                continue
            outcome.results += flatten([result])
            session.on_result(result)

    try:
        each()
    except (KeyboardInterrupt, Cancelled) as stop:  # what finished goes with it (the exports)
        finish(experiment, outcome)
        stop.partial_outcome = outcome  # type: ignore[union-attr]
        raise
    finish(experiment, outcome)
    return outcome


def cached(request: Any, session: Session) -> Any:
    """One request's cached result, or None: the app's quick first step (its backend looks up
    every job at once, in submission order, and sends only the misses to a device lane)."""
    return request.lookup(session.cache_root, session.notice)


def compute(request: Any, session: Session) -> Any:
    """Compute one request (loading its model) and store its result: the app's second step, on
    the device lane the backend chose (its progress from ``session.bar``, named after the
    request; cancellation and notices from the session)."""
    from isotui.experiments.base import Context

    with session.bar(request.model) as on_progress:
        return request.compute(Context(session.cache_root, on_progress, session.should_stop, session.notice))


def finish(experiment: Experiment, outcome: Outcome) -> None:
    """The CSV rows and JSON payload of the results collected."""
    if outcome.results:
        outcome.rows = experiment.rows(outcome.results)
        outcome.payload = experiment.payload(outcome.results)


def run_settings(config: Path | None, given: Mapping[str, Any]) -> dict[str, Any]:
    """``isotui run``'s settings: the config file's (a file or a preset's name; None: none),
    overridden by those the user gave (``given``: name -> value, None meaning not given)."""
    from isotui.config import load_run_config

    named = [key for key, value in given.items() if value is not None]
    settings: dict[str, Any] = load_run_config(config, named) if config is not None else {}
    for key, value in given.items():
        if value is not None:
            settings[key] = value
            if key == "data":
                settings["data_base_dir"] = Path.cwd()
    return settings


def config_path(config: str | Path | None) -> Path | None:
    """``config`` as given, or the bundled preset of that name when no such file exists
    (neither: one sentence, with the nearest preset's name)."""
    if config is None:
        return None
    from isotui.presets import config_or_preset

    return config_or_preset(Path(config))


def layer_requests(
    settings: Mapping[str, Any], config: Path | None, params: Any, given: Any = None
) -> list[Any]:
    """The layer run's requests from :func:`run_settings` (``models``, run options, data base
    folder); a bad setting is said with the config file it came from. ``given``: a model object
    measured where it sits, under the one name in ``models`` (see :func:`make_requests`)."""
    from isotui.experiments.registry import LAYERS
    from isotui.spec import given_options, make_spec

    models = settings.get("models") or ["minilm"]
    where = f"config file {config}: " if config else ""
    try:
        base = make_spec(
            models[0],
            base_dir=settings.get("data_base_dir", settings.get("base_dir")),
            **given_options(settings),
        )
    except IsotuiError as exc:
        raise IsotuiError(f"{where}{exc}") from None
    from isotui.data.sources import check_source

    check_source(base.data)  # missing data: one sentence, before any model is looked up
    LAYERS.check(params)
    if getattr(params, "save_sample", None) is not None and (len(models) > 1 or base.shard is not None):
        why = (
            "one model per run (-m once)" if len(models) > 1 else "the whole run in one process (no --shard)"
        )
        raise IsotuiError(f"{where}--save-sample writes one run's sample: it needs {why}")
    if given is not None:
        base = replace(base, given=given)
    return [LAYERS.request(base.with_model(model), params) for model in models]
