"""One checkpoint of a series (its model, label and step) and the folder layouts a series is read
from: below the series, its branch selectors (:mod:`isotui.experiments.revisions`) and the
series recorded in training (:mod:`isotui.experiments.recorded`), which all name checkpoints."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_STEP = re.compile(r"step[_-]?0*(\d+)(k?)", re.IGNORECASE)


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint: the model name isotui loads, a short label and its training step;
    ``duplicate_of``: the label of the later step whose weights it serves (see revisions);
    ``recorded``: for a step of a series recorded during training (:mod:`isotui.experiments.recorded`),
    the key of its layer run in its folder ``model``."""

    model: str
    label: str
    step: int | None
    duplicate_of: str | None = None
    recorded: str | None = None  # a recorded step's cache key: its layer run needs no weights


def step_of(text: str) -> int | None:
    """``step1000`` -> 1000, ``step_20k`` -> 20000, ``step_000100`` -> 100; else None."""
    found = _STEP.search(text)
    if not found:
        return None
    return int(found.group(1)) * (1000 if found.group(2) else 1)


def series_folder(path: Path) -> list[Path]:
    """The checkpoint folders inside a series folder: an ``isotui train-tiny`` run's own list,
    else every sub-folder with a config.json, by step."""
    from isotui.experiments.train_tiny import RUN_FILE, checkpoint_dirs

    if (path / RUN_FILE).is_file():
        return checkpoint_dirs(path)
    subs = [p for p in path.iterdir() if p.is_dir() and (p / "config.json").is_file()]
    return sorted(subs, key=lambda p: (step_of(p.name) is None, step_of(p.name) or 0, p.name))
