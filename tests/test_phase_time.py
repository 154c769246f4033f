"""``--dry-run``'s time per phase (isotui/extract/phase_time.py): the work it counts, checked
against the model's own parameter count and the run's sizes written out by hand; the rates are
the nominal H100's (no GPU here), so every number is fixed. Times are never measured here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from isotui.cli import main
from isotui.extract import phase_time
from isotui.extract.phase_time import NOMINAL, PhaseTimes, duration

from .test_device_map import PYTHIA_12B, _config, _neox_params


def _plan(tmp_path, *flags: str) -> dict:
    folder = _config(tmp_path, "pythia-12b", PYTHIA_12B)
    out = tmp_path / "plan.json"
    assert main(["run", "--model", str(folder), "--dry-run", "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())[str(folder)]


def test_pythia_12b_on_two_gpus_phase_by_phase(tmp_path):
    flags = (
        "--device-map",
        "auto",
        "--max-memory",
        "0=80GB,1=80GB",
        "--max-samples",
        "10",
        "--max-length",
        "512",
    )
    plan = _plan(tmp_path, *flags)
    phases = plan["phases"]
    assert "phases" in plan["estimates"]  # an estimate: the plan-equality test leaves it out
    d, blocks, vocab, tokens = 5120, 36, 50688, 10 * 512
    params = _neox_params(d, blocks, 20480, vocab)
    h100 = NOMINAL["H100"]
    assert phases["tokens"] == tokens and phases["bounded"] and phases["repeat"] == 1
    assert set(phases["devices"]) == {"cuda:0", "cuda:1"}
    assert all("H100" in what and "nominal" in what for what in phases["devices"].values())
    want = {
        # float16 weights read once from local disk
        "reading weights": params * 2 / phase_time.DISK_BYTES_PER_S,
        # 2 FLOPs per multiplied weight per token (the token embedding is looked up), and
        # attention's QK^T and AV over 512 positions in each block
        "forward": tokens * (2 * (params - vocab * d) + 4 * 512 * d * blocks) / h100.forward_flops,
        # 37 hidden states, every one exact: d^2 products per token each
        "sums": 37 * tokens * d * d * phase_time.SUMS_PRODUCTS / h100.sums_flops,
        # per layer: the covariance's eigh, the reservoir's (4,096 vectors < d) eighs, no
        # jackknife eighs above 1,024 dims, and the reservoir's products
        "finalisation": 37
        * (
            h100.eigh_8192_s * (d / 8192) ** 3
            + phase_time.SAMPLE_EIGHS * h100.eigh_8192_s * (4096 / 8192) ** 3
            + phase_time.SAMPLE_PRODUCTS * 2 * 4096 * d * d / h100.sums_flops
        ),
    }
    assert phases["seconds"].keys() == want.keys()
    for name, seconds in want.items():
        assert phases["seconds"][name] == pytest.approx(seconds, rel=1e-12), name
    # per hidden state (issue 40: each site's accumulation and finalisation): 37 alike layers
    assert len(phases["layers"]) == 37
    for layer in phases["layers"]:
        assert layer["sums"] == pytest.approx(want["sums"] / 37, rel=1e-12)
        assert layer["finalisation"] == pytest.approx(want["finalisation"] / 37, rel=1e-12)


def test_each_layer_costs_what_its_covariance_and_reservoir_make():
    """A layer without its exact covariance has no d x d sums and no d x d eigh; its reservoir's
    work is what is left: the per-layer parts say so, and add up to the phases."""
    rates = NOMINAL["H100"]
    work = phase_time.Work(
        tokens=8192,
        length=512,
        batch_tokens=2048,
        main="cuda:0",
        weights={"cuda:0": 10**9},
        weight_bytes=2,
        embedding_weights=0,
        blocks={"cuda:0": 2},
        dim=2048,
        layers=[("cuda:0", 2048, True, 4096), ("cuda:0", 2048, False, 4096), ("cuda:0", 512, True, 4096)],
    )
    got = phase_time.estimate(work, {"cuda:0": rates})
    (exact_s, exact_f), (sampled_s, sampled_f), (small_s, small_f) = got.layers
    products = phase_time.SUMS_PRODUCTS / rates.sums_flops
    assert exact_s == pytest.approx(8192 * 2048**2 * products, rel=1e-12)
    assert sampled_s == 0.0
    assert small_s == pytest.approx(8192 * 512**2 * products, rel=1e-12)
    assert exact_f - sampled_f == pytest.approx(rates.eigh_s(2048), rel=1e-9)  # the covariance's eigh
    assert got.seconds["sums"] == pytest.approx(exact_s + small_s, rel=1e-12)
    assert got.seconds["finalisation"] == pytest.approx(exact_f + sampled_f + small_f, rel=1e-12)


def test_the_dry_run_says_the_time_per_phase(tmp_path, capsys):
    folder = _config(tmp_path, "pythia-12b", PYTHIA_12B)
    main(["run", "--model", str(folder), "--dry-run", "--device-map", "auto", "--max-memory", "0=20GB"])
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("time (estimated"))
    # no --max-samples: a time per million tokens, and the rates' source named
    assert "per 1,000,000 tokens, no --max-samples" in line
    assert "cuda:0: NVIDIA H100, nominal" in line
    for phase in ("reading weights", "offloaded weights, every batch", "forward", "sums", "finalisation"):
        assert phase in line  # 23 GB of float16 weights, 20 GB on the GPU: some on the CPU or disk
    # the layer table: each hidden state's estimated sums and finalisation
    lines = printed.splitlines()
    header = next(x for x in lines if x.startswith("layer ") and "covariance" in x)
    assert header.split()[-2:] == ["sums", "finalise"]
    rows = [x for x in lines[lines.index(header) + 1 :] if x.startswith("layer ")]
    assert len(rows) == 37 and all(x.split()[-1] in ("s", "min", "h") for x in rows)
    assert all(len(x) <= 80 for x in [header, *rows])  # an 80-column terminal shows it unwrapped


def test_offloaded_weights_travel_once_per_batch():
    work = phase_time.Work(
        tokens=8192,
        length=512,
        batch_tokens=2048,
        main="cuda:0",
        weights={"cuda:0": 10**9, "cpu": 5 * 10**8, "disk": 2 * 10**8},
        weight_bytes=2,
        embedding_weights=0,
        blocks={"cuda:0": 4},
        dim=64,
        layers=[("cuda:0", 64, True, 4096)],
    )
    got = phase_time.estimate(work, {"cuda:0": NOMINAL["H100"]})
    per_batch = 5e8 / phase_time.HOST_TO_GPU_BYTES_PER_S + 2e8 * (
        1 / phase_time.DISK_BYTES_PER_S + 1 / phase_time.HOST_TO_GPU_BYTES_PER_S
    )
    assert got.seconds["offloaded weights, every batch"] == pytest.approx(4 * per_batch, rel=1e-12)


def test_a_series_says_its_whole_time_and_durations_read_as_a_person_would():
    times = PhaseTimes(
        512_000, {"forward": 100.0, "sums": 26.0}, {"cuda:0": "NVIDIA H100, nominal"}, repeat=154
    )
    line = times.line()
    assert "in all 126 s, 5.4 h for its 154 checkpoints" in line  # 126 x 154 = 19,404 s
    assert [duration(s) for s in (0.42, 12.4, 450, 4500, 40000)] == [
        "0.4 s",
        "12 s",
        "450 s",
        "75.0 min",
        "11.1 h",
    ]


@pytest.mark.slow
def test_the_benchmark_gives_the_issues_runs(tmp_path):
    """``benchmarks/memory_plan.py --times``: the issue's runs (the note quotes its output)."""
    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, str(root / "benchmarks" / "memory_plan.py"), "--times", "--samples", "10"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=True).stdout
    assert out.count("time per checkpoint:") == 4
    assert "pythia-12b on 8 x 80 GB" in out and "154 checkpoints one after another" in out
    assert "llama-3-70b on 2 x 80 GB" in out and "llama-3-70b on 4 x 80 GB" in out
    assert "offloaded weights, every batch" in out  # 70B on 2 GPUs: some weights on disk
