"""Layer metrics along training (Machina & Mercer 2024): a checkpoint series, layer by layer.

Each checkpoint is an ordinary layer-wise run (cached as one, so ``isotui run`` and the app see
it too); this module lines them up as a layer x step grid of any metric, printed as a shaded
heatmap and written as CSV (one row per checkpoint and layer, every metric).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from isotui.errors import IsotuiError
from isotui.results import METRICS as LAYER_METRIC_DECLARATIONS

HELP = "any layer metric along a checkpoint series, as a layer x step heatmap (Machina & Mercer 2024)"
METRICS = tuple(m.name for m in LAYER_METRIC_DECLARATIONS)  # the plottable ones and the rogue share


@dataclass
class CheckpointSeries:
    """The layer-wise results of a series' checkpoints, in series order."""

    series: str
    checkpoints: list  # of qk_dynamics.Checkpoint
    results: list  # of ModelResult

    def steps(self) -> list[int]:
        return [c.step if c.step is not None else i for i, c in enumerate(self.checkpoints)]

    @property
    def from_cache(self) -> bool:
        return all(r.from_cache for r in self.results)

    @property
    def rows(self) -> list:
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
                    out[labels.index(label), j] = getattr(row, metric)
        return labels, out

    def csv_rows(self) -> list[dict[str, Any]]:
        out = []
        for ckpt, step, result in zip(self.checkpoints, self.steps(), self.results, strict=True):
            for row in result.rows:
                out.append({"series": self.series, "checkpoint": ckpt.label, "step": step, **asdict(row)})
        return out


def _label(row) -> str:
    return str(row.layer) if row.component == "model" else f"{row.component} {row.layer}"


def run_series(
    series: str | None,
    checkpoints: list,
    base_spec,
    cache,
    *,
    progress=None,
    on_notice=None,
    should_stop=None,
    failures=None,
):
    """Measure (or read from the cache) every checkpoint's layer table.

    ``failures`` (a :class:`isotui.cli.ModelFailures`): a checkpoint that fails is said and left
    out, the series is built from the rest (None when none is left); without it the first failure
    ends the series.
    """
    from contextlib import nullcontext

    from isotui.experiments.layerwise import measure
    from isotui.extract.progress import never_stop, no_progress

    kept, results = [], []
    for i, ckpt in enumerate(checkpoints):
        with progress(i, ckpt) if progress else nullcontext(no_progress) as on_progress:

            def one(ckpt=ckpt, on_progress=on_progress):
                try:
                    return measure(
                        base_spec.with_model(ckpt.model),
                        cache,
                        on_progress=on_progress,
                        on_notice=on_notice,
                        should_stop=should_stop or never_stop,
                    )
                except IsotuiError as exc:
                    raise IsotuiError(f"checkpoint {ckpt.label}: {exc}") from None

            result = failures.attempt(ckpt.label, one) if failures is not None else one()
        if result is not None:
            kept.append(ckpt)
            results.append(result)
    return assemble_series(series, kept, results) if results else None


def assemble_series(series: str | None, checkpoints: list, results: list) -> CheckpointSeries:
    """The series from its checkpoints' layer results; one architecture or one sentence."""
    from isotui.experiments.qk_dynamics import series_name

    shape = [(r.component, r.layer, r.dim) for r in results[0].rows]
    for ckpt, result in zip(checkpoints, results, strict=True):
        if [(r.component, r.layer, r.dim) for r in result.rows] != shape:
            raise IsotuiError(
                f"checkpoint {ckpt.label!r} has other layers than {checkpoints[0].label!r}; a series must be "
                "checkpoints of one architecture"
            )
    return CheckpointSeries(series or series_name(checkpoints), checkpoints, results)


def heatmap(result: CheckpointSeries, metric: str):
    """A rich table: layers down, checkpoints across, each cell shaded by its value (dark to light
    over the grid's range)."""
    from rich.markup import escape
    from rich.style import Style
    from rich.table import Table
    from rich.text import Text

    from isotui.render import shorten

    labels, values = result.grid(metric)
    finite = values[np.isfinite(values)]
    lo, hi = (float(finite.min()), float(finite.max())) if len(finite) else (0.0, 1.0)
    meta = result.results[0].meta
    table = Table(
        title=f"[bold]{escape(shorten(result.series, 50))}[/]  {metric} by layer (rows) and step (columns)  "
        f"{escape(str(meta.get('data')))}, {meta.get('n_samples')} samples",
        title_justify="left",
        header_style="bold",
        pad_edge=False,
    )
    table.add_column("layer", justify="right")
    for step in result.steps():
        table.add_column(str(step), justify="right")
    for i, label in enumerate(labels):
        cells = []
        for v in values[i]:
            if not math.isfinite(v):
                cells.append(Text("-"))
                continue
            t = (v - lo) / (hi - lo) if hi > lo else 0.5
            grey = int(40 + 170 * t)
            fg = "black" if t > 0.55 else "white"
            cells.append(Text(f"{v:.3f}", style=Style(bgcolor=f"rgb({grey},{grey},{grey})", color=fg)))
        table.add_row(label, *cells)
    table.caption = f"darker = lower, lighter = higher ({lo:.3f} .. {hi:.3f}); columns: " + ", ".join(
        f"{s}={shorten(c.label, 24)}" for s, c in zip(result.steps(), result.checkpoints, strict=True)
    )
    table.caption_justify = "left"
    return table


# --- command line -------------------------------------------------------------------------------


def add_arguments(p) -> None:
    from isotui.cli_experiments import add_common, add_run_flags, add_series_flags

    add_series_flags(p)
    p.add_argument("--metric", default="avg_cos", choices=METRICS, help="the heatmap's metric (CSV: all)")
    add_run_flags(p, "checkpoints")
    add_common(p, device_seed=False)


def collect(args, err, *, width: int = 200, on_table=None, on_error=None):
    """The command's work without its output (see :func:`isotui.cli.collect_run`)."""
    from isotui.cli_experiments import progress_printer, spec_from_args
    from isotui.experiments.qk_dynamics import resolve_checkpoints
    from isotui.paths import cache_dir
    from isotui.results import ModelFailures, Outcome
    from isotui.store.cache import ResultCache

    checkpoints = resolve_checkpoints(args.model, args.checkpoints)
    base = spec_from_args(args, checkpoints[0].model)
    cache = None if args.no_cache else ResultCache(cache_dir(args.cache_dir))
    n = len(checkpoints)
    outcome = Outcome("checkpoints", [], [], {}, total=n, what="checkpoints")
    failures = ModelFailures(outcome, on_error)
    result = run_series(
        args.model,
        checkpoints,
        base,
        cache,
        progress=lambda i, c: progress_printer(err, f"{i + 1}/{n} {c.label}", quiet=args.quiet),
        on_notice=lambda text: err.print(f"[yellow]isotui: {text}[/]", highlight=False),
        failures=failures,
    )
    if result is None:  # every checkpoint failed, each said as it did
        return outcome
    outcome.results, outcome.rows = [result], result.csv_rows()
    outcome.payload = {
        "series": result.series,
        "checkpoints": [c.__dict__ for c in result.checkpoints],
        "results": [r.to_json() for r in result.results],
    }
    outcome.tables = [heatmap(result, args.metric)]
    if on_table:
        on_table(outcome.tables[0])
    return outcome


def main(args, err) -> int:
    from isotui.cli_experiments import command_main

    return command_main(collect)(args, err)
