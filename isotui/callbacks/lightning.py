"""Lightning's callback: layer metrics of the model a ``LightningModule`` trains, every N steps.

::

    import lightning as L
    from isotui.callbacks import IsotuiLightningCallback

    trainer = L.Trainer(max_steps=1000, callbacks=[IsotuiLightningCallback("builtin", tokenizer=tok)])
    trainer.fit(module, loader)

At the start of training (step 0, when ``every`` divides it or ``at`` names it), at the end of
every training batch whose optimizer step makes ``trainer.global_step`` due (after the update: the
weights a checkpoint saved at that step holds; under gradient accumulation, the batch that
completes the step) and at the training's last step (``at_end``, default: the batch that reaches
``max_steps``, else when the training ends, ``on_train_end``: ``max_epochs``, early stopping,
before the loggers are finalised), the model is probed (:class:`~isotui.callbacks.probe.Probe`)
and its scalars go to every logger of the trainer (``trainer.loggers``: CSV, TensorBoard, W&B,
...) through ``logger.log_metrics(scalars, step=global_step)``: at the probe's own step, not only
at the trainer's ``log_every_n_steps``. The series is written to ``out`` (default
``DEFAULT_ROOT_DIR/isotui``), which ``isotui experiment checkpoints -c`` reads as a checkpoint
series.

What is measured: ``model=`` picks it out of the ``LightningModule`` (an attribute name, or a
function of the module); by default its ``model`` attribute when it has one (the usual
``self.model = AutoModelForMaskedLM...``), else the module itself. ``tokenizer=`` /
``processor=``: by default the module's ``tokenizer`` / ``processor`` attribute.

Only the global rank zero probes (a DDP replica is whole); a model sharded across processes
(FSDP, DeepSpeed ZeRO-3) is not supported.

A probe never ends the training: ``out=``, ``model=``, the tokenizer or processor and the probe's
settings are checked when training starts, and a failure of the probe at that start refuses it
in one sentence; a later probe that fails (a full disk, a plug-in metric raising, non-finite
hidden states, out of memory) is said once, with ``rank_zero_warn(..., category=RuntimeWarning)``
as Lightning's own callbacks say a problem that does not stop the fit (EarlyStopping's missing
metric under ``strict=False``), and skipped: the training goes on as without the callback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from isotui.callbacks.probe import DEFAULT_AT_END, DEFAULT_EVERY, DEFAULT_METRICS, DEFAULT_SAMPLES, Probe
from isotui.errors import IsotuiError


class IsotuiLightningCallback(Callback):  # type: ignore[misc]  # Lightning's base is untyped here
    """Probe the model in training on ``data`` every ``every`` steps and at the steps ``at``
    (see :class:`~isotui.callbacks.probe.Probe` for the keywords) and, with ``at_end``, at the
    training's last step; ``model=`` the module's part
    to measure (attribute name or function), ``tokenizer=`` / ``processor=`` what turns the
    probe set into its inputs."""

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
        model: str | Callable[[Any], Any] | None = None,
        tokenizer: Any = None,
        processor: Any = None,
        **options: Any,
    ) -> None:
        self.probe = Probe(
            data, every=every, at=at, max_samples=max_samples, metrics=metrics, out=out,
            experiments=experiments, top_k=top_k, at_end=at_end, **options,
        )  # fmt: skip
        if model is not None and not isinstance(model, str) and not callable(model):
            raise IsotuiError(
                f"model= is the LightningModule's attribute to measure (a name) or a function of the "
                f"module (got {type(model).__name__})"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.processor = processor

    def measured(self, pl_module: Any) -> Any:
        """The part of ``pl_module`` that is probed (see ``model=``)."""
        import torch

        if callable(self.model):
            found = self.model(pl_module)
        elif isinstance(self.model, str):
            if not hasattr(pl_module, self.model):
                raise IsotuiError(
                    f"model={self.model!r}: the {type(pl_module).__name__} has no attribute {self.model!r}"
                )
            found = getattr(pl_module, self.model)
        else:
            inner = getattr(pl_module, "model", None)
            found = inner if isinstance(inner, torch.nn.Module) else pl_module
        if not isinstance(found, torch.nn.Module):
            raise IsotuiError(
                f"model= gives a {type(found).__name__}, not a torch module to measure; name the "
                f"{type(pl_module).__name__}'s attribute that holds the model"
            )
        return found

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero:  # before the first step: refused in one sentence
            self.probe.start(Path(trainer.default_root_dir) / "isotui")
            tokenizer, processor = self._inputs(pl_module)
            self.probe.check(self.measured(pl_module), tokenizer=tokenizer, processor=processor)
        self._probe(trainer, pl_module, before_training=True)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Before a batch whose step is probed with gradients: hook its own backward, if it is one."""
        coming = trainer.global_step + 1
        if not (trainer.is_global_zero and self.probe.wants_hooks(coming, trainer.max_steps)):
            return
        if not pl_module.automatic_optimization:
            self.probe.no_own = "manual optimisation (the module's training_step steps its optimizers itself)"
        elif trainer.accumulate_grad_batches > 1:
            accumulated = trainer.accumulate_grad_batches
            self.probe.no_own = f"gradient accumulation (accumulate_grad_batches={accumulated})"
        else:
            self.probe.arm(self.measured(pl_module), self._processing(pl_module)[0])

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        with self.probe.closing_step():
            self._probe(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """The training's last step, when no batch's end reached ``max_steps`` (``max_epochs``,
        early stopping, a time limit): probed now, with the weights it ended on, before the
        loggers are finalised."""
        with self.probe.after_training():
            self._probe(trainer, pl_module, last=True)

    def _processing(self, pl_module: Any) -> tuple[Any, Any]:
        tokenizer = self.tokenizer if self.tokenizer is not None else getattr(pl_module, "tokenizer", None)
        processor = self.processor if self.processor is not None else getattr(pl_module, "processor", None)
        return tokenizer, processor

    def _inputs(self, pl_module: Any) -> tuple[Any, Any]:
        """(tokenizer, processor), or one sentence when there is neither."""
        tokenizer, processor = self._processing(pl_module)
        if tokenizer is None and processor is None:
            raise IsotuiError(
                "IsotuiLightningCallback needs what turns the probe set into the model's inputs: give "
                "tokenizer= (text) or processor= (images, audio), or set the LightningModule's "
                "tokenizer attribute"
            )
        return tokenizer, processor

    def _probe(
        self, trainer: Any, pl_module: Any, before_training: bool = False, last: bool | None = None
    ) -> None:
        """Probe the step if it is due; ``last``: whether it is the training's last step (None:
        whether it reaches ``max_steps``)."""
        step = int(trainer.global_step)
        if not trainer.is_global_zero:
            return
        if last is None:
            last = 0 < trainer.max_steps <= step
        if not self.probe.due(step, last=last):
            return

        def measure() -> dict[str, float]:
            tokenizer, processor = self._inputs(pl_module)
            return self.probe.measure(
                self.measured(pl_module),
                step,
                tokenizer=tokenizer,
                processor=processor,
                epoch=int(trainer.current_epoch),
            )

        # the module's weights (the measured model's among them) looked at if the probe fails
        scalars = self.probe.attempt(step, measure, _warn, model=pl_module, before_training=before_training)
        if scalars is None:  # failed, said, skipped
            return
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)


def _warn(message: str) -> None:
    """A failed probe, said as Lightning's callbacks say a problem that does not stop the fit."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(message, category=RuntimeWarning)
