"""``--dry-run`` for every experiment that streams a model: a request's memory plan from the
model's config alone (built on the meta device, no weights read; see
:mod:`isotui.extract.memory_plan`, which plans the layer run's sums and knows no experiment:
the other experiments' plans are here, as :class:`ExperimentPlan`). The registry names one of
these per experiment; the CLI's one ``--dry-run`` path prints them. Import-light: torch and
transformers load when a plan is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from isotui.errors import IsotuiError

if TYPE_CHECKING:
    from isotui.extract.memory_plan import MemoryPlan, Paper
    from isotui.extract.phase_time import PhaseTimes
    from isotui.spec import RunSpec


# What a plan reads of a request: each experiment's request has these fields (the plans know no
# experiment, so that every experiment may import them, and none of them another experiment)
class Planned(Protocol):
    @property
    def spec(self) -> RunSpec: ...


@runtime_checkable
class PlannedSeries(Planned, Protocol):
    """A series (``checkpoints``): planned from its first checkpoint, timed for all of them."""

    @property
    def checkpoints(self) -> Sequence[object]: ...


class PlannedProbe(Planned, Protocol):
    """The attention probe's request (``attention``, and each checkpoint of ``qk-dynamics``)."""

    @property
    def kind(self) -> str: ...

    @property
    def sample_size(self) -> int: ...


class PlannedFinalNorm(Planned, Protocol):
    @property
    def every_layer(self) -> bool: ...


def _paper(spec: RunSpec, head: str | None = None) -> Paper:
    from isotui.extract.memory_plan import place_on_paper
    from isotui.models.naming import parse_model

    return place_on_paper(
        parse_model(spec.model),
        device_map=spec.device_map,
        max_memory=spec.max_memory,
        device=spec.device,
        dtype=spec.dtype,
        batch_size=spec.batch_size,
        max_length=spec.max_length,
        trust_remote_code=spec.trust_remote_code,
        head=head,
        reservoir=spec.reservoir,
    )


def layers(request: Planned) -> MemoryPlan:
    """``isotui run`` (and each checkpoint of ``checkpoints``): every hidden state's sums, and
    the time per phase (an estimate)."""
    from isotui.extract.memory_plan import layers_plan

    if request.spec.modules:
        raise IsotuiError(
            "--dry-run plans the hidden states from the model's config, and the modules --modules "
            "names are known only when the model runs (how many, how wide): drop --dry-run or --modules"
        )
    spec = request.spec
    paper = _paper(spec)
    counted = _counted(spec, paper.length)
    plan = layers_plan(paper, spec.reservoir, counted)
    repeat = len(request.checkpoints) if isinstance(request, PlannedSeries) else 1
    plan.phases = _phase_times(paper, plan, spec, repeat, None if counted is None else counted[1])
    plan.estimates.append("phases")
    return plan


# --data schemes whose whole corpus a dry run reads and tokenises (local files: cheap to count)
COUNTED_SCHEMES = ("builtin", "text", "jsonl")


def _counted(spec: RunSpec, length: int) -> tuple[int, int | None] | None:
    """The corpus as the run will count it, for the plan (:func:`isotui.extract.runner.corpus_counts`):
    (token types self-similarity follows, the most vectors a layer sees). Images and audio track
    no types; a local text corpus is read and tokenised at the planned ``length`` (what the run
    feeds); a streamed or hub corpus, or a tokenizer that does not load without the model, stays
    an estimate (None)."""
    from isotui.data.sources import MEDIA

    if spec.data.scheme in MEDIA or spec.data.scheme == "synthetic":
        return 0, None
    if spec.given is not None or spec.stream or spec.data.scheme not in COUNTED_SCHEMES:
        return None
    from isotui.data.stream import auto_stream, load_samples
    from isotui.extract.runner import corpus_counts
    from isotui.extract.tokens import tokenize
    from isotui.models.loading import text_tokenizer
    from isotui.models.naming import parse_model

    if auto_stream(spec.data):  # a corpus large enough to stream: the run counts it window by window
        return None
    tokenizer = text_tokenizer(
        parse_model(spec.model), tokenizer=spec.tokenizer, trust=spec.trust_remote_code
    )
    if tokenizer is None:
        return None
    samples = load_samples(spec.data, spec.max_samples, spec.max_length)
    tokens = tokenize(tokenizer, samples, length, with_types=False)
    if not len(tokens.ids) or tokens.special.all():  # a folder with no vocabulary (a config
        return None  # alone): the run refuses it without --tokenizer; the plan stays a guess
    return corpus_counts(tokens, include_special=spec.special_tokens == "include")


