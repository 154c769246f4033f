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
from isotui.results import LayerRow, ModelResult
from isotui.tui.app import IsotuiApp

SIZES = [(80, 24), (120, 36)]


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
    while not pilot.app.device_line:
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
