"""A series recorded during training (:mod:`isotui.callbacks`): a layer run per probed step,
read back as a checkpoint series whose checkpoints need no weights.

Folder::

    DIR/isotui_series.json        what was probed (data, options), and per step its cache key
    DIR/step_000010/runs/KEY.safetensors   that step's layer run: a result cache entry, the
    DIR/step_000020/runs/...               same file a run of the step's checkpoint caches

``--checkpoints DIR`` (``isotui experiment checkpoints``, ``isotui figure machina2024-heatmap``,
the app's series box) reads each step's layer run from its folder instead of loading weights
(:func:`recorded_series`, :func:`read_step`). ``isotui.load(KEY, cache_dir=DIR/step_000010)``
opens one. The JSON is rewritten atomically after every step, so an interrupted training leaves
the steps written so far.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict, cast

from isotui.errors import IsotuiError

if TYPE_CHECKING:
    from isotui.experiments.checkpoint import Checkpoint
    from isotui.experiments.gradients import GradientMeta, GradientResult
    from isotui.experiments.json_types import JsonValue
    from isotui.results import ModelResult

SERIES_FILE = "isotui_series.json"
COMMAND = "isotui-callback"
FORMAT = 1
GRADIENTS_FILE = "gradients.json"  # a step's gradients experiment result, when probed with it


class GradientSource(TypedDict):
    """Where a step's gradients came from: ``source`` (``own-backward`` or ``probe-set``) and,
    for the probe set's, ``why`` not from the step's own backward."""

    source: str
    why: NotRequired[str]


class RecordedGradients(GradientSource):
    """A step's ``gradients`` in the record: its file in the step's folder, and its source."""

    file: str


class StepEntry(TypedDict):
    """One probed step in the record: its folder and cache key; the trainer's facts (seconds,
    loss...) are further keys beside these."""

    step: int
    path: str
    key: str
    gradients: NotRequired[RecordedGradients]


class SeriesRecord(TypedDict):
    """The ``isotui_series.json`` of a recorded series (:func:`new_record`, :func:`write_step`)."""

    command: str
    format: int
    probe: dict[str, object]  # what is probed: the data, the run options, when
    steps: list[StepEntry]


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def read_record(out: Path) -> SeriesRecord | None:
    """The ``isotui_series.json`` of a recorded series in ``out``, None if there is none."""
    try:
        payload = json.loads((Path(out) / SERIES_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(payload, dict) or payload.get("command") != COMMAND:
        return None
    return cast("SeriesRecord", payload)  # an isotui callback's record: its command says so


def new_record(probe: dict[str, object]) -> SeriesRecord:
    """The JSON of a series about to be recorded: what is probed, no step yet."""
    return {"command": COMMAND, "format": FORMAT, "probe": probe, "steps": []}


def prepare_out(out: Path) -> None:
    """A new or empty folder, or an earlier recorded series (its steps are replaced as they come);
    anything else refused in one sentence (nothing of the user's is written over). A missing
    folder is made, with its missing parents (as the trainers make their output folders); one
    that cannot be made or written (read-only, under a file, no permission) is refused in one
    sentence naming ``out=``, before the first training step rather than at a probe."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise IsotuiError(f"out={str(out)!r} is a file; give a new or empty folder for the series")
    try:
        if out.is_dir() and any(out.iterdir()) and read_record(out) is None:
            raise IsotuiError(
                f"out={str(out)!r} is not empty and holds no recorded series ({SERIES_FILE}); give a new "
                "or empty folder"
            )
        out.mkdir(parents=True, exist_ok=True)
        trial = out / f".{SERIES_FILE}.write-check-{os.getpid()}"
        trial.write_bytes(b"")  # a read-only mount refuses this, even to root
        trial.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise IsotuiError(
            f"out={str(out)!r} cannot be written ({reason}); give a folder the series can be written to"
        ) from None


def write_step(
    out: Path,
    record: SeriesRecord,
    step: int,
    result: ModelResult,
    *,
    gradients: GradientResult | None = None,
    how: GradientSource | None = None,
    **facts: JsonValue,
) -> Path:
    """Store ``result`` (the layer run at ``step``) as a cache entry in ``out/step_NNNNNN`` and
    list it in the record (rewritten atomically); ``facts`` (seconds, loss...) go beside it.
    ``gradients`` (a :class:`~isotui.experiments.gradients.GradientResult`): its JSON in
    ``step_NNNNNN/gradients.json``, listed with ``how`` (its source: ``own-backward`` or
    ``probe-set`` and why)."""
    from dataclasses import asdict

    from isotui.store.cache import ResultCache

    folder = Path(out) / step_dir_name(step)
    ResultCache(folder).put_payload(result.key, result.to_json(), result.arrays)
    # the facts beside the step's own keys (a StepEntry with more keys)
    entry = cast("StepEntry", {"step": step, "path": folder.name, "key": result.key, **facts})
    if gradients is not None:
        payload = {k: v for k, v in asdict(gradients).items() if k != "from_cache"}
        (folder / GRADIENTS_FILE).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        # how: its source, given with the gradients
        entry["gradients"] = cast("RecordedGradients", {"file": GRADIENTS_FILE, **(how or {})})
    record["steps"] = [s for s in record["steps"] if s["step"] != step] + [entry]
    record["steps"].sort(key=lambda s: s["step"])
    tmp = Path(out) / f".{SERIES_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, Path(out) / SERIES_FILE)
    return folder


def recorded_gradients(path: Path) -> dict[int, GradientResult]:
    """The gradients recorded in the series in ``path``: step -> GradientResult (its
    ``meta["source"]``: ``own-backward`` or ``probe-set``)."""
    from isotui.experiments.gradients import gradients_from_payload

    record = read_record(path)
    found = {}
    for s in record["steps"] if record is not None else []:
        if "gradients" in s:
            payload = json.loads(
                (Path(path) / s["path"] / s["gradients"]["file"]).read_text(encoding="utf-8")
            )
            result = gradients_from_payload(payload, {})
            source = {k: v for k, v in s["gradients"].items() if k != "file"}
            result.meta = cast("GradientMeta", {**result.meta, **source})  # its source (and why) added
            found[int(s["step"])] = result
    return found


def recorded_series(path: Path) -> list[Checkpoint] | None:
    """The steps of the recorded series in ``path`` as checkpoints (each with its key in
    ``recorded``), None when ``path`` holds none."""
    from isotui.experiments.checkpoint import Checkpoint

    record = read_record(path)
    if record is None:
        return None
    return [
        Checkpoint(str(Path(path) / s["path"]), s["path"], int(s["step"]), recorded=str(s["key"]))
        for s in record["steps"]
    ]


def read_step(checkpoint: Checkpoint) -> ModelResult:
    """The layer run recorded for ``checkpoint`` (from :func:`recorded_series`)."""
    from isotui.experiments.layer_pass import read
    from isotui.store.cache import CacheProblem, ResultCache

    assert checkpoint.recorded is not None
    try:
        found = read(ResultCache(Path(checkpoint.model)), checkpoint.recorded)
    except CacheProblem as problem:
        raise IsotuiError(f"{problem} (recorded step {checkpoint.label})") from None
    if found is None:
        raise IsotuiError(
            f"the recorded step {checkpoint.label} has no layer run in {checkpoint.model} (removed?)"
        )
    found.from_cache = True
    return found


def refuse_recorded(checkpoints: Sequence[object], experiment: str) -> None:
    """One sentence when a series recorded during training is given to an experiment that needs
    the checkpoints' weights."""
    if any(getattr(c, "recorded", None) for c in checkpoints):
        raise IsotuiError(
            f"{experiment} needs each checkpoint's weights; a series recorded during training holds "
            "layer runs only (use it with the checkpoints experiment, or give the trainer's saved "
            "checkpoints)"
        )
