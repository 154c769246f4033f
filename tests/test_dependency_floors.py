"""The floors pyproject.toml declares are the versions CI's oldest set tests (`make test-oldest`
installs ci/oldest.txt), so a raised or lowered floor without a new ci/oldest.txt fails here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# every floor is tested (torch's too, since issue 35: declared at the release CI's oldest set runs)
UNTESTED_FLOORS: set[str] = set()


def _pins() -> dict[str, Version]:
    text = (ROOT / "ci" / "oldest.txt").read_text(encoding="utf-8")
    found = re.findall(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", text, flags=re.MULTILINE)
    return {canonicalize_name(name): Version(v) for name, v in found}


def _floors() -> dict[str, Version]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    floors = {}
    for line in [*project["dependencies"], *(r for name in extras if name != "test" for r in extras[name])]:
        req = Requirement(line)
        lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
        if lows:
            floors[canonicalize_name(req.name)] = max(lows)
    return floors


def test_every_declared_floor_is_pinned_in_the_oldest_set():
    pins, floors = _pins(), _floors()
    assert "transformers" in floors and "datasets" in floors  # the extras' floors are read too
    wrong = {
        name: (str(floor), str(pins.get(name)))
        for name, floor in floors.items()
        if name not in UNTESTED_FLOORS and pins.get(name) != floor
    }
    assert not wrong, f"floor in pyproject.toml vs ci/oldest.txt: {wrong}"


def test_ci_runs_both_ends():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    jobs = [line.split()[1] for line in ci.splitlines() if line.startswith("job ")]
    assert jobs == ["test", "test-oldest", "test-newest"]  # README's command, then both ends
