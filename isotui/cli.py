"""The ``isotui`` command: ``run`` (headless), ``models`` and ``cache``.

Kept free of torch/transformers imports: they load only when a model must actually run, so a
cached answer comes back at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from isotui import __version__
from isotui.errors import Cancelled, IsotuiError

EXIT_BAD_INPUT = 2


def stdout_console():
    """The console for results: full-width tables when piped, not an 80-column squeeze."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=200)


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """What to measure and how: flags shared by ``run`` and the attention experiments."""
    p.add_argument(
        "--data",
        help="builtin (default), text:PATH, jsonl:PATH[:FIELD], hf:NAME[:CONFIG]:SPLIT[:FIELD], "
        "images:DIR, audio:DIR, synthetic:images, synthetic:audio",
    )
    p.add_argument("--max-samples", help="keep the first N samples")
    p.add_argument(
        "--max-length", help="truncate each sample to L tokens (default: model limit, at most 512)"
    )
    p.add_argument(
        "--special-tokens",
        choices=["exclude", "include"],
        help="count CLS/SEP/BOS/EOS... (default exclude)",
    )
    p.add_argument("--batch-size", help="samples per batch (default auto: a token budget)")
    p.add_argument("--device", help="auto (cuda, mps, cpu), cpu, cuda, cuda:N, mps")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: float32 on CPU, the checkpoint's half dtype on a GPU",
    )
    p.add_argument("--seed", help="seed for random init and the reservoir sample (default 0)")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=None,
        help="allow a model's own code from the hub (off by default)",
    )


def _run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="measure layer-wise anisotropy of one or more models",
        description="Measure layer-wise anisotropy. Flags override CONFIG.toml.",
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
    p.add_argument(
        "--map-units",
        choices=["auto", "image", "position"],
        help="conv feature maps: image = each image's map flattened to one vector (Godey et al. "
        "Fig. 4), position = each spatial position's channel vector; auto: image for CNNs, "
        "position for token grids (SegFormer, timm ViTs)",
    )
    p.add_argument("--reservoir", help="vectors per layer kept for centred metrics (default 4096)")
    p.add_argument(
        "--exact",
        action="store_true",
        default=None,
        help="a second pass over the data: avg_cos_centered, I(W), all-but-the-top and "
        "standardised avg_cos over every vector rather than the reservoir (about twice the time)",
    )
    p.add_argument("--cache-dir", help="result cache (default ~/.cache/isotui, or $ISOTUI_CACHE_DIR)")
    p.add_argument("--no-cache", action="store_true", help="recompute, and store nothing")
    p.add_argument("--csv", help="write the per-layer table of all models here")
    p.add_argument("--json", help="write everything (tables, drift correlation, metadata) here")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="isotui", description="A terminal lab for the anisotropy of neural representations."
    )
    parser.add_argument("--version", action="version", version=f"isotui {__version__}")
    sub = parser.add_subparsers(dest="command")
    _run_parser(sub)
    sub.add_parser("models", help="list bundled models, presets and models in the local HF cache")
    cache = sub.add_parser("cache", help="inspect or clear the result cache")
    cache.add_argument("--cache-dir", help="result cache (default ~/.cache/isotui)")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    cache_sub.add_parser("ls", help="list cached runs")
    cache_sub.add_parser("path", help="print the cache folder")
    rm = cache_sub.add_parser("rm", help="remove cached runs by key (or prefix)")
    rm.add_argument("keys", nargs="*")
    rm.add_argument("--all", action="store_true", help="remove every cached run")
    from isotui.cli_experiments import add_parsers

    add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 2 bad input, 1 internal error, 130 interrupted)."""
    args = build_parser().parse_args(argv)
    from rich.console import Console

    err = Console(stderr=True, soft_wrap=True)  # one sentence stays one line
    try:
        if args.command == "run":
            return _cmd_run(args, err)
        if args.command == "models":
            from isotui.listing import print_models

            print_models(stdout_console())
            return 0
        if args.command == "cache":
            return _cmd_cache(args, err)
        if args.command:
            from isotui.cli_experiments import run

            code = run(args, err)
            if code is not None:
                return code
        from isotui.tui.app import run_app

        run_app()
        return 0
    except IsotuiError as exc:
        err.print(f"[bold red]isotui: error:[/] {exc}", highlight=False)
        return EXIT_BAD_INPUT
    except (KeyboardInterrupt, Cancelled):
        err.print("isotui: cancelled")
        return 130
    except Exception as exc:
        if os.environ.get("ISOTUI_DEBUG"):
            raise
        err.print(
            f"[bold red]isotui: internal error:[/] {type(exc).__name__}: {exc} "
            "(set ISOTUI_DEBUG=1 for the traceback)",
            highlight=False,
        )
        return 1


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Config file settings, overridden by the flags that were given."""
    from isotui.config import load_run_config

    settings: dict[str, Any] = load_run_config(args.config) if args.config else {}
    flags = {
        "models": args.models,
        "data": args.data,
        "max_samples": args.max_samples,
        "max_length": args.max_length,
        "special_tokens": args.special_tokens,
        "batch_size": args.batch_size,
        "device": args.device,
        "dtype": args.dtype,
        "seed": args.seed,
        "reservoir": args.reservoir,
        "trust_remote_code": args.trust_remote_code,
        "map_units": args.map_units,
        "exact": args.exact,
        "cache_dir": args.cache_dir,
        "csv": args.csv,
        "json": args.json,
    }
    for key, value in flags.items():
        if value is not None:
            settings[key] = value
            if key == "data":
                settings["data_base_dir"] = Path.cwd()
    return settings


