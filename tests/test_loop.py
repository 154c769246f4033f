"""The engine loop's services for every experiment that streams a model: out-of-memory back-off
(halve the batch, retry, same numbers), memory in the progress events, and steps that fold a
batch wholly or not at all."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest

from isotui.spec import make_spec

from .conftest import corpus
from .test_gradients import MAX_LEN, TOP_K, check_against_reference, lm_models, reference  # noqa: F401

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


@pytest.fixture
def text_file(tmp_path):
    texts = corpus(9)
    path = tmp_path / "t.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return texts, f"text:{path}"


def _oom_on_first_call(monkeypatch, cls, sizes: list[int]) -> None:
    """``cls.forward`` records each batch's size and runs out of memory on its first call only."""
    import torch

    original = cls.forward

    def forward(self, *args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        sizes.append(len(ids))
        if len(sizes) == 1:
            raise torch.cuda.OutOfMemoryError(OOM)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, forward.__name__, forward)


def _check_back_off(events, sizes: list[int], batch: int, width_words: str = " tokens") -> None:
    messages = [e.message for e in events if e.message]
    assert len(messages) == 1 and messages[0].startswith(f"out of memory on a batch of {batch} x ")
    assert messages[0].endswith(f"{width_words}; retrying with batches of {batch // 2}")
    assert sizes[0] == batch and sizes[1] == batch // 2 and max(sizes[1:]) <= batch // 2
    running = [e for e in events if not e.message]
    assert running and all(e.memory_bytes > 0 for e in running)  # the loop reports memory in use
    assert running[-1].samples_done == running[-1].samples_total == 9


def _close(a: float, b: float) -> bool:
    """Equal up to the float32 forward pass, whose sums differ in the last bits with the padding
    of differently sized batches (as in test_extract's back-off test)."""
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-9)


def test_final_norm_backs_off_on_out_of_memory_with_the_same_numbers(tiny_models, text_file, monkeypatch):
    from dataclasses import fields

    from transformers import GPT2Model

    from isotui.experiments.final_norm import measure_final_norm

    _, data = text_file
    spec = make_spec(str(tiny_models["gpt2"]), data, max_length=40, batch_size=4)
    clean = measure_final_norm(spec)
    sizes: list[int] = []
    _oom_on_first_call(monkeypatch, GPT2Model, sizes)
    events: list = []
    backed = measure_final_norm(spec, on_progress=events.append)
    _check_back_off(events, sizes, 4)
    assert backed.meta["n_samples"] == clean.meta["n_samples"] == 9
    for side in ("before", "after"):
        a, b = getattr(clean, side), getattr(backed, side)
        assert a.n_vectors == b.n_vectors > 9
        for f in fields(a):
            va, vb = getattr(a, f.name), getattr(b, f.name)
            if isinstance(va, float):
                assert _close(va, vb), f"{side} {f.name}: {va} != {vb}"
        np.testing.assert_allclose(b.mean, a.mean, rtol=1e-6, atol=1e-9)
    for da, db in zip(clean.dims, backed.dims, strict=True):
        assert _close(da.share_before, db.share_before) and _close(da.mean_before, db.mean_before)


@pytest.mark.parametrize("name, objective", [("gpt2", "causal"), ("bert", "masked")])
def test_gradients_back_off_on_out_of_memory_and_match_autograd(
    lm_models,  # noqa: F811
    text_file,
    monkeypatch,
    name,
    objective,
):
    from transformers import BertModel, GPT2Model

    from isotui.experiments.gradients import measure_gradients

    texts, data = text_file
    xs, gs = reference(lm_models[name], texts, objective)
    sizes: list[int] = []
    _oom_on_first_call(monkeypatch, GPT2Model if name == "gpt2" else BertModel, sizes)
    events: list = []
    spec = make_spec(str(lm_models[name]), data, max_length=MAX_LEN, batch_size=4)
    result = measure_gradients(spec, top_k=TOP_K, on_progress=events.append)
    _check_back_off(events, sizes, 4)
    check_against_reference(result, xs, gs)  # one sample at a time, by autograd, in the test


