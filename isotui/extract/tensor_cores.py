"""Which product scheme a device runs isotui's d x d sums with: measured there, once (issue 26).

A GPU's name does not say how fast its float32, float64, TF32 and bfloat16 products run, nor
whether its tensor cores are on (``NVIDIA_TF32_OVERRIDE=0`` turns TF32 off; a driver or a build
may lack a kernel): the probe forms one shifted anisotropic gram (``PROBE_ROWS`` x ``PROBE_DIM``)
by every candidate :class:`~isotui.core.products.Scheme`, checks each against float64 on the
same device (:data:`BOUND`, the float32 product's own bound, which keeps every metric within 1e-6:
tests/test_products.py), times the ones that pass, and picks the fastest. The table is kept per
device for the process (keyed by the device's name, compute capability and torch version, so two
cards of one kind share it) and set for :func:`isotui.core.products.scheme_for`. The CPU is never
probed: it keeps :data:`~isotui.core.products.FLOAT32` (its exact path: float64 for ``--exact``'s
projections), and MPS sums live on the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from isotui.core.products import BF16X6, FLOAT32, FLOAT64, TF32X3, Scheme, gram, set_scheme

if TYPE_CHECKING:
    import torch

PROBE_ROWS = 4096
PROBE_DIM = 1024
REPEATS = 3
BOUND = 2.0**-20  # max |G - G64| / max |G64| a scheme may show (float32: ~2^-23 here)


@dataclass(frozen=True)
class Measured:
    """One scheme on one device: its error against float64 and seconds per gram (None: failed)."""

    scheme: Scheme
    error: float
    seconds: float | None

    @property
    def passes(self) -> bool:
        return self.seconds is not None and self.error <= BOUND


_CHOSEN: dict[tuple[Any, ...], tuple[Scheme, tuple[Measured, ...]]] = {}


def candidates(device: torch.device) -> list[Scheme]:
    """The schemes worth measuring on ``device``: float32 and float64 everywhere; TF32 and
    bfloat16 slices where the device reports tensor cores for them (CUDA compute capability 8.0
    and above; ROCm reports its own numbers, so it measures them all)."""
    import torch

    out = [FLOAT32, FLOAT64]
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major >= 8 or torch.version.hip is not None:
            out += [TF32X3, BF16X6]
    return out


def probe_data(device: torch.device, rows: int = PROBE_ROWS, dim: int = PROBE_DIM) -> torch.Tensor:
    """Shifted anisotropic rows (a decaying spectrum, a rogue direction), in float64 on ``device``:
    what the accumulators multiply (their shift leaves the spread, not the offset)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(26)
    mix = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    mix *= torch.exp(-torch.arange(dim, dtype=torch.float64) / (dim / 8))[:, None]
    x = torch.randn(rows, dim, generator=g, dtype=torch.float64) @ mix
    x += 3 * torch.randn(dim, generator=g, dtype=torch.float64)
    return (x - x.mean(0)).to(device)


def measure(
    device: torch.device,
    schemes: Sequence[Scheme],
    x: torch.Tensor,
    *,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] | None = None,
    repeats: int = REPEATS,
) -> list[Measured]:
    """Each scheme's error on ``x``'s gram against float64, and its best time of ``repeats``
    (after one warm-up); a scheme that raises (no kernel for it) is measured as failed."""
    import torch

    wait = sync or (lambda: torch.cuda.synchronize(device) if device.type == "cuda" else None)
    x64 = x.to(torch.float64)
    want = x64.T @ x64
    scale = float(want.abs().max())
    out = []
    for scheme in schemes:
        try:
            got = gram(x, scheme)
            error = float((got - want).abs().max()) / scale
            best = float("inf")
            for _ in range(repeats):
                wait()
                start = clock()
                gram(x, scheme)
                wait()
                best = min(best, clock() - start)
            out.append(Measured(scheme, error, best))
        except (RuntimeError, NotImplementedError, TypeError):  # no kernel, or a torch without mm(out_dtype=)
            out.append(Measured(scheme, float("inf"), None))
    return out


def choose(table: Sequence[Measured]) -> Scheme:
    """The fastest scheme within :data:`BOUND`; float32 when none is (it is the reference path)."""
    passing = [m for m in table if m.passes and m.seconds is not None]
    if not passing:
        return FLOAT32
    return min(passing, key=lambda m: (m.seconds, m.scheme.products)).scheme


def device_key(device: torch.device) -> tuple[Any, ...]:
    """What the table is kept by: the device's name, compute capability and torch's version."""
    import torch

    if device.type == "cuda":
        return (
            "cuda",
            torch.cuda.get_device_name(device),
            torch.cuda.get_device_capability(device),
            torch.__version__,
        )
    return (device.type, torch.__version__)


def ensure_scheme(device: Any, *, probe: Callable[[Any], list[Measured]] | None = None) -> Scheme:
    """The scheme for ``device``'s products, measured on the first call for its kind of device
    and set for :func:`~isotui.core.products.scheme_for`; the CPU (and MPS, whose sums live on
    the CPU) keeps float32 without a probe. ``probe``: the measurement (tests inject one)."""
    import torch

    dev = torch.device(device)
    if dev.type in ("cpu", "mps", "meta"):
        return FLOAT32
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = device_key(dev)
    if key not in _CHOSEN:
        run = probe or (lambda d: measure(d, candidates(d), probe_data(d)))
        table = tuple(run(dev))
        _CHOSEN[key] = (choose(table), table)
    scheme = _CHOSEN[key][0]
    set_scheme(dev, scheme)  # as tensors report it: "cuda:0"
    return scheme


def scheme_note(device: Any) -> str | None:
    """One sentence for the run's notes: the scheme chosen for ``device`` and what was measured
    (None on the CPU, whose path is the reference)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type in ("cpu", "mps", "meta") or device_key(dev) not in _CHOSEN:
        return None
    scheme, table = _CHOSEN[device_key(dev)]
    timed = ", ".join(
        f"{m.scheme.name} {m.seconds * 1e3:.2f} ms (error {m.error:.1e})"
        if m.seconds is not None
        else f"{m.scheme.name} failed"
        for m in table
    )
    return (
        f"d x d sums on {dev} by {scheme.name} products, the fastest within {BOUND:.1e} of float64 "
        f"on a {PROBE_ROWS} x {PROBE_DIM} probe: {timed}"
    )
