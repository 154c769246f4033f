"""Inside self-attention (Godey et al. 2024, section 5): per layer and head, the mean query and
key, their norms, cosine and scalar product, the pre-softmax scores and the softmax's sharpness.

``isotui experiment attention -m MODEL`` prints one row per layer (heads averaged) and writes one
CSV row per layer and head; results are cached like layer runs (folder ``attention``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict, cast

import numpy as np
import numpy.typing as npt

from isotui.experiments import plans
from isotui.experiments.base import Arrays, Context, Experiment, OneModelJob, Payload, Rows
from isotui.experiments.json_types import from_fields
from isotui.experiments.params import param
from isotui.extract.progress import ProgressCallback, StopCheck, never_stop, no_progress

if TYPE_CHECKING:
    from isotui.experiments.base import Notice
    from isotui.experiments.layer_pass import Prepared
    from isotui.spec import RunSpec
    from isotui.store.cache import ResultCache

HELP = "queries, keys and attention sharpness per layer and head (Godey et al. 2024, sec. 5)"
SCHEMA = 3  # 3: score bins asinh-spaced with scale 0.001
FOLDER = "attention"


@dataclass
class AttentionRow:
    """One head of one attention module (CSV columns, in this order)."""

    model: str
    component: str
    layer: int
    attention: str  # self | cross
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
    rope: bool
    q_bar_norm_pre_rope: float
    k_bar_norm_pre_rope: float
    cos_qk_bar_pre_rope: float
    dot_qk_bar_pre_rope: float
    n_scores: int
    score_mean: float
    score_std: float
    score_min: float
    score_max: float
    softmax_max: float
    softmax_median: float
    softmax_min: float
    entropy: float

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class AttentionSite(TypedDict):
    """One attention module of a result (``meta["modules"]``, in array-index order)."""

    component: str
    layer: int
    attention: str  # self | cross


class AttentionEntry(TypedDict):
    """A cache entry's payload, as :meth:`AttentionResult.to_json` writes it."""

    model: str
    key: str
    rows: list[dict[str, object]]  # each an AttentionRow's fields
    meta: dict[str, object]


@dataclass
class AttentionResult:
    """Every head's row, the metadata, and per module: score histograms, Q_bar, K_bar and (for
    the dynamics) subsamples of queries and keys, keyed ``hist.i``, ``q_bar.i``... with i the
    module's index in ``meta['modules']``."""

    model: str
    key: str
    rows: list[AttentionRow]
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    from_cache: bool = False

    def to_json(self) -> Payload:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "key": self.key,
            "rows": [asdict(r) for r in self.rows],
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object], arrays: dict[str, np.ndarray]) -> AttentionResult:
        """Read a cached entry back; ValueError/TypeError/KeyError if its structure is not the one
        this version writes (a valid checksum says the bytes are intact, not that they fit)."""
        entry = cast("AttentionEntry", data)  # the cache checked its schema; _check checks the rest
        result = cls(
            entry["model"],
            entry["key"],
            [from_fields(AttentionRow, r) for r in entry["rows"]],
            entry["meta"],
            arrays,
        )
        result._check()
        return result

    def _check(self) -> None:
        kinds = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}
        for row in self.rows:
            for f in fields(AttentionRow):
                value = getattr(row, f.name)
                wrong_bool = f.type != "bool" and isinstance(value, bool)
                if wrong_bool or not isinstance(value, kinds[str(f.type)]):
                    raise TypeError(f"row field {f.name} is {type(value).__name__}")
        if not isinstance(self.model, str) or not isinstance(self.meta, dict):
            raise TypeError("model or meta of the wrong type")
        sites = set()
        for i, m in enumerate(self.modules()):
            sites.add((m["component"], m["layer"], m["attention"]))
            for name in ("hist", "q_bar", "k_bar"):
                if f"{name}.{i}" not in self.arrays:
                    raise KeyError(f"{name}.{i}")
        if any((r.component, r.layer, r.attention) not in sites for r in self.rows):
            raise ValueError("rows of modules the entry does not describe")

    def modules(self) -> list[AttentionSite]:
        """Each module's site (component, layer, attention kind) in array-index order."""
        modules: list[AttentionSite] = self.meta["modules"]
        return modules

    def module_rows(self, i: int) -> list[AttentionRow]:
        m = self.modules()[i]
        return [
            r
            for r in self.rows
            if (r.component, r.layer, r.attention) == (m["component"], m["layer"], m["attention"])
        ]


@dataclass
class LayerSummary:
    """Heads of one module averaged (the per-layer view of Godey et al. Figs. 11-15)."""

    component: str
    layer: int
    attention: str
    heads: int
    cos_qk_bar: float
    cos_qk_bar_min: float
    cos_qk_bar_max: float
    dot_qk_bar: float
    q_bar_norm: float
    k_bar_norm: float
    q_avg_cos: float
    k_avg_cos: float
    score_mean: float
    score_std: float
    softmax_max: float
    softmax_median: float
    softmax_min: float
    entropy: float
    cos_qk_bar_pre_rope: float  # NaN for a model without rotary embeddings


