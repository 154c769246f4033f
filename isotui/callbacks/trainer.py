"""The transformers ``Trainer``'s callback: layer metrics of the model in training, every N steps.

::

    from isotui.callbacks import IsotuiCallback

    trainer = Trainer(model=model, args=args, train_dataset=..., processing_class=tokenizer)
    IsotuiCallback("builtin", every=100).attach(trainer)
    trainer.train()

At the start of training (step 0 is due when ``every`` divides it or ``at`` names it) and at the
end of every step due, after the optimizer's update (the weights the Trainer's save at that step
writes), the model is probed (:class:`~isotui.callbacks.probe.Probe`) and its scalars go through
``trainer.log``: ``state.log_history`` and every reporter of ``report_to`` (TensorBoard, W&B,
CSV-like loggers) receive ``isotui/avg_cos/layer_3`` and the others at that step. The series is
written to ``out`` (default ``OUTPUT_DIR/isotui``), which ``isotui experiment checkpoints -c``
and ``isotui figure machina2024-heatmap -c`` read as a checkpoint series.

Only the world's process zero probes (the model as it holds it: under DDP a whole replica); a
model sharded across processes (FSDP, DeepSpeed ZeRO-3) is not supported.

A probe never ends the training: ``out=`` and the probe's settings are checked when training
starts, and a failure of the probe at that start refuses it in one sentence; a later probe that
fails (a full disk, a plug-in metric raising, non-finite hidden states, out of memory) is said
once, as a warning of the logger of transformers' own callbacks (``transformers.trainer_callback``,
which follows ``TrainingArguments.log_level`` and ``TRANSFORMERS_VERBOSITY``), and skipped: the
training goes on as without the callback.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.utils import logging

from isotui.callbacks.probe import DEFAULT_EVERY, DEFAULT_METRICS, DEFAULT_SAMPLES, Probe
from isotui.errors import IsotuiError

# the logger of transformers' own callbacks (EarlyStoppingCallback's warnings): the trainer's
# handler and verbosity, not a logger of isotui's that nothing shows
logger = logging.get_logger("transformers.trainer_callback")


class IsotuiCallback(TrainerCallback):  # type: ignore[misc]  # transformers' class is unannotated
    """Probe the model in training on ``data`` every ``every`` steps and at the steps ``at``
    (see :class:`~isotui.callbacks.probe.Probe` for the keywords); ``tokenizer=`` or
    ``processor=`` override the trainer's ``processing_class``. Add it with :meth:`attach`, which
    gives it the trainer its scalars are logged through."""

    def __init__(
        self,
        data: str = "builtin",
        *,
        every: int = DEFAULT_EVERY,
        at: Iterable[int] = (),
        max_samples: int = DEFAULT_SAMPLES,
        metrics: Iterable[str] = DEFAULT_METRICS,
        out: str | Path | None = None,
        experiments: Iterable[str] = ("layers",),
        top_k: int = 10,
        tokenizer: Any = None,
        processor: Any = None,
        **options: Any,
    ) -> None:
        self.probe = Probe(
            data, every=every, at=at, max_samples=max_samples, metrics=metrics, out=out,
            experiments=experiments, top_k=top_k, **options,
        )  # fmt: skip
        self.tokenizer = tokenizer
        self.processor = processor
        self.trainer: Any = None
        self.own: Any = None  # the coming step's own-backward hooks, when it is probed with gradients
        self.no_own = "no training step ran before it"

    def attach(self, trainer: Any) -> IsotuiCallback:
        """Add this callback to ``trainer`` and log through it; returns the callback."""
        if self.trainer is not None and self.trainer is not trainer:
            raise IsotuiError(
                "this IsotuiCallback is attached to another trainer already; make one per trainer"
            )
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is None:
            raise IsotuiError(
                "IsotuiCallback logs through its trainer: add it with IsotuiCallback(...).attach(trainer), "
                "not Trainer(callbacks=[...])"
            )
        if state.is_world_process_zero:  # before the first step: refused in one sentence
            self.probe.start(Path(args.output_dir) / "isotui")
            tokenizer, processor = self._processing(kwargs)
            self.probe.check(kwargs["model"], tokenizer=tokenizer, processor=processor)
        self._probe(state, kwargs, before_training=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Before a step whose end is probed with gradients: hook its own backward, if it is one."""
        if not (
            state.is_world_process_zero and self.probe.gradients and self.probe.due(state.global_step + 1)
        ):
            return
        if args.gradient_accumulation_steps > 1:
            self.no_own = (
                f"gradient accumulation ({args.gradient_accumulation_steps} batches per step, "
                "gradient_accumulation_steps)"
            )
            return
        try:
            self.own = self.probe.step_gradients(kwargs["model"], self._processing(kwargs)[0])
        except Exception as exc:  # the probe set's gradients instead: the step is never harmed
            self.no_own = f"its hooks could not be set ({type(exc).__name__}: {exc})"

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        try:
            self._probe(state, kwargs, control)
        finally:
            if self.own is not None:
                self.own.disarm()
            self.own, self.no_own = None, "no training step ran before it"

    def _processing(self, kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if self.tokenizer is not None or self.processor is not None:
            return self.tokenizer, self.processor
        return _split_processing(kwargs.get("processing_class") or kwargs.get("tokenizer"))

    def _probe(
        self, state: Any, kwargs: dict[str, Any], control: Any = None, before_training: bool = False
    ) -> None:
        step = int(state.global_step)
        if not state.is_world_process_zero or not self.probe.due(step):
            return
        tokenizer, processor = self._processing(kwargs)
        model = kwargs["model"]
        scalars = self.probe.attempt(
            step,
            lambda: self.probe.measure(
                model, step, tokenizer=tokenizer, processor=processor, own=self.own,
                no_own=self.no_own, epoch=state.epoch,
            ),
            logger.warning,
            model=model,
            before_training=before_training,
        )  # fmt: skip
        if scalars is None:  # failed, said, skipped
            return
        # the trainer's on_log clears should_log: kept, so the step's own loss is logged as without us
        should_log = getattr(control, "should_log", False)
        self.trainer.log(scalars)
        if control is not None:
            control.should_log = should_log


def _split_processing(processing: Any) -> tuple[Any, Any]:
    """The trainer's ``processing_class`` as (tokenizer, processor): a tokenizer is text's."""
    from transformers import PreTrainedTokenizerBase

    if processing is None:
        return None, None
    if isinstance(processing, PreTrainedTokenizerBase):
        return processing, None
    inner = getattr(processing, "tokenizer", None)  # a multimodal processor holding a tokenizer
    if isinstance(inner, PreTrainedTokenizerBase) and getattr(processing, "image_processor", None) is None:
        return inner, None
    return None, processing
