"""The sweep: every seed of a configuration, from the cache or computed N by N."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from isotui.core.attention import RANGE_BINS, merge_range_histograms
from isotui.errors import Cancelled, IsotuiError
from isotui.experiments.drift_block.config import FOLDER, DriftBlockConfig
from isotui.experiments.drift_block.fixed_point import fixed_point
from isotui.experiments.drift_block.model import _measure, _Step, build_block
from isotui.experiments.drift_block.result import (
    HEAD_METRICS,
    DriftBlockResult,
    DriftBlockRow,
    NormSummary,
    SeedRun,
)
from isotui.experiments.drift_block.store import _lookup, _store
from isotui.extract.progress import Progress, ProgressCallback, StopCheck, never_stop, no_progress

if TYPE_CHECKING:
    from isotui.store.cache import ResultCache


def _too_big(config: DriftBlockConfig, device: str, have: int | None) -> IsotuiError:
    free = f", and {have / 2**30:.1f} GiB is free on {device}" if have is not None else f" on {device}"
    return IsotuiError(
        f"drift-block with --vocab {config.vocab} --hidden {config.hidden} --intermediate "
        f"{config.intermediate} --batch {config.batch} --seq-len {config.seq_len} needs at least "
        f"{config.memory_bytes() / 2**30:.1f} GiB{free}; give smaller sizes"
    )


def _check_memory(config: DriftBlockConfig, device: str) -> None:
    """Refuse sizes that cannot fit before allocating anything, saying the memory they need."""
    from isotui.extract.device import available_memory

    have = available_memory(device)
    if have is not None and config.memory_bytes() > have:
        raise _too_big(config, device, have)


def _run_seed(
    config: DriftBlockConfig,
    seed: int,
    device: str,
    *,
    tick: Callable[[float], None],
    should_stop: StopCheck,
) -> SeedRun:
    """One seed's sweep over N; ``tick(norm)`` after each N, ``should_stop`` checked before each."""
    import torch

    start = time.perf_counter()
    try:  # the estimate is a lower bound: an allocation that still fails is said the same way
        built = build_block(config, seed)
        built.block.to(device)
        built.embeddings = built.embeddings.to(device)
        built.ids = built.ids.to(device)
        built.b_u = built.b_u.to(device)
    except (MemoryError, torch.OutOfMemoryError):
        raise _too_big(config, device, None) from None
    except RuntimeError as exc:
        if "allocate" not in str(exc):
            raise
        raise _too_big(config, device, None) from None
    with torch.inference_mode():
        steps: list[_Step] = []
        for norm in config.norms:
            if should_stop():
                raise Cancelled(f"drift-block stopped at seed {seed}, N={norm:g}")
            steps.append(_measure(built, norm, config.heads, device, config.measure))
            tick(norm)
    n_star, note = fixed_point(
        config.norms, [s.values["in_mean_norm"] for s in steps], [s.values["out_mean_norm"] for s in steps]
    )
    settings = config.settings()
    settings.pop("norms")
    rows = [
        DriftBlockRow(seed=seed, norm=float(norm), **s.values, n_star=n_star, **settings)
        for norm, s in zip(config.norms, steps, strict=True)
    ]
    return SeedRun(
        seed=seed,
        key=config.key(seed),
        rows=rows,
        n_star=n_star,
        notes=[f"seed {seed}: {note}"] if note else [],
        score_hist=np.stack([s.hist.counts for s in steps]).astype(np.int64),
        score_grid=np.array([(s.hist.exp, s.hist.start) for s in steps], dtype=np.int64).reshape(-1, 2),
        softmax_position=np.stack([s.position for s in steps]),
        head={k: np.stack([s.head[k] for s in steps]) for k in HEAD_METRICS},
        seconds=time.perf_counter() - start,
        device=str(device),
    )


def run_drift_block(
    config: DriftBlockConfig,
    cache: ResultCache | None,
    on_progress: ProgressCallback = no_progress,
    should_stop: StopCheck = never_stop,
) -> DriftBlockResult:
    """The sweep for every seed of ``config``: each seed from ``cache`` when there, else computed
    (and stored). Safe to call from a worker thread: ``on_progress`` gets a :class:`Progress`
    after each N (``samples_*`` count (seed, N) steps, ``tokens_done`` the tokens run through the
    block); ``should_stop()`` is checked before each N and raises :class:`Cancelled`."""
    n_norms, n_seeds = len(config.norms), len(config.seeds)
    total = n_norms * n_seeds
    tokens = config.batch * config.seq_len
    notes: list[str] = []
    runs: list[SeedRun] = []
    start = time.perf_counter()
    device: str | None = None
    done = 0

    def post(message: str | None = None) -> None:
        mem = 0
        if device is not None:
            from isotui.extract.device import memory_in_use

            mem = memory_in_use(device)
        on_progress(
            Progress(
                samples_done=done,
                samples_total=total,
                tokens_done=done * tokens,
                elapsed_s=time.perf_counter() - start,
                message=message,
                stage=FOLDER,
                memory_bytes=mem,
            )
        )

    for seed in config.seeds:
        key = config.key(seed)
        run = _lookup(cache, key, notes)
        if run is None:
            if device is None:  # torch is imported only when something must be computed
                from isotui.extract.device import resolve_device

                device = resolve_device(config.device)
                _check_memory(config, device)

            def tick(_norm: float) -> None:
                nonlocal done
                done += 1
                post()

            run = _run_seed(config, seed, device, tick=tick, should_stop=should_stop)
            _store(cache, run, notes)
        else:
            done += n_norms
            post()
        runs.append(run)
    return _assemble(config, runs, notes, device)


