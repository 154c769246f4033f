"""``isotui experiment drift-block``: an untrained Transformer block fed inputs that drift along a
random direction (Godey et al. 2024, "Anisotropy is inherent to self-attention in Transformers",
section 4.2, Figures 6-10).

Setting, per seed (everything drawn from one ``torch.Generator`` seeded by the seed, in this
order): an embedding table ``E`` (``vocab`` x ``hidden``, entries N(0, init_std^2), as BERT's word
embeddings; the padding row is *not* zeroed, since no token here is padding), one
``transformers`` ``BertLayer`` built from a ``BertConfig`` of the chosen sizes with dropout 0, in
eval mode, initialised as BERT's ``_init_weights`` does (every Linear N(0, init_std^2) with zero
bias, visiting modules in order; every LayerNorm weight 1, bias 0), token ids ``B`` x ``T``
uniform over the vocabulary, and a direction ``b_u ~ N(0, I_d)``. For each N of the sweep the
block's input is ``x = E[ids] + N * b_u / ||b_u||`` (the same direction for every N; no
embedding LayerNorm, no positions, no mask: every position attends to every position).

Block (``--block``): ``post-ln`` (default) is BERT's ``BertLayer`` as transformers runs it,
``LN2(h + FFN(h))`` with ``h = LN1(x + Attn(x))``; it ends in its output LayerNorm, whose weight 1
and bias 0 give every output vector the norm ``sqrt(d * v / (v + eps))`` (``v`` the vector's
variance over its dimensions), i.e. sqrt(d) whatever the input, so N* there is where the input's
mean norm reaches sqrt(d): a property of the norm, not of attention. ``pre-ln`` runs the same
modules (same weights, same draws) as a pre-LayerNorm block, ``h = x + Attn(LN1(x))``,
``out = h + FFN(LN2(h))`` (LN1 is the attention's output LayerNorm, LN2 the block's output
LayerNorm; both weight 1, bias 0), which ends in the residual sum. Measured output
(``--measure``): ``after-norm`` (default) is the block's output; ``before-norm`` (post-ln only)
is the input of its output LayerNorm, ``h + FFN(h)``, read by a forward pre-hook.

Definitions (over the ``n = B * T`` vectors; float64 sums, as in ``isotui.core``):

- Fig. 6: ``in_*`` are the block's inputs ``x``, ``out_*`` its outputs (after the attention and
  feed-forward sublayers and their LayerNorms). ``avg_cos`` is the exact mean cosine over all
  distinct pairs, ``(||sum u_i||^2 - n) / (n (n - 1))``; ``mean_norm`` the mean of ``||x_i||``;
  ``drift_norm`` the norm of the mean vector.
- N* (fixed point): with ``D(N) = in_mean_norm(N) - out_mean_norm(N)`` over the sweep sorted by N,
  the first N where D is 0 at a sweep point, else the first pair of neighbours where D changes
  sign, linearly interpolated: ``N* = N_i + (N_{i+1} - N_i) * D_i / (D_i - D_{i+1})``. NaN, with a
  note, when D keeps one sign over the sweep. Per seed; across seeds the mean (and std) of the
  seeds that have one.
- Fig. 7: pre-softmax scores ``s = q k^T / sqrt(d_k)`` for every (query, key) pair of a sequence,
  per head, histogrammed on :func:`isotui.core.attention.score_edges` (bin 0 below -64, bins
  1..1024 evenly spaced in asinh(s / 0.001), bin 1025 at or above 64); ``score_*`` pool all heads.
- Fig. 8: queries and keys are the outputs of the attention module's own ``query``/``key``
  Linear layers (with bias), captured by forward hooks. ``q_*``/``k_*``: the full ``hidden``-sized
  vectors (all heads together); ``*_heads``: per head on its ``d_k`` slice, then averaged over the
  heads. ``cos_qk_bar``: cosine between the mean query and the mean key.
- Fig. 9: per softmax row (one query, all ``T`` keys) its max, median (numpy's: mean of the two
  middle values when ``T`` is even) and min; ``softmax_position[seed, N, stat, t]`` is that
  statistic averaged over the batch and the heads at query position ``t``. The table's
  ``softmax_max/median/min`` are their means over positions (= means over all B * H * T rows).
- Fig. 10: ``softmax_max_peak = max_t softmax_position[.., max, t]`` (the largest per-position
  mean row maximum) and ``softmax_min_floor = min_t softmax_position[.., min, t]`` (the smallest
  per-position mean row minimum).
- Several seeds: per N, the mean and the sample standard deviation (ddof=1; NaN for one seed)
  of each scalar over the seeds.

Results are cached one entry per seed (key: every setting, the sweep, the seed, the schema and
the torch/transformers versions), so a sweep asked again, or with more seeds, reuses what exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from isotui.core.attention import score_edges
from isotui.errors import Cancelled, IsotuiError
from isotui.extract.progress import Progress, ProgressCallback, StopCheck, never_stop, no_progress

if TYPE_CHECKING:
    import torch

    from isotui.store.cache import ResultCache

SCHEMA = 3  # 3: score bins asinh-spaced with scale 0.001
FOLDER = "drift-block"
DEFAULT_NORMS = "0:30:31"
MAX_NORMS = 1000
SOFTMAX_STATS = ("max", "median", "min")  # the stat axis of softmax_position
BLOCKS = ("post-ln", "pre-ln")
MEASURES = ("after-norm", "before-norm")

HELP = (
    "an untrained BERT block fed token embeddings plus a random bias of norm N, swept over N "
    "(Godey et al. 2024, Fig. 6-10): input/output anisotropy and norms and their fixed point N*, "
    "query/key alignment, score histograms, softmax sharpness. The default (BERT-base, 16 x 512 "
    "tokens, 31 norms) takes about 3 minutes per seed on 2 idle CPU cores (7-9 minutes when they "
    "are busy with other work); smaller --hidden/--seq-len/--norms are faster."
)


# ----------------------------------------------------------------------------- settings


def _settings_defaults() -> tuple[float, ...]:
    return parse_norms(DEFAULT_NORMS)


def parse_norms(text: str) -> tuple[float, ...]:
    """``start:stop:count`` (inclusive, evenly spaced) or a comma list; sorted ascending."""
    text = str(text).strip()
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3:
            raise IsotuiError(f"--norms {text!r} must be START:STOP:COUNT (e.g. 0:30:31) or a comma list")
        try:
            start, stop = float(parts[0]), float(parts[1])
            count = int(parts[2])
        except ValueError:
            raise IsotuiError(
                f"--norms {text!r} needs numbers START:STOP and a whole COUNT, e.g. 0:30:31"
            ) from None
        if not (math.isfinite(start) and math.isfinite(stop)):
            raise IsotuiError(f"--norms {text!r} has a start or stop that is not a finite number")
        if count < 1 or count > MAX_NORMS:
            raise IsotuiError(f"--norms {text!r} has count {count}; give a count from 1 to {MAX_NORMS}")
        if start > stop:
            raise IsotuiError(f"--norms {text!r} starts above where it stops; give START <= STOP")
        if count == 1 and start != stop:
            raise IsotuiError(f"--norms {text!r} has count 1 but START != STOP; give a count of 2 or more")
        values = [float(v) for v in np.linspace(start, stop, count)]
    else:
        try:
            values = [float(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise IsotuiError(
                f"--norms {text!r} is not START:STOP:COUNT or a comma list of numbers, e.g. 0,5,10"
            ) from None
        if not values:
            raise IsotuiError("--norms is empty; give START:STOP:COUNT (e.g. 0:30:31) or a comma list")
        if len(values) > MAX_NORMS:
            raise IsotuiError(f"--norms lists {len(values)} values; give at most {MAX_NORMS}")
        if len(set(values)) != len(values):
            raise IsotuiError(f"--norms {text!r} repeats a value; list each norm once")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise IsotuiError(f"--norms {text!r} has a negative or non-finite norm; norms must be >= 0")
    return tuple(sorted(values))


def parse_seeds(text: str, flag: str = "--seeds") -> tuple[int, ...]:
    """A comma list of distinct non-negative integers, in the order given."""
    try:
        seeds = tuple(int(s) for s in str(text).split(",") if s.strip())
    except ValueError:
        raise IsotuiError(f"{flag} {text!r} must be whole numbers separated by commas, e.g. 0,1,2") from None
    if not seeds:
        raise IsotuiError(f"{flag} is empty; give one or more seeds, e.g. 0,1,2")
    if any(s < 0 or s >= 2**63 for s in seeds):
        raise IsotuiError(f"{flag} {text!r} has a seed outside 0..2^63-1; give non-negative seeds")
    if len(set(seeds)) != len(seeds):
        raise IsotuiError(f"{flag} {text!r} repeats a seed; list each seed once")
    return seeds


@dataclass(frozen=True)
class DriftBlockConfig:
    """Every setting of the experiment. Construction validates (raises :class:`IsotuiError`)."""

    hidden: int = 768
    heads: int = 12
    intermediate: int = 3072
    init_std: float = 0.02
    vocab: int = 30522
    batch: int = 16
    seq_len: int = 512
    norms: tuple[float, ...] = field(default_factory=_settings_defaults)
    seeds: tuple[int, ...] = (0,)
    device: str = "auto"
    block: str = "post-ln"
    measure: str = "after-norm"

    def __post_init__(self) -> None:
        if self.block not in BLOCKS:
            raise IsotuiError(f"--block {self.block!r} is not one of {', '.join(BLOCKS)}")
        if self.measure not in MEASURES:
            raise IsotuiError(f"--measure {self.measure!r} is not one of {', '.join(MEASURES)}")
        if self.block == "pre-ln" and self.measure == "before-norm":
            raise IsotuiError(
                "--measure before-norm needs --block post-ln: a pre-LN block does not end in a "
                "LayerNorm, so its output is already the un-normalised residual sum"
            )
        for name in ("hidden", "heads", "intermediate", "vocab", "batch", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise IsotuiError(f"{flag} {value!r} must be a whole number of at least 1")
        if self.hidden % self.heads:
            raise IsotuiError(
                f"--heads {self.heads} does not divide --hidden {self.hidden}; choose a number of heads "
                "that divides the hidden size"
            )
        if not (
            isinstance(self.init_std, (int, float)) and math.isfinite(self.init_std) and self.init_std > 0
        ):
            raise IsotuiError(f"--init-std {self.init_std!r} must be a positive number, e.g. 0.02")
        if self.seq_len < 2:
            raise IsotuiError(f"--seq-len {self.seq_len} is too short; give at least 2 tokens")
        norms = tuple(sorted(float(v) for v in self.norms))
        if not norms:
            raise IsotuiError("--norms is empty; give START:STOP:COUNT (e.g. 0:30:31) or a comma list")
        if len(set(norms)) != len(norms):
            raise IsotuiError("--norms repeats a value; list each norm once")
        if any(not math.isfinite(v) or v < 0 for v in norms):
            raise IsotuiError("--norms has a negative or non-finite norm; norms must be >= 0")
        object.__setattr__(self, "norms", norms)  # ascending: arrays are indexed by N in this order
        seeds = tuple(int(s) for s in self.seeds)
        if not seeds or len(set(seeds)) != len(seeds) or any(s < 0 or s >= 2**63 for s in seeds):
            raise IsotuiError("--seeds must be one or more distinct non-negative integers, e.g. 0,1,2")
        object.__setattr__(self, "seeds", seeds)
        from isotui.extract.device import validate_device

        validate_device(self.device)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def memory_bytes(self) -> int:
        """A lower bound of the memory one seed needs (float32): the embedding table (kept on
        the device), the block, and one N's activations (inputs, Q/K/V, outputs, the feed-forward
        and the attention scores with their softmax)."""
        h, i, tokens = self.hidden, self.intermediate, self.batch * self.seq_len
        table = self.vocab * h
        block = 4 * h * h + 2 * h * i
        activations = tokens * (8 * h + 2 * i) + 2 * self.batch * self.heads * self.seq_len**2
        return 4 * (table + block + activations) + 8 * tokens

    def settings(self) -> dict[str, Any]:
        """The settings that decide the numbers (not the seeds or the device)."""
        return {
            "hidden": self.hidden,
            "heads": self.heads,
            "intermediate": self.intermediate,
            "init_std": float(self.init_std),
            "vocab": self.vocab,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "norms": [float(v) for v in self.norms],
            "block": self.block,
            "measure": self.measure,
        }

    def describe_block(self) -> str:
        """``post-ln, output after-norm``, ``post-ln, output before-norm`` or ``pre-ln`` (no final norm)."""
        return self.block if self.block == "pre-ln" else f"{self.block}, output {self.measure}"

    @property
    def ends_in_norm(self) -> bool:
        """Whether the measured output is a LayerNorm's output (post-LN block, after its norm)."""
        return self.block == "post-ln" and self.measure == "after-norm"

    def key(self, seed: int) -> str:
        """The cache key of one seed's sweep."""
        fields_ = {
            "experiment": FOLDER,
            "schema": SCHEMA,
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "dtype": "float32",
            "seed": int(seed),
            **self.settings(),
        }
        for name, default in (("block", "post-ln"), ("measure", "after-norm")):
            if fields_[name] == default:  # keys of the default sweep stay those of earlier versions
                del fields_[name]
        return hashlib.sha256(json.dumps(fields_, sort_keys=True).encode()).hexdigest()[:32]


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


