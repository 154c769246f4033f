"""The Python API, for notebooks: ``isotui.run``, ``isotui.experiment``, ``isotui.load``.

Each call is the command line's own path: the keyword options become the flags the command would
get, its own parser reads them (same defaults, same checks, same one-sentence errors, raised as
:class:`~isotui.errors.IsotuiError`), and the function the command calls to do its work
(``collect``) computes, reading and writing the same result cache. So the numbers, the cache
entries and the files of :meth:`Result.to_csv` / :meth:`Result.to_json` are the CLI's, byte for
byte. Nothing here imports torch until a model must run.
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isotui.cli import Parser
from isotui.errors import IsotuiError

# API keywords that are not the command's flags, and flags the API spells differently
_NOT_OPTIONS = ("csv", "json", "quiet")  # files: Result.to_csv / to_json; quiet: progress=False


@dataclass
class Result:
    """One command's result, as the CLI prints and writes it.

    ``rows``: the ``--csv`` rows (dicts, keys in column order); ``payload``: the ``--json``
    document; ``results``: the experiment's own result objects (a layer run's
    :class:`~isotui.results.ModelResult`, with ``.rows``, ``.meta``, ``.arrays``...); ``tables``:
    the rich tables the CLI prints (``show()``, or just display the object in a notebook).
    """

    command: str
    models: list[str]
    rows: list[dict[str, Any]] = field(repr=False)
    payload: dict[str, Any] = field(repr=False)
    results: list = field(repr=False)
    tables: list = field(default_factory=list, repr=False)

    def __repr__(self) -> str:
        key = f", key={self.key[:12]}" if self.key else ""
        return f"Result({self.command}, models={self.models}, {len(self.rows)} rows{key})"

    @property
    def result(self):
        """The one result object (a run of one model), e.g. a ``ModelResult``."""
        if len(self.results) != 1:
            raise IsotuiError(f"this result holds {len(self.results)} results; use .results")
        return self.results[0]

    @property
    def key(self) -> str | None:
        """The cache key (``isotui.load(key)`` reopens it), for results that are cached by one."""
        return getattr(self.results[0], "key", None) if len(self.results) == 1 else None

    def to_csv(self, path: str | Path) -> Path:
        """Write the table as the CLI's ``--csv`` does (the same bytes); returns the path."""
        from isotui.store.export import write_dicts_csv

        return write_dicts_csv(self.rows, Path(path))

    def to_json(self, path: str | Path) -> Path:
        """Write everything as the CLI's ``--json`` does (NaN as null); returns the path."""
        from isotui.store.export import write_payload_json

        return write_payload_json(self.payload, Path(path))

    def to_pandas(self):
        """The rows as a pandas DataFrame (columns in CSV order); needs pandas installed."""
        try:
            import pandas as pd
        except ImportError:
            raise IsotuiError("to_pandas needs pandas: pip install pandas") from None
        return pd.DataFrame.from_records(self.rows, columns=list(self.rows[0]) if self.rows else None)

    def show(self, console=None) -> None:
        """Print the tables the CLI prints (to ``console``, default a new rich console)."""
        from isotui.terminal import console as new_console

        console = console or new_console()
        for table in self.tables:
            console.print(table)

    def __rich_console__(self, console, options):
        yield from self.tables

    def _repr_html_(self) -> str:
        """Jupyter shows the tables, coloured as in the terminal."""
        from isotui.terminal import console as new_console

        console = new_console(record=True, width=200, file=io.StringIO())
        self.show(console)
        return console.export_html(inline_styles=True)


class Results(list):
    """Several models' :class:`Result` (one per model, in the order asked), plus their common
    table: ``rows``, ``to_csv`` and ``to_json`` give what the CLI writes for all of them at once
    (``isotui run -m A -m B --csv ...``)."""

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [row for r in self for row in r.rows]

    @property
    def payload(self) -> dict[str, Any]:
        return {"results": [x for r in self for x in r.payload["results"]]}

    to_csv = Result.to_csv
    to_json = Result.to_json
    to_pandas = Result.to_pandas

    def show(self, console=None) -> None:
        for r in self:
            r.show(console)


