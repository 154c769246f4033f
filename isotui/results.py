"""Typed results of a layer-wise run: what the cache stores, the CLI prints and the TUI shows."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from isotui.core.correlation import EDGEWORTH_FLOOR, MC_PERMUTATIONS, DriftCorrelation, drift_correlation
from isotui.core.null import null_mean_quantile
from isotui.core.sampled import SE_DOF, SE_GROUPS, jackknife_t
from isotui.errors import Cancelled, IsotuiError

# Bump when a metric's definition or the stored layout changes: old entries are recomputed.
# 2: isoscore_star, iw, iw_centered, avg_cos_abtt, avg_cos_std, *_types
# 3: no token types for models without a token-type vocabulary; T5 decoders batch-invariant with
#    special tokens included; avg_cos_std's per-dimension variance in float64 (no underflow)
# 4: IsoScore* shrinks toward (tr C / d) I (scale-invariant); standard errors of the sampled
#    metrics; Spearman's permutation p beside the t approximation
# 5: I(W), centred I(W) and all-but-the-top over the exact covariance's directions where the d x d
#    sums are held (not the reservoir's own), their standard errors with those directions held
# 6: those I(W) standard errors widened by a row bootstrap's measure of the min/max selection bias
SCHEMA_VERSION = 6

ROGUE_TOP = 3


@dataclass(frozen=True)
class Metric:
    """One layer metric, declared once: the per-layer table's column, the wide table's digits,
    the app's plot (its cycle, its null line, its standard-error band), ``--wide`` and
    checkpoints' ``--metric`` choices, and the definition README's "What is measured" expands."""

    name: str  # the LayerRow field: the CSV column and the JSON key
    definition: str  # one line
    header: str = ""  # the per-layer table's column ("": CSV, plot and wide table only)
    digits: int = 4  # decimals in the tables
    min_width: int = 0  # the table drops the column on terminals narrower than this
    plottable: bool = True  # in the app's plot cycle and a choice of --wide
    null: str | None = None  # the column holding its isotropic-null line (comparable cosines)
    se: str | None = None  # the column of its standard error (a reservoir metric)


# In the order the layer table shows them, then the plot cycles through them (``m``).
METRICS: tuple[Metric, ...] = (
    Metric("avg_cos", "mean cosine over all distinct pairs, exactly", "avg_cos", null="null_p95"),
    Metric(
        "avg_cos_xctx",
        "avg_cos over pairs from different samples only",
        "xctx",
        min_width=100,
        null="null_p95",
    ),
    Metric(
        "avg_cos_centered",
        "avg_cos after subtracting the mean (reservoir, or --exact)",
        "centered",
        min_width=90,
        null="null_p95",
        se="avg_cos_centered_se",
    ),
    Metric("drift_norm", "norm of the mean vector (Godey et al.'s drift)", "drift", digits=3),
    Metric("mean_norm", "mean of the vectors' norms", "norm", digits=3),
    Metric("isoscore", "IsoScore of the covariance (Rudman et al. 2022)", "isoscore"),
    Metric("eff_rank", "exp of the entropy of the covariance's eigenvalues", "erank", digits=1, min_width=70),
    Metric("top_pc_share", "largest covariance eigenvalue over their sum", "top_pc", digits=3, min_width=80),
    Metric("isoscore_star", "IsoScore* of the covariance shrunk toward (tr C / d) I"),
    Metric(
        "iw",
        "I(W) of Mu & Viswanath 2018 (exact directions where d x d is held; Z: reservoir or --exact)",
        se="iw_se",
    ),
    Metric("iw_centered", "I(W) of the centred vectors", se="iw_centered_se"),
    Metric(
        "avg_cos_abtt",
        "avg_cos without the mean and the top PCs (all-but-the-top; PCs as I(W)'s directions)",
        null="null_p95",
        se="avg_cos_abtt_se",
    ),
    Metric("avg_cos_std", "avg_cos after z-scoring every dimension", null="null_p95", se="avg_cos_std_se"),
    Metric("avg_cos_types", "avg_cos with every token type weighted equally", null="null_p95"),
    Metric("drift_norm_types", "drift_norm with every token type weighted equally"),
    Metric("intra_sim", "mean cosine of each token to its sample's mean (Ethayarajh)"),
    Metric("self_sim", "mean cosine of a type's vectors across samples (Ethayarajh)"),
    Metric(
        "top_rogue_share",
        "the largest one dimension's share of avg_cos (rogue dims)",
        "rogue dim:share",
        digits=3,
        min_width=119,
        plottable=False,
    ),
)
METRIC: dict[str, Metric] = {m.name: m for m in METRICS}


def plugin_metrics(rows: list[LayerRow]) -> tuple[Metric, ...]:
    """The plug-in columns the rows hold (isotui.core.plugin), declared as metrics: a table
    column under their own name, a choice of ``--wide`` and of the app's plot cycle."""
    from isotui.core.plugin import column_owner

    names = list(dict.fromkeys(c for r in rows for c in r.extra))
    out = []
    for name in names:
        owner = column_owner(name)
        said = "" if owner is None else (getattr(owner, "descriptions", None) or {}).get(name, "")
        by = f"metric plug-in {owner.name!r}" if owner is not None else "a metric plug-in"
        out.append(Metric(name, said or f"{name}, from {by}", name, digits=4))
    return tuple(out)