# ----------------------------------------------------------------------------- results


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
    score_outside: int  # scores outside the histogram's range [-64, 64)
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


_NOT_METRICS = {
    "seed",
    "norm",
    "n_star",
    "hidden",
    "heads",
    "intermediate",
    "init_std",
    "vocab",
    "batch",
    "seq_len",
    "block",
    "measure",
}

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


@dataclass
class SeedRun:
    """One seed's sweep, as cached: rows, N*, and arrays indexed [N, ...]."""

    seed: int
    key: str
    rows: list[DriftBlockRow]
    n_star: float
    notes: list[str]
    score_hist: np.ndarray  # (nN, H, BINS + 2) int64
    softmax_position: np.ndarray  # (nN, 3, T): max, median, min per query position
    head: dict[str, np.ndarray]  # metric -> (nN, H)
    seconds: float
    device: str
    from_cache: bool = False

    def to_payload(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        payload = {
            "seed": self.seed,
            "rows": [asdict(r) for r in self.rows],
            "n_star": self.n_star,
            "notes": self.notes,
            "seconds": self.seconds,
            "device": self.device,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        arrays = {"score_hist": self.score_hist, "softmax_position": self.softmax_position}
        arrays.update({f"head.{k}": v for k, v in self.head.items()})
        return _nan_to_none(payload), arrays

    @classmethod
    def from_payload(cls, key: str, payload: dict[str, Any], arrays: dict[str, np.ndarray]) -> SeedRun:
        rows = [DriftBlockRow(**_none_to_nan(r)) for r in payload["rows"]]
        return cls(
            seed=int(payload["seed"]),
            key=key,
            rows=rows,
            n_star=_float(payload["n_star"]),
            notes=list(payload["notes"]),
            score_hist=arrays["score_hist"],
            softmax_position=arrays["softmax_position"],
            head={k: arrays[f"head.{k}"] for k in HEAD_METRICS},
            seconds=float(payload["seconds"]),
            device=str(payload["device"]),
            from_cache=True,
        )


def _float(v) -> float:
    return math.nan if v is None else float(v)


def _nan_to_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value


def _none_to_nan(row: dict[str, Any]) -> dict[str, Any]:
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
    score_edges: np.ndarray  # (BINS + 1,)
    score_hist: np.ndarray  # (S, nN, H, BINS + 2) int64: underflow, bins, overflow
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
        return np.array([s.mean[name] for s in self.summary])

    def std(self, name: str) -> np.ndarray:
        """(nN,) the metric's sample std over the seeds (NaN for one seed)."""
        return np.array([s.std[name] for s in self.summary])

    def score_hist_pooled(self) -> np.ndarray:
        """(nN, BINS + 2) score counts summed over seeds and heads."""
        return self.score_hist.sum(axis=(0, 2))

    def softmax_position_mean(self) -> np.ndarray:
        """(nN, 3, T) per-position softmax max, median, min averaged over the seeds."""
        return self.softmax_position.mean(axis=0)

    def to_json(self) -> dict[str, Any]:
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
            "score_hist_layout": "[seed][N][head][bin]: bin 0 below the first edge, 1..1024 the bins, "
            "1025 at or above the last edge",
            "score_hist": self.score_hist.tolist(),
            "softmax_position_layout": "[seed][N][stat][query position]",
            "softmax_stats": list(SOFTMAX_STATS),
            "softmax_position": self.softmax_position.tolist(),
            "head_layout": "[seed][N][head]",
            "head": {k: v.tolist() for k, v in self.head.items()},
            "versions": {"torch": _version("torch"), "transformers": _version("transformers")},
        }


# ----------------------------------------------------------------------------- N*


def fixed_point(norms, in_norm, out_norm) -> tuple[float, str | None]:
    """N where the input and output mean-norm curves first cross (linear between sweep points).

    Returns (N*, note); N* is NaN, with a note saying why, when they do not cross.
    """
    x = np.asarray(norms, dtype=np.float64)
    d = np.asarray(in_norm, dtype=np.float64) - np.asarray(out_norm, dtype=np.float64)
    span = f"N in [{x[0]:g}, {x[-1]:g}]" if len(x) else "an empty sweep"
    crossings: list[float] = []
    for i in range(len(x)):
        if d[i] == 0 and (i == 0 or d[i - 1] != 0):
            crossings.append(float(x[i]))
        elif i + 1 < len(x) and d[i] * d[i + 1] < 0:
            crossings.append(float(x[i] + (x[i + 1] - x[i]) * d[i] / (d[i] - d[i + 1])))
    if not crossings:
        if len(x) and np.all(np.isfinite(d)):
            side = "below" if d[0] < 0 else "above"
            return math.nan, (
                f"the input and output mean norms do not cross for {span} (the input stays {side} "
                "the output); widen --norms to find N*"
            )
        return math.nan, f"N* is undefined for {span}"
    note = None
    if len(crossings) > 1:
        note = f"the mean norms cross {len(crossings)} times for {span}; N* is the first crossing"
    return crossings[0], note


# ----------------------------------------------------------------------------- model and inputs


@dataclass
class BlockInputs:
    """What one seed draws: the embedding table, the block, the token ids and the bias direction."""

    embeddings: torch.Tensor  # (vocab, hidden) float32
    block: torch.nn.Module  # transformers BertLayer, eval mode
    ids: torch.Tensor  # (batch, seq_len) int64
    b_u: torch.Tensor  # (hidden,) the raw N(0, I) draw; the bias at norm N is N * b_u / ||b_u||
    kind: str = "post-ln"  # how ``run`` wires the block's modules (``DriftBlockConfig.block``)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for input ``x``: BertLayer itself (post-ln), or its modules pre-LN."""
        layer = self.block
        if self.kind == "post-ln":
            out = layer(x)
            return out[0] if isinstance(out, tuple) else out  # transformers 4 returns a tuple
        context = _self_attention(layer)(layer.attention.output.LayerNorm(x))[0]
        h = x + layer.attention.output.dense(context)
        return h + layer.output.dense(layer.intermediate(layer.output.LayerNorm(h)))

    def inputs_at(self, norm: float) -> torch.Tensor:
        """(batch, seq_len, hidden) the block's input for bias norm ``norm``."""
        return self.embeddings[self.ids] + (float(norm) / self.b_u.norm()) * self.b_u


def build_block(config: DriftBlockConfig, seed: int, *, attn_implementation: str = "sdpa") -> BlockInputs:
    """Draw everything one seed needs, on the CPU, from a generator seeded by ``seed``.

    Draw order: E, then the block's Linear weights in module order, then the ids, then b_u.
    """
    import torch
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    std = float(config.init_std)
    bert = BertConfig(
        vocab_size=config.vocab,
        hidden_size=config.hidden,
        num_attention_heads=config.heads,
        intermediate_size=config.intermediate,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=std,
        attn_implementation=attn_implementation,
    )
    with torch.no_grad():
        embeddings = torch.empty(config.vocab, config.hidden).normal_(0.0, std, generator=gen)
        block = BertLayer(bert)
        init_like_bert(block, std, gen)
        ids = torch.randint(0, config.vocab, (config.batch, config.seq_len), generator=gen)
        b_u = torch.randn(config.hidden, generator=gen)
    block.eval()
    for p in block.parameters():
        p.requires_grad_(False)
    return BlockInputs(embeddings, block, ids, b_u, config.block)


def init_like_bert(module: torch.nn.Module, std: float, gen: torch.Generator) -> None:
    """BERT's ``_init_weights`` on every submodule: Linear N(0, std^2), zero bias; LayerNorm 1, 0."""
    import torch

    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0.0, std, generator=gen)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, torch.nn.LayerNorm) or "LayerNorm" in type(m).__name__:
                if getattr(m, "weight", None) is not None:
                    m.weight.fill_(1.0)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()


