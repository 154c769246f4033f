"""One pass of a model over a corpus, the layer run's and every streaming experiment's: the spec
resolved and keyed before any model loads (:class:`Prepared`), the model loaded where the plan
puts it, the extraction run, and its result built into the layer table; read from and kept in
the runs' cache. Below the layer run (experiments/layerwise.py, which adds the cache-first
measure with its shards and half-precision check), the shards and every experiment that feeds
batches, none of which it imports."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from isotui.core.accumulator import LayerStats
from isotui.core.null import null_cos_quantile
from isotui.core.plugin import StreamingMetric
from isotui.data.sources import fingerprint
from isotui.data.stream import open_samples
from isotui.errors import IsotuiError, NoHeadError
from isotui.experiments.base import Notice, ignore_notice
from isotui.experiments.cached import keep, key_hash
from isotui.experiments.cached import lookup as lookup_entry
from isotui.experiments.cached import read as read_entry
from isotui.extract.device import needs_device_for_dtype, resolve_device, resolve_dtype
from isotui.extract.modules import has_wildcard
from isotui.extract.progress import ProgressCallback, StopCheck, never_stop, no_progress
from isotui.models.naming import parse_model
from isotui.results import ROGUE_TOP, SCHEMA_VERSION, SE_FIELDS, LayerRow, ModelResult, drift_of
from isotui.spec import RunSpec
from isotui.store.cache import ResultCache
from isotui.version import __version__

if TYPE_CHECKING:
    from isotui.extract.loop import BatchLoop
    from isotui.extract.planning import ExtractOptions
    from isotui.extract.runner import Extraction, LayerStream
    from isotui.models.loading import LoadedModel


@dataclass(frozen=True)
class Prepared:
    """What is known before any model is loaded: enough to look the result up in the cache."""

    spec: RunSpec
    key: str
    samples: Sequence[str]
    model_fingerprint: str
    data_fingerprint: str
    dtype: str
    device: str | None
    max_length: int | None = None  # resolved (text), None when only loading can tell
    legacy_keys: tuple[str, ...] = ()  # older keys of the same computation, still read
    # the plug-in metrics in force (isotui.plugins), by name: their names and versions are in the key
    metrics: tuple[StreamingMetric, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        """Every key this computation may be cached under: the current one first."""
        return (self.key, *self.legacy_keys)


def run_key(key_fields: Mapping[str, object]) -> str:
    """The hash of a run's resolved settings."""
    return key_hash(key_fields)


def prepare(spec: RunSpec, cache: ResultCache | None = None) -> Prepared:
    """Resolve names, data, dtype and max length and derive the cache key, importing torch only
    if needed.

    The key hashes resolved values, so one computation has one key: the max length a run will
    use (``--max-length 512`` on MiniLM is the default run), the dtype it will run in, never
    the device. Entries written before the max length was resolved hashed the requested one
    (None for a default run); that key is kept in ``legacy_keys`` and still read.
    ``cache``: where local weights' content digests are remembered (None: hash them anew); a
    model object's weights are hashed only with a cache (None: no cache, no hash).
    A streamed corpus (``--stream``) is read once here to hash it, so its key is the plain run's.
    """
    from isotui.models.limits import declared_default_length
    from isotui.plugins import in_force

    metrics = in_force()  # a plug-in that fails to load or clashes is refused before any work
    given = spec.given  # a model object (isotui.models.given): keyed by its weights, run where it is
    ref = None if given is not None else parse_model(spec.model)
    if ref is not None:
        model_fp = ref.fingerprint(cache.root if cache else None)
    else:  # an object: its weights hashed only for a cache to keep the result under
        model_fp = given.fingerprint() if cache is not None else given.unhashed()
    samples = open_samples(spec.data, spec.max_samples, spec.max_length, stream=spec.stream)
    data_fp = fingerprint(samples, spec.data)
    declared = None if ref is None else ref.declared_dtype()
    device = None
    if given is not None:
        device = given.device
    elif spec.device != "auto":
        device = spec.device
    elif needs_device_for_dtype(spec.dtype, declared):
        device = resolve_device("auto")
    dtype = (
        given.dtype
        if given is not None
        else resolve_dtype(spec.dtype, device.split(":")[0] if device else None, declared)
    )
    text = spec.data.modality == "text"
    default = None
    if text and ref is not None:
        default = declared_default_length(ref)
    elif text and given.modality == "text":  # the length the run resolves (extract/planning.py)
        from isotui.extract.planning import resolve_max_length

        default = resolve_max_length(given.loaded(), None, spec.model)
    max_length = spec.max_length if text else None
    if text and default is not None and (max_length is None or max_length <= default):
        max_length = max_length or default  # a longer request is refused when the model loads
    key_fields = {
        "schema": SCHEMA_VERSION,
        "model": model_fp,
        "data": data_fp,
        "max_length": max_length,  # text only
        "special_tokens": spec.special_tokens,
        "dtype": dtype,
        "seed": spec.seed,
        "reservoir": spec.reservoir,
        **({"map_units": spec.map_units} if spec.data.modality == "image" else {}),
        **({"tokenizer": spec.tokenizer} if spec.tokenizer else {}),  # only when given: old keys hold
        **({"exact": True} if spec.exact else {}),  # off: the keys of earlier runs stay valid
        **({"modules": list(spec.modules)} if spec.modules else {}),  # likewise
        # a pattern's matches follow the glob rule (issue 38: * within one dotted name): entries of
        # patterns read under fnmatch's rule are not answered for them; names and sites keep keys
        **({"glob_rule": "segment"} if any(has_wildcard(g) for g in spec.modules or ()) else {}),
        **({"metrics": [[m.name, m.version] for m in metrics]} if metrics else {}),  # plug-ins in force
    }
    key = run_key(key_fields)
    legacy: tuple[str, ...] = ()
    if default is not None and max_length == default:  # a default run hashed None before
        legacy = (run_key({**key_fields, "max_length": None}),)
    return Prepared(spec, key, samples, model_fp, data_fp, dtype, device, max_length, legacy, metrics)


