"""``isotui experiment NAME`` and ``isotui train-tiny``: the attention-side experiments.

Each experiment module (import-light: no torch at import) provides ``HELP``,
``add_arguments(parser)`` and ``main(args, err) -> int``; this module only wires them into the
command line, so adding an experiment is one line in :data:`EXPERIMENTS`.
"""

from __future__ import annotations

import argparse
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from isotui.spec import RunSpec

EXPERIMENTS = {
    "attention": "isotui.experiments.attention",
    "drift-block": "isotui.experiments.drift_block",
    "qk-dynamics": "isotui.experiments.qk_dynamics",
    "checkpoints": "isotui.experiments.checkpoints",
    "final-norm": "isotui.experiments.final_norm",
    "gradients": "isotui.experiments.gradients",
}
TOP_LEVEL = {"train-tiny": "isotui.experiments.train_tiny"}


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
        "them (isotui train-tiny output); comma- or space-separated, repeatable",
    )


def add_run_flags(p: argparse.ArgumentParser, command: str) -> None:
    """The run options experiment ``command`` takes (see :func:`isotui.cli.add_run_flags`)."""
    from isotui.cli import add_run_flags as run_flags

    run_flags(p, command)


def spec_from_args(args: argparse.Namespace, model: str) -> RunSpec:
    """A validated :class:`~isotui.spec.RunSpec` from the run flags of the experiment ``args``
    names (every option it takes; unset ones keep their defaults); missing data said first."""
    from isotui.data.sources import check_source
    from isotui.spec import given_options, make_spec

    command = getattr(args, "experiment", None) or args.command
    spec = make_spec(model, **given_options(vars(args), command))
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


def report(outcome, args: argparse.Namespace, err) -> int:
    """Write a command's --csv and --json (when it measured anything); its exit code."""
    from pathlib import Path

    from isotui.cli import exit_code
    from isotui.store.export import write_dicts_csv, write_payload_json

    if outcome.results and getattr(args, "csv", None):
        err.print(f"wrote {write_dicts_csv(outcome.rows, Path(args.csv))}")
    if outcome.results and getattr(args, "json", None):
        err.print(f"wrote {write_payload_json(outcome.payload, Path(args.json))}")
    return exit_code(outcome, err)


def command_main(collect, before_report=None):
    """A command's ``main(args, err)`` from its ``collect(args, err, ...)``: tables printed as
    they come, a failed model's sentence printed and the next one tried, then ``before_report``
    (a command's extra outputs, e.g. run's --wide-csv) and :func:`report`."""

    def main(args: argparse.Namespace, err) -> int:
        from isotui.cli import print_error, stdout_console

        out = stdout_console()
        outcome = collect(
            args,
            err,
            width=out.width,
            on_table=lambda table: (out.print(table), out.print()),
            on_error=lambda _model, text: print_error(err, text),
        )
        if before_report is not None:
            before_report(outcome, args, err)
        return report(outcome, args, err)

    return main


def progress_printer(err, name: str, *, quiet: bool):
    """The headless progress bar (see :func:`isotui.cli.progress_printer`)."""
    from isotui.cli import progress_printer as printer

    return printer(err, name, quiet=quiet)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """``experiment NAME ...`` and the top-level commands."""
    exp = sub.add_parser(
        "experiment",
        help="experiments: attention, drift-block, qk-dynamics, checkpoints, final-norm, gradients",
    )
    names = exp.add_subparsers(dest="experiment", required=True, metavar="NAME")
    for name, path in EXPERIMENTS.items():
        module = importlib.import_module(path)
        p = names.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
    for name, path in TOP_LEVEL.items():
        module = importlib.import_module(path)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)


def run(args: argparse.Namespace, err) -> int | None:
    """Run the experiment or top-level command ``args`` names; None if it names none of them."""
    if args.command == "experiment":
        from isotui.store.files import check_output

        for flag in ("csv", "json"):  # a path that cannot take the output: say it before the run
            if getattr(args, flag, None):
                check_output(getattr(args, flag), f"--{flag}")
        return importlib.import_module(EXPERIMENTS[args.experiment]).main(args, err)
    if args.command in TOP_LEVEL:
        return importlib.import_module(TOP_LEVEL[args.command]).main(args, err)
    return None
