"""A job of an experiment cached in a folder of its own (:mod:`isotui.experiments.cached`), keyed
by the layer run's key plus its own parameters: the keys, lookup, compute and measure that
final-norm, gradients and token types share. Above the one pass (it resolves the layer run's
key with :func:`~isotui.experiments.layer_pass.prepare`), which the cached path lies below.
Each experiment's request says only its folder and parameters, its pass, and its cache entry."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generic

from isotui.experiments.base import Arrays, Context, Notice, OneModelJob, R
from isotui.experiments.cached import (
    cached_run,
    experiment_key,
    folder_cache,
    lookup,
    relabel_rows,
    runs_cache,
)
from isotui.experiments.layer_pass import prepare

if TYPE_CHECKING:
    from isotui.experiments.layer_pass import Prepared
    from isotui.spec import RunSpec
    from isotui.store.cache import ResultCache


@dataclass(frozen=True)
class CachedRequest(OneModelJob, Generic[R]):
    """A job of an experiment cached in a folder of its own, keyed by the layer run's key plus its
    parameters (:mod:`isotui.experiments.cached`): final-norm, gradients, token types."""

    spec: RunSpec

    def _folder(self) -> tuple[str, int, Mapping[str, object]]:
        """(cache folder, schema, the parameters its keys add to the layer run's)."""
        raise NotImplementedError

    def _compute(self, prepared: Prepared, context: Context) -> R:
        """The experiment's own pass over the prepared run (the model loaded there)."""
        raise NotImplementedError

    def _encode(self, result: R) -> tuple[dict[str, object], Arrays]:
        """The cache entry ``result`` is stored as: its JSON payload and its arrays."""
        raise NotImplementedError

    def _decode(self, payload: Mapping[str, object], arrays: Arrays) -> R:
        """A cache entry back into a result (:meth:`_encode`'s inverse)."""
        raise NotImplementedError

    def _relabel(self, result: R) -> None:
        """A cached result named as this job asks (a result with ``model``, ``meta`` and ``rows``)."""
        relabel_rows(self.spec)(result)

    def _measure(self, cache: ResultCache | None, context: Context) -> R:
        """The result cached under the layer run's keys plus this job's parameters, else computed
        and stored under the first of them."""
        folder, schema, params = self._folder()
        prepared = prepare(self.spec, cache)
        return cached_run(
            cache,
            [experiment_key(k, folder, schema, params) for k in prepared.keys],
            decode=self._decode,
            relabel=self._relabel,
            compute=lambda: self._compute(prepared, context),
            encode=self._encode,
            notice=context.notice,
        )

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
