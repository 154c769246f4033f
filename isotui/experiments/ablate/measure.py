"""ablate's two passes on the measurement layer (:class:`~isotui.extract.runner.LayerStream`):
the sites' sums (mean, per-dimension share of avg_cos, exact covariance when ``pc:K`` is asked),
then each batch run clean and once per edit (:class:`~isotui.extract.runner.Edits`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from isotui.errors import IsotuiError, NoHeadError
from isotui.experiments.ablate.removal import Change, Removal, SiteMoments, changes, check_rows, check_width
from isotui.experiments.ablate.result import AblationCurves, AblationMeta, AblationResult, AblationRow

if TYPE_CHECKING:
    from isotui.core.accumulator import LayerAccumulator
    from isotui.experiments.layer_pass import Prepared
    from isotui.extract.memory_plan import MemoryPlan
    from isotui.extract.modules import Site
    from isotui.extract.objective import LMObjective
    from isotui.extract.progress import ProgressCallback, StopCheck
    from isotui.extract.runner import Edit, LayerStream, SumsPlan
    from isotui.models.loading import LoadedModel
    from isotui.spec import RunSpec

Known = Callable[[str, str], AblationResult | None]  # (site, removal) -> a one-row result, or None
NO_HEAD = "no loss: {why}; the rows give the representation columns only (loss columns nan)"


def measure_ablation(
    spec: RunSpec,
    removals: Sequence[Removal],
    modules: Sequence[str] = (),
    *,
    on_progress: ProgressCallback | None = None,
    should_stop: StopCheck | None = None,
    prepared: Prepared | None = None,
    known: Known | None = None,
) -> AblationResult:
    """Remove each of ``removals`` at each site ``modules`` names (default: every block's
    output), one site at a time, over ``spec``'s corpus. ``known(site, removal)``: a row
    measured before (a one-row result, from the cache), not measured again."""
    return measure_rows(spec, removals, modules, on_progress, should_stop, prepared, known)[0]


def measure_rows(
    spec: RunSpec,
    removals: Sequence[Removal],
    modules: Sequence[str],
    on_progress: ProgressCallback | None,
    should_stop: StopCheck | None,
    prepared: Prepared | None,
    known: Known | None,
    sample_ids: tuple[int, ...] | None = None,
) -> tuple[AblationResult, EditedSums | None]:
    """:func:`measure_ablation`'s result and the edited pass's sums (None: every row known).
    ``sample_ids``: a shard's (``--shard I/K``), whose first pass still reads every sample (so
    every shard edits along the same directions) and whose edited pass reads its own alone;
    its sums merge with the other shards' (:meth:`EditedSums.merge`, then :func:`fill`)."""
    from isotui.experiments.layer_pass import prepare, text_stream
    from isotui.extract.runner import Edit, Edits, LayerStream

    start = time.perf_counter()
    prepared = prepared or prepare(spec)
    if spec.data.modality != "text":
        raise IsotuiError("ablate reads language models; give text data")
    loaded, device, objective, head_note = _load(prepared)
    if getattr(loaded.model.config, "is_encoder_decoder", False):
        raise IsotuiError(
            f"model {spec.model!r} is an encoder-decoder; ablate reads single-stack models "
            "(masked LM encoders or causal LM decoders)"
        )
    sites, layers = _sites(loaded, tuple(modules))
    check_rows(len(sites), len(removals))  # before any pass: the forwards each batch makes
    asked = [(k, removal) for k in range(len(sites)) for removal in removals]
    have = {(k, r): known(sites[k].label, r.label) if known else None for k, r in asked}
    wanted = [(k, r) for k, r in asked if have[k, r] is None]
    if not wanted:  # every row cached: the model was read for its sites' names alone
        return _from_rows(spec, [have[a] for a in asked]), None
    measured = sorted({k for k, _ in wanted})
    need_cov = any(r.kind == "pc" for _, r in wanted)

    def widths(dims: dict[str, list[int]]) -> None:
        """At the first batch (its sites' widths known, the rows ordered): every removal fits
        every site, so a K or a coordinate too large is refused before the pass goes on."""
        for n, k in enumerate(measured):
            component, row = stream.module_rows[n]
            for r in removals:
                check_width(r, dims[component][row], sites[k].label)

    stream = text_stream(
        prepared,
        loaded,
        device,
        lambda loop: LayerStream(
            loop,
            sites=[sites[k] for k in measured],
            type_uniform=False,
            plan_sums=_sums_plan(need_cov, spec.model, widths),
        ),
        on_progress=on_progress,
        should_stop=should_stop,
    )
    loop = stream.loop
    loop.run(stream, phase="first pass: the sites' directions", start=start)
    if stream.accs is None:
        raise IsotuiError("no sample reached the sites")
    moments: dict[int, SiteMoments] = {}
    for n, k in enumerate(measured):
        component, row = stream.module_rows[n]
        # every removal fits: the first batch's widths check said so (``widths``)
        moments[k] = _moments(stream.accs[component][row], need_cov, sites[k].label)
    edits: list[Edit] = []
    for k, removal in wanted:
        # seeded by the row's own names, so a row is the same whatever else a request asks
        rng = np.random.default_rng([spec.seed, *_stable(sites[k].label, removal.label)])
        change, baseline = changes(removal, moments[k], rng)
        edits += [Edit(sites[k], change), Edit(sites[k], baseline)]
    edited = Edits(
        edits, not_sequence=f"model {spec.model!r} gives hidden states that are not token sequences"
    )
    run = stream  # a shard's edited pass: its own samples alone, on a loop of their own
    if sample_ids is not None:
        run = text_stream(
            prepared,
            loaded,
            device,
            lambda loop: LayerStream(loop, type_uniform=False),
            on_progress=on_progress,
            should_stop=should_stop,
            sample_ids=sample_ids,
        )
    run.edits, run.objective = edited, objective
    run.loop.run(run, phase="edited runs", start=start)
    sums = EditedSums.of(run)
    notes = list(run.notes) if run is stream else list(dict.fromkeys([*stream.notes, *run.notes]))
    new = _result(
        spec, prepared, loaded, objective, head_note, sums, notes, sites, layers, wanted, edits, start
    )
    got = dict(zip(wanted, (new.one(i) for i in range(len(wanted))), strict=True))
    return _from_rows(spec, [got.get(a) or have[a] for a in asked], new), sums


