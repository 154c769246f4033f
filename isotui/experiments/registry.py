"""The one table of experiments: the CLI's parser and loop, ``cache ls/rm``, the Python API
(``isotui.run``, ``isotui.experiment``, ``isotui.load``) and the app read it.

Each experiment's module defines its own ``EXPERIMENT`` (an :class:`~isotui.experiments.base.
Experiment`); the table below names it as a ``"module:attr"`` string, imported on first use, so
that importing the registry imports no experiment. Adding an experiment: its module (request,
result, ``csv_rows``/``json_payload``, its parameters dataclass, its ``EXPERIMENT``), one line below, a
view in :mod:`isotui.views`, and a test. Import-light: no torch, no rich.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

if TYPE_CHECKING:
    from isotui.experiments.base import Experiment
    from isotui.spec import RunOption

    AnyExperiment = Experiment[Any, Any, Any, Any]  # each entry its own input, params, request and result

TABLE: dict[str, str] = {
    "layers": "isotui.experiments.layerwise:EXPERIMENT",
    "attention": "isotui.experiments.attention:EXPERIMENT",
    "drift-block": "isotui.experiments.drift_block.experiment:EXPERIMENT",
    "qk-dynamics": "isotui.experiments.qk_dynamics:EXPERIMENT",
    "checkpoints": "isotui.experiments.checkpoints:EXPERIMENT",
    "final-norm": "isotui.experiments.final_norm:EXPERIMENT",
    "gradients": "isotui.experiments.gradients:EXPERIMENT",
    "token-types": "isotui.experiments.token_types:EXPERIMENT",
    "ablate": "isotui.experiments.ablate.experiment:EXPERIMENT",
}
"""Every registered experiment by name, in the order of the CLI's subcommands (the layer run
first): ``get(name)`` imports that one experiment's module alone."""

if TYPE_CHECKING:  # resolved on first use by the module's __getattr__
    REGISTRY: tuple[AnyExperiment, ...]
    EXPERIMENTS: dict[str, AnyExperiment]
    LAYERS: AnyExperiment


def resolve(entry: str) -> AnyExperiment:
    """The experiment a ``"module:attr"`` entry names (its module imported now)."""
    module, _, attr = entry.partition(":")
    experiment: AnyExperiment = getattr(import_module(module), attr)
    return experiment


def _registry() -> tuple[AnyExperiment, ...]:
    """REGISTRY: the table resolved once (or what a test set in its place)."""
    found = globals().get("REGISTRY")
    if found is None:
        found = tuple(resolve(entry) for entry in TABLE.values())
        globals()["REGISTRY"] = found
    registry: tuple[AnyExperiment, ...] = found
    return registry


def __getattr__(name: str) -> tuple[AnyExperiment, ...] | dict[str, AnyExperiment] | AnyExperiment:
    """``REGISTRY``, ``EXPERIMENTS`` and ``LAYERS``, resolved on first use."""
    if name == "REGISTRY":
        return _registry()
    if name == "EXPERIMENTS":
        # ``isotui experiment NAME``: every registered experiment but layers (``isotui run``)
        experiments = {e.name: e for e in _registry() if e.command == "experiment"}
        globals()["EXPERIMENTS"] = experiments
        return experiments
    if name == "LAYERS":
        return get("layers")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get(name: str) -> AnyExperiment:
    """The registered experiment ``name`` (``layers`` or ``run`` for the layer run)."""
    if "REGISTRY" not in globals() and name in TABLE:  # that one module imported, no other
        return resolve(TABLE[name])
    for e in _registry():
        if name in (e.name, e.command):
            return e
    raise KeyError(name)


def cache_folders() -> list[str]:
    """Every folder of the result cache an experiment writes (``runs`` first), for ``cache ls/rm``."""
    return [e.folder for e in _registry() if e.folder is not None]


def commands_taking(scope: str) -> tuple[str, ...]:
    """The commands (``run`` for the layer run, else the experiment's name) whose experiment
    declares the run options of ``scope`` (:data:`isotui.spec.SCOPES`), in registry order."""
    return tuple(e.command if e.command == "run" else e.name for e in _registry() if scope in e.run_options)


def cached_entries(root: Path, prefix: str) -> list[tuple[AnyExperiment, str]]:
    """(experiment, key) of every entry of the result cache at ``root`` whose key starts with
    ``prefix``, in the folders of the experiments that read one entry back (``decode``): a layer
    run, an attention, final-norm, gradients or drift-block result (``isotui show``, ``isotui.load``)."""
    return [
        (e, path.stem)
        for e in _registry()
        if e.folder is not None and e.decode is not None and (root / e.folder).is_dir()
        for path in sorted((root / e.folder).glob(f"{prefix}*.safetensors"))
    ]


def options_for(command: str) -> tuple[RunOption, ...]:
    """The run options ``command`` (``run`` or an experiment's name) takes: those of the scopes
    its registered experiment declares."""
    from isotui.spec import options_in

    return options_in(get(command).run_options)
