"""Budgets from measured free memory (issue 13): self-similarity's token types, the attention
probe's query/key subsample and the gradient sums shrink where a device has little free memory
and are what was asked where it has plenty. The free-memory measurement is patched (small and
large); every byte count is worked out here by hand from the sums' shapes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import isotui.extract.memory_plan as memory_plan
from isotui.errors import IsotuiError
from isotui.spec import make_spec

from .conftest import corpus
from .reference import hidden_vectors

MARGIN = memory_plan.MARGIN_MIN  # what a device with under ~2.5 GB free keeps back
PLENTY = 64 << 30


def _free(monkeypatch: pytest.MonkeyPatch, extra: int) -> None:
    """Every device has the margin plus ``extra`` bytes free (so its budget is ``extra``)."""
    monkeypatch.setattr(memory_plan, "available_memory", lambda _device: MARGIN + extra)


def _texts(tmp_path: Path, n: int = 12) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(corpus(n)) + "\n", encoding="utf-8")
    return f"text:{path}"


def test_fit_types_by_hand():
    d = 64
    vectors = 2 * 10 * 8 * d  # two layers' ten float64 d-vectors
    per_type = 2 * (8 * d + 24)  # a float64 d-vector and 24 bytes of counts, per layer
    layers = [(d, "cpu", True), (d, "cpu", True), (32, "x", False)]
    assert memory_plan.fit_types(layers, {"cpu": vectors + 37 * per_type + 500, "x": 10}, 1000) == 37
    assert memory_plan.fit_types(layers, {"cpu": vectors - 1, "x": 10}, 1000) == 0
    assert memory_plan.fit_types(layers, {"cpu": PLENTY, "x": 0}, 1000) == 1000  # x tracks none
    assert memory_plan.fit_types(layers, {"cpu": None}, 700) == 700  # free memory unknown: no cap


def test_exact_covariances_come_before_types_past_the_floor(monkeypatch):
    """Room for both covariances (and one batch partial) and 40 types beside them: 40 types,
    though 131 would fit without the covariances; with no room for them, the floor's 10 types."""
    d = 64
    vectors, per_type = 2 * 10 * 8 * d, 2 * (8 * d + 24)
    covariances = 3 * 8 * d * d  # two d x d float64 sums and the batch's partial
    monkeypatch.setattr(memory_plan, "SELF_SIM_FLOOR_BYTES", 10 * per_type)  # the floor: 10 types
    layers = [(d, "cpu", True), (d, "cpu", True)]
    floor = 2 * 16 * (4 * d + 8)  # the reservoirs' floor: 16 float32 vectors and keys per layer
    budget = vectors + covariances + floor + 40 * per_type + 7
    assert memory_plan.fit_types(layers, {"cpu": budget}, 1000, keep_vectors=16) == 40
    plans = memory_plan.plan_layers([("a", d, "cpu", 40), ("b", d, "cpu", 40)], {"cpu": budget}, 16)
    assert all(p.exact_cov for p in plans)
    assert (covariances + 40 * per_type + 7) // per_type == 131  # what types alone would take
    assert memory_plan.fit_types(layers, {"cpu": vectors + 50 * per_type}, 1000) == 10


def test_self_similarity_types_shrink_with_free_memory_and_stay_whole_with_plenty(
    tiny_models, tmp_path, monkeypatch
):
    from isotui.experiments.layerwise import measure

    folder = tiny_models["gpt_neox"]
    spec = make_spec(str(folder), _texts(tmp_path), max_length=64, device="cpu")
    _free(monkeypatch, PLENTY)
    plenty = measure(spec, None)
    plan = plenty.meta["memory_plan"]
    asked = plan["types_asked"]
    assert asked > 5 and all(p["types"] == asked for p in plan["layers"])  # every type asked
    assert not any("self-similarity follows" in n for n in plenty.meta["notes"])
    d, n = 32, 3  # hidden size, hidden states (embeddings and two blocks)
    floor = n * 16 * (4 * d + 8)  # the smallest reservoirs a plan may leave (16 float32 vectors + keys)
    budget = n * 10 * 8 * d + 5 * n * (8 * d + 24) + floor + 100  # the vectors, five types' sums
    _free(monkeypatch, budget)
    tight = measure(spec, None)
    plan = tight.meta["memory_plan"]
    assert [p["types"] for p in plan["layers"]] == [5] * n
    assert plan["types_asked"] == asked
    said = " ".join(tight.meta["notes"])
    assert f"self-similarity follows the 5 most frequent token types, not {asked:,}" in said
    assert all(r.self_sim_types <= 5 for r in tight.rows)
    assert all(r.self_sim_types > 5 for r in plenty.rows)
    xs, _labels = hidden_vectors(folder, corpus(12), max_length=64)
    for ra, rb, x in zip(plenty.rows, tight.rows, xs, strict=True):  # streamed sums: exact either way
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        m = len(u)
        ref = (np.square(u.sum(0)).sum() - m) / (m * (m - 1))  # mean cosine over distinct pairs
        assert ra.avg_cos == pytest.approx(ref, rel=1e-6)
        assert rb.avg_cos == pytest.approx(ra.avg_cos, rel=1e-10)


