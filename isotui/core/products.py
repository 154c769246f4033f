"""isotui's own matrix products: float32 at full precision, added into float64 sums (issue 15).

A GPU multiplies float64 matrices at 1/2 to 1/64 of its float32 rate, so every d x d (or
m x d x d) product on the per-batch path is formed in float32 from vectors shifted close to zero
(a batch's rounding is then relative to the spread, not to a common offset) and only its result
is added in float64. TF32 or bfloat16 products would not keep the metrics within 1e-6 of the
float64 reference (tests/test_products.py measures it), so those products run at float32's full
precision even when the user allowed TF32/bf16 globally (``torch.set_float32_matmul_precision``,
``torch.backends.cuda.matmul.allow_tf32``) for the model's own forward: :func:`full_float32`
switches the setting for the product alone and puts the user's back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# float64 products instead, for tests that compare two batchings of the same data to 1e-12 (the
# rounding of float32 products depends on which vectors share a batch: ~1e-8 on the spectrum)
FLOAT64_PRODUCTS = False
# mm_split's float32 path on the CPU too (tests: the GPU's path, traced on this machine). A CPU
# runs float64 at half its float32 rate, so there one float64 product beats the split's three.
SPLIT_ON_CPU = False

_LOCK = threading.Lock()
_depth = 0
_saved: tuple[str | None, Any, Any] | None = None  # the user's settings while switched


def _settings() -> tuple[str | None, Any, Any]:
    """The legacy precision (None when the user mixed it with the per-backend API: torch then
    refuses to read it) and the per-backend ones (torch >= 2.9; None before)."""
    import torch

    cuda = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    mkldnn = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    try:
        legacy: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:  # "mix of the legacy and new APIs"
        legacy = None
    return legacy, cuda, getattr(mkldnn, "fp32_precision", None)


def _apply(settings: tuple[str | None, Any, Any]) -> None:
    """Set the precision through the API the user's setting was read with: the legacy call
    when it could be read (it sets the per-backend ones to match), then each backend's own."""
    import torch

    legacy, cuda, mkldnn = settings
    if legacy is not None:
        torch.set_float32_matmul_precision(legacy)
    if cuda is not None and torch.backends.cuda.matmul.fp32_precision != cuda:
        torch.backends.cuda.matmul.fp32_precision = cuda
    onednn = getattr(torch.backends.mkldnn, "matmul", None)  # torch >= 2.9
    if mkldnn is not None and onednn is not None and onednn.fp32_precision != mkldnn:
        onednn.fp32_precision = mkldnn


@contextmanager
def full_float32() -> Iterator[None]:
    """float32 matmuls at full precision (no TF32, no bfloat16) inside, whatever the user set;
    nothing is switched when the setting is already "highest" (torch's default). Re-entrant and
    shared between threads: the first to enter saves the user's setting, the last to leave puts
    it back (the flags are global; a product launched inside reads them at launch)."""
    global _depth, _saved
    with _LOCK:
        if _depth == 0:
            now = _settings()
            if now[0] not in (None, "highest") or {now[1], now[2]} - {None, "ieee"}:
                _saved = now
                legacy, cuda, mkldnn = now
                _apply(("highest" if legacy else None, "ieee" if cuda else None, "ieee" if mkldnn else None))
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                saved, _saved = _saved, None
                _apply(saved)


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` formed in float32 at full precision, returned in float64: callers pass operands
    shifted close to zero and add the result into float64 sums."""
    import torch

    if FLOAT64_PRODUCTS:
        return a.to(torch.float64) @ b.to(torch.float64)
    with full_float32():
        return (a.to(torch.float32) @ b.to(torch.float32)).to(torch.float64)


def gram32(xs: torch.Tensor) -> torch.Tensor:
    """``xs^T xs`` (d x d) of shifted rows, as :func:`mm32`."""
    return mm32(xs.T, xs)


def _on_grid(t: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """``t`` (float64) rounded to ``bits`` bits below the largest power of two of each row
    (``dim=1``) or column (``dim=0``): every entry is then an integer of at most ``bits`` + 1
    bits times that row's (column's) unit."""
    import torch

    top = t.abs().amax(dim, keepdim=True)
    unit = torch.ldexp(torch.ones_like(top), torch.frexp(top).exponent - bits)
    return torch.round(t / unit) * unit


@dataclass(frozen=True)
class SplitRight:
    """The right operand of :func:`mm_split`, split once (it is the same for every batch)."""

    full: torch.Tensor  # float64, d x n
    bits: int  # k, from d
    hi: torch.Tensor  # float32: b on the per-column grid of k bits
    rest: torch.Tensor  # float32, 2d x n: [b - hi; b], the right side of the small terms


def split_right(b: torch.Tensor) -> SplitRight:
    """``b`` (d x n, float64) split for :func:`mm_split` with any m x d left operand."""
    import torch

    d = b.shape[0]
    bits = max(1, (24 - max(1, (d - 1).bit_length())) // 2)
    hi = _on_grid(b, 0, bits)
    rest = torch.cat([b - hi, b]).to(torch.float32)
    return SplitRight(b, bits, hi.to(torch.float32), rest)


def mm_split(a: torch.Tensor, b: torch.Tensor | SplitRight) -> torch.Tensor:
    """``a @ b`` (float64 operands, contraction over d) to about 1e-9 of float64 from float32
    products, where one float32 product is off by ~1e-7 of the rows' size (its running sums
    round: the I(W) of ``--exact`` then moved by 5e-6, tests/test_products.py).

    Each operand is split as hi + lo, hi on a per-row (a) or per-column (b) grid of k bits with
    2 k + log2(d) <= 24: each product of hi parts is an integer of 2 k bits in one unit, so
    hi_a @ hi_b sums exactly in float32, in any order; a @ b = hi_a @ hi_b + [hi_a, lo_a] @
    [lo_b; b], the second 2^-k smaller and so its rounding too (the Ozaki scheme, one level):
    three products' work in two calls (on a CPU, where float64 runs at half the float32 rate,
    that is slower than one float64 product, which the CPU therefore gets; on a GPU, many times
    faster)."""
    import torch

    right = b if isinstance(b, SplitRight) else split_right(b)
    if FLOAT64_PRODUCTS or (a.device.type == "cpu" and not SPLIT_ON_CPU):
        return a.to(torch.float64) @ right.full
    a_hi = _on_grid(a, 1, right.bits)
    left = torch.cat([a_hi, a - a_hi], 1).to(torch.float32)
    with full_float32():
        exact = left[:, : a.shape[1]] @ right.hi
        small = left @ right.rest
    return exact.to(torch.float64) + small.to(torch.float64)