def metrics_for(rows: list[LayerRow]) -> tuple[Metric, ...]:
    """Every metric of these rows: the built-in ones (:data:`METRICS`), then their plug-in columns."""
    return METRICS + plugin_metrics(rows)


# The per-layer metrics a plot or a heatmap can show (LayerRow fields), in the app's cycle order.
LAYER_METRICS = tuple(m.name for m in METRICS if m.plottable)
# Standard errors of the reservoir metrics (0 when exact: n <= reservoir, or --exact).
SE_FIELDS = tuple(m.se for m in METRICS if m.se)
# The metrics comparable to the isotropic null (the app's plot draws the null's line).
NULL_METRICS = tuple(m.name for m in METRICS if m.null)


@dataclass
class LayerRow:
    """One row of the per-layer table (and of the CSV, in this column order)."""

    model: str
    component: str
    layer: int
    n_vectors: int
    avg_cos: float
    drift_norm: float
    mean_norm: float
    avg_cos_xctx: float
    avg_cos_centered: float
    isoscore: float
    eff_rank: float
    top_pc_share: float
    null_p95: float
    above_null: bool
    top_rogue_dim: int
    top_rogue_share: float
    rogue_dims: str
    final_norm: bool
    depth: float
    dim: int
    n_zero: int
    n_sample: int
    spectrum_from: str
    isoscore_star: float
    iw: float
    iw_centered: float
    avg_cos_abtt: float
    avg_cos_std: float
    avg_cos_types: float
    drift_norm_types: float
    intra_sim: float
    self_sim: float
    self_sim_types: int
    # added after RUN_COLUMNS existed: the CSV writes them after those (see store.export)
    avg_cos_centered_se: float = math.nan
    iw_se: float = math.nan
    iw_centered_se: float = math.nan
    avg_cos_abtt_se: float = math.nan
    avg_cos_std_se: float = math.nan
    # the mean cosine against its own isotropic null (n vectors, not one pair: ``above_null``
    # compares avg_cos with one pair's 95th percentile); filled on load for older entries
    null_mean_p95: float = math.nan
    above_null_mean: bool = False
    # --modules: the module whose output the row measures (its name in model.named_modules())
    module: str = ""
    # plug-in metrics' columns (isotui.core.plugin), column -> value: read as attributes too
    # (``row.my_column``), written as columns after every built-in one (CSV, JSON)
    extra: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.n_vectors - self.n_zero
        unset = self.null_mean_p95 is None or math.isnan(self.null_mean_p95)
        if unset and n >= 2 and self.dim >= 2:
            self.null_mean_p95 = null_mean_quantile(n, self.dim)
            self.above_null_mean = bool(self.avg_cos > self.null_mean_p95)

    def __getattr__(self, name: str) -> float:
        """A plug-in column by name, as a built-in metric is read (``getattr(row, metric)``)."""
        extra = self.__dict__.get("extra")
        if extra is not None and name in extra:
            return float(extra[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def columns(cls) -> list[str]:
        """The built-in columns, in order (plug-in columns follow them: :meth:`as_dict`)."""
        return [f.name for f in fields(cls) if f.name != "extra"]

    def as_dict(self) -> dict[str, Any]:
        """The row as one flat dict: the built-in columns, then the plug-in ones."""
        return {**{c: getattr(self, c) for c in self.columns()}, **self.extra}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerRow:
        """A row from :meth:`as_dict` (a cached entry's JSON): other keys are plug-in columns."""
        known = set(cls.columns())
        own = {k: v for k, v in data.items() if k in known}
        nested = data.get("extra")  # asdict()'s form: nested
        rest = nested if isinstance(nested, dict) else {k: v for k, v in data.items() if k not in known}
        extra: dict[str, float] = {}
        for k, v in rest.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise TypeError(f"a layer row has a field {k!r} that is neither isotui's nor a number")
            extra[k] = math.nan if v is None else float(v)
        return cls(**own, extra=extra)


@dataclass
class ModelResult:
    """Everything one model's run produced. ``arrays`` holds per-layer vectors (see store)."""

    model: str
    key: str
    rows: list[LayerRow]
    drift: dict[str, DriftCorrelation]
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    from_cache: bool = False
    # seconds the cache write took: shown in the table and --verbose, not in the JSON or the
    # cache (a result read back from the cache exports the same bytes as when it was computed)
    write_seconds: float | None = None
    # each layer's reservoir sample, when the run was asked to keep it (save_sample=; never
    # cached: isotui.extract.sample.Sample)
    sample: Any = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The JSON form (arrays excluded; the cache stores them beside it)."""
        return {
            "schema": SCHEMA_VERSION,
            "model": self.model,
            "key": self.key,
            "rows": [r.as_dict() for r in self.rows],
            "drift": {c: d.to_dict() for c, d in self.drift.items()},
            "meta": self.meta,
            "intervals": intervals(self.rows),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], arrays: dict[str, np.ndarray]) -> ModelResult:
        rows = [LayerRow.from_dict(r) for r in data["rows"]]
        drift = {c: _current(c, DriftCorrelation(**d), d, rows) for c, d in data["drift"].items()}
        if any(r.module for r in rows) and drift.keys() != drift_of(rows)[0].keys():
            drift = drift_of(rows)[0]  # a --modules run cached before one rule: every row, all kinds
        return cls(
            model=data["model"],
            key=data["key"],
            rows=rows,
            drift=drift,
            meta=data["meta"],
            arrays=arrays,
        )


def _current(
    component: str, d: DriftCorrelation, stored: dict[str, Any], rows: list[LayerRow]
) -> DriftCorrelation:
    """A drift correlation cached before issue 28, recomputed from its rows where it changed: a
    Monte Carlo p on its floor (no resample as extreme: now an exact tail or a bound) and an
    encoder+decoder view that counted a shared layer twice. An Edgeworth p cached before issue 37
    below the floor it is now given to (0.0 where the series went negative) loads as NaN.
    Anything else loads as stored (a cached ``monte-carlo-bound`` too: still a valid bound)."""
    if "spearman_p_edgeworth" in stored:
        if d.spearman_p_edgeworth < EDGEWORTH_FLOOR:
            return replace(d, spearman_p_edgeworth=math.nan)
        return d
    if "+" in component:
        _, fresh, _ = joined_drift(rows)
        return fresh if fresh.n_layers != d.n_layers else d
    floor = 2 / (MC_PERMUTATIONS + 1)
    if d.spearman_p_method == "monte-carlo" and math.isclose(d.spearman_p, floor, rel_tol=1e-9):
        part = [r for r in rows if r.component == component]
        return drift_correlation([r.drift_norm for r in part], [r.avg_cos for r in part])
    return d


def same_vectors(a: LayerRow, b: LayerRow) -> bool:
    """Whether two rows hold the same vectors (T5's encoder and decoder layer 0 with special
    tokens left out: one shared embedding of the same tokens; GPT-NeoX's two norms of a block,
    which read one input): the same count and the same first and second moments, to float64
    rounding."""
    keys = ("avg_cos", "drift_norm", "mean_norm", "isoscore", "eff_rank")
    if a.n_vectors != b.n_vectors or a.dim != b.dim or a.n_vectors == 0:
        return False
    return all(math.isclose(getattr(a, k), getattr(b, k), rel_tol=1e-12, abs_tol=1e-15) for k in keys)


def module_kind(module: str) -> str:
    """A module's name with its index segments as ``*`` (``gpt_neox.layers.3.mlp`` ->
    ``gpt_neox.layers.*.mlp``): the rows of one kind are one site across the layers."""
    return ".".join("*" if part.isdigit() else part for part in module.split("."))


def _named(r: LayerRow) -> str:
    return r.module or f"{r.component} layer {r.layer}"


def distinct_points(rows: list[LayerRow]) -> tuple[list[LayerRow], list[LayerRow]]:
    """(kept, left out): the one rule for duplicate rows in every correlation across layers: a
    row holding the same vectors as an earlier kept row (:func:`same_vectors`) is left out, so no
    point counts twice."""
    kept: list[LayerRow] = []
    dropped: list[LayerRow] = []
    for r in rows:
        (dropped if any(same_vectors(r, o) for o in kept) else kept).append(r)
    return kept, dropped


def _correlate(points: list[LayerRow]) -> DriftCorrelation:
    return drift_correlation([r.drift_norm for r in points], [r.avg_cos for r in points])


def _left_out(label: str, dropped: list[LayerRow]) -> str:
    shown = ", ".join(_named(r) for r in dropped[:4]) + (
        f" and {len(dropped) - 4} more" if len(dropped) > 4 else ""
    )
    return (
        f"{label} drift correlation: {shown} left out, the same vectors as an earlier row, "
        "so no point counts twice"
    )


def stack_drift(component: str, rows: list[LayerRow]) -> tuple[dict[str, DriftCorrelation], list[str]]:
    """One stack's drift correlations across its layers (Godey et al. Fig. 5) and their notes.
    Duplicate rows are left out (:func:`distinct_points`); rows of several module kinds
    (``--modules`` matching attention and MLP outputs, both norms of a block) are correlated per
    kind, keyed ``component:kind``: a correlation across interleaved kinds is not the papers'
    across-layer one. A kind with fewer than 3 distinct rows (a final norm's one; a norm whose
    every input repeats another norm's) has none: the notes say so."""
    kept, dropped = distinct_points(rows)
    notes = [_left_out(component, dropped)] if dropped else []
    kinds = list(dict.fromkeys(module_kind(r.module) for r in rows))
    if len(kinds) <= 1:
        return {component: _correlate(kept)}, notes
    groups = {k: [r for r in kept if module_kind(r.module) == k] for k in kinds}
    out = {f"{component}:{k}": _correlate(g) for k, g in groups.items() if len(g) >= 3}
    few = [k for k, g in groups.items() if len(g) < 3]
    notes.append(
        f"{component}: the rows are {len(kinds)} kinds of module, so the drift correlation is "
        f"taken across the layers of each kind"
        + (f"; none for {', '.join(few)} (fewer than 3 distinct rows)" if few else "")
    )
    return out, notes


def drift_of(rows: list[LayerRow]) -> tuple[dict[str, DriftCorrelation], list[str]]:
    """Every drift correlation of a run's rows and the notes that say what was left out: per
    stack (:func:`stack_drift`), then, for an encoder-decoder, every stack's layers in order
    (:func:`joined_drift`)."""
    drift: dict[str, DriftCorrelation] = {}
    notes: list[str] = []
    components = list(dict.fromkeys(r.component for r in rows))
    for component in components:
        part, said = stack_drift(component, [r for r in rows if r.component == component])
        drift.update(part)
        notes += said
    if len(components) > 1:
        joined, drift[joined], note = joined_drift(rows)
        notes += [note] if note else []
    return drift, notes


def joined_drift(rows: list[LayerRow]) -> tuple[str, DriftCorrelation, str]:
    """(key, correlation, note) over every stack's layers in order (Godey et al. Fig. 1's T5:
    encoder, then decoder), a layer holding the same vectors as an earlier one's taken once."""
    joined = "+".join(dict.fromkeys(r.component for r in rows))
    points, dropped = distinct_points(rows)
    return joined, _correlate(points), _left_out(joined, dropped) if dropped else ""


def intervals(rows: list[LayerRow], level: float = 0.95) -> dict[str, Any]:
    """95% intervals of the sampled metrics, value -/+ t(0.975, G - 1) x SE: the SE is a
    delete-a-group jackknife over G = 8 groups, so 7 degrees of freedom and t = 2.36. Per row, each
    sampled metric's ``[low, high]`` (``[value, value]`` where exact, SE 0; null where unknown).
    Derived from the rows, never stored: a cached entry gets them too."""
    t = jackknife_t(level)
    out = []
    for r in rows:
        row: dict[str, Any] = {"component": r.component, "layer": r.layer}
        for m in METRICS:
            if m.se:
                value, se = getattr(r, m.name), getattr(r, m.se)
                ok = value is not None and math.isfinite(value) and se is not None and math.isfinite(se)
                row[m.name] = [value - t * se, value + t * se] if ok else None
        out.append(row)
    return {
        "method": "delete-a-group jackknife of the reservoir: value -/+ t x SE",
        "groups": SE_GROUPS,
        "dof": SE_DOF,
        "level": level,
        "t": t,
        "rows": out,
        "biased": [{"component": r.component, "layer": r.layer} for r in own_directions(rows)],
    }


def own_directions(rows: list[LayerRow]) -> list[LayerRow]:
    """The sampled layers whose I(W) and all-but-the-top use the reservoir's own principal
    directions (the d x d sums were not held): there the sample's bias is as large as the SE
    (+1.0 SE for all-but-the-top, -0.67 SE for I(W) measured on MiniLM), which the interval does
    not cover; ``--exact`` removes it."""
    return [
        r
        for r in rows
        if r.spectrum_from.startswith("sample")
        and any(getattr(r, f) or 0 for f in ("iw_se", "avg_cos_abtt_se"))
    ]


@dataclass
class Outcome:
    """What one command (``run`` or an experiment) computed, before anything is printed or
    written: the CLI prints ``tables`` and writes ``rows`` (--csv) and ``payload`` (--json); the
    Python API (:mod:`isotui.api`) hands the same object to a notebook."""

    command: str  # "run" or the experiment's name
    results: list  # the experiment's own result objects, one per model (or one per series)
    rows: list[dict[str, Any]]  # the --csv rows, keys in column order
    payload: dict[str, Any]  # the --json document
    tables: list = field(default_factory=list, repr=False)  # rich renderables, in print order
    failed: list[tuple[str, str]] = field(default_factory=list)  # (model, the one-sentence error)
    internal: list[str] = field(default_factory=list)  # the failed ones whose failure was a bug
    total: int = 0  # how many models (or checkpoints) were asked for; 0: results + failed
    what: str = "models"  # what ``total`` counts, for the closing line


TableCallback = Callable[[Any], None]
ErrorCallback = Callable[[str, str], None]


class ModelFailures:
    """The failures of a multi-model command, each its own: said in one sentence as it happens,
    so the other models still run and whatever succeeded is printed, exported and cached."""

    def __init__(self, outcome, on_error=None) -> None:
        self.outcome = outcome
        self.on_error = on_error  # (name, sentence): the CLI prints it; the Python API does not

    def attempt(self, name: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, or None after recording (and saying) why it failed; Ctrl-C
        and a closed stdout still stop everything."""
        try:
            return fn(*args, **kwargs)
        except (KeyboardInterrupt, Cancelled, BrokenPipeError):
            raise
        except IsotuiError as exc:
            text = str(exc)
        except Exception as exc:
            if os.environ.get("ISOTUI_DEBUG"):
                raise
            text = f"internal error in {name}: {type(exc).__name__}: {exc}"
            text += " (set ISOTUI_DEBUG=1 for the traceback)"
            self.outcome.internal.append(name)
        self.outcome.failed.append((name, text))
        if self.on_error:
            self.on_error(name, text)
        return None
