"""benchmarks/gpu.py (issue 26, item 6) at its tiny sizes on the CPU: every part's rows come out,
each naming the device it ran on, with the shares and ratios its columns say. On a GPU the same
script runs the real sizes; only its numbers are checked there by eye."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return "cpu: " + line.split(":", 1)[1].strip()
    return "cpu: " + (platform.processor() or platform.machine())


@pytest.mark.slow
def test_smoke_rows_name_the_device_and_hold_their_own_arithmetic(tmp_path):
    out = tmp_path / "rows.jsonl"
    argv = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--device", "cpu"]
    argv += ["--parts", "0,1,2,3", "--cases", "pythia-1.4b-shape", "--dims", "64", "--samples", "8"]
    proc = subprocess.run([*argv, "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["part"] for r in rows] == ["build", "whole", "shares", "syncs"]
    assert all(r["device"] == "cpu" and r["device_name"] == _cpu_name() for r in rows)
    build, whole, shares, syncs = rows
    assert build["params"] > 0
    assert build["ratio"] == round(build["isotui_build_s"] / build["from_config_s"], 3)
    for row in (whole, shares):
        assert row["ratio"] == round(row["isotui_wall_s"] / row["bare_wall_s"], 3)
        assert row["accumulation_share"] == round(row["isotui_metrics_s"] / row["bare_forward_s"], 4)
        assert row["finalisation_share"] == round(row["isotui_finalise_s"] / row["bare_forward_s"], 4)
        assert row["tokens"] > 0 and row["bare_forward_s"] > 0
    assert shares["d"] == 64 and shares["case"] == "llama-d64"
    # syncs are CUDA's to count: on the CPU they are said to be unknown, not zero
    assert syncs["isotui_syncs_per_batch"] is None and syncs["bare_syncs_per_batch"] is None
    assert proc.stdout.count("\n") >= len(rows)