def _stable(*names: str) -> list[int]:
    """Seed words from names (a hash that is the same in every process, unlike ``hash``)."""
    import hashlib

    digest = hashlib.sha256("\0".join(names).encode()).digest()
    return [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]


def _from_rows(
    spec: RunSpec, parts: Sequence[AblationResult | None], fresh: AblationResult | None = None
) -> AblationResult:
    """One result from one-row results (cached or just measured), in the order asked: the clean
    curves, notes and meta of the measured one when there is one."""
    rows = [p for p in parts if p is not None]
    base = fresh or rows[0]
    result = AblationResult(
        spec.model,
        base.objective,
        [p.rows[0] for p in rows],
        [p.curves[0] for p in rows],
        base.avg_cos,
        base.drift_norm,
        list(base.notes),
        base.meta,
        from_cache=fresh is None,
    )
    for row in result.rows:
        row.model = spec.model
    return result


def _load(prepared: Prepared) -> tuple[LoadedModel, str, LMObjective | None, str | None]:
    """(model, device, its LM objective, the note said when it has none): with its LM head when
    it has a trained one, else the base model and no loss."""
    from isotui.experiments.layer_pass import load_prepared
    from isotui.extract.objective import lm_objective
    from isotui.models.naming import parse_model

    spec = prepared.spec
    if spec.given is None and parse_model(spec.model).kind == "bundled":
        why = "the bundled MiniLM is a sentence encoder saved without its masked-LM head"
        loaded, device = load_prepared(prepared)
        return loaded, device, None, NO_HEAD.format(why=why)
    try:
        loaded, device = load_prepared(prepared, head="lm")
    except NoHeadError as exc:
        loaded, device = load_prepared(prepared)
        return loaded, device, None, NO_HEAD.format(why=str(exc).split(";")[0])
    return loaded, device, lm_objective(loaded, spec.seed, spec.model), None


