"""Finalisation on the device (issue 26 item 5): the layers' eigendecompositions batched, with
out-of-memory back-off (halve the batch, then the CPU, said in one note), and the time left from
the rate of the first layer. The GPU's batched path is traced on the CPU (``BATCH_ON_CPU``);
the numbers are checked against float64 numpy and against the one-layer path."""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
import pytest

from isotui.extract import finalise
from isotui.extract.progress import Progress

D = 48


def _accs(n_layers: int = 5, d: int = D, n: int = 600, reservoir: int = 64):
    """Accumulators of shifted anisotropic vectors (a different cloud per layer), the d x d sums
    held and the reservoir smaller than the data (the spectrum comes from the sums); and the data."""
    import torch

    from isotui.core.accumulator import LayerAccumulator, sample_keys

    rng = np.random.default_rng(4)
    accs, data = [], []
    for layer in range(n_layers):
        mix = rng.normal(size=(d, d)) * np.exp(-np.arange(d) / (d / (4 + layer)))[:, None]
        x = (rng.normal(size=(n, d)) @ mix + 20.0 + layer).astype(np.float32)
        acc = LayerAccumulator(d, torch.device("cpu"), full_cov=True, reservoir=reservoir)
        for start in range(0, n, 150):
            b = torch.from_numpy(x[start : start + 150])
            ids = torch.arange(len(b)) // 10
            keys = sample_keys(layer, ids + start, torch.arange(len(b)))
            acc.commit(acc.partial(b, ids, keys, None, None, int(ids.max()) + 1))
        accs.append(acc)
        data.append(x.astype(np.float64))
    return accs, data


def _same(a, b, rel: float = 1e-9) -> None:
    for key, value in asdict(a).items():
        other = asdict(b)[key]
        if isinstance(value, float) and math.isfinite(value):
            assert other == pytest.approx(value, rel=rel, abs=1e-300), key
        elif isinstance(value, np.ndarray):
            np.testing.assert_allclose(other, value, rtol=rel, atol=1e-12 * np.abs(value).max(), err_msg=key)


@pytest.fixture
def batched(monkeypatch):
    monkeypatch.setattr(finalise, "BATCH_ON_CPU", True)


def test_batched_eigendecompositions_give_the_one_layer_numbers_and_numpys(batched):
    accs, data = _accs()
    one = [acc.finalize() for acc in accs]
    events: list[Progress] = []
    notes: list[str] = []
    got = finalise.finalize_all({"model": accs}, events.append, Progress(0, 0, 0, 0.0), None, notes=notes)
    for a, b, x in zip(one, got["model"], data, strict=True):
        assert b.spectrum_from == "all" and b.n_sample == 64 < len(x)
        _same(a, b)
        want = np.clip(np.linalg.eigvalsh(np.cov(x, rowvar=False))[::-1], 0, None)
        # the d x d sums are float32 products (isotui.core.products): 1e-6 of float64 on the spectrum
        np.testing.assert_allclose(b.eigenvalues, want, rtol=1e-6, atol=1e-6 * want[0])
    assert [e.layers_done for e in events] == [0, 1, 2, 3, 4] and notes == []


