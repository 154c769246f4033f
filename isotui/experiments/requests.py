"""Experiment jobs for the backend: hashable requests that know how to answer from the cache
(quick, on the lookup thread) and how to compute (long, on a device lane).

A layer-wise job is a plain :class:`~isotui.spec.RunSpec`; these are the other experiments. Each
has ``model`` (what the jobs pane shows), ``device`` (which lane), ``kind``, and the two steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from isotui.spec import RunSpec


def series_progress(on_progress, n: int):
    """Per checkpoint i of n, a context giving its progress callback: one bar for the whole series
    (checkpoint i's samples come after those before it)."""
    from contextlib import nullcontext

    def for_checkpoint(i: int, _ckpt):
        def post(p):
            if p.message:
                on_progress(p)
                return
            per = p.samples_total
            on_progress(replace(p, samples_done=i * per + p.samples_done, samples_total=n * per))

        return nullcontext(post)

    return for_checkpoint


@dataclass(frozen=True)
class AttentionRequest:
    """Queries, keys and attention sharpness of one model (``isotui experiment attention``)."""

    spec: RunSpec
    sample_size: int = 0
    kind = "attention"

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def device(self) -> str:
        return self.spec.device

    def lookup(self, cache_root: Path | None, notice) -> Any:
        from isotui.experiments.attention import attention_cache, find_attention

        cache = attention_cache(cache_root) if cache_root else None
        return find_attention(self.spec, cache, self.sample_size, notice)[2]

    def compute(self, cache_root: Path | None, *, on_progress, should_stop, notice) -> Any:
        from isotui.experiments.attention import attention_cache, compute_attention, find_attention

        cache = attention_cache(cache_root) if cache_root else None
        prepared, key, _ = find_attention(self.spec, None, self.sample_size)
        return compute_attention(prepared, key, self.sample_size, cache, on_progress, should_stop, notice)


@dataclass(frozen=True)
class _SeriesRequest:
    """A job over a checkpoint series: what the jobs pane shows and which lane it runs on."""

    series: str | None
    checkpoints: tuple  # of qk_dynamics.Checkpoint
    spec: RunSpec  # data and run options; its model is the first checkpoint

    @property
    def model(self) -> str:
        from isotui.experiments.qk_dynamics import series_name

        return self.series or series_name(list(self.checkpoints))

    @property
    def device(self) -> str:
        return self.spec.device


@dataclass(frozen=True)
class DynamicsRequest(_SeriesRequest):
    """Queries and keys along a checkpoint series (``isotui experiment qk-dynamics``)."""

    sample_size: int = 256
    kind = "qk-dynamics"

    def lookup(self, cache_root: Path | None, notice) -> Any:
        """Answered at once only when every checkpoint is cached."""
        from isotui.experiments.attention import attention_cache, find_attention
        from isotui.experiments.qk_dynamics import assemble

        if cache_root is None:
            return None
        cache = attention_cache(cache_root)
        found = []
        for ckpt in self.checkpoints:
            hit = find_attention(self.spec.with_model(ckpt.model), cache, self.sample_size, notice)[2]
            if hit is None:
                return None
            found.append(hit)
        return assemble(self.series, list(self.checkpoints), found, self.sample_size)

    def compute(self, cache_root: Path | None, *, on_progress, should_stop, notice) -> Any:

        from isotui.experiments.attention import attention_cache
        from isotui.experiments.qk_dynamics import run_dynamics

        cache = attention_cache(cache_root) if cache_root else None
        return run_dynamics(
            self.series,
            list(self.checkpoints),
            self.spec,
            cache,
            sample_size=self.sample_size,
            progress=series_progress(on_progress, len(self.checkpoints)),
            should_stop=should_stop,
            on_notice=notice,
        )


@dataclass(frozen=True)
class DriftBlockRequest:
    """The untrained block under drift (``isotui experiment drift-block``)."""

    config: Any  # drift_block.DriftBlockConfig (frozen, hashable)
    kind = "drift-block"

    @property
    def model(self) -> str:
        c = self.config
        variant = "".join(f" {v}" for v in (c.block, c.measure) if v not in ("post-ln", "after-norm"))
        return f"d={c.hidden} heads={c.heads} std={c.init_std}{variant} seeds={','.join(map(str, c.seeds))}"

    @property
    def device(self) -> str:
        return self.config.device

    def lookup(self, cache_root: Path | None, notice) -> Any:
        """Answered at once only when every seed's sweep loads from the cache (nothing is
        computed on the lookup thread; a damaged entry is recomputed on the device lane)."""
        from isotui.experiments.drift_block import _assemble, _lookup, drift_cache

        if cache_root is None:
            return None
        cache = drift_cache(cache_root)
        notes: list[str] = []
        runs = [_lookup(cache, self.config.key(seed), notes) for seed in self.config.seeds]
        if any(run is None for run in runs):
            return None
        return _assemble(self.config, runs, notes, None)

    def compute(self, cache_root: Path | None, *, on_progress, should_stop, notice) -> Any:
        from isotui.experiments.drift_block import drift_cache, run_drift_block

        cache = drift_cache(cache_root) if cache_root else None
        return run_drift_block(self.config, cache, on_progress, should_stop)


@dataclass(frozen=True)
class CheckpointsRequest(_SeriesRequest):
    """Layer metrics along a checkpoint series (``isotui experiment checkpoints``)."""

    kind = "checkpoints"

    def lookup(self, cache_root: Path | None, notice) -> Any:
        """Answered at once only when every checkpoint's layer run is cached."""
        from isotui.experiments import layerwise
        from isotui.experiments.checkpoints import assemble_series
        from isotui.store.cache import ResultCache

        if cache_root is None:
            return None
        cache = ResultCache(cache_root)
        found = []
        for ckpt in self.checkpoints:
            hit = layerwise.lookup(layerwise.prepare(self.spec.with_model(ckpt.model), cache), cache, notice)
            if hit is None:
                return None
            found.append(hit)
        return assemble_series(self.series, list(self.checkpoints), found)

    def compute(self, cache_root: Path | None, *, on_progress, should_stop, notice) -> Any:

        from isotui.experiments.checkpoints import run_series
        from isotui.store.cache import ResultCache

        cache = ResultCache(cache_root) if cache_root else None
        return run_series(
            self.series,
            list(self.checkpoints),
            self.spec,
            cache,
            progress=series_progress(on_progress, len(self.checkpoints)),
            on_notice=notice,
            should_stop=should_stop,
        )
