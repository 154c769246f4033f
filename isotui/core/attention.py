"""Attention statistics per head (Godey et al. 2024, sections 4 and 5), streamed.

Queries and keys arrive per batch as (B, H, T, d_k) tensors with masks saying which query rows
and key positions count; what is kept grows with the number of heads, never with the corpus:
float64 sums for the mean query and key, fixed-bin score histograms, and running sums of the
softmax row statistics. Pure torch and numpy: no model, no I/O.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

# Float64 work tensors on the CPU are made at most this many elements (16 MiB): the C allocator
# maps a larger block afresh on every call and faults its pages in one by one, which costs more
# than the arithmetic (4M floats to float64: 18 ms into a new block, 3 ms into a reused one).
CHUNK_ELEMENTS = 1 << 21

# The CPU's own paths (numpy's sort, sums and bins, boolean gathers: free there, no device to
# wait for). Tests turn them off to trace, on a CPU, the path a GPU takes, which reads nothing
# back to the host per batch (issue 15).
CPU_PATHS = True


def _cpu_path(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the CPU's path (see ``CPU_PATHS``)."""
    return CPU_PATHS and x.device.type == "cpu"


# Elements per chunk of the CPU's float32 work buffers (1 MiB): small enough for the C allocator
# to hand back the same block each time, so no page is faulted in afresh.
SMALL_CHUNK = 1 << 18