# the tokens a time estimate is given for when --max-samples does not bound the corpus
TOKENS_PER_ESTIMATE = 1_000_000


def _phase_times(
    paper: Paper, plan: MemoryPlan, spec: RunSpec, repeat: int, counted: int | None = None
) -> PhaseTimes:
    """The run's time per phase (:mod:`isotui.extract.phase_time`): for the corpus's ``counted``
    tokens, else ``--max-samples`` samples of the planned length, else per
    :data:`TOKENS_PER_ESTIMATE` tokens."""
    from isotui.extract.phase_time import estimate, paper_work

    tokens = counted or (spec.max_samples * paper.length if spec.max_samples else TOKENS_PER_ESTIMATE)
    times = estimate(paper_work(paper, plan, tokens), repeat=repeat)
    times.bounded = bool(counted or spec.max_samples)
    return times


def _bytes(n: int | None) -> str:
    """Bytes in the plan tables' words (the layer plan's)."""
    from isotui.extract.memory_plan import size_text

    return size_text(n)


@dataclass(frozen=True)
class PartPlan:
    """One accumulator of an experiment other than layers: where it lives, what it is, its bytes."""

    name: str
    device: str
    dim: int
    what: str
    bytes: int


@dataclass
class ExperimentPlan:
    """An experiment's plan from the config alone: weights and accumulators per device, what
    is exact and what sampled, what the budgets cut, the batches (``--dry-run``)."""

    experiment: str
    parts: list[PartPlan]
    budgets: dict[str, int | None]
    weights: dict[str, int]
    exact: str
    sampled: str
    batch: str
    source: str
    caps: list[str] = field(default_factory=list)

    def per_device(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for part in self.parts:
            out[part.device] = out.get(part.device, 0) + part.bytes
        return out

    def notes(self) -> list[str]:
        weights = ", ".join(f"{d} {_bytes(b)}" for d, b in self.weights.items()) or "-"
        accs = ", ".join(
            f"{d} {_bytes(b)} ({sum(p.device == d for p in self.parts)} parts"
            + (f", of {_bytes(self.budgets[d])} left" if self.budgets.get(d) is not None else "")
            + ")"
            for d, b in self.per_device().items()
        )
        return [
            f"memory plan of {self.experiment} ({self.source}): weights {weights}; accumulators {accs}",
            f"exact: {self.exact}",
            f"sampled: {self.sampled}",
            *self.caps,
            f"batches: {self.batch}",
        ]

    def table(self) -> list[str]:
        rows = [f"{'part':<24} {'device':<8} {'d':>6} {'holds':<34} {'bytes':>10}"]
        for p in self.parts:
            rows.append(f"{p.name:<24} {p.device:<8} {p.dim:>6} {p.what:<34} {_bytes(p.bytes):>10}")
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "experiment": self.experiment,
            "weights_bytes": dict(self.weights),
            "accumulator_bytes": self.per_device(),
            "budget_bytes": dict(self.budgets),
            "batch": self.batch,
            "source": self.source,
            "exact": self.exact,
            "sampled": self.sampled,
            "caps": list(self.caps),
            "parts": [
                {"name": p.name, "device": p.device, "dim": p.dim, "what": p.what, "bytes": p.bytes}
                for p in self.parts
            ],
        }


def norms_exact(sums: int, dim: int, budget: int | None) -> bool:
    """final-norm's covariances, the dry run's and the run's choice: all ``sums`` (two per norm)
    exact when they fit ``budget`` together with one batch partial (None: not measurable), else
    none."""
    from isotui.extract.memory_plan import cov_bytes, partial_bytes

    return budget is None or sums * cov_bytes(dim) + partial_bytes(dim) <= budget