def read(cache: ResultCache, key: str) -> ModelResult | None:
    """The layer run cached under ``key``, None if absent; CacheProblem if it cannot be used."""
    found: ModelResult | None = read_entry(cache, key, ModelResult.from_json)
    return found


def lookup(
    prepared: Prepared, cache: ResultCache | None, on_notice: Notice = ignore_notice
) -> ModelResult | None:
    """The cached result for ``prepared``, or None; a damaged entry is reported and ignored."""
    hit: ModelResult | None = lookup_entry(cache, prepared.keys, ModelResult.from_json, on_notice)
    if hit is not None:  # same key: same numbers; the names are the ones asked for now
        hit.model = prepared.spec.model
        for row in hit.rows:
            row.model = prepared.spec.model
        hit.meta["data"] = prepared.spec.data.describe()  # e.g. a copied folder of the same files
        hit.from_cache = True
    return hit


def store(result: ModelResult, cache: ResultCache | None, on_notice: Notice = ignore_notice) -> None:
    """Cache ``result``; a cache that cannot be written is reported, never fatal."""
    keep(cache, result.key, result.to_json(), result.arrays, on_notice)


def weights_size(spec: RunSpec) -> str:
    """The model's weight files on disk (``90.9 MB``), or what is known without them."""
    if spec.given is not None:
        return f"{spec.given.weights_bytes / 1e6:.1f} MB in memory"
    ref = parse_model(spec.model)
    if ref.kind == "random":
        return "untrained, built from its config"
    try:
        folder = ref.local_dir()
    except Exception:
        folder = None
    if folder is None:
        return ""
    suffixes = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and f.name.endswith(suffixes))
    return f"{size / 1e6:.1f} MB" if size else ""


def extract_options(spec: RunSpec, metrics: tuple[StreamingMetric, ...] = ()) -> ExtractOptions:
    """The extraction options a run's spec asks for (every experiment that feeds batches);
    ``metrics``: the plug-in metrics the layers stream (the layer run's, :attr:`Prepared.metrics`)."""
    from isotui.extract.runner import ExtractOptions

    return ExtractOptions(
        max_length=spec.max_length,
        special_tokens=spec.special_tokens,
        batch_size=spec.batch_size,
        seed=spec.seed,
        reservoir=spec.reservoir,
        map_units=spec.map_units,
        cap_max_length=spec.cap_max_length,
        exact=spec.exact,
        max_memory=spec.max_memory,
        modules=spec.modules,
        metrics=metrics,
    )


