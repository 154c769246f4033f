"""The layers experiment's stream: every hidden layer of a model, folded into accumulators.

Nothing here keeps hidden states beyond one batch: memory is set by the batch, the layer count
and d, never by the corpus size. Any modality (see :mod:`isotui.extract.inputs`); a layer is a
(B, T, D) sequence (positions are the units), a (B, C, H, W) map (units: each image flattened to
one C*H*W vector, the view of Godey et al. Fig. 4, or each spatial position's C channels), or a
(B, D) vector. Encoder-decoder models give two components, ``encoder`` and ``decoder``. The
batches, devices, back-off and progress are :class:`isotui.extract.loop.BatchLoop`'s; this
module is its step (:class:`LayerStream`) and the metrics and notes made from it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

from isotui.core.accumulator import LayerAccumulator, LayerStats, sample_keys
from isotui.core.exact_pass import ExactPass
from isotui.core.sampled import EIGEN_JACKKNIFE_MAX_DIM, SE_GROUPS
from isotui.errors import IsotuiError
from isotui.extract.attention_probe import ModuleSite, install_probe
from isotui.extract.device import available_memory, memory_in_use, to_device
from isotui.extract.finalise import finalize_all, finalize_estimate_s
from isotui.extract.forward import (
    HiddenStates,
    Sites,
    block_sites,
    hidden_states,
    layer_tensor,
    layers_stay,
    watch_layers,
)
from isotui.extract.heap import release_free_memory
from isotui.extract.inputs import Fed
from isotui.extract.loop import Batch, BatchLoop, Hooks, merge_facts
from isotui.extract.memory_plan import (
    DTYPE_BYTES,
    Budgets,
    MemoryPlan,
    batch_line,
    batch_tokens,
    device_key,
    fit_types,
    hidden_state_devices,
    measured_memory,
    mlp_width,
    offload_bytes,
    plan_layers,
    reservoir_floor,
    room_for,
    size_text,
    sums_budgets,
    weights_per_device,
)
from isotui.extract.memory_values import SELF_SIM_TYPES as SELF_SIM_TYPES  # importable from here too
from isotui.extract.modules import Site
from isotui.extract.objective import LMObjective
from isotui.extract.planning import ExtractOptions, effective_max_length, selected_ids
from isotui.extract.planning import position_limit as position_limit  # importable from here too
from isotui.extract.planning import resolve_max_length as resolve_max_length
from isotui.extract.progress import Progress, ProgressCallback, StopCheck, never_stop, no_progress
from isotui.extract.tensor_cores import ensure_scheme
from isotui.extract.tokens import Tokens
from isotui.models.loading import LoadedModel, final_norm_modules

if TYPE_CHECKING:
    import torch

TOKEN_MAP_TYPES = ("segformer",)  # transformers whose stages are token grids, not conv maps

# the memory plan of a stream's sums from its first batch's unit widths and sums' devices, per
# component (see LayerStream's ``plan_sums``)
SumsPlan = Callable[[dict[str, list[int]], dict[str, list[Any]]], MemoryPlan]

S = TypeVar("S")  # a fold's batch sums


class TokenFold(Protocol, Generic[S]):
    """One layer's fold of its kept tokens, in place of a :class:`LayerAccumulator` (see
    :class:`TokenFolds`): ``partial`` makes one batch's sums from its kept vectors (m x d, on the
    layer's device) and their token ids (m, on the host), ``commit`` adds them in (the loop's
    out-of-memory back-off counts a batch once: extract/loop.py)."""

    def partial(self, x: torch.Tensor, token_ids: torch.Tensor) -> S: ...

    def commit(self, sums: S) -> None: ...


@dataclass(frozen=True)
class TokenFolds:
    """What :class:`LayerStream` folds a pass's token layers into in place of its accumulators:
    ``make(width, device)``, each layer's :class:`TokenFold` (on its plan's device); the sentences
    to raise for a layer that is not a sequence of positions (``not_sequence``) or whose
    positions are not the input's tokens (``not_tokens``: a downsampled stack)."""

    make: Callable[[int, torch.device], TokenFold[Any]]
    not_sequence: str
    not_tokens: str


class GradFold(Protocol, Generic[S]):
    """One layer's fold of its kept (activation, loss gradient) pairs (see :class:`GradFolds`):
    ``partial`` makes one batch's sums from the kept activations and their gradients (both
    m x d, on the layer's device), ``commit`` adds them in (the loop's out-of-memory back-off
    counts a batch once: extract/loop.py)."""

    def partial(self, x: torch.Tensor, g: torch.Tensor) -> S: ...

    def commit(self, sums: S) -> None: ...


@dataclass(frozen=True)
class GradFolds:
    """What :class:`LayerStream` folds a backward pass into (with its ``objective``): every
    hidden state (``output_hidden_states``, the model run with grad) and its gradient of the
    objective's summed loss. ``make(width, device)``, each layer's :class:`GradFold`; ``check``
    (every layer's width and device), the first batch's refusals before any fold is made; the
    sentences to raise for hidden states that are not token sequences (``not_sequence``) or
    not one vector per input token (``not_tokens``)."""

    make: Callable[[int, torch.device], GradFold[Any]]
    check: Callable[[list[int], list[torch.device]], None]
    not_sequence: str
    not_tokens: str


@dataclass(frozen=True)
class Edit:
    """One more forward of each batch with ``site``'s tensor replaced by ``change(tensor)``
    (the same shape and dtype), every later module reading the changed one (see :class:`Edits`)."""

    site: Site
    change: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Edits:
    """What :class:`LayerStream` runs each batch as, in place of one forward (an ablation, issue
    39): the model as it is (run 0), then once per edit (run k + 1: ``edits[k]``), on the same
    inputs (a masked LM's same masks). Per run, every hidden state's kept tokens folded into a
    :class:`LayerAccumulator` of their own (avg_cos, drift: :attr:`LayerStream.run_accs`), the
    objective's summed loss when there is one (:attr:`LayerStream.run_loss`), and for an edited
    run the summed ``1 - cos`` of each kept token's last hidden state against the unedited one
    (:attr:`LayerStream.run_change`)."""

    edits: Sequence[Edit]
    not_sequence: str  # hidden states that are not (batch, position, d) token sequences


@dataclass(frozen=True)
class AttentionView:
    """What an attention module computed on a batch (see :class:`AttentionFolds`), on the queries'
    device: queries (B, H, T, d) and keys (B, Hkv, S, d) after rotary embedding, scores and
    probabilities (B, H, T, S), the pairs the mask allows, the positions that count (B, T | S),
    the sample ids (B,), and the queries and keys before rotary embedding (None: not read)."""

    q: torch.Tensor
    k: torch.Tensor
    scores: torch.Tensor
    probs: torch.Tensor
    allowed: torch.Tensor
    q_keep: torch.Tensor
    k_keep: torch.Tensor
    ids: torch.Tensor
    pre_q: torch.Tensor | None
    pre_k: torch.Tensor | None


class AttentionFold(Protocol, Generic[S]):
    """One attention module's fold (see :class:`AttentionFolds`): ``partial`` makes what one
    batch's :class:`AttentionView` adds, ``commit`` adds it in (the loop's out-of-memory back-off
    counts a batch once per module: extract/loop.py)."""

    def partial(self, view: AttentionView) -> S: ...

    def commit(self, sums: S) -> None: ...


@dataclass(frozen=True)
class AttentionFolds:
    """What :class:`LayerStream` folds a pass under the attention probe into (every attention
    module of a transformers model: :mod:`isotui.extract.attention_probe`), in place of hidden
    states: ``make(sites, devices)``, each module's :class:`AttentionFold`, made at ``prepare``."""

    make: Callable[[list[ModuleSite], list[str]], list[AttentionFold[Any]]]


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
    memory_plan: dict[str, Any] | None = None  # MemoryPlan.to_json(): where the sums lived
    # per component, each layer's (C, H, W) where its vectors are flattened maps (else None)
    map_shapes: dict[str, list[list[int] | None]] | None = None
    sample: Any = None  # with ExtractOptions.keep_sample: each layer's reservoir (extract/sample.py)
    modules: list[str] | None = None  # --modules: each row's module (Site.label), in run order

    @property
    def layers(self) -> list[LayerStats]:
        """All layers in component order (encoder then decoder: the concatenated view)."""
        return [s for stats in self.components.values() for s in stats]