def _self_attention(block) -> torch.nn.Module:
    attn = block.attention.self
    if not all(hasattr(attn, n) for n in ("query", "key")):
        raise RuntimeError("this transformers' BertLayer has no query/key Linear layers to capture")
    return attn


# ----------------------------------------------------------------------------- one N


@dataclass
class _Step:
    values: dict[str, float]
    head: dict[str, np.ndarray]  # metric -> (H,)
    hist: np.ndarray  # (H, BINS + 2)
    position: np.ndarray  # (3, T)


def _measure(built: BlockInputs, norm: float, heads: int, device, measure: str = "after-norm") -> _Step:
    """Run the block at one N and fold every statistic (float64 sums, one head at a time).

    ``measure="before-norm"`` takes as the output the input of the block's output LayerNorm."""
    import torch

    from isotui.core.attention import ScoreSums, VectorSums, row_stats

    attn = _self_attention(built.block)
    captured: dict[str, torch.Tensor] = {}

    def grab(name):
        def hook(_module, _inputs, output):
            captured[name] = output

        return hook

    handles = [attn.query.register_forward_hook(grab("q")), attn.key.register_forward_hook(grab("k"))]
    if measure == "before-norm":

        def grab_norm_input(_module, inputs):
            captured["pre_norm"] = inputs[0]

        handles.append(built.block.output.LayerNorm.register_forward_pre_hook(grab_norm_input))
    try:
        x = built.inputs_at(norm).to(device)
        out = built.run(x)
    finally:
        for h in handles:
            h.remove()
    if measure == "before-norm":
        if "pre_norm" not in captured:
            raise RuntimeError("the block's output LayerNorm was not called; cannot read its input")
        out = captured.pop("pre_norm")
    if "q" not in captured or "k" not in captured:
        raise RuntimeError("the block's query/key Linear layers were not called; cannot capture them")
    q, k = captured["q"], captured["k"]
    B, T, d = x.shape
    dk = d // heads
    scale = float(getattr(attn, "scaling", dk**-0.5))
    keep = torch.ones((B, T), dtype=torch.bool, device=device)

    def full(v: torch.Tensor) -> tuple[float, float, float, np.ndarray]:
        s = VectorSums(1, d, device)
        s.add(v[:, None], keep)
        mean_norm, bar_norm, avg = s.summary()
        return float(avg[0]), float(mean_norm[0]), float(bar_norm[0]), s.mean()[0]

    in_cos, in_norm, in_drift, _ = full(x)
    out_cos, out_norm, out_drift, _ = full(out)
    q_cos, q_norm, q_bar, q_mean = full(q)
    k_cos, k_norm, k_bar, k_mean = full(k)
    qh = q.view(B, T, heads, dk).transpose(1, 2)  # (B, H, T, dk)
    kh = k.view(B, T, heads, dk).transpose(1, 2)
    qs, ks = VectorSums(heads, dk, device), VectorSums(heads, dk, device)
    qs.add(qh, keep)
    ks.add(kh, keep)
    qh_norm, qh_bar, qh_cos = qs.summary()
    kh_norm, kh_bar, kh_cos = ks.summary()
    q_means, k_means = qs.mean(), ks.mean()
    with np.errstate(invalid="ignore", divide="ignore"):
        cos_heads = np.einsum("hd,hd->h", q_means, k_means) / (qh_bar * kh_bar)

    allowed = torch.ones((1, 1, 1, T), dtype=torch.bool, device=device)
    pairs = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
    position = torch.zeros((3, T), dtype=torch.float64, device=device)
    rows = torch.zeros((4, heads), dtype=torch.float64, device=device)
    score_sums = []
    for h in range(heads):  # one head of the whole batch at a time: (B, 1, T, T)
        s = torch.matmul(qh[:, h], kh[:, h].transpose(-1, -2)).mul_(scale)[:, None]
        acc = ScoreSums(1, device)
        acc.add(s, pairs)
        score_sums.append(acc)
        p = torch.softmax(s, dim=-1)
        del s
        stats = row_stats(p, allowed)  # each (B, 1, T)
        del p
        for i in range(3):
            position[i] += stats[i].sum((0, 1))
        for i in range(4):
            rows[i, h] = stats[i].sum()
    position = (position / (B * heads)).cpu().numpy()
    rows = (rows / (B * T)).cpu().numpy()

    hist = torch.cat([a.hist for a in score_sums]).cpu().numpy()
    n = np.array([float(a.n[0]) for a in score_sums])
    ssum = np.array([float(a.sum[0]) for a in score_sums])
    ssq = np.array([float(a.sumsq[0]) for a in score_sums])
    head_mean = ssum / n
    head_std = np.sqrt(np.maximum(ssq / n - head_mean**2, 0.0))
    pooled_mean = ssum.sum() / n.sum()
    pooled_std = math.sqrt(max(ssq.sum() / n.sum() - pooled_mean**2, 0.0))
    denom = float(np.linalg.norm(q_mean) * np.linalg.norm(k_mean))
    values = {
        "in_avg_cos": in_cos,
        "in_mean_norm": in_norm,
        "in_drift_norm": in_drift,
        "out_avg_cos": out_cos,
        "out_mean_norm": out_norm,
        "out_drift_norm": out_drift,
        "q_avg_cos": q_cos,
        "k_avg_cos": k_cos,
        "q_mean_norm": q_norm,
        "k_mean_norm": k_norm,
        "q_bar_norm": q_bar,
        "k_bar_norm": k_bar,
        "cos_qk_bar": float(q_mean @ k_mean) / denom if denom > 0 else math.nan,
        "q_avg_cos_heads": float(np.mean(qh_cos)),
        "k_avg_cos_heads": float(np.mean(kh_cos)),
        "cos_qk_bar_heads": float(np.mean(cos_heads)),
        "score_mean": float(pooled_mean),
        "score_std": pooled_std,
        "score_min": float(min(float(a.min[0]) for a in score_sums)),
        "score_max": float(max(float(a.max[0]) for a in score_sums)),
        "score_outside": int(hist[:, 0].sum() + hist[:, -1].sum()),
        "softmax_max": float(rows[0].mean()),
        "softmax_median": float(rows[1].mean()),
        "softmax_min": float(rows[2].mean()),
        "softmax_max_peak": float(position[0].max()),
        "softmax_min_floor": float(position[2].min()),
        "entropy": float(rows[3].mean()),
    }
    head = {
        "q_avg_cos": qh_cos,
        "k_avg_cos": kh_cos,
        "q_mean_norm": qh_norm,
        "k_mean_norm": kh_norm,
        "q_bar_norm": qh_bar,
        "k_bar_norm": kh_bar,
        "cos_qk_bar": cos_heads,
        "score_mean": head_mean,
        "score_std": head_std,
        "softmax_max": rows[0],
        "softmax_median": rows[1],
        "softmax_min": rows[2],
        "entropy": rows[3],
    }
    return _Step(values, {k: np.asarray(v, dtype=np.float64) for k, v in head.items()}, hist, position)