def _config_path(config: Path | None) -> Path | None:
    """``config`` as given, or the bundled preset of that name when no such file exists."""
    if config is None or config.exists():
        return config
    from isotui.presets import find_preset

    return find_preset(str(config)) or config


def _cmd_run(args: argparse.Namespace, err) -> int:
    from isotui.data.sources import check_source
    from isotui.experiments.layerwise import measure
    from isotui.paths import cache_dir
    from isotui.render import result_table
    from isotui.spec import make_spec
    from isotui.store.cache import ResultCache
    from isotui.store.export import write_csv, write_json

    args.config = _config_path(args.config)
    s = _settings(args)
    models = s.get("models") or ["minilm"]
    where = f"config file {args.config}: " if args.config else ""
    try:
        base = make_spec(
            models[0],
            s.get("data", "builtin"),
            base_dir=s.get("data_base_dir", s.get("base_dir")),
            max_samples=s.get("max_samples"),
            max_length=s.get("max_length"),
            special_tokens=s.get("special_tokens", "exclude"),
            batch_size=s.get("batch_size"),
            device=s.get("device", "auto"),
            dtype=s.get("dtype", "auto"),
            seed=s.get("seed", 0),
            reservoir=s.get("reservoir", 4096),
            trust_remote_code=s.get("trust_remote_code", False),
            map_units=s.get("map_units", "auto"),
            exact=s.get("exact", False),
        )
    except IsotuiError as exc:
        raise IsotuiError(f"{where}{exc}") from None
    check_source(base.data)  # missing data: one sentence, before any model is looked up
    for key in ("csv", "json"):  # say it before a long run, not after
        if s.get(key) and Path(s[key]).expanduser().is_dir():
            raise IsotuiError(f"--{key} {s[key]} is a directory; give a file name")
    cache = None if args.no_cache else ResultCache(cache_dir(s.get("cache_dir")))
    out = stdout_console()
    results, failed = [], []
    for model in models:
        try:
            result = _measure_with_progress(
                base.with_model(model), cache, err, quiet=args.quiet, measure=measure
            )
        except IsotuiError as exc:
            err.print(f"[bold red]isotui: error:[/] {exc}", highlight=False)
            failed.append(model)
            continue
        results.append(result)
        out.print(result_table(result, out.width))
        out.print()
    if results and s.get("csv"):
        path = write_csv(results, Path(s["csv"]))
        err.print(f"wrote {path}")
    if results and s.get("json"):
        path = write_json(results, Path(s["json"]))
        err.print(f"wrote {path}")
    if failed and len(models) > 1:
        err.print(f"isotui: {len(failed)} of {len(models)} models failed: {', '.join(failed)}")
    return EXIT_BAD_INPUT if failed else 0


