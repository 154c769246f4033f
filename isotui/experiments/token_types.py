"""Which token types make a layer anisotropic (issue 27 item 5): per layer, the types that carry
most of the mean direction and of the top rogue dimension.

Over a layer's n kept vectors x_i (u_i = x_i / ||x_i||), each token type t (a token id) has

- its share of the **mean direction** m = mean_i x_i: sum over its tokens of <x_i, m/||m||>,
  divided by the same sum over all tokens (n ||m||); the shares of all types sum to 1;
- its share of the **top rogue dimension** k (the dimension contributing most to avg_cos,
  (S_k^2 - sum_i u_ik^2) / (n (n - 1)) with S = sum_i u_i, as in the layer table): sum over its
  tokens of u_ik, divided by S_k; these sum to 1 too.

Two passes over the data (the first makes m, S and k; the second the per-type sums), each layer
read as the layer run reads it (same masks, special tokens left out unless included), sums in
float64. Text models only: a type is a token id. Rows: per layer and direction, the ``top``
types by share, with their token count and text.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, ClassVar, TypedDict, cast

import numpy as np

from isotui.errors import IsotuiError
from isotui.experiments.base import Arrays, Context, Experiment, Payload, Rows
from isotui.experiments.cached_request import CachedRequest
from isotui.experiments.json_types import from_fields
from isotui.experiments.params import param, positive

if TYPE_CHECKING:
    import torch

    from isotui.experiments.layer_pass import Prepared
    from isotui.extract.loop import Batch, BatchLoop
    from isotui.extract.memory_plan import MemoryPlan
    from isotui.extract.progress import ProgressCallback, StopCheck
    from isotui.spec import RunSpec

HELP = "which token types carry each layer's mean direction and its top rogue dimension"
FOLDER = "token-types"
SCHEMA = 1


@dataclass
class TypeRow:
    """One token type's share of one layer's direction (a ``--csv`` row)."""

    model: str
    component: str
    layer: int
    direction: str  # "mean", or "rogue:K" (the layer's top rogue dimension K)
    rank: int  # 1: the type with the largest share
    token_id: int
    token: str
    count: int  # its kept tokens in the layer
    share: float  # its share of the direction (all types' shares sum to 1)
    freq_share: float  # its share of the layer's tokens: count / n (a share above it: a carrier)


@dataclass
class TokenTypesResult:
    model: str
    rows: list[TypeRow]
    meta: dict[str, object] = field(default_factory=dict)
    from_cache: bool = False


@dataclass
class LayerTypes:
    """One layer's rows, by direction: the carriers of its mean direction and of its top rogue
    dimension ``rogue_dim`` (each list largest share first)."""

    component: str
    layer: int
    mean: list[TypeRow] = field(default_factory=list)
    rogue_dim: int | None = None
    rogue: list[TypeRow] = field(default_factory=list)


def by_layer(rows: list[TypeRow]) -> list[LayerTypes]:
    """A result's rows grouped per layer (in the rows' order: component, then layer)."""
    layers: dict[tuple[str, int], LayerTypes] = {}
    for row in rows:
        group = layers.setdefault((row.component, row.layer), LayerTypes(row.component, row.layer))
        if row.direction == "mean":
            group.mean.append(row)
        else:
            group.rogue_dim = int(row.direction.removeprefix("rogue:"))
            group.rogue.append(row)
    return list(layers.values())


@dataclass(frozen=True)
class TokenTypesParams:
    """token-types' own parameters (the front ends add the models and the run options)."""

    top: int = param(
        5, parse=positive("--top"), metavar="N", help="token types shown per layer and direction"
    )


class _Sums:
    """One layer's first-pass sums: of x, of u and of u squared (float64), and the count."""

    def __init__(self, d: int, device: torch.device) -> None:
        import torch

        self.x = torch.zeros(d, dtype=torch.float64, device=device)
        self.u = torch.zeros(d, dtype=torch.float64, device=device)
        self.u2 = torch.zeros(d, dtype=torch.float64, device=device)
        self.n = 0


