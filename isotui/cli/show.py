"""``isotui show KEY`` for a cached result of any registered experiment other than the layer run
(attention, final-norm, gradients, drift-block): read back through the experiment's ``decode``,
printed through its view, exported through its ``rows`` and ``payload`` as the experiment's own
``--csv``/``--json`` would be. (A layer run's ``show`` is :func:`isotui.cli._cmd_show`.)"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from isotui.errors import IsotuiError

T = TypeVar("T")


def read_shown(args: argparse.Namespace, key: str, read: Callable[[], T | None], what: str) -> T:
    """The cached ``what`` (``cached run``, ``cached result``) under ``key`` that ``isotui show``
    prints, read with ``read()`` once its ``--csv``/``--json`` are known to be writable; a damaged
    or vanished entry is one sentence."""
    from isotui.store.cache import CacheProblem
    from isotui.store.files import check_distinct, check_output

    for flag in ("csv", "json"):
        value = getattr(args, flag)
        if value:
            check_output(value, f"--{flag}")
    check_distinct([("--csv", args.csv), ("--json", args.json)])
    try:
        result = read()
    except CacheProblem as problem:
        raise IsotuiError(f"{problem}; remove it with `isotui cache rm {key[:12]}`") from None
    if result is None:
        raise IsotuiError(f"{what} {key[:12]} was removed meanwhile")
    return result


def _defaults(build_parser: Callable[[], argparse.ArgumentParser], command: list[str]) -> argparse.Namespace:
    """The options of ``isotui COMMAND...`` with nothing given (what the view reads)."""
    parser = build_parser()
    for word in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser.parse_args([])


def show_experiment_entry(
    args: argparse.Namespace, err: Any, root: Path, build_parser: Callable[[], argparse.ArgumentParser]
) -> int | None:
    """Print the one experiment result whose key starts with ``args.key`` (and write its
    ``--csv``/``--json``); None when no experiment's folder holds such a key. ``build_parser``:
    the command line's (:func:`isotui.cli.build_parser`), for the options a view reads."""
    from rich.text import Text

    from isotui.cli.common import stdout_console
    from isotui.experiments.base import flatten
    from isotui.experiments.cached import read
    from isotui.experiments.registry import cached_entries
    from isotui.store.export import write_dicts_csv, write_payload_json
    from isotui.views import view_for

    prefix = args.key.strip()
    found = [(e, key) for e, key in cached_entries(root, prefix) if e.command != "run"]
    if not found:
        return None
    if len(found) > 1:
        raise IsotuiError(
            f"key {prefix!r} matches {len(found)} cached results; give more characters "
            "(see `isotui cache ls`)"
        )
    exp, key = found[0]
    decode = exp.decode
    assert decode is not None  # cached_entries lists the experiments that decode an entry
    result = read_shown(args, key, lambda: read(exp.cache(root), key, decode), "cached result")
    results = flatten([result])
    for r in results:
        if hasattr(r, "from_cache"):
            r.from_cache = True
    out = stdout_console()
    view = view_for(exp)
    for table in view.tables(result, _defaults(build_parser, ["experiment", exp.name]), out.width):
        out.print(table, highlight=None if view.highlight else False)
        if view.blank_line and not isinstance(table, Text):  # as the experiment printed it
            out.print()
    if args.csv:
        err.print(f"wrote {write_dicts_csv(exp.rows(results), Path(args.csv))}", markup=False)
    if args.json:
        err.print(f"wrote {write_payload_json(exp.payload(results), Path(args.json))}", markup=False)
    return 0
