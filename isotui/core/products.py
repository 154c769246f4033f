"""isotui's own matrix products: float32 at full precision, added into float64 sums (issue 15).

A GPU multiplies float64 matrices at 1/2 to 1/64 of its float32 rate, so every d x d (or
m x d x d) product on the per-batch path is formed in float32 from vectors shifted close to zero
(a batch's rounding is then relative to the spread, not to a common offset) and only its result
is added in float64. TF32 or bfloat16 products would not keep the metrics within 1e-6 of the
float64 reference (tests/test_products.py measures it), so those products run at float32's full
precision even when the user allowed TF32/bf16 globally (``torch.set_float32_matmul_precision``,
``torch.backends.cuda.matmul.allow_tf32``) for the model's own forward: :func:`full_float32`
switches the setting for the product alone and puts the user's back.

Issue 26: on a data-centre GPU float32 runs no faster than float64 (an H100: ~67 TFLOP/s for
both), while its tensor cores multiply TF32 and bfloat16 operands 7-15x faster. A :class:`Scheme`
splits each float64 operand into slices that the tensor cores hold exactly (two TF32 slices:
"3xtf32"; three bfloat16 ones: "bf16x6"), multiplies the slices whose product is not below the
last slice's rounding (3 and 6 products) with float32 accumulation, and adds the results in
float64: about a float32 product's error at tensor-core speed. Which scheme a device uses is the
table :func:`scheme_for` reads, filled per device from a measured probe
(:mod:`isotui.extract.tensor_cores`), never from the device's name; the CPU keeps
:data:`FLOAT32` (one float32 product for the d x d sums, float64 for :func:`mm_split`). On the
CPU the tensor cores are emulated: the same slices (rounded to TF32 / bfloat16 explicitly), each
product of two slices exact in float32, accumulated in float32 (tests/test_products.py).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Scheme:
    """How a device forms isotui's d x d products: ``fmt`` None: one product in ``name``'s dtype
    (float32 or float64); else each operand split into ``slices`` slices exact in ``fmt`` (TF32:
    10 stored mantissa bits, bfloat16: 7) and the products of slices i, j with i + j <= slices + 1
    formed on the tensor cores with float32 accumulation, added in float64."""

    name: str
    fmt: str | None = None
    slices: int = 1

    @property
    def products(self) -> int:
        """Products per ``a @ b`` (a gram needs fewer: slice pairs i != j are transposes)."""
        s = self.slices
        return sum(1 for i in range(1, s + 1) for j in range(1, s + 1) if i + j <= s + 1)


FLOAT32 = Scheme("float32")
FLOAT64 = Scheme("float64")
TF32X3 = Scheme("3xtf32", "tf32", 2)  # hi.hi + hi.lo + lo.hi (CUTLASS's 3xTF32)
BF16X6 = Scheme("bf16x6", "bf16", 3)  # three bfloat16 slices, the 6 leading products
SCHEMES = {s.name: s for s in (FLOAT32, FLOAT64, TF32X3, BF16X6)}
MANTISSA_BITS = {"tf32": 10, "bf16": 7}  # stored bits: significands of 11 and 8 bits

_TABLE: dict[str, Scheme] = {}  # str(device) -> its scheme, set by the probe (or a test)


def set_scheme(device: Any, scheme: Scheme | None) -> None:
    """Use ``scheme`` for products on ``device`` (None: the default again)."""
    key = str(device)
    if scheme is None:
        _TABLE.pop(key, None)
    else:
        _TABLE[key] = scheme


def scheme_for(device: Any) -> Scheme:
    """The scheme set for ``device`` (:func:`set_scheme`), else :data:`FLOAT32`: the CPU's
    exact path, and a device not probed yet."""
    return _TABLE.get(str(device), FLOAT32)


# float64 products instead, for tests that compare two batchings of the same data to 1e-12 (the
# rounding of float32 products depends on which vectors share a batch: ~1e-8 on the spectrum)
FLOAT64_PRODUCTS = False
# mm_split's float32 path on the CPU too (tests: the GPU's path, traced on this machine). A CPU
# runs float64 at half its float32 rate, so there one float64 product beats the split's three.
SPLIT_ON_CPU = False

_COND = threading.Condition()
_depth = 0
_level = "ieee"  # the level switched to while _depth > 0
_MINE = threading.local()  # this thread's depth
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


def _apply(settings: tuple[str | None, Any, Any], *, tf32: bool = False) -> None:
    """Set the precision through the API the user's setting was read with: the legacy call
    when it could be read (it sets the per-backend ones to match), then each backend's own;
    ``tf32``: also torch's older CUDA flag (torch < 2.9 has no per-backend setting)."""
    import torch

    legacy, cuda, mkldnn = settings
    if legacy is not None:
        torch.set_float32_matmul_precision(legacy)
    if tf32 and cuda is None:
        torch.backends.cuda.matmul.allow_tf32 = True
    if cuda is not None and torch.backends.cuda.matmul.fp32_precision != cuda:
        torch.backends.cuda.matmul.fp32_precision = cuda
    onednn = getattr(torch.backends.mkldnn, "matmul", None)  # torch >= 2.9
    if mkldnn is not None and onednn is not None and onednn.fp32_precision != mkldnn:
        onednn.fp32_precision = mkldnn