@pytest.mark.parametrize("name, objective", [("gpt2", "causal"), ("bert", "masked")])
def test_gradients_out_of_memory_while_folding_backs_off_and_counts_each_sample_once(
    lm_models,  # noqa: F811
    text_file,
    monkeypatch,
    name,
    objective,
):
    """Out of memory in the first batch's second layer's sums, after the first layer committed
    that batch: the halves skip the first layer (the ledger) and fold the rest, and the loss is
    added once per sample; every number as autograd's, one sample at a time."""
    import torch

    from isotui.core.gradients import GradAccumulator
    from isotui.experiments.gradients import measure_gradients

    texts, data = text_file
    xs, gs = reference(lm_models[name], texts, objective)
    original = GradAccumulator.partial
    calls: list[int] = []

    def partial(self, x, g):
        calls.append(len(x))
        if len(calls) == 2:  # the first batch's second layer: the first layer holds the batch
            raise torch.cuda.OutOfMemoryError(OOM)
        return original(self, x, g)

    monkeypatch.setattr(GradAccumulator, "partial", partial)
    spec = make_spec(str(lm_models[name]), data, max_length=MAX_LEN, batch_size=4)
    result = measure_gradients(spec, top_k=TOP_K)
    check_against_reference(result, xs, gs)  # no token counted twice nor lost, at every layer
    # the halves of the first batch fold layers 1 and 2 (of 3) only: layer 0 holds the batch
    first, half, other = calls[1], calls[2:4], calls[4:6]
    assert calls[0] == first and half[0] == half[1] and other[0] == other[1]
    assert half[0] + other[0] == first and 0 < half[0] < first
    monkeypatch.setattr(GradAccumulator, "partial", original)
    clean = measure_gradients(spec, top_k=TOP_K)
    assert result.meta["loss_tokens"] == clean.meta["loss_tokens"]
    assert result.meta["loss_per_token"] == pytest.approx(clean.meta["loss_per_token"], rel=1e-5)


def _oom_on_second_sums(monkeypatch, cls) -> None:
    """``cls()`` runs out of memory once, making the first batch's second layer's sums."""
    import torch

    original = cls.__init__
    made: list[int] = []

    def init(self, *args, **kwargs):
        made.append(1)
        if len(made) == 2:
            raise torch.cuda.OutOfMemoryError(OOM)
        original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", init)


def test_out_of_memory_making_the_first_sums_starts_the_batch_again(tiny_models, text_file, monkeypatch):
    """Out of memory while the first batch makes its layers' sums (the second of them): the
    halves start the first batch over, sums and all, and the numbers are a clean run's."""
    from isotui.core.accumulator import LayerAccumulator
    from isotui.experiments.final_norm import measure_final_norm

    _, data = text_file
    spec = make_spec(str(tiny_models["bert"]), data, max_length=40, batch_size=4)
    clean = measure_final_norm(spec)
    _oom_on_second_sums(monkeypatch, LayerAccumulator)
    backed = measure_final_norm(spec)
    for side in ("before", "after"):
        a, b = getattr(clean, side), getattr(backed, side)
        assert a.n_vectors == b.n_vectors > 9
        assert _close(a.avg_cos, b.avg_cos) and _close(a.drift_norm, b.drift_norm)


@pytest.mark.parametrize("name, objective", [("gpt2", "causal"), ("bert", "masked")])
def test_gradients_out_of_memory_making_the_first_sums_starts_over(
    lm_models,  # noqa: F811
    text_file,
    monkeypatch,
    name,
    objective,
):
    """Out of memory while the first batch makes the second layer's gradient sums: the halves
    make every layer's sums again (none left from the failed try), every number autograd's."""
    from isotui.core.gradients import GradAccumulator
    from isotui.experiments.gradients import measure_gradients

    texts, data = text_file
    xs, gs = reference(lm_models[name], texts, objective)
    _oom_on_second_sums(monkeypatch, GradAccumulator)
    spec = make_spec(str(lm_models[name]), data, max_length=MAX_LEN, batch_size=4)
    check_against_reference(measure_gradients(spec, top_k=TOP_K), xs, gs)


