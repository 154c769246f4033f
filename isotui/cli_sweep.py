"""``isotui sweep CONFIG.toml``: every (model, checkpoint, shard) task of a run config, run by a
pool of local processes or by Ray (:mod:`isotui.sweep`, shared with the app), then the shards
merged and the table written as ``isotui run`` would: once all tasks are done, ``isotui run CONFIG
--model ...`` over every run whose tasks all succeeded answers from the cache (the last shard
merged, or this merges) and prints, and writes the config's ``csv``/``json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from isotui.sweep import EXIT_BAD_INPUT, SweepSettings, Task, TaskResult, execute, plan, read_config

HELP = "run every (model, checkpoint, shard) task of a config file on local processes or Ray, then merge"


# --- the command --------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="a run config file with a [sweep] table")
    p.add_argument("--cache-dir", help="result cache every task shares (default: the config's, or the usual)")
    p.add_argument("--csv", help="write the per-layer table of all runs here (default: the config's csv)")
    p.add_argument("--json", help="write everything here (default: the config's json)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def run_args(args: argparse.Namespace, models: list[str]) -> argparse.Namespace:
    """``isotui run CONFIG --model ...`` for ``models``, parsed by the real parser."""
    from isotui.cli import build_parser

    argv = ["run", str(args.config), *(a for m in models for a in ("--model", m))]
    for flag in ("cache_dir", "csv", "json"):
        if getattr(args, flag, None):
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    ns = build_parser().parse_args(argv + (["-q"] if args.quiet else []))
    ns.argv = argv
    return ns


def main(args: argparse.Namespace, err: Any) -> int:
    """Plan, run the tasks (a bar over tasks), then the one ``isotui run`` over the runs."""
    from isotui.cli import _cmd_run, _settings, print_error
    from isotui.paths import cache_dir

    config = args.config
    settings_file, sweep, runs = read_config(
        config, [k for k in ("cache_dir", "csv", "json") if getattr(args, k)]
    )
    cache_root = cache_dir(args.cache_dir or settings_file.get("cache_dir"))
    todo = plan(config, _settings(run_args(args, runs)), runs, sweep.shards, cache_root)
    for model, text in todo.failed_early:
        print_error(err, f"{model}: {text}")
    total = todo.total
    if not todo.tasks:
        err.print(f"isotui: all {total} tasks of the sweep are cached", highlight=False)
    else:
        where = "Ray" if sweep.executor == "ray" else "local processes"
        err.print(
            f"isotui: {len(todo.tasks)} of {total} tasks to run on {where} ({todo.cached} cached)",
            highlight=False,
        )
    failed: list[TaskResult] = []
    if todo.tasks:
        failed = _run_tasks(todo.tasks, sweep, config, cache_root, todo.cached, args, err)
    lost = {t.task.model for t in failed} | {m for m, _ in todo.failed_early}
    kept = [m for m in runs if m not in lost]
    code = 0
    if kept:
        code = _cmd_run(run_args(args, kept), err)
    if failed or todo.failed_early:
        names = [t.task.name for t in failed] + [Path(m).name for m, _ in todo.failed_early]
        err.print(
            f"isotui: {len(failed) + sweep.shards * len(todo.failed_early)} of {total} tasks failed: "
            f"{', '.join(names)}; run the sweep again to "
            "retry them (the rest is cached)",
            highlight=False,
            markup=False,
        )
        crashed = any(t.crashed for t in failed)
        return 1 if crashed else max(code, EXIT_BAD_INPUT)
    return code


def _run_tasks(
    tasks: list[Task],
    sweep: SweepSettings,
    config: Path,
    cache_root: Path,
    already: int,
    args: argparse.Namespace,
    err: Any,
) -> list[TaskResult]:
    """Run ``tasks`` with the sweep's executor under one bar over all tasks; the failed ones."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from isotui.cli import print_error
    from isotui.terminal import literal

    columns = (  # task names as typed: no markup or emoji codes read in them
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}", markup=False),
        TimeElapsedColumn(),
    )
    failed: list[TaskResult] = []
    with Progress(*columns, console=err, transient=True, disable=bool(args.quiet)) as bar:
        bar_id = bar.add_task("sweep", total=len(tasks) + already, completed=already, status="")

        def say(text: str) -> None:
            bar.console.print(f"[yellow]isotui: {literal(text)}[/]", highlight=False)

        def done(result: TaskResult) -> None:
            if not result.ok:
                failed.append(result)
                print_error(bar.console, f"task {result.task.name} failed: {result.problem}")
            bar.update(bar_id, advance=1, status=f"{result.task.name} {'done' if result.ok else 'failed'}")

        execute(tasks, sweep, config, cache_root, done, say)
    return failed
