"""The type checker's configuration does what docs/development.md says: core/ and experiments/
strictly, the rest of the package with its function bodies checked but no annotation required."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # mypy in a subprocess

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
UNTYPED = "def f(x):\n    return x\n"


def test_only_core_and_experiments_must_be_annotated(tmp_path):
    """An unannotated function is an error in ``isotui.core`` and ``isotui.experiments`` and
    nowhere else (``strict = true`` in an override would make every module strict: mypy #11401)."""
    for folder in ("isotui", "isotui/core", "isotui/experiments", "isotui/models"):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text("")
        (tmp_path / folder / "m.py").write_text(UNTYPED)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(PYPROJECT), "--cache-dir", str(tmp_path / "c")]
        + [f"isotui/{p}m.py" for p in ("", "core/", "experiments/", "models/")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    flagged = {line.split(":")[0] for line in proc.stdout.splitlines() if "[no-untyped-def]" in line}
    assert flagged == {"isotui/core/m.py", "isotui/experiments/m.py"}, proc.stdout + proc.stderr