def test_attention_probe_undoes_a_batch_the_model_did_not_finish(tiny_models, text_file, monkeypatch):
    """Out of memory in the second attention module: the first had folded the batch already;
    the retry must not count it twice."""
    import torch

    from isotui.core.attention import AttentionAccumulator
    from isotui.experiments.layer_pass import extract_options, load_prepared, prepare
    from isotui.extract.attention import extract_attention_state

    _, data = text_file
    spec = make_spec(str(tiny_models["bert"]), data, max_length=24, batch_size=4)
    prepared = prepare(spec)
    loaded, device = load_prepared(prepared)

    def state(on_progress) -> dict:
        return extract_attention_state(
            loaded,
            prepared.samples,
            device=device,
            opts=extract_options(spec),
            on_progress=on_progress,
            should_stop=lambda: False,
            model_name=spec.model,
            modality="text",
            sample_size=20,
        )

    clean = state(lambda _e: None)
    original = AttentionAccumulator.add
    calls: list[int] = []

    def add(self, q, *args, **kwargs):
        calls.append(len(q))
        if len(calls) == 2:  # the first batch, its second module: the first one has folded it
            raise torch.cuda.OutOfMemoryError(OOM)
        return original(self, q, *args, **kwargs)

    monkeypatch.setattr(AttentionAccumulator, "add", add)
    events: list = []
    backed = state(events.append)
    assert next(e.message for e in events if e.message).endswith("retrying with batches of 2")
    assert calls[0] == 4 and calls[2] == 2
    assert backed["n_tokens"] == clean["n_tokens"]
    for ma, mb in zip(clean["modules"], backed["modules"], strict=True):
        for key, a in ma["acc"].items():
            b = mb["acc"][key]
            if not isinstance(a, torch.Tensor):
                assert a == b
            elif key.endswith(("n", "hist", "min", "max", "n_nonzero")):
                assert torch.equal(a, b), f"{ma['site']['name']} {key}"
            else:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
        for part in ("q_sample", "k_sample"):
            assert torch.equal(ma[part]["keys"].sort().values, mb[part]["keys"].sort().values)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_attention_out_of_memory_mid_batch_counts_each_sample_once_per_module(
    tiny_models, text_file, monkeypatch, name
):
    """Out of memory in the second attention module of the first batch, on the layer stream's
    pass: the first module committed the whole batch and skips the retried halves, the second
    folds the halves; every module sees each sample once and the result is a clean run's."""
    import dataclasses

    import torch
    from transformers.models.bert.modeling_bert import BertSelfAttention
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    from isotui.experiments.attention import measure_attention
    from isotui.extract import attention

    _, data = text_file
    spec = make_spec(str(tiny_models[name]), data, max_length=24, batch_size=4)
    clean = measure_attention(spec, None, sample_size=16)
    folded: list[tuple[int, int]] = []  # (layer, samples) per fold
    partial = attention._ModuleFold.partial
    monkeypatch.setattr(
        attention._ModuleFold,
        "partial",
        lambda self, view: folded.append((self.site.layer, len(view.q))) or partial(self, view),
    )
    cls = GPT2Attention if name == "gpt2" else BertSelfAttention
    forward, calls = cls.forward, [0]

    def failing(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:  # the first batch, its second module: the first one has folded it
            raise torch.cuda.OutOfMemoryError(OOM)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", failing)
    events: list = []
    backed = measure_attention(spec, None, sample_size=16, on_progress=events.append)
    assert next(e.message for e in events if e.message).endswith("retrying with batches of 2")
    assert folded[:3] == [(1, 4), (2, 2), (2, 2)]  # the halves skip layer 1, which has the batch
    assert [sum(n for layer, n in folded if layer == i) for i in (1, 2)] == [9, 9]
    assert backed.meta["n_tokens"] == clean.meta["n_tokens"]
    assert len(backed.rows) == len(clean.rows) == 8
    for a, b in zip(clean.rows, backed.rows, strict=True):
        for f in dataclasses.fields(a):
            va, vb = getattr(a, f.name), getattr(b, f.name)
            assert _close(va, vb) if isinstance(va, float) else va == vb, f"{a.layer} {a.head} {f.name}"
    assert clean.arrays.keys() == backed.arrays.keys()
    for key, a in clean.arrays.items():
        if key.startswith("hist"):
            np.testing.assert_array_equal(a, backed.arrays[key])
        else:  # the subsamples: the same tokens (keys are global), whatever the batching
            np.testing.assert_allclose(a, backed.arrays[key], rtol=1e-6, atol=1e-9)


def test_nothing_outside_the_engine_imports_its_private_names():
    """Experiments, front ends, benchmarks and scripts use the loop's public API only."""
    root = Path(__file__).resolve().parents[1]
    files = [*root.glob("isotui/**/*.py"), *root.glob("benchmarks/*.py"), *root.glob("scripts/*.py")]
    offenders = []
    for path in files:
        if path.relative_to(root).parts[:2] == ("isotui", "extract"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("isotui.extract"):
                offenders += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert len(files) > 50 and not offenders
