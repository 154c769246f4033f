"""A tokenized corpus held compactly (flat int32 arrays + offsets), and padded batches from it.

Python lists of token ids cost ~36 bytes a token and the tokenizer's own encodings more; flat
arrays cost 4-5, so a large corpus does not make the run's memory grow with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

CHUNK = 2048


@dataclass
class Tokens:
    """Token ids, special-token flags and (optionally) token types of every sample."""

    ids: np.ndarray  # int32, all samples concatenated
    special: np.ndarray  # bool
    types: np.ndarray | None  # int8, or None when the model takes no token_type_ids
    offsets: np.ndarray  # int64, len(samples) + 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def batch(self, idx: list[int], pad_id: int) -> dict[str, Any]:
        """Right-padded tensors for samples ``idx``: input_ids, attention_mask, special, types."""
        import torch

        lengths = self.lengths[idx]
        width = int(lengths.max())
        ids = np.full((len(idx), width), pad_id, dtype=np.int64)
        special = np.zeros((len(idx), width), dtype=bool)
        types = np.zeros((len(idx), width), dtype=np.int64) if self.types is not None else None
        for row, i in enumerate(idx):
            start, end = self.offsets[i], self.offsets[i + 1]
            ids[row, : end - start] = self.ids[start:end]
            special[row, : end - start] = self.special[start:end]
            if types is not None and self.types is not None:  # both or neither
                types[row, : end - start] = self.types[start:end]
        mask = np.arange(width)[None, :] < lengths[:, None]
        return {
            "input_ids": torch.from_numpy(ids),
            "attention_mask": torch.from_numpy(mask.astype(np.int64)),
            "special": torch.from_numpy(special),
            "token_type_ids": torch.from_numpy(types) if types is not None else None,
        }


def tokenize(tokenizer: Any, samples: Sequence[str], max_length: int, *, with_types: bool) -> Tokens:
    """Tokenize in chunks (truncation to ``max_length``), keeping only compact arrays."""
    ids, special, types, lengths = [], [], [], []
    for start in range(0, len(samples), CHUNK):
        enc = tokenizer(
            samples[start : start + CHUNK],
            truncation=True,
            max_length=max_length,
            return_special_tokens_mask=True,
            return_attention_mask=False,
            padding=False,
        )
        for k, row in enumerate(enc["input_ids"]):
            lengths.append(len(row))
            ids.append(np.asarray(row, dtype=np.int32))
            special.append(np.asarray(enc["special_tokens_mask"][k], dtype=bool))
            if with_types and "token_type_ids" in enc:
                types.append(np.asarray(enc["token_type_ids"][k], dtype=np.int8))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Tokens(
        ids=np.concatenate(ids) if ids else np.zeros(0, np.int32),
        special=np.concatenate(special) if special else np.zeros(0, bool),
        types=np.concatenate(types) if types else None,
        offsets=offsets,
    )
