"""How the experiments' modules stand to each other: each reads another's public names only
(the checkpoint series has its own module, :mod:`isotui.experiments.series`)."""

from __future__ import annotations

import ast
from pathlib import Path

import isotui

EXPERIMENTS = Path(isotui.__file__).parent / "experiments"


def _package(module: str) -> str:
    """``isotui.experiments.drift_block.store`` -> ``isotui.experiments.drift_block``; a module
    of the experiments' top level is a package of its own."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 else module


def test_no_experiment_imports_another_modules_private_names():
    found = []
    for path in sorted(EXPERIMENTS.rglob("*.py")):
        rel = path.relative_to(EXPERIMENTS.parent.parent).with_suffix("")
        here = ".".join(p for p in rel.parts if p != "__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("isotui")):
                continue
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private and _package(node.module) != _package(here):
                found.append(f"{here} imports {', '.join(private)} from {node.module}")
    assert found == []


def test_the_series_functions_are_the_series_modules():
    """qk-dynamics and revisions read the series from its module (the names qk_dynamics gave
    before still answer, for the callers that imported them there)."""
    from isotui.experiments import qk_dynamics, revisions, series

    assert qk_dynamics.resolve_checkpoints is series.resolve_checkpoints
    assert qk_dynamics.Checkpoint is series.Checkpoint is revisions.Checkpoint
    assert series.step_of("step_20k") == 20000 and series.step_of("main") is None