# ----------------------------------------------------------------------------- the sweep


def _too_big(config: DriftBlockConfig, device: str, have: int | None) -> IsotuiError:
    free = f", and {have / 2**30:.1f} GiB is free on {device}" if have is not None else f" on {device}"
    return IsotuiError(
        f"drift-block with --vocab {config.vocab} --hidden {config.hidden} --intermediate "
        f"{config.intermediate} --batch {config.batch} --seq-len {config.seq_len} needs at least "
        f"{config.memory_bytes() / 2**30:.1f} GiB{free}; give smaller sizes"
    )


def _check_memory(config: DriftBlockConfig, device: str) -> None:
    """Refuse sizes that cannot fit before allocating anything, saying the memory they need."""
    from isotui.extract.device import available_memory

    have = available_memory(device)
    if have is not None and config.memory_bytes() > have:
        raise _too_big(config, device, have)


def _run_seed(
    config: DriftBlockConfig,
    seed: int,
    device: str,
    *,
    tick: Callable[[float], None],
    should_stop: StopCheck,
) -> SeedRun:
    """One seed's sweep over N; ``tick(norm)`` after each N, ``should_stop`` checked before each."""
    import torch

    start = time.perf_counter()
    try:  # the estimate is a lower bound: an allocation that still fails is said the same way
        built = build_block(config, seed)
        built.block.to(device)
        built.embeddings = built.embeddings.to(device)
        built.ids = built.ids.to(device)
        built.b_u = built.b_u.to(device)
    except (MemoryError, torch.OutOfMemoryError):
        raise _too_big(config, device, None) from None
    except RuntimeError as exc:
        if "allocate" not in str(exc):
            raise
        raise _too_big(config, device, None) from None
    with torch.inference_mode():
        steps = []
        for norm in config.norms:
            if should_stop():
                raise Cancelled(f"drift-block stopped at seed {seed}, N={norm:g}")
            steps.append(_measure(built, norm, config.heads, device, config.measure))
            tick(norm)
    n_star, note = fixed_point(
        config.norms, [s.values["in_mean_norm"] for s in steps], [s.values["out_mean_norm"] for s in steps]
    )
    settings = config.settings()
    settings.pop("norms")
    rows = [
        DriftBlockRow(seed=seed, norm=float(norm), **s.values, n_star=n_star, **settings)
        for norm, s in zip(config.norms, steps, strict=True)
    ]
    return SeedRun(
        seed=seed,
        key=config.key(seed),
        rows=rows,
        n_star=n_star,
        notes=[f"seed {seed}: {note}"] if note else [],
        score_hist=np.stack([s.hist for s in steps]).astype(np.int64),
        softmax_position=np.stack([s.position for s in steps]),
        head={k: np.stack([s.head[k] for s in steps]) for k in HEAD_METRICS},
        seconds=time.perf_counter() - start,
        device=str(device),
    )