def _type_counts(ids: np.ndarray, kept: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kept tokens per id, samples with a kept token of that id) of one corpus or window:
    windows' counts add up to the corpus's (:func:`_add`)."""
    sample = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))[kept]
    kid = ids[kept]
    size = int(kid.max()) + 1 if len(kid) else 1
    counts = np.bincount(kid, minlength=size)
    pairs = np.unique(kid.astype(np.int64) * (len(offsets)) + sample)
    contexts = np.bincount(pairs // len(offsets), minlength=size)
    return counts, contexts


def _frequent_types(counts: np.ndarray, contexts: np.ndarray) -> np.ndarray:
    """token id -> slot 0, 1, ... for the types seen in at least two samples, most frequent
    first (ties: smaller id); -1 for the others (Ethayarajh's self-similarity needs contexts)."""
    eligible = np.flatnonzero(contexts >= 2)
    order = eligible[np.lexsort((eligible, -counts[eligible]))]
    slots = np.full(len(counts), -1, dtype=np.int64)
    slots[order] = np.arange(len(order))
    return slots


def corpus_counts(tokens: Tokens, *, include_special: bool) -> tuple[int, int]:
    """(token types self-similarity follows, the most vectors a layer sees) of a whole tokenised
    corpus, as a layers run counts them (:meth:`LayerStream._type_weights` and
    :meth:`LayerStream._vector_bound`): what a dry run plans with instead of a guess (issue 36)."""
    ids = tokens.ids.astype(np.int64)
    kept = np.ones(len(ids), bool) if include_special else ~tokens.special
    counts, contexts = _type_counts(ids, kept, tokens.offsets)
    tracked = int((_frequent_types(counts, contexts) >= 0).sum())
    return min(SELF_SIM_TYPES, tracked), int(tokens.offsets[-1])


def _add(total: np.ndarray | None, part: np.ndarray) -> np.ndarray:
    """``total + part`` for count arrays of different lengths (the longer one's length)."""
    if total is None:
        return part.astype(np.int64)
    if len(part) > len(total):
        total, part = part.astype(np.int64), total
    total[: len(part)] += part
    return total


def _inverse_counts(counts: np.ndarray | None) -> np.ndarray:
    """id -> 1 / count of that id (0 for ids that never occur)."""
    counts = np.zeros(1) if counts is None else counts.astype(np.float64)
    with np.errstate(divide="ignore"):
        return np.where(counts > 0, 1.0 / counts, 0.0)


class LayerStream:
    """The layers experiment's step on a :class:`BatchLoop`: each batch's hidden states, unit by
    unit, into one :class:`LayerAccumulator` per layer (during ``--exact``'s second pass, into
    :class:`ExactPass`), all layers or none; or, with ``sites`` (or ``--modules``), each
    :class:`Site`'s tensor, one accumulator per site.

    What another pass gives it (final-norm: each norm's input and output): ``sites``, read from
    the first batch on; ``type_uniform`` False, no type-uniform weights nor self-similarity types
    in the sums; ``plan_sums``, the memory plan of the sums in place of the layer run's
    (:func:`_memory_plan`); ``returned_by``, site index -> (a module that must return that site's
    very tensor, the sentence to raise when the first batch shows it does not). What token-types
    gives it: ``token_folds``, each layer's kept vectors and their token ids folded into the
    folds it makes (:attr:`folds`) instead of accumulators; a caller may replace those folds
    between passes (its second pass). What gradients gives it: ``objective`` (the LM loss on
    its labels, :mod:`isotui.extract.objective`) and ``grad_folds``, each batch run forward
    and backward (:meth:`_backward`), each layer's kept (activation, gradient) pairs folded into
    the folds it makes (:attr:`grad_folds_made`), the loss summed (:attr:`loss_sum`,
    :attr:`loss_tokens`). What the attention probe gives it: ``attention_folds``, each batch run
    under the probe (:meth:`_probed`), each attention module's view folded into the fold it
    makes (:attr:`attention_made`, by module name)."""

    def __init__(
        self,
        loop: BatchLoop,
        *,
        sites: Sequence[Site] | None = None,
        type_uniform: bool = True,
        plan_sums: SumsPlan | None = None,
        returned_by: Mapping[int, tuple[Any, str]] | None = None,
        token_folds: TokenFolds | None = None,
        objective: LMObjective | None = None,
        grad_folds: GradFolds | None = None,
        edits: Edits | None = None,
        attention_folds: AttentionFolds | None = None,
    ) -> None:
        if grad_folds is not None and objective is None:
            raise ValueError("a backward pass needs the objective whose loss it differentiates")
        self.loop = loop
        self.loaded = loop.loaded
        self.model = loop.model
        self.opts = loop.opts
        self.type_weights: dict[str, np.ndarray] = {}
        self.tracked: np.ndarray | None = None  # token id -> self-similarity slot (-1: none)
        self.n_tracked = 0
        self.accs: dict[str, list[LayerAccumulator]] | None = None
        self.second: dict[str, list[ExactPass]] | None = None  # --exact's second pass, when on
        self.final_norm: dict[str, bool] = {}
        self.final_norm_names: list[str] = []
        self.map_units = self._map_units()
        self.saw_maps = False  # whether any layer was a (B, C, H, W) map
        self.map_shapes: dict[str, list[list[int] | None]] | None = None  # flattened maps' (C, H, W)
        self.reservoir_capped = False
        self.plan: MemoryPlan | None = None  # made at the first batch (see _memory_plan)
        # under --max-memory, the budgets and the batch the dry run plans (see planned_room)
        self.room: Budgets | None = None
        self.max_length = 0  # tokens per sample (text), from prepare
        self.max_dim = 0
        self.forward_s = 0.0  # forward passes (building the batches: the loop's feed_s)
        self.metrics_s = 0.0  # folding each batch into the accumulators
        self.fold_s = 0.0  # folding, within the current batch
        # per component, the blocks whose hooks give each layer (and the final norm giving the
        # last one, if any), once the first batch showed they give the very hidden states
        self.sites: dict[str, tuple[list[Any], Any]] | None = None
        self.final_norm_by: dict[str, str] = {}  # component -> the final norm module's name
        # --modules: the sites the globs name (resolved at the first batch; or those given), and
        # each one's component and row there (the order they first ran in, during the first batch)
        self.module_sites: list[Site] | None = None if sites is None else list(sites)
        self.module_rows: dict[int, tuple[str, int]] = {}
        self.type_uniform = type_uniform
        self.plan_sums = plan_sums
        self.returned_by = dict(returned_by or {})
        self.token_folds = token_folds
        self.folds: dict[str, list[TokenFold[Any]]] | None = None  # made at the first batch
        self.objective = objective
        self.grad_folds = grad_folds
        self.grad_folds_made: list[GradFold[Any]] | None = None  # made at the first batch
        # the objective's summed loss (a device tensor after the first batch: read once, at the
        # end, issue 15) and how many tokens it is taken over
        self.loss_sum: float | torch.Tensor = 0.0
        self.loss_tokens = 0
        self.edits = edits
        # with edits: per run (0: unedited) its layers' accumulators, summed loss and (edited
        # runs) summed final-state change over the kept tokens (how many: :attr:`kept_tokens`)
        self.run_accs: list[list[LayerAccumulator]] | None = None
        self.run_loss: list[float | torch.Tensor] = []
        self.run_change: list[float | torch.Tensor] = []
        self.kept_tokens = 0
        self.attention_folds = attention_folds
        self.attention_made: dict[str, AttentionFold[Any]] = {}  # module name -> its fold (prepare)
        self.probed: tuple[Batch, dict[Any, Any]] | None = None  # the batch under the probe, its masks

    @property
    def notes(self) -> list[str]:
        """The run's notes: the loop's (back-offs) and this stream's, in the order they came."""
        return self.loop.notes

    def _map_units(self) -> str:
        """``image`` (one flattened vector per image) for conv maps; ``position`` for token grids."""
        if self.opts.map_units != "auto":
            return self.opts.map_units
        if self.loaded.model_type in TOKEN_MAP_TYPES or hasattr(self.model, "num_prefix_tokens"):
            return "position"
        return "image"

    def prepare(self, samples: Sequence[str], modality: str, max_length: int) -> None:
        self.max_length = max_length
        self.loop.prepare(samples, modality, max_length)
        self.type_weights = self._type_weights() if self.type_uniform else {}
        if self.attention_folds is not None:  # the probe stays in until the pass's hooks go
            probed = install_probe(self.loaded, self.loop.hooks, self.loop.device, self._observe)
            made = self.attention_folds.make([site for site, _ in probed], [where for _, where in probed])
            self.attention_made = {site.name: f for (site, _), f in zip(probed, made, strict=True)}

    def _type_weights(self) -> dict[str, np.ndarray]:
        """Per component, token id -> 1 / (how many kept tokens of the corpus have that id): the
        weights of the type-uniform view. Text only; the decoder of an encoder-decoder sees the
        text shifted right (a start token, then every token but the last). A streamed corpus is
        counted window by window (a tokenising pass of its own), to the same tables."""
        feeder = self.loop.feeder
        tokens = getattr(feeder, "tokens", None)
        if tokens is None:
            return {}
        windows = feeder.token_windows() if hasattr(feeder, "token_windows") else iter([tokens])
        include = self.opts.special_tokens == "include"
        enc_dec = getattr(feeder, "enc_dec", False)
        model = contexts = dec = None
        for window in windows:
            if not len(window.ids):
                continue
            ids = window.ids.astype(np.int64)
            kept = np.ones(len(ids), bool) if include else ~window.special
            counts, seen = _type_counts(ids, kept, window.offsets)
            model, contexts = _add(model, counts), _add(contexts, seen)
            if enc_dec:
                last = np.zeros(len(ids), bool)
                last[window.offsets[1:] - 1] = True
                shifted = ids[kept & ~last]
                if include:  # the start token is special: counted only when specials are
                    config = self.model.config
                    start = getattr(config, "decoder_start_token_id", None)
                    start = start if isinstance(start, int) else (config.pad_token_id or 0)
                    shifted = np.concatenate([shifted, np.full(len(window.offsets) - 1, start)])
                dec = _add(dec, np.bincount(shifted) if len(shifted) else np.zeros(1, np.int64))
        if model is None or contexts is None:
            return {}
        tables = {"model": _inverse_counts(model)}
        self.tracked = _frequent_types(model, contexts)
        if enc_dec:
            tables = {"encoder": tables["model"], "decoder": _inverse_counts(dec)}
        return tables

    def __call__(self, batch: Batch) -> int:
        """Forward one batch and fold it in, layer by layer; returns its real input units.

        The first batch asks the model for every hidden state (``output_hidden_states``) and
        reads the same tensors with hooks on its blocks; when each hooked tensor equals the
        returned one (``torch.equal``), later batches fold each layer inside its block's hook as
        it is produced (:meth:`_hooked_forward`), so one or two hidden states live at once, not
        all of them. Each layer commits as soon as its sums are made (``batch.pending``: a
        retried half skips the layers that already folded it; see extract/loop.py)."""
        import torch

        if self.grad_folds is not None:
            return self._backward(batch, self.grad_folds)
        if self.edits is not None:
            return self._edited(batch, self.edits)
        if self.attention_folds is not None:
            return self._probed(batch)
        started = time.perf_counter()
        self.fold_s = 0.0
        index: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        if self.opts.modules or self.module_sites is not None:
            self._module_forward(batch, index)
            self.forward_s += time.perf_counter() - started - self.fold_s
            self.metrics_s += self.fold_s
            return batch.units
        if self.plan is not None and self.sites is not None:
            self._hooked_forward(batch, index)
            self.forward_s += time.perf_counter() - started - self.fold_s
            self.metrics_s += self.fold_s
            return batch.units
        hook_out: dict[str, Any] = {}
        seen: dict[str, dict[int, list[Any]]] = {}
        sites: Sites = {}
        with Hooks() as hooks, self.loop.model_call(f"a batch of {self.loaded.modality}"):
            if self.plan is None:  # first batch: which final norm, if any, made the last hidden state
                for name, module in final_norm_modules(self.model):
                    hooks.forward(module, (lambda key: lambda _m, _i, o: hook_out.__setitem__(key, o))(name))
                sites = block_sites(self.loaded)  # and whether its blocks' hooks give every layer
                for component, blocks in sites.items():
                    seen[component] = {}
                    watch_layers(hooks, blocks, None, _keeper(seen[component]))
            with torch.inference_mode():
                components = hidden_states(self.loaded, batch.inputs)
        forwarded = time.perf_counter()
        self.forward_s += forwarded - started
        if self.plan is None:
            self._first_batch(components, hook_out)
            self.sites = self._hooks_agree(components, sites, seen, hook_out)
        with torch.inference_mode():
            for component, hidden in components.items():
                for i, h in enumerate(hidden):
                    self._fold(batch, index, component, i, h)
        self.metrics_s += time.perf_counter() - forwarded
        return batch.units

    def _fold(
        self, batch: Batch, index: dict[tuple[Any, ...], tuple[Any, ...]], component: str, i: int, h: Any
    ) -> None:
        """Layer ``i`` of ``component`` (its hidden state ``h``) into its accumulator (during
        ``--exact``'s second pass, its :class:`ExactPass`), committed at once, unless a try of
        a batch holding these samples already did. ``index``: this batch's kept units and keys,
        shared by the layers of one shape on one device (made once per batch, issue 15; each
        layer's sums live where its plan puts them: the layer run's on the device of its hidden
        states, the CPU when that is MPS). With ``token_folds``, into the layer's
        :class:`TokenFold` instead (:meth:`_fold_tokens`)."""
        started = time.perf_counter()
        key = (component, i)
        if not batch.pending(key):
            return
        if self.folds is not None:
            self._fold_tokens(batch, index, component, i, h)
            batch.committed(key)
            self.fold_s += time.perf_counter() - started
            return
        targets: Any = self.second if self.second is not None else self.accs
        acc = targets[component][i]
        fed, ids = batch.fed, batch.ids
        shape = (component, *h.shape[1:]) if h.ndim == 3 else (h.ndim, *h.shape[2:])
        shape = (*shape, str(h.device), str(acc.device))
        if shape not in index:  # from the host inputs, moved once per batch (issue 15)
            flat, local, positions = self._index(fed, component, h)
            keys = sample_keys(self.opts.seed, ids[local], positions)
            weights, types = self._weights(fed, component, h, flat)
            index[shape] = tuple(
                None if t is None else to_device(t, dev)
                for t, dev in (
                    (flat, h.device),
                    (local, acc.device),
                    (keys, acc.device),
                    (weights, acc.device),
                    (types, acc.device),
                )
            )
        flat, local, keys, weights, types = index[shape]
        vectors = self._vectors(h, flat)
        # the batch's samples (B), positionally: ExactPass.partial takes it too; committed at
        # once, so one layer's batch sums (a d x d gram) live at a time, not every layer's
        acc.commit(acc.partial(vectors, local, keys, weights, types, h.shape[0]))
        batch.committed(key)
        self.fold_s += time.perf_counter() - started

    def _fold_tokens(
        self, batch: Batch, index: dict[tuple[Any, ...], tuple[Any, ...]], component: str, i: int, h: Any
    ) -> None:
        """Layer ``i`` of ``component`` into its :class:`TokenFold`: its kept vectors and their
        token ids (``index``: made once per batch for the layers of one shape on one device)."""
        assert self.folds is not None and self.token_folds is not None
        shape = (component, *h.shape[1:], str(h.device))
        if shape not in index:
            flat, _local, _positions = self._index(batch.fed, component, h)
            token_ids = self._token_ids(batch.fed, component, h, flat)
            if token_ids is None:
                folds = self.token_folds
                raise IsotuiError(folds.not_sequence if h.ndim != 3 else folds.not_tokens)
            index[shape] = (to_device(flat, h.device), token_ids)
        flat, token_ids = index[shape]
        fold = self.folds[component][i]
        fold.commit(fold.partial(self._vectors(h, flat), token_ids))

    def _backward(self, batch: Batch, grad_folds: GradFolds) -> int:
        """Forward and backward over one batch: the objective's labels (and its input edit),
        the model run with grad for every hidden state, each one's gradient of the summed loss;
        each layer's kept (activation, gradient) pairs folded and committed at once, then the
        loss (``batch.pending``: a retried half skips the parts that already folded it, so an
        out-of-memory anywhere backs off and counts every sample once). Kept: the positions the
        layer run keeps that the loss can depend on (:meth:`LMObjective.bearing`); returns how
        many."""
        import torch

        objective = self.objective
        assert objective is not None  # __init__ refuses grad_folds without it
        device = self.loop.device
        ids = batch.fed.inputs["input_ids"]
        labels = objective.labels(batch, device)
        keep = objective.bearing(self.loop.keep(batch.fed, "model", ids.shape[1]), labels)
        started = time.perf_counter()
        with self.loop.model_call("a batch"), torch.enable_grad():
            out = self.model(**batch.inputs, output_hidden_states=True, return_dict=True)
            hidden = tuple(out.hidden_states)
            loss = objective.loss(out.logits, to_device(labels, device))
            grads = torch.autograd.grad(loss, hidden, allow_unused=True)
        forwarded = time.perf_counter()
        self.forward_s += forwarded - started
        missing = next((i for i, g in enumerate(grads) if g is None), None)
        if missing is not None:
            raise IsotuiError(
                f"hidden state {missing} of model {type(self.model).__name__} is not on the path to "
                "its loss, so it has no gradient"
            )
        if self.grad_folds_made is None:
            if any(h.ndim != 3 for h in hidden):
                raise IsotuiError(grad_folds.not_sequence)
            dims = [int(h.shape[-1]) for h in hidden]
            # each layer's sums on its hidden states' GPU (a split model's several), else on the
            # run's GPU, else on the CPU
            main = torch.device(device if device.startswith("cuda") else "cpu")
            where = [h.device if h.device.type == "cuda" else main for h in hidden]
            grad_folds.check(dims, where)
            self.grad_folds_made = [grad_folds.make(d, w) for d, w in zip(dims, where, strict=True)]
        if any(h.shape[1] != ids.shape[1] for h in hidden):
            raise IsotuiError(grad_folds.not_tokens)
        flat = to_device(keep.flatten().nonzero().squeeze(1), device)  # pinned, non-blocking (issue 26)
        for i, (fold, h, g) in enumerate(zip(self.grad_folds_made, hidden, grads, strict=True)):
            if not batch.pending(("model", i)):
                continue
            d = h.shape[-1]
            at = flat.to(h.device)  # a split model's layers sit on several GPUs
            fold.commit(fold.partial(h.detach().reshape(-1, d)[at], g.reshape(-1, d)[at]))
            batch.committed(("model", i))
        if batch.pending("loss"):
            self.loss_sum = self.loss_sum + loss.detach().to(torch.float64)
            self.loss_tokens += objective.tokens(labels)
            batch.committed("loss")
        self.metrics_s += time.perf_counter() - forwarded
        return int(keep.sum())

    def _edited(self, batch: Batch, edits: Edits) -> int:
        """One batch run unedited and once per edit (:class:`Edits`), on the same inputs (the
        objective's labels and input edit made once); each run's hidden states, loss and final
        change folded and committed part by part (``batch.pending``: a retried half skips the
        parts that already folded it, and runs the unedited model again for the final states it
        compares with). Returns the batch's kept tokens."""
        import torch

        from isotui.extract.modules import edit_hook

        device, objective = self.loop.device, self.objective
        ids = batch.fed.inputs["input_ids"]
        labels = None if objective is None else objective.labels(batch, device)
        keep = self.loop.keep(batch.fed, "model", ids.shape[1])
        flat = keep.flatten().nonzero().squeeze(1)
        local = flat // ids.shape[1]
        keys = sample_keys(self.opts.seed, batch.ids[local], flat % ids.shape[1])
        clean: torch.Tensor | None = None
        for run, edit in enumerate([None, *edits.edits]):
            started = time.perf_counter()
            # a model split by --device-map keeps each hidden state where its block ran
            with Hooks() as hooks, self.loop.model_call("a batch of text"), torch.inference_mode():
                if edit is not None:
                    edit_hook(hooks, edit.site, edit.change)
                with layers_stay(self.model):
                    out = self.model(**batch.inputs, output_hidden_states=True, return_dict=True)
                hidden = tuple(getattr(out, "hidden_states", None) or ())
                loss = None
                if objective is not None and labels is not None:
                    loss = objective.loss(out.logits, to_device(labels, out.logits.device))
            forwarded = time.perf_counter()
            self.forward_s += forwarded - started
            if not hidden or any(h.ndim != 3 or h.shape[1] != ids.shape[1] for h in hidden):
                raise IsotuiError(edits.not_sequence)
            if self.run_accs is None:  # the first batch: every run's sums, all or none
                accs = [
                    [
                        LayerAccumulator(h.shape[-1], _acc_device(h.device), full_cov=False, reservoir=0)
                        for h in hidden
                    ]
                    for _ in range(len(edits.edits) + 1)
                ]
                self.run_loss = [0.0] * len(accs)
                self.run_change = [0.0] * len(accs)
                self.run_accs = accs
            with torch.inference_mode():
                for i, (acc, h) in enumerate(zip(self.run_accs[run], hidden, strict=True)):
                    if batch.pending((run, i)):
                        at = flat.to(h.device)
                        x = h.reshape(-1, h.shape[-1]).index_select(0, at)
                        acc.commit(acc.partial(x, local, keys, n_samples=h.shape[0]))
                        batch.committed((run, i))
                last = (
                    hidden[-1].reshape(-1, hidden[-1].shape[-1]).index_select(0, flat.to(hidden[-1].device))
                )
                if run == 0:
                    clean = last
                elif batch.pending((run, "change")):
                    assert clean is not None
                    cos = torch.nn.functional.cosine_similarity(clean.double(), last.double(), dim=1)
                    self.run_change[run] = self.run_change[run] + (1.0 - cos).sum()
                    batch.committed((run, "change"))
                if loss is not None and batch.pending((run, "loss")):
                    self.run_loss[run] = self.run_loss[run] + loss.detach().to(torch.float64)
                    batch.committed((run, "loss"))
            self.metrics_s += time.perf_counter() - forwarded
        if batch.pending("tokens"):
            self.kept_tokens += int(keep.sum())
            if labels is not None:
                self.loss_tokens += LMObjective.tokens(labels)
            batch.committed("tokens")
        return int(keep.sum())

    def _probed(self, batch: Batch) -> int:
        """Run one batch under the attention probe: each module's view folded as the module
        attends (:meth:`_observe`)."""
        import torch

        self.probed = (batch, {})
        with self.loop.model_call("a batch under the attention probe"), torch.inference_mode():
            self.model(**batch.inputs, return_dict=True)
        if not self.probed[1]:  # no module attended through the probe
            raise IsotuiError(
                f"{type(self.model).__name__} does not compute attention through transformers' "
                "attention interface, so isotui cannot read its queries and keys"
            )
        return batch.units

    def _observe(
        self, site: ModuleSite, raw: dict[str, Any], q: Any, k: Any, scores: Any, probs: Any, allowed: Any
    ) -> None:
        """One module's attention on the batch into its fold, committed at once unless a try of
        a batch holding these samples already did (``batch.pending``). Its masks and the sample
        ids are moved to its device once per batch (issue 26: every module shares them)."""
        assert self.probed is not None
        batch, index = self.probed
        pre_q, pre_k = raw.pop("q", None), raw.pop("k", None)
        raw.clear()
        if q.shape[0] != len(batch.idx):
            raise IsotuiError(
                f"{site.name} attends within windows ({q.shape[0]} windows for {len(batch.idx)} "
                "samples, as Swin does); isotui's attention probe reads whole-sequence attention only"
            )
        if q.device.type == "mps":  # no float64 on MPS: measure on the CPU
            q, k, scores, probs, allowed = (x.cpu() for x in (q, k, scores, probs, allowed))
        index["seen"] = True
        called = index.setdefault("called", set())
        if site.name in called:  # its second call in one forward: the fold would miss or mix them
            raise IsotuiError(
                f"{site.name} attends more than once in one forward pass (one module shared across "
                "layers, as ALBERT's is): isotui's attention probe reads each attention module once per pass"
            )
        called.add(site.name)
        if not batch.pending(site.name):
            return

        def keep(component: str, width: int) -> Any:
            key = (component, width, str(q.device))
            if key not in index:
                index[key] = to_device(self.loop.keep(batch.fed, component, width), q.device)
            return index[key]

        if str(q.device) not in index:  # the batch's sample ids there
            index[str(q.device)] = to_device(batch.ids, q.device)
        k_component = "encoder" if site.kind == "cross" else site.component  # whose keys it reads
        keeps = keep(site.component, q.shape[2]), keep(k_component, k.shape[2])
        ids = index[str(q.device)]
        fold = self.attention_made[site.name]
        fold.commit(fold.partial(AttentionView(q, k, scores, probs, allowed, *keeps, ids, pre_q, pre_k)))
        batch.committed(site.name)

    def _hooked_forward(self, batch: Batch, index: dict[tuple[Any, ...], tuple[Any, ...]]) -> None:
        """Run the model without ``output_hidden_states``, folding each layer in the hook of the
        block that made it (the first layer: the first block's input; the last: the last
        block's output or, when the model applies one, its final norm's)."""
        import torch

        assert self.sites is not None
        folded: dict[str, list[int]] = {}

        def folder(component: str) -> Any:
            def hook_for(i: int) -> Any:
                def hook(_m: Any, *args: Any) -> None:
                    folded[component][i] += 1
                    self._fold(batch, index, component, i, layer_tensor(i, args))

                return hook

            return hook_for

        with Hooks() as hooks, self.loop.model_call(f"a batch of {self.loaded.modality}"):
            for component, (blocks, last) in self.sites.items():
                folded[component] = [0] * (len(blocks) + 1)
                watch_layers(hooks, blocks, last, folder(component))
            with torch.inference_mode(), layers_stay(self.model):
                self.model(**batch.inputs, return_dict=True)
        missed = [(c, i) for c, counts in folded.items() for i, k in enumerate(counts) if k != 1]
        if missed:  # a block skipped or run twice: the first batch's check cannot have seen it
            raise IsotuiError(
                f"model {type(self.model).__name__} skipped or repeated the block of {missed[0][0]} "
                f"layer {missed[0][1]} on a batch, which its first batch ran once: isotui cannot read "
                "its layers one by one; please report it"
            )

    def _module_forward(self, batch: Batch, index: dict[tuple[Any, ...], tuple[Any, ...]]) -> None:
        """``--modules`` (or the sites given): run the model with a hook on every site. The first
        batch keeps what each site gives, orders the sites by when they first ran (the rows'
        order, per component), checks ``returned_by`` and makes the accumulators from those
        tensors; later batches fold each site in its hook. A site must run once per forward pass
        and give a (batch, position, d) tensor."""
        import torch

        from isotui.extract.modules import read_value, resolve, site_tensor

        if self.module_sites is None:
            config = getattr(self.model, "config", None)
            if getattr(config, "is_encoder_decoder", False):
                raise IsotuiError(
                    f"--modules reads the modules of one stack of positions, and {type(self.model).__name__} "
                    "is an encoder-decoder model: measure it without --modules"
                )
            self.module_sites = resolve(
                self.model, self.loaded.model_type, tuple(self.opts.modules or ()), self.notes
            )
        sites = self.module_sites
        first = self.plan is None
        calls = [0] * len(sites)
        got: dict[int, Any] = {}  # first batch: site -> its tensor, in the order they ran
        returned: dict[int, Any] = {}  # first batch: site -> what its returned_by module returned

        def hook_for(k: int) -> Any:
            def hook(_m: Any, *args: Any) -> None:
                calls[k] += 1
                if calls[k] > 1:
                    return
                tensor = site_tensor(sites[k], read_value(sites[k], args), batch.inputs)
                if first:  # kept to the end of the pass: a copy, whatever the model does in place
                    got[k] = tensor.clone()
                else:
                    self._fold(batch, index, *self.module_rows[k], tensor)

            return hook

        def keep_returned(k: int) -> Any:
            return lambda _m, _i, out: returned.__setitem__(k, out[0] if isinstance(out, tuple) else out)

        with Hooks() as hooks, self.loop.model_call(f"a batch of {self.loaded.modality}"):
            for k, site in enumerate(sites):
                if site.read == "input":
                    hooks.pre(site.module, hook_for(k), with_kwargs=True)
                else:
                    hooks.forward(site.module, hook_for(k))
            for k, (module, _sentence) in self.returned_by.items() if first else ():
                hooks.forward(module, keep_returned(k))
            with torch.inference_mode():
                if self.loaded.family.startswith("timm") or self.loaded.family == "module":
                    hidden_states(self.loaded, batch.inputs)  # their own forward
                else:
                    with layers_stay(self.model):
                        self.model(**batch.inputs, return_dict=True)
        wrong = next((k for k, n in enumerate(calls) if n != 1), None)
        if wrong is not None:
            times = "did not run" if calls[wrong] == 0 else f"ran {calls[wrong]} times"
            said = f"module {sites[wrong].label} {times} in a forward pass of {type(self.model).__name__}"
            said += "; isotui measures a module that runs once per pass"
            raise IsotuiError(f"--modules: {said}: leave it out of the globs" if self.opts.modules else said)
        if not first:
            return
        by_component: dict[str, list[int]] = {}  # dicts keep the order they ran in
        for k in got:
            by_component.setdefault(sites[k].component, []).append(k)
        self.module_rows = {k: (c, row) for c, ks in by_component.items() for row, k in enumerate(ks)}
        self._first_batch({c: tuple(got[k] for k in ks) for c, ks in by_component.items()}, {})
        for k, (_module, sentence) in self.returned_by.items():
            if not torch.equal(got[k], returned[k]):
                raise IsotuiError(sentence)
        with torch.inference_mode():
            for k, tensor in got.items():
                self._fold(batch, index, *self.module_rows[k], tensor)

    def _hooks_agree(
        self,
        components: HiddenStates,
        sites: Sites,
        seen: dict[str, dict[int, list[Any]]],
        hook_out: dict[str, Any],
    ) -> dict[str, tuple[list[Any], Any]] | None:
        """The blocks (and final norm) to fold each layer in the hook of, per component, when
        the first batch's hooked tensors are the very hidden states the model returned (every
        block ran once, each tensor equal on the same device, NaN to NaN); None otherwise (the
        run keeps ``output_hidden_states``, and its notes say why)."""
        import torch

        if self.loaded.family.startswith("timm") or self.loaded.family == "module":  # their own path
            return None
        if set(sites) != set(components):
            self.notes.append(
                "every batch's hidden states are held at once (output_hidden_states): no stack of "
                "blocks was found to read them one by one"
            )
            return None
        out: dict[str, tuple[list[Any], Any]] = {}
        for component, hidden in components.items():
            blocks = sites[component]
            got = seen[component]
            last = None
            norm = self.final_norm_by.get(component)
            if norm is not None:
                last = dict(self.model.named_modules())[norm]
                normed = hook_out[norm]
                got = {**got, len(blocks): [normed[0] if isinstance(normed, tuple) else normed]}
            wanted = len(blocks) + 1
            same = len(hidden) == wanted and all(
                len(got.get(i, ())) == 1
                and isinstance(got[i][0], torch.Tensor)
                and got[i][0].device == h.device
                and got[i][0].shape == h.shape
                and same_values(got[i][0], h)
                for i, h in enumerate(hidden)
            )
            if not same:
                self.notes.append(
                    "every batch's hidden states are held at once (output_hidden_states): this "
                    "model's blocks do not give them one by one"
                )
                return None
            out[component] = (blocks, last)
        return out

    def _index(self, fed: Fed, component: str, h: Any) -> tuple[Any, Any, Any]:
        """Which units of a layer are kept (``flat`` rows of its sequence, None: all units), and
        each unit's sample (0..B-1) and position; on the host, from the host's masks."""
        import torch

        b = h.shape[0]
        if h.ndim == 2 or (h.ndim == 4 and self.map_units == "image"):
            return None, torch.arange(b), torch.zeros(b, dtype=torch.long)
        if h.ndim == 4:
            hw = h.shape[2] * h.shape[3]
            return None, torch.arange(b).repeat_interleave(hw), torch.arange(hw).repeat(b)
        width = h.shape[1]
        keep = self.loop.keep(fed, component, width)
        flat = keep.flatten().nonzero().squeeze(1)
        return flat, flat // width, flat % width

    def _weights(self, fed: Fed, component: str, h: Any, flat: Any) -> tuple[Any, Any]:
        """Type-uniform weights and self-similarity slots of a token layer's kept units; (None,
        None) for other layers (maps, CANINE's downsampled molecules: their units are not tokens).
        Self-similarity follows the encoder's (or the single stack's) tokens only."""
        import torch

        table = self.type_weights.get(component)
        kept = self._token_ids(fed, component, h, flat)
        if table is None or kept is None:
            return None, None
        picked = kept.numpy()
        inside = picked < len(table)
        w = np.where(inside, table[np.minimum(picked, len(table) - 1)], 0.0)
        slots = None
        if self.tracked is not None and self.n_tracked and component != "decoder":
            ok = picked < len(self.tracked)
            slot = np.where(ok, self.tracked[np.minimum(picked, len(self.tracked) - 1)], -1)
            slots = torch.from_numpy(np.where(slot < self.n_tracked, slot, -1).astype(np.int64))
        return torch.from_numpy(w), slots

    def _token_ids(self, fed: Fed, component: str, h: Any, flat: Any) -> torch.Tensor | None:
        """The token ids of a token layer's kept units (``flat``), on the host; None for other
        layers (maps, pooled vectors, CANINE's downsampled molecules: their units are not tokens).
        The decoder of an encoder-decoder reads ``decoder_input_ids``."""
        key = "decoder_input_ids" if component == "decoder" else "input_ids"
        token_ids = fed.inputs.get(key)
        if token_ids is None or h.ndim != 3 or h.shape[1] != token_ids.shape[1]:
            return None
        return token_ids.flatten()[flat]

    def _vectors(self, h: Any, flat: Any) -> Any:
        """The layer's unit vectors (m x d), in the order of :meth:`_index`."""
        b = h.shape[0]
        if h.ndim == 2:
            return h
        if h.ndim == 4 and self.map_units == "image":
            return h.reshape(b, -1)
        if h.ndim == 4:
            return h.permute(0, 2, 3, 1).reshape(b * h.shape[2] * h.shape[3], h.shape[1])
        return h.reshape(-1, h.shape[-1]).index_select(0, flat)

    def _unit_dim(self, h: Any) -> int:
        if h.ndim == 4:
            return int(h.shape[1] * h.shape[2] * h.shape[3]) if self.map_units == "image" else int(h.shape[1])
        return int(h.shape[-1])

    def _vector_bound(self, h: Any) -> int | None:
        """The most vectors a layer shaped like ``h`` (this first batch's) gives over the run: a
        flattened map one per image, a map's positions H x W per image, a ViT's tokens per
        image, text at most its tokens; None where it cannot be told (a streamed corpus, audio)."""
        plan = self.loop.plan
        lengths = plan.run_lengths()
        if lengths is None:
            return None
        n = len(lengths)
        if h.ndim == 4:
            return n if self.map_units == "image" else n * int(h.shape[2]) * int(h.shape[3])
        if h.ndim == 2:
            return n
        if self.loaded.modality == "text":
            return int(lengths.sum())
        if self.loaded.modality == "image":
            return n * int(h.shape[1])
        return None

    def _first_batch(self, components: HiddenStates, hook_out: dict[str, Any]) -> None:
        import torch

        dims = {c: [self._unit_dim(h) for h in hidden] for c, hidden in components.items()}
        self.saw_maps = any(h.ndim == 4 for hidden in components.values() for h in hidden)
        if self.saw_maps and self.map_units == "image":
            self.map_shapes = {
                c: [[int(n) for n in h.shape[1:]] if h.ndim == 4 else None for h in hidden]
                for c, hidden in components.items()
            }
        all_dims = [d for ds in dims.values() for d in ds]
        self.max_dim = max(all_dims)
        # the most frequent types, up to SELF_SIM_TYPES: as many as the plan finds room for (a
        # dry run, which reads no corpus, plans SELF_SIM_TYPES and says it is an estimate)
        asked = 0 if self.tracked is None else int(min(SELF_SIM_TYPES, int((self.tracked >= 0).sum())))
        # each layer's sums on its hidden states' device (no float64 on MPS: there, the CPU)
        where = {c: [_acc_device(h.device) for h in hidden] for c, hidden in components.items()}
        for dev in {str(d) for ds in where.values() for d in ds}:  # a model across several GPUs
            ensure_scheme(dev)
        # the plan is kept last, once every sum exists: it marks the first batch done, and a
        # first batch that ran out of memory making its sums runs again from the start
        if self.plan_sums is not None:  # another pass's plan (final-norm's)
            plan = self.plan_sums(dims, where)
        else:
            bounds = {c: [self._vector_bound(h) for h in hidden] for c, hidden in components.items()}
            plan = _memory_plan(
                self.loaded,
                self.loop,
                dims,
                where,
                asked,
                self.opts.reservoir,
                self.max_length or None,
                bounds,
                self.room,
            )
            if self.opts.settle_plan is not None:  # a shard: its run's one plan
                plan = self.opts.settle_plan(plan)
        layer_plans = iter(plan.layers)
        if self.token_folds is not None:  # each layer's fold where its plan puts it
            make = self.token_folds.make
            self.folds = {
                c: [make(d, torch.device(p.device)) for d, p in zip(ds, layer_plans, strict=False)]
                for c, ds in dims.items()
            }
        else:
            self.accs = {  # each layer's sums where its plan puts them (the layer run's: ``where``)
                c: [
                    LayerAccumulator(
                        d,
                        torch.device(p.device),
                        full_cov=p.exact_cov,
                        reservoir=p.reservoir,
                        types=p.types,
                        metrics=self.opts.metrics,
                    )
                    for d, p in zip(ds, layer_plans, strict=False)
                ]
                for c, ds in dims.items()
            }
        self.n_tracked = max((p.types for p in plan.layers), default=0)
        self.reservoir_capped = any(p.reservoir < self.opts.reservoir for p in plan.layers)
        self.plan = plan
        for component, hidden in components.items():
            last = hidden[-1]
            self.final_norm[component] = False
            for name, out in hook_out.items():
                normed = out[0] if isinstance(out, tuple) else out
                same = isinstance(normed, torch.Tensor) and normed.shape == last.shape
                if same and same_values(normed, last):
                    self.final_norm[component] = True
                    self.final_norm_names.append(name)
                    self.final_norm_by[component] = name
                    break


def same_values(a: Any, b: Any) -> bool:
    """``torch.equal``, NaN equal to NaN where both have it: the first batch's checks (the hooks
    give the very hidden states, the final norm made the last) hold for a layer of NaN too."""
    import torch

    if torch.equal(a, b):
        return True
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def _keeper(seen: dict[int, list[Any]]) -> Any:
    """Hooks for :func:`watch_layers` that keep what each layer's hook sees, in ``seen[i]``."""

    def hook_for(i: int) -> Any:
        return lambda _m, *args: seen.setdefault(i, []).append(layer_tensor(i, args))

    return hook_for


def _acc_device(device: Any) -> Any:
    """Where a layer's float64 sums live: its hidden states' device (the CPU for MPS)."""
    import torch

    return torch.device("cpu") if device.type == "mps" else device


def _memory_plan(
    loaded: LoadedModel,
    loop: BatchLoop,
    dims: dict[str, list[int]],
    where: dict[str, list[Any]],
    types: int,
    reservoir: int,
    max_length: int | None,
    bounds: dict[str, list[int | None]] | None = None,
    room: Budgets | None = None,
) -> MemoryPlan:
    """The run's memory plan, made after the model is placed and its first batch has run: each
    device's budget shared out by :func:`plan_layers`, after the self-similarity sums of as many
    of the ``types`` asked as fit (:func:`fit_types`); ``bounds``: per layer, the most vectors it
    will see (a reservoir holds no more). A device that ``--max-memory`` bounds has the budget
    the dry run plans (``room``, :func:`planned_room`), and its measured free memory may only
    stop the run; any other device has its measured free memory less the margin."""
    devices = {str(d) for ds in where.values() for d in ds}
    given = dict(loop.opts.max_memory or ())
    bound = {d for d in devices if room is not None and device_key(d) in given}
    memory = {d: measured_memory(d) for d in sorted(devices)}
    free, measured = {d: m[0] for d, m in memory.items()}, {d: m[1] for d, m in memory.items()}
    budgets = {d: room.budgets[d] if room is not None and d in bound else measured[d] for d in measured}
    weights = weights_per_device(loaded.model, loaded.device_map, loop.device)
    offload = offload_bytes(loaded.model, loaded.device_map, loop.device)
    asked = types
    tracks = [
        (dim, str(dev), c != "decoder")
        for c, ds in dims.items()
        for dim, dev in zip(ds, where[c], strict=True)
    ]
    types = fit_types(tracks, budgets, asked, reservoir_floor(reservoir))
    layers = [
        (f"layer {i}" if c == "model" else f"{c} layer {i}", dim, str(dev), 0 if c == "decoder" else types)
        for c, ds in dims.items()
        for i, (dim, dev) in enumerate(zip(ds, where[c], strict=True))
    ]
    opts = loop.opts
    vectors = [v for c in dims for v in (bounds or {}).get(c, [None] * len(dims[c]))]
    act_bytes = _value_bytes(loaded.model)
    # the batch the loop cuts: the plan's under --max-memory, else its token budget (halved only
    # on out-of-memory)
    length = max_length or 0
    tokens = room.tokens if room is not None else batch_tokens(opts.batch_size, length, loop.device, {})
    plan = MemoryPlan(
        plan_layers(layers, budgets, reservoir, vectors),
        budgets,
        weights=weights,
        reservoir_asked=reservoir,
        batch=batch_line(opts.batch_size, loop.device, max_length, room.tokens if room else None),
        types_asked=asked,
        batch_tokens=tokens if max_length else 0,
        act_bytes=act_bytes,
        mlp_width=mlp_width(getattr(loaded.model, "config", None), max(max(ds) for ds in dims.values())),
        offload=offload,
        resident=loaded.resident_before,
    )
    # measured with the weights loaded: what they take is out of the free memory already
    plan.free = {d: f for d, f in free.items() if d not in bound}
    plan.refuse_below_floor(None, {}, "the free memory", plan.free)
    for device in sorted(bound):  # the plan --max-memory allows: may this machine hold it?
        need, left, have = plan.per_device().get(device, 0), measured[device], free[device]
        if left is not None and have is not None and need > left:
            raise IsotuiError(
                f"--max-memory {device_key(device)}={size_text(given[device_key(device)])} plans "
                f"{size_text(need)} of isotui's sums on {device}, but {device} has {size_text(left)} "
                f"left here after the weights, the first batch and the margin kept free: free "
                f"{size_text(room_for(need) - have, up=True)} more there, or give it less with --max-memory"
            )
    return plan


def _value_bytes(model: Any) -> int:
    """Bytes per value of the model's weights (and so of its hidden states): 4, or 2 in half."""
    first = next(iter(model.parameters()), None)
    return DTYPE_BYTES.get(str(first.dtype).removeprefix("torch."), 4) if first is not None else 4


def _room(loaded: LoadedModel, main: str, opts: ExtractOptions, length: int | None) -> Budgets | None:
    """The budgets and first batch of the dry run's arithmetic (:func:`sums_budgets`) for this
    loaded model: ``--max-memory``'s bytes where it names a device, else its free memory now;
    None for models whose config gives no ``hidden_size`` and ``num_hidden_layers`` (the dry
    run plans none of them) or no length (images, audio)."""
    config = loaded.model.config
    dim, n_blocks = getattr(config, "hidden_size", None), getattr(config, "num_hidden_layers", None)
    if not isinstance(dim, int) or not isinstance(n_blocks, int) or not length:
        return None
    if getattr(config, "is_encoder_decoder", False) or loaded.modality != "text":
        return None
    where = hidden_state_devices(loaded.model, loaded.device_map or {"": main}, main, n_blocks)
    weights = weights_per_device(loaded.model, loaded.device_map, main)
    offload = offload_bytes(loaded.model, loaded.device_map, main)
    given = dict(opts.max_memory or ())
    have: dict[str, int | None] = {}
    for dev in dict.fromkeys([*where, "cpu"]):
        mine = given.get(device_key(dev))
        have[dev] = mine if mine is not None else available_memory(dev)
    return sums_budgets(
        have,
        weights,
        where,
        dim=dim,
        inter=mlp_width(config, dim),
        act_bytes=_value_bytes(loaded.model),
        batch_size=opts.batch_size,
        length=length,
        main=main,
        reservoir=opts.reservoir,
        offload=offload,
    )


def planned_room(loaded: LoadedModel, main: str, opts: ExtractOptions, length: int) -> Budgets | None:
    """Under ``--max-memory`` (a device map), the budgets and first batch the dry run plans,
    made before the first batch so that the batches are cut to it; None otherwise."""
    if not opts.max_memory:
        return None
    return _room(loaded, main, opts, length)


def extract(
    loaded: LoadedModel,
    samples: Sequence[str],
    *,
    device: str,
    opts: ExtractOptions,
    on_progress: ProgressCallback = no_progress,
    should_stop: StopCheck = never_stop,
    model_name: str = "",
    modality: str = "text",
) -> Extraction:
    """Measure every hidden layer of ``loaded`` over ``samples`` (see design.md for metrics)."""
    stream, facts = _stream(loaded, samples, device, opts, on_progress, should_stop, model_name, modality)
    assert stream.accs is not None
    ex = _finish(stream.accs, facts, on_progress, facts.pop("at"), facts.pop("estimate"))
    if opts.keep_sample:  # before --exact's second pass frees the reservoirs
        from isotui.extract.sample import reservoir_sample

        config = getattr(loaded.model, "config", None)
        ex.sample = reservoir_sample(stream.accs, stream.loop.feeder, loaded.tokenizer, opts.seed, config)
    if opts.exact and any(s.n_sample < s.n_vectors for stats in ex.components.values() for s in stats):
        before = len(stream.notes)
        ex.components = _exact_pass(stream, ex.components, facts["n_samples"], on_progress)
        ex.notes.extend(stream.notes[before:])
    return ex


def extract_state(
    loaded: LoadedModel,
    samples: Sequence[str],
    *,
    device: str,
    opts: ExtractOptions,
    on_progress: ProgressCallback = no_progress,
    should_stop: StopCheck = never_stop,
    model_name: str = "",
    modality: str = "text",
) -> dict[str, Any]:
    """:func:`extract`'s streamed state instead of its metrics: per component, each layer's
    accumulator state, and the run's facts. Shards (``opts.sample_ids``) merge with
    :func:`merge_extraction_states`; :func:`finish_extraction` turns a state into the metrics."""
    stream, facts = _stream(loaded, samples, device, opts, on_progress, should_stop, model_name, modality)
    assert stream.accs is not None
    for name in ("start", "at", "estimate"):  # a clock reading, a live event: meaningless elsewhere
        facts.pop(name)
    return {"components": {c: [a.state() for a in accs] for c, accs in stream.accs.items()}, **facts}


def merge_extraction_states(states: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One state from the states of disjoint shards of the same corpus (same model and options):
    accumulators merged (see :meth:`LayerAccumulator.merge`), counts and seconds added. The
    states are folded one at a time into a running sum, so that an iterator that reads each
    state when asked holds at most one state beside the sum."""
    accs: dict[str, list[LayerAccumulator]] | None = None
    every: list[dict[str, Any]] = []  # each state's facts, without its accumulators
    it = iter(states)
    while (state := next(it, None)) is not None:
        every.append({k: v for k, v in state.items() if k != "components"})
        accs = _fold_state(accs, state)
        del state  # the next state is read with only the running sum held
        release_free_memory()  # and its pages given back, not kept in the heap
    if accs is None:
        raise ValueError("nothing to merge")
    facts = merge_facts(every, any_of=("saw_maps", "reservoir_capped"), max_of=("max_dim",))
    audio = [s["audio_seconds"] for s in every if s["audio_seconds"] is not None]
    return {
        **facts,
        "components": {c: [a.state() for a in layer_accs] for c, layer_accs in accs.items()},
        "audio_seconds": sum(audio) if audio else None,
    }


def _fold_state(
    accs: dict[str, list[LayerAccumulator]] | None, state: dict[str, Any]
) -> dict[str, list[LayerAccumulator]]:
    """The running sum with one more shard's state merged in (the first state starts it)."""
    if accs is None:
        return {
            c: [LayerAccumulator.from_state(s) for s in layer_states]
            for c, layer_states in state["components"].items()
        }
    if list(state["components"]) != list(accs):
        raise ValueError("cannot merge the states of runs with different components")
    for c, layer_states in state["components"].items():
        for acc, s in zip(accs[c], layer_states, strict=True):
            acc.merge(LayerAccumulator.from_state(s, copy=False))  # merged in, not copied first
            # the reservoir it replaced is a hole the next, larger, one does not fit: given back
            release_free_memory()
    return accs


def finish_extraction(state: dict[str, Any], *, own: bool = False) -> Extraction:
    """The per-layer metrics of a (possibly merged) :func:`extract_state`. ``own``: the state is
    this call's to use up (a merge's): its tensors are finalised in place, not copied first."""
    accs = {
        c: [LayerAccumulator.from_state(s, copy=not own) for s in states]
        for c, states in state["components"].items()
    }
    facts = {k: v for k, v in state.items() if k != "components"}
    return _finish(accs, facts)


def _stream(
    loaded: LoadedModel,
    samples: Sequence[str],
    device: str,
    opts: ExtractOptions,
    on_progress: ProgressCallback,
    should_stop: StopCheck,
    model_name: str,
    modality: str,
) -> tuple[LayerStream, dict[str, Any]]:
    """Run the batches; (the stream with its accumulators, the facts :func:`_finish` needs)."""
    max_length = effective_max_length(loaded, opts, model_name, on_progress)
    room = planned_room(loaded, device, opts, max_length)
    if room is not None and not opts.batch_size:  # batches cut to the plan's first batch
        opts = replace(opts, token_budget=room.tokens)
    loop = BatchLoop(loaded, device, opts, on_progress, should_stop)
    stream = LayerStream(loop)
    stream.room = room
    total = len(samples) if opts.sample_ids is None else len(selected_ids(len(samples), opts.sample_ids))
    start = time.perf_counter()
    unit = "tokenising" if modality == "text" else "reading"
    on_progress(
        Progress(0, total, 0, 0.0, stage="prepare", phase="tokenising", detail=f"{unit} {total} samples")
    )
    stream.prepare(samples, modality, max_length)
    tokenise_s = time.perf_counter() - start
    start = time.perf_counter()
    on_progress(Progress(0, total, 0, 0.0, phase="running"))
    estimate: float | None = None

    def finalize_left(batch_no: int) -> float | None:  # refreshed as the reservoirs fill
        nonlocal estimate
        if estimate is None or batch_no % 8 == 0:
            estimate = finalize_estimate_s(stream.accs)
        return estimate

    done = loop.run(stream, start=start, finalize_left=finalize_left)
    if stream.accs is None:
        raise IsotuiError("no sample to measure: the selected sample ids are empty")
    if stream.plan is not None:  # the table's notes say what --dry-run says
        stream.notes.extend(stream.plan.notes())
    first = next(iter(stream.accs.values()))[0]
    if first.n_all == 0:
        raise IsotuiError(
            f"no token of the {total} samples was kept: all were special tokens or padding; use "
            "--special-tokens include or a larger --max-length"
        )
    elapsed = time.perf_counter() - start
    memory = memory_in_use(device)
    feeder = loop.feeder
    audio = getattr(feeder, "seconds", None)  # the whole corpus's; a shard's own below
    if audio is not None and opts.sample_ids is not None:
        audio = float(feeder.n_samples[loop.selected()].sum()) / feeder.rate
    facts = {
        "final_norm": stream.final_norm,
        "final_norm_module": ", ".join(stream.final_norm_names) or None,
        "n_samples": total,
        "n_tokens": done.units,
        "max_length": max_length,
        "start": start,
        "seconds": elapsed,
        "notes": stream.notes,
        "map_units": stream.map_units,
        "map_units_asked": opts.map_units,
        "saw_maps": stream.saw_maps,
        "reservoir_capped": stream.reservoir_capped,
        "max_dim": stream.max_dim,
        "audio_seconds": audio,
        "tokenise_s": tokenise_s,
        "forward_s": loop.feed_s + stream.forward_s,
        "metrics_s": stream.metrics_s,
        "at": Progress(done.samples, total, done.units, elapsed, memory_bytes=memory),
        "estimate": estimate,
        "exact": opts.exact,
        "memory_plan": stream.plan.to_json() if stream.plan is not None else None,
        "map_shapes": stream.map_shapes,
        "modules": _module_labels(stream),
    }
    return stream, facts


def _module_labels(stream: LayerStream) -> list[str] | None:
    """``--modules``: each row's module, in the order they ran (None for a run by layers)."""
    if stream.module_sites is None:
        return None
    by_row = sorted(stream.module_rows.items(), key=lambda item: item[1])
    return [stream.module_sites[k].label for k, _row in by_row]


def _finish(
    accs: dict[str, list[LayerAccumulator]],
    facts: dict[str, Any],
    on_progress: ProgressCallback = no_progress,
    at: Progress | None = None,
    estimate: float | None = None,
) -> Extraction:
    """Metrics and notes from the accumulators and the facts of :func:`_stream` (or a merge);
    ``at``: the last running event, from which finalisation's per-layer events go on."""
    begin = time.perf_counter()
    notes = list(facts["notes"])
    components = finalize_all(accs, on_progress, at or Progress(0, 0, 0, 0.0), estimate, notes=notes)
    finalize_s = time.perf_counter() - begin
    all_stats = [s for stats in components.values() for s in stats]
    notes.extend(nonfinite_notes(accs, facts.get("modules")))
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
        memory_plan=facts.get("memory_plan"),
        map_shapes=facts.get("map_shapes"),
        modules=facts.get("modules"),
        map_units=facts["map_units"] if facts["saw_maps"] else None,
        audio_seconds=facts["audio_seconds"],
        timings={
            "tokenise_s": facts.get("tokenise_s", 0.0),
            "forward_s": facts.get("forward_s", 0.0),
            "metrics_s": facts.get("metrics_s", 0.0),
            "finalise_s": finalize_s,
        },
    )


def _exact_pass(
    stream: LayerStream,
    components: dict[str, list[LayerStats]],
    total: int,
    on_progress: ProgressCallback,
) -> dict[str, list[LayerStats]]:
    """``--exact``: run the corpus again, folding every vector into :class:`ExactPass` with the
    first pass's mean, std and eigenvectors, and replace the sampled metrics by the exact ones."""
    assert stream.accs is not None
    second: dict[str, list[ExactPass]] = {}
    stream.second = second
    for c, accs in stream.accs.items():
        second[c] = []
        for acc in accs:
            second[c].append(ExactPass(acc))
            acc.gram = acc.res = None  # finalized: free the d x d sums before the next layer's
    start = time.perf_counter()
    on_progress(Progress(0, total, 0, 0.0, message="second pass over the data (--exact)"))
    stream.loop.run(stream, phase="second pass", start=start)
    out = {c: [p.apply(s) for p, s in zip(second[c], stats, strict=True)] for c, stats in components.items()}
    stream.notes.extend(_exact_notes(second))
    stream.second = None
    return out


def _exact_notes(second: dict[str, list[ExactPass]]) -> list[str]:
    """Say what the second pass computed over every vector, and where it fell back to the sample."""
    passes = [p for ps in second.values() for p in ps]
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
            f"sample (with standard errors): their d x d covariance is not held (it did not fit the "
            "memory left on their device: see the memory plan note)"
        )
    return notes


