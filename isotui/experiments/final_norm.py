"""Where isotropy is made: the model's final norm (Machina & Mercer 2024).

The last block's output is measured just before and just after the final norm (GPT-2 ``ln_f``,
GPT-NeoX ``final_layer_norm``, Llama/Mistral ``norm``...; for models without one, such as BERT,
the last block's own output LayerNorm), with every layer metric, plus a per-dimension table: the
mean component x_bar_k before the norm, the norm's gain gamma_k and bias beta_k, and each
dimension's share of avg_cos before and after. Spearman correlations between |x_bar_k| (and the
rogue share) and gamma_k say whether the norm damps the dimensions that carry the drift.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, ClassVar, TypedDict, cast

import numpy as np
import numpy.typing as npt

from isotui.errors import IsotuiError
from isotui.experiments import plans
from isotui.experiments.base import Arrays, Context, Experiment, Payload, Rows
from isotui.experiments.cached_request import CachedRequest
from isotui.experiments.json_types import from_fields
from isotui.experiments.params import param
from isotui.spec import MODEL, RESERVOIR

if TYPE_CHECKING:
    import torch

    from isotui.core.accumulator import LayerAccumulator, LayerStats, Sums
    from isotui.experiments.layer_pass import Prepared
    from isotui.extract.progress import ProgressCallback, StopCheck
    from isotui.extract.runner import SumsPlan
    from isotui.spec import RunSpec

HELP = "metrics before and after the final norm, per dimension (Machina & Mercer 2024)"
TOP = 5
FOLDER = "final-norm"  # the result cache's folder for this experiment
SCHEMA = 1


class GainBias(TypedDict):
    """A norm's gain and bias (zeros when it has none), float64."""

    gain: npt.NDArray[np.float64]
    bias: npt.NDArray[np.float64]


class NormSite(GainBias):
    """One norm measured: its name in the model and its kind (see :func:`norm_module`)."""

    name: str
    kind: str


class NormFacts(TypedDict):
    """What a pass over the norms knew besides the accumulators (see :func:`norms_state`)."""

    model: str
    data: str
    n_samples: int
    seconds: float
    sites: list[NormSite]


class NormsState(NormFacts):
    """A (possibly merged) streamed state: per norm the [before, after] accumulator states."""

    accumulators: list[list[Sums]]


@dataclass
class DimRow:
    """One hidden dimension (the CSV of ``--csv``)."""

    model: str
    module: str
    dim: int
    mean_before: float
    mean_after: float
    gain: float
    bias: float
    share_before: float  # of avg_cos before the norm (the shares sum to 1)
    share_after: float


@dataclass
class FinalNormResult:
    model: str
    module: str  # the norm's name in the model
    kind: str  # "final" or "last block's output norm"
    before: LayerStats
    after: LayerStats
    dims: list[DimRow]
    rho_mean_gain: float  # Spearman(|x_bar_k| before, gamma_k)
    p_mean_gain: float
    rho_share_gain: float  # Spearman(share of avg_cos before, gamma_k)
    p_share_gain: float
    # the standard error of the paired change avg_cos after - before (:func:`paired_change_se`);
    # NaN where it was not estimated (a result cached before issue 37, a reservoir too small)
    avg_cos_change_se: float = math.nan
    meta: dict[str, object] = field(default_factory=dict)
    from_cache: bool = False

    def verdict(self) -> str:
        """One sentence: does the norm raise or lower isotropy, and through which dimensions."""
        b, a = self.before.avg_cos, self.after.avg_cos
        top = sorted(self.dims, key=lambda r: -r.share_before)[:3]
        gains = np.array([r.gain for r in self.dims])
        dims = ", ".join(
            f"{r.dim} (share {signed(r.share_before, 2)}→{signed(r.share_after, 2)}, "
            f"gain {signed(r.gain, 2)})"
            for r in top
        )
        med = float(np.median(np.abs(gains))) if len(gains) else math.nan
        iso = f"IsoScore {self.before.isoscore:.3f}→{self.after.isoscore:.3f}"
        se = self.avg_cos_change_se
        noise = f"{abs(a - b) / se:.1f} SE of the paired change" if se > 0 else "its noise not estimated"
        if rounded_same(b, a):
            change = f"leaves avg_cos unchanged at {b:.4f} (to float32 rounding; {iso})"
        elif within_noise(b, a, se):
            change = f"leaves avg_cos unchanged at {b:.4f} (within noise: {a - b:+.1e}, {noise}; {iso})"
        else:
            way, direction = ("lowers", "isotropy up") if a < b else ("raises", "isotropy down")
            digits = 4 if f"{a:.4f}" != f"{b:.4f}" else 8  # a real change that 4 decimals hide
            change = f"{way} avg_cos from {b:.{digits}f} to {a:.{digits}f} ({direction}; {noise}; {iso})"
        return (
            f"{self.module} {change}; the dimensions carrying most of avg_cos before it: {dims}; "
            f"median |gain| {signed(med, 2)}; " + gain_correlation(self.rho_mean_gain, self.p_mean_gain)
        )


