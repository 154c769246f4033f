"""docs/architecture.md's walk of --max-samples is what scripts/walk.py traces on a real run."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from .conftest import corpus

ROOT = Path(__file__).resolve().parents[1]


def _walk_script():
    spec = importlib.util.spec_from_file_location("walk_script", ROOT / "scripts" / "walk.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def _documented() -> tuple[list[str], str]:
    """The stops docs/architecture.md lists (``file:function``, in order) and its count line."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("### One option's walk: --max-samples", 1)[1].split("\n## ", 1)[0]
    stops = re.findall(r"^\d+\. `([^`]+)`", section, flags=re.MULTILINE)
    count = re.search(r"^(\d+ stops in \d+ files, \d+ climbs?)\.", section, flags=re.MULTILINE)
    assert count is not None, "the section says its count"
    return stops, count.group(1)


@pytest.mark.slow
def test_documented_walk_is_the_traced_one(tmp_path):
    data = tmp_path / "samples.txt"
    data.write_text("\n".join(corpus(5)) + "\n", encoding="utf-8")
    argv = ["run", "-m", "minilm", "--data", f"text:{data}", "--max-samples", "7919", "-q"]
    walk = _walk_script().walk(argv, 7919)
    assert walk.code == 0
    stops, count = _documented()
    assert stops == [f"{file}:{name}" for file, name in walk.stops]
    climbs = len(walk.climbs)
    assert count == f"{len(walk.stops)} stops in {len(walk.files)} files, {climbs} climb{'s' * (climbs != 1)}"
    assert [callee for _, callee in walk.climbs] == [("isotui/service.py", "run.<locals>.one")]
