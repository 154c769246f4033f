"""The transformers ``Trainer``'s callback: layer metrics of the model in training, every N steps.

::

    from isotui.callbacks import IsotuiCallback

    trainer = Trainer(model=model, args=args, train_dataset=..., processing_class=tokenizer,
                      callbacks=[IsotuiCallback("builtin", every=100)])
    trainer.train()

(``IsotuiCallback(...).attach(trainer)`` adds it to a trainer made already.) The model and its
tokenizer or processor are those the events give (``model=``, ``processing_class=``); the trainer
the scalars are logged through is the one whose events call it (:func:`calling_trainer`: the
events carry no trainer, so it is found, once per training, as the ``Trainer`` up the call stack
whose callback handler holds this callback).

At the start of training (step 0 is due when ``every`` divides it or ``at`` names it), at the end
of every step due, after the optimizer's update (the weights the Trainer's save at that step
writes), and at the training's last step (``at_end``, default: ``max_steps``, or the step a callback
stopped it, early stopping's, before the best checkpoint is loaded back), the model is probed
(:class:`~isotui.callbacks.probe.Probe`) and its scalars go through ``trainer.log``:
``state.log_history`` and every reporter of ``report_to`` (TensorBoard, W&B, MLflow...) receive
``isotui/avg_cos/layer_3`` and the others at that step. The console printers (transformers'
``ProgressCallback``, ``PrinterCallback``, ``NotebookProgressCallback``) are left out of that call
unless ``console=True``: a probe's dozens of scalars are not printed beside the loss. The series is
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

from isotui.callbacks.probe import DEFAULT_AT_END, DEFAULT_EVERY, DEFAULT_METRICS, DEFAULT_SAMPLES, Probe
from isotui.errors import IsotuiError

# the logger of transformers' own callbacks (EarlyStoppingCallback's warnings): the trainer's
# handler and verbosity, not a logger of isotui's that nothing shows
logger = logging.get_logger("transformers.trainer_callback")

# transformers' callbacks that print every log to the console (the progress bar's write, print, a
# notebook's table): a probe's scalars skip them unless console=True
PRINTERS = ("ProgressCallback", "PrinterCallback", "NotebookProgressCallback")


class IsotuiCallback(TrainerCallback):  # type: ignore[misc]  # transformers' class is unannotated
    """Probe the model in training on ``data`` every ``every`` steps and at the steps ``at``
    (see :class:`~isotui.callbacks.probe.Probe` for the keywords) and, with ``at_end``, at the
    training's last step; ``tokenizer=`` or ``processor=`` override the trainer's
    ``processing_class``; ``console=True`` prints the scalars with the trainer's own logs. Give it
    to ``Trainer(callbacks=[...])``, or add it to a trainer with :meth:`attach`."""

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
        at_end: bool = DEFAULT_AT_END,
        console: bool = False,
        tokenizer: Any = None,
        processor: Any = None,
        **options: Any,
    ) -> None:
        self.probe = Probe(
            data, every=every, at=at, max_samples=max_samples, metrics=metrics, out=out,
            experiments=experiments, top_k=top_k, at_end=at_end, **options,
        )  # fmt: skip
        if not isinstance(console, bool):
            raise IsotuiError(
                "console= is False (the scalars go to the trainer's loggers, not the console) or True "
                f"(printed too), not {console!r}"
            )
        self.console = console
        self.tokenizer = tokenizer
        self.processor = processor
        self.trainer: Any = None

    def attach(self, trainer: Any) -> IsotuiCallback:
        """Add this callback to ``trainer`` (once: not again if its callbacks hold it already) and
        log through it; returns the callback."""
        self._belong(trainer)
        if not any(c is self for c in trainer.callback_handler.callbacks):
            trainer.add_callback(self)
        return self

    def _belong(self, trainer: Any) -> None:
        if self.trainer is not None and self.trainer is not trainer:
            raise IsotuiError("this IsotuiCallback belongs to another trainer already; make one per trainer")
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        found = calling_trainer(self)
        if found is not None:
            self._belong(found)
        elif self.trainer is None:
            raise IsotuiError(
                "IsotuiCallback found no transformers Trainer calling it: give it to "
                "Trainer(callbacks=[...]) or add it with IsotuiCallback(...).attach(trainer)"
            )
        if state.is_world_process_zero:  # before the first step: refused in one sentence
            self.probe.start(Path(args.output_dir) / "isotui")
            tokenizer, processor = self._processing(kwargs)
            self.probe.check(kwargs["model"], tokenizer=tokenizer, processor=processor)
        self._probe(state, kwargs, before_training=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Before a step whose end is probed with gradients: hook its own backward, if it is one."""
        coming = state.global_step + 1
        if not (state.is_world_process_zero and self.probe.wants_hooks(coming, state.max_steps)):
            return
        if args.gradient_accumulation_steps > 1:
            self.probe.no_own = (
                f"gradient accumulation ({args.gradient_accumulation_steps} batches per step, "
                "gradient_accumulation_steps)"
            )
            return
        self.probe.arm(kwargs["model"], self._processing(kwargs)[0])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the last step: max_steps, or a callback before this one stopped the training here
        last = 0 < state.max_steps <= state.global_step or bool(control.should_training_stop)
        with self.probe.closing_step():
            self._probe(state, kwargs, control, last=last)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The training stopped after its step's end (early stopping decides on the evaluation
        that follows it; a callback after this one): its last step probed now, before the trainer
        loads a best checkpoint back and before the reporters close at the end of training."""
        if control.should_training_stop or 0 < state.max_steps <= state.global_step:
            with self.probe.after_training():
                self._probe(state, kwargs, control, last=True)

    def _processing(self, kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if self.tokenizer is not None or self.processor is not None:
            return self.tokenizer, self.processor
        return _split_processing(kwargs.get("processing_class") or kwargs.get("tokenizer"))

    def _probe(
        self,
        state: Any,
        kwargs: dict[str, Any],
        control: Any = None,
        before_training: bool = False,
        last: bool = False,
    ) -> None:
        step = int(state.global_step)
        if not state.is_world_process_zero or not self.probe.due(step, last=last):
            return
        tokenizer, processor = self._processing(kwargs)
        model = kwargs["model"]
        scalars = self.probe.attempt(
            step,
            lambda: self.probe.measure(
                model, step, tokenizer=tokenizer, processor=processor, epoch=state.epoch
            ),
            logger.warning,
            model=model,
            before_training=before_training,
        )  # fmt: skip
        if scalars is None:  # failed, said, skipped
            return
        # the trainer's on_log clears should_log: kept, so the step's own loss is logged as without us
        should_log = getattr(control, "should_log", False)
        self._log(scalars)
        if control is not None:
            control.should_log = should_log

    def _log(self, scalars: dict[str, float]) -> None:
        """``trainer.log(scalars)``: the log history and every reporter; the console printers
        left out of this one call unless ``console=True`` (the handler's list is swapped for a
        copy without them and put back, so the event being dispatched is untouched)."""
        handler = self.trainer.callback_handler
        kept = handler.callbacks
        if not self.console:
            handler.callbacks = [c for c in kept if not prints(c)]
        try:
            self.trainer.log(scalars)
        finally:
            handler.callbacks = kept


def prints(callback: Any) -> bool:
    """Whether ``callback`` is one of transformers' console printers (or a subclass of one)."""
    return any(
        k.__name__ in PRINTERS and k.__module__.startswith("transformers.") for k in type(callback).__mro__
    )


def calling_trainer(callback: Any) -> Any:
    """The transformers ``Trainer`` whose event calls ``callback`` now, None when none does: the
    events give the model, its processing class, the optimizer and the dataloaders but not the
    trainer, whose ``log`` reaches the reporters. The trainer's loop calls the event through its
    ``callback_handler``, so the first ``self`` up the call stack that is a ``Trainer`` (a subclass:
    TRL's, sentence-transformers') whose handler holds ``callback`` is it."""
    import sys
    from types import FrameType

    from transformers import Trainer

    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            held = getattr(getattr(owner, "callback_handler", None), "callbacks", ())
            if any(c is callback for c in held):
                return owner
        frame = frame.f_back
    return None


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
