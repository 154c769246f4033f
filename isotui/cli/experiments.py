"""``isotui experiment NAME`` (and ``isotui run``'s loop) from the experiment registry, and
``isotui train-tiny``.

The parser gets one subcommand per registered experiment (:mod:`isotui.experiments.registry`):
the flags of its inputs kind (models or a checkpoint series), its own options, the run flags and
the output flags. One loop (:func:`collect`) runs every experiment: per model (or per series, or
the one configuration) the request, read from the cache or computed, with a progress bar; a
failed model said and the next one tried; the view's tables printed as they come; then --csv and
--json from the experiment's rows and payload.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from isotui.experiments.base import Experiment
    from isotui.results import Outcome
    from isotui.spec import RunSpec

TOP_LEVEL = {
    "train-tiny": "isotui.cli.train_tiny",
    "figure": "isotui.cli.figure",
    "sweep": "isotui.cli.sweep",
}


@dataclass(frozen=True)
class Outputs:
    """Where a command writes its results (``--csv``, ``--json``) and which cache it reads and
    fills (``--cache-dir``, ``--no-cache``): made once, from the flags (``isotui run``: the
    config file's settings under them), and handed to :func:`collect` and :func:`report`, so
    that nothing is written back onto the parsed flags."""

    csv: str | None = None
    json: str | None = None
    cache_dir: str | None = None
    no_cache: bool = False

    @classmethod
    def of_flags(cls, args: argparse.Namespace) -> Outputs:
        """The outputs the flags alone name (``isotui experiment NAME``, ``isotui figure``)."""
        return cls(
            getattr(args, "csv", None),
            getattr(args, "json", None),
            getattr(args, "cache_dir", None),
            bool(getattr(args, "no_cache", False)),
        )


def add_common(p: argparse.ArgumentParser, *, cache: bool = True, device_seed: bool = True) -> None:
    """Flags every experiment shares (``device_seed=False`` where :func:`add_run_flags` gave them)."""
    if device_seed:
        p.add_argument("--device", default="auto", help="auto (cuda, mps, cpu), cpu, cuda, cuda:N, mps")
        p.add_argument("--seed", default="0", help="seed (default 0)")
    if cache:
        p.add_argument("--cache-dir", help="result cache (default ~/.cache/isotui, or $ISOTUI_CACHE_DIR)")
        p.add_argument("--no-cache", action="store_true", help="recompute, and store nothing")
    p.add_argument("--csv", help="write the table here")
    p.add_argument("--json", help="write everything (tables, arrays as lists, metadata) here")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")


def add_series_flags(p: argparse.ArgumentParser) -> None:
    """``--model`` and ``--checkpoints``: a checkpoint series (see qk_dynamics.resolve_checkpoints)."""
    p.add_argument("--model", "-m", help="the model whose hub revisions --checkpoints names (optional)")
    p.add_argument(
        "--checkpoints",
        "-c",
        action="append",
        required=True,
        metavar="LIST",
        help="revisions of --model (step1000,step2000), model ids, checkpoint folders, or a folder of "
        "them (isotui train-tiny output); or --model's branches: all, every:N (steps that are multiples "
        "of N), stepA..stepB; comma- or space-separated, repeatable",
    )
    add_duplicates_flag(p)


def add_duplicates_flag(p: argparse.ArgumentParser) -> None:
    """``--skip-duplicates``, wherever a checkpoint series is taken."""
    p.add_argument(
        "--skip-duplicates",
        action="store_true",
        help="leave out checkpoints whose weight files are another step's (checked before downloading)",
    )


def add_dry_run_flag(p: argparse.ArgumentParser) -> None:
    """``--dry-run``, for every experiment that streams a model (its registry entry has a plan)."""
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the memory plan from the model's config alone (no weights read): weights and "
        "accumulators per device and per layer, what is exact and what sampled, the batches",
    )


def print_plans(entries: list[tuple[str, str, Any]], json_target: str | None) -> int:
    """Print dry-run plans, each (label, heading, plan): the heading, the plan's notes and its
    table; or, with ``--json``, all of them as one JSON object keyed by label (``-``: stdout)."""
    import json
    from pathlib import Path

    from isotui.cli.common import stdout_console

    out = stdout_console()
    if json_target:
        plans = {label: plan.to_json() | {"notes": plan.notes()} for label, _h, plan in entries}
        text = json.dumps(plans, indent=2)
        if str(json_target) == "-":
            out.print(text, highlight=False, soft_wrap=True)
        else:
            Path(json_target).write_text(text + "\n", encoding="utf-8")
        return 0
    for _label, heading, plan in entries:
        out.print(heading, highlight=False)
        for line in [*plan.notes(), "", *plan.table(), ""]:
            out.print(line, highlight=False, soft_wrap=True)
    return 0


def refuse_files_in_dry_run(flags: dict[str, Any]) -> None:
    """``--dry-run`` writes only its plans (``--json``): a ``--csv`` given with it is refused,
    not silently ignored (``flags``: name -> value, e.g. ``{"csv": "o.csv"}``)."""
    from isotui.errors import IsotuiError

    for name, value in flags.items():
        if value:
            flag = "--" + name.replace("_", "-")
            raise IsotuiError(
                f"--dry-run prints the memory plan and writes no {flag} ({flag} {value}); drop one of "
                "them (--json PATH writes the plan as JSON)"
            )


def dry_run(experiment: Experiment, args: argparse.Namespace, err: Any) -> int:
    """``isotui experiment NAME --dry-run``: each request's plan (:attr:`Experiment.plan`) from
    the config alone (:func:`isotui.service.plans`)."""
    from isotui import service

    refuse_files_in_dry_run({"csv": getattr(args, "csv", None)})
    requests = make_requests(experiment, args, _notice(err))
    return print_plans(service.plans(experiment, requests), getattr(args, "json", None))


def add_param_flags(
    p: argparse._ActionsContainer,  # a parser or one of its groups: what add_argument is on
    params: type,
    skip: tuple[str, ...] = (),
) -> None:
    """The flags of an experiment's parameters (:mod:`isotui.experiments.params`): each
    parameter's ``--name`` (and short spelling), its help, choices and on/off form; None when
    not given, so the parameter's own default (and check) applies."""
    from isotui.experiments.params import params_of

    for param in params_of(params):
        if param.name in skip:
            continue
        names = [param.flag, *([param.short] if param.short else [])]
        kwargs: dict[str, Any] = {"help": param.help, "dest": param.name}
        if param.switch:
            kwargs.update(action="store_true", default=None)
        else:
            if param.choices:
                kwargs["choices"] = list(param.choices)
            if param.metavar:
                kwargs["metavar"] = param.metavar
            if param.nargs:
                kwargs.update(nargs=param.nargs, const=param.const)
        p.add_argument(*names, **kwargs)


def params_from_args(experiment: Experiment, args: argparse.Namespace) -> Any:
    """The experiment's parameters from the parsed flags (a flag not given: its default)."""
    from isotui.experiments.params import make_params, params_of

    return make_params(
        experiment.params, {p.name: getattr(args, p.name, None) for p in params_of(experiment.params)}
    )


def add_run_flags(p: argparse.ArgumentParser, command: str) -> None:
    """The run options experiment ``command`` takes (see :func:`isotui.cli.common.add_run_flags`)."""
    from isotui.cli.common import add_run_flags as run_flags

    run_flags(p, command)


def spec_from_args(args: argparse.Namespace, model: str) -> RunSpec:
    """A validated :class:`~isotui.spec.RunSpec` from the run flags of the experiment ``args``
    names (every option it takes; unset ones keep their defaults); missing data said first."""
    from isotui.data.sources import check_source
    from isotui.experiments.registry import options_for
    from isotui.spec import given_options, make_spec

    command = getattr(args, "experiment", None) or args.command
    spec = make_spec(model, **given_options(vars(args), options_for(command)))
    check_source(spec.data)
    check_outputs(args)
    return spec


def check_outputs(args: argparse.Namespace) -> None:
    """Say a bad --csv/--json before a long run, not after it."""
    from pathlib import Path

    from isotui.errors import IsotuiError

    for flag in ("csv", "json"):
        value = getattr(args, flag, None)
        if value and Path(value).expanduser().is_dir():
            raise IsotuiError(f"--{flag} {value} is a directory; give a file name")


def report(outcome: Outcome, outputs: Outputs, err: Any) -> int:
    """Write a command's --csv and --json (when it measured anything); its exit code."""
    from isotui.cli.common import exit_code

    write_outputs(outcome, outputs, err)
    return exit_code(outcome, err)


def write_outputs(outcome: Outcome, outputs: Outputs, err: Any) -> None:
    """A command's --csv and --json of the results it has (none: nothing written)."""
    from pathlib import Path

    from isotui.store.export import write_dicts_csv, write_payload_json

    if outcome.results and outputs.csv:
        err.print(f"wrote {write_dicts_csv(outcome.rows, Path(outputs.csv))}", markup=False)
    if outcome.results and outputs.json:
        err.print(f"wrote {write_payload_json(outcome.payload, Path(outputs.json))}", markup=False)
    asked = [f"--{flag} {path}" for flag, path in (("csv", outputs.csv), ("json", outputs.json)) if path]
    if not outcome.results and asked:  # a shard that is not the last, or every model failed
        err.print(f"nothing written to {' and '.join(asked)}: no result to write", markup=False)


def command_main(
    experiment: Experiment,
    args: argparse.Namespace,
    err: Any,
    outputs: Outputs,
    *,
    requests: list[Any] | None = None,
    before_report: Callable[[Outcome, argparse.Namespace, Any], None] | None = None,
) -> int:
    """A command's work and output: :func:`collect` (of ``requests``, default those the flags
    make) with the view's tables printed as they come, a failed model's sentence printed and
    the next one tried, then ``before_report`` (a command's extra outputs, e.g. run's
    --wide-csv) and :func:`report` to ``outputs``; its exit code."""
    from rich.text import Text

    from isotui.cli.common import print_error, stdout_console
    from isotui.errors import Cancelled
    from isotui.views import view_for

    out = stdout_console()
    view = view_for(experiment)

    def on_table(table: Any) -> None:
        out.print(table, highlight=None if view.highlight else False)
        if view.blank_line and not isinstance(table, Text):  # a figure ends the output
            out.print()

    try:
        outcome = collect(
            experiment,
            args,
            err,
            outputs=outputs,
            width=out.width,
            on_table=on_table,
            on_error=lambda _model, text: print_error(err, text),
            requests=requests,
        )
    except (KeyboardInterrupt, Cancelled) as stop:  # ^C: the models that finished are written
        partial = getattr(stop, "partial_outcome", None)
        if partial is not None and partial.results:
            err.print(f"isotui: interrupted; writing the {len(partial.results)} result(s) that finished")
            write_outputs(partial, outputs, err)
        raise
    if before_report is not None:
        before_report(outcome, args, err)
    return report(outcome, outputs, err)


def progress_printer(err: Any, name: str, *, quiet: bool, verbose: bool = False) -> Any:
    """The headless progress bar (see :func:`isotui.cli.common.progress_printer`)."""
    from isotui.cli.common import progress_printer as printer

    return printer(err, name, quiet=quiet, verbose=verbose)


def _progress(err: Any, name: str, args: argparse.Namespace) -> Any:
    return progress_printer(err, name, quiet=bool(args.quiet), verbose=bool(getattr(args, "verbose", False)))


def _notice(err: Any) -> Callable[[str], None]:
    """A notice (not a failure) on stderr, in yellow."""
    from isotui.terminal import literal

    def notice(text: str) -> None:
        err.print(f"[yellow]isotui: {literal(text)}[/]", highlight=False)

    return notice


def make_requests(
    experiment: Experiment, args: argparse.Namespace, notice: Callable[[str], None] | None = None
) -> list[Any]:
    """The requests the flags of ``isotui experiment NAME`` stand for (:func:`isotui.service.
    make_requests`): one per ``--model``, the one series of ``--model``/``--checkpoints``, or
    the one configuration of its own flags; --csv/--json said before any work."""
    from isotui import service

    check_outputs(args)
    params = params_from_args(experiment, args)
    series = None
    if experiment.inputs == "series":
        series = service.Series(
            args.model, tuple(args.checkpoints), bool(getattr(args, "skip_duplicates", False))
        )
    return service.make_requests(
        experiment,
        params,
        models=getattr(args, "models", None) or (),
        series=series,
        options=vars(args),
        notice=notice or (lambda _t: None),
    )


def collect(
    experiment: Experiment,
    args: argparse.Namespace,
    err: Any,
    *,
    outputs: Outputs | None = None,
    width: int = 200,
    on_table: Callable[[Any], None] | None = None,
    on_error: Callable[[str, str], None] | None = None,
    requests: list[Any] | None = None,
) -> Outcome:
    """An experiment's work (:func:`isotui.service.run`) with the view's tables: an
    :class:`~isotui.results.Outcome` with the tables of every request that succeeded
    (``on_table`` sees each as soon as it is made), one sentence per model (or checkpoint) that
    failed (``on_error``), and the experiment's CSV rows and JSON payload. ``requests``: made by
    the caller (``isotui run`` reads a config file too); default :func:`make_requests`.
    ``outputs``: the cache to use (default: the flags' ``--cache-dir``/``--no-cache``)."""
    from isotui import service
    from isotui.errors import Cancelled
    from isotui.paths import cache_dir
    from isotui.views import view_for

    view = view_for(experiment)
    notice = _notice(err)
    if requests is None:
        requests = make_requests(experiment, args, notice)
    args = shown(experiment, args)
    tables: list[Any] = []
    highlight = None if view.highlight else False
    # a view's own bar (drift-block), or the CLI's
    progress = view.progress or _progress

    def on_result(result: Any) -> None:
        note = view.note(result, args) if view.note else None
        if note:
            err.print(note, highlight=highlight, markup=False)
        for table in view.tables(result, args, width):
            tables.append(table)
            if on_table:
                on_table(table)

    outputs = outputs or Outputs.of_flags(args)
    session = service.Session(
        None if outputs.no_cache else cache_dir(outputs.cache_dir),
        bar=lambda name: progress(err, name, args),
        notice=notice,
        on_result=on_result,
        on_error=on_error,
    )
    try:
        outcome = service.run(experiment, requests, session)
    except (KeyboardInterrupt, Cancelled) as stop:  # ^C: what finished goes with it (the exports)
        partial = getattr(stop, "partial_outcome", None)
        if partial is not None:
            partial.tables = tables
            _closing(partial, view, args, width, None)
        raise
    outcome.tables = tables
    _closing(outcome, view, args, width, on_table)
    return outcome


def shown(experiment: Experiment, args: argparse.Namespace) -> argparse.Namespace:
    """What the view reads: the parsed flags (``--quiet``, ``--verbose``...) with the
    experiment's parameters as parsed (a flag not given: its parameter's default)."""
    from dataclasses import asdict

    return argparse.Namespace(**{**vars(args), **asdict(params_from_args(experiment, args))})


def _closing(
    outcome: Outcome, view: Any, args: argparse.Namespace, width: int, on_table: Callable[[Any], None] | None
) -> None:
    """The closing tables of the results collected (``run --wide``)."""
    if outcome.results and view.closing:
        for table in view.closing(outcome.results, args, width):
            outcome.tables.append(table)
            if on_table:
                on_table(table)


def add_experiment_parser(
    names: argparse._SubParsersAction[argparse.ArgumentParser], experiment: Experiment
) -> argparse.ArgumentParser:
    """The subcommand of one registered experiment: its inputs' flags, its own options, the run
    flags and the output flags (those its own options did not add already)."""
    p: argparse.ArgumentParser = names.add_parser(
        experiment.name, help=experiment.help, description=experiment.help
    )
    if experiment.inputs == "models":
        p.add_argument(
            "--model", "-m", action="append", dest="models", metavar="MODEL", help="model (repeat to compare)"
        )
    elif experiment.inputs == "series":
        add_series_flags(p)
    add_param_flags(p, experiment.params)
    if experiment.run_flags:
        add_run_flags(p, experiment.name)
    if experiment.plan is not None:
        add_dry_run_flag(p)
    add_common(p, device_seed=not experiment.run_flags and "--device" not in p._option_string_actions)
    return p


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``experiment NAME ...`` for every registered experiment, and the top-level commands."""
    from isotui.experiments.registry import EXPERIMENTS

    exp = sub.add_parser("experiment", help=f"experiments: {', '.join(EXPERIMENTS)}")
    names = exp.add_subparsers(dest="experiment", required=True, metavar="NAME")
    for experiment in EXPERIMENTS.values():
        add_experiment_parser(names, experiment)
    for name, path in TOP_LEVEL.items():
        module = importlib.import_module(path)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)


def run(args: argparse.Namespace, err: Any) -> int | None:
    """Run the experiment or top-level command ``args`` names; None if it names none of them."""
    if args.command == "experiment":
        from isotui.experiments.registry import EXPERIMENTS
        from isotui.store.files import check_distinct, check_output

        for flag in ("csv", "json"):  # a path that cannot take the output: say it before the run
            if getattr(args, flag, None):
                check_output(getattr(args, flag), f"--{flag}")
        check_distinct([("--csv", getattr(args, "csv", None)), ("--json", getattr(args, "json", None))])
        if getattr(args, "dry_run", False):
            return dry_run(EXPERIMENTS[args.experiment], args, err)
        return command_main(EXPERIMENTS[args.experiment], args, err, Outputs.of_flags(args))
    if args.command in TOP_LEVEL:
        code: int = importlib.import_module(TOP_LEVEL[args.command]).main(args, err)
        return code
    return None
