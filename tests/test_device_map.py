"""--device-map / --max-memory (accelerate placement and offload) and --dry-run's memory plan.

Offload is checked on the CPU: a tiny max_memory sends some layers to disk, and the numbers are
those of a plain load (and of an independent numpy computation). The dry-run plans of pythia-12b
and Llama-3-70B are checked against byte counts computed here from their configs' formulas.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from isotui.cli import main
from isotui.errors import IsotuiError
from isotui.spec import make_spec

from .conftest import corpus
from .reference import hidden_vectors
from .test_plan_equal import _limit

GiB = 1 << 30


def _texts(tmp_path: Path, n: int = 12) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(corpus(n)) + "\n", encoding="utf-8")
    return path


def _wide_neox(tmp_path: Path) -> Path:
    """An untrained GPT-NeoX of d = 256 (4 blocks of 3.1 MB, 1 MB matrices) with the tests' BPE
    tokenizer: tensors large enough that offloading them saves memory (the loader maps 64 KiB of
    each tensor it leaves on disk, issue 24), unlike the tiny models' of a few kB."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXModel

    from .conftest import _bpe_tokenizer

    folder = tmp_path / "neox"
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=600,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=128,
    )
    GPTNeoXModel(config).save_pretrained(folder)
    _bpe_tokenizer(folder)
    return folder


def test_disk_offload_gives_the_numbers_of_a_plain_load(tmp_path):
    from isotui.experiments.layer_pass import load_prepared, prepare
    from isotui.experiments.layerwise import measure

    folder, data = _wide_neox(tmp_path), f"text:{_texts(tmp_path)}"
    # --max-memory bounds isotui's sums too (issue 24): 9 MB for weights beyond what isotui
    # keeps for its sums at their floor and a batch, of 13 MB; the one-process run made under
    # the plan the split run records is the plain load to compare with (batches of 4 samples)
    limit = _limit(folder, ["--batch-size", "4"], 9e6)
    split = make_spec(
        str(folder), data, max_length=64, device_map="auto", max_memory=f"cpu={limit}", batch_size=4
    )
    plain = make_spec(str(folder), data, max_length=64, device="cpu", batch_size=4)
    assert prepare(split).key == prepare(plain).key  # where the model sits is not what is measured
    loaded, device = load_prepared(prepare(split))
    placed = set(map(str, loaded.device_map.values()))
    assert {"cpu", "disk"} <= placed and device == "cpu"  # some layers really went to disk
    b = measure(split, None)
    a = _measured_under(plain, b.meta["memory_plan"])
    assert any("--device-map auto" in n for n in b.meta["notes"])
    assert any(n.startswith("memory plan") for n in b.meta["notes"])
    xs, _labels = hidden_vectors(folder, corpus(12), max_length=64)
    for ra, rb, x in zip(a.rows, b.rows, xs, strict=True):
        assert rb.avg_cos == pytest.approx(ra.avg_cos, rel=1e-10)
        assert rb.isoscore == pytest.approx(ra.isoscore, rel=1e-10)
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        n = len(u)
        ref = (np.square(u.sum(0)).sum() - n) / (n * (n - 1))  # mean cosine over distinct pairs
        assert rb.avg_cos == pytest.approx(ref, rel=1e-6)  # float32 forward vs the reference's


def _measured_under(spec, recorded: dict):
    """``spec`` measured in one process following the plan ``recorded`` (as a later shard of a
    run follows its first shard's plan)."""
    from dataclasses import replace

    from isotui.experiments import layer_pass, layerwise
    from isotui.extract.memory_plan import MemoryPlan

    plan = MemoryPlan.from_json(recorded)
    options = layer_pass.extract_options

    def following(spec_, *rest):
        return replace(options(spec_, *rest), settle_plan=lambda own: plan.follow(own, "the plain run", "-"))

    layer_pass.extract_options = following
    try:
        return layerwise.measure(spec, None)
    finally:
        layer_pass.extract_options = options


def _config(tmp_path: Path, name: str, config: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


PYTHIA_12B = {
    "architectures": ["GPTNeoXForCausalLM"],
    "model_type": "gpt_neox",
    "hidden_size": 5120,
    "num_hidden_layers": 36,
    "num_attention_heads": 40,
    "intermediate_size": 20480,
    "vocab_size": 50688,
    "max_position_embeddings": 2048,
    "rotary_pct": 0.25,
    "use_parallel_residual": True,
    "tie_word_embeddings": False,
    "dtype": "float16",
}
LLAMA_3_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}


def _neox_params(d: int, layers: int, inter: int, vocab: int) -> int:
    """GPTNeoXModel: embeddings; per block two LayerNorms, fused QKV, output, two MLP linears
    (all with biases); the final LayerNorm."""
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * inter + inter) + (inter * d + d)
    return vocab * d + layers * block + 2 * d


