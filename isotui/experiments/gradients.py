"""The gradient view of anisotropy: loss gradients with respect to every layer's hidden states.

For a language model (causal LM for decoders, masked LM for encoders, loaded with its head from
the same name), each kept token's gradient g_i = dL/dh_i at every layer (layer 0: the embedding
output, as in the layer table). Per layer: the gradients' anisotropy (``grad_avg_cos``, exact
over all pairs; ``grad_drift_norm``; ``grad_mean_norm``), and the share of gradient energy that
falls inside the top-k principal directions of the same layer's activations,
sum_i ||P_k g_i||^2 / sum_i ||g_i||^2, against k/d and a measured seeded random k-dimensional
subspace. One pass: per layer the sums of g g^T and of the (shifted) x x^T, in float64 (see
:mod:`isotui.core.gradients`).

Definitions that keep every number independent of batching:
- the loss is the SUM of token losses (cross-entropy, nats), never a batch mean, so a token's
  gradient is the gradient of its own sample's loss, whatever the batch size or padding;
- causal LM: every real token after the first is a target (padding never); a sample's last token
  is left out of the statistics (no loss depends on it: its gradient is zero at every layer);
- masked LM: 15% of each sample's non-special tokens are masked (all replaced by the mask token),
  chosen by a seeded hash of (seed, sample, position), at least one per sample; the loss is on
  the masked positions only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, ClassVar, TypedDict, cast

from isotui.errors import IsotuiError
from isotui.experiments import plans
from isotui.experiments.base import Arrays, Context, Experiment, Payload, Rows
from isotui.experiments.cached_request import CachedRequest
from isotui.experiments.json_types import from_fields
from isotui.experiments.params import param, positive
from isotui.extract.objective import MASK_RATE
from isotui.extract.objective import mlm_mask as mlm_mask  # importable from here too

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

    from isotui.core.accumulator import Sums
    from isotui.core.gradients import GradAccumulator
    from isotui.experiments.layer_pass import Prepared
    from isotui.extract.progress import ProgressCallback, StopCheck
    from isotui.spec import RunSpec
    from isotui.store.cache import ResultCache

HELP = "loss gradients w.r.t. hidden states: their anisotropy and share in the activations' top PCs"
FOLDER = "gradients"  # the result cache's folder for this experiment
SCHEMA = 1
OFFLINE_LMS = (
    "random:bert:num_hidden_layers=4 (untrained) or a checkpoint folder of `isotui train-tiny` "
    "(e.g. runs/tiny/step_000400, trained)"
)


@dataclass
class GradientRow:
    """One layer (the CSV of ``--csv``)."""

    model: str
    objective: str  # causal or masked
    component: str
    layer: int
    dim: int
    n_vectors: int
    n_zero: int
    grad_avg_cos: float
    grad_drift_norm: float
    grad_mean_norm: float
    act_avg_cos: float
    top_k: int
    top_share: float
    random_share: float
    expected_share: float
    act_top_var: float
    grad_top_share: float


class GradientMeta(TypedDict, total=False):
    """A gradient result's facts (every key set by a measurement; read with ``.get``)."""

    data: str
    n_samples: int
    lm_class: str
    loss_tokens: int
    loss_per_token: float
    special_tokens: str
    dtype: str
    seed: int
    seconds: float
    source: str  # a gradient result of the training's own backward (isotui.callbacks)
    n_tokens: int


@dataclass
class GradientResult:
    model: str
    objective: str
    rows: list[GradientRow]
    notes: list[str] = field(default_factory=list)
    meta: GradientMeta = field(default_factory=lambda: GradientMeta())
    from_cache: bool = False


class GradientFacts(TypedDict):
    """What a pass of gradients knew besides the accumulators (see :func:`gradients_state`)."""

    model: str
    objective: str
    top_k: int
    seed: int
    model_notes: list[str]
    data: str
    n_samples: int
    lm_class: str
    loss_sum: float
    loss_tokens: int
    special_tokens: str
    dtype: str
    seconds: float


class GradientsState(GradientFacts):
    """A (possibly merged) streamed state: per layer the accumulator's state."""

    accumulators: list[Sums]


