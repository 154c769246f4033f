"""Queries and keys along training (Godey et al. 2024, section 5.2, Figs. 11-15 and 19-23).

A checkpoint series is measured checkpoint by checkpoint with the attention experiment (each one
cached on its own, so adding a checkpoint later costs one run). Per checkpoint, layer and head:
cos(Q_bar, K_bar), Q_bar . K_bar, norms, attention entropy; and the 2-D trajectories of Q_bar and
K_bar in a basis shared by all checkpoints: the top two singular vectors of the union of the
checkpoints' queries and keys (uncentered), or of the queries only, or of the keys only
(App. C). The SVD uses a uniform subsample of query and key positions (``--sample``, 256 per
module by default), chosen by (sample, position) so every checkpoint contributes the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, TypedDict, cast

import numpy as np

from isotui.core.trajectory import BASES, common_basis, project
from isotui.errors import IsotuiError
from isotui.experiments import plans
from isotui.experiments.attention import SCHEMA as ATTENTION_SCHEMA
from isotui.experiments.attention import AttentionRequest, AttentionResult
from isotui.experiments.base import Context, Experiment, Notice, Payload, Rows
from isotui.experiments.params import param
from isotui.experiments.series import Attempts, SeriesRequest, unpack_series
from isotui.experiments.series import Checkpoint as Checkpoint  # the series' names, as before
from isotui.experiments.series import resolve_checkpoints as resolve_checkpoints
from isotui.experiments.series import series_name as series_name

if TYPE_CHECKING:
    from isotui.experiments.base import PartProgress
    from isotui.experiments.series import Failures, SeriesSpec
    from isotui.extract.progress import StopCheck
    from isotui.spec import RunSpec
    from isotui.store.cache import ResultCache

HELP = "queries and keys along a checkpoint series (Godey et al. 2024, Figs. 11-15, 19-23)"
DEFAULT_SAMPLE = 256


@dataclass
class DynamicsRow:
    """One head at one checkpoint (CSV columns, in this order). ``q_x_qk``: Q_bar's first
    coordinate in the basis of queries and keys together; ``_q``/``_k``: queries or keys only."""

    series: str
    checkpoint: str
    step: int
    component: str
    layer: int
    attention: str
    head: int
    kv_head: int
    cos_qk_bar: float
    dot_qk_bar: float
    q_bar_norm: float
    k_bar_norm: float
    entropy: float
    softmax_max: float
    q_x_qk: float
    q_y_qk: float
    k_x_qk: float
    k_y_qk: float
    q_x_q: float
    q_y_q: float
    k_x_q: float
    k_y_q: float
    q_x_k: float
    q_y_k: float
    k_x_k: float
    k_y_k: float

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class DynamicsMeta(TypedDict, total=False):
    """A series' facts (see :func:`assemble`; empty until it is assembled)."""

    data: str | None  # None: its first checkpoint's result did not say
    n_samples: int | None
    sample_size: int
    from_cache: list[bool]  # per checkpoint
    keys: list[str]  # each checkpoint's attention result (isotui show KEY)
    notes: list[str]


@dataclass
class DynamicsResult:
    series: str
    checkpoints: list[Checkpoint]
    rows: list[DynamicsRow]
    sites: list[tuple[str, int, str]]  # (component, layer, attention) per module
    meta: DynamicsMeta = field(default_factory=lambda: DynamicsMeta())

    def steps(self) -> list[int]:
        return [c.step if c.step is not None else i for i, c in enumerate(self.checkpoints)]

    @property
    def from_cache(self) -> bool:
        """Every checkpoint came from the cache."""
        return bool(self.meta.get("from_cache")) and all(self.meta["from_cache"])

    def layer_means(self, attr: str) -> np.ndarray:
        """(checkpoints, modules): ``attr`` averaged over heads (NaN-aware)."""
        out = np.full((len(self.checkpoints), len(self.sites)), math.nan)
        labels = [c.label for c in self.checkpoints]
        groups: dict[tuple[int, int], list[float]] = {}
        for r in self.rows:
            key = (labels.index(r.checkpoint), self.sites.index((r.component, r.layer, r.attention)))
            groups.setdefault(key, []).append(getattr(r, attr))
        for (i, j), vals in groups.items():
            v = np.asarray(vals, dtype=float)
            v = v[np.isfinite(v)]
            out[i, j] = v.mean() if len(v) else math.nan
        return out

    def trajectory(self, site: int, head: int, basis: str = "qk") -> tuple[np.ndarray, np.ndarray]:
        """(checkpoints, 2) coordinates of Q_bar and of K_bar for one head, in checkpoint order."""
        comp, layer, att = self.sites[site]
        rows = [
            r for r in self.rows if (r.component, r.layer, r.attention, r.head) == (comp, layer, att, head)
        ]
        q = np.array([[getattr(r, f"q_x_{basis}"), getattr(r, f"q_y_{basis}")] for r in rows])
        k = np.array([[getattr(r, f"k_x_{basis}"), getattr(r, f"k_y_{basis}")] for r in rows])
        return q, k


