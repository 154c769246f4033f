"""The reservoir sample of a layer run, handed out as arrays (issue 27 item 5): per layer, the
vectors its reservoir kept, with the sample and position each came from and, for text, its
token id and text.

A reservoir keeps vectors and their keys only (:func:`isotui.core.accumulator.sample_keys`, a
pure function of the seed, the sample's index in the corpus and the position). Where each kept
vector came from is found again by computing the key of every token of the corpus and matching:
no bookkeeping during the run, and no cost unless a sample is asked for. Layers whose units are
not the corpus's tokens (images, audio, a streamed corpus whose tokens are not held) get their
vectors with ``-1`` for the sample, position and token id, and empty texts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LayerSample:
    """One layer's kept vectors (``vectors``: n x d float32, in corpus order: by sample, then
    position), where each came from and the token it stands for (-1 and "" when not a token)."""

    vectors: np.ndarray
    sample_index: np.ndarray  # int64: the sample's index in the corpus
    position: np.ndarray  # int64: the position in the sample (text: its token index)
    token_ids: np.ndarray  # int64
    tokens: list[str]

    def __len__(self) -> int:
        return len(self.vectors)


Sample = dict[str, list[LayerSample]]  # component -> its layers, layer 0 first


def reservoir_sample(
    accs: dict[str, list[Any]], feeder: Any, tokenizer: Any, seed: int, config: Any
) -> Sample:
    """Every layer's reservoir (``accs``: component -> its accumulators), located in the corpus
    ``feeder`` read (its ``tokens`` for text) with the run's ``seed``."""
    tokens = getattr(feeder, "tokens", None)
    where = _token_keys(tokens, seed) if tokens is not None else None
    start = getattr(config, "decoder_start_token_id", None)
    start = start if isinstance(start, int) else (getattr(config, "pad_token_id", None) or 0)
    texts: dict[int, str] = {}
    out: Sample = {}
    for component, layers in accs.items():
        out[component] = []
        for acc in layers:
            if acc.res is None or acc.res_keys is None:
                vectors, keys = np.zeros((0, acc.dim), np.float32), np.zeros(0)
            else:
                vectors = acc.res.detach().cpu().numpy().astype(np.float32, copy=False)
                keys = acc.res_keys.detach().cpu().numpy()
            sample, position, ids = _locate(keys, where, tokens, component == "decoder", start)
            order = np.lexsort((position, sample))
            ids = ids[order]
            for i in np.unique(ids[ids >= 0]).tolist():
                if i not in texts:
                    texts[i] = str(tokenizer.convert_ids_to_tokens(int(i))) if tokenizer is not None else ""
            out[component].append(
                LayerSample(
                    vectors[order],
                    sample[order],
                    position[order],
                    ids,
                    [texts.get(int(i), "") for i in ids],
                )
            )
    return out


def _token_keys(tokens: Any, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted keys, their sample, their position) for every token of the corpus."""
    import torch

    from isotui.core.accumulator import sample_keys

    lengths = np.diff(tokens.offsets)
    sample = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    position = np.arange(len(sample), dtype=np.int64) - tokens.offsets[:-1].astype(np.int64)[sample]
    keys = sample_keys(seed, torch.from_numpy(sample), torch.from_numpy(position)).numpy()
    order = np.argsort(keys, kind="stable")
    return keys[order], sample[order], position[order]


def _locate(
    keys: np.ndarray,
    where: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
    tokens: Any,
    decoder: bool,
    start: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sample, position, token id) of each key; -1 where a key is no token of the corpus. The
    decoder of an encoder-decoder reads the text shifted right: position p is token p - 1, and
    position 0 its start token."""
    n = len(keys)
    none = np.full(n, -1, dtype=np.int64)
    if where is None or n == 0:
        return none, none.copy(), none.copy()
    sorted_keys, samples, positions = where
    at = np.clip(np.searchsorted(sorted_keys, keys), 0, len(sorted_keys) - 1)
    found = sorted_keys[at] == keys
    sample = np.where(found, samples[at], -1)
    position = np.where(found, positions[at], -1)
    index = tokens.offsets[np.maximum(sample, 0)] + position - (1 if decoder else 0)
    ids = tokens.ids[np.clip(index, 0, len(tokens.ids) - 1)].astype(np.int64)
    if decoder:
        ids = np.where(position == 0, start, ids)
    return sample, position, np.where(found, ids, -1)