def test_attention_subsample_fits_the_cpus_free_memory(tiny_models, monkeypatch):
    from isotui.experiments.attention import measure_attention

    spec = make_spec(str(tiny_models["bert"]), "builtin", max_samples=12, max_length=16)
    _free(monkeypatch, PLENTY)
    whole = measure_attention(spec, None, sample_size=20)
    assert whole.arrays["q_sample.0"].shape == (4, 20, 8)  # 4 heads, 20 positions, head dim 8
    assert not any("subsample capped" in n for n in whole.meta.get("notes", []))
    per_position = 2 * 2 * 4 * 32  # two modules, queries and keys, float32, hidden size 32
    _free(monkeypatch, 7 * per_position + 100)
    capped = measure_attention(spec, None, sample_size=20)
    assert capped.arrays["q_sample.0"].shape == (4, 7, 8)
    assert any("capped at 7 positions per module (of 20 asked)" in n for n in capped.meta["notes"])


def test_attention_subsample_fits_each_modules_device(tiny_models, monkeypatch):
    """The subsample lives where each module makes its queries and keys: the budget is each of
    those devices' (here two, one module each, named by hand since this machine has no GPU),
    and one size fits all, the tightest device's."""
    from isotui.experiments.attention import measure_attention
    from isotui.extract import attention, attention_probe

    devices = iter(["cuda:0", "cuda:1"])  # the two blocks' attention modules, in order
    monkeypatch.setattr(attention_probe, "_module_device", lambda _module, _run: next(devices))
    asked: list[str] = []
    per_position = 2 * 4 * 32  # one module's queries and keys, float32, hidden size 32
    room = {"cuda:0": 12 * per_position + 50, "cuda:1": 9 * per_position + 50}

    def budget(device: str) -> int:
        asked.append(device)
        return room[device]

    monkeypatch.setattr(attention, "measured_budget", budget)
    spec = make_spec(str(tiny_models["bert"]), "builtin", max_samples=12, max_length=16)
    capped = measure_attention(spec, None, sample_size=20)
    assert sorted(asked) == ["cuda:0", "cuda:1"]
    assert capped.arrays["q_sample.0"].shape == capped.arrays["q_sample.1"].shape == (4, 9, 8)
    (note,) = [n for n in capped.meta["notes"] if "subsample capped" in n]
    assert "capped at 9 positions per module (of 20 asked)" in note and "cuda:1 has left" in note


def test_gradient_sums_need_room_on_their_device(tiny_models, tmp_path, monkeypatch):
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from isotui.experiments.gradients import measure_gradients

    folder = tmp_path / "gpt2lm"
    torch.manual_seed(1)
    config = GPT2Config(vocab_size=600, n_embd=32, n_layer=2, n_head=4, n_positions=128)
    GPT2LMHeadModel(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tiny_models["gpt2"])).save_pretrained(folder)
    spec = make_spec(str(folder), _texts(tmp_path, 6), max_length=24)
    d, n = 32, 3
    need = n * (2 * 8 * d * d + 6 * 8 * d)  # per layer g g^T and x x^T (float64) and six d-vectors
    _free(monkeypatch, need - 1)
    with pytest.raises(IsotuiError, match=r"needs 53\.8 kB on cpu for its per-layer d x d gradient sums"):
        measure_gradients(spec, top_k=4)
    assert need == 53_760  # 3 x (16,384 + 1,536)
    _free(monkeypatch, need)
    exact = measure_gradients(spec, top_k=4)
    _free(monkeypatch, PLENTY)
    plenty = measure_gradients(spec, top_k=4)
    assert [r.grad_avg_cos for r in plenty.rows] == [r.grad_avg_cos for r in exact.rows]