def dynamics(series: str, checkpoints: list[Checkpoint], results: list[AttentionResult]) -> DynamicsResult:
    """Assemble the per-checkpoint attention results (with subsamples) into trajectories."""
    # each module's (component, layer, attention), in the order attention writes a site's keys
    sites = [cast("tuple[str, int, str]", tuple(m.values())) for m in results[0].modules()]

    def shapes(res: AttentionResult) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [(res.arrays[f"q_bar.{i}"].shape, res.arrays[f"k_bar.{i}"].shape) for i in range(len(sites))]

    for ckpt, res in zip(checkpoints, results, strict=True):
        same = [tuple(m.values()) for m in res.modules()] == sites
        if not same or shapes(res) != shapes(results[0]):
            raise IsotuiError(
                f"checkpoint {ckpt.label!r} has other attention layers than {checkpoints[0].label!r}; "
                "a series must be checkpoints of one architecture"
            )
    rows: list[DynamicsRow] = []
    per_ckpt: list[list[DynamicsRow]] = [[] for _ in checkpoints]
    for i, (comp, layer, att) in enumerate(sites):
        heads = results[0].module_rows(i)
        for hrow in heads:
            h, g = hrow.head, hrow.kv_head
            q_samples = [res.arrays[f"q_sample.{i}"][h] for res in results]
            k_samples = [res.arrays[f"k_sample.{i}"][g] for res in results]
            bases = {
                "qk": common_basis(q_samples + k_samples),
                "q": common_basis(q_samples),
                "k": common_basis(k_samples),
            }
            for t, (ckpt, res) in enumerate(zip(checkpoints, results, strict=True)):
                r = res.module_rows(i)[h]
                coords: dict[str, float] = {}
                for name in BASES:
                    basis = bases[name]
                    qp = _xy(res.arrays[f"q_bar.{i}"][h], basis)
                    kp = _xy(res.arrays[f"k_bar.{i}"][g], basis)
                    coords |= {
                        f"q_x_{name}": qp[0],
                        f"q_y_{name}": qp[1],
                        f"k_x_{name}": kp[0],
                        f"k_y_{name}": kp[1],
                    }
                per_ckpt[t].append(
                    DynamicsRow(
                        series=series,
                        checkpoint=ckpt.label,
                        step=ckpt.step if ckpt.step is not None else t,
                        component=comp,
                        layer=layer,
                        attention=att,
                        head=h,
                        kv_head=g,
                        cos_qk_bar=r.cos_qk_bar,
                        dot_qk_bar=r.dot_qk_bar,
                        q_bar_norm=r.q_bar_norm,
                        k_bar_norm=r.k_bar_norm,
                        entropy=r.entropy,
                        softmax_max=r.softmax_max,
                        **coords,
                    )
                )
    for part in per_ckpt:
        rows += part
    return DynamicsResult(series, checkpoints, rows, list(sites))


def _xy(vector: np.ndarray, basis: np.ndarray) -> tuple[float, float]:
    if basis.shape[0] < 2 or not np.all(np.isfinite(vector)):
        return math.nan, math.nan
    x, y = project(vector, basis)
    return float(x), float(y)


def run_dynamics(
    model: str | None,
    checkpoints: list[Checkpoint],
    base_spec: RunSpec,
    cache: ResultCache | None,
    *,
    sample_size: int = DEFAULT_SAMPLE,
    progress: PartProgress | None = None,
    should_stop: StopCheck | None = None,
    on_notice: Notice | None = None,
    failures: Failures | None = None,
) -> DynamicsResult | None:
    """Measure every checkpoint (each cached on its own), then build the trajectories.

    ``progress(i, checkpoint)``, if given, returns a context manager yielding that checkpoint's
    progress callback (a bar headless, job events in the app). ``failures`` (a
    :class:`isotui.cli.ModelFailures`): a checkpoint that fails is said and left out, the series
    is built from the rest (None when none is left); without it the first failure ends the series.
    """
    from isotui.experiments.attention import measure_attention
    from isotui.experiments.series import measure_checkpoints
    from isotui.extract.progress import never_stop

    kept, results = measure_checkpoints(
        checkpoints,
        lambda ckpt, on_progress: measure_attention(
            base_spec.with_model(ckpt.model),
            cache,
            sample_size=sample_size,
            on_progress=on_progress,
            should_stop=should_stop or never_stop,
            on_notice=on_notice,
        ),
        progress=progress,
        attempt=failures.attempt if failures is not None else None,
    )
    return assemble(model, kept, results, sample_size) if results else None


def assemble(
    model: str | None, checkpoints: list[Checkpoint], results: list[AttentionResult], sample_size: int
) -> DynamicsResult:
    """The series from its checkpoints' attention results (measured or cached)."""
    out = dynamics(model or series_name(checkpoints), checkpoints, results)
    out.meta = {
        "data": results[0].meta.get("data"),
        "n_samples": results[0].meta.get("n_samples"),
        "sample_size": sample_size,
        "from_cache": [r.from_cache for r in results],
        "keys": [r.key for r in results],  # each checkpoint's attention result (isotui show KEY)
        "notes": sorted({n for r in results for n in r.meta.get("notes", [])}),
    }
    return out