@dataclass(frozen=True)
class GradientsRequest(CachedRequest[GradientResult]):
    """Loss gradients w.r.t. hidden states (``isotui experiment gradients``)."""

    top_k: int = 10
    kind: ClassVar[str] = "gradients"

    def _folder(self) -> tuple[str, int, dict[str, object]]:
        return FOLDER, SCHEMA, {"top_k": self.top_k}

    def _measure(self, cache: ResultCache | None, context: Context) -> GradientResult:
        if self.spec.given is None:  # a model object: its head is checked where it is loaded
            _refuse_bundled(self.spec.model)
        return super()._measure(cache, context)

    def _compute(self, prepared: Prepared, context: Context) -> GradientResult:
        return measure_gradients(
            self.spec,
            top_k=self.top_k,
            on_progress=context.on_progress,
            should_stop=context.should_stop,
            prepared=prepared,
        )

    def _encode(self, result: GradientResult) -> tuple[dict[str, object], Arrays]:
        return {k: v for k, v in asdict(result).items() if k != "from_cache"}, {}

    def _decode(self, payload: Mapping[str, object], arrays: Arrays) -> GradientResult:
        return gradients_from_payload(payload, arrays)


class GradientEntry(TypedDict):
    """A cache entry's payload (or a recorded step's ``gradients.json``): a GradientResult's fields."""

    model: str
    objective: str
    rows: list[dict[str, object]]  # each a GradientRow's fields
    notes: list[str]
    meta: dict[str, object]


def gradients_from_payload(payload: Mapping[str, object], _arrays: Arrays) -> GradientResult:
    """The result a cache entry holds (the payload :meth:`GradientsRequest._encode` stores)."""
    entry = cast("GradientEntry", payload)  # the cache checked its schema: the request's payload
    rows = [from_fields(GradientRow, r) for r in entry["rows"]]
    return GradientResult(
        entry["model"],
        entry["objective"],
        rows,
        entry["notes"],
        cast("GradientMeta", dict(entry["meta"])),  # what its GradientResult stored
    )


def _refuse_bundled(model: str) -> None:
    """The bundled MiniLM is a sentence encoder saved without its masked-LM head: no loss."""
    from isotui.models.naming import parse_model

    if parse_model(model).kind == "bundled":
        raise IsotuiError(
            f"model {model!r} (the bundled MiniLM) is a sentence encoder saved without its masked-LM "
            f"head, so it has no loss to differentiate; offline, use {OFFLINE_LMS}"
        )


def measure_gradients(
    spec: RunSpec,
    *,
    top_k: int = 10,
    on_progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
    prepared: Prepared | None = None,
) -> GradientResult:
    """Stream ``spec``'s data through the model with its LM head, backward to every hidden state."""
    accs, facts = _stream_gradients(spec, top_k, on_progress, should_stop, None, prepared)
    return _finish_gradients(accs, facts)


def gradients_state(
    spec: RunSpec,
    *,
    top_k: int = 10,
    sample_ids: tuple[int, ...] | None = None,
    on_progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
) -> GradientsState:
    """:func:`measure_gradients`'s streamed state over the samples ``sample_ids`` (global indices
    into ``spec``'s corpus, which also seed the masked-LM masks; None: all): per layer the
    accumulator state, and the loss sums. Shards merge with :func:`merge_gradients_states`."""
    accs, facts = _stream_gradients(spec, top_k, on_progress, should_stop, sample_ids)
    return {**facts, "accumulators": [a.state() for a in accs]}


def merge_gradients_states(states: list[GradientsState]) -> GradientsState:
    """One state from disjoint shards of the same corpus: accumulators merged, sums added."""
    from isotui.core.gradients import GradAccumulator

    accs = [GradAccumulator.from_state(s) for s in states[0]["accumulators"]]
    for other in states[1:]:
        for acc, s in zip(accs, other["accumulators"], strict=True):
            acc.merge(GradAccumulator.from_state(s))
    return {
        **states[0],
        "accumulators": [a.state() for a in accs],
        "loss_sum": sum(s["loss_sum"] for s in states),
        "loss_tokens": sum(s["loss_tokens"] for s in states),
        "n_samples": sum(s["n_samples"] for s in states),
        "seconds": sum(s["seconds"] for s in states),
    }


