"""Layer metrics along training (Machina & Mercer 2024): a checkpoint series, layer by layer.

Each checkpoint is an ordinary layer-wise run (cached as one, so ``isotui run`` and the app see
it too); this module lines them up as a layer x step grid of any metric, printed as a shaded
heatmap and written as CSV (one row per checkpoint and layer, every metric).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from isotui.errors import IsotuiError
from isotui.experiments import plans
from isotui.experiments.base import Context, Experiment, Notice, Payload, Rows
from isotui.experiments.cached import runs_cache
from isotui.experiments.params import param
from isotui.experiments.series import Attempts, SeriesRequest, unpack_series
from isotui.results import METRICS as LAYER_METRIC_DECLARATIONS
from isotui.results import SCHEMA_VERSION
from isotui.spec import LAYER_METRICS, MODEL, RESERVOIR

if TYPE_CHECKING:
    from isotui.experiments.base import PartProgress
    from isotui.experiments.checkpoint import Checkpoint
    from isotui.experiments.layerwise import LayersRequest
    from isotui.experiments.series import Failures, SeriesSpec
    from isotui.extract.progress import StopCheck
    from isotui.results import LayerRow, ModelResult
    from isotui.spec import RunSpec
    from isotui.store.cache import ResultCache

HELP = "any layer metric along a checkpoint series, as a layer x step heatmap (Machina & Mercer 2024)"


class LayerMetricChoices(tuple[str, ...]):
    """The built-in layer metrics (what help lists); ``in`` also accepts a column of a plug-in
    metric in force (isotui.plugins), so ``--metric top_var_share`` draws a plug-in's heatmap."""

    def __contains__(self, name: object) -> bool:
        if tuple.__contains__(self, name):
            return True
        from isotui.errors import IsotuiError
        from isotui.plugins import in_force

        try:
            return any(name in m.columns for m in in_force())
        except IsotuiError:  # a broken plug-in: said by the run itself, in one sentence
            return False


# the plottable ones and the rogue share, then any plug-in's column
METRICS = LayerMetricChoices(m.name for m in LAYER_METRIC_DECLARATIONS)


@dataclass
class CheckpointSeries:
    """The layer-wise results of a series' checkpoints, in series order."""

    series: str
    checkpoints: list[Checkpoint]
    results: list[ModelResult]

    def steps(self) -> list[int]:
        return [c.step if c.step is not None else i for i, c in enumerate(self.checkpoints)]

    @property
    def from_cache(self) -> bool:
        return all(r.from_cache for r in self.results)

    @property
    def rows(self) -> Rows:
        """The CSV rows (for the app's export)."""
        return self.csv_rows()

    def grid(self, metric: str) -> tuple[list[str], np.ndarray]:
        """(row labels, values (layers x checkpoints)); layers in the first checkpoint's order."""
        labels = [_label(r) for r in self.results[0].rows]
        out = np.full((len(labels), len(self.results)), math.nan)
        for j, result in enumerate(self.results):
            for row in result.rows:
                label = _label(row)
                if label in labels:
                    out[labels.index(label), j] = getattr(row, metric, math.nan)  # NaN: a plug-in's it lacks
        return labels, out

    def csv_rows(self) -> Rows:
        out: Rows = []
        for ckpt, step, result in zip(self.checkpoints, self.steps(), self.results, strict=True):
            for row in result.rows:
                out.append(
                    {
                        "series": self.series,
                        "checkpoint": ckpt.label,
                        "step": step,
                        "duplicate_of": ckpt.duplicate_of or "",
                        **row.as_dict(),
                    }
                )
        return out


def _label(row: LayerRow) -> str:
    return str(row.layer) if row.component == "model" else f"{row.component} {row.layer}"


def run_series(
    series: str | None,
    checkpoints: list[Checkpoint],
    base_spec: RunSpec,
    cache: ResultCache | None,
    *,
    progress: PartProgress | None = None,
    on_notice: Notice | None = None,
    should_stop: StopCheck | None = None,
    failures: Failures | None = None,
) -> CheckpointSeries | None:
    """Measure (or read from the cache) every checkpoint's layer table.

    ``failures`` (a :class:`isotui.cli.ModelFailures`): a checkpoint that fails is said and left
    out, the series is built from the rest (None when none is left); without it the first failure
    ends the series.
    """
    from isotui.experiments.layerwise import measure
    from isotui.experiments.recorded import read_step
    from isotui.experiments.series import measure_checkpoints
    from isotui.extract.progress import never_stop

    kept, results = measure_checkpoints(
        checkpoints,
        lambda ckpt, on_progress: (
            read_step(ckpt)
            if ckpt.recorded
            else measure(
                base_spec.with_model(ckpt.model),
                cache,
                on_progress=on_progress,
                on_notice=on_notice,
                should_stop=should_stop or never_stop,
            )
        ),
        progress=progress,
        attempt=failures.attempt if failures is not None else None,
    )
    return assemble_series(series, kept, results) if results else None