def _llama_params(d: int, layers: int, heads: int, kv: int, inter: int, vocab: int) -> int:
    """LlamaModel: embeddings; per block q, k, v, o (grouped k and v), gate, up, down, two
    RMSNorms (no biases); the final RMSNorm."""
    head = d // heads
    block = d * d + 2 * d * kv * head + d * d + 3 * d * inter + 2 * d
    return vocab * d + layers * block + d


def _dry(folder: Path, tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "plan.json"
    assert main(["run", "--model", str(folder), "--dry-run", "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())[str(folder)]


def test_dry_run_plans_pythia_12b_from_its_config(tmp_path, capsys):
    folder = _config(tmp_path, "pythia-12b", PYTHIA_12B)
    plan = _dry(folder, tmp_path, "--device-map", "auto", "--max-memory", "0=80GB,1=80GB")
    d, n = 5120, 37  # 36 blocks and the embeddings
    assert len(plan["layers"]) == n and {p["dim"] for p in plan["layers"]} == {d}
    assert plan["covariance_bytes"] == n * d * d * 8  # every layer exact: 7.76 GB over two GPUs
    assert sum(plan["weights_bytes"].values()) == _neox_params(d, 36, 20480, 50688) * 2  # float16
    assert set(plan["weights_bytes"]) == {"cuda:0", "cuda:1"}
    # the covariance sum, reservoir and 10 float64 d-vectors; one layer's batch partial at a time
    # (committed before the next layer's is made), not one beside every covariance
    types = 1000  # tracked token types: all of SELF_SIM_TYPES fit two 80 GB GPUs' measured room
    fixed = 8 * d * 10 + types * (8 * d + 24)  # and their self-similarity sums
    per_layer = 8 * d * d + 4096 * (4 * d + 8) + fixed
    for p in plan["layers"]:
        assert p["bytes"] == per_layer and p["exact_cov"] and p["reservoir"] == 4096
    partial = 8 * d * d  # the batch's float64 d x d sum
    assert plan["batch_partial_bytes"] == {"cuda:0": partial, "cuda:1": partial}
    for device, used in plan["accumulator_bytes"].items():
        mine = sum(p["device"] == device for p in plan["layers"])
        assert used == mine * per_layer + partial
    # a batch's fold (~50 bytes a token per dimension with tracked types) beside 19 hidden states
    # of each GPU halves the 32,768-token budget once
    assert plan["batch_tokens"] == 16_384 and "32 samples of 512 tokens" in plan["batch"]
    main(
        ["run", "--model", str(folder), "--dry-run", "--device-map", "auto", "--max-memory", "0=80GB,1=80GB"]
    )
    printed = capsys.readouterr().out
    assert "memory plan" in printed and "layer 36" in printed and "cuda:1" in printed


@pytest.mark.parametrize(("gpus", "exact"), [(1, None), (4, 81), (8, 81)])
def test_dry_run_plans_llama_3_70b_on_80gb_gpus(tmp_path, gpus, exact):
    folder = _config(tmp_path, f"llama-70b-{gpus}", LLAMA_3_70B)
    memory = ",".join(f"{i}=80GB" for i in range(gpus))
    plan = _dry(folder, tmp_path, "--device-map", "auto", "--max-memory", memory)
    d, n = 8192, 81
    params = _llama_params(d, 80, 64, 8, 28672, 128256)
    assert sum(plan["weights_bytes"].values()) == params * 2  # bfloat16, 70.6e9 parameters
    assert len(plan["layers"]) == n
    held = sum(p["exact_cov"] for p in plan["layers"])
    # one GPU: --max-memory keeps room for the sums' floor and a batch before the weights are
    # placed, so what covariances fit depends on where the batch settles (asserted within budget)
    assert held == exact or exact is None
    assert plan["covariance_bytes"] == held * d * d * 8  # 8 x 80 GB: 81 x 8192^2 x 8 = 43.5 GB
    if held:  # one batch partial per device, not one per layer (that was 43.5 GB more)
        devices = {p["device"] for p in plan["layers"] if p["exact_cov"]}
        assert plan["batch_partial_bytes"] == dict.fromkeys(devices, 8 * d * d)  # 537 MB each
    for device, used in plan["accumulator_bytes"].items():  # each device within what it has left
        budget = plan["budget_bytes"][device]
        assert used <= budget or all(p["reservoir"] == 2 for p in plan["layers"] if p["device"] == device)
    if gpus == 1:  # 141 GB of weights on one 80 GB GPU: the rest on disk, no room left for sums
        assert "disk" in plan["weights_bytes"]
        assert all(p["reservoir"] < 4096 for p in plan["layers"])
    if gpus == 4:  # 32,768 tokens of 20 hidden states each beside 36 GB of weights: over a quarter
        assert "expected to halve" in plan["batch"]


def test_bad_values_are_one_sentence_naming_the_flag(tiny_models, capsys):
    folder = str(tiny_models["gpt_neox"])
    cases = [
        (["--device-map", "auto", "--max-memory", "0=lots"], "max-memory must be"),
        (["--device-map", "auto", "--max-memory", "gpu=1GB"], "max-memory must be"),
        (["--device-map", "auto", "--max-memory", "3=1GB"], "--max-memory gives memory to GPU 3"),
        (["--max-memory", "4=1GB"], "--max-memory gives memory to GPU 4"),  # alone: --device-map auto
        (["--device", "cpu", "--device-map", "auto"], "--device cpu and --device-map auto both say"),
    ]
    for flags, said in cases:
        assert main(["run", "--model", folder, "--max-samples", "2", "--no-cache", *flags]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exc:  # argparse's choices: exit 2 naming the flag
        main(["run", "--model", folder, "--device-map", "everywhere"])
    assert exc.value.code == 2 and "--device-map" in capsys.readouterr().err


def test_max_memory_forms():
    from isotui.extract.memory_values import parse_max_memory

    assert parse_max_memory("0=70GiB,1=70GiB,cpu=200GiB") == (
        (0, 70 * GiB),
        (1, 70 * GiB),
        ("cpu", 200 * GiB),
    )
    assert parse_max_memory({"cuda:0": "1.5GB", "disk": 2048}) == ((0, 1_500_000_000), ("disk", 2048))
    with pytest.raises(IsotuiError, match="max-memory"):
        parse_max_memory("0:70GiB")


def test_plan_gives_exact_covariances_where_they_fit_and_reservoirs_what_is_left():
    from isotui.extract.memory_plan import plan_layers

    d, fixed = 64, 8 * 64 * 10  # ten float64 d-vectors per layer (no tracked types)
    cov = 8 * d * d  # the d x d float64 sum
    partial = 8 * d * d  # one batch's float64 d x d partial, one layer's at a time
    budget = 2 * fixed + partial + cov + 50 * 2 * (4 * d + 8)  # one covariance, 50 vectors each
    plans = plan_layers(
        [("layer 0", d, "cpu", 0), ("layer 1", d, "cpu", 0), ("layer 2", d, "x", 0)],
        {"cpu": budget, "x": None},
        4096,
    )
    assert [p.exact_cov for p in plans] == [True, False, True]  # "x": free memory unknown, nothing capped
    assert [p.reservoir for p in plans] == [50, 50, 4096]  # 50 vectors take less than a covariance
    assert sum(p.bytes for p in plans[:2]) + partial == budget


def test_a_run_takes_its_budget_from_measured_free_memory(tiny_models, tmp_path, monkeypatch):
    """Little free memory: covariances go, the reservoir shrinks, and what is exact stays exact."""
    import isotui.extract.memory_plan as memory_plan
    from isotui.experiments.layerwise import measure

    folder, data = tiny_models["gpt_neox"], f"text:{_texts(tmp_path)}"
    spec = make_spec(str(folder), data, max_length=64, device="cpu")
    plenty = measure(spec, None)
    monkeypatch.setattr(memory_plan, "available_memory", lambda _device: memory_plan.MARGIN_MIN + 60_000)
    tight = measure(spec, None)
    said = " ".join(tight.meta["notes"])
    assert "exact covariance in 0 of 3 layers" in said and "memory left on their device" in said
    assert "exact covariance in 3 of 3 layers" in " ".join(plenty.meta["notes"])
    assert max(r.n_sample for r in tight.rows) < min(r.n_vectors for r in tight.rows)
    for a, b in zip(plenty.rows, tight.rows, strict=True):
        assert b.avg_cos == pytest.approx(a.avg_cos, rel=1e-10)  # streamed sums: never sampled


def test_hidden_states_are_not_gathered_to_the_input_device():
    """accelerate's top hook moves a split model's outputs to the input's device (all hidden
    states on one GPU); during isotui's forward it is off, and on again after, however it ends."""
    from types import SimpleNamespace

    from isotui.extract.forward import layers_stay

    gather, other = SimpleNamespace(io_same_device=True), SimpleNamespace(io_same_device=False)
    model = SimpleNamespace(_hf_hook=SimpleNamespace(hooks=[gather, other]))
    with pytest.raises(RuntimeError), layers_stay(model):
        assert gather.io_same_device is False
        raise RuntimeError("a failed forward")
    assert gather.io_same_device is True and other.io_same_device is False
