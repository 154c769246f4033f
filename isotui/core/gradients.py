"""The gradient view of anisotropy: one layer's loss gradients against its activations, one pass.

Per layer, over the kept tokens i = 1..n with activation x_i and loss gradient g_i = dL/dx_i (both
in R^d), everything is summed in float64:

- the gradients' own geometry, as the activations' in design.md: ``grad_avg_cos`` (exact mean
  pairwise cosine from the sum of unit vectors; zero gradients counted and skipped),
  ``grad_drift_norm`` = ||mean g||, ``grad_mean_norm`` = mean ||g_i|| (zeros included);
- the activations' covariance (streamed, shifted by the first batch's mean for stability) and the
  gradients' second moment G = sum_i g_i g_i^T, so that the share of gradient energy inside any
  k-dimensional subspace with orthonormal basis V (d x k) is exact and needs no second pass:
  sum_i ||V V^T g_i||^2 / sum_i ||g_i||^2 = trace(V^T G V) / trace(G).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from isotui.core.accumulator import avg_cos_from_sums, recentre
from isotui.core.counters import DeviceCount

if TYPE_CHECKING:
    import torch


def random_basis(d: int, k: int, seed: int) -> np.ndarray:
    """A seeded random orthonormal basis (d x k) of a uniformly random k-dimensional subspace:
    the Q of the QR decomposition of a standard Gaussian d x k matrix (signs fixed by R's diagonal)."""
    rng = np.random.default_rng(seed)
    q, r = np.linalg.qr(rng.standard_normal((d, k)))
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def subspace_share(g2: np.ndarray, basis: np.ndarray) -> float:
    """trace(V^T G V) / trace(G): the share of the energy sum_i ||g_i||^2 inside span(V)."""
    total = float(np.trace(g2))
    if total <= 0:
        return math.nan
    return float(np.einsum("ik,ij,jk->", basis, g2, basis) / total)


def top_eigvecs(cov: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (descending) and the top-k eigenvectors as COLUMNS (d x k) of a symmetric matrix."""
    vals, vecs = np.linalg.eigh((cov + cov.T) / 2)
    order = np.argsort(vals)[::-1]
    return vals[order], vecs[:, order[:k]]


@dataclass
class GradLayerStats:
    dim: int
    n_vectors: int
    n_zero: int  # kept tokens whose gradient is exactly zero (skipped by grad_avg_cos)
    grad_avg_cos: float
    grad_drift_norm: float
    grad_mean_norm: float
    act_avg_cos: float  # the activations' avg_cos over the same tokens, for comparison
    top_share: float  # share of gradient energy in the activations' top-k principal directions
    random_share: float  # ... in the seeded random k-dimensional subspace (the measured control)
    expected_share: float  # k / d: the expectation for a uniformly random k-dimensional subspace
    act_top_var: float  # share of the activations' variance in their own top k directions
    grad_top_share: float  # the most any k-dimensional subspace can hold (G's own top-k eigenvalues)


@dataclass
class GradSums:
    """One batch's sums (:meth:`GradAccumulator.partial`), on the accumulator's device."""

    n: int
    n_grad: torch.Tensor
    n_act: torch.Tensor
    sum_gu: torch.Tensor
    sum_g: torch.Tensor
    sum_gnorm: torch.Tensor
    g2: torch.Tensor
    sum_xu: torch.Tensor
    shift: torch.Tensor  # the activations' shift (the first batch's mean, or the accumulator's)
    sum_xs: torch.Tensor
    x2: torch.Tensor


class GradAccumulator:
    """Streams one layer's (activation, gradient) pairs; ``finalize`` gives :class:`GradLayerStats`."""

    def __init__(self, dim: int, device: torch.device) -> None:
        import torch

        f64 = torch.float64
        self.dim, self.device = dim, device
        self.n_all = 0
        # non-zero gradients and activations: counted on the device, read once at the end
        self._n_grad = torch.zeros((), dtype=torch.int64, device=device)
        self._n_act = torch.zeros((), dtype=torch.int64, device=device)
        self.sum_gu = torch.zeros(dim, dtype=f64, device=device)
        self.sum_g = torch.zeros(dim, dtype=f64, device=device)
        self.sum_gnorm = torch.zeros((), dtype=f64, device=device)
        self.g2 = torch.zeros((dim, dim), dtype=f64, device=device)
        self.sum_xu = torch.zeros(dim, dtype=f64, device=device)
        self.shift: torch.Tensor | None = None
        self.sum_xs = torch.zeros(dim, dtype=f64, device=device)
        self.x2 = torch.zeros((dim, dim), dtype=f64, device=device)

    n_grad = DeviceCount("Non-zero gradients (a device read: once, at the end).")
    n_act = DeviceCount("Non-zero activations (a device read: once, at the end).")

    def add(self, x: torch.Tensor, g: torch.Tensor) -> None:
        """Fold in m tokens: activations ``x`` and their gradients ``g`` (both m x d), in one go
        (:meth:`partial` then :meth:`commit`)."""
        self.commit(self.partial(x, g))

    def partial(self, x: torch.Tensor, g: torch.Tensor) -> GradSums | None:
        """One batch's sums of m tokens: activations ``x`` and their gradients ``g`` (both
        m x d); None for none. Nothing here changes the accumulator, so a batch whose sums ran
        out of memory may be retried (:meth:`commit` adds them in). Nothing is read on the host
        (zero rows are masked, not dropped: a GPU never waits), and the d x d products are
        float32, added into the float64 sums (see isotui.core.products)."""
        import torch

        from isotui.core.products import gram

        if not len(x):
            return None
        x64 = x.detach().to(self.device, torch.float64)
        g64 = g.detach().to(self.device, torch.float64)
        gn = torch.linalg.vector_norm(g64, dim=1)
        gz = gn > 0
        xn = torch.linalg.vector_norm(x64, dim=1)
        xz = xn > 0
        # the first batch's mean shifts the activations' sums (set by its commit)
        shift = x64.mean(0) if self.shift is None else self.shift
        xs = x64 - shift
        return GradSums(
            n=len(x64),
            n_grad=gz.sum(),
            n_act=xz.sum(),
            sum_gu=(g64 / torch.where(gz, gn, 1.0)[:, None]).sum(0),  # a zero row stays 0
            sum_g=g64.sum(0),
            sum_gnorm=gn.sum(),
            # G is not centred: its float32 rounding is relative to its own entries (the shares
            # are ratios of positive sums, no cancellation)
            g2=gram(g64),
            sum_xu=(x64 / torch.where(xz, xn, 1.0)[:, None]).sum(0),
            shift=shift,
            sum_xs=xs.sum(0),
            x2=gram(xs),
        )

    def commit(self, sums: GradSums | None) -> None:
        """Add one batch's :meth:`partial` sums (in place: no memory is asked for)."""
        if sums is None:
            return
        self.n_all += sums.n
        self._n_grad += sums.n_grad
        self._n_act += sums.n_act
        self.sum_gu += sums.sum_gu
        self.sum_g += sums.sum_g
        self.sum_gnorm += sums.sum_gnorm
        self.g2 += sums.g2
        self.sum_xu += sums.sum_xu
        if self.shift is None:
            self.shift = sums.shift
        self.sum_xs += sums.sum_xs
        self.x2 += sums.x2

    _SUMS = ("sum_gu", "sum_g", "sum_gnorm", "g2", "sum_xu")
    _COUNTS = ("n_all", "n_grad", "n_act")

    def state(self) -> dict[str, Any]:
        """The folded sums as tensors and plain scalars (safetensors-storable, no pickle)."""
        state: dict[str, Any] = {"dim": self.dim} | {k: getattr(self, k) for k in self._COUNTS}
        for k in (*self._SUMS, "sum_xs", "x2", "shift"):
            if getattr(self, k) is not None:
                state[k] = getattr(self, k)
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device | None = None) -> GradAccumulator:
        """An accumulator holding (a copy of) ``state``, on ``device`` (default: the CPU)."""
        import torch

        acc = cls(int(state["dim"]), torch.device("cpu") if device is None else device)
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                setattr(acc, k, v.to(acc.device).clone())
            elif k in cls._COUNTS:
                setattr(acc, k, int(v))
        return acc

    def merge(self, other: GradAccumulator) -> None:
        """Fold in another shard's accumulator: sums add; the activations' shifted second moment
        is re-centred to this one's shift exactly (see :func:`isotui.core.accumulator.recentre`)."""
        if other.dim != self.dim:
            raise ValueError(f"cannot merge gradient accumulators of sizes {self.dim} and {other.dim}")
        dev = self.device
        for k in self._COUNTS:
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for k in self._SUMS:
            getattr(self, k).add_(getattr(other, k).to(dev))
        if other.shift is None:
            return
        o_s, o_x2 = other.sum_xs.to(dev), other.x2.to(dev)
        if self.shift is None:
            self.shift = other.shift.to(dev).clone()
        else:
            o_s, _, o_x2 = recentre(other.shift.to(dev), self.shift, other.n_all, o_s, gram=o_x2)
        self.sum_xs.add_(o_s)
        self.x2.add_(o_x2)

    def finalize(self, k: int, basis: np.ndarray) -> GradLayerStats:
        """The metrics, with the top-``k`` principal directions and the random ``basis`` (d x k)."""
        n, d = self.n_all, self.dim
        g2 = self.g2.cpu().numpy()
        nan = math.nan
        if n:
            ms = self.sum_xs.cpu().numpy() / n
            cov = self.x2.cpu().numpy() / n - np.outer(ms, ms)
            act_vals, top = top_eigvecs(cov, k)
            act_var = float(act_vals[:k].sum() / act_vals.sum()) if act_vals.sum() > 0 else nan
            g_vals = np.linalg.eigvalsh((g2 + g2.T) / 2)[::-1]
            trace = float(np.trace(g2))
            grad_top = float(g_vals[:k].sum() / trace) if trace > 0 else nan
            top_share, rand_share = subspace_share(g2, top), subspace_share(g2, basis)
        else:
            act_var = grad_top = top_share = rand_share = nan
        return GradLayerStats(
            dim=d,
            n_vectors=n,
            n_zero=n - self.n_grad,
            grad_avg_cos=avg_cos_from_sums(self.sum_gu.cpu().numpy(), self.n_grad),
            grad_drift_norm=float(np.linalg.norm(self.sum_g.cpu().numpy() / n)) if n else nan,
            grad_mean_norm=float(self.sum_gnorm.cpu()) / n if n else nan,
            act_avg_cos=avg_cos_from_sums(self.sum_xu.cpu().numpy(), self.n_act),
            top_share=top_share,
            random_share=rand_share,
            expected_share=k / d,
            act_top_var=act_var,
            grad_top_share=grad_top,
        )
