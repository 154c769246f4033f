"""``benchmarks/process.py`` runs as docs/benchmarks.md gives it, at a tiny size: the bare forward
and `isotui run` over the same text, each pair's ratio, and with ``--modules`` the sites' run
over the plain one (issue 40's 25-site ratio), its row count the sites the globs name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_process_benchmark_times_a_run_of_sites_beside_the_plain_run(tmp_path):
    argv = [sys.executable, str(ROOT / "benchmarks" / "process.py"), "--samples", "6", "--threads", "1"]
    argv += ["--max-length", "32", "--modules", "attn_out", "--modules", "encoder.layer.*.intermediate.dense"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), ISOTUI_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "isotui installed: best/best over 1 pair(s)" in out
    # MiniLM: 6 attention outputs and 6 intermediate (1536-wide) layers
    assert re.search(r"threads 1 installed \+12 sites over the plain run: wall \d+\.\d\dx", out), out
    assert "target (issue 40): 25 MiniLM sites <= 2.5x the plain run" in out
