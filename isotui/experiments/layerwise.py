"""Layer-wise anisotropy of one model (Godey et al. 2024, Fig. 1): cache first, then one pass
(experiments/layer_pass.py), or the merge of its shards; its parameters, job and registry entry."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, TypeVar

from isotui.experiments import plans
from isotui.experiments.base import (
    Arrays,
    Context,
    Experiment,
    Notice,
    OneModelJob,
    Payload,
    Rows,
    ignore_notice,
)
from isotui.experiments.cached import runs_cache
from isotui.experiments.half_check import HALF_DTYPES
from isotui.experiments.json_types import JsonObject
from isotui.experiments.layer_pass import (
    Prepared,
    compute,
    lookup,
    prepare,
    store,
)
from isotui.experiments.params import param
from isotui.extract.progress import ProgressCallback, StopCheck, never_stop, no_progress
from isotui.results import SCHEMA_VERSION, ModelResult
from isotui.spec import LAYER_METRICS, MODEL, RESERVOIR, SHARD, RunSpec
from isotui.store.cache import ResultCache


def measure(
    spec: RunSpec,
    cache: ResultCache | None,
    *,
    on_progress: ProgressCallback = no_progress,
    should_stop: StopCheck = never_stop,
    on_notice: Notice | None = None,
    keep_sample: bool = False,
) -> ModelResult:
    """The layer-wise result for ``spec``: from ``cache`` when present, else computed and stored.

    ``cache=None`` recomputes and stores nothing. ``on_notice`` receives one-sentence news
    (e.g. a damaged cache entry being recomputed). ``keep_sample``: the result holds every
    layer's reservoir sample (``result.sample``), so it is computed even when cached (the cache
    keeps no sample) and stored again.
    """
    from isotui.extract.progress import Progress

    notice = on_notice or ignore_notice
    on_progress(
        Progress(0, 0, 0, 0.0, stage="prepare", phase="resolving", detail="model, data and cache key")
    )
    prepared = prepare(spec, cache)
    hit = None if keep_sample else lookup(prepared, cache, notice)
    if hit is not None:
        return hit
    from isotui.experiments.shards import merge_cached

    if cache is not None and not keep_sample:  # all K shards of this run cached: merged, not recomputed
        merged = merge_cached(prepared, cache.root, on_notice=notice, on_progress=on_progress)
        if merged is not None:
            return merged
    result = compute(prepared, on_progress=on_progress, should_stop=should_stop, keep_sample=keep_sample)
    if (
        prepared.dtype in HALF_DTYPES and spec.shard is None and spec.given is None
    ):  # the forward's half precision, measured
        from isotui.experiments.half_check import half_check, note

        on_progress(
            Progress(0, 0, 0, 0.0, stage="finalize", phase="running", detail=f"{prepared.dtype} vs float32")
        )
        weights = sum(((result.meta.get("memory_plan") or {}).get("weights_bytes") or {}).values())
        device = result.meta.get("device") or prepared.device
        check = half_check(
            lambda s: compute(prepare(s)),
            spec,
            prepared.dtype,
            len(prepared.samples),
            weights,
            device,
            run=result,
        )
        result.meta["half_check"] = check
        result.meta["notes"].append(note(check))
    elif prepared.dtype in HALF_DTYPES and spec.given is not None:
        result.meta["notes"].append(
            f"{prepared.dtype} forward of a model object: not compared with float32 (that needs a float32 "
            "copy of it); isotui's sums are float64 either way: for a paper, measure it in float32"
        )
    if cache is not None:
        n = result.meta.get("n_samples") or 0
        on_progress(
            Progress(
                n,
                n,
                result.meta.get("n_tokens") or 0,
                0.0,
                stage="write",
                phase="writing",
                detail="the cache",
            )
        )
        started = time.perf_counter()
        store(result, cache, notice)
        result.write_seconds = round(time.perf_counter() - started, 3)
    return result


def measure_for_driver(
    spec: RunSpec, index: int, count: int, plan: JsonObject | None, cache_root: Path
) -> tuple[str, bytes]:
    """A sweep task on a machine that does not see the driver's cache: the whole run (``count``
    1) or shard ``index`` of ``count`` (:func:`~isotui.experiments.shards.measure_shard_for_driver`,
    following ``plan``) measured here with this machine's own cache, and (the run's key, the
    bytes of its cache entry) returned for the driver to keep
    (:func:`~isotui.experiments.shards.keep_from_worker`)."""
    from isotui.experiments.shards import measure_shard_for_driver

    if count != 1:
        return measure_shard_for_driver(spec, index, count, plan, cache_root)
    runs = ResultCache(cache_root)
    result = measure(spec, runs)
    try:
        return result.key, runs.path_for(result.key).read_bytes()
    except OSError:  # not kept here (a full disk): sent from memory
        return result.key, runs.entry_bytes(result.to_json(), result.arrays)


def _wide(metric: str) -> str:
    """``--wide METRIC``, checked: a layer metric (the ones a figure can plot)."""
    from isotui.errors import IsotuiError
    from isotui.plugins import layer_metric_names

    choices = layer_metric_names()  # with the plug-ins' columns
    if metric not in choices:
        raise IsotuiError(f"--wide {metric} is not a layer metric; choose one of {', '.join(choices)}")
    return metric


def _sample_path(value: object) -> str:
    """``--save-sample PATH``: a file name (``~`` expanded) that can be written, said before any
    work (a folder, a missing parent...)."""
    from isotui.errors import IsotuiError
    from isotui.store.files import check_output

    text = str(value).strip()
    if not text:
        raise IsotuiError("--save-sample needs a file name, e.g. sample.safetensors")
    check_output(text, "--save-sample")
    return str(Path(text).expanduser())


@dataclass(frozen=True)
class LayersParams:
    """The layer run's own parameters (beyond the models and the run options): what is shown,
    and where the reservoir sample goes."""

    wide: str | None = param(
        None,
        parse=_wide,
        nargs="?",
        const="avg_cos",
        metavar="METRIC",
        view=True,
        help="also one table of layers (rows) by models (columns) for METRIC (default avg_cos; the "
        "layer metrics below)",
    )
    save_sample: str | None = param(
        None,
        parse=_sample_path,
        metavar="PATH",
        help="write every layer's reservoir sample (its vectors, with each one's sample, position, "
        "token id and token text) to PATH as safetensors; one model per run; computed even when "
        "cached (the cache keeps no sample)",
    )


# --- the layer run's job (the app's backend and the registry's request) -----------------------------


@dataclass(frozen=True)
class LayersRequest(OneModelJob):
    """Layer-wise anisotropy of one model (``isotui run``): the layer experiment's job. Its
    compute gives None for a shard (``--shard I/K``) that is not the last of its K.

    ``prepare_fn(spec)`` and ``compute_fn(prepared, on_progress=, should_stop=)`` default to
    :func:`~isotui.experiments.layer_pass.prepare` (with this cache) and
    :func:`~isotui.experiments.layer_pass.compute`; a front end's test passes fakes (not part of
    the job's identity: equal specs are one job)."""

    spec: RunSpec
    compute_fn: Callable[..., ModelResult] | None = field(default=None, compare=False, repr=False)
    prepare_fn: Callable[[RunSpec], Prepared] | None = field(default=None, compare=False, repr=False)
    _resolved: dict[str, Prepared] = field(default_factory=dict, compare=False, repr=False)
    save_sample: str | None = None  # --save-sample PATH: the reservoir sample written there
    kind: ClassVar[str] = "layers"

    def _prepare(self, cache: ResultCache | None) -> Prepared:
        """The spec resolved (names, data, dtype, key): once per request, so that a lookup and the
        compute after it read the data once (a new request resolves anew)."""
        if "prepared" not in self._resolved:
            prepare_fn = self.prepare_fn or (lambda spec: prepare(spec, cache))
            self._resolved["prepared"] = prepare_fn(self.spec)
        return self._resolved["prepared"]

    def keys(self, cache_root: Path | None) -> list[str]:
        return list(self._prepare(runs_cache(cache_root)).keys)

    def resolved_device(self) -> str:
        """The device it runs on, once looked up (the lookup resolved it): the jobs pane's."""
        from isotui.extract.device import resolve_device

        prepared = self._resolved.get("prepared")
        if prepared is not None and prepared.device:
            return str(prepared.device)
        return resolve_device(self.spec.device)

    def lookup(self, cache_root: Path | None, notice: Notice) -> ModelResult | None:
        cache = runs_cache(cache_root)
        return lookup(self._prepare(cache), cache, notice)

    def compute(self, context: Context) -> ModelResult | None:
        from isotui.experiments.shards import measure_shard, merge_cached

        cache_root, notice = context.cache_root, context.notice
        if self.spec.shard is not None and self.compute_fn is None:
            return measure_shard(
                self.spec,
                cache_root,
                on_progress=context.on_progress,
                should_stop=context.should_stop,
                on_notice=notice,
            )
        cache = runs_cache(cache_root)
        prepared = self._prepare(cache)
        merged = None if self.compute_fn else merge_cached(prepared, cache_root, on_notice=notice)
        if merged is not None:
            return merged
        compute_fn = self.compute_fn or compute
        result = compute_fn(prepared, on_progress=context.on_progress, should_stop=context.should_stop)
        store(result, cache, notice)
        return result

    def measure(self, context: Context) -> ModelResult | None:
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
            return self.compute(context)
        result = measure(
            self.spec,
            runs_cache(context.cache_root),
            on_progress=context.on_progress,
            should_stop=context.should_stop,
            on_notice=context.notice,
            keep_sample=self.save_sample is not None,
        )
        if self.save_sample is not None and result.sample is not None:
            from isotui.store.sample_file import save_sample

            meta = {"model": result.model, "run_key": result.key, "seed": self.spec.seed}
            meta |= {"reservoir": self.spec.reservoir, "data": result.meta.get("data")}
            save_sample(result.sample, self.save_sample, meta, "--save-sample")
        return result


