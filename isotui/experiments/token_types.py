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
    from isotui.extract.memory_plan import MemoryPlan
    from isotui.extract.progress import ProgressCallback, StopCheck
    from isotui.spec import RunSpec

HELP = "which token types carry each layer's mean direction and its top rogue dimension"
FOLDER = "token-types"
SCHEMA = 1

# a batch's sums: of the first pass (x, u, u squared, count), of the second (per token id)
_MomentSums = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor", int]
_ShareSums = tuple[np.ndarray, np.ndarray, np.ndarray]


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


class _Moments:
    """One layer's first-pass sums (a :class:`~isotui.extract.runner.TokenFold`): of x, of u and
    of u squared (float64), and the count."""

    def __init__(self, d: int, device: torch.device) -> None:
        import torch

        self.device = device
        self.x = torch.zeros(d, dtype=torch.float64, device=device)
        self.u = torch.zeros(d, dtype=torch.float64, device=device)
        self.u2 = torch.zeros(d, dtype=torch.float64, device=device)
        self.n = 0

    def partial(self, x: torch.Tensor, token_ids: torch.Tensor) -> _MomentSums:
        x = x.to(self.device).double()
        u = x / x.norm(dim=1, keepdim=True).clamp_min(1e-300)
        return x.sum(0), u.sum(0), (u * u).sum(0), len(x)

    def commit(self, sums: _MomentSums) -> None:
        x, u, u2, n = sums
        self.x += x
        self.u += u
        self.u2 += u2
        self.n += n


class _Shares:
    """One layer's second-pass sums (a :class:`~isotui.extract.runner.TokenFold`), per token id:
    of <x, m/||m||> (``proj``), of u_k (``rogue``) and the count; with the first pass's direction
    ``m_hat``, top rogue dimension ``k``, ``along`` (n ||m||) and ``s_k`` (S_k)."""

    def __init__(self, first: _Moments, size: int) -> None:
        import torch

        n = first.n
        mean = first.x / max(n, 1)
        norm = float(mean.norm())
        contrib = (first.u**2 - first.u2) / (n * (n - 1)) if n >= 2 else first.u * math.nan
        self.device = first.device
        self.k = int(torch.argmax(contrib))
        self.m_hat = mean / norm if norm > 0 else mean
        self.along = n * norm
        self.s_k = float(first.u[self.k])
        self.proj, self.rogue = np.zeros(size), np.zeros(size)
        self.count = np.zeros(size, np.int64)

    def partial(self, x: torch.Tensor, token_ids: torch.Tensor) -> _ShareSums:
        x = x.to(self.device).double()
        u_k = x[:, self.k] / x.norm(dim=1).clamp_min(1e-300)
        ids = token_ids.numpy().astype(np.int64)
        n = max(len(self.count), int(ids.max()) + 1 if len(ids) else 0)
        proj = np.bincount(ids, (x @ self.m_hat).cpu().numpy(), minlength=n)
        return proj, np.bincount(ids, u_k.cpu().numpy(), minlength=n), np.bincount(ids, minlength=n)

    def commit(self, sums: _ShareSums) -> None:
        proj, rogue, count = sums
        grow = len(count) - len(self.count)
        if grow > 0:  # ids past the tokenizer's length
            self.proj = np.concatenate([self.proj, np.zeros(grow)])
            self.rogue = np.concatenate([self.rogue, np.zeros(grow)])
            self.count = np.concatenate([self.count, np.zeros(grow, np.int64)])
        self.proj += proj
        self.rogue += rogue
        self.count += count


def _sums_plan(dims: dict[str, list[int]], where: dict[str, list[object]]) -> MemoryPlan:
    """The stream's plan of token-types' sums: a few d-vectors per layer on the device of its
    hidden states (the CPU for MPS: ``where``), no covariance, no reservoir."""
    from isotui.extract.memory_plan import LayerPlan, MemoryPlan

    layers = [
        LayerPlan(f"layer {i}" if c == "model" else f"{c} layer {i}", d, str(dev), False, 0)
        for c, ds in dims.items()
        for i, (d, dev) in enumerate(zip(ds, where[c], strict=True))
    ]
    return MemoryPlan(layers, {})


def measure_types(
    spec: RunSpec,
    *,
    top: int,
    on_progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
    prepared: Prepared | None = None,
) -> TokenTypesResult:
    """The two passes of the module's doc over ``spec``'s data, both the layer stream's
    (:class:`~isotui.extract.runner.LayerStream`, every hidden state of each component, kept as
    the layer run keeps them): into :class:`_Moments`, then :class:`_Shares`."""
    import time

    from isotui.experiments.layer_pass import load_prepared, prepare, text_stream
    from isotui.extract.runner import LayerStream, TokenFolds

    started = time.perf_counter()
    prepared = prepared or prepare(spec)
    if spec.data.modality != "text":
        raise IsotuiError("token-types reads text models (a type is a token id); give text data")
    loaded, device = load_prepared(prepared)
    if loaded.modality != "text":
        raise IsotuiError(f"token-types reads text models; {spec.model!r} reads {loaded.modality}")
    folds = TokenFolds(
        _Moments,
        not_sequence="token-types reads layers of one vector per token; this model's are not",
        not_tokens="token-types reads layers of one vector per input token; this model's are not",
    )
    stream = text_stream(
        prepared,
        loaded,
        device,
        lambda loop: LayerStream(loop, type_uniform=False, plan_sums=_sums_plan, token_folds=folds),
        on_progress=on_progress,
        should_stop=should_stop,
    )
    loop = stream.loop
    loop.run(stream)
    # the folds token-types' TokenFolds made: _Moments
    first = cast("dict[str, list[_Moments]]", stream.folds or {})
    size = max(len(loaded.tokenizer), 1)
    second = {c: [_Shares(s, size) for s in sums] for c, sums in first.items()}
    stream.folds = {c: list(shares) for c, shares in second.items()}
    loop.run(stream, phase="second pass")
    rows: list[TypeRow] = []
    texts: dict[int, str] = {}
    for component, layers in second.items():
        for layer, s in enumerate(layers):
            count = s.count
            n = int(count.sum())
            for direction, total, part in (("mean", s.along, s.proj), (f"rogue:{s.k}", s.s_k, s.rogue)):
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