def _lookup(cache: ResultCache | None, key: str, notes: list[str]) -> SeedRun | None:
    if cache is None:
        return None
    from isotui.store.cache import CacheProblem

    try:
        found = cache.get_payload(key)
    except CacheProblem as problem:
        notes.append(f"{problem}; recomputed")
        return None
    if found is None:
        return None
    try:
        return SeedRun.from_payload(key, *found)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        notes.append(f"cache entry {key} is unreadable ({type(exc).__name__}); recomputed")
        return None


def _store(cache: ResultCache | None, run: SeedRun, notes: list[str]) -> None:
    if cache is None:
        return
    from isotui.store.cache import CacheWriteError

    try:
        cache.put_payload(run.key, *run.to_payload())
    except CacheWriteError as exc:
        notes.append(str(exc))


def drift_cache(root) -> ResultCache:
    """The drift-block sweeps' cache folder (one entry per seed) under the result cache ``root``."""
    from isotui.store.cache import ResultCache

    return ResultCache(root, folder=FOLDER, schema=SCHEMA)


def run_drift_block(
    config: DriftBlockConfig,
    cache: ResultCache | None,
    on_progress: ProgressCallback = no_progress,
    should_stop: StopCheck = never_stop,
) -> DriftBlockResult:
    """The sweep for every seed of ``config``: each seed from ``cache`` when there, else computed
    (and stored). Safe to call from a worker thread: ``on_progress`` gets a :class:`Progress`
    after each N (``samples_*`` count (seed, N) steps, ``tokens_done`` the tokens run through the
    block); ``should_stop()`` is checked before each N and raises :class:`Cancelled`."""
    n_norms, n_seeds = len(config.norms), len(config.seeds)
    total = n_norms * n_seeds
    tokens = config.batch * config.seq_len
    notes: list[str] = []
    runs: list[SeedRun] = []
    start = time.perf_counter()
    device: str | None = None
    done = 0

    def post(message: str | None = None) -> None:
        mem = 0
        if device is not None:
            from isotui.extract.device import memory_in_use

            mem = memory_in_use(device)
        on_progress(
            Progress(
                samples_done=done,
                samples_total=total,
                tokens_done=done * tokens,
                elapsed_s=time.perf_counter() - start,
                message=message,
                stage=FOLDER,
                memory_bytes=mem,
            )
        )

    for seed in config.seeds:
        key = config.key(seed)
        run = _lookup(cache, key, notes)
        if run is None:
            if device is None:  # torch is imported only when something must be computed
                from isotui.extract.device import resolve_device

                device = resolve_device(config.device)
                _check_memory(config, device)

            def tick(_norm: float) -> None:
                nonlocal done
                done += 1
                post()

            run = _run_seed(config, seed, device, tick=tick, should_stop=should_stop)
            _store(cache, run, notes)
        else:
            done += n_norms
            post()
        runs.append(run)
    return _assemble(config, runs, notes, device)


