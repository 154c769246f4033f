"""Layers folded one by one (issues 13 and 15): each layer's batch sums committed as soon as they
are made, exact under out-of-memory back-off (a retried half skips the layers that already folded
it), and hidden states read in hooks on the blocks as the model makes them, to the bit what
``output_hidden_states`` returns, for every family the tests cover."""

from __future__ import annotations

import gc
import math
import weakref
from dataclasses import asdict

import numpy as np
import pytest

from isotui.experiments.layerwise import measure
from isotui.spec import make_spec

from .conftest import corpus
from .reference import hidden_vectors
from .test_plan_equal import _limit

BERT = "random:bert:num_hidden_layers=4,hidden_size=32,num_attention_heads=4,intermediate_size=64"
FAMILIES = {
    "bert": (BERT, "builtin"),
    "gpt2": ("random:gpt2:n_layer=2,n_embd=32,n_head=4", "builtin"),
    "gpt_neox": (
        "random:gpt_neox:hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64",
        "builtin",
    ),
    "llama": (
        "random:llama:hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64,"
        "num_key_value_heads=2",
        "builtin",
    ),
    "t5": ("random:t5:d_model=32,d_ff=64,num_layers=2,num_heads=2,d_kv=16", "builtin"),
    "bart": (
        "random:bart:d_model=32,encoder_layers=2,decoder_layers=2,encoder_attention_heads=4,"
        "decoder_attention_heads=4,encoder_ffn_dim=64,decoder_ffn_dim=64",
        "builtin",
    ),
    "vit": (
        "random:vit:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,"
        "image_size=32,patch_size=8",
        "synthetic:images",
    ),
}


def _same_rows(a, b, rel: float = 0.0) -> None:
    """Every field of every layer row equal (NaN equals NaN), floats to ``rel`` relative."""
    assert len(a.rows) == len(b.rows)
    for ra, rb in zip(a.rows, b.rows, strict=True):
        for name, va in asdict(ra).items():
            vb = asdict(rb)[name]
            if isinstance(va, float) and math.isnan(va):
                assert math.isnan(vb), name
            elif isinstance(va, float):
                assert vb == pytest.approx(va, rel=rel, abs=0.0), name
            else:
                assert va == vb, name


def _plain(monkeypatch) -> None:
    """No block sites: every batch through ``output_hidden_states``, as before hooks."""
    from isotui.extract import runner

    monkeypatch.setattr(runner, "block_sites", lambda loaded: {})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hooked_layers_give_the_numbers_of_output_hidden_states(family, monkeypatch):
    from isotui.extract import runner

    name, data = FAMILIES[family]
    spec = make_spec(name, data, max_samples=12, batch_size=4)
    agreed: list[bool] = []
    original = runner.LayerStream._hooks_agree

    def hooks_agree(self, *args):
        sites = original(self, *args)
        agreed.append(sites is not None)
        return sites

    folds: list[str] = []
    hooked_forward = runner.LayerStream._hooked_forward

    def counted(self, batch, index):
        folds.append("hooked")
        return hooked_forward(self, batch, index)

    monkeypatch.setattr(runner.LayerStream, "_hooks_agree", hooks_agree)
    monkeypatch.setattr(runner.LayerStream, "_hooked_forward", counted)
    hooked = measure(spec, None)
    assert agreed == [True] and folds == ["hooked", "hooked"]  # batches 2 and 3 ran hooked
    monkeypatch.undo()
    _plain(monkeypatch)
    plain = measure(spec, None)
    _same_rows(hooked, plain)  # to the bit


def test_blocks_that_do_not_give_the_hidden_states_keep_output_hidden_states(monkeypatch):
    from isotui.extract import forward, runner

    spec = make_spec(FAMILIES["gpt2"][0], "builtin", max_samples=12, batch_size=4)
    sites = forward.block_sites
    monkeypatch.setattr(runner, "block_sites", lambda loaded: {c: b[::-1] for c, b in sites(loaded).items()})
    monkeypatch.setattr(runner.LayerStream, "_hooked_forward", lambda *a: pytest.fail("ran hooked"))
    wrong = measure(spec, None)
    assert any("output_hidden_states" in n for n in wrong.meta["notes"])
    monkeypatch.undo()
    _plain(monkeypatch)
    _same_rows(wrong, measure(spec, None))


