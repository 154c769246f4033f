"""The gradients experiment's metrics from a training step's own backward: no extra backward.

When a probe with gradients is due at the end of a step, :class:`StepGradients` is armed before
the step: on the model's base (:func:`body`) a forward pre-hook asks for
its hidden states (``output_hidden_states=True``: the same computation, its per-layer outputs
returned too) and keeps the batch's ``input_ids`` and ``attention_mask``; a forward hook keeps each
hidden state (detached) and registers a tensor hook on it that keeps its gradient when the
step's own backward passes (the hook only reads it: the training's gradients are unchanged).
After the step, :meth:`StepGradients.result` folds every layer's (activation, gradient) pairs of
the batch's kept tokens (attended, not special; the mask token counts, it is where a masked-LM
loss is) into the gradients experiment's accumulators (:class:`isotui.core.gradients.GradAccumulator`)
and finalises them as that experiment does: a :class:`~isotui.experiments.gradients.GradientResult`.

These are the gradients of the training's loss as the training computes it (usually a mean over
the batch's target tokens, so their norms are those of the probe set's summed loss divided by the
number of targets), on the training batch, in train mode (dropout on). Where the step's own
backward cannot give them, :meth:`StepGradients.result` says why in one sentence and the probe
falls back to the gradients experiment on the probe set: gradient accumulation (several forwards
per step), a model whose base gives no hidden states, a hidden state off the loss's path.
"""

from __future__ import annotations

from typing import Any

from isotui.errors import IsotuiError

SOURCE_OWN = "own-backward"  # the series' record and the logged isotui/gradients_own_backward = 1
SOURCE_PROBE = "probe-set"


def body(model: Any) -> Any:
    """What isotui measures of a model in training: a transformers model's base model (the
    ``BertModel`` inside ``BertForMaskedLM``: what ``isotui run`` loads from its checkpoint, by
    ``AutoModel``), without the head, whose vocabulary projection over every position would
    cost more than the layers (85% of a probe of train-tiny's BERT); any other model as it is."""
    import torch

    base = getattr(model, "base_model", None)
    return base if isinstance(base, torch.nn.Module) and base is not model else model


class StepGradients:
    """Hooks on ``model``'s base for one training step; :meth:`result` after its backward."""

    def __init__(self, model: Any, tokenizer: Any, top_k: int, seed: int) -> None:
        self.base = body(model)
        self.name = type(model).__name__
        self.tokenizer, self.top_k, self.seed = tokenizer, top_k, seed
        self.handles: list[Any] = []
        self.forwards = 0
        self.inputs: dict[str, Any] = {}
        self.hidden: list[Any] = []
        self.grads: dict[int, Any] = {}
        self.problem: str | None = None

    def arm(self) -> StepGradients:
        try:  # one at a time: a failure leaves no hook behind
            self.handles.append(self.base.register_forward_pre_hook(self._before, with_kwargs=True))
            self.handles.append(self.base.register_forward_hook(self._after))
        except BaseException:
            self.disarm()
            raise
        return self

    def disarm(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _before(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        self.forwards += 1
        ids = args[0] if args else kwargs.get("input_ids")
        self.inputs = {"input_ids": ids, "attention_mask": kwargs.get("attention_mask")}
        return args, {**kwargs, "output_hidden_states": True}

    def _after(self, module: Any, args: Any, output: Any) -> None:
        try:  # inside the training's forward: a failure here is the probe's, never the step's
            self._keep(module, output)
        except Exception as exc:
            self.problem = f"its hooks failed on the step's forward ({type(exc).__name__}: {exc})"

    def _keep(self, module: Any, output: Any) -> None:
        import torch

        hidden = getattr(output, "hidden_states", None)
        if not isinstance(hidden, tuple | list) or not hidden:
            self.problem = f"the base model {type(module).__name__} gave no hidden states"
            return
        if self.forwards > 1:  # a second forward in the step: only the first one's batch is kept
            return
        for i, h in enumerate(hidden):
            if not isinstance(h, torch.Tensor) or h.ndim != 3 or not h.requires_grad:
                self.problem = f"hidden state {i} of {type(module).__name__} is not on the loss's path"
                return
            self.hidden.append(h.detach())
            h.register_hook(lambda g, i=i: self.grads.__setitem__(i, g.detach()))

    def result(self) -> tuple[Any, str | None]:
        """(the step's GradientResult, None), or (None, why the step's own backward could not give it)."""
        self.disarm()
        if self.problem is not None:
            return None, self.problem
        if self.forwards != 1:
            return None, f"the step ran {self.forwards} forwards of the model (gradient accumulation?)"
        missing = [i for i in range(len(self.hidden)) if i not in self.grads]
        if not self.hidden or missing:
            return None, f"hidden state {missing[0] if missing else 0} got no gradient in the step's backward"
        ids = self.inputs["input_ids"]
        if ids is None:
            return None, f"the base model {type(self.base).__name__} was called without input_ids"
        try:
            return self._finish(ids, self.inputs["attention_mask"]), None
        except IsotuiError as problem:
            return None, str(problem)

    def _finish(self, ids: Any, attention: Any) -> Any:
        import torch

        from isotui.core.gradients import GradAccumulator, random_basis
        from isotui.experiments.gradients import GradientResult, GradientRow

        special = sorted(set(getattr(self.tokenizer, "all_special_ids", None) or ()))
        mask_id = getattr(self.tokenizer, "mask_token_id", None)
        special = [s for s in special if s != mask_id]  # the masked positions carry the loss
        keep = torch.ones_like(ids, dtype=torch.bool) if attention is None else attention.bool()
        if special:
            keep = keep & ~torch.isin(ids, torch.tensor(special, device=ids.device))
        flat = keep.flatten().nonzero().squeeze(1)
        dims = [int(h.shape[-1]) for h in self.hidden]
        if self.top_k >= min(dims):
            raise IsotuiError(f"top_k={self.top_k} is not below the hidden size {min(dims)} of the model")
        rows = []
        bases: dict[int, Any] = {}
        for layer, (h, d) in enumerate(zip(self.hidden, dims, strict=True)):
            g = self.grads[layer]
            acc = GradAccumulator(d, torch.device("cpu"))
            at = flat.to(h.device)
            acc.add(h.reshape(-1, d)[at], g.reshape(-1, d)[at])
            if d not in bases:
                bases[d] = random_basis(d, self.top_k, self.seed)
            stats = acc.finalize(self.top_k, bases[d])
            rows.append(
                GradientRow(self.name, "training", "model", layer, top_k=self.top_k, **_fields(stats))
            )
        return GradientResult(
            self.name,
            "training",
            rows,
            notes=[
                "gradients of the training's own loss on the step's batch (train mode, no extra backward), "
                "w.r.t. the base model's hidden states; tokens: attended, not special (the mask token counts)"
            ],
            meta={
                "source": SOURCE_OWN,
                "n_samples": int(ids.shape[0]),
                "n_tokens": int(flat.numel()),
                "seed": self.seed,
            },
        )


def _fields(stats: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(stats)
