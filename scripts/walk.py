"""The walk of one ``--max-samples`` value through isotui, traced, not read off the code.

Runs ``isotui ARGS`` in this process (``isotui.cli.main``) under a profiler and lists the walk:
the isotui functions the value reaches the place that cuts the corpus
(``isotui.data.sources.load_samples``) through. A stop is a function called with the value:
as itself, a Namespace attribute or a settings key (``max_samples``), a field of a spec or of a
request's spec, or in a list of those. The walk is closed over two hand-overs: the stop that
called it with the value, and the stop whose returned value (a settings dict, a spec, the
requests) it was called with. A climb is a call on the walk into a higher import layer (the
layers contract in pyproject.toml: a callback handed down), or from the shared experiment loop
(``cli.experiments``) back into ``isotui run``'s own module (``cli``).

    PYTHONPATH=. python scripts/walk.py run -m minilm --data text:FILE --max-samples 7919 -q

Give ``--max-samples`` a number nothing else in the run equals (7919): the value is found by
equality. docs/architecture.md ("One option's walk") lists what this prints;
tests/test_walk.py checks the two agree.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

Stop = tuple[str, str]  # (file under the repository, function's qualified name)
CUT: Stop = ("isotui/data/sources.py", "load_samples")


@dataclass(frozen=True)
class Walk:
    """A traced walk: its stops in the order first called, and its climbs (caller, callee)."""

    code: int  # the command's exit code
    stops: list[Stop]
    climbs: list[tuple[Stop, Stop]]

    @property
    def files(self) -> set[str]:
        return {file for file, _ in self.stops}

    def lines(self) -> list[str]:
        """One line per stop (``file:function``), a climb marked with where it comes from."""
        came = {callee: caller for caller, callee in self.climbs}
        return [
            f"{file}:{name}"
            + (f" (climb, from {':'.join(came[(file, name)])})" if (file, name) in came else "")
            for file, name in self.stops
        ]


def _layers(root: Path) -> dict[str, int]:
    """Module -> its place in the layers contract (0: the top)."""
    contracts = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    layers = contracts["tool"]["importlinter"]["contracts"][0]["layers"]
    return {mod.strip(): i for i, line in enumerate(layers) for mod in line.split(":")}


def _module(file: str) -> str:
    return file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _layer_of(layers: dict[str, int], file: str) -> int | None:
    parts = _module(file).split(".")
    while parts:
        if ".".join(parts) in layers:
            return layers[".".join(parts)]
        parts.pop()
    return None


def walk(argv: Sequence[str], value: int) -> Walk:
    """Run ``isotui argv`` (which gives ``--max-samples value``) and trace the value's walk."""
    import isotui
    from isotui.cli import main

    package = Path(isotui.__file__).parent
    root = package.parent

    def holds(v: object, depth: int = 0) -> bool:
        if depth > 3 or isinstance(v, bool):
            return False
        if isinstance(v, int):
            return v == value
        if isinstance(v, str):
            return v == str(value)
        if isinstance(v, argparse.Namespace):
            return holds(getattr(v, "max_samples", None), depth + 1)
        if isinstance(v, dict):
            return "max_samples" in v and holds(v["max_samples"], depth + 1)
        if isinstance(v, (list, tuple)):
            return any(holds(x, depth + 1) for x in v[:8])
        return any(holds(getattr(v, a, None), depth + 1) for a in ("max_samples", "spec", "request"))

    def handles(v: Any) -> list[object]:
        """What a carrier is known by: itself, its items, its spec, a dict's value."""
        out: list[object] = [id(v)]
        if isinstance(v, dict) and "max_samples" in v:
            out.append(("in-dict", id(v["max_samples"])))
        elif isinstance(v, (list, tuple)):
            out += [id(x) for x in v[:8]]
        elif not isinstance(v, (str, int, argparse.Namespace)):
            out += [id(getattr(v, a)) for a in ("spec", "request") if getattr(v, a, None) is not None]
        return out

    def name_of(frame: FrameType) -> Stop:
        return str(Path(frame.f_code.co_filename).relative_to(root)), frame.f_code.co_qualname

    live: dict[int, Stop] = {}  # id(frame) -> its stop, while it runs
    order: dict[Stop, int] = {}
    deps: dict[Stop, set[Stop]] = {}
    calls: set[tuple[Stop, Stop]] = set()
    produced: dict[object, list[Stop]] = {}
    kept: list[object] = []  # returned carriers, alive so that their ids stay theirs

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "return":
            stop = live.pop(id(frame), None)
            if stop is not None and holds(arg):
                kept.append(arg)
                for h in handles(arg):
                    produced.setdefault(h, []).append(stop)
            return
        if event != "call" or not frame.f_code.co_filename.startswith(str(package)):
            return
        code = frame.f_code
        n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
        args = [a for a in (frame.f_locals.get(name) for name in code.co_varnames[:n]) if holds(a)]
        if not args:
            return
        stop = name_of(frame)
        live[id(frame)] = stop
        order.setdefault(stop, len(order))
        d = deps.setdefault(stop, set())
        caller = frame.f_back
        while caller is not None and id(caller) not in live:
            caller = caller.f_back
        if caller is not None:
            d.add(live[id(caller)])
            calls.add((live[id(caller)], stop))
        for a in args:
            d.update(s for h in handles(a) for s in produced.get(h, []) if s != stop)

    sys.setprofile(profile)
    try:
        code = main(list(argv))
    finally:
        sys.setprofile(None)
    on_walk: set[Stop] = set()
    todo = [CUT] if CUT in deps else []
    while todo:
        stop = todo.pop()
        if stop not in on_walk:
            on_walk.add(stop)
            todo += deps.get(stop, ())
    layers = _layers(root)
    climbs = []
    for caller, callee in sorted(calls, key=lambda c: order[c[1]]):
        if caller in on_walk and callee in on_walk:
            lo, hi = _layer_of(layers, caller[0]), _layer_of(layers, callee[0])
            back = _module(caller[0]) == "isotui.cli.experiments" and _module(callee[0]) == "isotui.cli"
            if back or (lo is not None and hi is not None and hi < lo):
                climbs.append((caller, callee))
    return Walk(code, sorted(on_walk, key=order.__getitem__), climbs)


def main() -> int:
    argv = sys.argv[1:]
    if "--max-samples" not in argv:
        print("give isotui's arguments with --max-samples N (a number nothing else equals)", file=sys.stderr)
        return 2
    traced = walk(argv, int(argv[argv.index("--max-samples") + 1]))
    for i, line in enumerate(traced.lines(), 1):
        print(f"{i:2d}. {line}")
    stops, files, climbs = len(traced.stops), len(traced.files), len(traced.climbs)
    print(f"{stops} stops in {files} files, {climbs} climb(s); exit {traced.code}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
