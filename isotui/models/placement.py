"""Where accelerate places a model's parts (``--device-map`` under ``--max-memory``), as
transformers' ``from_pretrained`` places them: the map, the refusals it leads to, and accelerate's
warnings kept quiet. Used by loading (an untrained model is built, then dispatched by the map) and
by the planner (a dry run places the model on paper), below both."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from isotui.errors import IsotuiError


@contextmanager
def quiet_accelerate() -> Iterator[None]:
    """accelerate warns for every GPU a dry run names that this machine lacks (it plans on
    paper) and that offloaded parameters sit on the meta device (the notes say where they are)."""
    logs = [logging.getLogger(name) for name in ("accelerate.utils.modeling", "accelerate.big_modeling")]
    before = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(logs, before, strict=True):
            log.setLevel(level)


def tied_weights_bug(exc: BaseException) -> bool:
    """Whether ``exc`` is the IndexError transformers' and accelerate's
    ``get_module_size_with_ties`` raise for some budgets when a model ties weights."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return isinstance(exc, IndexError) and any(f.name == "get_module_size_with_ties" for f in frames)


def infer_device_map(
    model: Any, device_map: str, max_memory: Mapping[int | str, int] | None
) -> dict[str, Any]:
    """The device map transformers' ``from_pretrained(device_map=..., max_memory=...)`` would
    make for ``model`` (accelerate's ``infer_auto_device_map``, balanced as transformers
    balances it); used for dry runs and untrained models (which are built, not loaded)."""
    from transformers.integrations.accelerate import _get_device_map

    try:
        with quiet_accelerate():
            return dict(_get_device_map(model, device_map, dict(max_memory) if max_memory else None, None))
    except IndexError as exc:
        if not tied_weights_bug(exc):
            raise
        raise IsotuiError(
            f"--device-map {device_map} could not place the model within --max-memory: transformers' "
            "device-map planner fails on its tied weights at this budget (a known bug, "
            "huggingface/transformers#35824); give --max-memory more or less"
        ) from None


def refuse_all_on_disk(placed: Mapping[str, Any], name: str) -> None:
    """An untrained model is built in memory and then dispatched by the map: accelerate cannot
    run one whose every part is on disk (a checkpoint it can, reading its weight files), so the
    run and its dry run refuse it in the same sentence."""
    if set(map(str, placed.values())) == {"disk"}:
        raise IsotuiError(
            f"--max-memory leaves no room in memory for any part of model {name!r}; give its devices more"
        )
