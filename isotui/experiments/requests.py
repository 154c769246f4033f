"""Every experiment's job (the :class:`~isotui.experiments.base.Request` contract): hashable
requests that know how to answer from the cache (quick, on the lookup thread), how to compute
(long, on a device lane), and both in one pass (``measure``, the CLI's and the API's path).

Each has ``model`` (what the jobs pane shows), ``device`` (which lane), ``kind``, ``keys`` (the
cache entries of its result) and the steps. A layer-wise job is a :class:`LayersRequest` (the
app may still submit a plain :class:`~isotui.spec.RunSpec`: :func:`request_for` wraps it).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from isotui.experiments.base import Context, Notice, PartProgress
from isotui.extract.progress import Progress, ProgressCallback, StopCheck
from isotui.spec import RunSpec


def series_progress(on_progress: ProgressCallback, n: int) -> PartProgress:
    """Per checkpoint i of n, a context giving its progress callback: one bar for the whole series
    (checkpoint i's samples come after those before it)."""
    from contextlib import nullcontext

    def for_checkpoint(i: int, _ckpt: Any) -> AbstractContextManager[ProgressCallback]:
        def post(p: Progress) -> None:
            if p.message:
                on_progress(p)
                return
            per = p.samples_total
            on_progress(replace(p, samples_done=i * per + p.samples_done, samples_total=n * per))

        return nullcontext(post)

    return for_checkpoint


Compute = dict[str, Any]  # the keyword arguments of a request's compute


def _cache(cache_root: Path | None, folder: str, schema: int) -> Any:
    """The experiment's cache folder at ``cache_root`` (None: no cache)."""
    from isotui.store.cache import ResultCache

    return ResultCache(cache_root, folder=folder, schema=schema) if cache_root is not None else None


def _runs(cache_root: Path | None) -> Any:
    """The layer runs' cache folder (``runs``) at ``cache_root`` (None: no cache)."""
    from isotui.store.cache import ResultCache

    return ResultCache(cache_root) if cache_root is not None else None


@dataclass(frozen=True)
class LayersRequest:
    """Layer-wise anisotropy of one model (``isotui run``): the layer experiment's job.

    ``prepare_fn(spec)`` and ``compute_fn(prepared, on_progress=, should_stop=)`` default to
    :func:`~isotui.experiments.layerwise.prepare` (with this cache) and
    :func:`~isotui.experiments.layerwise.compute`; a front end's test passes fakes (not part of
    the job's identity: equal specs are one job)."""

    spec: RunSpec
    compute_fn: Any = field(default=None, compare=False, repr=False)
    prepare_fn: Any = field(default=None, compare=False, repr=False)
    _resolved: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    kind: ClassVar[str] = "layers"

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def device(self) -> str:
        return self.spec.device

    def _prepare(self, cache: Any) -> Any:
        """The spec resolved (names, data, dtype, key): once per request, so that a lookup and the
        compute after it read the data once (a new request resolves anew)."""
        from isotui.experiments import layerwise

        if "prepared" not in self._resolved:
            prepare = self.prepare_fn or (lambda spec: layerwise.prepare(spec, cache))
            self._resolved["prepared"] = prepare(self.spec)
        return self._resolved["prepared"]

    def keys(self, cache_root: Path | None) -> list[str]:
        return list(self._prepare(_runs(cache_root)).keys)

    def resolved_device(self) -> str:
        """The device it runs on, once looked up (the lookup resolved it): the jobs pane's."""
        from isotui.extract.device import resolve_device

        prepared = self._resolved.get("prepared")
        if prepared is not None and prepared.device:
            return str(prepared.device)
        return resolve_device(self.spec.device)

    def lookup(self, cache_root: Path | None, notice: Notice) -> Any:
        from isotui.experiments import layerwise

        cache = _runs(cache_root)
        return layerwise.lookup(self._prepare(cache), cache, notice)

    def compute(
        self,
        cache_root: Path | None,
        *,
        on_progress: ProgressCallback,
        should_stop: StopCheck,
        notice: Notice,
    ) -> Any:
        from isotui.experiments import layerwise
        from isotui.experiments.shards import measure_shard, merge_cached

        if self.spec.shard is not None and self.compute_fn is None:
            return measure_shard(
                self.spec, cache_root, on_progress=on_progress, should_stop=should_stop, on_notice=notice
            )
        cache = _runs(cache_root)
        prepared = self._prepare(cache)
        merged = None if self.compute_fn else merge_cached(prepared, cache_root, on_notice=notice)
        if merged is not None:
            return merged
        compute = self.compute_fn or layerwise.compute
        result = compute(prepared, on_progress=on_progress, should_stop=should_stop)
        layerwise.store(result, cache, notice)
        return result

    def measure(self, context: Context) -> Any:
        from isotui.experiments.layerwise import measure
        from isotui.experiments.shards import measure_shard

        if self.spec.shard is not None and not (self.compute_fn or self.prepare_fn):
            return measure_shard(
                self.spec,
                context.cache_root,
                on_progress=context.on_progress,
                should_stop=context.should_stop,
                on_notice=context.notice,
            )
        if self.compute_fn or self.prepare_fn:  # a fake's own steps
            found = self.lookup(context.cache_root, context.notice)
            if found is not None:
                return found
            return self.compute(
                context.cache_root,
                on_progress=context.on_progress,
                should_stop=context.should_stop,
                notice=context.notice,
            )
        return measure(
            self.spec,
            _runs(context.cache_root),
            on_progress=context.on_progress,
            should_stop=context.should_stop,
            on_notice=context.notice,
        )


def request_for(job: Any) -> Any:
    """The request of a job: a plain :class:`~isotui.spec.RunSpec` is a :class:`LayersRequest`;
    any other request is itself (so a front end that still submits specs needs no other branch)."""
    return LayersRequest(job) if isinstance(job, RunSpec) else job


@dataclass(frozen=True)
class AttentionRequest:
    """Queries, keys and attention sharpness of one model (``isotui experiment attention``)."""

    spec: RunSpec
    sample_size: int = 0
    kind: ClassVar[str] = "attention"

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def device(self) -> str:
        return self.spec.device

    def keys(self, cache_root: Path | None) -> list[str]:
        from isotui.experiments.attention import find_attention

        return [find_attention(self.spec, None, self.sample_size)[1]]

    def lookup(self, cache_root: Path | None, notice: Notice) -> Any:
        from isotui.experiments.attention import attention_cache, find_attention

        cache = attention_cache(cache_root) if cache_root else None
        return find_attention(self.spec, cache, self.sample_size, notice)[2]

    def compute(
        self,
        cache_root: Path | None,
        *,
        on_progress: ProgressCallback,
        should_stop: StopCheck,
        notice: Notice,
    ) -> Any:
        from isotui.experiments.attention import attention_cache, compute_attention, find_attention

        cache = attention_cache(cache_root) if cache_root else None
        prepared, key, _ = find_attention(self.spec, None, self.sample_size)
        return compute_attention(prepared, key, self.sample_size, cache, on_progress, should_stop, notice)

    def measure(self, context: Context) -> Any:
        from isotui.experiments.attention import attention_cache, measure_attention

        return measure_attention(
            self.spec,
            attention_cache(context.cache_root) if context.cache_root else None,
            sample_size=self.sample_size,
            on_progress=context.on_progress,
            should_stop=context.should_stop,
            on_notice=context.notice,
        )


@dataclass(frozen=True)
class _CachedRequest:
    """A job of an experiment cached in a folder of its own, keyed by the layer run's key plus its
    parameters (:mod:`isotui.experiments.cached`): final-norm, gradients."""

    spec: RunSpec

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def device(self) -> str:
        return self.spec.device

    def _measure(self, cache: Any, context: Context) -> Any:
        raise NotImplementedError

    def _folder(self) -> tuple[str, int, dict[str, Any]]:
        raise NotImplementedError

    def keys(self, cache_root: Path | None) -> list[str]:
        from isotui.experiments.cached import experiment_key
        from isotui.experiments.layerwise import prepare

        folder, schema, params = self._folder()
        return [experiment_key(k, folder, schema, params) for k in prepare(self.spec, _runs(cache_root)).keys]

    def lookup(self, cache_root: Path | None, notice: Notice) -> Any:
        """Answered when the cache holds the result (the same reading as :meth:`measure`)."""
        from isotui.experiments.cached import lookup

        if cache_root is None:
            return None
        folder, schema, _ = self._folder()
        cache = _cache(cache_root, folder, schema)
        if lookup(cache, self.keys(cache_root), lambda payload, _arrays: payload, notice) is None:
            return None
        return self._measure(cache, Context(cache_root, notice=notice))

    def compute(
        self,
        cache_root: Path | None,
        *,
        on_progress: ProgressCallback,
        should_stop: StopCheck,
        notice: Notice,
    ) -> Any:
        folder, schema, _ = self._folder()
        return self._measure(
            _cache(cache_root, folder, schema),
            Context(cache_root, on_progress=on_progress, should_stop=should_stop, notice=notice),
        )

    def measure(self, context: Context) -> Any:
        folder, schema, _ = self._folder()
        return self._measure(_cache(context.cache_root, folder, schema), context)


@dataclass(frozen=True)
class FinalNormRequest(_CachedRequest):
    """Metrics before and after the final norm (``isotui experiment final-norm``); its result is
    a list: the final norm, or (``every_layer``) every block's output norm."""

    every_layer: bool = False
    kind: ClassVar[str] = "final-norm"

    def _folder(self) -> tuple[str, int, dict[str, Any]]:
        from isotui.experiments.final_norm import FOLDER, SCHEMA

        return FOLDER, SCHEMA, {"every_layer": self.every_layer}

    def _measure(self, cache: Any, context: Context) -> Any:
        from isotui.experiments.final_norm import cached_norms

        return cached_norms(
            self.spec,
            cache,
            every_layer=self.every_layer,
            on_progress=context.on_progress,
            should_stop=context.should_stop,
            on_notice=context.notice,
        )


@dataclass(frozen=True)
class GradientsRequest(_CachedRequest):
    """Loss gradients w.r.t. hidden states (``isotui experiment gradients``)."""

    top_k: int = 10
    kind: ClassVar[str] = "gradients"

    def _folder(self) -> tuple[str, int, dict[str, Any]]:
        from isotui.experiments.gradients import FOLDER, SCHEMA

        return FOLDER, SCHEMA, {"top_k": self.top_k}

    def _measure(self, cache: Any, context: Context) -> Any:
        from isotui.experiments.gradients import cached_gradients

        return cached_gradients(
            self.spec,
            cache,
            top_k=self.top_k,
            on_progress=context.on_progress,
            should_stop=context.should_stop,
            on_notice=context.notice,
        )


@dataclass(frozen=True)
class _SeriesRequest:
    """A job over a checkpoint series: what the jobs pane shows and which lane it runs on."""

    series: str | None
    checkpoints: tuple[Any, ...]  # of qk_dynamics.Checkpoint
    spec: RunSpec  # data and run options; its model is the first checkpoint

    @property
    def model(self) -> str:
        from isotui.experiments.qk_dynamics import series_name

        return self.series or series_name(list(self.checkpoints))

    @property
    def device(self) -> str:
        return self.spec.device

    def _parts(self) -> list[Any]:
        """The requests of its checkpoints, each cached on its own."""
        raise NotImplementedError

    def keys(self, cache_root: Path | None) -> list[str]:
        return [k for part in self._parts() for k in part.keys(cache_root)[:1]]

    def compute(
        self,
        cache_root: Path | None,
        *,
        on_progress: ProgressCallback,
        should_stop: StopCheck,
        notice: Notice,
    ) -> Any:
        return self.measure(Context(cache_root, on_progress, should_stop, notice))

    def measure(self, context: Context) -> Any:
        raise NotImplementedError

    def _progress(self, context: Context) -> PartProgress:
        return context.part_progress or series_progress(context.on_progress, len(self.checkpoints))


@dataclass(frozen=True)
class DynamicsRequest(_SeriesRequest):
    """Queries and keys along a checkpoint series (``isotui experiment qk-dynamics``)."""

    sample_size: int = 256
    kind: ClassVar[str] = "qk-dynamics"

    def _parts(self) -> list[Any]:
        return [AttentionRequest(self.spec.with_model(c.model), self.sample_size) for c in self.checkpoints]

    def lookup(self, cache_root: Path | None, notice: Notice) -> Any:
        """Answered at once only when every checkpoint is cached."""
        from isotui.experiments.qk_dynamics import assemble

        if cache_root is None:
            return None
        found = []
        for part in self._parts():
            hit = part.lookup(cache_root, notice)
            if hit is None:
                return None
            found.append(hit)
        return assemble(self.series, list(self.checkpoints), found, self.sample_size)

    def measure(self, context: Context) -> Any:
        from isotui.experiments.attention import attention_cache
        from isotui.experiments.qk_dynamics import run_dynamics

        cache = attention_cache(context.cache_root) if context.cache_root else None
        return run_dynamics(
            self.series,
            list(self.checkpoints),
            self.spec,
            cache,
            sample_size=self.sample_size,
            progress=self._progress(context),
            should_stop=context.should_stop,
            on_notice=context.notice,
            failures=_Attempts(context.attempt) if context.attempt else None,
        )


@dataclass(frozen=True)
class CheckpointsRequest(_SeriesRequest):
    """Layer metrics along a checkpoint series (``isotui experiment checkpoints``)."""

    kind: ClassVar[str] = "checkpoints"

    def _parts(self) -> list[Any]:
        return [LayersRequest(self.spec.with_model(c.model)) for c in self.checkpoints]

    def lookup(self, cache_root: Path | None, notice: Notice) -> Any:
        """Answered at once only when every checkpoint's layer run is cached."""
        from isotui.experiments.checkpoints import assemble_series

        if cache_root is None:
            return None
        found = []
        for part in self._parts():
            hit = part.lookup(cache_root, notice)
            if hit is None:
                return None
            found.append(hit)
        return assemble_series(self.series, list(self.checkpoints), found)

    def measure(self, context: Context) -> Any:
        from isotui.experiments.checkpoints import run_series

        return run_series(
            self.series,
            list(self.checkpoints),
            self.spec,
            _runs(context.cache_root),
            progress=self._progress(context),
            on_notice=context.notice,
            should_stop=context.should_stop,
            failures=_Attempts(context.attempt) if context.attempt else None,
        )


@dataclass(frozen=True)
class _Attempts:
    """A context's ``attempt`` where the series functions take ``failures`` (``.attempt``)."""

    attempt: Any


@dataclass(frozen=True)
class DriftBlockRequest:
    """The untrained block under drift (``isotui experiment drift-block``)."""

    config: Any  # drift_block.DriftBlockConfig (frozen, hashable)
    kind: ClassVar[str] = "drift-block"

    @property
    def model(self) -> str:
        c = self.config
        variant = "".join(f" {v}" for v in (c.block, c.measure) if v not in ("post-ln", "after-norm"))
        return f"d={c.hidden} heads={c.heads} std={c.init_std}{variant} seeds={','.join(map(str, c.seeds))}"

    @property
    def device(self) -> str:
        return str(self.config.device)

    def keys(self, cache_root: Path | None) -> list[str]:
        return [str(self.config.key(seed)) for seed in self.config.seeds]

    def lookup(self, cache_root: Path | None, notice: Notice) -> Any:
        """Answered at once only when every seed's sweep loads from the cache (nothing is
        computed on the lookup thread; a damaged entry is recomputed on the device lane)."""
        from isotui.experiments.drift_block import _assemble, _lookup, drift_cache

        if cache_root is None:
            return None
        cache = drift_cache(cache_root)
        notes: list[str] = []
        runs = [_lookup(cache, self.config.key(seed), notes) for seed in self.config.seeds]
        kept = [run for run in runs if run is not None]
        if len(kept) < len(runs):
            return None
        return _assemble(self.config, kept, notes, None)

    def compute(
        self,
        cache_root: Path | None,
        *,
        on_progress: ProgressCallback,
        should_stop: StopCheck,
        notice: Notice,
    ) -> Any:
        return self.measure(Context(cache_root, on_progress, should_stop, notice))

    def measure(self, context: Context) -> Any:
        from isotui.experiments.drift_block import drift_cache, run_drift_block

        cache = drift_cache(context.cache_root) if context.cache_root else None
        return run_drift_block(self.config, cache, context.on_progress, context.should_stop)
