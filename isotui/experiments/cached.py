"""The one cached-run path of every experiment: a result's cache key (the hash of its fields),
its lookup (every key it may be stored under, the entry decoded, a damaged one said and
ignored), its computation and its store (a cache that cannot be written said, never fatal).

An experiment that computes over a model (attention, final-norm, gradients) keeps its results in
a folder of its own under the cache root, with its own schema number, keyed by the layer run's
key (model, data, resolved max length, dtype, seed...) plus the experiment's own parameters
(:func:`experiment_key`). Reading also tries the layer run's legacy keys, so results cached
before a key change stay readable. The layer run and drift-block hash their own fields with
:func:`key_hash` and read and store through :func:`lookup` and :func:`keep`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from isotui.experiments.base import Notice, ignore_notice

if TYPE_CHECKING:
    from isotui.spec import RunSpec
    from isotui.store.cache import ResultCache

T = TypeVar("T")
Decode = Callable[[dict[str, object], dict[str, np.ndarray]], T]  # a cache entry's payload and arrays


def relabel_rows(spec: RunSpec) -> Callable[[Any], None]:
    """A cached result (with ``model``, ``meta`` and ``rows``) relabelled for ``spec``, the ask
    that found it: its model's name as asked, its data as described, marked from the cache."""

    def relabel(result: Any) -> None:
        result.model, result.from_cache = spec.model, True
        result.meta["data"] = spec.data.describe()
        for row in result.rows:
            row.model = spec.model

    return relabel


def key_hash(fields: Mapping[str, object]) -> str:
    """A cache key: the sha256 of ``fields`` as JSON with sorted keys, its first 32 hex digits
    (every key of the result cache, so existing caches keep answering)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def experiment_key(layer_key: str, folder: str, schema: int, params: Mapping[str, object]) -> str:
    """The key of one experiment result: the run's key plus the experiment, schema and parameters."""
    return key_hash({"run": layer_key, "experiment": folder, "schema": schema, **params})


def experiment_cache(root: Path, folder: str, schema: int) -> ResultCache:
    """The experiment's folder of the result cache at ``root``."""
    from isotui.store.cache import ResultCache

    return ResultCache(root, folder=folder, schema=schema)


def folder_cache(cache_root: Path | None, folder: str, schema: int) -> ResultCache | None:
    """An experiment's folder of the result cache at ``cache_root`` (None: no cache)."""
    return experiment_cache(cache_root, folder, schema) if cache_root is not None else None


def runs_cache(cache_root: Path | None) -> ResultCache | None:
    """The layer runs' folder (``runs``) of the result cache at ``cache_root`` (None: no cache)."""
    from isotui.store.cache import ResultCache

    return ResultCache(cache_root) if cache_root is not None else None


def read(cache: ResultCache, key: str, decode: Decode[T]) -> T | None:
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


def lookup(
    cache: ResultCache | None,
    keys: Sequence[str],
    decode: Decode[T],
    notice: Notice | None = None,
    then: str = "recomputing",
) -> T | None:
    """The result cached under the first of ``keys`` (the current key, then older ones) that
    holds one, else None; an entry that cannot be used is said (``"...; recomputing"``) and
    ends the lookup. ``cache`` None (``--no-cache``) finds nothing."""
    from isotui.store.cache import CacheProblem

    if cache is None:
        return None
    for key in keys:
        try:
            hit = read(cache, key, decode)
        except CacheProblem as problem:
            (notice or ignore_notice)(f"{problem}; {then}")
            return None
        if hit is not None:
            return hit
    return None


def keep(
    cache: ResultCache | None,
    key: str,
    payload: dict[str, object],
    arrays: dict[str, np.ndarray],
    on_notice: Notice | None = None,
) -> None:
    """Store one result; a cache that cannot be written is said, never fatal."""
    from isotui.store.cache import CacheWriteError

    if cache is None:
        return
    try:
        cache.put_payload(key, payload, arrays)
    except CacheWriteError as exc:  # the result itself is fine: said in one sentence, kept
        (on_notice or ignore_notice)(str(exc))


def cached_run(
    cache: ResultCache | None,
    keys: Sequence[str],
    *,
    decode: Decode[T],
    relabel: Callable[[T], None],
    compute: Callable[[], T],
    encode: Callable[[T], tuple[dict[str, object], dict[str, np.ndarray]]],
    notice: Notice | None = None,
) -> T:
    """The cached result when there is one (``relabel`` gives it the names asked for now and
    marks it from the cache), else ``compute()``'d and stored under the first of ``keys``."""
    hit = lookup(cache, keys, decode, notice)
    if hit is not None:
        relabel(hit)
        return hit
    result = compute()
    keep(cache, keys[0], *encode(result), notice)
    return result
