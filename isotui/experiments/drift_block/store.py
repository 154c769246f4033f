"""The cache: one entry per seed's sweep, in the result cache's ``drift-block`` folder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from isotui.experiments.drift_block.config import FOLDER, SCHEMA
from isotui.experiments.drift_block.result import SeedRun

if TYPE_CHECKING:
    from isotui.store.cache import ResultCache


def _lookup(cache: ResultCache | None, key: str, notes: list[str]) -> SeedRun | None:
    from isotui.experiments.cached import lookup

    return lookup(
        cache,
        [key],
        lambda payload, arrays: SeedRun.from_payload(key, payload, arrays),
        notes.append,
        "recomputed",
    )


def _store(cache: ResultCache | None, run: SeedRun, notes: list[str]) -> None:
    from isotui.experiments.cached import keep

    keep(cache, run.key, *run.to_payload(), notes.append)


def drift_cache(root: str | Path) -> ResultCache:
    """The drift-block sweeps' cache folder (one entry per seed) under the result cache ``root``."""
    from isotui.store.cache import ResultCache

    return ResultCache(Path(root), folder=FOLDER, schema=SCHEMA)