def final_norm(request: PlannedFinalNorm) -> ExperimentPlan:
    """final-norm's sums: before and after each norm (the final one, or every block's), all on
    the device of the first norm's activations (the last block's for the final norm); exact
    covariances for all of them when they fit that device's budget together, else none (as the
    run decides after its first batch)."""
    from isotui.extract.memory_plan import LayerPlan, cov_bytes, partial_bytes

    paper, every_layer, reservoir = _paper(request.spec), request.every_layer, request.spec.reservoir
    d, sites = paper.dim, paper.n_blocks if every_layer else 1
    on = paper.where[1 if every_layer else -1]
    on = on if on.startswith("cuda") else "cpu"  # offloaded blocks run on the main device's copy
    budget = paper.budgets.get(on)
    full = norms_exact(sites * 2, d, budget)  # as the run decides
    names = [f"block {i} norm" for i in range(sites)] if every_layer else ["final norm"]
    partial = [PartPlan("batch partial", on, d, "float64 d x d, a side at a time", partial_bytes(d))]
    parts = [
        PartPlan(
            f"{name} {side}",
            on,
            d,
            ("exact covariance, " if full else "") + f"reservoir {reservoir:,}",
            LayerPlan(name, d, on, full, reservoir).bytes,
        )
        for name in names
        for side in ("in", "out")
    ] + (partial if full else [])
    cov = "IsoScore, effective rank and the spectrum from the exact covariance"
    return ExperimentPlan(
        "final-norm",
        parts,
        {on: budget},
        paper.weights,
        "avg_cos, drift and norms before and after each norm over every vector"
        + (f"; {cov}" if full else ""),
        f"the centred metrics from a reservoir of {reservoir:,} vectors per side"
        + ("" if full else f"; {cov.split(' from')[0]} from it too"),
        paper.batch,
        paper.source,
        []
        if full
        else [
            f"covariances: {sites * 2} of {cov_bytes(d):,} bytes each do not fit the "
            f"{_bytes(budget)} {on} has left, so none is exact"
        ],
    )


def gradients(request: Planned) -> ExperimentPlan:
    """gradients' sums: per hidden state two d x d float64 (:func:`gradient_bytes`) on its GPU
    (else the CPU); exact or refused, never sampled."""
    from isotui.extract.memory_plan import gradient_bytes

    paper, model = _paper(request.spec, head="lm"), request.spec.model
    where = [w if w.startswith("cuda") else "cpu" for w in paper.where]
    d = paper.dim
    parts = [
        PartPlan(f"layer {i}", w, d, "g g^T and x x^T (float64)", gradient_bytes(d))
        for i, w in enumerate(where)
    ]
    budgets = {w: paper.budgets.get(w) for w in dict.fromkeys(where)}
    plan = ExperimentPlan(
        "gradients",
        parts,
        budgets,
        paper.weights,
        "every statistic, over every kept token's activation and gradient (streamed float64 sums)",
        "nothing",
        paper.batch + "; the backward pass holds every layer's activations on top",
        paper.source,
    )
    for w, need in plan.per_device().items():
        if budgets[w] is not None and need > (budgets[w] or 0):
            plan.caps.append(
                f"refused as planned: model {model!r} needs {_bytes(need)} on {w} for its gradient sums, "
                f"more than the {_bytes(budgets[w])} {w} has left"
            )
    return plan


def attention_bytes(heads: int, kv_heads: int, head_dim: int, rope: bool) -> int:
    """One attention module's sums (:class:`~isotui.core.attention.AttentionAccumulator`): per
    query and key head the float64 sums of vectors and unit vectors and three counts, per query
    head the score histogram (int64 bins), score moments and extremes and the row sums; twice
    the vector sums where queries and keys are also read before the rotary embedding."""
    from isotui.core.attention import SCORE_BINS

    vectors = 8 * (heads + kv_heads) * (2 * head_dim + 3)
    scores = 8 * heads * (SCORE_BINS + 2) + 8 * 5 * heads
    rows = 8 * 5 * heads
    return vectors * (2 if rope else 1) + scores + rows


