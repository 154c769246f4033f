"""The memory plan says what a run allocates (issue 29 item 7): a reservoir holds no more vectors
than a layer gives (32 images' flattened conv maps: 32, not the 4,096 asked), and the table names
a flattened map's rogue dimensions by channel and position."""

from __future__ import annotations

import numpy as np
import pytest

from isotui.core.accumulator import LayerAccumulator
from isotui.experiments.layerwise import measure
from isotui.spec import make_spec


def _allocated(acc: LayerAccumulator) -> int:
    """Bytes of every array the accumulator holds (its 0-d counters aside), read off the tensors."""
    import torch

    return sum(
        v.numel() * v.element_size() for v in vars(acc).values() if isinstance(v, torch.Tensor) and v.ndim > 0
    )


@pytest.fixture(scope="module")
def resnet_run():
    pytest.importorskip("timm")
    seen: list[int] = []
    finalize = LayerAccumulator.finalize

    def measured(self, *args, **kwargs):  # the sums as they stand after the last batch, before they are read
        seen.append(_allocated(self))
        return finalize(self, *args, **kwargs)

    LayerAccumulator.finalize = measured
    try:
        result = measure(
            make_spec("random:timm:resnet18", "synthetic:images", max_samples=3, batch_size=2), None
        )
    finally:
        LayerAccumulator.finalize = finalize
    return result, seen


def test_planned_bytes_are_the_arrays_the_run_allocates(resnet_run):
    result, seen = resnet_run
    plan = result.meta["memory_plan"]
    layers = plan["layers"]
    assert len(seen) == len(layers) == 5
    assert [p["bytes"] for p in layers] == seen  # each layer's plan is what it held
    assert all(p["vectors"] == 3 for p in layers)  # three images, one flattened map each
    assert sum(plan["accumulator_bytes"].values()) == sum(seen)
    said = next(n for n in result.meta["notes"] if n.startswith("memory plan"))
    assert f"{sum(seen) / 1e6:.1f} MB" in said


def test_the_rogue_column_names_a_maps_channel_and_position(resnet_run):
    from rich.console import Console

    from isotui.render import result_table

    result, _ = resnet_run
    shapes = result.meta["map_shapes"]["model"]
    console = Console(width=250, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(result_table(result, 250))
    text = console.export_text()
    row = result.rows[0]
    top, share = row.rogue_dims.split("|")[0].split(":")
    assert float(share) != 0  # a share of ~1e-5 is kept in significant digits, not as 0.0000
    c, h, w = shapes[0]
    channel, y, x = np.unravel_index(int(top), (c, h, w))  # (C, H, W), flattened as the run does
    assert f"c{channel}@({y},{x}):{float(share):.2g}" in text
    assert f"{top}:" not in text
