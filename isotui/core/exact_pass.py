"""``--exact``'s second pass: the reservoir-sampled metrics over every vector.

Where :mod:`isotui.core.sampled` estimates avg_cos_centered, I(W), centred I(W), all-but-the-top
and standardised avg_cos from the reservoir with their standard errors, :class:`ExactPass`
streams the data again with the first pass's mean, per-dimension std and the eigenvectors of the
exact second moment and covariance, summing over every vector.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from isotui.core.accumulator import LayerAccumulator, LayerStats, avg_cos_from_sums
from isotui.core.isotropy import abtt_components
from isotui.core.sampled import se_name

if TYPE_CHECKING:
    import torch


class ExactPass:
    """One layer's second pass: every vector, the first pass's mean, std and eigenvectors.

    Same two-phase interface as :class:`~isotui.core.accumulator.LayerAccumulator` (``partial``
    allocates, ``commit`` adds), so a batch that runs out of memory can be retried."""

    def __init__(self, acc: LayerAccumulator) -> None:
        import torch

        from isotui.core.products import split_right

        f64, dev = torch.float64, acc.device
        self.device = dev
        n = acc.n_all
        self.mean = acc.sum_x / n
        std = torch.as_tensor(acc.dim_std(n), dtype=f64, device=dev)
        self.live = torch.nonzero(std > 0).squeeze(1)  # indices, read once here: no mask per batch
        self.std = std[self.live]
        # full_cov holds the gram matrix; n >= 2 means a batch has set the shift
        exact = acc.exact_eigen()  # with its directions (the default)
        self.eigen = exact is not None
        if exact is not None:
            assert exact.vecs is not None and exact.vecs_c is not None
            self.vecs, self.vecs_c = exact.vecs, exact.vecs_c  # largest first
            self.top = self.vecs_c[:, : abtt_components(acc.dim)]
            # the products with the centred vectors are float32 (see isotui.core.products), I(W)'s
            # split three ways (one float32 product moved it by 5e-6); x . w = (x - mean) . w +
            # mean . w, the second in float64 once per layer
            self.both = split_right(torch.cat([self.vecs, self.vecs_c], 1))
            self.offset = self.vecs.T @ self.mean
            self.log_z = torch.full((2 * acc.dim,), -math.inf, dtype=f64, device=dev)
            self.log_zc = torch.full((2 * acc.dim,), -math.inf, dtype=f64, device=dev)
        self.sums = {m: torch.zeros(acc.dim, dtype=f64, device=dev) for m in ("centered", "abtt")}
        self.sums["std"] = torch.zeros(len(self.live), dtype=f64, device=dev)
        # counts stay on the device until :meth:`values` (reading one would wait for it)
        self.counts = {m: torch.zeros((), dtype=torch.int64, device=dev) for m in self.sums}

    def partial(self, x: torch.Tensor, *_ignored: object) -> dict[str, Any]:
        """Sums of one batch's vectors ``x`` (m x d); nothing is read on the host (zero rows are
        masked, not dropped), and the d x d products are float32 (see isotui.core.products)."""
        import torch

        from isotui.core.products import mm32, mm_split

        x64 = x.to(self.device).to(torch.float64)
        v = x64 - self.mean
        parts = {"centered": v, "std": v.index_select(1, self.live) / self.std}
        out: dict[str, Any] = {}
        if self.eigen:
            d = self.top.shape[0]
            # m x d x k, k = d / 100, in float32: within 1e-9 of float64 on avg_cos_abtt
            parts["abtt"] = v - mm32(mm32(v, self.top), self.top.T)
            both = mm_split(v, self.both)  # logsumexp in float64: I(W) is a ratio of exps
            proj, proj_c = both[:, :d], both[:, d:]
            out["log_z"] = torch.cat([torch.logsumexp(proj, 0), torch.logsumexp(-proj, 0)])
            out["log_z"] += torch.cat([self.offset, -self.offset])
            out["log_zc"] = torch.cat([torch.logsumexp(proj_c, 0), torch.logsumexp(-proj_c, 0)])
        for name, rows in parts.items():
            norms = torch.linalg.vector_norm(rows, dim=1)
            keep = norms > 0
            out[name] = ((rows / torch.where(keep, norms, 1.0)[:, None]).sum(0), keep.sum())
        return out

    def commit(self, p: dict[str, Any]) -> None:
        import torch

        for name in self.sums:
            if name in p:
                self.sums[name].add_(p[name][0])
                self.counts[name].add_(p[name][1])
        if "log_z" in p and len(p["log_z"]):
            torch.logaddexp(self.log_z, p["log_z"], out=self.log_z)
            torch.logaddexp(self.log_zc, p["log_zc"], out=self.log_zc)

    def values(self) -> dict[str, float]:
        """The exact metrics (and their standard errors, 0)."""

        def mean_cos(name: str) -> float:
            return avg_cos_from_sums(self.sums[name].cpu().numpy(), int(self.counts[name]))

        out = {"avg_cos_centered": mean_cos("centered"), "avg_cos_std": mean_cos("std")}
        if self.eigen:
            out["avg_cos_abtt"] = mean_cos("abtt")
            out["iw"] = float(np.exp(float(self.log_z.min() - self.log_z.max())))
            out["iw_centered"] = float(np.exp(float(self.log_zc.min() - self.log_zc.max())))
        return out | {se_name(m): 0.0 for m in out}

    def apply(self, stats: LayerStats) -> LayerStats:
        """``stats`` with the sampled metrics replaced by the exact ones."""
        # mypy checks a **dict against every field; the keys are SAMPLED and their SEs (floats)
        return dataclasses.replace(stats, **self.values())  # type: ignore[arg-type]
