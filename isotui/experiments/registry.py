"""The one table of experiments: the CLI's parser and loop, ``cache ls/rm``, the Python API
(``isotui.run``, ``isotui.experiment``, ``isotui.load``) and the app read it.

Adding an experiment: its module (request type in :mod:`isotui.experiments.requests`, result,
``csv_rows``/``json_payload``, ``add_options``), one :class:`Experiment` line below, a view in
:mod:`isotui.views`, and a test. Import-light: no torch, no rich.
"""

from __future__ import annotations

import argparse
from typing import Any

from isotui.experiments import attention, checkpoints, final_norm, gradients, plans, qk_dynamics
from isotui.experiments.base import Arrays, Experiment, Payload, Rows
from isotui.experiments.drift_block import experiment as drift_block_experiment
from isotui.experiments.requests import (
    AttentionRequest,
    CheckpointsRequest,
    DynamicsRequest,
    FinalNormRequest,
    GradientsRequest,
    LayersRequest,
)
from isotui.results import SCHEMA_VERSION, ModelResult

# --- layers (isotui run) ---------------------------------------------------------------------------


def _layer_rows(results: list[Any]) -> Rows:
    from isotui.store.export import layer_csv_rows

    return layer_csv_rows(results)


def _layer_payload(results: list[Any]) -> Payload:
    return {"results": [r.to_json() for r in results]}


def _layer_decode(payload: Payload, arrays: Arrays) -> ModelResult:
    return ModelResult.from_json(payload, arrays)


def _series(spec: Any) -> tuple[str | None, tuple[Any, ...], Any]:
    series, ckpts, base = spec
    return series, tuple(ckpts), base


def _dynamics_request(spec: Any, args: argparse.Namespace) -> DynamicsRequest:
    series, ckpts, base = _series(spec)
    return DynamicsRequest(series, ckpts, base, sample_size=qk_dynamics.sample_size(args.sample))


def _checkpoints_request(spec: Any, _args: argparse.Namespace) -> CheckpointsRequest:
    return CheckpointsRequest(*_series(spec))


LAYERS = Experiment(
    name="layers",
    help="measure layer-wise anisotropy of one or more models",
    request_type=LayersRequest,
    result_type=ModelResult,
    folder="runs",
    schema=SCHEMA_VERSION,
    view="layers",
    inputs="models",
    make_request=lambda spec, _args: LayersRequest(spec),
    rows=_layer_rows,
    payload=_layer_payload,
    decode=_layer_decode,
    command="run",
    plan=plans.layers,
)

REGISTRY: tuple[Experiment, ...] = (
    LAYERS,
    Experiment(
        name="attention",
        help=attention.HELP,
        request_type=AttentionRequest,
        result_type=attention.AttentionResult,
        folder=attention.FOLDER,
        schema=attention.SCHEMA,
        view="attention",
        inputs="models",
        make_request=lambda spec, _args: AttentionRequest(spec),
        rows=attention.csv_rows,
        payload=attention.json_payload,
        add_options=attention.add_options,
        decode=attention.AttentionResult.from_json,
        plan=plans.attention,
        lab_tab="isotui.tui.lab_heads:HeadsTab",
    ),
    drift_block_experiment.EXPERIMENT,
    Experiment(
        name="qk-dynamics",
        help=qk_dynamics.HELP,
        request_type=DynamicsRequest,
        result_type=qk_dynamics.DynamicsResult,
        folder=None,  # each checkpoint is an attention result
        schema=attention.SCHEMA,
        view="qk-dynamics",
        inputs="series",
        make_request=_dynamics_request,
        rows=qk_dynamics.csv_rows,
        payload=qk_dynamics.json_payload,
        add_options=qk_dynamics.add_options,
        check=qk_dynamics.check_options,
        what="checkpoints",
        plan=plans.attention,
        lab_tab="isotui.tui.lab_dynamics:DynamicsTab",
    ),
    Experiment(
        name="checkpoints",
        help=checkpoints.HELP,
        request_type=CheckpointsRequest,
        result_type=checkpoints.CheckpointSeries,
        folder=None,  # each checkpoint is a layer run
        schema=SCHEMA_VERSION,
        view="checkpoints",
        inputs="series",
        make_request=_checkpoints_request,
        rows=checkpoints.csv_rows,
        payload=checkpoints.json_payload,
        add_options=checkpoints.add_options,
        what="checkpoints",
        plan=plans.layers,
        lab_tab="isotui.tui.lab_checkpoints:CheckpointsTab",
    ),
    Experiment(
        name="final-norm",
        help=final_norm.HELP,
        request_type=FinalNormRequest,
        result_type=list,  # of final_norm.FinalNormResult: the final norm, or every block's
        folder=final_norm.FOLDER,
        schema=final_norm.SCHEMA,
        view="final-norm",
        inputs="models",
        make_request=lambda spec, args: FinalNormRequest(spec, every_layer=bool(args.every_layer)),
        rows=final_norm.csv_rows,
        payload=final_norm.json_payload,
        add_options=final_norm.add_options,
        decode=final_norm.results_from_payload,
        plan=plans.final_norm,
    ),
    Experiment(
        name="gradients",
        help=gradients.HELP,
        request_type=GradientsRequest,
        result_type=gradients.GradientResult,
        folder=gradients.FOLDER,
        schema=gradients.SCHEMA,
        view="gradients",
        inputs="models",
        make_request=lambda spec, args: GradientsRequest(spec, top_k=int(args.top_k)),
        rows=gradients.csv_rows,
        payload=gradients.json_payload,
        add_options=gradients.add_options,
        decode=gradients.gradients_from_payload,
        plan=plans.gradients,
    ),
)

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in REGISTRY if e.command == "experiment"}
"""``isotui experiment NAME``: every registered experiment but layers (which is ``isotui run``)."""


def get(name: str) -> Experiment:
    """The registered experiment ``name`` (``layers`` or ``run`` for the layer run)."""
    for e in REGISTRY:
        if name in (e.name, e.command):
            return e
    raise KeyError(name)


def cache_folders() -> list[str]:
    """Every folder of the result cache an experiment writes (``runs`` first), for ``cache ls/rm``."""
    return [e.folder for e in REGISTRY if e.folder is not None]
