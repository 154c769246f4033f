"""``benchmarks/device_math.py``, as the docs' GPU page gives it, runs (on the CPU, at tiny sizes):
every scheme's error against float64 and which one the probe picked, and batched against
one-by-one finalisation with the first layer's ETA beside the truth."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_device_math_benchmark_runs_on_the_cpu():
    argv = [sys.executable, str(ROOT / "benchmarks" / "device_math.py"), "--device", "cpu"]
    argv += ["--dims", "64", "--rows", "256", "--layers", "2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    schemes = [line for line in lines if line.startswith("cpu") and ("float32" in line or "float64" in line)]
    assert len([line for line in schemes if "<-" in line]) == 1  # one scheme picked for d = 64
    batched = next(line for line in lines if line.startswith("device") and "batched" in line)
    row = lines[lines.index(batched) + 1].split()
    assert float(row[row.index("64") + 4]) < 1e-9  # batched equals one by one (max rel diff)
