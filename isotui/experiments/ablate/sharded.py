"""ablate's shards (``--shard I/K``): each shard's edited-pass sums (:class:`EditedSums`, with
its result for the labels) kept as a partial state in ablate's own cache folder, named by the
request's key and the shard (``KEY-I-of-K``, as the layer run names its shards): ablate's layout
under ablate's schema, apart from the layer runs' ``shards/`` (whose listing and merge read a
layer run's state). Once all K are there they merge into the one-process result
(:func:`merged`), which the caller stores as an unsharded run's, then drops the K states."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, cast

from isotui.errors import IsotuiError
from isotui.experiments.ablate.measure import EditedSums, fill
from isotui.experiments.ablate.result import AblationResult, from_payload
from isotui.experiments.base import Notice
from isotui.experiments.shards import DAMAGE, partial_key, state_from_payload, state_payload
from isotui.store.cache import CacheProblem, CacheWriteError

if TYPE_CHECKING:
    from isotui.experiments.shards import ShardEntry
    from isotui.store.cache import ResultCache


def have(cache: ResultCache, key: str, count: int) -> list[int]:
    """The shards of ``count`` whose partial state is cached."""
    return [i for i in range(count) if cache.path_for(partial_key(key, i, count)).is_file()]


def counts(cache: ResultCache, key: str) -> list[int]:
    """Every K the cache holds all K partial states of."""
    found = {
        p.name.removesuffix(".safetensors").rpartition("-of-")[2] for p in cache.runs.glob(f"{key}-*-of-*")
    }
    ks = sorted(int(k) for k in found if k.isdigit())
    return [k for k in ks if len(have(cache, key, k)) == k]


def keep(
    cache: ResultCache, key: str, index: int, count: int, result: AblationResult, sums: EditedSums
) -> None:
    payload, arrays = state_payload(sums.state())
    payload["result"] = result.to_payload()
    try:
        cache.put_payload(partial_key(key, index, count), payload, arrays)
    except CacheWriteError as exc:
        raise IsotuiError(f"{exc}; a shard is kept only in the cache, so it is lost") from None


def merged(cache: ResultCache, key: str, notice: Notice) -> tuple[AblationResult, int] | None:
    """The result merged from the first complete set of cached shards, and its K; None when no
    K are all there (or one was damaged: said, removed, to be run again)."""
    for count in counts(cache, key):
        total: EditedSums | None = None
        template: AblationResult | None = None
        notes: list[str] = []
        seconds = 0.0
        for i in range(count):
            name = partial_key(key, i, count)
            try:
                found = cache.get_payload(name)
                if found is None:  # merged and removed by another shard meanwhile
                    return None
                sums = EditedSums.from_state(state_from_payload(cast("ShardEntry", found[0]), found[1]))
                part = from_payload(cast("dict[str, object]", found[0]["result"]), {})
                if total is None:
                    total, template = sums, part
                else:
                    total.merge(sums)
            except (CacheProblem, *DAMAGE) as exc:
                cache.remove(name)
                notice(
                    f"cache entry {name} of ablate is damaged ({type(exc).__name__}); removed it: "
                    f"shard {i}/{count} runs again"
                )
                return None
            notes += part.notes
            seconds += float(part.meta.get("seconds", 0.0))
        assert total is not None and template is not None
        result = fill(template, total)
        said: dict[str, str] = {}  # a note the shards say with other numbers (the load): once, the first's
        for note in notes:
            said.setdefault(re.sub(r"[\d.]+", "#", note), note)
        result.notes = [*said.values(), f"merged from {count} shards"]
        result.meta["seconds"] = round(seconds, 3)
        return result, count
    return None


def forget(cache: ResultCache, key: str) -> None:
    """Every partial state of ``key``, whatever its K and complete or not: once the whole result
    is kept, none of them is read again (an unfinished set, another K, a damaged one's peers)."""
    for path in cache.runs.glob(f"{key}-*-of-*.safetensors"):
        cache.remove(path.name.removesuffix(".safetensors"))
