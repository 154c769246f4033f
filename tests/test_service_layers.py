"""The API is the service (issue 25): ``isotui.run``'s import closure holds no module of the
command line or the app, and no argparse, rich or textual; statically (every import statement,
lazy ones too, as import-linter reads them) and at run time (what a computed run loads)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FRONT_ENDS = ("isotui.cli", "isotui.tui", "isotui.views", "isotui.render")
FORBIDDEN = ("argparse", "rich", "textual")


def _closure(module: str) -> set[str]:
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("isotui", include_external_packages=True)
    # the root package's lazy attributes (isotui.run -> isotui.api) are loaded on use only
    graph.remove_import(importer="isotui", imported="isotui.api")
    return set(graph.find_upstream_modules(module)) | {module}


@pytest.mark.parametrize("module", ["isotui.api", "isotui.service"])
def test_the_import_closure_holds_no_front_end_argparse_rich_or_textual(module):
    closure = _closure(module)
    assert "isotui.service" in closure or module == "isotui.service"
    assert not [m for m in closure if m.startswith(FRONT_ENDS)]
    assert not closure & set(FORBIDDEN)


def test_the_closure_check_sees_a_front_end_when_there_is_one():
    """The same check on the CLI finds what it must (a check that cannot fail proves nothing)."""
    closure = _closure("isotui.cli")
    assert {"argparse", "rich"} <= closure and "isotui.service" in closure


@pytest.mark.slow
def test_a_computed_run_loads_no_front_end_rich_or_textual(tiny_models, tmp_path):
    """At run time: a model computed through ``isotui.run`` (torch and all) and its rows read,
    with no module of the CLI, the app or the views loaded, and no rich or textual unless the
    libraries isotui runs on load them themselves (some versions of them import rich); showing
    the result then loads the views (and rich), as it must. (argparse is loaded by numpy.testing
    itself, so only the static check above can speak for it.)"""
    data = tmp_path / "samples.txt"
    data.write_text("one sample here\nanother one there\nand a third\n", encoding="utf-8")
    probe = (
        "import sys\n"
        "import numpy, torch, transformers, accelerate, safetensors\n"
        "deps = sorted({m.split('.')[0] for m in sys.modules} & {'rich', 'textual'})\n"
        "import isotui\n"
        f"r = isotui.run({str(tiny_models['bert'])!r}, data='text:{data}', progress=False)\n"
        "assert r.rows and not r.result.from_cache\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({FRONT_ENDS!r})"
        " or (m.split('.')[0] in ('rich', 'textual') and m.split('.')[0] not in deps))\n"
        "print('LOADED', bad)\n"
        "r.tables\n"
        "print('SHOWN', 'rich' in sys.modules, 'isotui.views' in sys.modules)\n"
    )
    env = dict(os.environ, ISOTUI_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout and "SHOWN True True" in proc.stdout


# issue 40: no import cycle, type-checking imports included. The last ones went by the layer run's
# one pass (experiments/layer_pass.py) lying below the layer run, its shards and the cached
# experiments' job (experiments/cached_request.py), and by the app's helpers seeing the app
# through a protocol (tui/host.py's AppState) instead of importing it.


def _cycles(graph) -> list[set[str]]:
    """The groups of modules that import each other (type-checking imports too: a cycle in the
    types is one in the design), from grimp's transitive closures."""
    groups: list[set[str]] = []
    for module in sorted(graph.modules):
        if any(module in g for g in groups):
            continue
        group = set(graph.find_upstream_modules(module)) & set(graph.find_downstream_modules(module))
        if group:
            groups.append(group | {module})
    return groups


def _graph():
    grimp = pytest.importorskip("grimp")
    return grimp.build_graph("isotui", cache_dir=None)


def test_no_import_cycle():
    assert [sorted(group) for group in _cycles(_graph())] == []


def test_the_cycle_check_sees_a_cycle_when_there_is_one():
    graph = _graph()
    assert not any("isotui.core.spectrum" in g for g in _cycles(graph))
    graph.add_import(importer="isotui.core.spectrum", imported="isotui.core.isotropy")  # isotropy imports it
    assert {"isotui.core.spectrum", "isotui.core.isotropy"} in _cycles(graph)


# An experiment package's own lab tab (isotui/experiments/NAME/tab.py) may import the app and
# textual; those exceptions match nothing until a package holds one, so the contracts do not
# alert on unmatched exceptions, and this test finds a stale one instead.
TAB_EXCEPTIONS = ("isotui.experiments.*.tab -> ",)


def _exceptions() -> list[tuple[str, str]]:
    import tomllib
    from pathlib import Path

    config = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    lines = [
        line
        for contract in config["tool"]["importlinter"]["contracts"]
        for line in contract.get("ignore_imports", [])
        if not line.startswith(TAB_EXCEPTIONS)
    ]
    pairs = [line.split("->") for line in lines]
    return [(importer.strip(), imported.strip()) for importer, imported in pairs]


def test_every_import_contract_exception_is_an_import_there_is():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("isotui", include_external_packages=True)
    exceptions = _exceptions()
    assert ("isotui.experiments.drift_block.view", "rich") in exceptions
    stale = [f"{a} -> {b}" for a, b in exceptions if not graph.direct_import_exists(importer=a, imported=b)]
    assert not stale, f"import contract exceptions that match no import (delete them): {stale}"
