"""What every ``isotui`` subcommand's module shares: exit codes, the console results go to, the
run options as flags, one failure's sentence and the progress bar. Below :mod:`isotui.cli` (which
builds the parser and dispatches) and its siblings, so none of them imports another for these.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Any

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left


def exit_code(outcome, err) -> int:
    """0 when all succeeded, else 1 if any failure was internal, 2 if all were bad input; with
    several models (or checkpoints), one closing line names the failed ones."""
    failed = [name for name, _ in outcome.failed]
    total = outcome.total or len(failed) + len(outcome.results)
    if failed and total > 1:
        from isotui.terminal import plain

        err.print(plain(f"isotui: {len(failed)} of {total} {outcome.what} failed: {', '.join(failed)}"))
    return EXIT_INTERNAL if outcome.internal else EXIT_BAD_INPUT if failed else 0


def stdout_console():
    """The console for results: full-width tables when piped, not an 80-column squeeze."""
    from rich.console import Console

    from isotui.terminal import console

    class Out(Console):
        def on_broken_pipe(self) -> None:  # rich would exit 1; main() ends quietly instead
            self.quiet = True
            raise BrokenPipeError

    out = console(Out)
    return out if out.is_terminal else console(Out, width=200)


def add_run_flags(p: argparse.ArgumentParser, command: str = "run") -> None:
    """The run options ``command`` (``run`` or an experiment's name) takes, as flags: what to
    measure and how (declared once, in :mod:`isotui.spec`)."""
    from isotui.experiments.registry import options_for

    for option in options_for(command):
        kwargs: dict[str, Any] = {"help": option.help}
        if option.switch:
            kwargs.update(action="store_true", default=None)
        if option.repeat:
            kwargs["action"] = "append"
        if option.choices:
            kwargs["choices"] = list(option.choices)
        if option.aliases:  # checked against the choices after this
            kwargs["type"] = option.unalias
        if option.metavar:
            kwargs["metavar"] = option.metavar
        p.add_argument(option.flag, **kwargs)


def print_error(err, text: str) -> None:
    """A model's failure, as the one sentence the command prints before going on (as written:
    ``[serve]`` or ``[run]`` in it is text, not Rich markup)."""
    from isotui.terminal import literal

    err.print(f"[bold red]isotui: error:[/] {literal(text)}", highlight=False)


def progress_status(ev) -> str:
    """What a job is doing, in words (:meth:`isotui.extract.progress.Progress.status`)."""
    return str(ev.status())


@contextmanager
def progress_printer(err, name: str, *, quiet: bool, verbose: bool = False):
    """A progress callback drawing a rich bar on stderr while open: the phase (resolving, loading,
    tokenising, running with samples, tokens, tok/s and an ETA that covers the metrics'
    finalisation, finalising layer by layer, writing); one-off messages (an out-of-memory
    back-off) are printed above it, and with ``verbose`` each phase as it starts."""
    import time

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from isotui.extract.progress import Progress as Event
    from isotui.terminal import literal

    columns = (  # the name and the status as typed: no markup or emoji codes read in them
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        TextColumn("{task.fields[status]}", markup=False),
        TimeElapsedColumn(),
    )
    started = time.perf_counter()
    seen: list[str] = []
    with Progress(*columns, console=err, transient=True, disable=quiet) as bar:
        task = bar.add_task(name, total=None, status="starting: resolving and loading the model")

        def on_progress(ev: Event) -> None:
            if ev.message:
                bar.console.print(f"[yellow]{literal(name)}: {literal(ev.message)}[/]", highlight=False)
                return
            phase = ev.phase or "running"
            if verbose and phase not in seen:
                seen.append(phase)
                line = f"{name}: {phase}: {progress_status(ev)}" if ev.phase else f"{name}: running"
                elapsed = time.perf_counter() - started
                bar.console.print(f"[dim]{elapsed:7.1f} s  {literal(line)}[/]", highlight=False)
            total: int | None
            if phase == "finalising":
                total, completed = ev.layers_total, ev.layers_done
            elif phase == "running" or ev.samples_total:
                total, completed = ev.samples_total or None, ev.samples_done
            else:
                total, completed = None, 0
            bar.update(task, total=total, completed=completed, status=progress_status(ev))

        yield on_progress
