"""``isotui sweep CONFIG.toml``: every (model, checkpoint, shard) task of a run config, run by a
pool of local processes or by Ray (:mod:`isotui.sweep`, shared with the app), then the shards
merged and the table written as ``isotui run`` would: once all tasks are done, ``isotui run CONFIG
--model ...`` over every run whose tasks all succeeded answers from the cache (the last shard
merged, or this merges) and prints, and writes the config's ``csv``/``json``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
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
    return build_parser().parse_args(argv + (["-q"] if args.quiet else []), argparse.Namespace(argv=argv))


def main(args: argparse.Namespace, err: Any) -> int:
    """Plan, run the tasks (a bar over tasks), then the one ``isotui run`` over the runs. ^C
    while the tasks run: none starts after it, the running ones are terminated, exit 130."""
    from isotui.cli import _cmd_run, _settings
    from isotui.cli.common import print_error
    from isotui.paths import cache_dir
    from isotui.store.files import check_distinct, check_output

    config = args.config
    settings_file, sweep, runs = read_config(
        config, [k for k in ("cache_dir", "csv", "json") if getattr(args, k)]
    )
    cache_root = cache_dir(args.cache_dir or settings_file.get("cache_dir"))
    settings = _settings(run_args(args, runs), config)
    for key in ("csv", "json"):  # the final run writes them: say it before the tasks, not after
        if settings.get(key):
            check_output(settings[key], f"--{key}")
    check_distinct([("--csv", settings.get("csv")), ("--json", settings.get("json"))])
    todo = plan(config, settings, runs, sweep.shards, cache_root)
    for model, text in todo.failed_early:
        print_error(err, f"{model}: {text}")
    total = todo.total
    if todo.tasks:
        where = "Ray" if sweep.executor == "ray" else "local processes"
        err.print(
            f"isotui: {len(todo.tasks)} of {total} tasks to run on {where} ({todo.cached} cached)",
            highlight=False,
        )
    elif todo.cached == total:
        err.print(f"isotui: all {total} tasks of the sweep are cached", highlight=False)
    elif todo.cached:
        err.print(f"isotui: {todo.cached} of {total} tasks of the sweep are cached", highlight=False)
    results: list[TaskResult] = []
    if todo.tasks:
        results, stopped = _run_tasks(todo.tasks, sweep, config, cache_root, todo.cached, args, err)
        if stopped:
            err.print(stop_summary(results, todo.tasks, todo.cached), highlight=False)
            return EXIT_INTERRUPTED
    failed = [r for r in results if not r.ok]
    lost = {t.task.model for t in failed} | {m for m, _ in todo.failed_early}
    kept = [m for m in runs if m not in lost]
    code = 0
    if kept:
        code = _cmd_run(run_args(args, kept), err)
    if failed or todo.failed_early:
        names = [t.task.name for t in failed] + [Path(m).name for m, _ in todo.failed_early]
        n_failed = len(failed) + sweep.shards * len(todo.failed_early)
        crashed = any(t.crashed for t in failed)
        # a crash may pass on another try; a refusal (bad input) will be refused again
        advice = "; run the sweep again to retry them" if crashed else ""
        rest = " (the rest is cached)" if n_failed < total else ""
        err.print(
            f"isotui: {n_failed} of {total} tasks failed: {', '.join(names)}{advice}{rest}",
            highlight=False,
            markup=False,
        )
        return 1 if crashed else max(code, EXIT_BAD_INPUT)
    return code


EXIT_INTERRUPTED = 130
NAMED = 8  # a summary names at most this many tasks of a kind


def _named(tasks: list[Task]) -> str:
    names = [t.name for t in tasks[:NAMED]]
    more = f" and {len(tasks) - NAMED} more" if len(tasks) > NAMED else ""
    return f"{', '.join(names)}{more}"


def stop_summary(results: list[TaskResult], tasks: list[Task], cached: int) -> str:
    """What a sweep stopped by ^C did: the tasks done (and cached before), failed, stopped while
    they ran and never started, named."""
    by = {r.task: r for r in results}

    def those(keep: Callable[[TaskResult | None], bool]) -> list[Task]:  # in the sweep's order
        return [t for t in tasks if keep(by.get(t))]

    done = those(lambda r: r is not None and r.ok)
    failed = those(lambda r: r is not None and not r.ok and not r.cancelled)
    stopped = those(lambda r: r is not None and r.cancelled and r.started is True)
    either = those(lambda r: r is not None and r.cancelled and r.started is None)  # Ray's
    not_started = those(lambda r: r is None or (r.cancelled and r.started is False))
    parts = [f"{len(done)} of {len(tasks)} tasks done" + (f" ({_named(done)})" if done else "")]
    if cached:
        parts[0] += f", {cached} cached before"
    groups = (
        ("failed", failed),
        ("stopped while running", stopped),
        ("stopped, running or queued on Ray", either),
        ("not started", not_started),
    )
    for what, group in groups:
        if group:
            parts.append(f"{len(group)} {what} ({_named(group)})")
    return (
        f"isotui: sweep stopped by ^C: {'; '.join(parts)}; run it again to do the rest "
        "(what is done is cached)"
    )


@contextlib.contextmanager
def interrupt_stops(stop: threading.Event, say: Callable[[str], None]) -> Iterator[None]:
    """While the tasks run, ^C (SIGINT) sets ``stop`` instead of raising, so the executor starts
    no further task and terminates the running ones (their processes get the terminal's ^C too);
    a second ^C raises KeyboardInterrupt at once. Only in the main thread (where signals land)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_interrupt(_signum: int, _frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        say("stopping the sweep: no task starts now, the running ones are terminated (^C again: at once)")

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_tasks(
    tasks: list[Task],
    sweep: SweepSettings,
    config: Path,
    cache_root: Path,
    already: int,
    args: argparse.Namespace,
    err: Any,
) -> tuple[list[TaskResult], bool]:
    """Run ``tasks`` with the sweep's executor under one bar over all tasks; every task's result,
    and whether ^C stopped the sweep."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from isotui.cli.common import print_error
    from isotui.terminal import literal

    columns = (  # task names as typed: no markup or emoji codes read in them
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}", markup=False),
        TimeElapsedColumn(),
    )
    results: list[TaskResult] = []
    stop = threading.Event()
    with Progress(*columns, console=err, transient=True, disable=bool(args.quiet)) as bar:
        bar_id = bar.add_task("sweep", total=len(tasks) + already, completed=already, status="")

        def say(text: str) -> None:
            bar.console.print(f"[yellow]isotui: {literal(text)}[/]", highlight=False)

        def done(result: TaskResult) -> None:
            results.append(result)
            if result.cancelled:
                return
            if not result.ok:
                print_error(bar.console, f"task {result.task.name} failed: {result.problem}")
            bar.update(bar_id, advance=1, status=f"{result.task.name} {'done' if result.ok else 'failed'}")

        with interrupt_stops(stop, say):
            execute(tasks, sweep, config, cache_root, done, say, stop.is_set)
    return results, stop.is_set()