def text_stream(
    prepared: Prepared,
    loaded: LoadedModel,
    device: str,
    make: Callable[[BatchLoop], LayerStream],
    *,
    on_progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
    sample_ids: tuple[int, ...] | None = None,
) -> LayerStream:
    """One pass of a text model over the prepared corpus on the measurement layer, as every
    experiment beside the layer run opens it: the loop (batches, devices, back-off, progress,
    the samples ``sample_ids`` of a shard, None: all), the stream ``make`` builds on it (its
    sites and folds), and the samples tokenised at the run's max length (one convention: the
    app's a ceiling, a shorter model run at its own limit)."""
    import dataclasses

    from isotui.extract.loop import BatchLoop
    from isotui.extract.planning import effective_max_length

    spec = prepared.spec
    opts = dataclasses.replace(extract_options(spec), sample_ids=sample_ids)
    stream = make(BatchLoop(loaded, device, opts, on_progress, should_stop))
    # a capped ceiling said once, as the layer run says it (the app shows it as a notice)
    length = effective_max_length(loaded, opts, spec.model, on_progress or no_progress)
    stream.prepare(prepared.samples, "text", length)
    return stream


def load_prepared(prepared: Prepared, head: str | None = None) -> tuple[LoadedModel, str]:
    """(loaded model, device) for a prepared run: the device resolved, the run's dtype, seed and
    CPU threads (``--threads``: torch's, for the rest of the process);
    ``head`` goes to :func:`~isotui.models.loading.load_model` (``"lm"``: the language-model head)."""
    from isotui.extract.heap import HELD_NOTE, hold_heap_to_live_bytes, paused_gc
    from isotui.extract.threads import apply_threads
    from isotui.models.loading import load_model

    spec = prepared.spec
    if spec.given is not None:  # a model object: the same object, where it sits (models/given.py)
        return _given_loaded(spec, head)
    with paused_gc():  # torch, transformers and the model: no collection while they are made
        device = "cpu" if spec.device_map else resolve_device(prepared.device or "auto")
        threads_note = apply_threads(spec.threads)  # every streaming experiment loads through here
        handed = placement_memory(spec, prepared.dtype, head)
        # the CPU's bound holds resident memory too (the CLI asked already, before the imports)
        held = "cpu" in dict(handed or ()) and hold_heap_to_live_bytes()
        loaded = load_model(
            parse_model(spec.model),
            device=device,
            dtype=prepared.dtype,
            seed=spec.seed,
            trust_remote_code=spec.trust_remote_code,
            tokenizer=spec.tokenizer,
            head=head,
            device_map=spec.device_map,
            max_memory=handed,
        )
    if threads_note:
        loaded.notes.append(threads_note)
    if held:
        loaded.notes.append(HELD_NOTE)
    if loaded.device_map is not None:  # inputs go where accelerate runs the model first
        from isotui.extract.memory_plan import device_summary, execution_device

        device = execution_device(loaded.device_map)
        loaded.notes.append(f"--device-map {spec.device_map}: {device_summary(loaded.device_map)}")
    return loaded, device


def _given_loaded(spec: RunSpec, head: str | None) -> tuple[LoadedModel, str]:
    """(the model object as a loaded model, its device): nothing loaded, copied or moved; an
    experiment that needs a language-model head (``head="lm"``) refuses an object without one."""
    from isotui.extract.threads import apply_threads
    from isotui.models.given import describe

    given = spec.given
    if head == "lm" and (
        given.family != "transformers"
        or getattr(given.model, "get_output_embeddings", lambda: None)() is None
    ):
        raise NoHeadError(
            f"model {spec.model!r} ({type(given.model).__name__}) has no language-model head: give the "
            "AutoModelForMaskedLM or AutoModelForCausalLM object"
        )
    loaded = given.loaded()
    loaded.notes.insert(0, describe(given))
    if threads_note := apply_threads(spec.threads, interop=False):  # GivenModel.kept restores them
        loaded.notes.append(threads_note)
    return loaded, given.device


def placement_memory(
    spec: RunSpec, dtype: str, head: str | None = None
) -> tuple[tuple[int | str, int], ...] | None:
    """``--max-memory`` as accelerate gets it: less isotui's sums at the floor and the first
    batch's workspace on the devices that hold them (:func:`~isotui.extract.memory_plan.placement_memory`,
    as the dry run places the model), so weights, sums and workspace stay within what was typed."""
    from isotui.extract import memory_plan
    from isotui.models.loading import model_config

    if not spec.max_memory or not spec.device_map:
        return spec.max_memory
    try:
        config = model_config(parse_model(spec.model), spec.trust_remote_code)
    except IsotuiError:  # a timm model: no transformers config, placed under what was given
        return spec.max_memory
    given = dict(spec.max_memory)
    planned = isinstance(getattr(config, "num_hidden_layers", None), int) and not getattr(
        config, "is_encoder_decoder", False
    )
    if "cpu" in given and planned:  # placed on paper as the dry run places it: what offloading
        # adds on the CPU comes out of the weights' share, not the sums'
        model = memory_plan.meta_model(
            config, spec.model, head=head, dtype=dtype, trust_remote_code=spec.trust_remote_code
        )
        _, handed = memory_plan.place_under(
            model,
            config,
            given,
            spec.device_map,
            dtype=dtype,
            batch_size=spec.batch_size,
            max_length=spec.max_length,
            reservoir=spec.reservoir,
            built=parse_model(spec.model).kind == "random",
        )
    else:
        handed = memory_plan.placement_memory(
            config,
            given,
            dtype=dtype,
            batch_size=spec.batch_size,
            max_length=spec.max_length,
            reservoir=spec.reservoir,
        )
    return tuple(handed.items()) if handed else None