def summarize(result: AttentionResult) -> list[LayerSummary]:
    """One row per attention module, heads averaged (NaN-aware)."""
    out = []
    for i, m in enumerate(result.modules()):
        rows = result.module_rows(i)

        def mean(attr: str, rows: list[AttentionRow] = rows) -> float:
            vals = np.array([getattr(r, attr) for r in rows], dtype=float)
            vals = vals[np.isfinite(vals)]
            return float(vals.mean()) if len(vals) else math.nan

        cos = np.array([r.cos_qk_bar for r in rows], dtype=float)
        cos = cos[np.isfinite(cos)]
        out.append(
            LayerSummary(
                component=m["component"],
                layer=m["layer"],
                attention=m["attention"],
                heads=len(rows),
                cos_qk_bar=mean("cos_qk_bar"),
                cos_qk_bar_min=float(cos.min()) if len(cos) else math.nan,
                cos_qk_bar_max=float(cos.max()) if len(cos) else math.nan,
                dot_qk_bar=mean("dot_qk_bar"),
                q_bar_norm=mean("q_bar_norm"),
                k_bar_norm=mean("k_bar_norm"),
                q_avg_cos=mean("q_avg_cos"),
                k_avg_cos=mean("k_avg_cos"),
                score_mean=mean("score_mean"),
                score_std=mean("score_std"),
                softmax_max=mean("softmax_max"),
                softmax_median=mean("softmax_median"),
                softmax_min=mean("softmax_min"),
                entropy=mean("entropy"),
                cos_qk_bar_pre_rope=mean("cos_qk_bar_pre_rope"),
            )
        )
    return out


def cache_key(layer_key: str, sample_size: int) -> str:
    """The attention result's key: the layer run's key (model, data, limits, dtype, seed...) plus
    this experiment's schema and subsample size."""
    from isotui.experiments.cached import experiment_key

    return experiment_key(layer_key, FOLDER, SCHEMA, {"sample": sample_size})


def attention_cache(root: Path) -> ResultCache:
    from isotui.store.cache import ResultCache

    return ResultCache(root, folder=FOLDER, schema=SCHEMA)


def measure_attention(
    spec: RunSpec,
    cache: ResultCache | None,
    *,
    sample_size: int = 0,
    on_progress: ProgressCallback = no_progress,
    should_stop: StopCheck = never_stop,
    on_notice: Notice | None = None,
) -> AttentionResult:
    """The attention result for ``spec`` (a :class:`~isotui.spec.RunSpec`): from ``cache`` (an
    :func:`attention_cache`, or None) when present, else computed and stored.

    ``sample_size``: queries and keys kept per module (a uniform subsample, the same tokens for
    every checkpoint of a model) for the dynamics' common SVD; 0 keeps none.
    """
    prepared, key, hit = find_attention(spec, cache, sample_size, on_notice)
    if hit is not None:
        return hit
    return compute_attention(prepared, key, sample_size, cache, on_progress, should_stop, on_notice)


def find_attention(
    spec: RunSpec, cache: ResultCache | None, sample_size: int = 0, on_notice: Notice | None = None
) -> tuple[Prepared, str, AttentionResult | None]:
    """(prepared run, cache key, cached result or None): the quick part, no model loaded."""
    from isotui.experiments.cached import lookup
    from isotui.experiments.layer_pass import prepare

    prepared = prepare(spec, cache)
    key = cache_key(prepared.key, sample_size)
    # the current key, then one an older isotui wrote
    keys = [cache_key(layer_key, sample_size) for layer_key in prepared.keys]
    result = lookup(cache, keys, AttentionResult.from_json, on_notice)
    if result is None:
        return prepared, key, None
    result.model = spec.model
    for row in result.rows:
        row.model = spec.model
    result.from_cache = True
    return prepared, key, result


def compute_attention(
    prepared: Prepared,
    key: str,
    sample_size: int,
    cache: ResultCache | None,
    on_progress: ProgressCallback = no_progress,
    should_stop: StopCheck = never_stop,
    on_notice: Notice | None = None,
) -> AttentionResult:
    """Load the model, measure, and store the result (a cache that cannot be written is said)."""
    from isotui.experiments.cached import keep

    result = _compute(prepared, key, sample_size, on_progress, should_stop)
    keep(cache, key, result.to_json(), result.arrays, on_notice)
    return result