def finish_gradients(state: GradientsState) -> GradientResult:
    """The result of a (possibly merged) :func:`gradients_state`."""
    from isotui.core.gradients import GradAccumulator

    accs = [GradAccumulator.from_state(s) for s in state["accumulators"]]
    # a GradientsState less its accumulators: its GradientFacts
    return _finish_gradients(
        accs, cast("GradientFacts", {k: v for k, v in state.items() if k != "accumulators"})
    )


def _stream_gradients(
    spec: RunSpec,
    top_k: int,
    on_progress: ProgressCallback | None,
    should_stop: StopCheck | None,
    sample_ids: tuple[int, ...] | None,
    prepared: Prepared | None = None,
) -> tuple[list[GradAccumulator], GradientFacts]:
    """Stream the batches forward and backward (the layer stream's backward pass, with the model's
    LM objective); (per layer the accumulator, the facts to finish)."""
    import time

    from isotui.core.gradients import GradAccumulator
    from isotui.experiments.layer_pass import load_prepared, prepare, text_stream
    from isotui.extract.objective import lm_objective
    from isotui.extract.runner import GradFolds, LayerStream

    if top_k < 1:
        raise IsotuiError(f"top-k must be a positive integer (got {top_k})")
    if spec.given is None:  # a model object: its head is checked where it is loaded
        _refuse_bundled(spec.model)
    prepared = prepared or prepare(spec)
    if spec.data.modality != "text":
        raise IsotuiError("the gradient experiment reads language models; give text data")

    loaded, device = load_prepared(prepared, head="lm")
    model = loaded.model
    objective = lm_objective(loaded, spec.seed, spec.model)
    folds = GradFolds(
        make=GradAccumulator,  # one per layer, made at the first batch (all or, out of memory, none)
        check=lambda dims, where: _check_layers(dims, where, top_k, spec.model),
        not_sequence=f"model {spec.model!r} gives hidden states that are not token sequences",
        not_tokens=f"model {spec.model!r} has layers that are not one vector per input token",
    )
    stream = text_stream(
        prepared,
        loaded,
        device,
        lambda loop: LayerStream(loop, type_uniform=False, objective=objective, grad_folds=folds),
        on_progress=on_progress,
        should_stop=should_stop,
        sample_ids=sample_ids,
    )
    loop = stream.loop
    start = time.perf_counter()
    loop.run(stream, phase="", start=start)
    total = loop.total
    # the folds this stream's GradFolds made: GradAccumulators
    accs = cast("list[GradAccumulator]", stream.grad_folds_made or [])
    if not accs or accs[0].n_all == 0:
        raise IsotuiError(
            f"no token of the {total} samples was kept: all were special tokens, padding or last "
            "tokens; use --special-tokens include or longer samples"
        )
    facts: GradientFacts = {
        "model": spec.model,
        "objective": objective.kind,
        "top_k": top_k,
        "seed": spec.seed,
        "model_notes": list(loaded.notes),
        "data": prepared.spec.data.describe(),
        "n_samples": total,
        "lm_class": type(model).__name__,
        "loss_sum": float(stream.loss_sum),
        "loss_tokens": stream.loss_tokens,
        "special_tokens": spec.special_tokens,
        "dtype": prepared.dtype,
        "seconds": time.perf_counter() - start,
    }
    return accs, facts


def _finish_gradients(accs: list[GradAccumulator], facts: GradientFacts) -> GradientResult:
    from isotui.core.gradients import random_basis

    model, objective, top_k = facts["model"], facts["objective"], facts["top_k"]
    rows: list[GradientRow] = []
    bases: dict[int, npt.NDArray[np.float64]] = {}
    for layer, acc in enumerate(accs):
        if acc.dim not in bases:  # one seeded random subspace per hidden size
            bases[acc.dim] = random_basis(acc.dim, top_k, facts["seed"])
        s = acc.finalize(top_k, bases[acc.dim])
        rows.append(GradientRow(model, objective, "model", layer, top_k=top_k, **asdict(s)))
    loss_tokens = facts["loss_tokens"]
    return GradientResult(
        model,
        objective,
        rows,
        notes=[*facts["model_notes"], *_notes(objective, top_k)],
        meta={
            "data": facts["data"],
            "n_samples": facts["n_samples"],
            "lm_class": facts["lm_class"],
            "loss_tokens": loss_tokens,
            "loss_per_token": facts["loss_sum"] / loss_tokens if loss_tokens else math.nan,
            "special_tokens": facts["special_tokens"],
            "dtype": facts["dtype"],
            "seed": facts["seed"],
            "seconds": round(facts["seconds"], 3),
        },
    )


