"""Plans are refused, not degraded, below a floor (issue 24): a budget that leaves a layer fewer
than 16 reservoir vectors is one sentence saying what would fit, in the dry run and in the run;
a plan that samples a covariance from fewer vectors than dimensions says so."""

from __future__ import annotations

import re

import pytest

from isotui.cli import main

LLAMA = (
    "random:llama:hidden_size=256,intermediate_size=512,num_hidden_layers=4,"
    "num_attention_heads=4,num_key_value_heads=2"
)
DRY = ["run", "-m", LLAMA, "--max-samples", "100", "--max-length", "64", "--device-map", "auto", "--dry-run"]


def _stated(argv: list[str], capsys) -> str:
    """The size the refusal of ``argv`` (a --max-memory too small) says would fit: ``398.2MB``."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    m = re.search(
        r"too little for even 16 reservoir vectors per layer .* needs at least --max-memory cpu=(\S+ MB) ",
        err,
    )
    assert m, err
    return m.group(1).replace(" ", "")


def _below(size: str) -> str:
    """1% under ``size`` (``398.2MB``)."""
    return f"{float(size.removesuffix('MB')) * 0.99:.1f}MB"


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """The untrained Llama above, saved: a checkpoint, which accelerate can run wholly from disk."""
    import torch
    from transformers import LlamaConfig, LlamaModel

    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaModel(config).save_pretrained(folder)
    return str(folder)


def test_a_max_memory_too_small_for_the_floor_is_refused_with_the_size_that_fits(llama_checkpoint, capsys):
    dry = [*DRY[:2], llama_checkpoint, *DRY[3:]]
    size = _stated([*dry, "--max-memory", "cpu=300MB"], capsys)
    assert main([*dry, "--max-memory", f"cpu={size}"]) == 0  # what it said fits does
    out = capsys.readouterr().out
    reservoirs = {int(r) for r in re.findall(r"^layer \d+ +cpu +256 +sampled +(\d+)", out, re.M)}
    assert len(reservoirs) == 1 and 16 <= min(reservoirs) < 256
    # and the plan says that a covariance sampled from fewer vectors than d has that rank at most
    assert "rank-deficient by construction: layer 0, layer 1, layer 2, layer 3 and 1 more" in out
    assert f"reservoir of {min(reservoirs)} vectors in d = 256" in out
    assert main([*dry, "--max-memory", f"cpu={_below(size)}"]) == 2  # and 1% less is refused
    capsys.readouterr()


def test_the_size_an_untrained_model_is_told_runs_and_1_percent_less_is_refused(capsys):
    """Issue 36: an untrained model is built in memory and dispatched, never wholly on disk. Its
    refusal asked for a size at which every weight went to disk, which the run then refused;
    the size now counts its weights in memory (and accelerate's room for its largest layer)."""
    size = _stated([*DRY, "--max-memory", "cpu=300MB"], capsys)
    assert main([*DRY, "--max-memory", f"cpu={size}"]) == 0
    out = capsys.readouterr().out
    assert "weights cpu" in out and "no room in memory" not in out
    run = [a for a in DRY if a != "--dry-run"]
    assert main([*run, "--max-memory", f"cpu={size}", "--no-cache", "-q"]) == 0  # the run agrees
    capsys.readouterr()
    assert main([*DRY, "--max-memory", f"cpu={_below(size)}"]) == 2  # refused, in one sentence
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-memory" in err and "Traceback" not in err


def test_a_run_whose_free_memory_leaves_less_than_the_floor_is_refused(
    tiny_models, tmp_path, monkeypatch, capsys
):
    from isotui.extract import runner

    data = tmp_path / "t.txt"
    data.write_text("one two three four\nfive six seven eight\n", encoding="utf-8")
    monkeypatch.setattr(runner, "measured_budget", lambda _d: 5_000)  # a few kB left on the device
    argv = ["run", "-m", str(tiny_models["gpt2"]), "--data", f"text:{data}", "--no-cache"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "the free memory leaves 5.0 kB on cpu" in err and "16 reservoir vectors per layer" in err
    monkeypatch.setattr(runner, "measured_budget", lambda _d: 10**9)
    assert main([*argv, "-q"]) == 0


@pytest.mark.parametrize("budget", [60_000, 10**9])
def test_types_and_covariances_leave_the_floor_to_the_reservoirs(budget):
    """Token types and exact covariances used to take every byte and leave 2-vector reservoirs."""
    from isotui.extract import memory_plan as mp

    layers = [(32, "cpu", True)] * 3
    types = mp.fit_types(layers, {"cpu": budget}, 1000, keep_vectors=16)
    plans = mp.plan_layers([(f"layer {i}", 32, "cpu", types) for i in range(3)], {"cpu": budget}, 4096)
    assert min(p.reservoir for p in plans) >= 16
    held = sum(p.bytes for p in plans) + (8 * 32 * 32 if any(p.exact_cov for p in plans) else 0)
    assert held <= budget
