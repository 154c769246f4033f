"""The ``isotui`` command: ``run`` (headless), ``models`` and ``cache``.

Kept free of torch/transformers imports: they load only when a model must actually run, so a
cached answer comes back at once.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from isotui import __version__
from isotui.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    add_run_flags,
    print_error,
    stdout_console,
)
from isotui.errors import Cancelled, IsotuiError


def metrics_help() -> str:
    """``isotui run --help``'s closing list: each layer metric (a ``--wide`` choice) in one line."""
    from isotui.results import METRICS

    width = max(len(m.name) for m in METRICS)
    lines = [f"  {m.name:<{width}}  {m.definition}" for m in METRICS if m.plottable]
    return "layer metrics (CSV columns; --wide METRIC):\n" + "\n".join(lines)


def _run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="measure layer-wise anisotropy of one or more models",
        description="Measure layer-wise anisotropy. Flags override CONFIG.toml.",
        epilog=metrics_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "config",
        nargs="?",
        type=Path,
        help="a TOML file with the same settings, or a preset name (see isotui models)",
    )
    p.add_argument(
        "--model",
        "-m",
        action="append",
        dest="models",
        metavar="MODEL",
        help="HF id[@revision], local dir, minilm, timm:NAME, or random:TYPE (repeat to compare)",
    )
    add_run_flags(p)
    p.add_argument("--cache-dir", help="result cache (default ~/.cache/isotui, or $ISOTUI_CACHE_DIR)")
    p.add_argument("--no-cache", action="store_true", help="recompute, and store nothing")
    p.add_argument("--csv", help="write the per-layer table of all models here")
    p.add_argument("--json", help="write everything (tables, drift correlation, metadata) here")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.add_argument(
        "--verbose", "-v", action="store_true", help="print each phase and the time breakdown on stderr"
    )
    from isotui.cli.experiments import add_param_flags
    from isotui.experiments.layerwise import LayersParams

    add_param_flags(p, LayersParams)
    p.add_argument("--wide-csv", metavar="PATH", help="write that layer x model table here as CSV")
    from isotui.cli.experiments import add_dry_run_flag

    add_dry_run_flag(p)


class Parser(argparse.ArgumentParser):
    """argparse as isotui answers: an option it does not know is said by the subcommand it was
    given to (``isotui run: ...``), with the nearest option it has (``--max-sampels``: did you
    mean --max-samples?); a bad value is one line naming the command's ``--help``, not its
    whole usage."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self.chosen(parsed)
            guesses = [command.option_guess(word) for word in extras if word.startswith("-")]
            said = "; ".join(g for g in guesses if g)
            command.error(f"unrecognized arguments: {' '.join(extras)}" + (f"; {said}" if said else ""))
        return parsed

    def chosen(self, parsed: argparse.Namespace) -> Parser:
        """The innermost subcommand ``parsed`` went to (``isotui experiment attention``)."""
        parser: Parser = self
        while True:
            sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            name = getattr(parsed, sub.dest, None) if sub is not None else None
            if sub is None or name not in sub.choices:
                return parser
            parser = sub.choices[name]

    def option_guess(self, word: str) -> str:
        """``did you mean --max-samples?`` for an option this command lacks (``""``: no guess)."""
        from isotui.suggest import did_you_mean

        flag = word.split("=", 1)[0]
        return did_you_mean(flag, [o for o in self._option_string_actions if o.startswith("--")])

    def error(self, message: str) -> Any:  # type: ignore[override]
        """One line: what is wrong (a misspelt choice: with the nearest one), and where the
        command's options are listed (exit 2)."""
        import re

        from isotui.suggest import did_you_mean

        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            guess = did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
            message += f"; {guess}" if guess else ""
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser(parser_class: type[argparse.ArgumentParser] = Parser):
    """The whole command line; ``parser_class`` (for every subcommand too) lets the Python API
    turn a bad option into an exception instead of an exit."""
    parser = parser_class(
        prog="isotui", description="A terminal lab for the anisotropy of neural representations."
    )
    parser.add_argument("--version", action="version", version=f"isotui {__version__}")
    parser.add_argument(
        "--fresh", action="store_true", help="the app: start without the last session (session.toml)"
    )
    sub = parser.add_subparsers(dest="command")
    _run_parser(sub)
    sub.add_parser("models", help="list bundled models, presets and models in the local HF cache")
    cache = sub.add_parser("cache", help="inspect or clear the result cache")
    cache.add_argument("--cache-dir", help="result cache (default ~/.cache/isotui)")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    ls = cache_sub.add_parser("ls", help="list cached runs")
    ls.add_argument(
        "--wide", action="store_true", help="every column (created, size, each setting), however wide"
    )
    path = cache_sub.add_parser("path", help="print the cache folder")
    rm = cache_sub.add_parser("rm", help="remove cached runs by key (or prefix)")
    rm.add_argument("keys", nargs="*")
    rm.add_argument("--all", action="store_true", help="remove every cached run")
    for p in (ls, path, rm):  # `cache ls --cache-dir X` as well as `cache --cache-dir X ls`
        p.add_argument(
            "--cache-dir", default=argparse.SUPPRESS, help="result cache (default ~/.cache/isotui)"
        )
    show = sub.add_parser("show", help="print the table of a cached run (key or prefix from `cache ls`)")
    show.add_argument("key", help="the run's key, or an unambiguous prefix of at least 6 characters")
    show.add_argument("--cache-dir", help="result cache (default ~/.cache/isotui, or $ISOTUI_CACHE_DIR)")
    show.add_argument("--csv", help="write the per-layer table here")
    show.add_argument("--json", help="write everything (table, drift correlation, metadata) here")
    serve = sub.add_parser("serve", help="the app in a browser (textual-serve), on 127.0.0.1 by default")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve.add_argument(
        "--public-url", help="the page's address as the browser sees it (default http://HOST:PORT)"
    )
    from isotui.cli.experiments import add_parsers

    add_parsers(sub)
    describe_commands(parser)
    return parser


