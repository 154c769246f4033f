"""What a sweep gives: a row per (seed, N), one seed's cached sweep, the whole result over seeds."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import NotRequired, TypedDict, cast

import numpy as np

from isotui.core.attention import RangeHistogram
from isotui.experiments.drift_block.config import FOLDER, ROW_SETTINGS, SCHEMA, DriftBlockConfig, _version
from isotui.experiments.json_types import from_fields

SOFTMAX_STATS = ("max", "median", "min")  # the stat axis of softmax_position


@dataclass
class DriftBlockRow:
    """One (seed, N) of the sweep; the CSV's columns, in this order."""

    seed: int
    norm: float
    in_avg_cos: float
    in_mean_norm: float
    in_drift_norm: float
    out_avg_cos: float
    out_mean_norm: float
    out_drift_norm: float
    q_avg_cos: float
    k_avg_cos: float
    q_mean_norm: float
    k_mean_norm: float
    q_bar_norm: float
    k_bar_norm: float
    cos_qk_bar: float
    q_avg_cos_heads: float
    k_avg_cos_heads: float
    cos_qk_bar_heads: float
    score_mean: float
    score_std: float
    score_min: float
    score_max: float
    score_outside: int  # non-finite scores: every finite one is inside the histogram's data range
    softmax_max: float
    softmax_median: float
    softmax_min: float
    softmax_max_peak: float
    softmax_min_floor: float
    entropy: float
    n_star: float  # this seed's fixed point (repeated on each of its rows)
    hidden: int
    heads: int
    intermediate: int
    init_std: float
    vocab: int
    batch: int
    seq_len: int
    block: str = "post-ln"  # defaults: entries cached before these settings existed still load
    measure: str = "after-norm"

    @classmethod
    def metrics(cls) -> list[str]:
        """The per-N scalar metrics (not seed, N or the settings)."""
        return [f.name for f in fields(cls) if f.name not in _NOT_METRICS]


_NOT_METRICS = {"seed", "norm", "n_star", *ROW_SETTINGS}

HEAD_METRICS = (
    "q_avg_cos",
    "k_avg_cos",
    "q_mean_norm",
    "k_mean_norm",
    "q_bar_norm",
    "k_bar_norm",
    "cos_qk_bar",
    "score_mean",
    "score_std",
    "softmax_max",
    "softmax_median",
    "softmax_min",
    "entropy",
)


@dataclass
class NormSummary:
    """One N across the seeds: mean and sample std (ddof=1, NaN for one seed) of every metric."""

    norm: float
    n_seeds: int
    mean: dict[str, float]
    std: dict[str, float]


class RowSettings(TypedDict):
    """Of a cached row (a DriftBlockRow's fields, NaN as null), the sweep's settings and its N,
    which a cache entry is read back with (``block`` and ``measure``: absent before they existed)."""

    norm: float
    hidden: int
    heads: int
    intermediate: int
    init_std: float
    vocab: int
    batch: int
    seq_len: int
    block: NotRequired[str]
    measure: NotRequired[str]


class SeedEntry(TypedDict):
    """One seed's cache entry, as :meth:`SeedRun.to_payload` writes it (beside its arrays)."""

    seed: int
    rows: list[RowSettings]  # each a DriftBlockRow's fields
    n_star: float | None
    notes: list[str]
    seconds: float
    device: str
    created: str


