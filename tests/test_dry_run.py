"""``--dry-run`` for every experiment that streams a model (attention, final-norm, gradients,
checkpoints, qk-dynamics), added once through the registry: the plan from a config file written
here (no weights), every byte count worked out here from the sums' shapes (pythia-12b: d = 5120,
36 blocks, 40 heads of 128)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isotui.cli import build_parser, main
from isotui.experiments.registry import REGISTRY

from .test_device_map import PYTHIA_12B, _config, _neox_params

D, BLOCKS, HEADS, HEAD_DIM, INTER, VOCAB = 5120, 36, 40, 128, 20480, 50688
GPUS = "0=80GB,1=80GB"
MARGIN_MIN = 256 << 20


def _budget(given: int) -> int:
    """What a device given ``given`` bytes and holding no weights and no activations leaves
    for sums: less the margin (10%, at least 256 MiB)."""
    return given - max(MARGIN_MIN, given // 10)


def _plan(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "plan.json"
    assert main(["experiment", *args, "--dry-run", "--json", str(out)]) == 0
    (plan,) = json.loads(out.read_text()).values()
    return plan


@pytest.fixture
def pythia(tmp_path):
    return str(_config(tmp_path, "pythia-12b", PYTHIA_12B))


def test_every_experiment_that_streams_a_model_takes_dry_run():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["experiment"]
    names = next(a for a in sub._actions if a.dest == "experiment").choices
    for e in REGISTRY:
        if e.command != "experiment":
            continue
        flags = {s for a in names[e.name]._actions for s in a.option_strings}
        assert ("--dry-run" in flags) == (e.name != "drift-block"), e.name  # drift-block builds its own


def test_gradients_plan(pythia, tmp_path):
    plan = _plan(tmp_path, "gradients", "-m", pythia, "--device-map", "auto", "--max-memory", GPUS)
    per_layer = 2 * 8 * D * D + 6 * 8 * D  # g g^T and x x^T in float64, six float64 d-vectors
    assert per_layer == 419_676_160
    assert [p["bytes"] for p in plan["parts"]] == [per_layer] * (BLOCKS + 1)
    assert sum(plan["accumulator_bytes"].values()) == (BLOCKS + 1) * per_layer
    assert set(plan["accumulator_bytes"]) == {"cuda:0", "cuda:1"}  # each layer's sums on its GPU
    with_head = _neox_params(D, BLOCKS, INTER, VOCAB) + VOCAB * D  # the untied LM head (embed_out)
    assert sum(plan["weights_bytes"].values()) == with_head * 2  # float16
    assert plan["sampled"] == "nothing" and not plan["caps"]


def test_attention_plan(pythia, tmp_path):
    plan = _plan(tmp_path, "attention", "-m", pythia, "--device-map", "auto", "--max-memory", GPUS)
    vectors = 8 * (HEADS + HEADS) * (2 * HEAD_DIM + 3)  # per head: sums of vectors and unit vectors, 3 counts
    scores = 8 * HEADS * (1024 + 2) + 8 * 5 * HEADS  # int64 histogram and five float64 per head
    rows = 8 * 5 * HEADS
    module = 2 * vectors + scores + rows  # rotary: queries and keys read before it too
    assert module == 663_040
    assert [p["bytes"] for p in plan["parts"]] == [module] * BLOCKS
    assert "nothing" in plan["sampled"]


@pytest.mark.parametrize("sample", [256, 5000])
def test_qk_dynamics_plan_caps_the_subsample_to_its_devices(pythia, tmp_path, sample):
    """Each module's query/key subsample lives beside its sums, on its block's GPU; one size for
    all, what the tightest GPU's budget holds (the CPU holds none of it)."""
    args = (
        "qk-dynamics",
        "--checkpoints",
        f"{pythia},{pythia}",
        "--sample",
        str(sample),
        "--device-map",
        "auto",
        "--max-memory",
        "0=13GB,1=13GB,cpu=100GB",
    )
    plan = _plan(tmp_path, *args)
    per_position = 2 * 4 * D  # a module's queries and keys, float32, at most d each
    modules = {}
    for p in plan["parts"]:
        if p["name"].startswith("attention "):
            modules[p["device"]] = modules.get(p["device"], 0) + 1
    assert set(modules) == {"cuda:0", "cuda:1"} and sum(modules.values()) == BLOCKS
    fits = {dev: plan["budget_bytes"][dev] // (n * per_position) for dev, n in modules.items()}
    size = min(sample, *fits.values())
    assert 256 < min(fits.values()) < 5000  # 256 fits; 5,000 does not
    samples = [p for p in plan["parts"] if p["name"] == "query/key subsample"]
    assert {p["device"]: p["bytes"] for p in samples} == {
        dev: size * n * per_position for dev, n in modules.items()
    }
    capped = [c for c in plan["caps"] if "subsample capped" in c]
    assert bool(capped) == (size < sample)
    if capped:
        tightest = min(fits, key=fits.__getitem__)
        assert f"capped at {size:,} positions per module (of {sample:,} asked)" in capped[0]
        assert capped[0].endswith(f"{tightest} has left")


@pytest.mark.parametrize(
    ("memory", "exact"),
    [
        ([GPUS], True),
        # --max-memory keeps room for the layer sums' floor and a batch before placing weights
        # (issue 24); 32 samples of 2,048 tokens leave 13 GB GPUs no room for final-norm's three
        (["0=13GB,1=13GB,cpu=100GB", "--batch-size", "32"], False),
    ],
)
def test_final_norm_plan(pythia, tmp_path, memory, exact):
    plan = _plan(tmp_path, "final-norm", "-m", pythia, "--device-map", "auto", "--max-memory", *memory)
    # the sums live beside the last block's output (a GPU: cuda:1, or the main GPU running an
    # offloaded last block), as the run puts them
    (on,) = {p["device"] for p in plan["parts"]}
    assert on.startswith("cuda:") and set(plan["budget_bytes"]) == {on}
    if "cpu" not in plan["weights_bytes"]:
        assert on == "cuda:1"
    cov = 8 * D * D  # a d x d float64 sum; one batch partial of that size beside them, a side at a time
    assert (3 * cov <= plan["budget_bytes"][on]) == exact  # before and after the norm: both or none
    vectors, reservoir = 8 * D * 10, 4096 * (4 * D + 8)
    side = vectors + (cov if exact else 0) + reservoir
    partial = [cov] if exact else []
    assert [p["bytes"] for p in plan["parts"]] == [side, side, *partial]
    assert plan["accumulator_bytes"] == {on: 2 * side + sum(partial)}
    assert bool(plan["caps"]) == (not exact)


def test_checkpoints_plan_is_each_checkpoints_layer_plan(pythia, tmp_path, capsys):
    args = [
        "checkpoints",
        "--checkpoints",
        f"{pythia},{pythia}",
        "--device-map",
        "auto",
        "--max-memory",
        GPUS,
    ]
    plan = _plan(tmp_path, *args)
    assert plan["covariance_bytes"] == (BLOCKS + 1) * D * D * 8
    assert main(["experiment", *args, "--dry-run"]) == 0
    assert "each of its 2 checkpoints in turn holds this" in capsys.readouterr().out


def test_a_model_it_cannot_plan_is_one_sentence(capsys):
    assert main(["experiment", "gradients", "-m", "random:t5:d_model=32", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--dry-run plans text models whose config gives hidden_size" in err and "Traceback" not in err


def test_a_hub_series_says_the_disk_its_revisions_keep(tmp_path):
    """A series of hub revisions: each stays in the hub cache once downloaded (Pythia-12B's 154
    checkpoints: 154 x its weights); local folders and recorded steps take no new disk."""
    from isotui.experiments.series import Checkpoint
    from isotui.extract.memory_plan import MemoryPlan
    from isotui.service import _hub_disk

    plan = MemoryPlan([], {}, weights={"cuda:0": 20 * 10**9, "disk": 3 * 10**9})
    hub = [Checkpoint(f"EleutherAI/pythia-12b@step{s}", f"step{s}", s) for s in (1000, 2000, 3000)]
    said = _hub_disk(hub, plan)
    assert "the 3 hub revisions stay in the hub cache" in said
    assert "69.0 GB of disk (23.0 GB each" in said  # 3 x (20 + 3) GB, computed by hand
    (tmp_path / "checkpoint-10").mkdir()
    (tmp_path / "checkpoint-10" / "config.json").write_text("{}", encoding="utf-8")
    local = [Checkpoint(str(tmp_path / "checkpoint-10"), "checkpoint-10", 10)]
    recorded = [Checkpoint("EleutherAI/pythia-12b@step1", "step1", 1, recorded="KEY")]
    assert _hub_disk(local + recorded, plan) == ""
