"""A job of an experiment cached in a folder of its own (:mod:`isotui.experiments.cached`), keyed
by the layer run's key plus its own parameters: the keys, lookup, compute and measure that
final-norm, gradients and token types share. Above the one pass (it resolves the layer run's
key with :func:`~isotui.experiments.layer_pass.prepare`), which the cached path lies below."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generic

from isotui.experiments.base import Context, Notice, OneModelJob, R
from isotui.experiments.cached import experiment_key, folder_cache, lookup, runs_cache
from isotui.experiments.layer_pass import prepare

if TYPE_CHECKING:
    from isotui.spec import RunSpec
    from isotui.store.cache import ResultCache


@dataclass(frozen=True)
class CachedRequest(OneModelJob, Generic[R]):
    """A job of an experiment cached in a folder of its own, keyed by the layer run's key plus its
    parameters (:mod:`isotui.experiments.cached`): final-norm, gradients."""

    spec: RunSpec

    def _measure(self, cache: ResultCache | None, context: Context) -> R:
        raise NotImplementedError

    def _folder(self) -> tuple[str, int, Mapping[str, object]]:
        raise NotImplementedError

    def keys(self, cache_root: Path | None) -> list[str]:
        folder, schema, params = self._folder()
        return [
            experiment_key(k, folder, schema, params) for k in prepare(self.spec, runs_cache(cache_root)).keys
        ]

    def lookup(self, cache_root: Path | None, notice: Notice) -> R | None:
        """Answered when the cache holds the result (the same reading as :meth:`measure`)."""
        if cache_root is None:
            return None
        folder, schema, _ = self._folder()
        cache = folder_cache(cache_root, folder, schema)
        if lookup(cache, self.keys(cache_root), lambda payload, _arrays: payload, notice) is None:
            return None
        return self._measure(cache, Context(cache_root, notice=notice))

    def compute(self, context: Context) -> R:
        folder, schema, _ = self._folder()
        return self._measure(folder_cache(context.cache_root, folder, schema), context)

    def measure(self, context: Context) -> R:
        folder, schema, _ = self._folder()
        return self._measure(folder_cache(context.cache_root, folder, schema), context)
