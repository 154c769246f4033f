"""The result cache of an experiment that computes over a model (final-norm, gradients...).

Each experiment keeps its results in a folder of its own under the cache root, with its own
schema number, keyed by the layer run's key (model, data, resolved max length, dtype, seed...)
plus the experiment's own parameters: the same scheme as attention (see
:func:`isotui.experiments.attention.cache_key`). Reading also tries the layer run's legacy keys,
so results cached before a key change stay readable.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from isotui.experiments.layerwise import Prepared
    from isotui.store.cache import ResultCache

Notice = Callable[[str], None]


def experiment_key(layer_key: str, folder: str, schema: int, params: dict[str, Any]) -> str:
    """The key of one experiment result: the run's key plus the experiment, schema and parameters."""
    fields = {"run": layer_key, "experiment": folder, "schema": schema, **params}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def experiment_cache(root: Path, folder: str, schema: int) -> ResultCache:
    """The experiment's folder of the result cache at ``root``."""
    from isotui.store.cache import ResultCache

    return ResultCache(root, folder=folder, schema=schema)


def read(cache: ResultCache, key: str, decode: Callable[[dict[str, Any], dict[str, np.ndarray]], Any]) -> Any:
    """The result cached under ``key`` (``decode`` of its payload and arrays), None if absent;
    :class:`~isotui.store.cache.CacheProblem` if it cannot be used (damaged, or a structure this
    version cannot read: a valid checksum says the bytes are intact, not that they fit)."""
    from isotui.store.cache import CacheProblem

    found = cache.get_payload(key)
    if found is None:
        return None
    try:
        return decode(*found)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise CacheProblem(f"cache entry {key}.safetensors is unreadable ({type(exc).__name__})") from None


def find(
    cache: ResultCache | None,
    prepared: Prepared,
    folder: str,
    schema: int,
    params: dict[str, Any],
    on_notice: Notice | None = None,
) -> tuple[str, tuple[dict[str, Any], dict[str, np.ndarray]] | None]:
    """(key to store under, cached (payload, arrays) or None); a damaged entry is said and ignored.
    ``cache`` None (``--no-cache``) finds nothing."""
    from isotui.store.cache import CacheProblem

    keys = [experiment_key(k, folder, schema, params) for k in prepared.keys]
    if cache is None:
        return keys[0], None
    try:
        for key in keys:
            found = cache.get_payload(key)
            if found is not None:
                return keys[0], found
    except CacheProblem as problem:
        (on_notice or (lambda _t: None))(f"{problem}; recomputing")
    return keys[0], None


def keep(
    cache: ResultCache | None,
    key: str,
    payload: dict[str, Any],
    arrays: dict[str, npt.NDArray[Any]],
    on_notice: Notice | None = None,
) -> None:
    """Store one result; a cache that cannot be written is said, never fatal."""
    from isotui.store.cache import CacheWriteError

    if cache is None:
        return
    try:
        cache.put_payload(key, payload, arrays)
    except CacheWriteError as exc:  # the result itself is fine: said in one sentence, kept
        (on_notice or (lambda _t: None))(str(exc))
