"""Push samples through a model in length-sorted batches and stream hidden states into accumulators.

Nothing here keeps hidden states beyond one batch: memory is set by the batch, the layer count
and d, never by the corpus size. Any modality (see :mod:`isotui.extract.inputs`); a layer is a
(B, T, D) sequence (positions are the units), a (B, C, H, W) map (units: each image flattened to
one C*H*W vector, the view of Godey et al. Fig. 4, or each spatial position's C channels), or a
(B, D) vector. Encoder-decoder models give two components, ``encoder`` and ``decoder``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from isotui.core.accumulator import LayerAccumulator, LayerStats, sample_keys
from isotui.core.sampled import EIGEN_JACKKNIFE_MAX_DIM, SE_GROUPS, ExactPass
from isotui.errors import Cancelled, IsotuiError
from isotui.extract.device import memory_in_use
from isotui.extract.heap import TRIM_EVERY, release_free_memory
from isotui.extract.inputs import make_feeder
from isotui.extract.progress import Progress, ProgressCallback, StopCheck, never_stop, no_progress
from isotui.models.limits import config_position_limit, default_length, tokenizer_limit
from isotui.models.loading import LoadedModel, final_norm_modules

TOKEN_BUDGET = {"cpu": 4096, "mps": 8192, "cuda": 32768}
COV_BUDGET_BYTES = 1 << 30  # exact streamed covariance while all layers' d x d fit in 1 GiB
RESERVOIR_BUDGET_BYTES = 1 << 30  # all layers' reservoirs together (float32): caps huge-d layers
SELF_SIM_TYPES = 1000  # token types followed for self-similarity (the most frequent ones)
SELF_SIM_BUDGET_BYTES = 256 << 20  # their float64 sums, all layers together
TOKEN_MAP_TYPES = ("segformer",)  # transformers whose stages are token grids, not conv maps


@dataclass
class ExtractOptions:
    max_length: int | None = None
    special_tokens: str = "exclude"
    batch_size: int | None = None
    seed: int = 0
    reservoir: int = 4096
    map_units: str = "auto"
    cap_max_length: bool = False  # see RunSpec.cap_max_length
    # a shard: measure only these samples (indices into the whole corpus, which still sets the
    # reservoir keys, masks, type weights and tracked types); None: every sample
    sample_ids: tuple[int, ...] | None = None
    exact: bool = False  # a second pass: the reservoir metrics over every vector


@dataclass
class Extraction:
    """Per-layer statistics per component (``model``, or ``encoder`` and ``decoder``) plus what
    the table must say about how they were made."""

    components: dict[str, list[LayerStats]]
    final_norm: dict[str, bool]
    final_norm_module: str | None
    n_samples: int
    n_tokens: int
    max_length: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    map_units: str | None = None
    audio_seconds: float | None = None
    timings: dict[str, float] = field(default_factory=dict)  # tokenise/forward/metrics/finalise s

    @property
    def layers(self) -> list[LayerStats]:
        """All layers in component order (encoder then decoder: the concatenated view)."""
        return [s for stats in self.components.values() for s in stats]


def position_limit(loaded: LoadedModel) -> int | None:
    """How many positions the model's embeddings have, when its config says so."""
    return config_position_limit(loaded.model.config)


def _special_count(tokenizer: Any) -> int:
    try:
        return int(tokenizer.num_special_tokens_to_add())
    except Exception:
        return 0


def resolve_max_length(
    loaded: LoadedModel, requested: int | None, model_name: str, *, cap: bool = False
) -> int:
    """``requested`` if the model can take it, else the model's and tokenizer's limit (<= 512).
    With ``cap`` a ``requested`` above the model's limit becomes the limit (the app's ceiling)
    instead of an error. Images and audio have no token length: 0."""
    if loaded.modality != "text":
        return 0
    limit = position_limit(loaded)
    special = _special_count(loaded.tokenizer)
    if requested is not None and requested <= special:
        raise IsotuiError(
            f"max-length {requested} leaves no room for text: the tokenizer of {model_name!r} adds "
            f"{special} special tokens; use --max-length {special + 1} or more"
        )
    if requested is not None:
        if cap and limit is not None and requested > limit:
            return limit
        if limit is not None and requested > limit:
            raise IsotuiError(
                f"max-length {requested} is longer than model {model_name!r} accepts "
                f"({limit} positions); use --max-length {limit} or less"
            )
        return requested
    return default_length(limit, tokenizer_limit(getattr(loaded.tokenizer, "model_max_length", None)))