@contextmanager
def _matmul_precision(level: str) -> Iterator[None]:
    """float32 matmuls at ``level`` inside ("ieee": full precision; "tf32": TF32 on CUDA's
    tensor cores), whatever the user set. Re-entrant and shared between threads: the first to
    enter saves the user's setting, the last to leave puts it back (the flags are global; a
    product launched inside reads them at launch); a thread asking for the other level waits."""
    global _depth, _saved, _level
    with _COND:
        # another thread's level: wait for it to leave; this thread's own (nested): keep it (TF32
        # slices multiplied at full float32 give the same numbers, only slower)
        while _depth and _level != level and not getattr(_MINE, "depth", 0):
            _COND.wait()
        if getattr(_MINE, "depth", 0) and _level == "tf32" and level == "ieee":
            raise RuntimeError("a full-precision float32 product inside a TF32 one would run at TF32")
        if _depth == 0:
            _level = level
            now = _settings()
            legacy, cuda, mkldnn = now
            if level == "ieee":
                want = ("highest" if legacy else None, "ieee" if cuda else None, "ieee" if mkldnn else None)
            elif legacy:  # TF32 (used on CUDA only: the CPU's slice products are emulated)
                want = ("high", "tf32" if cuda else None, "tf32" if mkldnn else None)
            else:
                want = (None, "tf32" if cuda else None, mkldnn)
            if now != want:
                _saved = now
                _apply(want, tf32=level == "tf32")
        _depth += 1
        _MINE.depth = getattr(_MINE, "depth", 0) + 1
    try:
        yield
    finally:
        with _COND:
            _MINE.depth -= 1
            _depth -= 1
            if _depth == 0:
                if _saved is not None:
                    saved, _saved = _saved, None
                    _apply(saved)
                _COND.notify_all()


