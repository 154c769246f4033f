"""drift-block's entry in the experiment registry (the contract of
:mod:`isotui.experiments.base`): its request, result, cache folder and schema, CSV rows, JSON
document, how a cache entry reads back, its view's name and its own flags.

The registry lists it as ``drift_block.experiment.EXPERIMENT``. Import-light: no torch, no rich,
no CLI (its flags and keywords come from :class:`.params.DriftBlockParams`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar, cast

from isotui.experiments.base import Arrays, Context, Experiment, Notice, Payload, Rows
from isotui.experiments.drift_block.config import FOLDER, SCHEMA, DriftBlockConfig
from isotui.experiments.drift_block.params import HELP, DriftBlockParams, config_from_params
from isotui.experiments.drift_block.result import DriftBlockResult, SeedEntry, SeedRun
from isotui.experiments.drift_block.store import _lookup, drift_cache
from isotui.experiments.drift_block.sweep import _assemble, run_drift_block


def make_request(_spec: None, params: DriftBlockParams) -> DriftBlockRequest:
    """The request the parameters describe (drift-block reads no model: ``_spec`` is None)."""
    return DriftBlockRequest(config_from_params(params))


def csv_rows(results: list[DriftBlockResult]) -> Rows:
    """``--csv``: one row per (seed, N), seed by seed, the columns of :class:`DriftBlockRow`."""
    return [asdict(r) for result in results for r in result.rows]


def json_payload(results: list[DriftBlockResult]) -> Payload:
    """``--json``: the sweep's document (one configuration, so one result)."""
    payload: Payload = results[0].to_json()
    return payload


def decode(payload: Mapping[str, object], arrays: Arrays) -> DriftBlockResult:
    """One cache entry (one seed's sweep) as a result of that seed alone: the settings are read
    back from its rows (entries from before --block/--measure existed are post-ln, after-norm)."""
    entry = cast("SeedEntry", payload)  # the cache checked its schema: SeedRun.to_payload's
    rows = entry["rows"]
    first = rows[0]
    config = DriftBlockConfig(
        hidden=int(first["hidden"]),
        heads=int(first["heads"]),
        intermediate=int(first["intermediate"]),
        init_std=float(first["init_std"]),
        vocab=int(first["vocab"]),
        batch=int(first["batch"]),
        seq_len=int(first["seq_len"]),
        norms=tuple(float(r["norm"]) for r in rows),
        seeds=(int(entry["seed"]),),
        block=str(first.get("block", "post-ln")),
        measure=str(first.get("measure", "after-norm")),
    )
    run = SeedRun.from_payload(config.key(config.seeds[0]), payload, arrays)
    return _assemble(config, [run], [], None)


@dataclass(frozen=True)
class DriftBlockRequest:
    """The untrained block under drift (``isotui experiment drift-block``)."""

    config: DriftBlockConfig  # frozen, hashable
    kind: ClassVar[str] = "drift-block"

    @property
    def model(self) -> str:
        c = self.config
        variant = "".join(f" {v}" for v in (c.block, c.measure) if v not in ("post-ln", "after-norm"))
        return f"d={c.hidden} heads={c.heads} std={c.init_std}{variant} seeds={','.join(map(str, c.seeds))}"

    @property
    def device(self) -> str:
        return str(self.config.device)

    def keys(self, cache_root: Path | None) -> list[str]:
        return [str(self.config.key(seed)) for seed in self.config.seeds]

    def lookup(self, cache_root: Path | None, notice: Notice) -> DriftBlockResult | None:
        """Answered at once only when every seed's sweep loads from the cache (nothing is
        computed on the lookup thread; a damaged entry is recomputed on the device lane)."""
        if cache_root is None:
            return None
        cache = drift_cache(cache_root)
        notes: list[str] = []
        runs = [_lookup(cache, self.config.key(seed), notes) for seed in self.config.seeds]
        kept = [run for run in runs if run is not None]
        if len(kept) < len(runs):
            return None
        return _assemble(self.config, kept, notes, None)

    def compute(self, context: Context) -> DriftBlockResult:
        return self.measure(context)

    def measure(self, context: Context) -> DriftBlockResult:
        cache = drift_cache(context.cache_root) if context.cache_root else None
        return run_drift_block(self.config, cache, context.on_progress, context.should_stop)


EXPERIMENT: Experiment[None, DriftBlockParams, DriftBlockRequest, DriftBlockResult] = Experiment(
    name="drift-block",
    help=HELP,
    request_type=DriftBlockRequest,
    result_type=DriftBlockResult,
    folder=FOLDER,  # one entry per seed's sweep
    schema=SCHEMA,
    inputs="config",
    make_request=make_request,
    rows=csv_rows,
    payload=json_payload,
    params=DriftBlockParams,
    decode=decode,
    run_options=(),  # its own model, from its own options
    lab_tab="isotui.tui.lab_drift:DriftTab",
)
