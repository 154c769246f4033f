"""ETAs from the measured rate of the phase a job is in (issue 38 item 2): a CNN run showed
``ETA 1418:20:43`` while it ran (it took 38.7 s) because the finalisation estimate costed each
flattened conv map (d = 200,704) as a d x d eigendecomposition that is never done."""

from __future__ import annotations

import types

import pytest

from isotui.experiments import layerwise
from isotui.extract import finalise, loop, runner
from isotui.extract.progress import Progress
from isotui.spec import make_spec
from isotui.store.cache import ResultCache

RESNET = "random:resnet:hidden_sizes=[8,16],depths=[1,1]"  # the docs' example (docs/guide/run.md)


def test_a_flattened_conv_map_costs_its_reservoirs_eigenproblem_not_d_cubed():
    import torch

    from isotui.core.accumulator import LayerAccumulator

    conv = LayerAccumulator(64 * 56 * 56, torch.device("cpu"), full_cov=False, reservoir=4096)
    conv.n_all = 32  # 32 images, one vector each: at most a 32 x 32 Gram matrix is decomposed
    assert finalise.layer_cost(conv) < 5.0  # was 5.1e6 s (1418 h)
    exact = LayerAccumulator(256, torch.device("cpu"), full_cov=True, reservoir=4096)
    exact.n_all = 10_000  # the d x d sums decomposed: d^3 as calibrated
    assert finalise.layer_cost(exact) > finalise.FINALIZE_PER_DIM3_S * 256**3


@pytest.fixture
def fake_clock(monkeypatch):
    """Every read of the clock (the batch loop's, the runner's, finalisation's) one second on."""
    now = [0.0]

    def tick() -> float:
        now[0] += 1.0
        return now[0]

    fake = types.SimpleNamespace(perf_counter=tick, time=tick, monotonic=tick, sleep=lambda _s: None)
    monkeypatch.setattr(loop, "time", fake)
    monkeypatch.setattr(runner, "time", fake)
    monkeypatch.setattr(finalise.finalize_all, "__kwdefaults__", {"notes": None, "clock": tick})
    return now


def test_the_docs_resnet_run_shows_etas_of_its_measured_rate(fake_clock, tmp_path):
    events: list[Progress] = []
    spec = make_spec(RESNET, "synthetic:images", max_samples=32, batch_size=8)
    layerwise.measure(spec, ResultCache(tmp_path / "c"), on_progress=events.append)
    running = [e for e in events if e.phase == "running" and e.samples_done]
    assert [e.samples_done for e in running] == [8, 16, 24, 32]
    run_s = fake_clock[0]  # the whole run in the fake clock's seconds
    for e in running:
        forward_left = e.elapsed_s * (e.samples_total - e.samples_done) / e.samples_done
        assert e.eta_s is not None and forward_left <= e.eta_s <= forward_left + 5.0, e
        assert "ETA 0:" in e.status(), e.status()
    final = [e for e in events if e.phase == "finalising"]
    assert final and all(e.eta_s is not None and e.eta_s <= run_s for e in final), final