def norm_note(config: DriftBlockConfig, out_norms: list[float]) -> str:
    """The sentence that says N* of a block ending in a LayerNorm is that norm's fixed output norm."""
    low, high = min(out_norms), max(out_norms)
    measured = f"{low:.3f}" if f"{low:.3f}" == f"{high:.3f}" else f"{low:.3f} to {high:.3f}"
    return (
        f"the block ends in its output LayerNorm (weight 1, bias 0), which gives every output vector "
        f"the norm sqrt(d) = {math.sqrt(config.hidden):.3f} less the eps term (here {measured} for "
        "every N), so N* is where the input's mean norm reaches that fixed value, not an effect of "
        "attention; --measure before-norm or --block pre-ln measure the block without it"
    )


def _assemble(
    config: DriftBlockConfig, runs: list[SeedRun], notes: list[str], device: str | None
) -> DriftBlockResult:
    rows = [r for run in runs for r in run.rows]
    metrics = DriftBlockRow.metrics()
    summary = []
    for i, norm in enumerate(config.norms):
        per_seed = [run.rows[i] for run in runs]
        mean, std = {}, {}
        for name in metrics:
            values = np.array([getattr(r, name) for r in per_seed], dtype=np.float64)
            mean[name] = float(np.mean(values))
            std[name] = float(np.std(values, ddof=1)) if len(values) > 1 else math.nan
        summary.append(NormSummary(float(norm), len(per_seed), mean, std))
    stars = np.array([run.n_star for run in runs], dtype=np.float64)
    finite = stars[np.isfinite(stars)]
    n_star = float(np.mean(finite)) if len(finite) else math.nan
    n_star_std = float(np.std(finite, ddof=1)) if len(finite) > 1 else math.nan
    if 0 < len(finite) < len(stars):
        notes.append(f"N* is the mean over the {len(finite)} of {len(stars)} seeds whose norms cross")
    if config.ends_in_norm and rows:
        notes.insert(0, norm_note(config, [r.out_mean_norm for r in rows]))
    computed = [run for run in runs if not run.from_cache]
    return DriftBlockResult(
        config=config,
        norms=np.array(config.norms, dtype=np.float64),
        seeds=tuple(run.seed for run in runs),
        rows=rows,
        summary=summary,
        n_star=n_star,
        n_star_std=n_star_std,
        n_star_per_seed=stars,
        score_edges=score_edges(),
        score_hist=np.stack([run.score_hist for run in runs]),
        softmax_position=np.stack([run.softmax_position for run in runs]),
        head={k: np.stack([run.head[k] for run in runs]) for k in HEAD_METRICS},
        notes=[n for run in runs for n in run.notes] + notes,
        keys=tuple(run.key for run in runs),
        from_cache=tuple(run.from_cache for run in runs),
        seconds=sum(run.seconds for run in computed),
        device=device or (runs[0].device if runs else "none"),
    )


