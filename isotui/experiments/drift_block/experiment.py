"""drift-block's entry in the experiment registry (the contract of
:mod:`isotui.experiments.base`): its request, result, cache folder and schema, CSV rows, JSON
document, how a cache entry reads back, its view's name and its own flags.

The registry lists it as ``drift_block.experiment.EXPERIMENT``. Import-light: no torch, no rich,
no CLI (its flags come from :func:`.cli.add_options`; the CLI adds the shared ones).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from isotui.experiments.base import Arrays, Experiment, Payload, Rows
from isotui.experiments.drift_block.cli import HELP, add_options, config_from_args
from isotui.experiments.drift_block.config import FOLDER, SCHEMA, DriftBlockConfig
from isotui.experiments.drift_block.result import DriftBlockResult, SeedRun
from isotui.experiments.drift_block.sweep import _assemble
from isotui.experiments.requests import DriftBlockRequest


def make_request(_spec: Any, args: argparse.Namespace) -> DriftBlockRequest:
    """The request the flags describe (drift-block reads no model: ``_spec`` is None)."""
    return DriftBlockRequest(config_from_args(args))


def csv_rows(results: list[Any]) -> Rows:
    """``--csv``: one row per (seed, N), seed by seed, the columns of :class:`DriftBlockRow`."""
    return [asdict(r) for result in results for r in result.rows]


def json_payload(results: list[Any]) -> Payload:
    """``--json``: the sweep's document (one configuration, so one result)."""
    payload: Payload = results[0].to_json()
    return payload


def decode(payload: Payload, arrays: Arrays) -> DriftBlockResult:
    """One cache entry (one seed's sweep) as a result of that seed alone: the settings are read
    back from its rows (entries from before --block/--measure existed are post-ln, after-norm)."""
    rows = payload["rows"]
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
        seeds=(int(payload["seed"]),),
        block=str(first.get("block", "post-ln")),
        measure=str(first.get("measure", "after-norm")),
    )
    run = SeedRun.from_payload(config.key(config.seeds[0]), payload, arrays)
    return _assemble(config, [run], [], None)


EXPERIMENT = Experiment(
    name="drift-block",
    help=HELP,
    request_type=DriftBlockRequest,
    result_type=DriftBlockResult,
    folder=FOLDER,  # one entry per seed's sweep
    schema=SCHEMA,
    view="drift-block",
    inputs="config",
    make_request=make_request,
    rows=csv_rows,
    payload=json_payload,
    add_options=add_options,
    decode=decode,
    run_flags=False,
    lab_tab="isotui.tui.lab_drift:DriftTab",
)
