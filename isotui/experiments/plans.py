"""``--dry-run`` for every experiment that streams a model: a request's memory plan from the
model's config alone (built on the meta device, no weights read; see
:mod:`isotui.extract.memory_plan`). The registry names one of these per experiment; the CLI's
one ``--dry-run`` path prints them. Import-light: torch and transformers load when a plan is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from isotui.errors import IsotuiError

if TYPE_CHECKING:
    from isotui.extract.memory_plan import ExperimentPlan, MemoryPlan, Paper
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


def attention(request: PlannedProbe) -> ExperimentPlan:
    """The attention probe (and each checkpoint of ``qk-dynamics``, with its subsample)."""
    from isotui.extract.memory_plan import attention_plan

    return attention_plan(_paper(request.spec), sample_size=request.sample_size, experiment=request.kind)


def final_norm(request: PlannedFinalNorm) -> ExperimentPlan:
    from isotui.extract.memory_plan import final_norm_plan

    spec = request.spec
    return final_norm_plan(_paper(spec), every_layer=request.every_layer, reservoir=spec.reservoir)


def gradients(request: Planned) -> ExperimentPlan:
    from isotui.extract.memory_plan import gradients_plan

    return gradients_plan(_paper(request.spec, head="lm"), model=request.spec.model)