def test_the_batch_is_one_stack(batched, monkeypatch):
    """After the first layer (alone: its time is the rate), the other four in one eigh call."""
    import torch

    calls = []
    original = torch.linalg.eigh

    def eigh(a, *args, **kwargs):
        calls.append(tuple(a.shape))
        return original(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    accs, _ = _accs()
    finalise.finalize_all({"model": accs}, lambda _e: None, Progress(0, 0, 0, 0.0), None)
    assert calls[:2] == [(D, D), (D, D)] and (8, D, D) in calls  # 4 layers x (scatter, X^T X)


def test_out_of_memory_halves_the_batch_then_finalises_on_the_cpu(batched, monkeypatch):
    """A batch of more than two layers runs out of memory: halved (4 -> 2) and said; a layer that
    runs out alone is finalised from a copy of its sums on the CPU, said in the same note; the
    numbers are the one-layer path's."""
    import torch

    from isotui.core.accumulator import LayerAccumulator

    accs, _ = _accs(n_layers=6)
    one = [acc.finalize() for acc in accs]
    sizes = []
    decompose = finalise.decompose

    def small_only(chunk):
        sizes.append(len(chunk))
        if len(chunk) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return decompose(chunk)

    monkeypatch.setattr(finalise, "decompose", small_only)
    original = LayerAccumulator.finalize
    last = accs[-1]

    def finalize(self, eigen=None):
        if self is last:  # the device copy of the last layer: out of memory even alone
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return original(self, eigen)

    monkeypatch.setattr(LayerAccumulator, "finalize", finalize)
    notes: list[str] = []
    got = finalise.finalize_all({"model": accs}, lambda _e: None, Progress(0, 0, 0, 0.0), None, notes=notes)
    assert sizes == [5, 2, 2]  # the first layer alone, then 5 -> 2, 2 and the last alone
    for a, b in zip(one, got["model"], strict=True):
        _same(a, b)
    assert notes == [
        f"finalisation ran out of device memory: eigendecompositions of d = {D} on cpu 2 layers at a "
        "time (not 5); 1 of 6 layers finalised on the CPU (one did not fit alone)"
    ]


def test_other_errors_are_not_taken_for_out_of_memory(batched, monkeypatch):
    accs, _ = _accs(n_layers=3)

    def broken(chunk):
        raise RuntimeError("cusolver error: CUSOLVER_STATUS_INTERNAL_ERROR")

    monkeypatch.setattr(finalise, "decompose", broken)
    with pytest.raises(RuntimeError, match="CUSOLVER"):
        finalise.finalize_all({"model": accs}, lambda _e: None, Progress(0, 0, 0, 0.0), None)


def test_the_time_left_is_the_first_layers_rate_extrapolated_within_2x(monkeypatch):
    """An injected clock: each layer takes what a GPU's would (mostly fixed cost, weakly growing
    with d: nothing like the CPU's model), the first layer (the embedding, d = 32) smaller than the
    rest (d = 64). Before the first layer: the estimate given (none on a device); after it, the
    time left within 2x of the true time left at every event."""
    from isotui.core.accumulator import LayerAccumulator

    now = [100.0]

    def gpu_seconds(d: int) -> float:
        return 0.2 + 1e-3 * d

    original = LayerAccumulator.finalize

    def finalize(self, eigen=None):
        now[0] += gpu_seconds(self.dim)
        return original(self, eigen)

    monkeypatch.setattr(LayerAccumulator, "finalize", finalize)
    first, _ = _accs(n_layers=1, d=32)
    rest, _ = _accs(n_layers=6, d=64)
    accs = first + rest
    events: list[Progress] = []
    finalise.finalize_all({"model": accs}, events.append, Progress(0, 0, 0, 0.0), None, clock=lambda: now[0])
    assert events[0].finalize_left_s is None and events[0].eta_s is None
    for e in events[1:]:
        truth = sum(gpu_seconds(a.dim) for a in accs[e.layers_done :])
        assert e.finalize_left_s is not None and truth / 2 <= e.finalize_left_s <= 2 * truth, (e, truth)


def test_no_estimate_before_finalisation_on_a_device_the_cpus_model_on_the_cpu():
    """The calibrated model is the CPU's (it was 40-190x off on an H100): on another device the
    time left waits for the first layer's rate."""
    import torch

    from isotui.core.accumulator import LayerAccumulator

    cpu = LayerAccumulator(256, torch.device("cpu"), full_cov=True, reservoir=4096)
    cpu.n_all = 4096
    f = finalise
    want = (f.FINALIZE_BASE_S + f.FINALIZE_PER_DIM2_S * 256**2) + f.FINALIZE_PER_DIM3_S * 256**3
    assert finalise.finalize_estimate_s({"model": [cpu]}) == pytest.approx(want)
    device = LayerAccumulator(256, torch.device("meta"), full_cov=True, reservoir=4096)
    assert finalise.finalize_estimate_s({"model": [cpu, device]}) is None


def test_the_first_batch_is_what_free_memory_holds_at_the_plans_workspace(monkeypatch):
    """The batch of layers decomposed at once starts at what the device has free over one layer's
    workspace as the memory plan counts it (56 d^2 bytes and LAPACK's syevd, written out here)."""
    from isotui.extract import device, finalise

    d = 512
    per_layer = 56 * d * d + 8 * (1 + 6 * d)  # the exact layer's peak: sums' products, two eigh
    monkeypatch.setattr(device, "available_memory", lambda _dev: int(3.5 * per_layer))
    assert finalise.first_batch("cuda:0", d) == 3
    monkeypatch.setattr(device, "available_memory", lambda _dev: per_layer // 2)
    assert finalise.first_batch("cuda:0", d) == 1  # never none: out of memory then falls back
    monkeypatch.setattr(device, "available_memory", lambda _dev: None)
    assert finalise.first_batch("mps", d) == finalise.MAX_BATCH