def describe_commands(parser: argparse.ArgumentParser) -> None:
    """Each subcommand's ``--help`` says what it does (its one-line help, where it has no longer
    description): `isotui models --help` printed only its usage."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                command = action.choices[choice.dest]
                command.description = command.description or choice.help
                describe_commands(command)


def _bounds_the_cpu(max_memory: object) -> bool:
    """Whether a typed ``--max-memory`` gives the CPU a bound (a run then keeps resident memory
    to live bytes from the process's start, :func:`~isotui.extract.heap.hold_heap_to_live_bytes`;
    set later, as a run does for a config file's or the API's bound, a heap already grown by the
    imports stays fragmented: an offloaded GPT-2 then peaked 31-38 MB above its baseline, against
    27-29 MB set at the start)."""
    return isinstance(max_memory, str) and any(
        part.partition("=")[0].strip().lower() == "cpu" for part in max_memory.split(",")
    )


@functools.cache
def freeze_heap_at_exit() -> None:
    """At the interpreter's exit, move every object to the collector's permanent generation
    (``gc.freeze``), so that the shutdown's collections skip them: with torch and transformers
    loaded they walked about a million objects several times, 1-4 s of every command's exit
    (issue 15; a bare forward script pays the same). Registered once per process."""
    import atexit
    import gc

    atexit.register(gc.freeze)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 2 bad input, 1 internal error, 130 interrupted)."""
    freeze_heap_at_exit()
    typed = list(sys.argv[1:] if argv is None else argv)  # as typed: `isotui figure` records it
    args = build_parser().parse_args(argv, argparse.Namespace(argv=typed))
    if _bounds_the_cpu(getattr(args, "max_memory", None)):  # before torch makes the heap large
        from isotui.extract.heap import hold_heap_to_live_bytes

        hold_heap_to_live_bytes()
    from isotui.terminal import console

    err = console(stderr=True, soft_wrap=True)  # one sentence stays one line
    try:
        if args.command == "run":
            return _cmd_run(args, err)
        if args.command == "models":
            from isotui.listing import print_models

            print_models(stdout_console())
            return 0
        if args.command == "cache":
            return _cmd_cache(args, err)
        if args.command == "show":
            return _cmd_show(args, err)
        if args.command == "serve":
            from isotui.tui.serve import serve

            return serve(args.host, args.port, public_url=args.public_url, fresh=args.fresh, err=err)
        if args.command:
            from isotui.cli.experiments import run

            code = run(args, err)
            if code is not None:
                return code
        from isotui.tui.app import run_app

        run_app(fresh=args.fresh)
        return 0
    except IsotuiError as exc:
        print_error(err, str(exc))
        return EXIT_BAD_INPUT
    except (KeyboardInterrupt, Cancelled):
        err.print("isotui: cancelled")
        return 130
    except BrokenPipeError:  # stdout closed early (`| head`): end quietly, as a SIGPIPE would
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        if os.environ.get("ISOTUI_DEBUG"):
            raise
        from isotui.terminal import literal

        err.print(
            f"[bold red]isotui: internal error:[/] {type(exc).__name__}: {literal(exc)} "
            "(set ISOTUI_DEBUG=1 for the traceback)",
            highlight=False,
        )
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush cannot complain again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _settings(args: argparse.Namespace, config: Path | None) -> dict[str, Any]:
    """``isotui run``'s settings: the config file ``config`` (resolved by
    :func:`isotui.service.config_path`; None: none) under the flags that were given
    (:func:`isotui.service.run_settings`)."""
    from isotui.experiments.registry import options_for
    from isotui.service import run_settings

    flags = {
        "models": args.models,
        **{o.name: getattr(args, o.name) for o in options_for("run")},
        "cache_dir": args.cache_dir,
        "csv": args.csv,
        "json": args.json,
    }
    return run_settings(config, flags)