def full_float32() -> AbstractContextManager[None]:
    """float32 matmuls at full precision (no TF32, no bfloat16) inside, whatever the user set;
    nothing is switched when the setting is already "highest" (torch's default)."""
    return _matmul_precision("ieee")


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` formed in float32 at full precision, returned in float64: callers pass operands
    shifted close to zero and add the result into float64 sums (skinny products: ABTT's d / 100
    columns, which no scheme speeds up)."""
    import torch

    if FLOAT64_PRODUCTS:
        return a.to(torch.float64) @ b.to(torch.float64)
    with full_float32():
        return (a.to(torch.float32) @ b.to(torch.float32)).to(torch.float64)


def round_to(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """``t`` rounded to nearest (ties to even) in ``fmt`` ("tf32" or "bf16"), as float32 values
    (what the tensor cores read: the slices are made exact in it, so nothing rounds there)."""
    import torch

    t32 = t.to(torch.float32)
    if fmt == "bf16":
        return t32.to(torch.bfloat16).to(torch.float32)
    drop = 23 - MANTISSA_BITS[fmt]
    i = t32.contiguous().view(torch.int32)
    odd = (i >> drop) & 1
    i = (i + ((1 << (drop - 1)) - 1) + odd) & ~((1 << drop) - 1)
    return i.view(torch.float32).view(t32.shape)


def split(t: torch.Tensor, fmt: str, slices: int) -> list[torch.Tensor]:
    """``t`` (float64) as ``slices`` float32 tensors exact in ``fmt`` whose sum is ``t`` to
    2^-(slices (p + 1)) of each entry (p: ``fmt``'s stored bits): each slice is the rounding of
    what the ones before left, which float64 holds exactly."""
    import torch

    parts, rest = [], t.to(torch.float64)
    for i in range(slices):
        part = round_to(rest, fmt)
        parts.append(part)
        if i + 1 < slices:
            rest = rest - part.to(torch.float64)
    return parts


def _slice_mm(a: torch.Tensor, b: torch.Tensor, fmt: str) -> torch.Tensor:
    """One product of two slices exact in ``fmt``, accumulated in float32: on CUDA's tensor
    cores (TF32 matmul of the float32 slices; bfloat16 operands with a float32 result), elsewhere
    emulated (tests only: the CPU's own scheme is :data:`FLOAT32`).

    The emulation models the tensor cores' float32 accumulator as a wide one: each product of
    two slices is exact (11 + 11 or 8 + 8 significant bits), the sum is formed in float64 and
    rounded to float32 once. A CPU GEMM's own float32 accumulation is its kernel's (order,
    blocking): on an AVX-512/AMX Xeon, MKL's sum of 250 bfloat16-exact squares came out 3.5e-7 low
    (relative) on every diagonal entry, which moved eff_rank by 2.2e-6 where other CPUs stayed
    within 1e-6 (issue 35). So the emulation tests the scheme (its slices, the pairs it drops, one
    float32 rounding) the same on every CPU; what a card's own accumulation adds is measured on
    the card by the probe (:mod:`isotui.extract.tensor_cores`) and the tests marked ``gpu``."""
    import torch

    if a.device.type == "cuda":
        if fmt == "bf16":
            return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16), out_dtype=torch.float32)
        with _matmul_precision("tf32"):
            return a @ b
    return (a.to(torch.float64) @ b.to(torch.float64)).to(torch.float32)


def _pairs(slices: int) -> list[tuple[int, int]]:
    """The slice pairs (i, j) whose product is kept, smallest first (float64 adds them so)."""
    kept = [(i, j) for i in range(slices) for j in range(slices) if i + j <= slices - 1]
    return sorted(kept, key=lambda p: -(p[0] + p[1]))


def mm_scheme(a: torch.Tensor, b: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """``a @ b`` (float64 operands) by ``scheme``, in float64."""
    import torch

    if FLOAT64_PRODUCTS or scheme is FLOAT64 or scheme.name == "float64":
        return a.to(torch.float64) @ b.to(torch.float64)
    if scheme.fmt is None:
        return mm32(a, b)
    sa, sb = split(a, scheme.fmt, scheme.slices), split(b, scheme.fmt, scheme.slices)
    out = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.float64, device=a.device)
    for i, j in _pairs(scheme.slices):
        out += _slice_mm(sa[i], sb[j], scheme.fmt).to(torch.float64)
    return out


# the CPU's float32 gram by column blocks: only the upper triangle's products, mirrored (one CPU
# core: 4.7-5.1 ms against 8.3-8.6 ms for the whole product at 3,600 x 384; issue 40)
GRAM_BLOCKS = 8


def _upper_gram(x32: torch.Tensor) -> torch.Tensor:
    """``x32^T x32`` (float64) from the products of each column block with the blocks from it on:
    every entry is the same float32 dot product as the whole product's, a little more than half
    the multiplications, and the result exactly symmetric."""
    import torch

    d = x32.shape[1]
    edges = [d * i // GRAM_BLOCKS for i in range(GRAM_BLOCKS + 1)]
    out = torch.empty((d, d), dtype=torch.float64)
    with full_float32():
        for lo, hi in itertools.pairwise(edges):
            p = (x32[:, lo:hi].T @ x32[:, lo:]).to(torch.float64)
            out[lo:hi, lo:] = p
            out[lo:, lo:hi] = p.T
    return out


def gram(xs: torch.Tensor, scheme: Scheme | None = None) -> torch.Tensor:
    """``xs^T xs`` (d x d, float64) of shifted rows, by ``scheme`` (default: the table's for
    ``xs``'s device): a slice pair and its transpose are one product."""
    import torch

    scheme = scheme_for(xs.device) if scheme is None else scheme
    if FLOAT64_PRODUCTS or scheme.name == "float64":
        x64 = xs.to(torch.float64)
        return x64.T @ x64
    if scheme.fmt is None:  # one float32 copy serves both operands (mm32 would make two)
        x32 = xs.to(torch.float32)
        if xs.device.type == "cpu" and xs.shape[1] >= GRAM_BLOCKS * 16:
            return _upper_gram(x32)
        return mm32(x32.T, x32)
    parts = split(xs, scheme.fmt, scheme.slices)
    d = xs.shape[1]
    out = torch.zeros((d, d), dtype=torch.float64, device=xs.device)
    for i, j in _pairs(scheme.slices):
        if i > j:
            continue
        p = _slice_mm(parts[i].T, parts[j], scheme.fmt).to(torch.float64)
        out += p if i == j else p + p.T
    return out


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
    bits: int  # k, from d (and the scheme's format)
    hi: torch.Tensor  # float32: b on the per-column grid of k bits
    rest: torch.Tensor  # float32, 2d x n: [b - hi; b], the right side of the small terms
    rest64: torch.Tensor  # the same in float64 (a tensor-core scheme splits it its own way)
    scheme: Scheme = FLOAT32


def split_right(b: torch.Tensor, scheme: Scheme | None = None) -> SplitRight:
    """``b`` (d x n, float64) split for :func:`mm_split` with any m x d left operand, by
    ``scheme`` (default: the table's for ``b``'s device)."""
    import torch

    scheme = scheme_for(b.device) if scheme is None else scheme
    d = b.shape[0]
    bits = max(1, (24 - max(1, (d - 1).bit_length())) // 2)
    if scheme.fmt is not None:  # the hi parts' integers (k + 1 bits) exact in the format
        bits = min(bits, MANTISSA_BITS[scheme.fmt])
    hi = _on_grid(b, 0, bits)
    rest64 = torch.cat([b - hi, b])
    return SplitRight(b, bits, hi.to(torch.float32), rest64.to(torch.float32), rest64, scheme)


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
    faster). With a tensor-core scheme, hi_a @ hi_b is one product of slices exact in its format
    (k <= its stored bits) and the small terms are that scheme's product."""
    import torch

    right = b if isinstance(b, SplitRight) else split_right(b, scheme_for(a.device))
    scheme = right.scheme
    cpu_exact = a.device.type == "cpu" and not SPLIT_ON_CPU and scheme.fmt is None
    if FLOAT64_PRODUCTS or cpu_exact or scheme.name == "float64":
        return a.to(torch.float64) @ right.full
    a_hi = _on_grid(a, 1, right.bits)
    if scheme.fmt is not None:
        exact = _slice_mm(a_hi.to(torch.float32), right.hi, scheme.fmt)
        small = mm_scheme(torch.cat([a_hi, a - a_hi], 1), right.rest64, scheme)
        return exact.to(torch.float64) + small
    left = torch.cat([a_hi, a - a_hi], 1).to(torch.float32)
    with full_float32():
        exact = left[:, : a.shape[1]] @ right.hi
        small = left @ right.rest
    return exact.to(torch.float64) + small.to(torch.float64)