def run(
    model: str | Sequence[str] = "minilm",
    data: str | None = None,
    *,
    config: str | Path | None = None,
    max_samples: int | None = None,
    max_length: int | None = None,
    special_tokens: str | None = None,
    batch_size: int | str | None = None,
    device: str | None = None,
    device_map: str | None = None,
    max_memory: str | dict[int | str, str | int] | None = None,
    dtype: str | None = None,
    seed: int | None = None,
    reservoir: int | None = None,
    map_units: str | None = None,
    trust_remote_code: bool | None = None,
    shard: str | None = None,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    progress: bool | None = None,
    **more: Any,
) -> Result | Results:
    """Layer-wise anisotropy, as ``isotui run`` (same defaults: ``data`` builtin, the model's
    length limit up to 512, 4096-vector reservoir, seed 0, ...; ``config`` a TOML file or preset
    whose settings the keywords override). One model name gives a :class:`Result`; a list gives
    :class:`Results`, one per model. ``cache=False`` recomputes and stores nothing; progress shows
    where a person is watching (see :func:`watching`), ``progress=False`` silences it and
    ``progress=True`` shows it anywhere. ``shard="I/K"``: one slice of a
    sharded run (``--shard``), an empty result until the shard that merges all K.
    ``device_map="auto"`` with ``max_memory="0=70GiB,cpu=200GiB"`` (or ``{0: "70GiB", "cpu": ...}``):
    the model across devices through accelerate (``--device-map``, ``--max-memory``). Any other
    flag of ``isotui run`` is a keyword too (``threads=4``, ``exact=True``, ``stream=True``,
    ``tokenizer="minilm"``); a keyword it does not have is an :class:`IsotuiError` naming them."""
    if isinstance(max_memory, dict):  # the flag's own form
        max_memory = ",".join(f"{k}={v}" for k, v in max_memory.items())
    options = {
        "data": data,
        "max_samples": max_samples,
        "max_length": max_length,
        "special_tokens": special_tokens,
        "batch_size": batch_size,
        "device": device,
        "device_map": device_map,
        "max_memory": max_memory,
        "dtype": dtype,
        "seed": seed,
        "reservoir": reservoir,
        "map_units": map_units,
        "trust_remote_code": trust_remote_code,
        "shard": shard,
        "cache_dir": cache_dir,
        **more,
    }
    positional = [str(config)] if config is not None else []
    return _per_model("run", model, options, positional, cache=cache, progress=progress)


def experiment(
    name: str, *, cache: bool = True, progress: bool | None = None, **options: Any
) -> Result | Results:
    """One of the experiments of ``isotui experiment NAME`` (attention, final-norm, gradients,
    qk-dynamics, checkpoints, drift-block), with its flags as keywords (``max_samples=200``,
    ``every_layer=True``, ``checkpoints=["step1000", "step2000"]``...). Experiments over models
    take ``model`` (a name, or a list: :class:`Results`); the series experiments take ``model``
    and ``checkpoints``; drift-block takes its own sizes."""
    from isotui.experiments.registry import EXPERIMENTS

    if not isinstance(name, str) or name not in EXPERIMENTS:
        raise IsotuiError(f"no experiment {name!r}; experiments: {', '.join(EXPERIMENTS)}")
    exp = EXPERIMENTS[name]
    if exp.inputs == "models":
        return _per_model(name, options.pop("model", "minilm"), options, [], cache=cache, progress=progress)
    return _call(name, options, [], cache=cache, progress=progress)


def load(key: str, cache_dir: str | Path | None = None) -> Result:
    """Reopen a cached result by its key or a unique prefix of it (``isotui cache ls`` lists
    them; ``Result.key`` gives one): a layer run, or the result of any registered experiment
    cached one result per entry (attention, final-norm, gradients)."""
    from isotui.experiments.cached import read
    from isotui.experiments.registry import REGISTRY
    from isotui.paths import cache_dir as default_cache_dir
    from isotui.store.cache import CacheProblem
    from isotui.views import view_of

    root = default_cache_dir(str(cache_dir) if cache_dir is not None else None)
    readable = [(e, e.folder, e.decode) for e in REGISTRY if e.folder is not None and e.decode is not None]
    matches = [
        (exp, decode, path.stem)
        for exp, folder, decode in readable
        if (root / folder).is_dir()
        for path in sorted((root / folder).glob(f"{key}*.safetensors"))
    ]
    if len(matches) != 1 or not key:
        what = "no cached result" if not matches else f"{len(matches)} cached results"
        raise IsotuiError(f"key {key!r} matches {what} in {root}; see `isotui cache ls`")
    exp, decode, full = matches[0]
    try:
        found = read(exp.cache(root), full, decode)
    except CacheProblem as problem:
        raise IsotuiError(str(problem)) from None
    if found is None:
        raise IsotuiError(f"cached result {full[:12]} was removed meanwhile")
    results = found if isinstance(found, list) else [found]
    view = view_of(exp.view)
    options = _subparser([exp.command] if exp.command == "run" else ["experiment", exp.name]).parse_args([])
    tables = [
        t for r in ([found] if isinstance(found, list) else results) for t in view.tables(r, options, 200)
    ]
    command = exp.command if exp.command == "run" else exp.name
    models = sorted({r.model for r in results})
    return Result(command, models, exp.rows(results), exp.payload(results), results, tables)


# --- progress where a person is watching ---------------------------------------------------------


def watching() -> str | None:
    """Where the default progress goes: ``"notebook"`` in Jupyter (or Colab...: tqdm's notebook
    bar when tqdm is installed, else rich's), ``"terminal"`` when stderr is a terminal (the CLI's
    bar), None when output goes to files or pipes (a script's log: nothing)."""
    import sys

    from isotui.terminal import console

    if console(stderr=True).is_jupyter:
        return "notebook"
    isatty = getattr(sys.stderr, "isatty", None)
    return "terminal" if isatty is not None and isatty() else None