def _oom_once_at(monkeypatch, call: int) -> list[int]:
    """``LayerAccumulator.partial`` runs out of memory on its ``call``-th call only."""
    from isotui.core.accumulator import LayerAccumulator

    original = LayerAccumulator.partial
    calls: list[int] = []

    def partial(self, x, *args, **kwargs):
        calls.append(len(x))
        if len(calls) == call:
            raise RuntimeError("CPU out of memory (injected)")
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(LayerAccumulator, "partial", partial)
    return calls


@pytest.fixture
def float64_grams():
    """Batch grams in float64 (the float32 product rounds differently for differently split
    batches, which a back-off makes; in float64 a split changes the sums by ~1e-16)."""
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("hooked", [True, False])
def test_out_of_memory_at_a_middle_layer_counts_nothing_twice(
    tiny_models, tmp_path, monkeypatch, float64_grams, hooked
):
    texts = corpus(16)
    path = tmp_path / "t.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    # 12 tokens each (every line is longer): batches of any size run the same rows, no padding
    spec = make_spec(str(tiny_models["bert"]), f"text:{path}", batch_size=4, max_length=12)
    if not hooked:
        _plain(monkeypatch)
    clean = measure(spec, None)
    # 3 layers a batch: the 5th call is the second batch's middle layer (layer 0 committed)
    calls = _oom_once_at(monkeypatch, 5)
    backed = measure(spec, None)
    assert any("out of memory on a batch of 4 x 12 tokens" in n for n in backed.meta["notes"])
    # batch 1 (3 layers), batch 2's layer 0 and the failed layer 1, each half's layers 1 and 2
    # only (layer 0 already has them), then 8 samples in batches of 2
    assert len(calls) == 3 + 2 + 2 * 2 + 4 * 3
    _same_rows(backed, clean, rel=1e-12)
    # and the sums against numpy over all pairs of the vectors of a plain one-sample loop
    xs, _labels = hidden_vectors(tiny_models["bert"], texts, max_length=12)
    for row, x in zip(backed.rows, xs, strict=True):
        assert row.n_vectors == len(x) == 16 * 10
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        g = u @ u.T
        pairs = g[~np.eye(len(x), dtype=bool)].mean()
        assert row.avg_cos == pytest.approx(pairs, rel=1e-5)
        assert row.mean_norm == pytest.approx(np.linalg.norm(x, axis=1).mean(), rel=1e-5)


@pytest.mark.slow
def test_one_layer_of_batch_sums_lives_at_a_time(monkeypatch):
    """The d x d batch grams (and every other batch sum) of one layer at a time, not of all L:
    a layer's sums are committed and freed before the next layer's are made. And after the
    first batch, the hidden states are read in hooks: at most the current layer's and its
    block's input are alive when a layer is folded (and the embeddings' output, which BERT's
    forward holds to its end), not all L + 1."""
    import torch

    from isotui.core.accumulator import LayerAccumulator
    from isotui.extract import runner

    grams: list[weakref.ref] = []
    alive_grams: list[int] = []
    original = LayerAccumulator.partial

    def partial(self, *args, **kwargs):
        alive_grams.append(sum(r() is not None for r in grams))
        out = original(self, *args, **kwargs)
        assert out["gram"] is not None  # full covariance: d = 32
        grams.append(weakref.ref(out["gram"]))
        return out

    states: list[tuple[int, list[weakref.ref]]] = []
    alive_states: list[int] = []
    fold = runner.LayerStream._fold

    def watched(self, batch, index, component, i, h):
        if not states or states[-1][0] != id(batch):
            states.append((id(batch), []))
        # layer 0 left out: BERT's forward keeps its embedding output to the end, whatever reads it;
        # what only a reference cycle holds is collected first (after other tests, some can hang on)
        gc.collect()
        alive_states.append(sum(r() is not None for r in states[-1][1][1:]))
        states[-1][1].append(weakref.ref(h))
        return fold(self, batch, index, component, i, h)

    monkeypatch.setattr(LayerAccumulator, "partial", partial)
    monkeypatch.setattr(runner.LayerStream, "_fold", watched)
    with torch.inference_mode(False):
        measure(make_spec(BERT, "builtin", max_samples=12, batch_size=4), None)
    assert len(alive_grams) == 3 * 5 and max(alive_grams) == 0  # 5 layers, none held over
    first, later = alive_states[:5], alive_states[5:]
    assert first == [0, 0, 1, 2, 3]  # the first batch: output_hidden_states holds them all
    # hooked: the block's input, and now and then (1 run in 6 alone on the oldest versions, cause
    # not found) one more state not yet released; never the layers piling up (all L would be 4)
    assert len(later) == 2 * 5 and max(later) <= 2


