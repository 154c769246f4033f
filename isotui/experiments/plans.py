"""``--dry-run`` for every experiment that streams a model: a request's memory plan from the
model's config alone (built on the meta device, no weights read; see
:mod:`isotui.extract.memory_plan`). The registry names one of these per experiment; the CLI's
one ``--dry-run`` path prints them. Import-light: torch and transformers load when a plan is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from isotui.errors import IsotuiError

if TYPE_CHECKING:
    from isotui.experiments.attention import AttentionRequest
    from isotui.experiments.checkpoints import CheckpointsRequest
    from isotui.experiments.final_norm import FinalNormRequest
    from isotui.experiments.gradients import GradientsRequest
    from isotui.experiments.layerwise import LayersRequest
    from isotui.experiments.qk_dynamics import DynamicsRequest
    from isotui.extract.memory_plan import ExperimentPlan, MemoryPlan, Paper
    from isotui.extract.phase_time import PhaseTimes
    from isotui.spec import RunSpec


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


def layers(request: LayersRequest | CheckpointsRequest) -> MemoryPlan:
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
    plan = layers_plan(paper, spec.reservoir)
    from isotui.experiments.checkpoints import CheckpointsRequest

    repeat = len(request.checkpoints) if isinstance(request, CheckpointsRequest) else 1
    plan.phases = _phase_times(paper, plan, spec, repeat)
    plan.estimates.append("phases")
    return plan


# the tokens a time estimate is given for when --max-samples does not bound the corpus
TOKENS_PER_ESTIMATE = 1_000_000


def _phase_times(paper: Paper, plan: MemoryPlan, spec: RunSpec, repeat: int) -> PhaseTimes:
    """The run's time per phase (:mod:`isotui.extract.phase_time`): for ``--max-samples`` samples
    of the planned length, else per :data:`TOKENS_PER_ESTIMATE` tokens."""
    from isotui.extract.phase_time import estimate, paper_work

    tokens = spec.max_samples * paper.length if spec.max_samples else TOKENS_PER_ESTIMATE
    times = estimate(paper_work(paper, plan, tokens), repeat=repeat)
    times.bounded = bool(spec.max_samples)
    return times


def attention(request: AttentionRequest | DynamicsRequest) -> ExperimentPlan:
    """The attention probe (and each checkpoint of ``qk-dynamics``, with its subsample)."""
    from isotui.extract.memory_plan import attention_plan

    return attention_plan(_paper(request.spec), sample_size=request.sample_size, experiment=request.kind)


def final_norm(request: FinalNormRequest) -> ExperimentPlan:
    from isotui.extract.memory_plan import final_norm_plan

    spec = request.spec
    return final_norm_plan(_paper(spec), every_layer=request.every_layer, reservoir=spec.reservoir)


def gradients(request: GradientsRequest) -> ExperimentPlan:
    from isotui.extract.memory_plan import gradients_plan

    return gradients_plan(_paper(request.spec, head="lm"), model=request.spec.model)
