"""A half-precision run measures what its half precision moved (issue 28, item 1): MiniLM in
bfloat16 on the CPU, against its own forward in bfloat16 and float32 computed independently
with transformers and numpy over all pairs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from isotui.experiments.layerwise import measure
from isotui.spec import make_spec

SAMPLES = 6


def _avg_cos(x: np.ndarray) -> float:
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    cos = u @ u.T
    n = len(u)
    return float((cos.sum() - np.trace(cos)) / (n * (n - 1)))


def _independent_avg_cos(dtype: str) -> list[float]:
    """Per layer, avg_cos of MiniLM's hidden states, one sample at a time, special tokens out."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from isotui.data.sources import load_samples, parse_data
    from isotui.models.naming import bundled_minilm_dir

    folder = str(bundled_minilm_dir())
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, torch_dtype=getattr(torch, dtype)).eval()
    per_layer: list[list[np.ndarray]] = []
    for text in load_samples(parse_data("builtin"), SAMPLES):
        enc = tok(text, truncation=True, max_length=512, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**enc, output_hidden_states=True).hidden_states
        for k, h in enumerate(hidden):
            if len(per_layer) <= k:
                per_layer.append([])
            per_layer[k].append(h[0, 1:-1].double().numpy())  # [CLS] and [SEP] left out
    return [_avg_cos(np.concatenate(xs)) for xs in per_layer]


@pytest.fixture(scope="module")
def half():
    return measure(make_spec("minilm", max_samples=SAMPLES, dtype="bfloat16", batch_size=1), None)


def test_bfloat16_run_reports_its_change_from_float32(half):
    check = half.meta["half_check"]
    assert check["dtype"] == "bfloat16" and check["samples"] == SAMPLES
    bf16, f32 = _independent_avg_cos("bfloat16"), _independent_avg_cos("float32")
    assert [r.avg_cos for r in half.rows] == pytest.approx(bf16, rel=1e-6)  # the run is bf16's forward
    want = max(abs(a - b) / abs(b) for a, b in zip(bf16, f32, strict=True))
    assert want > 1e-4  # half precision does move it
    assert check["max_rel_change"]["avg_cos"] == pytest.approx(want, rel=1e-3)
    changes = check["max_rel_change"]
    assert set(changes) >= {"avg_cos", "avg_cos_centered", "iw", "avg_cos_std", "isoscore"}
    assert all(math.isfinite(v) and v >= 0 for v in changes.values())
    (said,) = [n for n in half.meta["notes"] if n.startswith("bfloat16 forward")]
    worst = max(changes, key=changes.get)
    assert f"{worst} {changes[worst]:.2%}" in said and "--dtype float32" in said


def test_float32_run_has_no_check():
    result = measure(make_spec("minilm", max_samples=2, dtype="float32"), None)
    assert "half_check" not in result.meta
    assert not any("forward: on the first" in n for n in result.meta["notes"])


def test_the_float32_copy_is_not_loaded_where_it_cannot_fit(monkeypatch):
    """A 70B model in bf16 would be loaded again in float32 (280 GB): skipped, said, never tried."""
    from isotui.experiments import half_check as hc
    from isotui.extract import device as dev
    from isotui.spec import make_spec

    spec = make_spec("minilm", "builtin")
    monkeypatch.setattr(dev, "available_memory", lambda _d: 100 * 10**9)
    assert hc.too_large(spec, 10 * 10**9, "cpu") == ""  # 20 GB of float32 in 100 GB free
    said = hc.too_large(spec, 140 * 10**9, "cuda:0")
    assert "float32 weights (280.0 GB) would not fit in the 100.0 GB cuda:0 has free" in said
    check = hc.half_check(spec, "bfloat16", 500, 140 * 10**9, "cuda:0")
    assert check["skipped"] == said and "max_rel_change" not in check
    split = make_spec("minilm", "builtin", device_map="auto")
    assert "--device-map" in hc.too_large(split, 1, "cpu")
