"""The Python examples of the API page's sections on issue 27 (a model object in memory, the
reservoir sample saved and read back) run as written: each section's fenced blocks, in the page's
order, in one fresh process (``sh`` blocks through ``isotui.cli.main``, ``python`` blocks as
they are), in a temporary folder with a temporary cache, offline."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"

# One process per section: the sh blocks' commands (each must exit 0), then the Python as written.
DRIVER = """
import json, sys
from isotui.cli import main
for kind, code in json.loads(sys.argv[1]):
    if kind == "sh":
        for argv in code:
            assert main(argv[1:]) == 0, argv
    else:
        exec(compile(code, "docs/api.md", "exec"), globals())
print("SECTION RAN")
"""


def section_blocks(page: Path, heading: str) -> list[tuple[str, object]]:
    """The fenced ``sh`` (as argvs) and ``python`` blocks of the section under ``heading``."""
    text = page.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end >= 0 else None]
    blocks: list[tuple[str, object]] = []
    for kind, code in re.findall(r"^```(sh|python)\n(.*?)^```", section, re.S | re.M):
        if kind == "sh":
            lines = code.replace("\\\n", " ").splitlines()
            blocks.append((kind, [shlex.split(line, comments=True) for line in lines if line.strip()]))
        else:
            blocks.append((kind, code))
    return blocks


@pytest.mark.slow
@pytest.mark.parametrize(
    "heading",
    ["## Measure a model you already have in memory", "## Get the vectors back: the reservoir sample"],
    ids=["model-object", "reservoir-sample"],
)
def test_the_api_pages_examples_run_as_written(heading, tmp_path):
    blocks = section_blocks(API, heading)
    assert any(kind == "python" for kind, _ in blocks)
    env = {**os.environ, "ISOTUI_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    env["HOME"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(blocks)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0 and "SECTION RAN" in proc.stdout, proc.stderr[-3000:]