def norm_note(config: DriftBlockConfig, out_norms: list[float]) -> str:
    """The sentence that says N* of a block ending in a LayerNorm is that norm's fixed output norm."""
    low, high = min(out_norms), max(out_norms)
    measured = f"{low:.3f}" if f"{low:.3f}" == f"{high:.3f}" else f"{low:.3f} to {high:.3f}"
    return (
        f"the block ends in its output LayerNorm (weight 1, bias 0), which gives every output vector "
        f"the norm sqrt(d) = {math.sqrt(config.hidden):.3f} less the eps term (here {measured} for "
        "every N), so N* is where the input's mean norm reaches that fixed value, not an effect of "
        "attention; --measure before-norm or --block pre-ln measure the block without it"
    )


def _assemble(
    config: DriftBlockConfig, runs: list[SeedRun], notes: list[str], device: str | None
) -> DriftBlockResult:
    """The seeds' sweeps as one result: per-N mean and std over seeds, N*, arrays stacked."""
    rows = [r for run in runs for r in run.rows]
    metrics = DriftBlockRow.metrics()
    summary = []
    for i, norm in enumerate(config.norms):
        per_seed = [run.rows[i] for run in runs]
        mean: dict[str, float] = {}
        std: dict[str, float] = {}
        for name in metrics:
            values = np.array([getattr(r, name) for r in per_seed], dtype=np.float64)
            mean[name] = float(np.mean(values))
            std[name] = float(np.std(values, ddof=1)) if len(values) > 1 else math.nan
        summary.append(NormSummary(float(norm), len(per_seed), mean, std))
    stars = np.array([run.n_star for run in runs], dtype=np.float64)
    finite = stars[np.isfinite(stars)]
    n_star = float(np.mean(finite)) if len(finite) else math.nan
    n_star_std = float(np.std(finite, ddof=1)) if len(finite) > 1 else math.nan
    if 0 < len(finite) < len(stars):
        notes.append(f"N* is the mean over the {len(finite)} of {len(stars)} seeds whose norms cross")
    if config.ends_in_norm and rows:
        notes.insert(0, norm_note(config, [r.out_mean_norm for r in rows]))
    computed = [run for run in runs if not run.from_cache]
    edges, hist = _common_histograms(len(config.norms), runs)
    return DriftBlockResult(
        config=config,
        norms=np.array(config.norms, dtype=np.float64),
        seeds=tuple(run.seed for run in runs),
        rows=rows,
        summary=summary,
        n_star=n_star,
        n_star_std=n_star_std,
        n_star_per_seed=stars,
        score_edges=edges,
        score_hist=hist,
        softmax_position=np.stack([run.softmax_position for run in runs]),
        head={k: np.stack([run.head[k] for run in runs]) for k in HEAD_METRICS},
        notes=[n for run in runs for n in run.notes] + notes,
        keys=tuple(run.key for run in runs),
        from_cache=tuple(run.from_cache for run in runs),
        seconds=sum(run.seconds for run in computed),
        device=device or (runs[0].device if runs else "none"),
    )


def _common_histograms(n_norms: int, runs: list[SeedRun]) -> tuple[np.ndarray, np.ndarray]:
    """Each N's score histograms of every seed on one grid (the seeds' merged range, exact: see
    :func:`~isotui.core.attention.merge_range_histograms`): edges (nN, RANGE_BINS + 1) and
    counts (S, nN, H, RANGE_BINS + 2)."""
    per_seed = [run.score_histograms() for run in runs]
    edges, counts = [], []
    for i in range(n_norms):
        common = merge_range_histograms([hists[i] for hists in per_seed], RANGE_BINS)
        edges.append(common[0].edges())
        counts.append(np.stack([h.counts for h in common]))
    return np.stack(edges), np.stack(counts, axis=1).astype(np.int64)