def nonfinite_notes(accs: dict[str, list[LayerAccumulator]], modules: list[str] | None = None) -> list[str]:
    """One sentence naming each layer (``modules``: each row's module, ``--modules``) whose
    vectors held NaN or inf values, with how many and in how many vectors: those layers' metrics
    are NaN (:meth:`LayerAccumulator.finalize`), their rows kept so every layer keeps its number;
    the other layers are measured as usual."""
    parts = []
    for component, layer_accs in accs.items():
        for i, acc in enumerate(layer_accs):
            bad = acc.nonfinite
            if not bad:
                continue
            if modules:
                where = f"module {modules[i]}"
            else:
                where = f"layer {i}" if component == "model" else f"{component} layer {i}"
            parts.append(
                f"{where} held {bad:,} NaN or inf value{'s' if bad != 1 else ''} in "
                f"{acc.nonfinite_vectors:,} of its {acc.n_all:,} vectors"
            )
    if not parts:
        return []
    which = "its" if len(parts) == 1 else "their"
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return [
        f"{listed}: {which} metrics are NaN (a sum over a NaN or an inf has no value), the other "
        "layers are measured as usual"
    ]


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


def _sample_notes(facts: dict[str, Any], stats: list[LayerStats]) -> list[str]:
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
    held = sum(s.spectrum_from == "all" for s in partial)
    if sampled and held:
        where = "" if held == len(partial) else f" in {held} of those layers"
        note += (
            f"; I(W)'s and all-but-the-top's directions are exact{where} (the eigenvectors of the "
            "d x d covariance and second moment over every vector): only their sums over vectors "
            "are sampled"
        )
    if not facts.get("exact"):
        note += (
            f"; ± their standard errors from {SE_GROUPS} disjoint sub-samples (the *_se columns; "
            "--exact computes them over every vector)"
        )
        if any(s.dim > EIGEN_JACKKNIFE_MAX_DIM and s.spectrum_from != "all" for s in partial):
            note += (
                f"; I(W) and all-but-the-top have none in layers wider than {EIGEN_JACKKNIFE_MAX_DIM:,} "
                "dims (16 more eigendecompositions each)"
            )
    if facts["reservoir_capped"]:
        note += (
            "; the sample is capped so that the layers' samples fit the memory left on their device "
            f"(d up to {facts['max_dim']:,}; see the memory plan note)"
        )
    return [note]
