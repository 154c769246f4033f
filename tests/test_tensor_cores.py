"""Which product scheme a device's d x d sums use (issue 26): measured on the device (error
against float64, then time), never read from its name; the CPU keeps its exact path. Traced here
on the CPU with the tensor cores emulated (isotui.core.products) and an injected clock."""

from __future__ import annotations

import numpy as np
import pytest

from isotui.core import products
from isotui.extract import tensor_cores
from isotui.extract.tensor_cores import Measured


def test_the_fastest_scheme_within_the_bound_is_chosen_never_a_fast_wrong_one():
    s = products.SCHEMES
    table = [
        Measured(s["float32"], 1e-7, 4.0),
        Measured(s["float64"], 0.0, 3.5),
        Measured(s["3xtf32"], 2e-7, 1.2),
        Measured(s["bf16x6"], 3e-7, 1.0),
        Measured(products.Scheme("tf32", "tf32", 1), 4e-5, 0.3),  # fastest, outside the bound
        Measured(products.Scheme("broken", "bf16", 3), float("inf"), None),  # no kernel
    ]
    assert tensor_cores.choose(table) is s["bf16x6"]
    assert tensor_cores.choose(table[:3]) is s["3xtf32"]
    assert tensor_cores.choose(table[:2]) is s["float64"]  # an H100: float64 as fast as float32
    assert tensor_cores.choose(table[4:]) is s["float32"]  # none passes: the reference path


def test_the_probe_measures_errors_against_float64_with_an_injected_clock():
    """On the CPU (emulated tensor cores), the probe's errors are numpy's max |G - X^T X| / max
    |X^T X|: float32, 3xTF32 and bf16x6 within the bound, one TF32 product outside; the times
    are the injected clock's (best of the repeats)."""
    import torch

    x = tensor_cores.probe_data(torch.device("cpu"), rows=512, dim=128)
    ticks = iter(range(1000))
    single = products.Scheme("tf32", "tf32", 1)
    schemes = [products.FLOAT32, products.TF32X3, products.BF16X6, single]
    table = tensor_cores.measure(
        torch.device("cpu"), schemes, x, clock=lambda: 1.5 * next(ticks), sync=lambda: None, repeats=2
    )
    xn = x.numpy()
    want = xn.T @ xn
    for m in table:
        got = products.gram(x, m.scheme).numpy()
        assert m.error == pytest.approx(np.abs(got - want).max() / np.abs(want).max(), rel=1e-12)
        assert m.seconds == 1.5
    assert [m.passes for m in table] == [True, True, True, False]
    assert tensor_cores.choose(table) is products.FLOAT32  # a tie: the fewest products


def test_a_device_is_probed_once_and_its_scheme_set(monkeypatch):
    """A GPU (its name and capability faked): the probe runs on the first call only, the scheme
    it chose is what the products on that device use, and the note says what was measured. The
    CPU is never probed."""
    import torch

    monkeypatch.setattr(tensor_cores, "_CHOSEN", {})
    monkeypatch.setattr(tensor_cores, "device_key", lambda dev: ("cuda", "Fake GPU", (9, 0), "x"))
    calls = []

    def probe(dev):
        calls.append(str(dev))
        return [Measured(products.FLOAT32, 1e-7, 2.0), Measured(products.TF32X3, 2e-7, 0.5)]

    def refuse(dev):
        raise AssertionError("the CPU is not probed")

    try:
        assert tensor_cores.ensure_scheme("cpu", probe=refuse) is products.FLOAT32
        assert products.scheme_for(torch.device("cpu")) is products.FLOAT32
        for _ in range(2):
            assert tensor_cores.ensure_scheme("cuda:0", probe=probe) is products.TF32X3
        assert calls == ["cuda:0"]
        assert products.scheme_for(torch.device("cuda", 0)) is products.TF32X3
        note = tensor_cores.scheme_note("cuda:0")
        assert note is not None and "3xtf32" in note and "float32 2000.00 ms" in note
        assert tensor_cores.scheme_note("cpu") is None
    finally:
        products.set_scheme("cuda:0", None)


def test_a_scheme_the_device_cannot_run_is_measured_as_failed(monkeypatch):
    """A torch without ``mm(..., out_dtype=)`` (TypeError) or a device without the kernel
    (RuntimeError): that scheme fails, the others are measured and one of them is chosen."""
    import torch

    real = tensor_cores.gram

    def gram(x, scheme):
        if scheme is products.BF16X6:
            raise TypeError("mm() got an unexpected keyword argument 'out_dtype'")
        if scheme is products.TF32X3:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return real(x, scheme)

    monkeypatch.setattr(tensor_cores, "gram", gram)
    x = tensor_cores.probe_data(torch.device("cpu"), rows=256, dim=64)
    schemes = [products.FLOAT32, products.TF32X3, products.BF16X6]
    table = tensor_cores.measure(torch.device("cpu"), schemes, x, sync=lambda: None, repeats=1)
    assert [m.passes for m in table] == [True, False, False]
    assert table[1].seconds is None and table[2].seconds is None
    assert tensor_cores.choose(table) is products.FLOAT32
