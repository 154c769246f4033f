"""Screenshots of the main screen at 80x24 and 120x36 (pytest-textual-snapshot).

The screens must not depend on the machine: the device line and cache path are fixed, the HF
cache is empty (conftest), no clock is shown, focus sits on the list (no blinking cursor), and the
two results are layout fixtures built from a formula (what is checked here is the screen, not a
metric; metrics are checked against independent computations in test_core and test_engine).
Update after an intended change with ``pytest tests/test_snapshots.py --snapshot-update`` and
look at the SVGs in tests/__snapshots__/ before committing them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from isotui.core.correlation import drift_correlation
from isotui.experiments.base import Context
from isotui.results import LayerRow, ModelResult
from isotui.tui.app import IsotuiApp

SIZES = [(80, 24), (120, 36)]
pytestmark = pytest.mark.usefixtures("app_tabs_only")  # the lab's own tabs: another's tab re-pins nothing


def fixture_result(model: str, n_layers: int, dim: int, bump: float) -> ModelResult:
    """A plausible-looking run: avg cosine and drift rise through the stack, dip at the end."""
    rows = []
    for i in range(n_layers):
        depth = i / (n_layers - 1)
        avg_cos = round(0.05 + bump * math.sin(math.pi * depth * 0.9), 4)
        drift = round(1.0 + 4.0 * math.sin(math.pi * depth * 0.85), 3)
        rows.append(
            LayerRow(
                model=model,
                component="model",
                layer=i,
                n_vectors=4096,
                avg_cos=avg_cos,
                drift_norm=drift,
                mean_norm=round(8.0 + i * 0.5, 3),
                avg_cos_xctx=avg_cos,
                avg_cos_centered=round(0.002 * (i + 1), 4),
                isoscore=round(0.3 - 0.02 * i, 4),
                eff_rank=round(180.0 - 6.0 * i, 1),
                top_pc_share=round(0.05 + 0.004 * i, 3),
                null_p95=0.084,
                above_null=avg_cos > 0.084,
                top_rogue_dim=63,
                top_rogue_share=round(0.1 + 0.03 * i, 4),
                rogue_dims=f"63:{0.1 + 0.03 * i:.4f}|223:0.0500",
                final_norm=i == n_layers - 1,
                depth=depth,
                dim=dim,
                n_zero=0,
                n_sample=4096,
                spectrum_from="reservoir",
                isoscore_star=round(0.4 - 0.02 * i, 4),
                iw=round(0.5 - 0.03 * i, 4),
                iw_centered=round(0.8 - 0.01 * i, 4),
                avg_cos_abtt=round(0.001 * i, 4),
                avg_cos_std=round(0.01 + 0.002 * i, 4),
                avg_cos_types=round(avg_cos * 0.8, 4),
                drift_norm_types=round(drift * 0.9, 3),
                intra_sim=round(0.3 + 0.01 * i, 4),
                self_sim=round(0.4 + 0.01 * i, 4),
                self_sim_types=700,
            )
        )
    drift = drift_correlation([r.drift_norm for r in rows], [r.avg_cos for r in rows])
    meta = {"data": "builtin", "n_samples": 2000, "n_tokens": 40515, "device": "cpu", "seconds": 1.0}
    return ModelResult(model, f"key-{model}", rows, {"model": drift}, meta, from_cache=True)


def _app() -> IsotuiApp:
    return IsotuiApp(
        cache_root=Path("/isotui-snapshot/cache"),
        export_dir=Path("/isotui-snapshot"),
        device_probe=lambda: "cpu (snapshot)",
    )


async def _settle(pilot) -> None:
    while not pilot.app.device_line or not pilot.app.entries:  # both come from worker threads
        await pilot.pause(0.05)
    await pilot.pause()


async def _with_results(pilot) -> None:
    await _settle(pilot)
    app = pilot.app
    app.add_result(fixture_result("minilm", 7, 384, 0.22))
    app.add_result(fixture_result("random:gpt2", 13, 768, 0.6))
    await pilot.press("n")  # normalised depth: models of different depth line up
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_main_screen_at_start(snap_compare, size):
    assert snap_compare(_app(), terminal_size=size, run_before=_settle)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_main_screen_comparing_two_models(snap_compare, size):
    assert snap_compare(_app(), terminal_size=size, run_before=_with_results)


UNTRAINED = (
    "random:gpt2:n_layer=4,n_embd=128,vocab_size=128",
    "random:gpt2:n_layer=6,n_embd=128,vocab_size=128",
)


def add_jobs(app, finished: int = 3, running: int = 1) -> None:
    """``finished`` done jobs and ``running`` ones at 40%, straight into the jobs pane (the events a
    backend posts; nothing runs, no clock is read: a running job's ETA is its samples' rate)."""
    from types import SimpleNamespace

    from isotui.backend import JobFinished, JobProgress, JobQueued, JobStarted
    from isotui.extract.progress import Progress
    from isotui.tui.jobs import JobsTable

    jobs = app.query_one("#jobs", JobsTable)
    for i in range(finished + running):
        spec = SimpleNamespace(
            model=("minilm", *UNTRAINED, "bert-base-uncased")[i % 4], device="cpu", kind=None
        )
        jobs.apply(JobQueued(i + 1, spec))
        jobs.apply(JobStarted(i + 1, spec, "cpu"))
        if i < finished:
            jobs.apply(JobFinished(i + 1, spec, SimpleNamespace(from_cache=False, meta={"device": "cpu"})))
        else:
            progress = Progress(800, 2000, 40_000, 20.0, memory_bytes=300 * 2**20, phase="running")
            jobs.apply(JobProgress(i + 1, spec, progress))


async def _with_jobs(pilot) -> None:
    """Four compared models, two of them untrained ones whose names differ in one setting, and
    three finished jobs and one running."""
    await _settle(pilot)
    app = pilot.app
    for i, name in enumerate(("minilm", *UNTRAINED, "bert-base-uncased")):
        app.add_result(fixture_result(name, 7 + 2 * i, 384, 0.15 * (i + 1)))
    add_jobs(app)
    await pilot.press("n")
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_main_screen_with_jobs(snap_compare, size):
    """At 80x24 the jobs pane is folded to its summary line (the table and plot keep their rows);
    at 120x36 it lists the four jobs. The legend tells the two untrained models apart."""
    assert snap_compare(_app(), terminal_size=size, run_before=_with_jobs)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_main_screen_with_jobs_unfolded(snap_compare, size):
    """The jobs key unfolds the pane at 80x24 (the user's choice: the plot gives way) and folds it
    at 120x36."""

    async def unfold(pilot) -> None:
        await _with_jobs(pilot)
        await pilot.press("j")
        await pilot.pause()

    assert snap_compare(_app(), terminal_size=size, run_before=unfold)


LAB_TABS = ("1", "2", "3", "4", "5")  # Heads, Dynamics, Drift block, Checkpoints, Token types


@pytest.fixture(scope="module")
def lab_results(tmp_path_factory, tiny_models) -> dict:
    """Every lab tab's result from a real run on tiny models (deterministic on CPU), renamed so
    no temporary path shows, and marked as cached so no timing shows."""
    import dataclasses

    import torch
    from transformers import AutoModel, AutoTokenizer

    from isotui.experiments.attention import AttentionRequest
    from isotui.experiments.checkpoints import CheckpointsRequest
    from isotui.experiments.drift_block import DriftBlockConfig
    from isotui.experiments.drift_block.experiment import DriftBlockRequest
    from isotui.experiments.qk_dynamics import DynamicsRequest, resolve_checkpoints
    from isotui.experiments.token_types import TokenTypesRequest
    from isotui.spec import make_spec

    from .conftest import corpus

    root = tmp_path_factory.mktemp("lab")
    data = root / "samples.txt"
    data.write_text("\n".join(corpus(8)) + "\n", encoding="utf-8")
    series = root / "series"
    for i, step in enumerate((0, 500, 1000)):
        torch.manual_seed(step)
        model = AutoModel.from_pretrained(str(tiny_models["bert"]))
        with torch.no_grad():
            for layer in model.encoder.layer:
                layer.attention.self.query.bias += 0.2 * i * torch.randn_like(layer.attention.self.query.bias)
                layer.output.dense.bias += 0.5 * i * torch.randn_like(layer.output.dense.bias)
        model.save_pretrained(series / f"step_{step}")
        AutoTokenizer.from_pretrained(str(tiny_models["bert"])).save_pretrained(series / f"step_{step}")
    spec = make_spec(str(tiny_models["bert"]), f"text:{data}", max_samples=8, max_length=32)
    run = Context(None)
    attention = AttentionRequest(spec).compute(run)
    attention.model, attention.from_cache = "tiny-bert", True
    checkpoints = tuple(resolve_checkpoints(None, [str(series)]))
    dynamics = DynamicsRequest("tiny-bert", checkpoints, spec).compute(run)
    heat = CheckpointsRequest("tiny-bert", checkpoints, spec).compute(run)
    config = DriftBlockConfig(
        hidden=32,
        heads=4,
        intermediate=64,
        vocab=200,
        batch=2,
        seq_len=16,
        norms=(0.0, 5.0, 10.0, 20.0, 40.0),
    )
    drift = DriftBlockRequest(config).compute(run)
    drift = dataclasses.replace(drift, from_cache=tuple(True for _ in drift.from_cache))
    for r in heat.results:
        r.meta["data"] = "text:samples.txt"
    attention.meta["data"] = "text:samples.txt"
    types = TokenTypesRequest(spec).compute(run)
    types.model, types.from_cache = "tiny-bert", True
    types.meta["data"] = "text:samples.txt"
    return {
        "attention": {"tiny-bert": attention},
        "qk-dynamics": dynamics,
        "drift-block": drift,
        "checkpoints": heat,
        "token-types": {"tiny-bert": types},
    }


@pytest.mark.parametrize("tab", LAB_TABS, ids=("heads", "dynamics", "drift", "checkpoints", "types"))
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_lab_tab(snap_compare, size, tab, lab_results):
    """Each lab tab with a result, legible at 80x24 and 120x36 (plots keep their height)."""

    async def open_tab(pilot) -> None:
        await _settle(pilot)
        app = pilot.app
        app.lab_results.update(lab_results)
        app.selected = "tiny-bert"
        await pilot.press("A", tab)
        await pilot.pause()
        await pilot.pause()

    assert snap_compare(_app(), terminal_size=size, run_before=open_tab)


@pytest.mark.parametrize("log", [False, True], ids=("linear", "log"))
def test_lab_drift_fig7(snap_compare, log, lab_results):
    """Drift block Fig. 7 at 80x24 for d=32 at BERT's init (N=0: scores within ~1e-5): the bars
    span the scores' own range (issue 12: it was six bars on fixed bins); ``l`` gives log counts."""

    async def open_fig7(pilot) -> None:
        await _settle(pilot)
        app = pilot.app
        app.lab_results.update(lab_results)
        await pilot.press("A", "3")
        await pilot.pause()
        app.screen.query_one("#drift-table").focus()
        await pilot.press("m", *(["l"] if log else []))
        await pilot.pause()
        await pilot.pause()

    assert snap_compare(_app(), terminal_size=(80, 24), run_before=open_fig7)