def attention(request: PlannedProbe) -> ExperimentPlan:
    """The attention probe's sums: one accumulator per block's attention module on its block's
    device, and (``sample_size``) its query/key subsamples beside them, shrunk (one size for all
    modules) to what the tightest of those devices' budgets holds, as the run shrinks them; each
    checkpoint of ``qk-dynamics`` is one, with its subsample."""
    paper, sample_size, experiment = _paper(request.spec), request.sample_size, request.kind
    config, d = paper.config, paper.dim
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or d // heads)
    rope = any(("rope" in k or "rotary" in k) for k in config.to_dict())
    modules = paper.n_blocks
    parts = [
        PartPlan(
            f"attention {i + 1}",
            paper.where[i + 1],
            head_dim,
            f"{heads} query, {kv} key heads" + (", pre-rope too" if rope else ""),
            attention_bytes(heads, kv, head_dim, rope),
        )
        for i in range(modules)
    ]
    caps: list[str] = []
    size = 0
    if sample_size:
        per_position = 2 * 4 * d  # a module's queries and keys, float32, at most d each
        homes = ["cpu" if w.startswith("mps") else w for w in paper.where[1 : modules + 1]]  # as the run
        on = {w: homes.count(w) for w in dict.fromkeys(homes)}
        size, tightest = sample_size, None
        for where, count in on.items():
            budget = paper.budgets.get(where)
            fit = sample_size if budget is None else max(2, budget // (count * per_position))
            if fit < size:
                size, tightest = fit, (where, budget)
        if tightest is not None:
            where, budget = tightest
            caps.append(
                f"query/key subsample capped at {size:,} positions per module (of {sample_size:,} asked) "
                f"to fit the {_bytes(budget or 0)} {'the CPU' if where == 'cpu' else where} has left"
            )
        parts += [
            PartPlan(
                "query/key subsample",
                where,
                d,
                f"{size:,} positions x {count} modules",
                size * count * per_position,
            )
            for where, count in on.items()
        ]
    budgets = {w: paper.budgets.get(w) for w in dict.fromkeys(p.device for p in parts)}
    return ExperimentPlan(
        experiment,
        parts,
        budgets,
        paper.weights,
        "every head's query/key norms, means and cosines, score moments and extremes, softmax "
        "statistics and entropy, over every kept position and pair",
        f"queries and keys for the common SVD from a subsample of {size:,} positions per module"
        if sample_size
        else "nothing (score histograms are binned on fixed edges)",
        paper.batch,
        paper.source,
        caps,
    )


class PlannedAblation(Planned, Protocol):
    """ablate's request: its removals (each with a ``kind``) and the sites its globs name."""

    @property
    def remove(self) -> Sequence[Any]: ...

    @property
    def modules(self) -> Sequence[str]: ...


def ablate(request: PlannedAblation) -> ExperimentPlan:
    """ablate's sums and forwards: per site its first pass's sums (an exact covariance when a
    ``pc:K`` removal needs its directions), then per run of the edited pass (the clean model, and
    an edit and its random baseline per site and removal) every hidden state's vector sums; the
    forward passes each batch makes. Sites named by globs are counted only when the model runs:
    a dry run plans the default sites (every block's output) or module names without wildcards."""
    from isotui.errors import NoHeadError
    from isotui.experiments.ablate.removal import check_rows
    from isotui.extract.memory_plan import LayerPlan, fixed_bytes
    from isotui.extract.modules import SITE_NAMES, has_wildcard

    spec, modules = request.spec, tuple(request.modules)
    if any(has_wildcard(m) or m in SITE_NAMES for m in modules):
        raise IsotuiError(
            "--dry-run plans from the model's config, and the sites a glob or a named site names are "
            "known only when the model runs: drop --dry-run, or name the modules one by one"
        )
    try:
        paper = _paper(spec, head="lm")
    except NoHeadError:  # ablate runs without a loss then
        paper = _paper(spec)
    d, n_sites = paper.dim, len(modules) or paper.n_blocks
    check_rows(n_sites, len(request.remove))  # as the run refuses it
    pc = any(r.kind == "pc" for r in request.remove)
    rows = n_sites * len(request.remove)
    on = next((w for w in paper.where if w.startswith("cuda")), "cpu")
    site_bytes = LayerPlan("site", d, on, pc, 0).bytes
    run_bytes = (paper.n_blocks + 1) * fixed_bytes(d, 0)
    states = f"vector sums of {paper.n_blocks + 1} hidden states"
    parts = [  # one line per kind of part (a thousand rows would be two thousand lines)
        PartPlan(
            f"{n_sites} sites",
            on,
            d,
            "vector sums" + (", exact covariance" if pc else ""),
            n_sites * site_bytes,
        ),
        PartPlan("clean run", on, d, states, run_bytes),
        PartPlan(f"{2 * rows} edited runs", on, d, f"each: {states}", 2 * rows * run_bytes),
    ]
    forwards = 1 + 2 * rows
    plan = ExperimentPlan(
        "ablate",
        parts,
        {on: paper.budgets.get(on)},
        paper.weights,
        "every number, over every kept token: the sites' means, avg_cos shares and covariances; per run "
        "the loss, the final states' change and every hidden state's avg_cos and drift",
        "nothing (the random baselines' directions are seeded)",
        f"{paper.batch}; each batch runs once in the first pass and {forwards} times in the second "
        f"(the clean model, then an edit and its random baseline for each of {n_sites} sites x "
        f"{len(request.remove)} removals)",
        paper.source,
    )
    return plan