@dataclass(frozen=True)
class DynamicsRequest(SeriesRequest[DynamicsResult]):
    """Queries and keys along a checkpoint series (``isotui experiment qk-dynamics``)."""

    sample_size: int = 256
    kind: ClassVar[str] = "qk-dynamics"

    def _parts(self) -> Sequence[AttentionRequest]:
        return [AttentionRequest(self.spec.with_model(c.model), self.sample_size) for c in self.checkpoints]

    def lookup(self, cache_root: Path | None, notice: Notice) -> DynamicsResult | None:
        """Answered at once only when every checkpoint is cached."""
        if cache_root is None:
            return None
        found: list[AttentionResult] = []
        for part in self._parts():
            hit = part.lookup(cache_root, notice)
            if hit is None:
                return None
            found.append(hit)
        return assemble(self.series, list(self.checkpoints), found, self.sample_size)

    def measure(self, context: Context) -> DynamicsResult | None:
        from isotui.experiments.attention import attention_cache

        cache = attention_cache(context.cache_root) if context.cache_root else None
        return run_dynamics(
            self.series,
            list(self.checkpoints),
            self.spec,
            cache,
            sample_size=self.sample_size,
            progress=self._progress(context),
            should_stop=context.should_stop,
            on_notice=context.notice,
            failures=Attempts(context.attempt) if context.attempt else None,
        )


# --- export and command-line options ------------------------------------------------------------


def csv_rows(results: list[DynamicsResult]) -> Rows:
    """The ``--csv`` rows: one per checkpoint and head; ``duplicate_of`` after the step."""
    out: Rows = []
    for result in results:
        duplicates = {c.label: c.duplicate_of or "" for c in result.checkpoints}
        for r in result.rows:
            row = asdict(r)
            at = list(row).index("step") + 1
            items = list(row.items())
            out.append(dict([*items[:at], ("duplicate_of", duplicates.get(r.checkpoint, "")), *items[at:]]))
    return out


def json_payload(results: list[DynamicsResult]) -> Payload:
    """The ``--json`` document of the series (one per command)."""
    result = results[0]
    return {
        "series": result.series,
        "checkpoints": [c.__dict__ for c in result.checkpoints],
        "sites": result.sites,
        "rows": [r.__dict__ for r in result.rows],
        "meta": result.meta,
    }


def sample_size(text: str | int) -> int:
    """``--sample``, checked: positions kept per module (at least 2, to span two directions)."""
    try:
        sample = int(text)
    except (TypeError, ValueError):
        raise IsotuiError(f"--sample must be a positive integer (got {text!r})") from None
    if sample < 2:
        raise IsotuiError(f"--sample must be at least 2 to span two directions (got {sample})")
    return sample


def parse_plot(text: str | int | None) -> tuple[int, int] | None:
    """``--plot LAYER[:HEAD]``, checked: (layer, head), None when not given."""
    if text is None:
        return None
    layer, _, head = str(text).partition(":")
    try:
        return int(layer), int(head or 0)
    except ValueError:
        raise IsotuiError(f"--plot must be LAYER or LAYER:HEAD, e.g. 3:0 (got {text!r})") from None


def _plot(text: str | int) -> str:
    parse_plot(text)
    return str(text)


@dataclass(frozen=True)
class DynamicsParams:
    """qk-dynamics' own parameters (the front ends add the series and the run options); each
    said before any checkpoint is resolved."""

    sample: int = param(
        DEFAULT_SAMPLE,
        parse=sample_size,
        help=f"query and key positions per module kept for the common SVD (default {DEFAULT_SAMPLE})",
    )
    plot: str | None = param(
        None, parse=_plot, metavar="LAYER[:HEAD]", view=True, help="draw Q_bar/K_bar trajectories of one head"
    )
    basis: str = param("qk", choices=BASES, view=True, help="SVD of queries+keys (qk), or q or k only")


def _dynamics_request(spec: SeriesSpec, params: DynamicsParams) -> DynamicsRequest:
    from isotui.experiments.recorded import refuse_recorded

    series, ckpts, base = unpack_series(spec)
    refuse_recorded(list(ckpts), "qk-dynamics")
    return DynamicsRequest(series, ckpts, base, sample_size=params.sample)


EXPERIMENT: Experiment[SeriesSpec, DynamicsParams, DynamicsRequest, DynamicsResult] = Experiment(
    name="qk-dynamics",
    help=HELP,
    request_type=DynamicsRequest,
    result_type=DynamicsResult,
    folder=None,  # each checkpoint is an attention result
    schema=ATTENTION_SCHEMA,
    inputs="series",
    make_request=_dynamics_request,
    rows=csv_rows,
    payload=json_payload,
    params=DynamicsParams,
    what="checkpoints",
    plan=plans.attention,
    lab_tab="isotui.tui.lab_dynamics:DynamicsTab",
)