def _kept(
    loop: BatchLoop, batch: Batch, component: str, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A (B, T, d) layer's kept vectors (float64) and their token ids, as the layer run keeps them."""
    if h.ndim != 3:
        raise IsotuiError("token-types reads layers of one vector per token; this model's are not")
    keep = loop.keep(batch.fed, component, h.shape[1])
    key = "decoder_input_ids" if component == "decoder" else "input_ids"
    ids = batch.fed.inputs[key]
    if ids.shape[1] != h.shape[1]:
        raise IsotuiError("token-types reads layers of one vector per input token; this model's are not")
    flat = keep.flatten().nonzero().squeeze(1)
    x = h.reshape(-1, h.shape[-1]).index_select(0, flat.to(h.device)).double()
    return x, ids.flatten()[flat]


def measure_types(
    spec: RunSpec,
    *,
    top: int,
    on_progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
    prepared: Prepared | None = None,
) -> TokenTypesResult:
    """The two passes of the module's doc over ``spec``'s data."""
    import time

    import torch

    from isotui.experiments.layer_pass import extract_options, load_prepared, prepare
    from isotui.extract.forward import hidden_states
    from isotui.extract.loop import BatchLoop
    from isotui.extract.runner import resolve_max_length

    started = time.perf_counter()
    prepared = prepared or prepare(spec)
    if spec.data.modality != "text":
        raise IsotuiError("token-types reads text models (a type is a token id); give text data")
    loaded, device = load_prepared(prepared)
    if loaded.modality != "text":
        raise IsotuiError(f"token-types reads text models; {spec.model!r} reads {loaded.modality}")
    loop = BatchLoop(loaded, device, dataclasses.replace(extract_options(spec)), on_progress, should_stop)
    loop.prepare(prepared.samples, "text", resolve_max_length(loaded, spec.max_length, spec.model))
    first: dict[str, list[_Sums]] = {}

    def pass_one(batch: Batch) -> int:
        with torch.inference_mode():
            for component, hidden in hidden_states(loaded, batch.inputs).items():
                sums = first.setdefault(component, [_Sums(h.shape[-1], h.device) for h in hidden])
                for s, h in zip(sums, hidden, strict=True):
                    x, _ = _kept(loop, batch, component, h)
                    u = x / x.norm(dim=1, keepdim=True).clamp_min(1e-300)
                    s.x += x.sum(0)
                    s.u += u.sum(0)
                    s.u2 += (u * u).sum(0)
                    s.n += len(x)
        return batch.units

    loop.run(pass_one)
    directions: dict[str, list[tuple[torch.Tensor, int, float, float]]] = {}  # (m hat, k, n||m||, S_k)
    for component, sums in first.items():
        directions[component] = []
        for s in sums:
            n = s.n
            mean = s.x / max(n, 1)
            norm = float(mean.norm())
            contrib = (s.u**2 - s.u2) / (n * (n - 1)) if n >= 2 else s.u * math.nan
            k = int(torch.argmax(contrib))
            directions[component].append((mean / norm if norm > 0 else mean, k, n * norm, float(s.u[k])))
    size = max(len(loaded.tokenizer), 1)
    second: dict[str, list[list[np.ndarray]]] = {
        c: [[np.zeros(size), np.zeros(size), np.zeros(size, np.int64)] for _ in ds]
        for c, ds in directions.items()
    }

    def pass_two(batch: Batch) -> int:
        with torch.inference_mode():
            for component, hidden in hidden_states(loaded, batch.inputs).items():
                for (m, k, _, _), parts, h in zip(
                    directions[component], second[component], hidden, strict=True
                ):
                    x, ids = _kept(loop, batch, component, h)
                    u_k = x[:, k] / x.norm(dim=1).clamp_min(1e-300)
                    ids_np = ids.numpy().astype(np.int64)
                    grow = int(ids_np.max()) + 1 if len(ids_np) else 0
                    if grow > len(parts[0]):
                        for j, dtype in enumerate((np.float64, np.float64, np.int64)):
                            parts[j] = np.concatenate([parts[j], np.zeros(grow - len(parts[j]), dtype)])
                    n = len(parts[0])
                    parts[0] += np.bincount(ids_np, (x @ m).cpu().numpy(), minlength=n)
                    parts[1] += np.bincount(ids_np, u_k.cpu().numpy(), minlength=n)
                    parts[2] += np.bincount(ids_np, minlength=n)
        return batch.units

    loop.run(pass_two, phase="second pass")
    rows: list[TypeRow] = []
    texts: dict[int, str] = {}
    for component, ds in directions.items():
        for layer, ((_, k, along, s_k), (proj, rogue, count)) in enumerate(
            zip(ds, second[component], strict=True)
        ):
            n = int(count.sum())
            for direction, total, part in (("mean", along, proj), (f"rogue:{k}", s_k, rogue)):
                shares: np.ndarray = np.asarray(part / total) if total else np.full(len(part), math.nan)
                seen = np.flatnonzero(count)
                best = seen[np.lexsort((seen, -shares[seen]))][:top]
                for rank, t in enumerate(best.tolist(), 1):
                    if t not in texts:
                        texts[t] = str(loaded.tokenizer.convert_ids_to_tokens(t))
                    rows.append(
                        TypeRow(
                            spec.model,
                            component,
                            layer,
                            direction,
                            rank,
                            t,
                            texts[t],
                            int(count[t]),
                            float(shares[t]),
                            float(count[t] / n) if n else math.nan,
                        )
                    )
    meta = {
        "data": spec.data.describe(),
        "n_samples": len(prepared.samples),
        "top": top,
        "seconds": round(time.perf_counter() - started, 3),
        "notes": list(loaded.notes),
    }
    return TokenTypesResult(spec.model, rows, meta)


class TypesEntry(TypedDict):
    """A cache entry's payload, as :meth:`TokenTypesRequest._encode` stores it."""

    model: str
    rows: list[dict[str, object]]  # each a TypeRow's fields
    meta: dict[str, object]


def decode(payload: Mapping[str, object], _arrays: Arrays) -> TokenTypesResult:
    entry = cast("TypesEntry", payload)  # the cache checked its schema: the request's payload
    return TokenTypesResult(
        entry["model"], [from_fields(TypeRow, r) for r in entry["rows"]], dict(entry["meta"])
    )


@dataclass(frozen=True)
class TokenTypesRequest(CachedRequest[TokenTypesResult]):
    """The token types of each layer's directions (``isotui experiment token-types``)."""

    top: int = 5
    kind: ClassVar[str] = "token-types"

    def _folder(self) -> tuple[str, int, dict[str, object]]:
        return FOLDER, SCHEMA, {"top": self.top}

    def _compute(self, prepared: Prepared, context: Context) -> TokenTypesResult:
        return measure_types(
            self.spec,
            top=self.top,
            on_progress=context.on_progress,
            should_stop=context.should_stop,
            prepared=prepared,
        )

    def _encode(self, result: TokenTypesResult) -> tuple[dict[str, object], Arrays]:
        return {"model": result.model, "rows": [asdict(x) for x in result.rows], "meta": result.meta}, {}

    def _decode(self, payload: Mapping[str, object], arrays: Arrays) -> TokenTypesResult:
        return decode(payload, arrays)


def csv_rows(results: list[TokenTypesResult]) -> Rows:
    """The ``--csv`` rows: per model, layer, direction and rank."""
    return [asdict(row) for r in results for row in r.rows]


def json_payload(results: list[TokenTypesResult]) -> Payload:
    return {
        "results": [{"model": r.model, "rows": [asdict(x) for x in r.rows], "meta": r.meta} for r in results]
    }


def _plan(request: TokenTypesRequest) -> MemoryPlan:
    """--dry-run: the layer run's plan (one batch's hidden states and a few d-vectors per layer
    fit within it; it also counts the reservoirs this experiment does not keep: an overstatement)."""
    from isotui.experiments.plans import layers

    return layers(request)


EXPERIMENT: Experiment[RunSpec, TokenTypesParams, TokenTypesRequest, TokenTypesResult] = Experiment(
    name="token-types",
    help=HELP,
    request_type=TokenTypesRequest,
    result_type=TokenTypesResult,
    folder=FOLDER,
    schema=SCHEMA,
    make_request=lambda spec, params: TokenTypesRequest(spec, top=params.top),
    rows=csv_rows,
    payload=json_payload,
    params=TokenTypesParams,
    decode=decode,
    plan=_plan,  # one batch's hidden states and a few d-vectors per layer: within the layer run's
    lab_tab="isotui.tui.lab_types:TypesTab",
)
