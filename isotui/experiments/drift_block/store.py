"""The cache: one entry per seed's sweep, in the result cache's ``drift-block`` folder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from isotui.experiments.drift_block.config import FOLDER, SCHEMA
from isotui.experiments.drift_block.result import SeedRun

if TYPE_CHECKING:
    from isotui.store.cache import ResultCache


def _lookup(cache: ResultCache | None, key: str, notes: list[str]) -> SeedRun | None:
    if cache is None:
        return None
    from isotui.store.cache import CacheProblem

    try:
        found = cache.get_payload(key)
    except CacheProblem as problem:
        notes.append(f"{problem}; recomputed")
        return None
    if found is None:
        return None
    try:
        return SeedRun.from_payload(key, *found)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        notes.append(f"cache entry {key} is unreadable ({type(exc).__name__}); recomputed")
        return None


def _store(cache: ResultCache | None, run: SeedRun, notes: list[str]) -> None:
    if cache is None:
        return
    from isotui.store.cache import CacheWriteError

    try:
        cache.put_payload(run.key, *run.to_payload())
    except CacheWriteError as exc:
        notes.append(str(exc))


def drift_cache(root: str | Path) -> ResultCache:
    """The drift-block sweeps' cache folder (one entry per seed) under the result cache ``root``."""
    from isotui.store.cache import ResultCache

    return ResultCache(Path(root), folder=FOLDER, schema=SCHEMA)