# ----------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    from isotui.cli_experiments import add_common

    p.add_argument("--hidden", default="768", help="hidden size d (default 768, BERT-base)")
    p.add_argument("--heads", default="12", help="attention heads; must divide --hidden (default 12)")
    p.add_argument("--intermediate", default="3072", help="feed-forward size (default 3072)")
    p.add_argument("--init-std", default="0.02", help="std of every weight and of E (default 0.02)")
    p.add_argument("--vocab", default="30522", help="rows of the embedding table E (default 30522)")
    p.add_argument("--batch", default="16", help="sequences (default 16)")
    p.add_argument("--seq-len", default="512", help="tokens per sequence (default 512)")
    p.add_argument(
        "--norms",
        default=DEFAULT_NORMS,
        help=f"bias norms N: START:STOP:COUNT, inclusive (default {DEFAULT_NORMS}), or a comma list; "
        "write --norms=-1,5 for a list that starts with a minus",
    )
    p.add_argument("--seeds", help="several seeds, e.g. 0,1,2 (overrides --seed); rows give mean ± std")
    p.add_argument(
        "--block",
        default="post-ln",
        help="post-ln (default): BERT's BertLayer, ending in its output LayerNorm; pre-ln: the same "
        "modules as a pre-LayerNorm block, x + Attn(LN(x)), then + FFN(LN(.))",
    )
    p.add_argument(
        "--measure",
        default="after-norm",
        help="after-norm (default): the block's output; before-norm: the post-ln block's output "
        "before its final LayerNorm (whose fixed output norm otherwise sets N*)",
    )
    add_common(p)


def _int(args: argparse.Namespace, name: str) -> int:
    text = str(getattr(args, name)).strip()
    flag = "--" + name.replace("_", "-")
    try:
        return int(text)
    except ValueError:
        raise IsotuiError(f"{flag} {text!r} must be a whole number, e.g. {flag} 64") from None


def config_from_args(args: argparse.Namespace) -> DriftBlockConfig:
    """The validated configuration the flags describe (no torch import)."""
    try:
        init_std = float(args.init_std)
    except ValueError:
        raise IsotuiError(f"--init-std {args.init_std!r} must be a positive number, e.g. 0.02") from None
    seeds = parse_seeds(args.seeds) if args.seeds is not None else parse_seeds(args.seed, "--seed")
    return DriftBlockConfig(
        hidden=_int(args, "hidden"),
        heads=_int(args, "heads"),
        intermediate=_int(args, "intermediate"),
        init_std=init_std,
        vocab=_int(args, "vocab"),
        batch=_int(args, "batch"),
        seq_len=_int(args, "seq_len"),
        norms=parse_norms(args.norms),
        seeds=seeds,
        device=args.device,
        block=str(args.block).strip(),
        measure=str(args.measure).strip(),
    )