@dataclass
class SeedRun:
    """One seed's sweep, as cached: rows, N*, and arrays indexed [N, ...]."""

    seed: int
    key: str
    rows: list[DriftBlockRow]
    n_star: float
    notes: list[str]
    score_hist: np.ndarray  # (nN, H, RANGE_BINS + 2) int64, N by N on its own grid:
    score_grid: np.ndarray  # (nN, 2) int64: that grid's (exp, start), see RangeHistogram
    softmax_position: np.ndarray  # (nN, 3, T): max, median, min per query position
    head: dict[str, np.ndarray]  # metric -> (nN, H)
    seconds: float
    device: str
    from_cache: bool = False

    def to_payload(self) -> tuple[dict[str, object], dict[str, np.ndarray]]:
        payload = {
            "seed": self.seed,
            "rows": [asdict(r) for r in self.rows],
            "n_star": self.n_star,
            "notes": self.notes,
            "seconds": self.seconds,
            "device": self.device,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        arrays = {
            "score_hist": self.score_hist,
            "score_grid": self.score_grid,
            "softmax_position": self.softmax_position,
        }
        arrays.update({f"head.{k}": v for k, v in self.head.items()})
        return cast("dict[str, object]", _nan_to_none(payload)), arrays  # a dict stays a dict

    @classmethod
    def from_payload(cls, key: str, payload: Mapping[str, object], arrays: dict[str, np.ndarray]) -> SeedRun:
        entry = cast("SeedEntry", payload)  # the cache checked its schema: to_payload's
        rows = [from_fields(DriftBlockRow, _none_to_nan(r)) for r in entry["rows"]]
        return cls(
            seed=int(entry["seed"]),
            key=key,
            rows=rows,
            n_star=_float(entry["n_star"]),
            notes=list(entry["notes"]),
            score_hist=arrays["score_hist"],
            score_grid=arrays["score_grid"],
            softmax_position=arrays["softmax_position"],
            head={k: arrays[f"head.{k}"] for k in HEAD_METRICS},
            seconds=float(entry["seconds"]),
            device=str(entry["device"]),
            from_cache=True,
        )

    def score_histograms(self) -> list[RangeHistogram]:
        """One histogram per N (counts (H, RANGE_BINS + 2)) on that N's grid."""
        return [
            RangeHistogram(int(exp), int(start), self.score_hist[i])
            for i, (exp, start) in enumerate(self.score_grid.tolist())
        ]


def _float(v: float | None) -> float:
    return math.nan if v is None else float(v)


def _nan_to_none(value: object) -> object:
    """JSON has no NaN: a non-finite float becomes null (lists and dicts walked)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value


def _none_to_nan(row: Mapping[str, object]) -> dict[str, object]:
    return {k: (math.nan if v is None else v) for k, v in row.items()}


@dataclass
class DriftBlockResult:
    """The whole sweep over seeds, ready to tabulate and plot.

    Arrays are indexed ``[seed_index, norm_index, ...]`` in the order of ``seeds`` and ``norms``.
    """

    config: DriftBlockConfig
    norms: np.ndarray  # (nN,)
    seeds: tuple[int, ...]
    rows: list[DriftBlockRow]  # seed by seed, N ascending within a seed
    summary: list[NormSummary]  # one per N
    n_star: float  # mean over the seeds whose norms cross; NaN if none do
    n_star_std: float  # sample std of those (NaN for fewer than two)
    n_star_per_seed: np.ndarray  # (S,)
    score_edges: np.ndarray  # (nN, RANGE_BINS + 1): N's bin edges, from the data, shared by the seeds
    score_hist: np.ndarray  # (S, nN, H, RANGE_BINS + 2) int64: -inf, the bins, +inf and NaN
    softmax_position: np.ndarray  # (S, nN, 3, T): row max, median, min per query position
    head: dict[str, np.ndarray]  # metric -> (S, nN, H)
    notes: list[str]
    keys: tuple[str, ...]
    from_cache: tuple[bool, ...]
    seconds: float  # compute time of the seeds computed now (0 when all came from the cache)
    device: str

    def metric(self, name: str) -> np.ndarray:
        """(S, nN) one scalar metric per seed and N."""
        n = len(self.norms)
        return np.array([getattr(r, name) for r in self.rows], dtype=np.float64).reshape(len(self.seeds), n)

    def mean(self, name: str) -> np.ndarray:
        """(nN,) the metric's mean over the seeds."""
        return np.array([s.mean[name] for s in self.summary], dtype=np.float64)

    def std(self, name: str) -> np.ndarray:
        """(nN,) the metric's sample std over the seeds (NaN for one seed)."""
        return np.array([s.std[name] for s in self.summary], dtype=np.float64)

    def score_hist_pooled(self) -> np.ndarray:
        """(nN, RANGE_BINS + 2) score counts summed over seeds and heads (on ``score_edges[N]``)."""
        pooled: np.ndarray = self.score_hist.sum(axis=(0, 2))
        return pooled

    def softmax_position_mean(self) -> np.ndarray:
        """(nN, 3, T) per-position softmax max, median, min averaged over the seeds."""
        mean: np.ndarray = self.softmax_position.mean(axis=0)
        return mean

    def to_json(self) -> dict[str, object]:
        return {
            "experiment": FOLDER,
            "schema": SCHEMA,
            "settings": self.config.settings(),
            "seeds": list(self.seeds),
            "device": self.device,
            "norms": self.norms.tolist(),
            "n_star": self.n_star,
            "n_star_std": self.n_star_std,
            "n_star_per_seed": self.n_star_per_seed.tolist(),
            "notes": self.notes,
            "keys": list(self.keys),
            "from_cache": list(self.from_cache),
            "rows": [asdict(r) for r in self.rows],
            "summary": [asdict(s) for s in self.summary],
            "score_edges": self.score_edges.tolist(),
            "score_edges_layout": "[N][edge]: each N's bin edges, chosen from its scores (all seeds)",
            "score_hist_layout": f"[seed][N][head][bin]: bin 0 -inf, 1..{self.score_edges.shape[-1] - 1} "
            f"the bins of score_edges[N], {self.score_edges.shape[-1]} +inf or NaN",
            "score_hist": self.score_hist.tolist(),
            "softmax_position_layout": "[seed][N][stat][query position]",
            "softmax_stats": list(SOFTMAX_STATS),
            "softmax_position": self.softmax_position.tolist(),
            "head_layout": "[seed][N][head]",
            "head": {k: v.tolist() for k, v in self.head.items()},
            "versions": {"torch": _version("torch"), "transformers": _version("transformers")},
        }