def _cmd_run(args: argparse.Namespace, err) -> int:
    """``isotui run``: the settings (config file, then flags) made once into the layer
    experiment's requests and the run's :class:`~isotui.cli.experiments.Outputs`, run by the one
    loop of every experiment (:func:`isotui.cli.experiments.command_main`); the parsed flags
    are read, never written."""
    from isotui import service
    from isotui.cli.experiments import Outputs, command_main, params_from_args, print_plans
    from isotui.experiments.registry import LAYERS
    from isotui.store.files import check_distinct, check_output

    config = service.config_path(args.config)
    s = _settings(args, config)
    if getattr(args, "dry_run", False):  # each model's memory plan (--json: as JSON)
        from isotui.cli.experiments import refuse_files_in_dry_run

        refuse_files_in_dry_run({"csv": s.get("csv"), "wide_csv": args.wide_csv})
        requests = service.layer_requests(s, config, params_from_args(LAYERS, args))
        return print_plans(service.plans(LAYERS, requests), s.get("json"))
    requests = service.layer_requests(s, config, params_from_args(LAYERS, args))
    outputs = Outputs(s.get("csv"), s.get("json"), s.get("cache_dir"), bool(args.no_cache))
    for flag, path in (("--csv", outputs.csv), ("--json", outputs.json)):  # before a long run, not after
        if path:
            check_output(path, flag)
    named = [("--csv", outputs.csv), ("--json", outputs.json), ("--wide-csv", args.wide_csv)]
    check_distinct([*named, ("--save-sample", getattr(args, "save_sample", None))])  # as typed
    _wide_metric(args)  # --wide-csv said before any model runs
    return command_main(LAYERS, args, err, outputs, requests=requests, before_report=_write_wide_csv)


def _write_wide_csv(outcome, args: argparse.Namespace, err) -> None:
    """``--wide-csv``: the layer x model table of a run, beside its --csv/--json."""
    if outcome.results and getattr(args, "wide_csv", None):
        from isotui.render import wide_rows
        from isotui.store.export import write_dicts_csv

        names, rows = wide_rows(outcome.results, _wide_metric(args))
        dicts = [{"component": r[0], "layer": r[1], **dict(zip(names, r[2:], strict=True))} for r in rows]
        err.print(f"wrote {write_dicts_csv(dicts, Path(args.wide_csv))}", markup=False)