def _check_layers(dims: Sequence[int], where: Sequence[torch.device], top_k: int, model: str) -> None:
    """The first batch's refusals before the sums are made: a top-k not below every hidden
    size, sums that do not fit (:func:`check_gradient_room`)."""
    if top_k >= min(dims):
        raise IsotuiError(
            f"--top-k {top_k} is not below the hidden size {min(dims)} of model {model!r}; "
            f"use --top-k {min(dims) - 1} or less"
        )
    check_gradient_room(model, dims, [str(w) for w in where])


def check_gradient_room(model: str, dims: Sequence[int], where: Sequence[str]) -> None:
    """Refuse, before the sums are made, a model whose per-layer gradient sums (two d x d float64
    each, :func:`~isotui.extract.memory_plan.gradient_bytes`) exceed what a device has left: its
    measured free memory after the model is placed and the first batch has run, less the margin.
    They are exact or not at all (no sample stands in for a d x d sum)."""
    from isotui.extract.memory_plan import gradient_bytes, measured_budget, size_text

    need: dict[str, int] = {}
    for d, w in zip(dims, where, strict=True):
        need[w] = need.get(w, 0) + gradient_bytes(d)
    for w, n in need.items():
        budget = measured_budget(w)
        if budget is not None and n > budget:
            raise IsotuiError(
                f"model {model!r} needs {size_text(n)} on {w} for its per-layer d x d gradient sums "
                f"({where.count(w)} layers, d up to {max(dims)}), more than the {size_text(budget)} "
                f"{w} has left (its measured free memory less a margin); spread the model over more "
                "devices with --device-map and --max-memory"
            )


def _notes(objective: str, top_k: int) -> list[str]:
    if objective == "masked":
        loss = (
            f"loss: masked-LM cross-entropy summed over the masked positions only ({MASK_RATE:.0%} of each "
            "sample's non-special tokens, at least one, chosen by a seeded hash of sample and position, "
            "all replaced by the mask token); at the last layer only masked positions get a gradient "
            "(the rest count in 'zero', skipped by grad cos)"
        )
    else:
        loss = (
            "loss: next-token cross-entropy summed over every real token (padding never a target); each "
            "sample's last token is left out (no loss depends on it)"
        )
    return [
        loss + "; a sum, not a batch mean, so no gradient depends on batch size or padding",
        f"top-{top_k} share: Σ‖P_k g‖² / Σ‖g‖², P_k onto the top-{top_k} eigenvectors of the layer's "
        "activation covariance (centered, same tokens); random: a seeded random subspace of the same "
        "rank (QR of a Gaussian), expected k/d; best: the most any such subspace can hold",
    ]


# --- export and command-line options ------------------------------------------------------------


def csv_rows(results: list[GradientResult]) -> Rows:
    """The ``--csv`` rows: one per model and layer."""
    return [asdict(r) for res in results for r in res.rows]


def json_payload(results: list[GradientResult]) -> Payload:
    """The ``--json`` document: each result as its fields."""
    return {"results": [{k: v for k, v in asdict(r).items() if k != "from_cache"} for r in results]}


@dataclass(frozen=True)
class GradientsParams:
    """gradients' own parameters (the front ends add the models and the run options)."""

    top_k: int = param(
        10, parse=positive("top-k"), help="principal directions of the activations (default 10)"
    )


EXPERIMENT: Experiment[RunSpec, GradientsParams, GradientsRequest, GradientResult] = Experiment(
    name="gradients",
    help=HELP,
    request_type=GradientsRequest,
    result_type=GradientResult,
    folder=FOLDER,
    schema=SCHEMA,
    make_request=lambda spec, params: GradientsRequest(spec, top_k=params.top_k),
    rows=csv_rows,
    payload=json_payload,
    params=GradientsParams,
    decode=gradients_from_payload,
    plan=plans.gradients,
)