def effective_max_length(
    loaded: LoadedModel, opts: ExtractOptions, model_name: str, on_progress: ProgressCallback
) -> int:
    """The max length a run uses (:func:`resolve_max_length`); a capped ceiling is said once
    through ``on_progress`` (the app shows it as a notice)."""
    length = resolve_max_length(loaded, opts.max_length, model_name, cap=opts.cap_max_length)
    if opts.max_length is not None and 0 < length < opts.max_length:
        on_progress(
            Progress(
                0,
                0,
                0,
                0.0,
                message=f"max length {opts.max_length} is more than {model_name!r} accepts: "
                f"capped at its {length} positions",
                stage="notice",
            )
        )
    return length


def _frequent_types(ids: np.ndarray, kept: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """token id -> slot 0, 1, ... for the types seen in at least two samples, most frequent
    first (ties: smaller id); -1 for the others (Ethayarajh's self-similarity needs contexts)."""
    sample = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))[kept]
    kid = ids[kept]
    size = int(kid.max()) + 1 if len(kid) else 1
    counts = np.bincount(kid, minlength=size)
    pairs = np.unique(kid.astype(np.int64) * (len(offsets)) + sample)
    contexts = np.bincount(pairs // len(offsets), minlength=size)
    eligible = np.flatnonzero(contexts >= 2)
    order = eligible[np.lexsort((eligible, -counts[eligible]))]
    slots = np.full(size, -1, dtype=np.int64)
    slots[order] = np.arange(len(order))
    return slots


def _inverse_counts(ids: np.ndarray) -> np.ndarray:
    """id -> 1 / count of that id in ``ids`` (0 for ids that never occur)."""
    counts = np.bincount(ids).astype(np.float64) if len(ids) else np.zeros(1)
    with np.errstate(divide="ignore"):
        return np.where(counts > 0, 1.0 / counts, 0.0)


def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class _Runner:
    def __init__(
        self,
        loaded: LoadedModel,
        device: str,
        opts: ExtractOptions,
        on_progress: ProgressCallback,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = device
        self.opts = opts
        self.on_progress = on_progress
        self.feeder = None
        self.type_weights: dict[str, np.ndarray] = {}
        self.tracked: np.ndarray | None = None  # token id -> self-similarity slot (-1: none)
        self.n_tracked = 0
        self.accs: dict[str, list[LayerAccumulator]] | None = None
        self.second: dict[str, list[ExactPass]] | None = None  # --exact's second pass, when on
        self.final_norm: dict[str, bool] = {}
        self.final_norm_names: list[str] = []
        self.notes: list[str] = []
        self.token_budget = TOKEN_BUDGET.get(device.split(":")[0], 4096)
        self.batch_cap: int | None = opts.batch_size
        self.map_units = self._map_units()
        self.saw_maps = False  # whether any layer was a (B, C, H, W) map
        self.reservoir_capped = False
        self.max_dim = 0
        self.dtype = next((p.dtype for p in self.model.parameters()), None)
        self.forward_s = 0.0  # feeding and forward passes
        self.metrics_s = 0.0  # folding each batch into the accumulators

    def _map_units(self) -> str:
        """``image`` (one flattened vector per image) for conv maps; ``position`` for token grids."""
        if self.opts.map_units != "auto":
            return self.opts.map_units
        if self.loaded.model_type in TOKEN_MAP_TYPES or hasattr(self.model, "num_prefix_tokens"):
            return "position"
        return "image"

    def _accepts(self, name: str) -> bool:
        import inspect

        params = inspect.signature(self.model.forward).parameters
        return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

    def prepare(self, samples: list[str], modality: str, max_length: int) -> None:
        self.feeder = make_feeder(self.loaded, samples, modality, max_length, self._accepts)
        self.type_weights = self._type_weights()

    def _type_weights(self) -> dict[str, np.ndarray]:
        """Per component, token id -> 1 / (how many kept tokens of the corpus have that id): the
        weights of the type-uniform view. Text only; the decoder of an encoder-decoder sees the
        text shifted right (a start token, then every token but the last)."""
        tokens = getattr(self.feeder, "tokens", None)
        if tokens is None or not len(tokens.ids):
            return {}
        include = self.opts.special_tokens == "include"
        ids = tokens.ids.astype(np.int64)
        kept = np.ones(len(ids), bool) if include else ~tokens.special
        tables = {"model": _inverse_counts(ids[kept])}
        self.tracked = _frequent_types(ids, kept, tokens.offsets)
        if getattr(self.feeder, "enc_dec", False):
            last = np.zeros(len(ids), bool)
            last[tokens.offsets[1:] - 1] = True
            dec = ids[kept & ~last]
            if include:  # the start token is special: counted only when specials are
                config = self.model.config
                start = getattr(config, "decoder_start_token_id", None)
                start = start if isinstance(start, int) else (config.pad_token_id or 0)
                dec = np.concatenate([dec, np.full(len(tokens.offsets) - 1, start)])
            tables = {"encoder": tables["model"], "decoder": _inverse_counts(dec)}
        return tables

    def batches(self, lengths: Sequence[int]) -> Iterator[list[int]]:
        """Sample indices, longest first, cut by batch size or by token budget (auto).

        A generator, so that a back-off after running out of memory shrinks later batches too.
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        same = getattr(self.feeder, "same_length_key", None)  # only equal inputs share a batch
        chosen = np.asarray(self.selected(len(lengths)), dtype=np.int64)
        sub = lengths[chosen]
        keys = (-sub,) if same is None else (-np.asarray(same, dtype=np.int64)[chosen], -sub)
        order = chosen[np.lexsort(keys)]  # stable: longest first, then by key, then in sample order
        pos = 0
        while pos < len(order):
            width = max(int(lengths[order[pos]]), 1)
            cap = self.batch_cap or max(1, self.token_budget // width)
            batch = order[pos : pos + cap].tolist()
            if same is not None:  # equal keys sit next to each other in this order
                batch = [i for i in batch if same[i] == same[batch[0]]]
            yield batch
            pos += len(batch)

    def selected(self, n: int) -> list[int]:
        """The sample indices this run measures: all ``n``, or the shard of ``opts.sample_ids``."""
        if self.opts.sample_ids is None:
            return list(range(n))
        ids = sorted(set(self.opts.sample_ids))
        if ids and (ids[0] < 0 or ids[-1] >= n):
            raise IsotuiError(f"sample ids must lie in 0..{n - 1} (the corpus has {n} samples)")
        return ids

    def _forward(self, inputs: dict[str, Any]) -> dict[str, tuple]:
        """Hidden states per component."""
        if self.loaded.family == "timm":
            feats = self.model.forward_intermediates(inputs["pixel_values"], intermediates_only=True)
            return {"model": tuple(feats)}
        if self.loaded.family == "timm-features":  # a features_only model returns its stages
            return {"model": tuple(self.model(inputs["pixel_values"]))}
        if self.loaded.family == "timm-blocks":
            return {"model": self._timm_blocks(inputs["pixel_values"])}
        out = self.model(**inputs, output_hidden_states=True, return_dict=True)
        enc, dec = getattr(out, "encoder_hidden_states", None), getattr(out, "decoder_hidden_states", None)
        if enc and dec:
            return {"encoder": tuple(enc), "decoder": tuple(dec)}
        hidden = getattr(out, "hidden_states", None)
        if not hidden:
            raise IsotuiError(
                f"model {type(self.model).__name__} returned no hidden states; isotui needs a model "
                "whose forward accepts output_hidden_states=True"
            )
        return {"model": tuple(hidden)}

    def _timm_blocks(self, pixels) -> tuple:
        """A timm ViT's token sequences, prefix tokens included: the input of its first block
        (patch and position embeddings, as a transformers model's layer 0), then every block's
        output. timm's forward_intermediates would drop the prefix tokens and the embeddings."""
        blocks = list(self.model.blocks)
        seen: list = []
        handles = [blocks[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))]
        handles += [b.register_forward_hook(lambda _m, _i, out: seen.append(out)) for b in blocks]
        try:
            self.model.forward_features(pixels)
        finally:
            for handle in handles:
                handle.remove()
        return tuple(seen)

    def run_batch(self, idx: list[int]) -> int:
        """Forward one batch and fold it in; returns its number of real input units."""
        import torch

        assert self.feeder is not None
        started = time.perf_counter()
        fed = self.feeder.feed(idx)
        inputs = self.device_inputs(fed)
        hook_out: dict[str, Any] = {}
        handles = []
        if self.accs is None:  # first batch: which final norm, if any, made the last hidden state
            for name, module in final_norm_modules(self.model):
                hook = (lambda key: lambda _m, _i, o: hook_out.__setitem__(key, o))(name)
                handles.append(module.register_forward_hook(hook))
        try:
            with torch.inference_mode():
                components = self._forward(inputs)
        except IsotuiError:
            raise
        except Exception as exc:
            raise self.batch_failure(exc, f"a batch of {self.loaded.modality}") from None
        finally:
            for handle in handles:
                handle.remove()
        forwarded = time.perf_counter()
        self.forward_s += forwarded - started
        if self.accs is None:
            self._first_batch(components, hook_out)
        assert self.accs is not None
        ids = torch.tensor(idx, dtype=torch.long)
        acc_device = next(iter(self.accs.values()))[0].device  # the CPU when the model is on MPS
        index: dict[tuple, tuple] = {}  # layers of one shape share their units' index and keys
        partials = []
        with torch.inference_mode():
            targets = self.second if self.second is not None else self.accs
            for component, hidden in components.items():
                for acc, h in zip(targets[component], hidden, strict=True):
                    shape = (component, *h.shape[1:]) if h.ndim == 3 else (h.ndim, *h.shape[2:])
                    if shape not in index:
                        flat, local, positions = self._index(fed, component, h)
                        keys = sample_keys(self.opts.seed, ids[local], positions).to(acc_device)
                        weights, types = self._weights(fed, component, h, flat)
                        index[shape] = (flat, local.to(acc_device), keys, weights, types)
                    flat, local, keys, weights, types = index[shape]
                    vectors = self._vectors(h, flat)
                    partials.append((acc, acc.partial(vectors, local, keys, weights, types)))
            for acc, p in partials:  # only now: all or nothing
                acc.commit(p)
        self.metrics_s += time.perf_counter() - forwarded
        if fed.valid is not None:
            return int(fed.valid.sum())
        return len(idx)

    def device_inputs(self, fed) -> dict[str, Any]:
        """A fed batch on the model's device, floating inputs in the model's dtype."""
        inputs = {}
        for name, value in fed.inputs.items():
            if value.is_floating_point() and self.dtype is not None:
                value = value.to(self.dtype)
            inputs[name] = value.to(self.device)
        return inputs

    def batch_failure(self, exc: Exception, what: str) -> Exception:
        """The exception to raise for a failed forward pass: out of memory as it is (the caller
        backs off), anything else as one sentence naming the model and ``what`` it was fed."""
        if _is_oom(exc):
            return exc
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        return IsotuiError(
            f"model {type(self.model).__name__} failed on {what} ({type(exc).__name__}: {first})"
        )

    def _index(self, fed, component: str, h):
        """Which units of a layer are kept (``flat`` rows of its sequence, None: all units), and
        each unit's sample (0..B-1) and position."""
        import torch

        b = h.shape[0]
        if h.ndim == 2 or (h.ndim == 4 and self.map_units == "image"):
            return None, torch.arange(b), torch.zeros(b, dtype=torch.long)
        if h.ndim == 4:
            hw = h.shape[2] * h.shape[3]
            return None, torch.arange(b).repeat_interleave(hw), torch.arange(hw).repeat(b)
        width = h.shape[1]
        valid, special = self.feeder.mask(fed, component, width)
        keep = valid if self.opts.special_tokens == "include" else valid & ~special
        flat = keep.flatten().nonzero().squeeze(1).to(h.device)
        return flat, flat.cpu() // width, flat.cpu() % width

    def _weights(self, fed, component: str, h, flat):
        """Type-uniform weights and self-similarity slots of a token layer's kept units; (None,
        None) for other layers (maps, CANINE's downsampled molecules: their units are not tokens).
        Self-similarity follows the encoder's (or the single stack's) tokens only."""
        import torch

        table = self.type_weights.get(component)
        key = "decoder_input_ids" if component == "decoder" else "input_ids"
        token_ids = fed.inputs.get(key)
        if table is None or token_ids is None or h.ndim != 3 or h.shape[1] != token_ids.shape[1]:
            return None, None
        picked = token_ids.flatten()[flat.cpu()].numpy()
        inside = picked < len(table)
        w = np.where(inside, table[np.minimum(picked, len(table) - 1)], 0.0)
        slots = None
        if self.tracked is not None and self.n_tracked and component != "decoder":
            ok = picked < len(self.tracked)
            slot = np.where(ok, self.tracked[np.minimum(picked, len(self.tracked) - 1)], -1)
            slots = torch.from_numpy(np.where(slot < self.n_tracked, slot, -1).astype(np.int64))
        return torch.from_numpy(w), slots

    def _vectors(self, h, flat):
        """The layer's unit vectors (m x d), in the order of :meth:`_index`."""
        b = h.shape[0]
        if h.ndim == 2:
            return h
        if h.ndim == 4 and self.map_units == "image":
            return h.reshape(b, -1)
        if h.ndim == 4:
            return h.permute(0, 2, 3, 1).reshape(b * h.shape[2] * h.shape[3], h.shape[1])
        return h.reshape(-1, h.shape[-1]).index_select(0, flat)

    def _unit_dim(self, h) -> int:
        if h.ndim == 4:
            return int(h.shape[1] * h.shape[2] * h.shape[3]) if self.map_units == "image" else int(h.shape[1])
        return int(h.shape[-1])

    def _first_batch(self, components: dict[str, tuple], hook_out: dict[str, Any]) -> None:
        import torch

        dims = {c: [self._unit_dim(h) for h in hidden] for c, hidden in components.items()}
        self.saw_maps = any(h.ndim == 4 for hidden in components.values() for h in hidden)
        all_dims = [d for ds in dims.values() for d in ds]
        full_cov = sum(d * d * 8 for d in all_dims) <= COV_BUDGET_BYTES
        cap = max(2, RESERVOIR_BUDGET_BYTES // (4 * sum(all_dims)))
        reservoir = min(self.opts.reservoir, cap)
        self.reservoir_capped = reservoir < self.opts.reservoir
        self.max_dim = max(all_dims)
        dev = next(iter(components.values()))[0].device
        if dev.type == "mps":  # no float64 on MPS: accumulate on the CPU
            dev = torch.device("cpu")
        if self.tracked is not None:  # as many types as fit the budget, up to SELF_SIM_TYPES
            token_dims = sum(
                h.shape[-1] for c, hidden in components.items() if c != "decoder" for h in hidden
            )
            fit = SELF_SIM_BUDGET_BYTES // max(1, 8 * token_dims)
            self.n_tracked = int(min(SELF_SIM_TYPES, fit, int((self.tracked >= 0).sum())))
        self.accs = {
            c: [
                LayerAccumulator(
                    d,
                    dev,
                    full_cov=full_cov,
                    reservoir=reservoir,
                    types=0 if c == "decoder" else self.n_tracked,
                )
                for d in ds
            ]
            for c, ds in dims.items()
        }
        for component, hidden in components.items():
            last = hidden[-1]
            self.final_norm[component] = False
            for name, out in hook_out.items():
                normed = out[0] if isinstance(out, tuple) else out
                same = isinstance(normed, torch.Tensor) and normed.shape == last.shape
                if same and torch.equal(normed, last):
                    self.final_norm[component] = True
                    self.final_norm_names.append(name)
                    break

    def process(self, idx: list[int]) -> int:
        """``run_batch`` with out-of-memory back-off: halve the batch and retry, say so."""
        try:
            return self.run_batch(idx)
        except Exception as exc:
            if not _is_oom(exc):
                raise
        self._free()
        assert self.feeder is not None
        width = int(np.asarray(self.feeder.lengths)[idx].max())
        if len(idx) == 1:
            raise IsotuiError(
                f"one sample ({self._describe(1, width)}) does not fit in {self.device} memory; "
                + ("lower --max-length or " if self.loaded.modality == "text" else "")
                + "use --dtype bfloat16"
            )
        half = len(idx) // 2
        if self.batch_cap:
            self.batch_cap = half
        else:
            self.token_budget = max(1, half * width)
        message = (
            f"out of memory on a batch of {self._describe(len(idx), width)}; retrying with batches of {half}"
        )
        self.notes.append(message)
        self.on_progress(Progress(0, 0, 0, 0.0, message=message, stage="oom"))
        return self.process(idx[:half]) + self.process(idx[half:])

    def _describe(self, n: int, width: int) -> str:
        if self.loaded.modality == "text":
            return f"{n} x {width} tokens"
        if self.loaded.modality == "image":
            return f"{n} images"
        return f"{n} clips of up to {width * 20 / 1000:.1f} s"

    def _free(self) -> None:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def extract(
    loaded: LoadedModel,
    samples: list[str],
    *,
    device: str,
    opts: ExtractOptions,
    on_progress: ProgressCallback = no_progress,
    should_stop: StopCheck = never_stop,
    model_name: str = "",
    modality: str = "text",
) -> Extraction:
    """Measure every hidden layer of ``loaded`` over ``samples`` (see design.md for metrics)."""
    runner, facts = _stream(loaded, samples, device, opts, on_progress, should_stop, model_name, modality)
    assert runner.accs is not None
    ex = _finish(runner.accs, facts, on_progress, facts.pop("at"), facts.pop("estimate"))
    if opts.exact and any(s.n_sample < s.n_vectors for stats in ex.components.values() for s in stats):
        before = len(runner.notes)
        ex.components = _exact_pass(
            runner, ex.components, facts["n_samples"], device, on_progress, should_stop
        )
        ex.notes.extend(runner.notes[before:])
    return ex


def extract_state(
    loaded: LoadedModel,
    samples: list[str],
    *,
    device: str,
    opts: ExtractOptions,
    on_progress: ProgressCallback = no_progress,
    should_stop: StopCheck = never_stop,
    model_name: str = "",
    modality: str = "text",
) -> dict:
    """:func:`extract`'s streamed state instead of its metrics: per component, each layer's
    accumulator state, and the run's facts. Shards (``opts.sample_ids``) merge with
    :func:`merge_extraction_states`; :func:`finish_extraction` turns a state into the metrics."""
    runner, facts = _stream(loaded, samples, device, opts, on_progress, should_stop, model_name, modality)
    assert runner.accs is not None
    for name in ("start", "at", "estimate"):  # a clock reading, a live event: meaningless elsewhere
        facts.pop(name)
    return {"components": {c: [a.state() for a in accs] for c, accs in runner.accs.items()}, **facts}


def merge_extraction_states(states: Sequence[dict]) -> dict:
    """One state from the states of disjoint shards of the same corpus (same model and options):
    accumulators merged (see :meth:`LayerAccumulator.merge`), counts and seconds added."""
    if not states:
        raise ValueError("nothing to merge")
    first = states[0]
    accs = {
        c: [LayerAccumulator.from_state(s) for s in layer_states]
        for c, layer_states in first["components"].items()
    }
    for other in states[1:]:
        if list(other["components"]) != list(accs):
            raise ValueError("cannot merge the states of runs with different components")
        for c, layer_states in other["components"].items():
            for acc, s in zip(accs[c], layer_states, strict=True):
                acc.merge(LayerAccumulator.from_state(s))
    notes = list(dict.fromkeys(n for s in states for n in s["notes"]))
    audio = [s["audio_seconds"] for s in states if s["audio_seconds"] is not None]
    return {
        **first,
        "components": {c: [a.state() for a in layer_accs] for c, layer_accs in accs.items()},
        "n_samples": sum(s["n_samples"] for s in states),
        "n_tokens": sum(s["n_tokens"] for s in states),
        "seconds": sum(s["seconds"] for s in states),
        "notes": notes,
        "saw_maps": any(s["saw_maps"] for s in states),
        "reservoir_capped": any(s["reservoir_capped"] for s in states),
        "max_dim": max(s["max_dim"] for s in states),
        "audio_seconds": sum(audio) if audio else None,
    }


def finish_extraction(state: dict) -> Extraction:
    """The per-layer metrics of a (possibly merged) :func:`extract_state`."""
    accs = {c: [LayerAccumulator.from_state(s) for s in states] for c, states in state["components"].items()}
    facts = {k: v for k, v in state.items() if k != "components"}
    return _finish(accs, facts)


def _stream(loaded, samples, device, opts, on_progress, should_stop, model_name, modality) -> tuple:
    """Run the batches; (the runner with its accumulators, the facts :func:`_finish` needs)."""
    runner = _Runner(loaded, device, opts, on_progress)
    max_length = effective_max_length(loaded, opts, model_name, on_progress)
    total = len(runner.selected(len(samples)))
    start = time.perf_counter()
    unit = "tokenising" if modality == "text" else "reading"
    on_progress(
        Progress(0, total, 0, 0.0, stage="prepare", phase="tokenising", detail=f"{unit} {total} samples")
    )
    runner.prepare(samples, modality, max_length)
    assert runner.feeder is not None
    tokenise_s = time.perf_counter() - start
    start = time.perf_counter()
    on_progress(Progress(0, total, 0, 0.0, phase="running"))
    done, n_tokens, estimate = _batch_pass(runner, total, start, device, on_progress, should_stop)
    if runner.accs is None:
        raise IsotuiError("no sample to measure: the selected sample ids are empty")
    first = next(iter(runner.accs.values()))[0]
    if first.n_all == 0:
        raise IsotuiError(
            f"no token of the {total} samples was kept: all were special tokens or padding; use "
            "--special-tokens include or a larger --max-length"
        )
    elapsed = time.perf_counter() - start
    memory = memory_in_use(device)
    audio = getattr(runner.feeder, "seconds", None)  # the whole corpus's; a shard's own below
    if audio is not None and opts.sample_ids is not None:
        audio = float(runner.feeder.n_samples[runner.selected(len(samples))].sum()) / runner.feeder.rate
    facts = {
        "final_norm": runner.final_norm,
        "final_norm_module": ", ".join(runner.final_norm_names) or None,
        "n_samples": total,
        "n_tokens": n_tokens,
        "max_length": max_length,
        "start": start,
        "seconds": elapsed,
        "notes": runner.notes,
        "map_units": runner.map_units,
        "map_units_asked": opts.map_units,
        "saw_maps": runner.saw_maps,
        "reservoir_capped": runner.reservoir_capped,
        "max_dim": runner.max_dim,
        "audio_seconds": audio,
        "tokenise_s": tokenise_s,
        "forward_s": runner.forward_s,
        "metrics_s": runner.metrics_s,
        "at": Progress(done, total, n_tokens, elapsed, memory_bytes=memory),
        "estimate": estimate,
        "exact": opts.exact,
    }
    return runner, facts


def _finish(
    accs: dict[str, list[LayerAccumulator]],
    facts: dict,
    on_progress: ProgressCallback = no_progress,
    at: Progress | None = None,
    estimate: float | None = None,
) -> Extraction:
    """Metrics and notes from the accumulators and the facts of :func:`_stream` (or a merge);
    ``at``: the last running event, from which finalisation's per-layer events go on."""
    begin = time.perf_counter()
    components = finalize_all(accs, on_progress, at or Progress(0, 0, 0, 0.0), estimate)
    finalize_s = time.perf_counter() - begin
    all_stats = [s for stats in components.values() for s in stats]
    notes = list(facts["notes"])
    notes.extend(_sample_notes(facts, all_stats))
    notes.extend(_rank_notes(all_stats))
    notes.extend(constant_notes(components))
    asked = facts["map_units_asked"]
    if asked != "auto" and not facts["saw_maps"]:
        notes.append(f"--map-units {asked} has no effect: this model's layers are token sequences")
    start = facts.get("start")  # one pass: its wall time up to now; merged shards: their sum
    return Extraction(
        components=components,
        final_norm=facts["final_norm"],
        final_norm_module=facts["final_norm_module"],
        n_samples=facts["n_samples"],
        n_tokens=facts["n_tokens"],
        max_length=facts["max_length"],
        seconds=time.perf_counter() - start if start is not None else facts["seconds"],
        notes=notes,
        map_units=facts["map_units"] if facts["saw_maps"] else None,
        audio_seconds=facts["audio_seconds"],
        timings={
            "tokenise_s": facts.get("tokenise_s", 0.0),
            "forward_s": facts.get("forward_s", 0.0),
            "metrics_s": facts.get("metrics_s", 0.0),
            "finalise_s": finalize_s,
        },
    )


# Finalisation per layer on a 2-core CPU, reservoir 4096 full (MiniLM, d=384: 2.6 s; a GPT-2-size
# model, d=768: 3.5 s; issue 12): an estimate from d for the ETA before finalisation starts; once
# it runs, the layers already finalised give the time per layer.
FINALIZE_BASE_S = 1.7
FINALIZE_PER_DIM_S = 0.0023


def finalize_estimate_s(runner: _Runner) -> float | None:
    """Seconds the finalisation of every layer will take, estimated from each layer's d and how
    full its reservoir is (the pairwise reservoir metrics dominate at small d)."""
    if not runner.accs:
        return None
    total = 0.0
    for accs in runner.accs.values():
        for acc in accs:
            fill = min(1.0, acc.n_all / max(1, acc.reservoir_size))
            total += (FINALIZE_BASE_S + FINALIZE_PER_DIM_S * acc.dim) * max(fill, 0.05)
    return total


def finalize_all(
    all_accs: dict[str, list[LayerAccumulator]],
    on_progress: ProgressCallback,
    at: Progress,
    estimate: float | None,
) -> dict[str, list[LayerStats]]:
    """Finalise every layer, posting one progress event per layer with the time left (from the
    layers done so far, else ``estimate``)."""
    from dataclasses import replace

    n_layers = sum(len(accs) for accs in all_accs.values())
    start = time.perf_counter()
    done = 0
    out: dict[str, list[LayerStats]] = {}
    for component, accs in all_accs.items():
        out[component] = []
        for acc in accs:
            spent = time.perf_counter() - start
            left = spent / done * (n_layers - done) if done else estimate
            on_progress(
                replace(
                    at,
                    stage="finalize",
                    phase="finalising",
                    layers_done=done,
                    layers_total=n_layers,
                    finalize_left_s=left,
                )
            )
            out[component].append(acc.finalize())
            done += 1
    return out


def _batch_pass(
    runner: _Runner,
    total: int,
    start: float,
    device: str,
    on_progress: ProgressCallback,
    should_stop: StopCheck,
    phase: str = "running",
) -> tuple[int, int, float | None]:
    """One pass over the corpus in batches; (samples done, input units, the estimate of the
    finalisation still to come, refreshed as the reservoirs fill)."""
    assert runner.feeder is not None
    done = n_tokens = 0
    estimate = None
    for batch_no, idx in enumerate(runner.batches(runner.feeder.lengths), 1):
        if should_stop():
            raise Cancelled()
        n_tokens += runner.process(idx)
        done += len(idx)
        if device == "cpu" and batch_no % TRIM_EVERY == 0:
            release_free_memory()
        if phase == "running" and (estimate is None or batch_no % 8 == 0):
            estimate = finalize_estimate_s(runner)
        on_progress(
            Progress(
                done,
                total,
                n_tokens,
                time.perf_counter() - start,
                memory_bytes=memory_in_use(device),
                phase=phase,
                finalize_left_s=estimate,
            )
        )
    return done, n_tokens, estimate


def _exact_pass(
    runner: _Runner,
    components: dict[str, list[LayerStats]],
    total: int,
    device: str,
    on_progress: ProgressCallback,
    should_stop: StopCheck,
) -> dict[str, list[LayerStats]]:
    """``--exact``: run the corpus again, folding every vector into :class:`ExactPass` with the
    first pass's mean, std and eigenvectors, and replace the sampled metrics by the exact ones."""
    assert runner.accs is not None
    runner.second = {}
    for c, accs in runner.accs.items():
        runner.second[c] = []
        for acc in accs:
            runner.second[c].append(ExactPass(acc))
            acc.gram = acc.res = None  # finalized: free the d x d sums before the next layer's
    start = time.perf_counter()
    on_progress(Progress(0, total, 0, 0.0, message="second pass over the data (--exact)"))
    _batch_pass(runner, total, start, device, on_progress, should_stop, phase="second pass")
    out = {
        c: [p.apply(s) for p, s in zip(runner.second[c], stats, strict=True)]
        for c, stats in components.items()
    }
    runner.notes.extend(_exact_notes(runner, out))
    runner.second = None
    return out


def _exact_notes(runner: _Runner, components: dict[str, list[LayerStats]]) -> list[str]:
    """Say what the second pass computed over every vector, and where it fell back to the sample."""
    assert runner.second is not None
    passes = [p for ps in runner.second.values() for p in ps]
    n = len(passes)
    wide = sum(not p.eigen for p in passes)
    notes = [
        "--exact: avg_cos_centered, I(W), centred I(W), all-but-the-top and standardised avg_cos "
        "over every vector (a second pass with the final mean, per-dimension std and the "
        "eigenvectors of the exact second moment and covariance)"
    ]
    if wide:
        notes.append(
            f"--exact: I(W), centred I(W) and all-but-the-top of {wide} of {n} layers come from the "
            f"sample (with standard errors): their d x d covariance is not held (all layers' d x d "
            f"over {COV_BUDGET_BYTES >> 30} GiB)"
        )
    return notes


def constant_notes(components: dict[str, list[LayerStats]]) -> list[str]:
    """Say which dimensions standardised avg_cos leaves out: those exactly constant in a layer."""
    parts = []
    for component, stats in components.items():
        for i, s in enumerate(stats):
            if s.constant_dims and math.isfinite(s.avg_cos_std):
                dims = ", ".join(str(k) for k in s.constant_dims[:8])
                more = f" and {len(s.constant_dims) - 8} more" if len(s.constant_dims) > 8 else ""
                where = f"layer {i}" if component == "model" else f"{component} layer {i}"
                parts.append(f"{where}: {dims}{more}")
    if not parts:
        return []
    return [
        "standardised avg_cos leaves out the dimensions whose value is the same in every vector "
        f"(they have no spread to scale): {'; '.join(parts)}"
    ]


def _rank_notes(stats: list[LayerStats]) -> list[str]:
    """Say when a layer has fewer vectors than dimensions (its covariance is rank-deficient)."""
    from isotui.core.isotropy import ISOSCORE_STAR_ZETA

    short = [s for s in stats if 0 < s.n_vectors <= s.dim]
    if not short:
        return []
    return [
        f"{len(short)} of {len(stats)} layers have no more vectors than dimensions "
        f"(n={short[0].n_vectors:,}, d={short[0].dim:,}): their covariance is rank-deficient, so "
        "IsoScore is low by construction; "
        f"IsoScore* shrinks it toward the isotropic covariance of the same total variance "
        f"((tr C / d) I, zeta {ISOSCORE_STAR_ZETA}); measure more samples"
    ]


def _sample_notes(facts: dict, stats: list[LayerStats]) -> list[str]:
    """Say which metrics came from the reservoir sample rather than from every vector."""
    partial = [s for s in stats if s.n_sample < s.n_vectors]
    if not partial:
        return []
    spectrum = any(s.spectrum_from.startswith("sample:") for s in partial)
    sampled = "avg_cos_centered, I(W), all-but-the-top and standardised avg_cos"
    if facts.get("exact"):  # the second pass gives those over every vector
        if not spectrum:
            return []
        sampled = ""
    if spectrum:
        what = f"{sampled} and the spectrum metrics" if sampled else "the spectrum metrics"
    else:
        what = sampled
    note = (
        f"{what} from a uniform sample of {partial[0].n_sample:,} vectors in {len(partial)} of "
        f"{len(stats)} layers (--reservoir)"
    )
    if not facts.get("exact"):
        note += (
            f"; ± their standard errors from {SE_GROUPS} disjoint sub-samples (the *_se columns; "
            "--exact computes them over every vector)"
        )
        if any(s.dim > EIGEN_JACKKNIFE_MAX_DIM for s in partial):
            note += (
                f"; I(W) and all-but-the-top have none in layers wider than {EIGEN_JACKKNIFE_MAX_DIM:,} "
                "dims (16 more eigendecompositions each)"
            )
    if facts["reservoir_capped"]:
        note += (
            f"; the sample is capped so that all layers' samples fit in "
            f"{RESERVOIR_BUDGET_BYTES >> 20} MiB (d up to {facts['max_dim']:,})"
        )
    return [note]