def _square_row_sums64(a: np.ndarray) -> np.ndarray:
    """``(a * a).sum(-1, dtype=float64)`` for an array of rows (each square rounded to ``a``'s
    dtype, as torch's ``square`` rounds it), squared a chunk of rows at a time into one buffer
    instead of a fresh copy of ``a``: each row's sum is the same numpy sum either way."""
    size = a.shape[-1]
    rows = a.reshape(-1, size)
    out = np.empty(rows.shape[0], dtype=np.float64)
    step = max(1, SMALL_CHUNK // max(size, 1))
    buf = np.empty((min(step, rows.shape[0]), size), dtype=a.dtype)
    for i in range(0, rows.shape[0], step):
        part = buf[: min(step, rows.shape[0] - i)]
        np.square(rows[i : i + step], out=part)
        part.sum(-1, dtype=np.float64, out=out[i : i + len(part)])
    return out.reshape(a.shape[:-1])


_SCRATCH = threading.local()


def _scratch64(size: int) -> torch.Tensor:
    """A float64 CPU work buffer of at least ``size`` elements, this thread's own, kept between
    calls (at most :data:`CHUNK_ELEMENTS`): a fresh one would be faulted in page by page each time."""
    import torch

    buf: torch.Tensor | None = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < size:
        # a normal tensor, even when first asked for under inference mode: written in place both
        # inside it and outside (an inference tensor may not be written outside it)
        with torch.inference_mode(False):
            buf = torch.empty(size, dtype=torch.float64)
        _SCRATCH.buf = buf
    return buf


def row_sums64(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1, dtype=float64)``. On the CPU through numpy, which casts in small buffers (torch
    makes the whole float64 copy first: twice the time, and more in page faults)."""
    import torch

    if not _cpu_path(x):
        return x.sum(-1, dtype=torch.float64)
    return torch.from_numpy(np.asarray(x.numpy().sum(-1, dtype=np.float64)))


# Score histogram: 1024 bins over [-64, 64), evenly spaced in asinh(s / 0.001): about 2e-5 wide
# near 0 and 1.5 wide at +-64, so an untrained block's scores (within +-0.001 at BERT's init) and
# a trained model's (+-30) both get a shape. Outside the range: one underflow, one overflow count.
SCORE_LIMIT, SCORE_SCALE, SCORE_BINS = 64.0, 0.001, 1024
_SPAN = math.asinh(SCORE_LIMIT / SCORE_SCALE)


def score_edges() -> np.ndarray:
    """The histogram's bin edges: bin i holds ``edges[i] <= s < edges[i + 1]``."""
    edges = SCORE_SCALE * np.sinh(np.linspace(-_SPAN, _SPAN, SCORE_BINS + 1))
    edges[[0, -1]] = -SCORE_LIMIT, SCORE_LIMIT
    return edges


def score_bins(s: torch.Tensor) -> torch.Tensor:
    """Each score's histogram index: 0 below the first edge, 1..BINS the bins, BINS + 1 at or
    above the last edge (int32: half the memory of int64, and torch's bincount takes it 3x
    faster). On the CPU in numpy, whose vectorised arcsinh is about 6x
    torch's (it may differ from torch's in the last bit: a score that close to an edge may fall
    on either side of it, as it may on another device)."""
    import torch

    if not _cpu_path(s):
        u = torch.asinh(s / SCORE_SCALE)
        u.add_(_SPAN).mul_(SCORE_BINS / (2 * _SPAN)).floor_().clamp_(-1, SCORE_BINS)
        idx = u.to(torch.int32).add_(1)
        idx.masked_fill_(s >= SCORE_LIMIT, SCORE_BINS + 1)
        return idx.masked_fill_(s < -SCORE_LIMIT, 0)
    a = s.numpy()
    out = np.empty(a.shape, dtype=np.int32)
    _bins_into(a, np.empty(a.shape, dtype=a.dtype), out)
    return torch.from_numpy(out)


def _bins_into(a: np.ndarray, work: np.ndarray, out: np.ndarray, *, inside: bool = False) -> None:
    """:func:`score_bins` in numpy: ``a``'s bin indices into the int32 ``out``, through the
    float buffer ``work`` (both of ``a``'s shape), so that a caller may reuse them chunk by chunk.
    ``inside``: every score lies in [-LIMIT, LIMIT) (no NaN), so the clip and the end slots
    change nothing and are skipped."""
    f = a.dtype.type
    np.divide(a, f(SCORE_SCALE), out=work)
    np.arcsinh(work, out=work)
    work += f(_SPAN)
    work *= f(SCORE_BINS / (2 * _SPAN))
    np.floor(work, out=work)
    if not inside:
        np.clip(work, -1, SCORE_BINS, out=work)
    out[...] = work
    out += 1
    if not inside:
        np.putmask(out, a >= SCORE_LIMIT, SCORE_BINS + 1)
        np.putmask(out, a < -SCORE_LIMIT, 0)


def _score_sums_np(x: np.ndarray) -> tuple[np.ndarray, float, float, float, float]:
    """(histogram counts (BINS + 2,) int64, float64 sum, float64 sum of squares, min, max) of
    the 1-D scores ``x`` (not empty), a chunk of :data:`SMALL_CHUNK` at a time through reused
    buffers that stay in the cache (each square rounded to ``x``'s dtype, as torch's ``square``
    rounds it)."""
    lo, hi = float(x.min()), float(x.max())
    inside = lo >= -SCORE_LIMIT and hi < SCORE_LIMIT  # False for NaN
    counts = np.zeros(SCORE_BINS + 2, dtype=np.int64)
    total = squares = 0.0
    size = min(SMALL_CHUNK, x.size)
    work, idx = np.empty(size, dtype=x.dtype), np.empty(size, dtype=np.int32)
    for i in range(0, x.size, SMALL_CHUNK):
        part = x[i : i + SMALL_CHUNK]
        n = len(part)
        _bins_into(part, work[:n], idx[:n], inside=inside)
        counts += np.bincount(idx[:n], minlength=SCORE_BINS + 2)
        total += float(part.sum(dtype=np.float64))
        squares += float(np.square(part, out=work[:n]).sum(dtype=np.float64))
    return counts, total, squares, lo, hi


def _entropy_sum_np(p: np.ndarray) -> float:
    """The float64 sum of ``p log p`` over the probabilities ``p`` (any shape), a chunk at a
    time. ``p`` is raised to the dtype's smallest normal number inside the log, so a zero adds
    nothing (as ``xlogy`` gives) and a subnormal p adds p log(tiny) instead of p log p, which
    differ by less than 1e-36."""
    flat = p.reshape(-1)
    tiny = np.finfo(flat.dtype).tiny
    work = np.empty(min(SMALL_CHUNK, flat.size), dtype=flat.dtype)
    total = 0.0
    for i in range(0, flat.size, SMALL_CHUNK):
        part = flat[i : i + SMALL_CHUNK]
        buf = work[: len(part)]
        np.maximum(part, tiny, out=buf)
        np.log(buf, out=buf)
        buf *= part
        total += float(buf.sum(dtype=np.float64))
    return total


def _kept_rows(x: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """(H, m, ...) the rows of ``x`` (B, H, T, ...) at the (B, T) positions ``keep`` holds: one
    numpy gather (torch's boolean index of the permuted view costs about 10x)."""
    return x.transpose(1, 0, 2, *range(3, x.ndim))[:, keep]


# Data-ranged histogram (drift-block Fig. 7): the fixed bins above put an untrained block's
# scores at small d into a handful of bins. Here the range comes from the data: bins of width
# 2**exp at multiples of that width, exp the smallest that covers [min, max] in at most ``bins``
# bins. A score's bin is floor(s * 2**-exp), exact in float64 for any float32 score, so counts
# are exact; two such histograms merge exactly by coarsening the finer (each bin of width 2**e
# lies inside one bin of width 2**(e + j)) onto the smallest common grid that holds both.
RANGE_BINS = 512


@dataclass
class RangeHistogram:
    """Counts on bins ``[(start + i) * 2**exp, (start + i + 1) * 2**exp)``, ``i < bins``, along
    the last axis of ``counts`` (``bins + 2`` long): slot 0 counts -inf, the last slot +inf and
    NaN (scores no finite range holds), slots 1..bins the bins."""

    exp: int
    start: int
    counts: np.ndarray  # (..., bins + 2) int64

    @property
    def bins(self) -> int:
        return int(self.counts.shape[-1]) - 2

    def edges(self) -> np.ndarray:
        """(bins + 1,) the bin edges (exact: integers times a power of two)."""
        return np.ldexp(np.arange(self.start, self.start + self.bins + 1, dtype=np.float64), self.exp)

    def occupied(self) -> tuple[int, int] | None:
        """The first and last bin index (absolute, in units of 2**exp) holding a count."""
        inner = self.counts[..., 1:-1].reshape(-1, self.bins).sum(0)
        nz = np.flatnonzero(inner)
        return None if len(nz) == 0 else (self.start + int(nz[0]), self.start + int(nz[-1]))

    def regrid(self, exp: int, start: int, bins: int) -> RangeHistogram:
        """The same counts on the coarser (or equal) grid ``exp``, ``start``, ``bins`` (exact:
        each bin falls whole into one of the grid's); :class:`ValueError` if a count falls off it."""
        if exp < self.exp:
            raise ValueError(f"cannot regrid bins of width 2**{self.exp} onto finer ones (2**{exp})")
        shift = exp - self.exp
        lead = self.counts.shape[:-1]
        out = np.zeros((*lead, bins + 2), dtype=np.int64)
        out[..., 0], out[..., -1] = self.counts[..., 0], self.counts[..., -1]
        inner = self.counts[..., 1:-1]
        where = np.flatnonzero(inner.reshape(-1, self.bins).any(0))
        target = ((self.start + where) >> shift) - start  # >> floors negative indices too
        if len(where) and (target.min() < 0 or target.max() >= bins):
            raise ValueError("a count falls outside the target grid")
        for j, t in zip(where.tolist(), target.tolist(), strict=True):
            out[..., 1 + t] += inner[..., j]
        return RangeHistogram(exp, start, out)


def range_grid(lo: float, hi: float, bins: int = RANGE_BINS, exp: int | None = None) -> tuple[int, int]:
    """``(exp, start)``: the finest power-of-two width (at least ``2**exp`` when given) whose
    aligned bins cover ``[lo, hi]`` in at most ``bins`` bins, and the first bin's index."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
        raise ValueError(f"no histogram range from {lo} to {hi}")
    span = hi - lo if hi > lo else (abs(lo) or 1.0)
    e = math.frexp(span / bins)[1] - 1  # 2**e <= span / bins: a lower bound
    if exp is not None:
        e = max(e, exp)
    while math.floor(math.ldexp(hi, -e)) - math.floor(math.ldexp(lo, -e)) + 1 > bins:
        e += 1
    return e, math.floor(math.ldexp(lo, -e))


def range_histogram(chunks: list[torch.Tensor], bins: int = RANGE_BINS) -> RangeHistogram:
    """Counts of every value of ``chunks`` (one row per chunk, e.g. per head) on the grid that
    :func:`range_grid` chooses from their finite min and max (a first pass over the values)."""
    import torch

    lo, hi = math.inf, -math.inf
    all_finite = []
    for s in chunks:
        if not s.numel():
            a, b = math.inf, -math.inf
        elif _cpu_path(s):  # numpy's min and max: SIMD, one thread, no allocation
            a, b = float(s.numpy().min()), float(s.numpy().max())
        else:
            a, b = (float(v) for v in torch.aminmax(s))
        finite = (math.isfinite(a) and math.isfinite(b)) or not s.numel()  # NaN or inf: look closer
        if not finite:
            kept = s[torch.isfinite(s)]
            a, b = (float(kept.min()), float(kept.max())) if kept.numel() else (math.inf, -math.inf)
        lo, hi = min(lo, a), max(hi, b)
        all_finite.append(finite)
    exp, start = range_grid(lo, hi, bins) if lo <= hi else (0, 0)
    scale = math.ldexp(1.0, -exp)
    # a float32 score times 2**-exp is exact when exp <= 0 (no overflow: the grid's bins cover
    # [lo, hi]), so its floor is the float64 one; the bin numbers then fit an int32
    narrow = exp <= 0 and max(abs(lo), abs(hi)) * scale < 2**30
    rows = []
    for s, finite in zip(chunks, all_finite, strict=True):
        if finite and narrow and s.dtype == torch.float32 and _cpu_path(s):
            counts = torch.from_numpy(_bin_counts(s.numpy().reshape(-1), scale, start - 1, bins + 2))
        elif finite and narrow and s.dtype == torch.float32:
            t = s.reshape(-1) * scale
            idx = t.floor_().to(torch.int32).sub_(start - 1)
            counts = torch.bincount(idx, minlength=bins + 2)
        else:
            x = s.reshape(-1).double()
            ok = torch.isfinite(x)
            idx64 = torch.floor(x[ok] * scale).long() - (start - 1)  # exact: a power of 2
            counts = torch.bincount(idx64, minlength=bins + 2)
            counts[0] += int((x == -math.inf).sum())
            counts[-1] += int((~ok).sum() - (x == -math.inf).sum())
        rows.append(counts.cpu().numpy().astype(np.int64))
    return RangeHistogram(exp, start, np.stack(rows) if rows else np.zeros((0, bins + 2), np.int64))


def _bin_counts(a: np.ndarray, scale: float, offset: int, length: int) -> np.ndarray:
    """``bincount(floor(a * scale) - offset)`` for float32 ``a`` whose products by the power of
    two ``scale`` are exact and whose bins fall in ``[0, length)``: in numpy a chunk at a time
    through two reused buffers (torch's own ops allocate and fault in a full-size copy per step)."""
    counts = np.zeros(length, dtype=np.int64)
    f = np.float32(scale)
    buf = np.empty(min(SMALL_CHUNK, a.size), dtype=np.float32)
    idx = np.empty(len(buf), dtype=np.int64)
    for i in range(0, a.size, SMALL_CHUNK):
        part, ints = buf[: min(SMALL_CHUNK, a.size - i)], idx[: min(SMALL_CHUNK, a.size - i)]
        np.multiply(a[i : i + SMALL_CHUNK], f, out=part)
        np.floor(part, out=part)
        ints[...] = part  # exact: whole numbers below 2**30
        ints -= offset
        counts += np.bincount(ints, minlength=length)
    return counts


def merge_range_histograms(hists: list[RangeHistogram], bins: int = RANGE_BINS) -> list[RangeHistogram]:
    """The histograms on one common grid (the coarsest of theirs, coarsened further until their
    occupied bins fit in ``bins``): counts unchanged, so they add bin by bin."""
    exp = max(h.exp for h in hists)
    spans = [(h, h.occupied()) for h in hists]
    while True:
        ends = [(a >> (exp - h.exp), b >> (exp - h.exp)) for h, span in spans if span for a, b in [span]]
        start = min((a for a, _ in ends), default=0)
        if not ends or max(b for _, b in ends) - start + 1 <= bins:
            break
        exp += 1
    return [h.regrid(exp, start, bins) for h in hists]


def sorted_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` sorted along its last axis (NaN and +inf last). On the CPU through numpy's sort,
    which is vectorised: about 10x torch's for rows of 50-500 values (measured on AVX-512)."""
    import torch

    if _cpu_path(x) and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.sort(x.numpy(), axis=-1))
    return x.sort(-1).values


def row_stats(probs: torch.Tensor, allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Per softmax row (last axis): max, median, min over the allowed keys, and entropy in nats.

    ``allowed`` broadcasts against ``probs`` (None: every key counts). The median of an even
    count is the mean of the two middle values (numpy's convention). Rows with no allowed key
    give NaN. Computed in the probabilities' own precision (float32 from the probe), returned as
    float64.
    """
    import torch

    p = probs if probs.dtype in (torch.float32, torch.float64) else probs.float()
    size = p.shape[-1]
    if allowed is None:
        ordered = sorted_rows(p)
        lo, hi = ordered[..., (size - 1) // 2], ordered[..., size // 2]
        median = (lo.double() + hi.double()) / 2
        entropy = -row_sums64(torch.special.xlogy(p, p))
        return ordered[..., -1].double(), median, ordered[..., 0].double(), entropy
    blocked = ~allowed
    m = allowed.expand(*allowed.shape[:-1], size).sum(-1, keepdim=True)  # the mask's own shape
    ordered = sorted_rows(p.masked_fill(blocked, math.inf))  # blocked keys sort last
    last = (m - 1).clamp(min=0).expand(*p.shape[:-1], 1)
    row_min = ordered[..., 0].double()
    row_max = ordered.gather(-1, last).squeeze(-1).double()
    lo, hi = last // 2, (m // 2).clamp(max=size - 1).expand(*p.shape[:-1], 1)
    median = (ordered.gather(-1, lo).double() + ordered.gather(-1, hi).double()).squeeze(-1) / 2
    entropy = -row_sums64(torch.special.xlogy(p, p).masked_fill_(blocked, 0.0))
    empty = (m.squeeze(-1) == 0).expand_as(row_min)
    return tuple(t.masked_fill(empty, math.nan) for t in (row_max, median, row_min, entropy))


@dataclass
class HeadStats:
    """One head's final statistics (plain floats, NaN where nothing was seen)."""

    head: int
    kv_head: int
    n_queries: int
    n_keys: int
    q_mean_norm: float
    k_mean_norm: float
    q_bar_norm: float
    k_bar_norm: float
    cos_qk_bar: float
    dot_qk_bar: float
    q_avg_cos: float
    k_avg_cos: float
    n_scores: int
    score_mean: float
    score_std: float
    score_min: float
    score_max: float
    softmax_max: float
    softmax_median: float
    softmax_min: float
    entropy: float


class _Sums:
    """Mergeable state for a set of float64 sums (``SUMS``, which add) and running extremes
    (``MINS``/``MAXES``, which take min/max): a shard's state merges into another's exactly."""

    SUMS: tuple[str, ...] = ()
    MINS: tuple[str, ...] = ()
    MAXES: tuple[str, ...] = ()

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors, by name (safetensors-storable)."""
        return {k: getattr(self, k) for k in (*self.SUMS, *self.MINS, *self.MAXES)}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take (a copy of) ``state``, on this object's device."""
        for k in (*self.SUMS, *self.MINS, *self.MAXES):
            mine = getattr(self, k)
            if state[k].shape != mine.shape:
                raise ValueError(f"cannot load {k} of shape {tuple(state[k].shape)} into {tuple(mine.shape)}")
            setattr(self, k, state[k].to(mine.device).clone())

    def merge(self, other: _Sums) -> None:
        """Fold in another shard's sums."""
        import torch

        for k in self.SUMS:
            getattr(self, k).add_(getattr(other, k).to(getattr(self, k).device))
        for k in self.MINS:
            setattr(self, k, torch.minimum(getattr(self, k), getattr(other, k).to(getattr(self, k).device)))
        for k in self.MAXES:
            setattr(self, k, torch.maximum(getattr(self, k), getattr(other, k).to(getattr(self, k).device)))


class VectorSums(_Sums):
    """Float64 sums over the kept vectors of each head: mean vector, mean norm, exact avg_cos."""

    SUMS = ("n", "sum", "sum_unit", "sum_norm", "n_nonzero")

    def __init__(self, heads: int, dim: int, device: torch.device) -> None:
        import torch

        f64 = torch.float64
        self.n = torch.zeros(heads, dtype=f64, device=device)
        self.sum = torch.zeros((heads, dim), dtype=f64, device=device)
        self.sum_unit = torch.zeros((heads, dim), dtype=f64, device=device)
        self.sum_norm = torch.zeros(heads, dtype=f64, device=device)
        self.n_nonzero = torch.zeros(heads, dtype=f64, device=device)

    def add(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """``x``: (B, H, T, d); ``keep``: (B, T) bool, the positions that count (None: all).
        Converted to float64 a chunk of positions at a time (see :data:`CHUNK_ELEMENTS`)."""
        import torch

        if not _cpu_path(x):  # masked, not gathered: no count is read on the host (issue 15)
            v = x.permute(1, 0, 2, 3)
            v = (v if keep is None else torch.where(keep[None, :, :, None], v, 0)).to(torch.float64)
            v = v.flatten(1, 2)  # (H, B T, d); a zeroed row adds nothing and has no direction
            self.n += v.shape[1] if keep is None else keep.sum()
            self._fold(v)
            return
        heads, dim = x.shape[1], x.shape[-1]
        kept = x.permute(1, 0, 2, 3)
        if keep is None:
            kept = kept.reshape(heads, -1, dim)
        elif x.dtype in (torch.float32, torch.float64):
            kept = torch.from_numpy(_kept_rows(x.detach().numpy(), keep.numpy()))  # (H, m, d)
        else:
            kept = kept[:, keep]
        step = max(1, CHUNK_ELEMENTS // (heads * dim))  # the CPU: no fresh 50 MB block per call
        flat = _scratch64(heads * min(step, kept.shape[1]) * dim)  # one block for every call
        for i in range(0, kept.shape[1], step):
            chunk = kept[:, i : i + step]
            v = flat[: chunk.numel()].view(chunk.shape).copy_(chunk)  # contiguous, as .to() made it
            self.n += v.shape[1]
            self._fold(v, scratch=True)

    def _fold(self, v: torch.Tensor, scratch: bool = False) -> None:
        """Add the rows of ``v`` (H, m, d, float64); a zero row adds nothing and has no direction.
        ``scratch``: ``v`` is a work buffer, divided by the norms in place (the same quotients)."""
        import torch

        norms = torch.linalg.vector_norm(v, dim=-1)
        self.sum += v.sum(1)
        self.sum_norm += norms.sum(1)
        nonzero = norms > 0
        self.n_nonzero += nonzero.sum(1)
        divisor = torch.where(nonzero, norms, 1.0)[..., None]
        self.sum_unit += (v.div_(divisor) if scratch else v / divisor).sum(1)

    def mean(self) -> npt.NDArray[np.float64]:
        """(H, d) mean vectors (NaN for a head that saw nothing)."""
        n = self.n.cpu().numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            out: npt.NDArray[np.float64] = self.sum.cpu().numpy() / n[:, None]
        return out

    def summary(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per head: mean norm, norm of the mean, exact mean pairwise cosine."""
        n = self.n.cpu().numpy()
        nz = self.n_nonzero.cpu().numpy()
        su = self.sum_unit.cpu().numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_norm = self.sum_norm.cpu().numpy() / n
            bar_norm = np.linalg.norm(self.mean(), axis=1)
            avg_cos = np.where(nz >= 2, (np.einsum("hd,hd->h", su, su) - nz) / (nz * (nz - 1)), np.nan)
        return mean_norm, bar_norm, avg_cos


class ScoreSums(_Sums):
    """Per head: histogram of pre-softmax scores and running moments, over allowed pairs."""

    SUMS, MINS, MAXES = ("hist", "n", "sum", "sumsq"), ("min",), ("max",)

    def __init__(self, heads: int, device: torch.device, *, histogram: bool = True) -> None:
        import torch

        f64 = torch.float64
        bins = SCORE_BINS + 2 if histogram else 0  # drift-block bins its scores on a data range
        self.hist = torch.zeros((heads, bins), dtype=torch.int64, device=device)
        self.n = torch.zeros(heads, dtype=f64, device=device)
        self.sum = torch.zeros(heads, dtype=f64, device=device)
        self.sumsq = torch.zeros(heads, dtype=f64, device=device)
        self.min = torch.full((heads,), math.inf, dtype=f64, device=device)
        self.max = torch.full((heads,), -math.inf, dtype=f64, device=device)

    def add(self, scores: torch.Tensor, pairs: torch.Tensor | None = None) -> None:
        """``scores``: (B, H, T, S); ``pairs``: bool broadcastable to it, the pairs that count
        (None: all of them). The mask is used at its own shape, never expanded to the scores'."""
        import torch

        heads = scores.shape[1]
        s = scores if scores.dtype in (torch.float32, torch.float64) else scores.float()
        if pairs is not None and self.hist.shape[1] and _cpu_path(s):
            self._add_kept(s.numpy(), pairs.numpy())
            return
        per_head = (0, 2, 3)
        blocked = None if pairs is None else ~pairs
        if self.hist.shape[1]:
            width = heads * (SCORE_BINS + 2)
            idx = score_bins(s)
            offsets = torch.arange(heads, dtype=idx.dtype, device=s.device) * (SCORE_BINS + 2)
            idx += offsets.view(1, heads, 1, 1)
            if blocked is not None:
                idx.masked_fill_(blocked, width)  # one spare bin past the last head's
            flat = idx.view(-1).long()
            if _cpu_path(s):
                counts = torch.bincount(flat, minlength=width + 1)
            else:  # index_add_: bincount's length is its largest index, read on the host (issue 15)
                counts = torch.zeros(width + 1, dtype=torch.int64, device=s.device)
                counts.index_add_(0, flat, torch.ones_like(flat))
            self.hist += counts[:width].view(heads, -1)
        if blocked is None and _cpu_path(s):
            self.n += s.shape[0] * s.shape[2] * s.shape[3]
            self.sum += row_sums64(s).sum((0, 2))
            self.sumsq += torch.from_numpy(_square_row_sums64(s.numpy())).sum((0, 2))
            a = s.numpy()  # numpy's min and max: single-threaded SIMD, no wait on a busy core
            self.min = torch.minimum(self.min, torch.from_numpy(np.asarray(a.min(axis=per_head))).double())
            self.max = torch.maximum(self.max, torch.from_numpy(np.asarray(a.max(axis=per_head))).double())
            return
        if blocked is None:
            self.n += s.shape[0] * s.shape[2] * s.shape[3]
            self.sum += row_sums64(s).sum((0, 2))
            self.sumsq += row_sums64(s.square()).sum((0, 2))
            self.min = torch.minimum(self.min, s.amin(per_head).double())
            self.max = torch.maximum(self.max, s.amax(per_head).double())
            return
        assert pairs is not None
        self.n += pairs.expand(s.shape[0], pairs.shape[1], *s.shape[2:]).sum(per_head)
        kept = s.masked_fill(blocked, 0.0)  # one copy, refilled in place for each statistic
        self.sum += row_sums64(kept).sum((0, 2))
        self.min = torch.minimum(self.min, kept.masked_fill_(blocked, math.inf).amin(per_head).double())
        self.max = torch.maximum(self.max, kept.masked_fill_(blocked, -math.inf).amax(per_head).double())
        self.sumsq += row_sums64(kept.masked_fill_(blocked, 0.0).square_()).sum((0, 2))

    def _add_kept(self, a: np.ndarray, pairs: np.ndarray) -> None:
        """The CPU's path: each head's counted scores gathered once into one 1-D array, and every
        statistic taken on it without masks (:func:`_score_sums_np`)."""
        import torch

        b, heads, t, size = a.shape
        pairs = np.broadcast_to(pairs, (b, pairs.shape[1], t, size))
        hist = np.zeros((heads, SCORE_BINS + 2), dtype=np.int64)
        n, sums, squares = (np.zeros(heads) for _ in range(3))
        lo, hi = np.full(heads, math.inf), np.full(heads, -math.inf)
        for h in range(heads):
            x = a[:, h][pairs[:, h if pairs.shape[1] > 1 else 0]]
            if x.size:
                hist[h], sums[h], squares[h], lo[h], hi[h] = _score_sums_np(x)
                n[h] = x.size
        self.hist += torch.from_numpy(hist)
        self.n += torch.from_numpy(n)
        self.sum += torch.from_numpy(sums)
        self.sumsq += torch.from_numpy(squares)
        self.min = torch.minimum(self.min, torch.from_numpy(lo))
        self.max = torch.maximum(self.max, torch.from_numpy(hi))


class RowSums(_Sums):
    """Per head: sums over kept query rows of the softmax row max, median, min and entropy."""

    SUMS = ("n", "sums")

    def __init__(self, heads: int, device: torch.device) -> None:
        import torch

        self.n = torch.zeros(heads, dtype=torch.float64, device=device)
        self.sums = torch.zeros((4, heads), dtype=torch.float64, device=device)

    def add(self, probs: torch.Tensor, allowed: torch.Tensor, rows: torch.Tensor) -> None:
        """``probs``: (B, H, T, S), a softmax over the allowed keys (so a blocked key holds 0);
        ``allowed``: keys per row; ``rows``: (B, T) query rows that count."""
        import torch

        if _cpu_path(probs) and probs.dtype in (torch.float32, torch.float64):
            self._add_kept(probs.numpy(), allowed.numpy(), rows.numpy())
            return
        stats = row_stats(probs, allowed)
        for i, x in enumerate(stats):  # x: (B, H, T); rows masked, not dropped
            self.sums[i] += torch.where(rows[:, None, :], x, 0.0).sum((0, 2))
        self.n += rows.sum()

    def _add_kept(self, p: np.ndarray, allowed: np.ndarray, rows: np.ndarray) -> None:
        """The CPU's path: the counted rows gathered once and sorted in place. A blocked key
        holds 0, so with m allowed keys of S the allowed values are the row's last m once sorted
        (the zeros before them are interchangeable): no fill with +inf before the sort."""
        import torch

        b, _, t, size = p.shape
        sel = _kept_rows(p, rows)  # (H, n, S), a copy of its own
        allowed = np.broadcast_to(allowed, (b, allowed.shape[1], t, size))
        m = np.count_nonzero(_kept_rows(allowed, rows), axis=-1)  # (1|H, n)
        entropy = np.array([-_entropy_sum_np(head) for head in sel])
        sel.sort(axis=-1)
        first = np.broadcast_to(np.minimum(size - m, size - 1), sel.shape[:2])

        def at(index: np.ndarray) -> np.ndarray:
            return np.take_along_axis(sel, index[..., None], axis=-1)[..., 0].astype(np.float64)

        mid_lo = first + np.broadcast_to(np.maximum(m - 1, 0) // 2, first.shape)
        mid_hi = first + np.broadcast_to(m // 2, first.shape)
        median = (at(mid_lo) + at(np.minimum(mid_hi, size - 1))) / 2
        sums = np.stack([at(np.full(first.shape, size - 1)), median, at(first)]).sum(-1)
        sums = np.concatenate([sums, entropy[None]])
        empty = np.broadcast_to((m == 0).any(-1), sums.shape[1:])  # a counted row allowing no key
        sums[:, empty] = math.nan
        self.sums += torch.from_numpy(sums)
        self.n += float(sel.shape[1])

    def means(self) -> npt.NDArray[np.float64]:
        """(4, H): mean row max, median, min, entropy."""
        with np.errstate(invalid="ignore", divide="ignore"):
            out: npt.NDArray[np.float64] = self.sums.cpu().numpy() / self.n.cpu().numpy()[None, :]
        return out


class AttentionAccumulator:
    """Everything about one attention module over a corpus: fixed size, folded batch by batch."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = VectorSums(heads, head_dim, device)
        self.k = VectorSums(kv_heads, head_dim, device)
        self.scores = ScoreSums(heads, device)
        self.rows = RowSums(heads, device)

    def kv_of(self, head: int) -> int:
        """The key/value head a query head reads (grouped-query attention shares them)."""
        return head // (self.heads // self.kv_heads)

    def add(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        scores: torch.Tensor,
        probs: torch.Tensor,
        *,
        q_keep: torch.Tensor,
        k_keep: torch.Tensor,
        allowed: torch.Tensor,
    ) -> None:
        """Fold one batch: ``q`` (B, H, T, d), ``k`` (B, Hkv, S, d), ``scores``/``probs``
        (B, H, T, S) before and after the softmax, ``q_keep`` (B, T) and ``k_keep`` (B, S) the
        positions that count as vectors and rows, ``allowed`` (B, 1|H, T, S) the pairs the
        model's mask lets through."""
        self.q.add(q, q_keep)
        self.k.add(k, k_keep)
        pairs = allowed & q_keep[:, None, :, None]
        self.scores.add(scores, pairs)
        self.rows.add(probs, allowed, q_keep)

    _PARTS = ("q", "k", "scores", "rows")

    def state(self) -> dict[str, Any]:
        """All sums as one flat dict (``q.sum``, ``scores.hist``, ...) plus the head layout."""
        out: dict[str, Any] = {"heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim}
        for part in self._PARTS:
            out |= {f"{part}.{k}": v for k, v in getattr(self, part).state().items()}
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device | None = None) -> AttentionAccumulator:
        """An accumulator holding (a copy of) ``state``, on ``device`` (default: the CPU)."""
        import torch

        device = torch.device("cpu") if device is None else device
        acc = cls(int(state["heads"]), int(state["kv_heads"]), int(state["head_dim"]), device)
        for part in cls._PARTS:
            prefix = f"{part}."
            getattr(acc, part).load_state(
                {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            )
        return acc

    def merge(self, other: AttentionAccumulator) -> None:
        """Fold in another shard's accumulator of the same module (sums add, extremes min/max)."""
        if (self.heads, self.kv_heads, self.head_dim) != (other.heads, other.kv_heads, other.head_dim):
            raise ValueError("cannot merge attention accumulators of different head layouts")
        for part in self._PARTS:
            getattr(self, part).merge(getattr(other, part))

    def finalize(self) -> list[HeadStats]:
        q_mean_norm, q_bar_norm, q_avg = self.q.summary()
        k_mean_norm, k_bar_norm, k_avg = self.k.summary()
        q_bar, k_bar = self.q.mean(), self.k.mean()
        row = self.rows.means()
        n = self.scores.n.cpu().numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = self.scores.sum.cpu().numpy() / n
            var = np.maximum(self.scores.sumsq.cpu().numpy() / n - mean**2, 0.0)
        lo, hi = self.scores.min.cpu().numpy(), self.scores.max.cpu().numpy()
        out = []
        for h in range(self.heads):
            g = self.kv_of(h)
            dot = float(q_bar[h] @ k_bar[g])
            denom = q_bar_norm[h] * k_bar_norm[g]
            out.append(
                HeadStats(
                    head=h,
                    kv_head=g,
                    n_queries=int(self.q.n[h]),
                    n_keys=int(self.k.n[g]),
                    q_mean_norm=float(q_mean_norm[h]),
                    k_mean_norm=float(k_mean_norm[g]),
                    q_bar_norm=float(q_bar_norm[h]),
                    k_bar_norm=float(k_bar_norm[g]),
                    cos_qk_bar=float(dot / denom) if denom > 0 else math.nan,
                    dot_qk_bar=dot,
                    q_avg_cos=float(q_avg[h]),
                    k_avg_cos=float(k_avg[g]),
                    n_scores=int(n[h]),
                    score_mean=float(mean[h]),
                    score_std=float(math.sqrt(var[h])) if n[h] > 0 else math.nan,
                    score_min=float(lo[h]) if n[h] > 0 else math.nan,
                    score_max=float(hi[h]) if n[h] > 0 else math.nan,
                    softmax_max=float(row[0, h]),
                    softmax_median=float(row[1, h]),
                    softmax_min=float(row[2, h]),
                    entropy=float(row[3, h]),
                )
            )
        return out

    def histograms(self) -> np.ndarray:
        """(H, BINS + 2) counts: underflow, the bins of :func:`score_edges`, overflow."""
        return self.scores.hist.cpu().numpy()
