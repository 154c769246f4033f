"""Streaming per-layer accumulators: exact anisotropy statistics in one pass, O(d) or O(d^2) memory.

Everything is accumulated in float64 on the model's device, whatever the model's dtype (fp16
norms overflow). A batch is folded in two phases, ``partial`` (allocates) then ``commit``
(cheap in-place adds), so an out-of-memory error in the middle of a batch leaves no half-added
state behind and the batch can be retried.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, overload

import numpy as np
import numpy.typing as npt

from isotui.core.counters import DeviceCount
from isotui.core.exact_spectrum import ExactEigen, exact_eigen
from isotui.core.isotropy import isoscore_star
from isotui.core.plugin import STATE_PREFIX, Plugged, PluginError, State, StreamingMetric, lookup
from isotui.core.products import gram
from isotui.core.sampled import SAMPLED, Groups, cos_jackknife_se, key_groups, sample_metrics, se_name
from isotui.core.spectrum import (
    Spectrum,
    eigenvalues,
    sample_eigenvalues,
    spectrum_from_eigenvalues,
)

if TYPE_CHECKING:
    import torch


# a batch's reservoir change (see LayerAccumulator._merge_reservoir)
ReservoirChange: TypeAlias = """(
    tuple[Literal["set"], torch.Tensor, torch.Tensor]
    | tuple[Literal["none"]]
    | tuple[Literal["update"], torch.Tensor, torch.Tensor, torch.Tensor]
)"""
# tensors and counts by name: a batch's partial sums, or an accumulator's state
Sums: TypeAlias = dict[str, Any]

_MASK62 = (1 << 62) - 1
SAMPLE_METRICS_MAX_DIM = 8192  # wider (flattened conv maps): no I(W), ABTT, standardised (memory)


def sample_keys(seed: int, sample_index: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """A pseudo-random key in [0, 1) per vector, a pure function of (seed, sample, position).

    Reservoir membership then does not depend on batch size or order, so results are
    identical however the corpus is batched.
    """
    import torch

    x = (sample_index.to(torch.int64) * 1_000_003 + position.to(torch.int64)) & _MASK62
    x = (x + (((seed + 1) * 0x9E3779B97F4A7C15) & _MASK62)) & _MASK62
    for mult, shift in (
        (0xBF58476D1CE4E5B9, 31),
        (0x94D049BB133111EB, 29),
        (0x2545F4914F6CDD1D, 32),
    ):
        x = (x ^ (x >> shift)) & _MASK62
        x = (x * (mult & _MASK62)) & _MASK62
    return (x >> 9).to(torch.float64) / float(1 << 53)


# the accelerators' sync-free paths on the CPU too (tests trace them here): the CPU reads a count
# on the host for free, and uses it to touch only the rows that matter (NaN/inf, the reservoir)
SYNC_FREE_ON_CPU = False


def _nonfinite(xd: torch.Tensor, norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values that are NaN or inf, rows holding any) of a batch ``xd`` and its rows' float64
    norms. On the CPU a row's norm is finite exactly when its values are (a float32 or narrower
    value squared is below 1.2e77, far from float64's range; NaN and inf carry through), so only
    the rows that hold one are scanned; elsewhere, and for float64 values (whose squares can
    overflow), every value is checked on the device, nothing read on the host."""
    import torch

    if xd.device.type == "cpu" and xd.dtype != torch.float64 and not SYNC_FREE_ON_CPU:
        bad_rows = torch.isfinite(norms).logical_not_()
        return torch.isfinite(xd[bad_rows]).logical_not_().sum(), bad_rows
    bad = torch.isfinite(xd).logical_not_()
    return bad.sum(), bad.any(1)


@dataclass
class LayerStats:
    """Final per-layer metrics (plain Python / numpy), ready for tables and the cache."""

    dim: int
    n_vectors: int
    n_zero: int
    avg_cos: float
    avg_cos_xctx: float
    drift_norm: float
    mean_norm: float
    avg_cos_centered: float
    n_sample: int
    isoscore: float
    eff_rank: float
    top_pc_share: float
    spectrum_from: str
    dim_contrib: npt.NDArray[np.float64] = field(repr=False)
    eigenvalues: npt.NDArray[np.float64] = field(repr=False)
    mean: npt.NDArray[np.float64] = field(repr=False)  # the mean vector x_bar (its norm is drift_norm)
    isoscore_star: float = math.nan  # see isotui.core.isotropy for these five
    iw: float = math.nan
    iw_centered: float = math.nan
    avg_cos_abtt: float = math.nan
    avg_cos_std: float = math.nan
    avg_cos_types: float = math.nan  # token types weighted equally (text)
    drift_norm_types: float = math.nan
    intra_sim: float = math.nan  # Ethayarajh 2019 (text)
    self_sim: float = math.nan
    self_sim_types: int = 0
    constant_dims: tuple[int, ...] = ()  # dimensions with one value in every vector (std 0)
    # standard errors of the reservoir metrics (isotui.core.sampled); 0 when exact
    avg_cos_centered_se: float = math.nan
    iw_se: float = math.nan
    iw_centered_se: float = math.nan
    avg_cos_abtt_se: float = math.nan
    avg_cos_std_se: float = math.nan
    # plug-in metrics' columns (isotui.core.plugin), in the order of the metrics, then columns
    plugins: dict[str, float] = field(default_factory=dict)


def avg_cos_from_sums(sum_u: npt.NDArray[np.float64], n: int) -> float:
    """Exact mean cosine over all n(n-1) ordered distinct pairs of unit vectors summing to sum_u."""
    if n < 2:
        return math.nan
    return float((np.dot(sum_u, sum_u) - n) / (n * (n - 1)))