def _sites(loaded: LoadedModel, modules: tuple[str, ...]) -> tuple[list[Site], list[int]]:
    """The sites ``modules`` names (every block's output when none), and the hidden state each
    gives (block i's input: i, its output: i + 1; -1 for another module, and for the last
    block's output where a final norm follows it)."""
    from isotui.extract.forward import block_sites
    from isotui.extract.modules import INPUT, OUTPUT, Site, resolve
    from isotui.models.loading import final_norm_modules

    model = loaded.model
    blocks = block_sites(loaded).get("model", [])
    if modules:
        sites = resolve(model, loaded.model_type, modules)
    else:
        if not blocks:
            raise IsotuiError(
                f"no stack of blocks was found in {type(model).__name__}: name the sites (modules, --modules)"
            )
        names = {id(m): n for n, m in model.named_modules()}
        sites = [Site(names[id(b)], b, OUTPUT) for b in blocks]
    # block i's input is hidden state i, its output hidden state i + 1, but for the last block
    # of a model with a final norm (GPT-2's ln_f: its last hidden state is the norm's output)
    normed = bool(final_norm_modules(model))
    at = {(id(b), INPUT): i for i, b in enumerate(blocks)}
    at |= {(id(b), OUTPUT): i + 1 for i, b in enumerate(blocks) if not (normed and i == len(blocks) - 1)}
    return sites, [at.get((id(s.module), s.read), -1) for s in sites]


def _sums_plan(
    need_cov: bool, model: str, check: Callable[[dict[str, list[int]]], None] = lambda _dims: None
) -> SumsPlan:
    """The first pass's sums: every site's on the device of its activations, with an exact
    covariance when a ``pc:K`` removal needs its directions (refused when they do not fit);
    ``check`` sees the sites' widths first (the first batch)."""
    from isotui.extract.memory_plan import LayerPlan, MemoryPlan, cov_bytes, measured_budget, size_text

    def plan(dims: dict[str, list[int]], where: dict[str, list[Any]]) -> MemoryPlan:
        check(dims)
        widths = [d for ds in dims.values() for d in ds]
        on = [str(w) for ws in where.values() for w in ws]
        budgets: dict[str, int | None] = {w: measured_budget(w) for w in dict.fromkeys(on)}
        if need_cov:
            for w, budget in budgets.items():
                need = sum(cov_bytes(d) for d, o in zip(widths, on, strict=True) if o == w)
                if budget is not None and need > budget:
                    raise IsotuiError(
                        f"remove pc:K needs each site's exact covariance, {size_text(need)} on {w} for "
                        f"model {model!r}, more than the {size_text(budget)} it has left; name fewer "
                        "sites with modules (--modules)"
                    )
        layers = [
            LayerPlan(f"site {k}", d, o, need_cov, 0) for k, (d, o) in enumerate(zip(widths, on, strict=True))
        ]
        return MemoryPlan(layers, budgets)

    return plan


def _moments(acc: LayerAccumulator, need_cov: bool, site: str) -> SiteMoments:
    """A site's first-pass moments (see :class:`SiteMoments`)."""
    stats = acc.finalize()
    if acc.n_all < 2 or not np.all(np.isfinite(stats.mean)):
        raise IsotuiError(f"site {site} kept {acc.n_all} finite vectors; ablate needs at least 2")
    vecs = None
    if need_cov:
        eigen = acc.exact_eigen(directions=True)
        assert eigen is not None and eigen.vecs_c is not None  # the plan kept the covariance
        vecs = eigen.vecs_c.cpu().numpy()
    return SiteMoments(np.asarray(stats.mean, np.float64), np.asarray(stats.dim_contrib, np.float64), vecs)


def _curve(accs: list[LayerAccumulator]) -> tuple[list[float], list[float]]:
    stats = [a.finalize() for a in accs]
    return [float(s.avg_cos) for s in stats], [float(s.drift_norm) for s in stats]