def test_final_norm_out_of_memory_between_its_two_sides_counts_nothing_twice(
    tiny_models, tmp_path, monkeypatch, float64_grams
):
    from dataclasses import fields

    from isotui.experiments.final_norm import measure_final_norm

    path = tmp_path / "t.txt"
    path.write_text("\n".join(corpus(16)) + "\n", encoding="utf-8")
    spec = make_spec(str(tiny_models["gpt2"]), f"text:{path}", batch_size=4, max_length=12)
    clean = measure_final_norm(spec)
    calls = _oom_once_at(monkeypatch, 4)  # the second batch's "after" side ("before" committed)
    backed = measure_final_norm(spec)
    assert len(calls) == 2 + 2 + 2 * 1 + 4 * 2  # each half: the "after" side only
    for side in ("before", "after"):
        a, b = getattr(clean, side), getattr(backed, side)
        assert a.n_vectors == b.n_vectors == 16 * 12
        for f in fields(a):
            va, vb = getattr(a, f.name), getattr(b, f.name)
            if isinstance(va, float) and not math.isnan(va):
                assert vb == pytest.approx(va, rel=1e-12, abs=0.0), f"{side} {f.name}"


def test_hooked_layers_under_a_device_map_with_disk_offload(tiny_models, tmp_path, monkeypatch):
    """accelerate's hooks move each block's inputs and weights; the layers' hooks still see each
    hidden state where its block ran, the same tensors as output_hidden_states."""
    from isotui.extract import runner

    path = tmp_path / "t.txt"
    path.write_text("\n".join(corpus(12)) + "\n", encoding="utf-8")
    folder = tiny_models["gpt_neox"]
    limit = _limit(folder, ["--batch-size", "4"], 130e3)  # 130 kB for weights beside isotui's own
    spec = make_spec(
        str(folder), f"text:{path}", max_length=64, batch_size=4, device_map="auto", max_memory=f"cpu={limit}"
    )
    ran: list[int] = []
    hooked_forward = runner.LayerStream._hooked_forward
    monkeypatch.setattr(
        runner.LayerStream, "_hooked_forward", lambda self, b, i: ran.append(1) or hooked_forward(self, b, i)
    )
    hooked = measure(spec, None)
    assert len(ran) == 2 and not any("output_hidden_states" in n for n in hooked.meta["notes"])
    monkeypatch.undo()
    _plain(monkeypatch)
    _same_rows(hooked, measure(spec, None))


def test_exact_second_pass_folds_in_hooks_to_the_same_numbers(monkeypatch):
    from isotui.extract import runner

    spec = make_spec(FAMILIES["gpt2"][0], "builtin", max_samples=12, batch_size=4, reservoir=16, exact=True)
    ran: list[int] = []
    hooked_forward = runner.LayerStream._hooked_forward
    monkeypatch.setattr(
        runner.LayerStream, "_hooked_forward", lambda self, b, i: ran.append(1) or hooked_forward(self, b, i)
    )
    hooked = measure(spec, None)
    assert len(ran) == 2 + 3  # the first pass's later batches, and every batch of the second
    assert any(n.startswith("--exact:") for n in hooked.meta["notes"])
    monkeypatch.undo()
    _plain(monkeypatch)
    _same_rows(hooked, measure(spec, None))