# float32 forwards round a cosine to about 1e-7; a rescaling norm (RMSNorm with unit gain, an
# untrained LayerNorm on centred vectors) leaves every cosine as it was up to that
ROUNDING = 1e-6


def rounded_same(before: float, after: float) -> bool:
    """Whether avg_cos before and after the norm are the same to float32 rounding (relative
    :data:`ROUNDING`): a norm that only rescales each vector."""
    if not (math.isfinite(after) and math.isfinite(before)):
        return False
    return abs(after - before) <= ROUNDING * max(abs(after), abs(before))


def within_noise(before: float, after: float, se: float) -> bool:
    """Whether the change in avg_cos is within the noise of the change itself: inside the 95%
    interval of the paired change, +-t x SE (t of the jackknife's degrees of freedom, 2.36), SE
    from :func:`paired_change_se`. Not the sd of one mean: the norm maps each vector, so the two
    means move together, and a systematic change smaller than either mean's own noise is real
    (issue 37: 1.8e-3 at n = 100, d = 64, the null sd of one mean there). False where the SE is
    unknown (NaN): nothing is then said to be within noise."""
    from isotui.core.sampled import jackknife_t

    if not (math.isfinite(after) and math.isfinite(before) and math.isfinite(se)):
        return False
    return abs(after - before) <= jackknife_t() * se


def paired_change_se(acc_in: LayerAccumulator, acc_out: LayerAccumulator) -> float:
    """Standard error of avg_cos(after) - avg_cos(before) over the same vectors, by the delete-a-
    group jackknife on the paired reservoirs (the norm's input and output of the same tokens,
    which carry the same keys: :func:`isotui.core.sampled.key_groups`' G groups in key order).
    Each group left out moves both means at once, so what the two sides share cancels: the SE of
    the change itself. From K reservoir vectors to all n it is scaled by sqrt(K / n) (a mean
    cosine's leading term falls as 1/n; exact, unscaled, when the reservoir holds every vector).
    NaN where the reservoirs are too small for G groups or do not hold the same tokens."""
    import torch

    from isotui.core.sampled import SE_GROUPS, jackknife_se

    sides = (acc_in, acc_out)
    if any(acc.res is None or acc.res_keys is None for acc in sides):
        return math.nan
    keys = [acc.res_keys.cpu() for acc in sides]  # type: ignore[union-attr]
    order = [torch.argsort(k) for k in keys]
    if len(keys[0]) != len(keys[1]) or len(keys[0]) < 2 * SE_GROUPS:
        return math.nan
    if not torch.equal(keys[0][order[0]], keys[1][order[1]]):
        return math.nan
    theta = []
    for acc, at in zip(sides, order, strict=True):
        v = acc.res.cpu()[at].to(torch.float64)  # type: ignore[union-attr]
        norms = torch.linalg.vector_norm(v, dim=1)
        keep = norms > 0
        u = (v / torch.where(keep, norms, 1.0)[:, None]).masked_fill_(~keep[:, None], 0.0)
        parts = torch.tensor_split(torch.arange(len(v)), SE_GROUPS)
        sums = torch.stack([u[idx].sum(0) for idx in parts]).numpy()
        counts = np.array([int(keep[idx].sum()) for idx in parts], dtype=np.float64)
        rest, n_rest = sums.sum(0) - sums, counts.sum() - counts
        if np.any(n_rest < 2):
            return math.nan
        theta.append((np.einsum("gd,gd->g", rest, rest) - n_rest) / (n_rest * (n_rest - 1)))
    se = jackknife_se(theta[1] - theta[0])
    k = len(keys[0])
    n = max(acc_in.n_all, k)
    return se * math.sqrt(k / n)


