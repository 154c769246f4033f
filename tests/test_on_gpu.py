"""On a CUDA GPU (issue 26; skipped elsewhere, see tests/conftest.py): ``auto`` picks it, and a run
there gives the CPU's numbers. Every other test runs as on a machine without CUDA."""

from __future__ import annotations

import numpy as np
import pytest

import isotui

from .conftest import corpus

pytestmark = pytest.mark.gpu

TINY = "random:gpt2:n_layer=2,n_embd=64,n_head=4"


def test_auto_is_the_gpu():
    from isotui.extract.device import resolve_device, resolve_dtype

    assert resolve_device("auto") == "cuda"
    assert resolve_dtype("auto", "cuda", None) == "float32"  # an untrained model declares no dtype


def test_a_run_on_the_gpu_gives_the_cpus_numbers(tmp_path):
    """Float32 on both: the forward differs in the last bits only (MiniLM on an H100: 1.5e-6)."""
    data = tmp_path / "samples.txt"
    data.write_text("\n".join(corpus(40)) + "\n", encoding="utf-8")
    runs = {
        device: isotui.run(
            TINY, data=f"text:{data}", device=device, dtype="float32", max_length=32, cache=False
        )
        for device in ("cuda", "cpu")
    }
    gpu, cpu = runs["cuda"].result.rows, runs["cpu"].result.rows
    assert len(gpu) == len(cpu)
    for a, b in zip(gpu, cpu, strict=True):
        assert a.n_vectors == b.n_vectors
        for name in ("avg_cos", "drift_norm", "mean_norm", "isoscore", "eff_rank"):
            assert np.isclose(getattr(a, name), getattr(b, name), rtol=1e-4, atol=1e-7), (a.layer, name)