def compute(
    prepared: Prepared,
    *,
    on_progress: ProgressCallback = no_progress,
    should_stop: StopCheck = never_stop,
    keep_sample: bool = False,
) -> ModelResult:
    """Load the model, run the extraction and build the table (``keep_sample``: with each
    layer's reservoir sample, ``result.sample``)."""
    from isotui.extract.progress import Progress
    from isotui.extract.runner import extract

    spec = prepared.spec
    n = len(prepared.samples)
    on_progress(Progress(0, n, 0, 0.0, stage="prepare", phase="loading", detail=weights_size(spec)))
    started = time.perf_counter()
    loaded, device = load_prepared(prepared)
    load_s = time.perf_counter() - started
    opts = extract_options(spec, prepared.metrics)
    opts.keep_sample = keep_sample
    ex = extract(
        loaded,
        prepared.samples,
        device=device,
        opts=opts,
        on_progress=on_progress,
        should_stop=should_stop,
        model_name=spec.model,
        modality=spec.data.modality,
    )
    result = build_result(prepared, ex, loaded_facts(loaded, device, load_s))
    result.sample = ex.sample
    return result


class LoadFacts(TypedDict):
    """What :func:`loaded_facts` says of a loaded model."""

    model_class: str
    modality: str
    device: str
    load_s: float
    threads: int
    notes: list[str]
    versions: dict[str, str]


def loaded_facts(loaded: LoadedModel, device: str, load_s: float) -> LoadFacts:
    """What the table's metadata says about the loaded model (JSON: a shard keeps it with its
    partial state, so that the merged table says what a one-process run's says)."""
    import torch

    return {
        "model_class": type(loaded.model).__name__,
        "modality": loaded.modality,
        "device": device,
        "load_s": load_s,
        "threads": torch.get_num_threads(),  # how fast, not what: not in the key
        "notes": list(loaded.notes),
        "versions": {
            "isotui": __version__,
            "torch": str(torch.__version__),  # a plain str: results unpickle without torch
            "transformers": metadata.version("transformers"),
            **({"timm": metadata.version("timm")} if loaded.family == "timm" else {}),
        },
    }


def build_result(prepared: Prepared, ex: Extraction, facts: LoadFacts) -> ModelResult:
    """The layer table of an extraction (one pass, or merged shards) and the loaded model's
    ``facts`` (:func:`loaded_facts`)."""
    spec = prepared.spec
    rows: list[LayerRow] = []
    for component, layers in ex.components.items():
        part = build_rows(
            spec.model, component, layers, final_norm=ex.final_norm.get(component, False), modules=ex.modules
        )
        rows.extend(part)
    drift, drift_notes = drift_of(rows)
    notes: list[str] = []
    if ex.modules:
        asked = " ".join(f"--modules {g}" for g in spec.modules or ())
        notes.append(
            f"{asked}: the rows are the outputs of {len(ex.modules)} modules in the order they ran, "
            f"{ex.modules[0]} (layer 0) to {ex.modules[-1]} (layer {len(ex.modules) - 1}); the CSV's "
            "module column names each"
        )
    notes += drift_notes  # duplicate rows left out, module kinds apart, the joined view (T5)
    meta = {
        "data": spec.data.describe(),
        "data_fingerprint": prepared.data_fingerprint,
        "model_fingerprint": prepared.model_fingerprint,
        "model_class": facts["model_class"],
        "modality": facts["modality"],
        "map_units": ex.map_units,
        **({"map_shapes": ex.map_shapes} if ex.map_shapes else {}),  # names rogue dims of flattened maps
        "audio_seconds": ex.audio_seconds,
        "n_samples": ex.n_samples,
        "n_tokens": ex.n_tokens,
        "max_length": ex.max_length or None,
        "special_tokens": spec.special_tokens,
        "dtype": prepared.dtype,
        "device": facts["device"],
        "seed": spec.seed,
        "reservoir": spec.reservoir,
        "exact": spec.exact,
        **({"modules": list(spec.modules)} if spec.modules else {}),  # in the key when given
        **({"metrics": {m.name: m.version for m in prepared.metrics}} if prepared.metrics else {}),
        **({"tokenizer": spec.tokenizer} if spec.tokenizer else {}),  # in the key when given
        "threads": facts.get("threads"),  # how fast, not what: not in the key
        "final_norm_module": ex.final_norm_module,
        "seconds": round(ex.seconds, 3),
        "timings": {"load_s": round(facts["load_s"], 3), **{k: round(v, 3) for k, v in ex.timings.items()}},
        "notes": facts["notes"] + ex.notes + list(getattr(prepared.samples, "notes", [])) + notes,
        **({"memory_plan": ex.memory_plan} if ex.memory_plan else {}),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": facts["versions"],
    }
    arrays = _stack_arrays(ex.layers)
    return ModelResult(spec.model, prepared.key, rows, drift, meta, arrays)