def assemble_series(
    series: str | None, checkpoints: list[Checkpoint], results: list[ModelResult]
) -> CheckpointSeries:
    """The series from its checkpoints' layer results; one architecture or one sentence."""
    from isotui.experiments.series import series_name

    shape = [(r.component, r.layer, r.dim) for r in results[0].rows]
    for ckpt, result in zip(checkpoints, results, strict=True):
        if [(r.component, r.layer, r.dim) for r in result.rows] != shape:
            raise IsotuiError(
                f"checkpoint {ckpt.label!r} has other layers than {checkpoints[0].label!r}; a series must be "
                "checkpoints of one architecture"
            )
    return CheckpointSeries(series or series_name(checkpoints), checkpoints, results)


# --- export and command-line options ------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointsRequest(SeriesRequest[CheckpointSeries]):
    """Layer metrics along a checkpoint series (``isotui experiment checkpoints``)."""

    kind: ClassVar[str] = "checkpoints"

    def _parts(self) -> Sequence[LayersRequest]:
        from isotui.experiments.layerwise import LayersRequest

        return [LayersRequest(self.spec.with_model(c.model)) for c in self.checkpoints if not c.recorded]

    def keys(self, cache_root: Path | None) -> list[str]:
        """Each checkpoint's layer-run key (a recorded step's: the one it was recorded under)."""
        parts = iter(self._parts())
        return [c.recorded or next(parts).keys(cache_root)[0] for c in self.checkpoints]

    def lookup(self, cache_root: Path | None, notice: Notice) -> CheckpointSeries | None:
        """Answered at once only when every checkpoint's layer run is cached or recorded."""
        from isotui.experiments.recorded import read_step

        if cache_root is None and not all(c.recorded for c in self.checkpoints):
            return None
        found: list[ModelResult] = []
        parts = iter(self._parts())
        for ckpt in self.checkpoints:
            hit = read_step(ckpt) if ckpt.recorded else next(parts).lookup(cache_root, notice)
            if hit is None:
                return None
            found.append(hit)
        return assemble_series(self.series, list(self.checkpoints), found)

    def measure(self, context: Context) -> CheckpointSeries | None:
        return run_series(
            self.series,
            list(self.checkpoints),
            self.spec,
            runs_cache(context.cache_root),
            progress=self._progress(context),
            on_notice=context.notice,
            should_stop=context.should_stop,
            failures=Attempts(context.attempt) if context.attempt else None,
        )


def csv_rows(results: list[CheckpointSeries]) -> Rows:
    """The ``--csv`` rows: one per checkpoint and layer, every metric."""
    return [row for result in results for row in result.csv_rows()]


def json_payload(results: list[CheckpointSeries]) -> Payload:
    """The ``--json`` document of the series (one per command)."""
    result = results[0]
    return {
        "series": result.series,
        "checkpoints": [c.__dict__ for c in result.checkpoints],
        "results": [r.to_json() for r in result.results],
    }


@dataclass(frozen=True)
class CheckpointsParams:
    """checkpoints' own parameters (the front ends add the series and the run options)."""

    metric: str = param("avg_cos", choices=METRICS, view=True, help="the heatmap's metric (CSV: all)")


def _checkpoints_request(spec: SeriesSpec, _params: CheckpointsParams) -> CheckpointsRequest:
    return CheckpointsRequest(*unpack_series(spec))


EXPERIMENT: Experiment[SeriesSpec, CheckpointsParams, CheckpointsRequest, CheckpointSeries] = Experiment(
    name="checkpoints",
    help=HELP,
    request_type=CheckpointsRequest,
    result_type=CheckpointSeries,
    folder=None,  # each checkpoint is a layer run
    schema=SCHEMA_VERSION,
    inputs="series",
    make_request=_checkpoints_request,
    rows=csv_rows,
    payload=json_payload,
    params=CheckpointsParams,
    what="checkpoints",
    plan=plans.layers,
    run_options=(MODEL, LAYER_METRICS, RESERVOIR),  # a layer run per checkpoint, not sharded
    lab_tab="isotui.tui.lab_checkpoints:CheckpointsTab",
)