def _measure_with_progress(spec, cache, err, *, quiet: bool, measure):
    """Run one model with a rich progress bar (samples, tokens, tokens/s) on stderr."""
    with progress_printer(err, spec.model, quiet=quiet) as on_progress:
        return measure(
            spec,
            cache,
            on_progress=on_progress,
            on_notice=lambda text: err.print(f"[yellow]isotui: {text}[/]", highlight=False),
        )


@contextmanager
def progress_printer(err, name: str, *, quiet: bool):
    """A progress callback drawing a rich bar (samples, tokens, tokens/s) on stderr while open;
    one-off messages (an out-of-memory back-off) are printed above it."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from isotui.extract.progress import Progress as Event

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} samples"),
        TextColumn("{task.fields[tokens]} tokens  {task.fields[rate]:.0f} tok/s"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True, disable=quiet) as bar:
        task = bar.add_task(name, total=None, tokens=0, rate=0.0)

        def on_progress(ev: Event) -> None:
            if ev.message:
                bar.console.print(f"[yellow]{name}: {ev.message}[/]", highlight=False)
                return
            bar.update(
                task,
                total=ev.samples_total,
                completed=ev.samples_done,
                tokens=ev.tokens_done,
                rate=ev.tokens_per_s,
            )

        yield on_progress


def _cmd_cache(args: argparse.Namespace, err) -> int:
    from rich.table import Table

    from isotui.paths import cache_dir
    from isotui.store.cache import ResultCache

    cache = ResultCache(cache_dir(args.cache_dir))
    out = stdout_console()
    if args.cache_command == "path":
        print(cache.root)
        return 0
    entries = cache.entries()
    if args.cache_command == "ls":
        if not entries:
            out.print(f"no cached runs in {cache.root}")
            _print_experiment_entries(out, cache.root)
            return 0
        table = Table(title=f"cached runs in {cache.root}", title_justify="left")
        for col in ("key", "model", "data", "samples", "created", "size"):
            table.add_column(col)
        for e in entries:
            table.add_row(
                e.key[:12],
                e.model,
                e.data,
                str(e.n_samples),
                e.created,
                f"{e.size_bytes / 1024:.0f} KiB",
            )
        out.print(table)
        _print_experiment_entries(out, cache.root)
        return 0
    if not args.all and not args.keys:
        raise IsotuiError("cache rm needs keys (see `isotui cache ls`) or --all")
    experiments = _experiment_entries(cache.root)
    if args.all:
        for path in experiments:
            path.unlink()
        if experiments:
            err.print(f"removed {len(experiments)} cached experiment result(s) (attention, drift-block)")
    chosen = entries if args.all else []
    for prefix in args.keys:
        matches = [e for e in entries if e.key.startswith(prefix)]
        if len(matches) != 1:
            what = "no cached run" if not matches else f"{len(matches)} cached runs"
            raise IsotuiError(f"key {prefix!r} matches {what}; see `isotui cache ls`")
        chosen.extend(matches)
    for e in chosen:
        cache.remove(e.key)
    err.print(f"removed {len(chosen)} cached run{'s' if len(chosen) != 1 else ''}")
    return 0


EXPERIMENT_FOLDERS = ("attention", "drift-block")  # experiments that cache beside runs/


def _experiment_entries(root: Path) -> list[Path]:
    return [p for folder in EXPERIMENT_FOLDERS for p in sorted((Path(root) / folder).glob("*.safetensors"))]


def _print_experiment_entries(out, root: Path) -> None:
    """One line per experiment folder: how many results it holds and their size."""
    for folder in EXPERIMENT_FOLDERS:
        files = sorted((Path(root) / folder).glob("*.safetensors"))
        if files:
            size = sum(f.stat().st_size for f in files) / (1 << 20)
            out.print(f"{folder}: {len(files)} cached result(s), {size:.1f} MiB in {Path(root) / folder}")


if __name__ == "__main__":
    sys.exit(main())