@dataclass
class EditedSums:
    """The edited pass's sums, per run (0: clean, then each edit): every hidden state's
    accumulator, the summed loss and final change; and the kept and predicted tokens and the
    samples they came from. They add across shards: :meth:`merge`, then :func:`fill`."""

    accs: list[list[LayerAccumulator]]
    loss: list[float]
    change: list[float]
    kept_tokens: int
    loss_tokens: int
    n_samples: int

    @classmethod
    def of(cls, stream: LayerStream) -> EditedSums:
        assert stream.run_accs is not None
        loss, change = ([float(x) for x in xs] for xs in (stream.run_loss, stream.run_change))
        return cls(stream.run_accs, loss, change, stream.kept_tokens, stream.loss_tokens, stream.loop.total)

    def merge(self, other: EditedSums) -> None:
        for mine, theirs in zip(self.accs, other.accs, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                a.merge(b)
        self.loss = [a + b for a, b in zip(self.loss, other.loss, strict=True)]
        self.change = [a + b for a, b in zip(self.change, other.change, strict=True)]
        self.kept_tokens += other.kept_tokens
        self.loss_tokens += other.loss_tokens
        self.n_samples += other.n_samples

    def state(self) -> dict[str, object]:
        """As :func:`isotui.extract.runner.extract_state` lays a state out (components: each run's
        accumulator states; the rest facts), for :func:`isotui.experiments.shards.state_payload`."""
        components = {f"run{r}": [a.state() for a in accs] for r, accs in enumerate(self.accs)}
        return {"components": components, "loss": self.loss, "change": self.change} | {
            k: getattr(self, k) for k in ("kept_tokens", "loss_tokens", "n_samples")
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EditedSums:
        from isotui.core.accumulator import LayerAccumulator

        runs = state["components"]
        accs = [[LayerAccumulator.from_state(s) for s in runs[f"run{r}"]] for r in range(len(runs))]
        counts = (int(state[k]) for k in ("kept_tokens", "loss_tokens", "n_samples"))
        return cls(accs, [float(x) for x in state["loss"]], [float(x) for x in state["change"]], *counts)


def fill(result: AblationResult, sums: EditedSums) -> AblationResult:
    """``result``'s numbers (rows, curves, the clean curves, the token counts) from ``sums``:
    its labels (sites, removals, layers, sizes, dims) are kept."""
    tokens, kept = sums.loss_tokens, sums.kept_tokens

    def loss(run: int) -> float:
        return sums.loss[run] / tokens if result.objective != "none" and tokens else math.nan

    result.avg_cos, result.drift_norm = _curve(sums.accs[0])
    clean = result.avg_cos[-1]
    for n, (row, curves) in enumerate(zip(result.rows, result.curves, strict=True)):
        run, base = 2 * n + 1, 2 * n + 2
        curves.avg_cos, curves.drift_norm = _curve(sums.accs[run])
        curves.avg_cos_random, curves.drift_norm_random = _curve(sums.accs[base])
        row.loss, row.loss_ablated, row.loss_random = loss(0), loss(run), loss(base)
        row.delta_loss, row.delta_loss_random = loss(run) - loss(0), loss(base) - loss(0)
        if kept:  # else nan: no kept token (a shard of samples that are all special tokens)
            row.final_change, row.final_change_random = sums.change[run] / kept, sums.change[base] / kept
        row.recovery = curves.avg_cos[-1] / clean if clean else math.nan
    result.meta["n_samples"], result.meta["n_tokens"], result.meta["loss_tokens"] = (
        sums.n_samples,
        kept,
        tokens,
    )
    return result


def _result(
    spec: RunSpec,
    prepared: Prepared,
    loaded: LoadedModel,
    objective: LMObjective | None,
    head_note: str | None,
    sums: EditedSums,
    notes: list[str],
    sites: list[Site],
    layers: list[int],
    labels: list[tuple[int, Removal]],
    edits: list[Edit],
    start: float,
) -> AblationResult:
    rows: list[AblationRow] = []
    curves: list[AblationCurves] = []
    for n, (k, removal) in enumerate(labels):
        change = edits[2 * n].change
        assert isinstance(change, Change)
        nan = math.nan  # the numbers are fill's
        row = AblationRow(
            spec.model, sites[k].label, removal.label, nan, nan, nan, nan, nan, nan, nan, nan, 0, 0
        )
        row.layer, row.removed = layers[k], change.size
        rows.append(row)
        curves.append(AblationCurves([], [], [], [], list(change.dims)))
    meta: AblationMeta = {
        "data": prepared.spec.data.describe(),
        "n_samples": sums.n_samples,
        "n_tokens": sums.kept_tokens,
        "loss_tokens": sums.loss_tokens,
        "lm_class": type(loaded.model).__name__,
        "special_tokens": spec.special_tokens,
        "dtype": prepared.dtype,
        "seed": spec.seed,
        "forwards": 1 + len(edits),
        "seconds": round(time.perf_counter() - start, 3),
    }
    notes = [*loaded.notes, *([head_note] if head_note else []), *notes]
    kind = objective.kind if objective else "none"
    return fill(AblationResult(spec.model, kind, rows, curves, [], [], notes, meta), sums)