@dataclass(frozen=True)
class AttentionRequest(OneModelJob):
    """Queries, keys and attention sharpness of one model (``isotui experiment attention``)."""

    spec: RunSpec
    sample_size: int = 0
    kind: ClassVar[str] = "attention"

    def keys(self, cache_root: Path | None) -> list[str]:
        return [find_attention(self.spec, None, self.sample_size)[1]]

    def lookup(self, cache_root: Path | None, notice: Notice) -> AttentionResult | None:
        cache = attention_cache(cache_root) if cache_root else None
        return find_attention(self.spec, cache, self.sample_size, notice)[2]

    def compute(self, context: Context) -> AttentionResult:
        cache = attention_cache(context.cache_root) if context.cache_root else None
        prepared, key, _ = find_attention(self.spec, None, self.sample_size)
        return compute_attention(
            prepared, key, self.sample_size, cache, context.on_progress, context.should_stop, context.notice
        )

    def measure(self, context: Context) -> AttentionResult:
        return measure_attention(
            self.spec,
            attention_cache(context.cache_root) if context.cache_root else None,
            sample_size=self.sample_size,
            on_progress=context.on_progress,
            should_stop=context.should_stop,
            on_notice=context.notice,
        )


def _compute(
    prepared: Prepared, key: str, sample_size: int, on_progress: ProgressCallback, should_stop: StopCheck
) -> AttentionResult:
    from importlib import metadata

    import torch

    from isotui.experiments.layer_pass import extract_options, load_prepared
    from isotui.extract.attention import extract_attention
    from isotui.version import __version__

    spec = prepared.spec
    loaded, device = load_prepared(prepared)
    ex = extract_attention(
        loaded,
        prepared.samples,
        device=device,
        opts=extract_options(spec),
        on_progress=on_progress,
        should_stop=should_stop,
        model_name=spec.model,
        modality=spec.data.modality,
        sample_size=sample_size,
    )
    rows: list[AttentionRow] = []
    arrays: Arrays = {}
    modules: list[AttentionSite] = []
    nan = math.nan
    for i, m in enumerate(ex.modules):
        modules.append({"component": m.site.component, "layer": m.site.layer, "attention": m.site.kind})
        arrays[f"hist.{i}"] = m.histograms.astype(np.int64)
        arrays[f"q_bar.{i}"] = m.q_bar.astype(np.float64)
        arrays[f"k_bar.{i}"] = m.k_bar.astype(np.float64)
        if m.q_sample is not None and m.k_sample is not None:  # kept together
            arrays[f"q_sample.{i}"] = m.q_sample.astype(np.float32)
            arrays[f"k_sample.{i}"] = m.k_sample.astype(np.float32)
        for h, s in enumerate(m.heads):
            pre = m.pre_rope[h] if m.pre_rope else (nan, nan, nan, nan)
            head = asdict(s)
            rows.append(
                AttentionRow(
                    model=spec.model,
                    component=m.site.component,
                    layer=m.site.layer,
                    attention=m.site.kind,
                    rope=m.rope,
                    q_bar_norm_pre_rope=pre[0],
                    k_bar_norm_pre_rope=pre[1],
                    cos_qk_bar_pre_rope=pre[2],
                    dot_qk_bar_pre_rope=pre[3],
                    **head,
                )
            )
    meta = {
        "data": spec.data.describe(),
        "modality": loaded.modality,
        "model_fingerprint": prepared.model_fingerprint,
        "model_class": type(loaded.model).__name__,
        "n_samples": ex.n_samples,
        "n_tokens": ex.n_tokens,
        "max_length": ex.max_length or None,
        "special_tokens": spec.special_tokens,
        "dtype": prepared.dtype,
        "device": device,
        "seed": spec.seed,
        "sample_size": sample_size,
        "modules": modules,
        "score_edges": [float(x) for x in _edges()],
        "seconds": round(ex.seconds, 3),
        "notes": loaded.notes + ex.notes,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {
            "isotui": __version__,
            "torch": str(torch.__version__),  # a plain str: results unpickle without torch
            "transformers": metadata.version("transformers"),
        },
    }
    return AttentionResult(spec.model, key, rows, meta, arrays)


def _edges() -> npt.NDArray[np.float64]:
    from isotui.core.attention import score_edges

    return score_edges()


# --- export and command-line options ------------------------------------------------------------


def csv_rows(results: list[AttentionResult]) -> Rows:
    """The ``--csv`` rows: one per model, layer and head."""
    return [asdict(r) for res in results for r in res.rows]


def json_payload(results: list[AttentionResult]) -> Payload:
    """The ``--json`` document: each result with its arrays as lists."""
    return {
        "results": [
            res.to_json() | {"arrays": {k: v.tolist() for k, v in res.arrays.items()}} for res in results
        ]
    }


@dataclass(frozen=True)
class AttentionParams:
    """attention's own parameters (the front ends add the models and the run options)."""

    heads: bool = param(False, switch=True, view=True, help="print every head, not heads averaged per layer")


EXPERIMENT: Experiment[RunSpec, AttentionParams, AttentionRequest, AttentionResult] = Experiment(
    name="attention",
    help=HELP,
    request_type=AttentionRequest,
    result_type=AttentionResult,
    folder=FOLDER,
    schema=SCHEMA,
    make_request=lambda spec, _params: AttentionRequest(spec),
    rows=csv_rows,
    payload=json_payload,
    params=AttentionParams,
    decode=AttentionResult.from_json,
    plan=plans.attention,
    lab_tab="isotui.tui.lab_heads:HeadsTab",
)