def signed(value: float, digits: int) -> str:
    """``value`` to ``digits`` decimals, unless that rounds a non-zero value to zero: then in one
    significant digit, its sign kept (a gain of -0.003 as ``-0.003``, not ``-0.00``); 0 as 0."""
    if math.isnan(value):
        return "-"
    if value == 0 or math.isinf(value):
        return f"{0.0:.{digits}f}"
    if round(value, digits) == 0:
        return f"{value:.1g}"
    return f"{value:.{digits}f}"


def gain_correlation(rho: float, p: float, label: str = "Spearman(|x̄_k|, gain)", digits: int = 2) -> str:
    """``Spearman(|x̄_k|, gain) = 0.42 (p=0.003)``, or why there is none: every gain equal (an
    untrained norm) leaves no rank correlation, and no p (scipy's would be nan)."""
    if math.isfinite(rho):
        return f"{label} = {rho:.{digits}f} (p={p:.2g})"
    return (
        f"{label}: none, every gain is the same (an untrained norm?): it scales no dimension "
        "more than another"
    )


def norm_module(model: torch.nn.Module) -> tuple[str, torch.nn.Module, str]:
    """(name, module, kind): the model's final norm, else the last block's output LayerNorm."""
    from isotui.models.loading import final_norm_modules

    found = [(n, m) for n, m in final_norm_modules(model) if hasattr(m, "weight")]
    if found:
        name, module = found[-1]  # encoder-decoder: the decoder's (the model's last word)
        return name, module, "final"
    norms = [
        (n, m)
        for n, m in model.named_modules()
        if type(m).__name__ in ("LayerNorm", "RMSNorm") or type(m).__name__.endswith(("LayerNorm", "RMSNorm"))
    ]
    if not norms:
        raise IsotuiError(f"{type(model).__name__} has no LayerNorm or RMSNorm to analyse")
    name, module = norms[-1]
    return name, module, "last block's output norm"