J = TypeVar("J")  # a job that is already a request


def request_for(job: RunSpec | J) -> LayersRequest | J:
    """The request of a job: a plain :class:`~isotui.spec.RunSpec` is a :class:`LayersRequest`;
    any other request is itself (so a front end that still submits specs needs no other branch)."""
    return LayersRequest(job) if isinstance(job, RunSpec) else job


# --- the registry's entry (isotui run) ---------------------------------------------------------------


def _layer_rows(results: list[ModelResult]) -> Rows:
    from isotui.store.export import layer_csv_rows

    return layer_csv_rows(results)


def _layer_payload(results: list[ModelResult]) -> Payload:
    return {"results": [r.to_json() for r in results]}


def _layer_decode(payload: Payload, arrays: Arrays) -> ModelResult:
    return ModelResult.from_json(payload, arrays)


EXPERIMENT: Experiment[RunSpec, LayersParams, LayersRequest, ModelResult] = Experiment(
    name="layers",
    help="measure layer-wise anisotropy of one or more models",
    request_type=LayersRequest,
    result_type=ModelResult,
    folder="runs",
    schema=SCHEMA_VERSION,
    make_request=lambda spec, params: LayersRequest(spec, save_sample=getattr(params, "save_sample", None)),
    rows=_layer_rows,
    payload=_layer_payload,
    params=LayersParams,
    decode=_layer_decode,
    command="run",
    plan=plans.layers,
    run_options=(MODEL, LAYER_METRICS, RESERVOIR, SHARD),
)
