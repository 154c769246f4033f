"""Extraction behaviour: out-of-memory back-off, cancellation, progress, lazy imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from isotui.errors import Cancelled
from isotui.experiments.layerwise import measure
from isotui.spec import make_spec
from isotui.store.cache import ResultCache

from .conftest import corpus


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(20)) + "\n", encoding="utf-8")
    return f"text:{path}"


def test_out_of_memory_halves_the_batch_and_says_so(tiny_models, data, monkeypatch):
    import torch
    from transformers import BertModel

    spec = make_spec(str(tiny_models["bert"]), data, batch_size=16)
    clean = measure(spec, None)
    original = BertModel.forward
    sizes = []

    def forward(self, input_ids=None, **kwargs):
        sizes.append(len(input_ids))
        if len(input_ids) > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(BertModel, "forward", forward)
    events = []
    result = measure(spec, None, on_progress=events.append)
    messages = [e.message for e in events if e.message]
    assert messages[0].startswith("out of memory on a batch of 16 x ")
    assert messages[0].endswith(" tokens; retrying with batches of 8")
    assert max(s for s in sizes[1:]) <= 8 and sizes.count(16) == 1  # later batches stay small
    for a, b in zip(clean.rows, result.rows, strict=True):
        assert b.n_vectors == a.n_vectors
        assert b.avg_cos == pytest.approx(a.avg_cos, rel=1e-6)
        assert b.isoscore == pytest.approx(a.isoscore, rel=1e-6)
    assert any("out of memory" in n for n in result.meta["notes"])


def test_cancel_between_batches_stores_nothing(tmp_path, tiny_models, data):
    cache = ResultCache(tmp_path / "c")
    seen = []

    def on_progress(ev):
        if ev.stage == "extract":  # the forward passes (not resolving, loading, tokenising)
            seen.append(ev.samples_done)

    with pytest.raises(Cancelled):
        measure(
            make_spec(str(tiny_models["bert"]), data, batch_size=4),
            cache,
            on_progress=on_progress,
            should_stop=lambda: len(seen) >= 3,
        )
    assert seen[-1] == 8  # two batches ran, then it stopped
    assert not cache.entries()


def test_progress_reports_samples_and_tokens(tiny_models, data):
    events = []
    measure(make_spec(str(tiny_models["gpt2"]), data, batch_size=6), None, on_progress=events.append)
    done = [e for e in events if e.stage == "extract"]
    assert [e.samples_done for e in done] == [0, 6, 12, 18, 20]
    assert done[-1].samples_total == 20 and done[-1].tokens_done > 20 and done[-1].tokens_per_s > 0


def test_importing_isotui_does_not_import_torch():
    code = (
        "import sys, isotui.cli, isotui.experiments.layerwise, isotui.store.cache; "
        "print(sorted(m for m in ('torch', 'transformers', 'scipy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