def block_output_norms(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """Every block's last norm (BERT's ``output.LayerNorm``), in block order; verified on the
    first batch to be what the block returns (a pre-LN block ends with a residual sum instead)."""
    import torch

    out: list[tuple[str, torch.nn.Module, str]] = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 1:
            continue
        for i, block in enumerate(module):
            norms = [
                (f"{name}.{i}.{n}", m)
                for n, m in block.named_modules()
                if n and type(m).__name__.endswith(("LayerNorm", "RMSNorm")) and hasattr(m, "weight")
            ]
            if norms:
                out.append((*norms[-1], f"block {i} output norm"))
        if out:
            return out
    return out


def measure_final_norm(
    spec: RunSpec, *, on_progress: ProgressCallback | None = None, should_stop: StopCheck | None = None
) -> FinalNormResult:
    """Stream the inputs and outputs of the final norm over ``spec``'s data."""
    return measure_norms(spec, every_layer=False, on_progress=on_progress, should_stop=should_stop)[0]


@dataclass(frozen=True)
class FinalNormRequest(CachedRequest[list[FinalNormResult]]):
    """Metrics before and after the final norm (``isotui experiment final-norm``); its result is
    a list: the final norm, or (``every_layer``) every block's output norm."""

    every_layer: bool = False
    kind: ClassVar[str] = "final-norm"

    def _folder(self) -> tuple[str, int, dict[str, object]]:
        return FOLDER, SCHEMA, {"every_layer": self.every_layer}

    def _compute(self, prepared: Prepared, context: Context) -> list[FinalNormResult]:
        return measure_norms(
            self.spec,
            every_layer=self.every_layer,
            on_progress=context.on_progress,
            should_stop=context.should_stop,
            prepared=prepared,
        )

    def _encode(self, result: list[FinalNormResult]) -> tuple[dict[str, object], Arrays]:
        return results_payload(result)

    def _decode(self, payload: Mapping[str, object], arrays: Arrays) -> list[FinalNormResult]:
        return results_from_payload(payload, arrays)

    def _relabel(self, result: list[FinalNormResult]) -> None:
        for r in result:
            r.model, r.from_cache = self.spec.model, True
            r.meta["data"] = self.spec.data.describe()
            for d in r.dims:
                d.model = self.spec.model


_STAT_ARRAYS = ("dim_contrib", "eigenvalues", "mean")


def results_payload(results: list[FinalNormResult]) -> tuple[Payload, dict[str, np.ndarray]]:
    """(JSON payload, arrays) of one run's results, for the cache."""
    items: list[dict[str, object]] = []
    arrays: dict[str, npt.NDArray[np.float64]] = {}
    for i, r in enumerate(results):
        item = {k: v for k, v in asdict(r).items() if k not in ("before", "after", "from_cache")}
        for side in ("before", "after"):
            stats = getattr(r, side)
            item[side] = {
                k: list(v) if isinstance(v, tuple) else v
                for k, v in asdict(stats).items()
                if k not in _STAT_ARRAYS
            }
            for name in _STAT_ARRAYS:
                arrays[f"{i}.{side}.{name}"] = np.asarray(getattr(stats, name), dtype=np.float64)
        items.append(item)
    return {"results": items}, arrays


class FinalNormEntry(TypedDict):
    """A cache entry's payload, as :func:`results_payload` writes it: per result its fields,
    ``before`` and ``after`` its LayerStats' scalars (the arrays beside), ``dims`` its DimRows'."""

    results: list[dict[str, object]]


def results_from_payload(
    payload: Mapping[str, object], arrays: dict[str, np.ndarray]
) -> list[FinalNormResult]:
    """The results :func:`results_payload` stored."""
    from isotui.core.accumulator import LayerStats

    entry = cast("FinalNormEntry", payload)  # the cache checked its schema: results_payload's
    out = []
    for i, item in enumerate(entry["results"]):
        sides = {}
        for side in ("before", "after"):
            fields_ = dict(cast("dict[str, object]", item[side]))  # its LayerStats' scalars
            fields_["constant_dims"] = tuple(cast("list[int]", fields_.get("constant_dims", ())))
            for name in _STAT_ARRAYS:
                fields_[name] = arrays[f"{i}.{side}.{name}"]
            sides[side] = from_fields(LayerStats, fields_)
        rest = {k: v for k, v in item.items() if k not in ("before", "after", "dims")}
        dims = [from_fields(DimRow, d) for d in cast("list[dict[str, object]]", item["dims"])]
        out.append(
            from_fields(FinalNormResult, rest, before=sides["before"], after=sides["after"], dims=dims)
        )
    return out


def measure_norms(
    spec: RunSpec,
    *,
    every_layer: bool,
    on_progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
    prepared: Prepared | None = None,
) -> list[FinalNormResult]:
    """The final norm, or (``every_layer``) every block's output norm, over ``spec``'s data, in one
    pass: each norm's input and output streamed into a pair of accumulators."""
    accs, facts = _stream_norms(spec, every_layer, on_progress, should_stop, None, prepared)
    return _finish_norms(accs, facts)


def norms_state(
    spec: RunSpec,
    *,
    every_layer: bool,
    sample_ids: tuple[int, ...] | None = None,
    on_progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
) -> NormsState:
    """:func:`measure_norms`'s streamed state over the samples ``sample_ids`` (global indices into
    ``spec``'s corpus; None: all): per norm its name, kind, gain, bias and the before/after
    accumulator states. Shards merge with :func:`merge_norms_states`; :func:`finish_norms` ends."""
    accs, facts = _stream_norms(spec, every_layer, on_progress, should_stop, sample_ids)
    return {**facts, "accumulators": [[a.state() for a in pair] for pair in accs]}


def merge_norms_states(states: list[NormsState]) -> NormsState:
    """One state from disjoint shards of the same corpus: accumulators merged, counts added."""
    from isotui.core.accumulator import LayerAccumulator

    first = states[0]
    accs = [[LayerAccumulator.from_state(s) for s in pair] for pair in first["accumulators"]]
    for other in states[1:]:
        if [site["name"] for site in other["sites"]] != [site["name"] for site in first["sites"]]:
            raise ValueError("cannot merge the states of different norms")
        for pair, theirs in zip(accs, other["accumulators"], strict=True):
            for acc, s in zip(pair, theirs, strict=True):
                acc.merge(LayerAccumulator.from_state(s))
    return {
        **first,
        "accumulators": [[a.state() for a in pair] for pair in accs],
        "n_samples": sum(s["n_samples"] for s in states),
        "seconds": sum(s["seconds"] for s in states),
    }


def finish_norms(state: NormsState) -> list[FinalNormResult]:
    """The results of a (possibly merged) :func:`norms_state`."""
    from isotui.core.accumulator import LayerAccumulator

    accs = [[LayerAccumulator.from_state(s) for s in pair] for pair in state["accumulators"]]
    # a NormsState less its accumulators: its NormFacts
    return _finish_norms(accs, cast("NormFacts", {k: v for k, v in state.items() if k != "accumulators"}))


def _finish_norms(accs: list[list[LayerAccumulator]], facts: NormFacts) -> list[FinalNormResult]:
    out = []
    for site, (acc_in, acc_out) in zip(facts["sites"], accs, strict=True):
        change_se = paired_change_se(acc_in, acc_out)
        out.append(_result(facts, site, acc_in.finalize(), acc_out.finalize(), change_se))
    return out


def _stream_norms(
    spec: RunSpec,
    every_layer: bool,
    on_progress: ProgressCallback | None,
    should_stop: StopCheck | None,
    sample_ids: tuple[int, ...] | None,
    prepared: Prepared | None = None,
) -> tuple[list[list[LayerAccumulator]], NormFacts]:
    """Stream the batches; (per norm the [before, after] accumulators, the facts to finish).
    The pass is the layer stream's (:class:`~isotui.extract.runner.LayerStream`) over two sites
    per norm, its input and output, with no type-uniform weights and final-norm's memory plan
    (:func:`_sums_plan`); with ``every_layer``, its first batch checks that each norm's output is
    what its block returns."""
    import time

    from isotui.experiments.layer_pass import load_prepared, prepare, text_stream
    from isotui.extract.modules import INPUT, OUTPUT, Site
    from isotui.extract.runner import LayerStream

    prepared = prepared or prepare(spec)

    loaded, device = load_prepared(prepared)
    if loaded.family != "transformers" or loaded.modality != "text":
        raise IsotuiError("the final-norm analysis reads text transformers models; give a text model")
    model = loaded.model
    norms = block_output_norms(model) if every_layer else [norm_module(model)]
    if not norms:
        raise IsotuiError(f"{type(model).__name__} has no blocks with a norm to analyse")
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    sites = [
        Site(name, module, read, _component(name, encoder_decoder))
        for name, module, _kind in norms
        for read in (INPUT, OUTPUT)
    ]
    returned_by: dict[int, tuple[object, str]] = {}
    if every_layer:  # each block's own output, to check that its last norm is what it returns
        named = dict(model.named_modules())
        for i, (n, _m, _k) in enumerate(norms):
            parent = n.rsplit(".", 2)[0]
            block = named[".".join(n.split(".")[: len(parent.split(".")) + 1])]
            returned_by[2 * i + 1] = (
                block,
                f"{n} is not what its block returns ({type(model).__name__} puts its norms "
                "before attention and MLP, pre-LN); analyse its final norm without --every-layer",
            )
    stream = text_stream(
        prepared,
        loaded,
        device,
        lambda loop: LayerStream(
            loop,
            sites=sites,
            type_uniform=False,
            plan_sums=_sums_plan(spec.reservoir),
            returned_by=returned_by,
        ),
        on_progress=on_progress,
        should_stop=should_stop,
        sample_ids=sample_ids,
    )
    loop = stream.loop
    start = time.perf_counter()
    loop.run(stream, phase="", start=start)
    if stream.accs is None:
        raise IsotuiError("no sample reached the norm")
    accs = stream.accs
    rows = stream.module_rows
    pairs = [[accs[c][row] for c, row in (rows[2 * i], rows[2 * i + 1])] for i in range(len(norms))]
    facts: NormFacts = {
        "model": spec.model,
        "data": prepared.spec.data.describe(),
        "n_samples": loop.total,
        "seconds": time.perf_counter() - start,
        "sites": [{"name": name, "kind": kind, **_gain_bias(module)} for name, module, kind in norms],
    }
    return pairs, facts


def _component(name: str, encoder_decoder: bool) -> str:
    """The stack of positions a norm named ``name`` is in (its tokens' keep mask): an
    encoder-decoder's ``decoder`` or ``encoder``, else ``model``."""
    first = name.split(".")[0]
    return "decoder" if "decoder" in first else ("encoder" if encoder_decoder else "model")


def _sums_plan(reservoir: int) -> SumsPlan:
    """final-norm's memory plan, what ``--dry-run`` says (:func:`isotui.experiments.plans.final_norm`):
    every side's sums on the device of the first one's activations (the CPU
    for MPS: ``where``), exact covariances for all of them when they fit that device's measured
    budget together with one batch partial, else none; reservoirs of ``reservoir`` vectors."""
    from isotui.experiments.plans import norms_exact
    from isotui.extract.memory_plan import LayerPlan, MemoryPlan, measured_budget

    def plan(dims: dict[str, list[int]], where: dict[str, list[object]]) -> MemoryPlan:
        widths = [d for ds in dims.values() for d in ds]
        on = str(next(iter(where.values()))[0])  # the sums live beside the activations (issue 15)
        budget = measured_budget(on)
        exact = norms_exact(len(widths), widths[0], budget)
        layers = [LayerPlan(f"side {k}", d, on, exact, reservoir) for k, d in enumerate(widths)]
        return MemoryPlan(layers, {on: budget}, reservoir_asked=reservoir)

    return plan


def _gain_bias(module: torch.nn.Module) -> GainBias:
    """A norm's gain and bias (zeros when it has none) as float64 arrays."""
    import torch

    from isotui.models.loading import readable

    with readable(module):  # offloaded by --device-map: its weights only exist in a forward
        weight, bias_ = module.weight, getattr(module, "bias", None)
        assert isinstance(weight, torch.Tensor)  # norm_module and block_output_norms keep weighted norms
        gain = weight.detach().float().cpu().numpy().astype(np.float64)
        bias = (
            bias_.detach().float().cpu().numpy().astype(np.float64)
            if bias_ is not None
            else np.zeros_like(gain)
        )
    return {"gain": gain, "bias": bias}


def _result(
    facts: NormFacts,
    site: NormSite,
    before: LayerStats,
    after: LayerStats,
    change_se: float = math.nan,
) -> FinalNormResult:
    from scipy.stats import spearmanr

    model, name, kind = facts["model"], site["name"], site["kind"]
    gain, bias = site["gain"], site["bias"]
    share_b = before.dim_contrib / before.avg_cos
    share_a = after.dim_contrib / after.avg_cos
    dims = [
        DimRow(
            model,
            name,
            k,
            float(before.mean[k]),
            float(after.mean[k]),
            float(gain[k]),
            float(bias[k]),
            float(share_b[k]),
            float(share_a[k]),
        )
        for k in range(len(gain))
    ]
    if np.ptp(gain) == 0:  # all gains equal (an untrained norm): no rank correlation exists
        r1 = r2 = type("NoCorrelation", (), {"statistic": math.nan, "pvalue": math.nan})()
    else:
        r1 = spearmanr(np.abs(before.mean), gain)
        r2 = spearmanr(share_b, gain)
    return FinalNormResult(
        model=model,
        module=name,
        kind=kind,
        before=before,
        after=after,
        dims=dims,
        rho_mean_gain=float(r1.statistic),
        p_mean_gain=float(r1.pvalue),
        rho_share_gain=float(r2.statistic),
        p_share_gain=float(r2.pvalue),
        avg_cos_change_se=change_se,
        meta={
            "data": facts["data"],
            "n_samples": facts["n_samples"],
            "seconds": round(facts["seconds"], 3),
        },
    )


# --- export and command-line options ------------------------------------------------------------


def csv_rows(results: list[FinalNormResult]) -> Rows:
    """The ``--csv`` rows: one per model, norm and hidden dimension."""
    return [asdict(d) for r in results for d in r.dims]


def json_payload(results: list[FinalNormResult]) -> Payload:
    """The ``--json`` document: each norm's verdict, before/after metrics and dimensions."""
    return {
        "results": [
            {
                "model": r.model,
                "module": r.module,
                "kind": r.kind,
                "verdict": r.verdict(),
                "avg_cos_change_se": r.avg_cos_change_se,  # the paired change's SE (NaN: unknown)
                "before": {k: v for k, v in asdict(r.before).items() if not isinstance(v, np.ndarray)},
                "after": {k: v for k, v in asdict(r.after).items() if not isinstance(v, np.ndarray)},
                "dims": [asdict(d) for d in r.dims],
                "meta": r.meta,
            }
            for r in results
        ]
    }


@dataclass(frozen=True)
class FinalNormParams:
    """final-norm's own parameters (the front ends add the models and the run options)."""

    every_layer: bool = param(
        False,
        switch=True,
        help="every block's output norm (post-LN models such as BERT), one table row per block",
    )


EXPERIMENT: Experiment[RunSpec, FinalNormParams, FinalNormRequest, FinalNormResult] = Experiment(
    name="final-norm",
    help=HELP,
    request_type=FinalNormRequest,
    result_type=FinalNormResult,  # a request gives a list: the final norm, or every block's
    folder=FOLDER,
    schema=SCHEMA,
    make_request=lambda spec, params: FinalNormRequest(spec, every_layer=params.every_layer),
    rows=csv_rows,
    payload=json_payload,
    params=FinalNormParams,
    decode=results_from_payload,
    plan=plans.final_norm,
    run_options=(MODEL, RESERVOIR),
)