def _wide_metric(args: argparse.Namespace) -> str:
    """The metric of the layer x model table (``--wide METRIC``), checked before any run."""
    from isotui.plugins import layer_metric_names
    from isotui.store.files import check_output

    metric = getattr(args, "wide", None) or "avg_cos"
    choices = layer_metric_names()  # with the plug-ins' columns
    if metric not in choices:
        raise IsotuiError(f"--wide {metric} is not a layer metric; choose one of {', '.join(choices)}")
    if getattr(args, "wide_csv", None):
        check_output(args.wide_csv, "--wide-csv")
    return metric


def _cmd_cache(args: argparse.Namespace, err) -> int:
    from isotui.paths import cache_dir
    from isotui.store.cache import ResultCache
    from isotui.terminal import plain

    cache = ResultCache(cache_dir(args.cache_dir))
    out = stdout_console()
    if args.cache_command == "path":
        print(cache.root)
        return 0
    scan = cache.scan()
    if args.cache_command == "ls":
        if not scan.entries:
            out.print(f"no cached runs in {cache.root}", markup=False)
        else:
            from isotui.cache_listing import cache_table, run_params

            title = plain(f"cached runs in {cache.root}", style="table.title")
            params = [run_params(e.path) for e in scan.entries]
            wide = bool(getattr(args, "wide", False))
            above, table, below, natural = cache_table(scan.entries, params, out.width, wide, title)
            for line in above:
                out.print(line, markup=False, highlight=False)
            # --wide: every column whole, wider than the terminal if need be (less -S scrolls it)
            width, out.width = out.width, max(out.width, natural) if wide else out.width
            try:
                out.print(table)
            finally:
                out.width = width
            for line in below:
                out.print(line, markup=False, highlight=False)
        _print_partial_runs(out, cache.root)
        skipped = scan.skipped + _print_experiment_entries(out, cache.root)
        if skipped:
            err.print(
                f"skipped {skipped} file(s) in {cache.root} that vanished while listing or are not "
                "readable isotui entries",
                markup=False,
            )
        return 0
    if not args.all and not args.keys:
        raise IsotuiError("cache rm needs keys (see `isotui cache ls`) or --all")
    for prefix in args.keys:
        if len(prefix) < KEY_PREFIX_MIN:
            raise IsotuiError(
                f"key {prefix!r} is too short: give at least {KEY_PREFIX_MIN} characters of a key "
                "shown by `isotui cache ls`; nothing was removed"
            )
    folders = [(cache, scan)] + [
        (c, c.scan()) for c in (ResultCache(cache.root, folder=f) for f in experiment_folders())
    ]
    chosen = [(c, e) for c, sc in folders for e in sc.entries] if args.all else []
    for prefix in args.keys:
        matches = [(c, e) for c, sc in folders for e in sc.entries if e.key.startswith(prefix)]
        if _one_partial_run(matches):  # KEY-I-of-K: the shards of one run go together
            chosen.extend(matches)
            continue
        if len(matches) != 1:
            what = "no cached run or result" if not matches else f"{len(matches)} cached entries"
            raise IsotuiError(f"key {prefix!r} matches {what}; see `isotui cache ls`; nothing was removed")
        chosen.extend(matches)
    removed = {True: 0, False: 0}  # experiment results, runs
    from isotui.experiments.shards import FOLDER, remove_shard

    for c, e in chosen:
        try:
            if remove_shard(c.root, e.key) if c.runs.name == FOLDER else c.remove(e.key):
                removed[c.runs.name != "runs"] += 1
        except OSError as exc:
            done = sum(removed.values())
            raise IsotuiError(
                f"cannot remove cache entries in {c.runs} ({exc.strerror or exc}); "
                f"{done} of {len(chosen)} removed"
            ) from None
    if removed[True]:
        err.print(f"removed {removed[True]} cached experiment result(s) ({', '.join(experiment_folders())})")
    err.print(f"removed {removed[False]} cached run{'s' if removed[False] != 1 else ''}")
    if args.all:
        from isotui.experiments.shards import forget_plans

        forget_plans(cache.root)
        left = sum(sc.skipped for _, sc in folders)
        if left:
            err.print(f"left {left} file(s) that are not readable isotui entries")
    return 0