def _has_tqdm() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("tqdm.auto") is not None
    except (ImportError, ValueError):  # a stand-in module without a spec
        return False


@contextmanager
def tqdm_bar(_err: Any, name: str, _args: Any) -> Iterator[Callable[[Any], None]]:
    """A job's progress as a tqdm bar (``tqdm.auto``: the notebook's widget where it can): samples
    while running, layers while finalising, the CLI's status words beside it."""
    from tqdm.auto import tqdm

    from isotui.cli import progress_status

    bar = tqdm(total=None, desc=name, unit="sample", leave=False, dynamic_ncols=True)

    def on_progress(ev: Any) -> None:
        if ev.message:
            bar.write(f"{name}: {ev.message}")
            return
        finalising = ev.phase == "finalising"
        total = (ev.layers_total if finalising else ev.samples_total) or None
        if total != bar.total:
            bar.reset(total=total)
            bar.unit = "layer" if finalising else "sample"
        bar.n = ev.layers_done if finalising else ev.samples_done
        bar.set_postfix_str(progress_status(ev), refresh=False)
        bar.refresh()

    try:
        yield on_progress
    finally:
        bar.close()


# --- the command line's path -----------------------------------------------------------------------


class _Parser(Parser):
    """The CLI's parser, saying a bad option as an :class:`IsotuiError` instead of exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise IsotuiError(message)


def _subparser(command: list[str], parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The parser of ``isotui COMMAND...`` (``["run"]``, ``["experiment", "attention"]``) within
    ``parser`` (default: a new one of the whole command line)."""
    from isotui.cli import build_parser

    parser = parser or build_parser(parser_class=_Parser)
    for word in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def _argv(parser: argparse.ArgumentParser, what: str, options: dict[str, Any]) -> list[str]:
    """The flags ``options`` (API keywords) stand for; a keyword the command lacks is said."""
    flags = {}
    for action in parser._actions:
        for flag in action.option_strings:
            if flag.startswith("--"):
                flags[flag[2:].replace("-", "_")] = flag
    argv: list[str] = []
    for name, value in options.items():
        if name in _NOT_OPTIONS:
            raise IsotuiError(
                f"{name}= is not an option of the Python API: "
                + ("use progress=" if name == "quiet" else f"write files with result.to_{name}(path)")
            )
        if name not in flags or name in ("help", "no_cache"):
            known = sorted(k for k in flags if k not in (*_NOT_OPTIONS, "help", "no_cache"))
            options_said = ", ".join([*known, "cache", "progress"])
            raise IsotuiError(f"{what} has no option {name!r}; its options: {options_said}")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flags[name])
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flags[name], str(item)]
        else:
            argv += [flags[name], str(value)]
    return argv


def _per_model(command: str, model, options: dict[str, Any], positional: list[str], *, cache, progress):
    """One :class:`Result` for a model name; :class:`Results` (one per model) for a list."""
    if isinstance(model, str | Path):
        return _call(command, {**options, "model": str(model)}, positional, cache=cache, progress=progress)
    if not isinstance(model, list | tuple) or not all(isinstance(m, str | Path) for m in model):
        raise IsotuiError(
            f"model must be a model name (a string such as 'minilm') or a list of names (got {model!r})"
        )
    models = [str(m) for m in model]
    if not models:
        raise IsotuiError("give at least one model")
    return Results(
        _call(command, {**options, "model": m}, positional, cache=cache, progress=progress) for m in models
    )


def _call(
    command: str, options: dict[str, Any], positional: list[str], *, cache: bool, progress: bool | None
):
    """Parse ``options`` as the command's flags and run the command's ``collect``."""
    from isotui.cli import build_parser
    from isotui.terminal import console

    words = ["run"] if command == "run" else ["experiment", command]
    root = build_parser(parser_class=_Parser)
    parser = _subparser(words, root)
    what = "isotui.run" if command == "run" else f"experiment {command!r}"
    argv = [*positional, *_argv(parser, what, options)]
    if not cache and any("--no-cache" in a.option_strings for a in parser._actions):
        argv.append("--no-cache")
    shown = None if progress is False else watching() or ("terminal" if progress else None)
    if shown is None:
        argv.append("--quiet")
    args = root.parse_args([*words, *argv])
    err = console(stderr=True, soft_wrap=True)
    if shown == "notebook" and _has_tqdm():
        args.progress_bar = tqdm_bar
    if command == "run":
        from isotui.cli import collect_run

        outcome = collect_run(args, err)
    else:
        from isotui.cli_experiments import collect
        from isotui.experiments.registry import EXPERIMENTS

        outcome = collect(EXPERIMENTS[command], args, err)
    if outcome.failed:
        raise IsotuiError(outcome.failed[0][1])
    models = [str(m) for m in (options.get("model"),) if m is not None]
    return Result(command, models, outcome.rows, outcome.payload, outcome.results, outcome.tables)