# (column title, metric, format, priority: lower is kept longer on a narrow terminal)
TABLE_COLUMNS = (
    ("in cos", "in_avg_cos", ".4f", 0),
    ("out cos", "out_avg_cos", ".4f", 0),
    ("in |x|", "in_mean_norm", ".2f", 1),
    ("out |x|", "out_mean_norm", ".2f", 1),
    ("q cos", "q_avg_cos", ".4f", 3),
    ("k cos", "k_avg_cos", ".4f", 3),
    ("cos(Q̄,K̄)", "cos_qk_bar", ".4f", 2),
    ("score μ", "score_mean", ".3f", 6),
    ("score σ", "score_std", ".3f", 4),
    ("sm max", "softmax_max", ".3e", 2),
    ("sm med", "softmax_median", ".3e", 6),
    ("sm min", "softmax_min", ".3e", 2),
    ("peak max", "softmax_max_peak", ".3e", 5),
    ("floor min", "softmax_min_floor", ".3e", 5),
)


def _cell(mean: float, std: float, fmt: str) -> str:
    if math.isnan(mean):
        return "-"
    text = format(mean, fmt)
    if not math.isnan(std):  # several seeds: the std on a line of its own keeps the table narrow
        text += f"\n[dim]±{std:{'.1e' if fmt.endswith('e') else fmt}}[/]"
    return text


def result_table(result: DriftBlockResult, width: int = 200):
    """The rich table: one row per N (mean, and ± std below it, over the seeds when several).

    Columns that do not fit ``width`` are dropped, least essential first (the CSV has them all).
    """
    from rich.table import Table

    c = result.config
    seeds = ",".join(str(s) for s in result.seeds)
    title = (
        f"[bold]drift-block[/]  BERT block d={c.hidden} heads={c.heads} ffn={c.intermediate} "
        f"std={c.init_std:g}  {c.batch}x{c.seq_len} tokens  vocab {c.vocab}  {c.describe_block()}  "
        f"seed{'s' if len(result.seeds) > 1 else ''} {seeds}"
    )
    table = Table(title=title, title_justify="left", header_style="bold", pad_edge=False)
    cells = {m: [_cell(s.mean[m], s.std[m], fmt) for s in result.summary] for _, m, fmt, _ in TABLE_COLUMNS}

    def col_width(head: str, metric: str) -> int:
        lines = [
            line.replace("[dim]", "").replace("[/]", "") for v in cells[metric] for line in v.split("\n")
        ]
        return max(len(head), *map(len, lines)) + 3

    norm_width = max(len(f"{v:g}") for v in result.norms) + 3
    kept = list(TABLE_COLUMNS)
    while kept and norm_width + sum(col_width(h, m) for h, m, _, _ in kept) > width:
        kept.remove(max(kept, key=lambda col: (col[3], TABLE_COLUMNS.index(col))))
    table.add_column("N", justify="right")
    for head, _, _, _ in kept:
        table.add_column(head, justify="right", no_wrap=True)
    for i, s in enumerate(result.summary):
        table.add_row(f"{s.norm:g}", *(cells[m][i] for _, m, _, _ in kept))
    notes = []
    if len(kept) < len(TABLE_COLUMNS):
        notes.append("(narrow terminal: some columns hidden; --csv has them all)")
    notes.append(n_star_line(result))
    notes.extend(result.notes)
    table.caption = "\n".join(notes)
    table.caption_justify = "left"
    return table


def n_star_line(result: DriftBlockResult) -> str:
    if math.isnan(result.n_star):
        return "fixed point N*: none in this sweep (input and output mean norms do not cross)"
    text = f"fixed point N* (input mean norm = output mean norm): {result.n_star:.3f}"
    if not math.isnan(result.n_star_std):
        text += f" ± {result.n_star_std:.3f} over {np.isfinite(result.n_star_per_seed).sum()} seeds"
    return text


def collect(args: argparse.Namespace, err, *, width: int = 200, on_table=None, on_error=None):
    """The command's work without its output (see :func:`isotui.cli.collect_run`)."""
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    from isotui.paths import cache_dir
    from isotui.results import Outcome

    config = config_from_args(args)
    for flag in ("csv", "json"):  # say it before a long run, not after
        value = getattr(args, flag, None)
        if value and Path(value).expanduser().is_dir():
            raise IsotuiError(f"--{flag} {value} is a directory; give a file name")
    cache = None if args.no_cache else drift_cache(cache_dir(args.cache_dir))
    columns = (
        TextColumn("[bold]drift-block"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} (seed, N)"),
        TimeElapsedColumn(),
    )
    with Bar(*columns, console=err, transient=True, disable=args.quiet) as bar:
        task = bar.add_task("drift-block", total=len(config.norms) * len(config.seeds))

        def on_progress(ev: Progress) -> None:
            bar.update(task, completed=ev.samples_done, total=ev.samples_total)

        result = run_drift_block(config, cache, on_progress=on_progress)
    rows = [asdict(r) for r in result.rows]
    return Outcome("drift-block", [result], rows, result.to_json(), [result_table(result, width)])


def main(args: argparse.Namespace, err) -> int:
    from isotui.cli import stdout_console
    from isotui.cli_experiments import report

    out = stdout_console()
    outcome = collect(args, err, width=out.width)
    result = outcome.results[0]
    out.print(outcome.tables[0], highlight=False)
    if not args.quiet:
        cached = sum(result.from_cache)
        parts = [f"{cached} of {len(result.seeds)} seeds from the cache"] if cached else []
        if cached < len(result.seeds):
            parts.append(f"{result.seconds:.1f} s computing on {result.device}")
        err.print(", ".join(parts), highlight=False)
    return report(outcome, args, err)