ARRAY_LIMIT = 1 << 16  # per-layer vectors longer than this (flattened conv maps) are cut


def _stack_arrays(layers: list[LayerStats]) -> dict[str, np.ndarray]:
    """Per-layer vectors for the cache: rogue-dimension contributions (skipped for layers of more
    than 65,536 dims, where they would make the file hundreds of MB) and the leading eigenvalues."""
    out = {}
    for i, layer in enumerate(layers):
        if layer.dim <= ARRAY_LIMIT:
            out[f"dim_contrib.{i}"] = np.asarray(layer.dim_contrib, dtype=np.float64)
        out[f"eigenvalues.{i}"] = np.asarray(layer.eigenvalues[:ARRAY_LIMIT], dtype=np.float64)
    return out


def _share(share: float) -> str:
    """A rogue dimension's share of avg_cos: four decimals, or three significant digits when that
    would read 0.0000 (a flattened conv map's ~10^5 dimensions carry ~1e-5 each)."""
    return f"{share:.4f}" if share == 0 or abs(share) >= 1e-3 else f"{share:.3e}"


def build_rows(
    model: str,
    component: str,
    layers: list[LayerStats],
    *,
    final_norm: bool,
    modules: list[str] | None = None,
) -> list[LayerRow]:
    """Per-layer rows with the isotropic null and the top rogue dimensions; ``modules``: each
    row's module (``--modules``)."""
    rows = []
    last = len(layers) - 1
    for i, s in enumerate(layers):
        p95 = null_cos_quantile(s.dim) if s.dim >= 2 else math.nan
        contrib = s.dim_contrib
        if np.all(np.isfinite(contrib)) and s.avg_cos and math.isfinite(s.avg_cos):
            top = np.argsort(-contrib)[:ROGUE_TOP]
            shares = [float(contrib[k] / s.avg_cos) for k in top]
            rogue = "|".join(f"{int(k)}:{_share(sh)}" for k, sh in zip(top, shares, strict=True))
            top_dim, top_share = int(top[0]), shares[0]
        else:
            rogue, top_dim, top_share = "", -1, math.nan
        rows.append(
            LayerRow(
                model=model,
                component=component,
                layer=i,
                n_vectors=s.n_vectors,
                avg_cos=s.avg_cos,
                drift_norm=s.drift_norm,
                mean_norm=s.mean_norm,
                avg_cos_xctx=s.avg_cos_xctx,
                avg_cos_centered=s.avg_cos_centered,
                isoscore=s.isoscore,
                eff_rank=s.eff_rank,
                top_pc_share=s.top_pc_share,
                null_p95=p95,
                above_null=bool(s.avg_cos > p95) if math.isfinite(s.avg_cos) else False,
                top_rogue_dim=top_dim,
                top_rogue_share=top_share,
                rogue_dims=rogue,
                final_norm=bool(final_norm and i == last),
                depth=i / last if last > 0 else 0.0,
                dim=s.dim,
                n_zero=s.n_zero,
                n_sample=s.n_sample,
                spectrum_from=s.spectrum_from,
                isoscore_star=s.isoscore_star,
                iw=s.iw,
                iw_centered=s.iw_centered,
                avg_cos_abtt=s.avg_cos_abtt,
                avg_cos_std=s.avg_cos_std,
                avg_cos_types=s.avg_cos_types,
                drift_norm_types=s.drift_norm_types,
                intra_sim=s.intra_sim,
                self_sim=s.self_sim,
                self_sim_types=s.self_sim_types,
                **{f: getattr(s, f) for f in SE_FIELDS},
                module=modules[i] if modules else "",
                extra=dict(s.plugins),
            )
        )
    return rows
