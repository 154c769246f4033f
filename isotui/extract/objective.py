"""The language-model objective a pass differentiates (or an ablation compares): one convention.

A model loaded with its LM head has one of two objectives (:func:`lm_objective`):

- ``causal``: position t predicts token t + 1; every real token after the first is a target
  (padding never), and a sample's last token predicts nothing (no loss depends on it);
- ``masked``: ``MASK_RATE`` of each sample's non-special tokens are masked (all replaced by the
  mask token), chosen by a seeded hash of (seed, sample, position), at least one per sample
  (:func:`mlm_mask`); the loss is on the masked positions only.

The loss is the SUM of token losses (cross-entropy, nats) over the labelled tokens, never a
batch mean, so a token's gradient is the gradient of its own sample's loss, whatever the batch
size or padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from isotui.errors import IsotuiError

if TYPE_CHECKING:
    import torch

    from isotui.extract.loop import Batch
    from isotui.models.loading import LoadedModel

MASK_RATE = 0.15
MASK_SALT = 0x6D6C6D  # separates the masking hash from the reservoir's (same seed)
IGNORE = -100  # the label of a position no loss is taken at


def mlm_mask(
    seed: int, sample_ids: torch.Tensor, positions: torch.Tensor, candidates: torch.Tensor
) -> torch.Tensor:
    """Which positions to mask: (B, T) bool, a pure function of (seed, sample, position).

    ``sample_ids`` (B,) are the samples' indices in the corpus, ``positions`` (T,), ``candidates``
    (B, T) the maskable tokens (real, non-special). About ``MASK_RATE`` of them, and at least one
    per sample that has any (the candidate with the smallest key).
    """
    import torch

    from isotui.core.accumulator import sample_keys

    b, t = candidates.shape
    keys = sample_keys(seed + MASK_SALT, sample_ids[:, None].expand(b, t), positions[None, :].expand(b, t))
    keys = torch.where(candidates, keys, torch.full_like(keys, 2.0))
    masked = keys < MASK_RATE
    lonely = candidates.any(1) & ~masked.any(1)
    if bool(lonely.any()):
        rows = lonely.nonzero().squeeze(1)
        masked[rows, keys[rows].argmin(1)] = True
    return masked


@dataclass(frozen=True)
class LMObjective:
    """A model's LM objective: ``kind`` (``masked`` or ``causal``), the ``seed`` of the masked
    positions, and the tokenizer's ``mask_id`` (masked only)."""

    kind: str
    seed: int
    mask_id: int | None = None

    def labels(self, batch: Batch, device: str) -> torch.Tensor:
        """The batch's labels (B, T, on the host; :data:`IGNORE` where no loss is taken); for a
        masked LM, the batch's device ``input_ids`` are replaced by the masked ones (the edit)."""
        import torch

        from isotui.extract.device import to_device

        ids = batch.fed.inputs["input_ids"]
        valid, special = batch.fed.valid, batch.fed.special
        if self.kind == "masked":
            assert self.mask_id is not None  # lm_objective refuses a tokenizer without one
            masked = mlm_mask(self.seed, batch.ids, torch.arange(ids.shape[1]), valid & ~special)
            masked_ids = torch.where(masked, torch.full_like(ids, self.mask_id), ids)
            batch.inputs["input_ids"] = to_device(masked_ids, device)
            return torch.where(masked, ids, torch.full_like(ids, IGNORE))
        labels = torch.full_like(ids, IGNORE)  # position t predicts token t + 1
        labels[:, :-1] = torch.where(valid[:, 1:], ids[:, 1:], labels[:, 1:])
        return labels

    def bearing(self, keep: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Of the kept positions ``keep`` (B, T), those a loss can depend on: all of them for a
        masked LM (every position feeds the masked ones); for a causal LM, those that predict
        a token (a sample's last token predicts nothing: its gradient is zero everywhere)."""
        return keep if self.kind == "masked" else keep & (labels != IGNORE)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy (float32 logits) over the labelled tokens (``labels`` on
        the logits' device)."""
        import torch

        logits = logits.float()
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
        )

    @staticmethod
    def tokens(labels: torch.Tensor) -> int:
        """How many tokens the loss is taken over (host labels)."""
        return int((labels != IGNORE).sum())


def lm_objective(loaded: LoadedModel, seed: int, model_name: str) -> LMObjective:
    """The objective of a model loaded with its LM head: masked when it is the masked-LM class
    for its config, else causal; refused for a masked LM whose tokenizer has no mask token."""
    from transformers import AutoModelForMaskedLM

    model = loaded.model
    # untyped: its stub's values (tuples) are not the model classes it holds
    masked_map: Any = AutoModelForMaskedLM._model_mapping
    if type(model.config) in masked_map and masked_map[type(model.config)] is type(model):
        mask_id: Any = getattr(loaded.tokenizer, "mask_token_id", None)
        if mask_id is None:
            raise IsotuiError(
                f"the tokenizer of model {model_name!r} has no mask token, so no masked-LM loss"
            )
        return LMObjective("masked", seed, int(mask_id))
    return LMObjective("causal", seed)