KEY_PREFIX_MIN = 6  # `cache rm` and `show` take a full key or a prefix this long (an unset $KEY is '')


def _one_partial_run(matches: list[Any]) -> bool:
    """Whether ``matches`` are all shards of one partial run (``shards/KEY-I-of-K``)."""
    from isotui.experiments.shards import FOLDER

    runs = {e.key.split("-", 1)[0] for c, e in matches if c.runs.name == FOLDER}
    return bool(matches) and len(runs) == 1 and all(c.runs.name == FOLDER for c, _ in matches)


def _print_partial_runs(out, root: Path) -> None:
    """``cache ls``: the runs whose K shards are not all cached yet (``--shard I/K``)."""
    from isotui.experiments.shards import partial_runs
    from isotui.render import Table
    from isotui.terminal import plain

    runs = partial_runs(root)
    if not runs:
        return
    table = Table(title="partial runs (isotui run --shard I/K)", title_justify="left")
    for col in ("key", "model", "data", "shards", "cached", "samples", "created", "size"):
        table.add_column(col)
    for r in runs:
        table.add_row(
            r.key[:12],
            plain(r.model),
            plain(r.data),
            f"{len(r.have)} of {r.count}",
            ", ".join(map(str, r.have)),
            str(r.n_samples),
            r.created,
            f"{r.size_bytes / 1024:.0f} KiB",
        )
    out.print(table)


def _cmd_show(args: argparse.Namespace, err) -> int:
    """Print a cached run's table; ``--csv``/``--json`` export it as ``isotui run`` would."""
    from isotui.experiments.layer_pass import read
    from isotui.paths import cache_dir
    from isotui.render import result_table
    from isotui.store.cache import ResultCache
    from isotui.store.export import write_csv, write_json

    prefix = args.key.strip()
    if len(prefix) < KEY_PREFIX_MIN:
        raise IsotuiError(
            f"key {prefix!r} is too short: give at least {KEY_PREFIX_MIN} characters (see `isotui cache ls`)"
        )
    cache = ResultCache(cache_dir(args.cache_dir))
    matches = [e for e in cache.entries() if e.key.startswith(prefix)]
    if not matches:  # any other experiment's cached result (attention, final-norm...)
        from isotui.cli.show import show_experiment_entry

        shown = show_experiment_entry(args, err, cache.root, build_parser)
        if shown is not None:
            return shown
    if len(matches) != 1:
        what = "no cached run" if not matches else f"{len(matches)} cached runs; give more characters"
        raise IsotuiError(f"key {prefix!r} matches {what} in {cache.root} (see `isotui cache ls`)")
    from isotui.cli.show import read_shown

    key = matches[0].key
    result = read_shown(args, key, lambda: read(cache, key), "cached run")
    result.from_cache = True
    out = stdout_console()
    out.print(result_table(result, out.width))
    if args.csv:
        err.print(f"wrote {write_csv([result], Path(args.csv))}", markup=False)
    if args.json:
        err.print(f"wrote {write_json([result], Path(args.json))}", markup=False)
    return 0


def experiment_folders() -> list[str]:
    """The cache folders beside ``runs/`` that registered experiments write (``cache ls/rm``)."""
    from isotui.experiments.registry import cache_folders
    from isotui.experiments.shards import FOLDER

    return [*(f for f in cache_folders() if f != "runs"), FOLDER]


def _print_experiment_entries(out, root: Path) -> int:
    """One line per experiment folder: how many results it holds and their size; returns how
    many files were skipped (vanished, unreadable, not isotui's)."""
    from isotui.store.cache import ResultCache

    skipped = 0
    for folder in experiment_folders():
        scan = ResultCache(root, folder=folder).scan()
        skipped += scan.skipped
        if scan.entries:
            size = sum(e.size_bytes for e in scan.entries) / (1 << 20)
            out.print(
                f"{folder}: {len(scan.entries)} cached result(s), {size:.1f} MiB in {Path(root) / folder}",
                markup=False,
            )
    return skipped


if __name__ == "__main__":
    sys.exit(main())