class LayerAccumulator:
    """Streams one layer's vectors; ``finalize`` gives :class:`LayerStats`.

    ``full_cov``: accumulate the d x d second moment of all vectors (exact spectrum) rather than
    estimating the spectrum from the reservoir sample. The reservoir (``reservoir`` vectors,
    uniform over all vectors, chosen by :func:`sample_keys`) serves ``avg_cos_centered``, which
    needs the final mean before it can normalise; it is exact whenever n <= reservoir.
    """

    def __init__(
        self,
        dim: int,
        device: torch.device,
        *,
        full_cov: bool,
        reservoir: int,
        types: int = 0,
        metrics: Sequence[StreamingMetric] = (),
    ) -> None:
        import torch

        f64 = torch.float64
        self.dim = dim
        self.device = device
        self.full_cov = full_cov
        self.reservoir_size = reservoir
        # counts that depend on the data stay on the device while batches stream (reading one
        # would wait for the device): see the properties below
        self._n = torch.zeros((), dtype=torch.int64, device=device)  # vectors with a direction
        self.n_all = 0
        # NaN and inf: values, and the vectors holding any (their layer's metrics are NaN: finalize)
        self._nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        self._nonfinite_vectors = torch.zeros((), dtype=torch.int64, device=device)
        self._pairs_within = torch.zeros((), dtype=torch.int64, device=device)  # sum_s n_s (n_s - 1)
        self.sum_u = torch.zeros(dim, dtype=f64, device=device)
        self.sum_u2 = torch.zeros(dim, dtype=f64, device=device)
        self.sum_x = torch.zeros(dim, dtype=f64, device=device)
        self.sum_norm = torch.zeros((), dtype=f64, device=device)
        self.within = torch.zeros((), dtype=f64, device=device)  # sum_s ||S_s||^2
        # type-uniform weighting (text): vector i weighs 1 / (count of its token type)
        self.weighted = False
        self.sum_wu = torch.zeros(dim, dtype=f64, device=device)
        self.sum_wx = torch.zeros(dim, dtype=f64, device=device)
        self.sum_w = torch.zeros((), dtype=f64, device=device)  # over vectors with a direction
        self.sum_w2 = torch.zeros((), dtype=f64, device=device)
        self.sum_w_all = torch.zeros((), dtype=f64, device=device)
        # intra-sentence similarity: sum over samples of mean_i cos(x_i, sample mean), and count
        self.intra = torch.zeros((), dtype=f64, device=device)
        self._n_sentences = torch.zeros((), dtype=torch.int64, device=device)
        # self-similarity of ``types`` tracked token types: unit-vector sums per type, and the
        # same-sample parts to take out (sum_s ||S_ts||^2 and sum_s n_ts^2)
        self.types = types
        self.type_u = torch.zeros((types, dim), dtype=f64, device=device)
        self.type_n = torch.zeros(types, dtype=f64, device=device)
        self.type_within = torch.zeros(types, dtype=f64, device=device)
        self.type_within_n = torch.zeros(types, dtype=f64, device=device)
        self.shift: torch.Tensor | None = None  # first batch mean: keeps the 2nd moment stable
        self.sum_xs = torch.zeros(dim, dtype=f64, device=device)
        # per-dimension sum of squared shifted values in float64 (the float32 d x d product
        # underflows for dimensions of scale ~1e-30, e.g. a LayerNorm gain near 0); it is 0
        # exactly for a constant dimension of float32 or narrower values (see constant_dims);
        # float64 values keep each dimension's range instead (+-inf: not kept)
        self.sum_xs2 = torch.zeros(dim, dtype=f64, device=device)
        self.x_min = torch.full((dim,), math.inf, dtype=f64, device=device)
        self.x_max = torch.full((dim,), -math.inf, dtype=f64, device=device)
        self.gram = torch.zeros((dim, dim), dtype=f64, device=device) if full_cov else None
        self.res: torch.Tensor | None = None
        self.res_keys: torch.Tensor | None = None
        # plug-in metrics (isotui.core.plugin): each one's checked calls and its running state
        self.plugins: dict[str, Plugged] = {m.name: Plugged(m, dim, device) for m in metrics}
        self.plugin_states: dict[str, State] = {n: p.empty_state for n, p in self.plugins.items()}

    # counts on the device (each read on the host is a sync: once, at the end)
    n = DeviceCount("Vectors with a direction (non-zero).")
    nonfinite = DeviceCount("Values that are NaN or inf among the vectors folded in.")
    nonfinite_vectors = DeviceCount("Vectors holding a NaN or an inf.")
    pairs_within = DeviceCount(
        "Ordered pairs of distinct vectors of one sample: sum over samples of n_s (n_s - 1)."
    )
    n_sentences = DeviceCount("Samples with an intra-sentence similarity (a vector and a non-zero mean).")

    def partial(
        self,
        x: torch.Tensor,
        sample_ids: torch.Tensor,
        keys: torch.Tensor,
        weights: torch.Tensor | None = None,
        type_index: torch.Tensor | None = None,
        n_samples: int | None = None,
    ) -> Sums:
        """Statistics of one batch of vectors ``x`` (m x d) from samples ``sample_ids`` (0..B-1);
        when the units are tokens, ``weights`` (m, float64) are their type-uniform weights and
        ``type_index`` (m, int64) their tracked type (-1: not tracked) for self-similarity.

        Nothing here reads a device value on the host when ``n_samples`` (B) is given and ``x`` is
        on an accelerator: zero vectors are masked (their unit vector is 0 and their weight counts
        for nothing), never dropped, so every size is known from the shapes (issue 15: a GPU
        never waits). On the CPU, where a read costs nothing, NaN and inf are found from the row
        norms and counted only in the rows that hold them (issue 40: the per-batch cost).

        The per-batch cost is passes over m x d float64 arrays (issue 40): the sums weighted per
        row (plain, unit, type-uniform) are one product with the rows' weights, and the batch's
        own float64 copy is shifted and squared in place once nothing else reads it."""
        import torch

        # MPS has no float64: there the accumulators live on the CPU (see LayerAccumulator).
        xd = x.to(self.device)
        x64 = xd.to(torch.float64)
        own = x64.data_ptr() != xd.data_ptr() and not self.plugins  # free to overwrite in place
        sample_ids, keys = sample_ids.to(self.device), keys.to(self.device)
        norms = torch.linalg.vector_norm(x64, dim=1)
        nonfinite, bad_rows = _nonfinite(xd, norms)
        nonzero = (norms > 0) & bad_rows.logical_not()
        # a zero vector's unit row is 0; a row holding NaN or inf keeps its values (the layer's
        # metrics are NaN: finalize)
        scale = torch.where(nonzero, norms, 1.0).reciprocal_()
        u = x64 * scale[:, None]
        ids = sample_ids
        if n_samples is None:  # callers that do not know B: one read of the largest id
            n_samples = int(sample_ids.max()) + 1 if len(sample_ids) else 0
        per_sample = torch.zeros((n_samples, self.dim), dtype=torch.float64, device=self.device)
        per_sample.index_add_(0, ids, u)
        counts = torch.zeros(n_samples, dtype=torch.int64, device=self.device)
        counts.index_add_(0, ids, nonzero.to(torch.int64))
        # per-row weights of the sums over rows, as one (k x m) @ (m x d) product
        rows = [torch.ones_like(norms), scale]
        if weights is not None:
            w = weights.to(self.device).to(torch.float64)
            wn = torch.where(nonzero, w, 0.0)
            rows += [w, wn * scale]
        sums = torch.stack(rows) @ x64
        out = {
            "n": nonzero.sum(),
            "n_all": len(norms),
            "nonfinite": nonfinite,
            "nonfinite_vectors": bad_rows.sum(),
            "pairs_within": (counts * (counts - 1)).sum(),
            "sum_u": sums[1],
            "sum_x": sums[0],
            "sum_norm": norms.sum(),
            "within": (per_sample * per_sample).sum(),
        }
        if len(x64) and xd.dtype == torch.float64:  # narrower values: sum_xs2 tells (constant_dims)
            out["x_min"], out["x_max"] = xd.amin(0), xd.amax(0)
        if weights is not None:
            out |= self._sentences(x64, ids, per_sample, counts.to(torch.float64))
            if type_index is not None and self.types:
                out |= self._type_sums(u, ids, type_index.to(self.device), nonzero)
            out |= {
                "sum_wu": sums[3],
                "sum_wx": sums[2],
                "sum_w": wn.sum(),
                "sum_w2": (wn * wn).sum(),
                "sum_w_all": w.sum(),
            }
        out["sum_u2"] = u.square_().sum(0)  # u's last use
        del u
        out["reservoir"] = self._merge_reservoir(x, keys)
        if self.plugins:  # every kept vector, zero ones too, as the plug-in's own batch state
            out["plugins"] = {n: p.batch(x64) for n, p in self.plugins.items()}
        shift = self._shift_for(x64)
        out["shift"] = shift
        out["sum_xs"] = out["sum_x"] - len(x64) * shift
        xs64 = x64.sub_(shift) if own else x64 - shift
        if self.full_cov:
            # float32 at full precision, whatever the user's TF32/bf16 setting: shifting first keeps
            # the spectrum metrics within ~1e-8 of float64 (tests/test_products.py), which float64
            # accumulation across batches then preserves; a float64 d x d product costs 2x on a
            # CPU and up to 64x on a GPU
            out["gram"] = gram(xs64)
        out["sum_xs2"] = (xs64.square_() if own else xs64 * xs64).sum(0)
        return out

    def _sentences(
        self, x64: torch.Tensor, ids: torch.Tensor, per_sample: torch.Tensor, n_s: torch.Tensor
    ) -> Sums:
        """Intra-sentence similarity (Ethayarajh 2019): per sample, the mean cosine between its
        vectors and its mean vector, summed over the batch's samples that have vectors (``n_s``:
        each sample's vectors with a direction; zero vectors add nothing to its sums)."""
        import torch

        sum_x = torch.zeros_like(per_sample).index_add_(0, ids, x64)
        bar_norm = torch.linalg.vector_norm(sum_x, dim=1)
        live = (n_s > 0) & (bar_norm > 0)
        cos = (per_sample * sum_x).sum(1) / torch.where(live, n_s * bar_norm, 1.0)
        return {"intra": torch.where(live, cos, 0.0).sum(), "n_sentences": live.sum()}

    def _type_sums(
        self, u: torch.Tensor, ids: torch.Tensor, type_index: torch.Tensor, nonzero: torch.Tensor
    ) -> Sums:
        """Per tracked type: sum of unit vectors, count, and the same-sample parts. Untracked
        units (and zero vectors) go to a spare slot ``k`` that is dropped. On the CPU the (sample,
        type) groups are ``torch.unique``'s (their count is free to read); elsewhere
        :meth:`_type_groups`'s."""
        import torch

        k, f64 = self.types, torch.float64
        tracked = (type_index >= 0) & nonzero
        t = torch.where(tracked, type_index, k)
        type_u = torch.zeros((k + 1, self.dim), dtype=f64, device=self.device).index_add_(0, t, u)
        type_n = torch.zeros(k + 1, dtype=f64, device=self.device).index_add_(0, t, tracked.to(f64))
        key = torch.where(tracked, ids * k + t, -1)
        if self.device.type == "cpu" and not SYNC_FREE_ON_CPU:  # counts are free to read here
            within, within_n = self._type_within_cpu(u, key)
        else:
            per, per_n, owner = self._type_groups(u, key, t, tracked)
            within = torch.zeros(k + 1, dtype=f64, device=self.device).index_add_(
                0,
                owner,
                torch.einsum("ij,ij->i", per, per),  # no m x d temporary
            )
            within_n = torch.zeros(k + 1, dtype=f64, device=self.device).index_add_(0, owner, per_n * per_n)
        return {
            "type_u": type_u[:k],
            "type_n": type_n[:k],
            "type_within": within[:k],
            "type_within_n": within_n[:k],
        }

    def _type_within_cpu(self, u: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per tracked type (slot ``k``: none), the same-sample parts sum_s ||S_ts||^2 and sum_s
        n_ts^2 from ``key`` (sample * k + type; -1: untracked). Most (sample, type) groups are one
        unit vector, whose ||S||^2 is 1: only the groups of two or more are summed as vectors
        (in a batch of MiniLM's built-in corpus, 6 in 10 tracked tokens are alone in theirs)."""
        import torch

        k, f64 = self.types, torch.float64
        groups, group, sizes = torch.unique(key, return_inverse=True, return_counts=True)
        live = groups >= 0  # -1: the untracked units, dropped
        owner = torch.where(live, groups % k, k)
        n = sizes.to(f64)
        within_n = torch.zeros(k + 1, dtype=f64).index_add_(0, owner, torch.where(live, n * n, 0.0))
        alone = live & (sizes == 1)
        within = torch.zeros(k + 1, dtype=f64).index_add_(0, owner, alone.to(f64))
        shared = live & (sizes > 1)
        rows = torch.nonzero(shared[group]).squeeze(1)
        if len(rows):
            slots = torch.cumsum(shared, 0) - 1  # group -> its row among the shared groups
            per = torch.zeros((int(shared.sum()), self.dim), dtype=f64)
            per.index_add_(0, slots[group[rows]], u[rows])
            within.index_add_(0, owner[shared], torch.einsum("ij,ij->i", per, per))
        return within, within_n

    def _type_groups(
        self, u: torch.Tensor, key: torch.Tensor, t: torch.Tensor, tracked: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per (sample, type) group, numbered 0..m-1 as runs of the sorted keys: its unit-vector
        sum, its count and its type (``k``: untracked). Sizes from the shapes alone: nothing read
        on the host (the accelerators' path)."""
        import torch

        k, m, f64 = self.types, len(u), torch.float64
        order = torch.sort(key, stable=True).indices
        sorted_key = key[order]
        starts = torch.ones(m, dtype=torch.int64, device=self.device)
        starts[1:] = (sorted_key[1:] != sorted_key[:-1]).to(torch.int64)
        group = torch.empty_like(order).scatter_(0, order, torch.cumsum(starts, 0) - 1)
        per = torch.zeros((m, self.dim), dtype=f64, device=self.device).index_add_(0, group, u)
        per_n = torch.zeros(m, dtype=f64, device=self.device).index_add_(0, group, tracked.to(f64))
        owner = torch.full((m,), k, dtype=torch.int64, device=self.device).scatter_(0, group, t)
        return per, per_n, owner

    def _shift_for(self, x64: torch.Tensor) -> torch.Tensor:
        """The fixed shift of the second moment: the first batch's mean (zeros if it is empty)."""
        import torch

        if self.shift is not None:
            return self.shift
        if len(x64):
            return x64.mean(0)
        return torch.zeros(self.dim, dtype=torch.float64, device=self.device)

    def _merge_reservoir(self, x: torch.Tensor, keys: torch.Tensor) -> ReservoirChange:
        """The reservoir update for a batch: the K smallest keys seen so far win.

        While filling, returns the new (vectors, keys); once full, a fixed number of slot writes
        (slots, vectors, keys), min(K, m): evicted slots in ascending order get the entering
        vectors in batch order and the other writes repeat the first, so that no count is read on
        the host and a batch copies at most m vectors, never the whole reservoir. On the CPU, where
        a count costs nothing to read, just the entering vectors' writes (the same reservoir).
        """
        import torch

        x32 = x.to(self.device).to(torch.float32)
        k = self.reservoir_size
        if self.res is None or self.res_keys is None or len(self.res) < k:  # both set, or neither
            vecs = x32 if self.res is None else torch.cat([self.res, x32])
            all_keys = keys if self.res_keys is None else torch.cat([self.res_keys, keys])
            if len(all_keys) > k:
                keep = torch.topk(all_keys, k, largest=False).indices
                vecs, all_keys = vecs[keep], all_keys[keep]
            return ("set", vecs, all_keys)
        m = len(keys)
        if m == 0:
            return ("none",)
        keep = torch.topk(torch.cat([self.res_keys, keys]), k, largest=False).indices
        kept = torch.zeros(k + m, dtype=torch.bool, device=self.device)
        kept[keep] = True
        if self.device.type == "cpu" and not SYNC_FREE_ON_CPU:  # the same writes, only those that enter
            slots = torch.nonzero(~kept[:k]).squeeze(1)  # evicted, ascending
            units = torch.nonzero(kept[k:]).squeeze(1)  # entering, in batch order
            return ("update", slots, x32[units], keys[units]) if len(units) else ("none",)
        writes = min(k, m)  # entering = evicted <= both
        # stable sorts put the evicted slots (ascending) and the entering units (in batch order)
        # first; the first e of each pair up, e = how many enter (never read)
        slots = torch.sort(kept[:k].to(torch.int8), stable=True).indices[:writes]
        units = torch.sort((~kept[k:]).to(torch.int8), stable=True).indices[:writes]
        # writes past the first e repeat the first write (the same slot, the same vector: the
        # result does not depend on which duplicate lands); when none enters, the first write
        # puts its slot's own vector back
        enters = ~kept[slots]
        slots = torch.where(enters, slots, slots[:1])
        units = torch.where(enters, units, units[:1])
        first = torch.where(enters[:1, None], x32[units[:1]], self.res[slots[:1]])
        first_key = torch.where(enters[:1], keys[units[:1]], self.res_keys[slots[:1]])
        vecs = torch.where(enters[:, None], x32[units], first)
        return ("update", slots, vecs, torch.where(enters, keys[units], first_key))

    def commit(self, p: Sums) -> None:
        """Add a batch's :meth:`partial` into the running state (no large allocations)."""
        import torch

        self._n.add_(p["n"])
        self.n_all += p["n_all"]
        self._nonfinite.add_(p["nonfinite"])
        self._nonfinite_vectors.add_(p["nonfinite_vectors"])
        self._pairs_within.add_(p["pairs_within"])
        for name in ("sum_u", "sum_u2", "sum_x", "sum_norm", "within"):
            getattr(self, name).add_(p[name])
        if "sum_wu" in p:
            self.weighted = True
            for name in ("sum_wu", "sum_wx", "sum_w", "sum_w2", "sum_w_all", "intra"):
                getattr(self, name).add_(p[name])
            self._n_sentences.add_(p["n_sentences"])
        if "type_u" in p:
            for name in ("type_u", "type_n", "type_within", "type_within_n"):
                getattr(self, name).add_(p[name])
        if self.shift is None and p["n_all"]:
            self.shift = p["shift"]
        self.sum_xs.add_(p["sum_xs"])
        self.sum_xs2.add_(p["sum_xs2"])
        if "x_min" in p:
            torch.minimum(self.x_min, p["x_min"], out=self.x_min)
            torch.maximum(self.x_max, p["x_max"], out=self.x_max)
        if self.gram is not None:  # full_cov
            self.gram.add_(p["gram"])
        change: ReservoirChange = p["reservoir"]
        if change[0] == "set":
            self.res, self.res_keys = change[1], change[2]
        elif change[0] == "update" and self.res is not None and self.res_keys is not None:
            self.res.index_copy_(0, change[1], change[2])
            self.res_keys.index_copy_(0, change[1], change[3])
        if "plugins" in p:  # each merged first, then all set: a failing merge leaves none half-added
            merged = {n: self.plugins[n].merge(self.plugin_states[n], s) for n, s in p["plugins"].items()}
            self.plugin_states.update(merged)

    def finalize(self, eigen: ExactEigen | None = None) -> LayerStats:
        """Turn the sums into metrics (see design.md for the exact definitions). ``eigen``: this
        layer's :meth:`exact_eigen`, when the caller decomposed it already (batched with other
        layers: isotui/extract/finalise.py). A layer that held a NaN or an inf has NaN metrics
        (:meth:`_nonfinite_stats`)."""
        if self.nonfinite:
            return self._nonfinite_stats()
        n, n_all, d = self.n, self.n_all, self.dim
        sum_u = self.sum_u.cpu().numpy()
        sum_u2 = self.sum_u2.cpu().numpy()
        s2 = float(np.dot(sum_u, sum_u))
        avg_cos = avg_cos_from_sums(sum_u, n)
        pairs_cross = n * (n - 1) - self.pairs_within
        within = float(self.within.cpu())
        avg_cos_xctx = (s2 - within) / pairs_cross if pairs_cross > 0 else math.nan
        mean = self.sum_x.cpu().numpy() / n_all if n_all else np.full(d, np.nan)
        drift = float(np.linalg.norm(mean)) if n_all else math.nan
        mean_norm = float(self.sum_norm.cpu()) / n_all if n_all else math.nan
        contrib = (sum_u**2 - sum_u2) / (n * (n - 1)) if n >= 2 else np.full(d, np.nan)

        sample = self.res.cpu().numpy().astype(np.float64) if self.res is not None else None
        centered = _centered_avg_cos(sample, mean) if sample is not None else math.nan
        n_sample = 0 if sample is None else len(sample)

        eig, exact = None, None
        if sample is not None and 2 <= n_sample == n_all:
            # every vector is in the reservoir: the exact float64 spectrum of the data itself (for
            # rank-deficient data, n <= d, the float32 batch products would blur the null space)
            eig = sample_eigenvalues(sample) if d > n_sample else eigenvalues(np.cov(sample, rowvar=False))
            spectrum_from = "all"
        elif (exact := eigen or self.exact_eigen(directions=self.needs_directions())) is not None:
            # full_cov: one eigh each, on the device (eigenvalues alone where no metric reads vectors)
            eig = exact.values.cpu().numpy()
            spectrum_from = "all"
        elif sample is not None and n_sample >= 2:
            # d > n (flattened conv maps): the n x n Gram matrix, never a d x d covariance
            eig = sample_eigenvalues(sample) if d > n_sample else eigenvalues(np.cov(sample, rowvar=False))
            spectrum_from = "all" if n_sample == n_all else f"sample:{n_sample}"
        else:
            spectrum_from = "none"
        if eig is not None:
            spec = spectrum_from_eigenvalues(eig)
        else:
            spec, eig = Spectrum(math.nan, math.nan, math.nan), np.full(d, np.nan)
        extra = self._sample_metrics(sample, mean, n_all, exact) | self._type_uniform()
        extra |= self._sample_errors(sample, mean, n_all)
        self_sim_types = int(extra.pop("self_sim_types", 0))  # the one count among the floats
        return LayerStats(
            dim=d,
            n_vectors=n_all,
            n_zero=n_all - n,
            avg_cos=avg_cos,
            avg_cos_xctx=avg_cos_xctx,
            drift_norm=drift,
            mean_norm=mean_norm,
            avg_cos_centered=centered,
            n_sample=n_sample,
            isoscore=spec.isoscore,
            eff_rank=spec.eff_rank,
            top_pc_share=spec.top_pc_share,
            spectrum_from=spectrum_from,
            dim_contrib=contrib,
            eigenvalues=eig,
            mean=mean,
            isoscore_star=isoscore_star(eig),
            constant_dims=tuple(int(k) for k in np.flatnonzero(self.constant_dims())),
            self_sim_types=self_sim_types,
            plugins=self.plugin_values(),
            **extra,
        )

    def _nonfinite_stats(self) -> LayerStats:
        """The metrics of a layer whose vectors held NaN or inf values: NaN, every one of them
        (the plug-ins' columns too), since every sum and every eigenvalue would be NaN or inf;
        the counts are kept (``n_zero``: the finite zero vectors). Its row stays in the table
        and its run's notes say where and how many (isotui/extract/runner.py)."""
        d = self.dim
        nan = np.full(d, np.nan)
        return LayerStats(
            dim=d,
            n_vectors=self.n_all,
            n_zero=self.n_all - self.n - self.nonfinite_vectors,
            avg_cos=math.nan,
            avg_cos_xctx=math.nan,
            drift_norm=math.nan,
            mean_norm=math.nan,
            avg_cos_centered=math.nan,
            n_sample=0 if self.res is None else len(self.res),
            isoscore=math.nan,
            eff_rank=math.nan,
            top_pc_share=math.nan,
            spectrum_from="none",
            dim_contrib=nan,
            eigenvalues=nan.copy(),
            mean=nan.copy(),
            plugins={c: math.nan for p in self.plugins.values() for c in p.metric.columns},
        )

    def plugin_values(self) -> dict[str, float]:
        """Every plug-in metric's columns for this layer (column -> value)."""
        out: dict[str, float] = {}
        for name, plugged in self.plugins.items():
            out |= plugged.finalize(self.plugin_states[name])
        return out

    def _type_uniform(self) -> dict[str, float]:
        """avg_cos and drift with every token type weighted equally: pairs (i, j), i != j, weigh
        w_i w_j with w = 1 / count(type), so (||sum w u||^2 - sum w^2) / ((sum w)^2 - sum w^2);
        and Ethayarajh's intra-sentence and self-similarity (text units only)."""
        if not self.weighted:
            return {}
        sw, sw2 = float(self.sum_w.cpu()), float(self.sum_w2.cpu())
        su = self.sum_wu.cpu().numpy()
        denom = sw * sw - sw2
        swa = float(self.sum_w_all.cpu())
        out = {
            "avg_cos_types": float((su @ su - sw2) / denom) if denom > 0 else math.nan,
            "drift_norm_types": float(np.linalg.norm(self.sum_wx.cpu().numpy()) / swa)
            if swa > 0
            else math.nan,
            "intra_sim": float(self.intra.cpu()) / self.n_sentences if self.n_sentences else math.nan,
        }
        if self.types:
            tu = self.type_u.cpu().numpy()
            n = self.type_n.cpu().numpy()
            cross = n * n - self.type_within_n.cpu().numpy()  # ordered pairs from different samples
            live = cross > 0
            sims = (np.einsum("td,td->t", tu, tu) - self.type_within.cpu().numpy())[live] / cross[live]
            out["self_sim"] = float(sims.mean()) if len(sims) else math.nan
            out["self_sim_types"] = int(live.sum())
        return out

    def spectrum_from_sample(self) -> bool:
        """Whether :meth:`finalize` takes the spectrum from the reservoir (it holds every vector),
        not from the d x d sums: then no :meth:`exact_eigen` is needed."""
        return self.res is not None and 2 <= len(self.res) == self.n_all

    def exact_eigen(self, *, directions: bool = True) -> ExactEigen | None:
        """The eigendecompositions of the exact covariance and X^T X over every vector (see
        :mod:`isotui.core.exact_spectrum`; without ``directions``, the covariance's eigenvalues
        alone); None when the d x d sums are not held (or n < 2)."""
        sums = self.exact_eigen_inputs()
        return None if sums is None else exact_eigen(*sums, directions=directions)

    def needs_directions(self) -> bool:
        """Whether :meth:`finalize` reads the exact eigenvectors: the reservoir metrics (I(W),
        centred I(W), all-but-the-top) do, up to :data:`SAMPLE_METRICS_MAX_DIM` dims and where a
        reservoir is kept; elsewhere the spectrum's eigenvalues are all it decomposes."""
        return self.res is not None and self.dim <= SAMPLE_METRICS_MAX_DIM

    def exact_eigen_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """(gram, shift, sum_xs, n) for :func:`~isotui.core.exact_spectrum.exact_eigen`; None when
        the d x d sums are not held (or n < 2)."""
        if self.gram is None or self.shift is None or self.n_all < 2 or self.nonfinite:
            return None
        return self.gram, self.shift, self.sum_xs, self.n_all

    def _sample_metrics(
        self,
        sample: npt.NDArray[np.float64] | None,
        mean: npt.NDArray[np.float64],
        n_all: int,
        exact: ExactEigen | None = None,
    ) -> dict[str, float]:
        """I(W), all-but-the-top and standardised avg_cos, from the reservoir (exact when it holds
        every vector, as avg_cos_centered) over the ``exact`` directions when the d x d sums are
        held, else the sample's own; skipped above :data:`SAMPLE_METRICS_MAX_DIM` dims."""
        import torch

        if self.res is None or sample is None or len(sample) < 2 or self.dim > SAMPLE_METRICS_MAX_DIM:
            return {}
        # the sample, on the accumulator's device (GPU: fast eigh); on the CPU the float64 host
        # copy itself (the same values), not a second one
        x = torch.from_numpy(sample) if self.res.device.type == "cpu" else self.res.to(torch.float64)
        directions = None
        if exact is not None and exact.vecs is not None and exact.vecs_c is not None:
            directions = (exact.vecs, exact.vecs_c)
        return sample_metrics(x, mean, self.dim_std(n_all), self._se_groups(n_all), directions)

    def _se_groups(self, n_all: int) -> Groups | None:
        """The reservoir's disjoint groups for standard errors; None when it holds every vector
        (the metrics are exact: see :meth:`_sample_errors`)."""
        if self.res is None or self.res_keys is None or len(self.res) >= n_all:
            return None
        return key_groups(self.res_keys)

    def _sample_errors(
        self, sample: npt.NDArray[np.float64] | None, mean: npt.NDArray[np.float64], n_all: int
    ) -> dict[str, float]:
        """avg_cos_centered's standard error from disjoint sub-samples, and 0 for every reservoir
        metric when the reservoir holds every vector (exact); see :mod:`isotui.core.sampled`."""
        import torch

        if self.res is None or sample is None or len(sample) < 2:
            return {}
        if len(sample) == n_all:
            names = SAMPLED if self.dim <= SAMPLE_METRICS_MAX_DIM else ("avg_cos_centered",)
            return {se_name(m): 0.0 for m in names}
        groups = self._se_groups(n_all)
        if groups is None:
            return {}
        x = torch.from_numpy(sample) if self.res.device.type == "cpu" else self.res.to(torch.float64)
        centred = x - torch.as_tensor(mean, device=self.res.device)
        del x
        return {"avg_cos_centered_se": cos_jackknife_se(centred, groups)}

    def dim_std(self, n_all: int) -> npt.NDArray[np.float64]:
        """Each dimension's standard deviation over all vectors, from float64 sums of values
        shifted by the first batch's mean (stable for any scale); exactly 0 for a dimension whose
        every value is the same (and only for those: see :meth:`constant_dims`)."""
        if n_all < 2:
            return np.full(self.dim, np.nan)
        ms = self.sum_xs.cpu().numpy() / n_all
        var = (self.sum_xs2.cpu().numpy() - n_all * ms * ms) / (n_all - 1)
        std = np.sqrt(np.clip(var, 0.0, None))
        constant = self.constant_dims()
        std[constant] = 0.0
        return std

    def state(self) -> Sums:
        """Everything the accumulator has folded in, as tensors and plain scalars (no pickle:
        safetensors can store it), for :meth:`from_state` and :meth:`merge` elsewhere."""
        return _layer_state(self)

    @classmethod
    def from_state(
        cls, state: Sums, device: torch.device | None = None, *, copy: bool = True
    ) -> LayerAccumulator:
        """An accumulator holding ``state`` (a copy), on ``device`` (default: the CPU). With
        ``copy=False`` it holds the state's own tensors where they are already on ``device`` (to
        check a state, or to merge it in, without a second copy of its sums)."""
        return _layer_from_state(cls, state, device, copy=copy)

    def merge(self, other: LayerAccumulator) -> None:
        """Fold in another shard's accumulator (disjoint samples, same corpus-level choices): sums
        add, the shifted second moments are re-centred to this one's shift exactly, min/max take
        min/max, and the reservoir keeps the smallest keys of the union (the one-pass reservoir,
        since keys depend only on the global sample index and position)."""
        _layer_merge(self, other)

    def constant_dims(self) -> npt.NDArray[np.bool_]:
        """Mask of dimensions in which every vector has exactly the same value.

        For float32 or narrower values (every model's hidden states but a float64 one) that is
        where the shifted squares sum to exactly 0, with no range kept per batch (two passes
        over each batch, 8% of its metrics' time on a CPU): the shift, the first batch's float64
        mean, is exact for a constant dimension (m copies of a 24-bit value sum exactly in
        float64, and m c / m = c), so each of its values shifts to 0; any other value shifts to
        a float64 difference of at least ~1e-61 (values of float32's range, subnormals
        included), whose square does not underflow. Shards merged: a dimension constant in all
        of them has the same shift in each, and re-centring adds exactly 0. float64 values
        (whose mean may round, and whose differences may square to 0) keep their range."""
        import torch

        if bool(torch.isfinite(self.x_min).any()):  # a range was kept: float64 values
            same: npt.NDArray[np.bool_] = (self.x_min == self.x_max).cpu().numpy()
        else:
            same = (self.sum_xs2 == 0).cpu().numpy()
        return same & (self.n_all > 0)


# --- mergeable state: shards of a corpus measured apart, then combined -------------------------

# sums that add across shards (tensors) and counts (ints); extend these when adding a sum
_LAYER_SUMS = (
    "sum_u",
    "sum_u2",
    "sum_x",
    "sum_norm",
    "within",
    "sum_wu",
    "sum_wx",
    "sum_w",
    "sum_w2",
    "sum_w_all",
    "intra",
    "type_u",
    "type_n",
    "type_within",
    "type_within_n",
)
_TYPE_SUMS = ("type_u", "type_n", "type_within", "type_within_n")  # one row per token type
_LAYER_COUNTS = ("n", "n_all", "pairs_within", "n_sentences", "nonfinite", "nonfinite_vectors")
_LATER_COUNTS = ("nonfinite", "nonfinite_vectors")  # 0 in a state saved before they were counted
_LAYER_SHAPE = ("dim", "full_cov", "reservoir_size", "types")


@overload
def recentre(
    shift_from: torch.Tensor,
    shift_to: torch.Tensor,
    n: int,
    sum_s: torch.Tensor,
    sum_s2: torch.Tensor,
    gram: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...
@overload
def recentre(
    shift_from: torch.Tensor,
    shift_to: torch.Tensor,
    n: int,
    sum_s: torch.Tensor,
    sum_s2: None = None,
    *,
    gram: torch.Tensor,
) -> tuple[torch.Tensor, None, torch.Tensor]: ...
def recentre(
    shift_from: torch.Tensor,
    shift_to: torch.Tensor,
    n: int,
    sum_s: torch.Tensor,
    sum_s2: torch.Tensor | None = None,
    gram: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Sums of ``n`` vectors shifted by ``shift_from`` re-expressed around ``shift_to``, exactly:
    with delta = shift_from - shift_to, x - shift_to = (x - shift_from) + delta, so
    sum = sum_s + n delta, per-dimension squares = sum_s2 + 2 delta sum_s + n delta^2 and
    second moment = gram + sum_s delta^T + delta sum_s^T + n delta delta^T."""
    import torch

    delta = shift_from - shift_to
    out_s = sum_s + n * delta
    out_s2 = None if sum_s2 is None else sum_s2 + 2 * delta * sum_s + n * delta * delta
    out_g = None
    if gram is not None:
        cross = torch.outer(sum_s, delta)
        out_g = gram + cross + cross.T + n * torch.outer(delta, delta)
    return out_s, out_s2, out_g


def keep_smallest(
    keys: torch.Tensor, values: torch.Tensor, size: int, dim: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``size`` entries with the smallest keys (all of them when there are fewer): the
    keyed reservoir of a union, whatever order its parts arrived in."""
    import torch

    if len(keys) <= size:
        return keys, values
    keep = torch.topk(keys, size, largest=False).indices
    return keys[keep], values.index_select(dim, keep.to(values.device))


def _layer_state(acc: LayerAccumulator) -> Sums:
    state: Sums = {k: getattr(acc, k) for k in (*_LAYER_SHAPE, *_LAYER_COUNTS)}
    state["weighted"] = acc.weighted
    for k in (*_LAYER_SUMS, "sum_xs", "sum_xs2", "x_min", "x_max", "shift", "gram", "res", "res_keys"):
        if getattr(acc, k) is not None:
            state[k] = getattr(acc, k)
    if acc.plugins:  # the names (a JSON string), then each one's tensors as plugin.<name>.<tensor>
        state["plugins"] = ",".join(acc.plugins)
        for name, tensors in acc.plugin_states.items():
            state |= {f"{STATE_PREFIX}{name}.{k}": v for k, v in tensors.items()}
    return state


def _layer_from_state(
    cls: type[LayerAccumulator], state: Sums, device: torch.device | None, *, copy: bool = True
) -> LayerAccumulator:
    import torch

    device = torch.device("cpu") if device is None else device
    # built without its d x d and per-type sums, which the state brings: zeros of their size
    # would be allocated (and touched) only to be replaced
    acc = cls(int(state["dim"]), device, full_cov=False, reservoir=int(state["reservoir_size"]))
    acc.full_cov, acc.types = bool(state["full_cov"]), int(state["types"])
    for k in _LAYER_COUNTS:
        setattr(acc, k, int(state.get(k, 0) if k in _LATER_COUNTS else state[k]))
    acc.weighted = bool(state["weighted"])
    _plugins_from_state(acc, state, device, copy=copy)
    for k, v in state.items():
        if k.startswith(STATE_PREFIX):
            continue
        if isinstance(v, torch.Tensor):
            _check_shape(acc, k, v)
            setattr(acc, k, v.to(device).clone() if copy else v.to(device))
    f64 = torch.float64
    if acc.full_cov and acc.gram is None:  # what the constructor would have held
        acc.gram = torch.zeros((acc.dim, acc.dim), dtype=f64, device=device)
    for k in _TYPE_SUMS:
        if k not in state:
            shape = (acc.types, acc.dim) if k == "type_u" else (acc.types,)
            setattr(acc, k, torch.zeros(shape, dtype=f64, device=device))
    if (acc.res is None) != (acc.res_keys is None) or (
        acc.res is not None and acc.res_keys is not None and len(acc.res) != len(acc.res_keys)
    ):
        raise ValueError("the layer state's reservoir and its keys do not match")
    return acc


def _plugins_from_state(acc: LayerAccumulator, state: Sums, device: torch.device, *, copy: bool) -> None:
    """The plug-in metrics a layer state holds (see :func:`_layer_state`), each found among the
    metrics in force by name and its tensors checked against its empty state's shapes (a state of
    other shapes is damaged: ValueError)."""
    names = [n for n in str(state.get("plugins") or "").split(",") if n]
    for name in names:
        plugged = Plugged(lookup(name), acc.dim, device)
        prefix = f"{STATE_PREFIX}{name}."
        tensors = {
            k[len(prefix) :]: (v.to(device).clone() if copy else v.to(device))
            for k, v in state.items()
            if k.startswith(prefix)
        }
        try:
            acc.plugin_states[name] = plugged.check("the stored state", tensors)
        except PluginError as exc:
            raise ValueError(str(exc)) from None
        acc.plugins[name] = plugged


def _check_shape(acc: LayerAccumulator, name: str, value: torch.Tensor) -> None:
    """ValueError when a state's tensor ``name`` has not the shape an accumulator of its ``dim``
    (``types``, ``full_cov``) keeps: a damaged or foreign state, which would fail (or worse,
    broadcast) later in a merge or the metrics."""
    fresh = getattr(acc, name, None)
    if name == "shift":
        want: tuple[int | None, ...] = (acc.dim,)
    elif name == "res":
        want = (None, acc.dim)
    elif name == "res_keys":
        want = (None,)  # as many as the reservoir's rows: checked once both are set
    elif name == "gram" and acc.full_cov:
        want = (acc.dim, acc.dim)
    elif name in _TYPE_SUMS:
        want = (acc.types, acc.dim) if name == "type_u" else (acc.types,)
    elif isinstance(fresh, type(value)):
        want = tuple(fresh.shape)
    else:
        return
    got = tuple(value.shape)
    if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want, strict=False)):
        shown = tuple("n" if w is None else w for w in want)
        raise ValueError(f"the layer state's {name} has shape {got}, not {shown} (dim {acc.dim})")


def _layer_merge(acc: LayerAccumulator, other: LayerAccumulator) -> None:
    import torch

    mine = tuple(getattr(acc, k) for k in _LAYER_SHAPE)
    theirs = tuple(getattr(other, k) for k in _LAYER_SHAPE)
    if mine != theirs:
        raise ValueError(f"cannot merge accumulators of different shapes {mine} and {theirs}")
    if list(acc.plugins) != list(other.plugins):
        raise ValueError(
            f"cannot merge accumulators of different plug-in metrics ({', '.join(acc.plugins) or 'none'} "
            f"and {', '.join(other.plugins) or 'none'})"
        )
    dev = acc.device
    merged = {
        n: p.merge(acc.plugin_states[n], {k: v.to(dev) for k, v in other.plugin_states[n].items()})
        for n, p in acc.plugins.items()
    }
    acc.plugin_states.update(merged)
    # a state kept before ranges were dropped for float32 and narrower values (its range is
    # finite) beside one kept after (+-inf): neither range covers every vector, so neither is
    # kept and the shifted squares tell (constant_dims), as they do for both
    ranged = [bool(torch.isfinite(a.x_min).any()) for a in (acc, other)]
    unranged = acc.n_all > 0 and other.n_all > 0 and ranged[0] != ranged[1]
    for k in _LAYER_COUNTS:
        setattr(acc, k, getattr(acc, k) + getattr(other, k))
    acc.weighted = acc.weighted or other.weighted
    for k in _LAYER_SUMS:
        getattr(acc, k).add_(getattr(other, k).to(dev))
    if unranged:
        acc.x_min.fill_(math.inf)
        acc.x_max.fill_(-math.inf)
    else:
        torch.minimum(acc.x_min, other.x_min.to(dev), out=acc.x_min)
        torch.maximum(acc.x_max, other.x_max.to(dev), out=acc.x_max)
    if other.shift is not None:  # None: the other saw no vector, its shifted sums are zero
        o_s, o_s2 = other.sum_xs.to(dev), other.sum_xs2.to(dev)
        delta = None
        if acc.shift is None:
            acc.shift = other.shift.to(dev).clone()
        else:
            delta = other.shift.to(dev) - acc.shift
            o_s, o_s2, _ = recentre(other.shift.to(dev), acc.shift, other.n_all, o_s, o_s2)
        if acc.gram is not None and other.gram is not None:  # full_cov, as acc
            # recentred in place (see recentre): no d x d temporary beside the running sum
            acc.gram.add_(other.gram.to(dev))
            if delta is not None:
                s = other.sum_xs.to(dev)
                acc.gram.addr_(s, delta).addr_(delta, s).addr_(delta, delta, alpha=other.n_all)
        acc.sum_xs.add_(o_s)
        acc.sum_xs2.add_(o_s2)
    if other.res is not None and other.res_keys is not None:
        res, keys = other.res.to(dev), other.res_keys.to(dev)
        adopted = acc.res is None or acc.res_keys is None  # then kept as the other's, if not cut
        if acc.res is not None and acc.res_keys is not None:  # the union is new, as is any cut of it
            res, keys = torch.cat([acc.res, res]), torch.cat([acc.res_keys, keys])
        acc.res_keys, acc.res = keep_smallest(keys, res, acc.reservoir_size)
        if adopted:
            acc.res, acc.res_keys = acc.res.clone(), acc.res_keys.clone()


def _centered_avg_cos(sample: npt.NDArray[np.float64], mean: npt.NDArray[np.float64]) -> float:
    """Mean pairwise cosine of ``sample`` after subtracting the exact full-data ``mean``."""
    v = sample - mean
    norms = np.linalg.norm(v, axis=1)
    keep = norms > 0
    u = v[keep] / norms[keep, None]
    return avg_cos_from_sums(u.sum(0), int(keep.sum()))
