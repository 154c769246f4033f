"""The reservoir sample of a layer run, handed out as arrays (issue 27 item 5): per layer, the
vectors its reservoir kept, with the sample and position each came from and, for text, its
token id and text.

A reservoir keeps vectors and their keys only (:func:`isotui.core.accumulator.sample_keys`, a
pure function of the seed, the sample's index in the corpus and the position). Where each kept
vector came from is found again by computing the key of every token of the corpus and matching:
no bookkeeping during the run, and no cost unless a sample is asked for (a streamed corpus is
tokenised once more, window by window). Layers whose units are not the corpus's tokens (images,
audio) get their vectors with ``-1`` for the sample, position and token id, and empty texts.
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
    ``feeder`` read (its ``tokens`` for text; a streamed corpus's windows) with the run's ``seed``."""
    start = getattr(config, "decoder_start_token_id", None)
    start = start if isinstance(start, int) else (getattr(config, "pad_token_id", None) or 0)
    kept: list[tuple[str, np.ndarray, np.ndarray]] = []  # (component, vectors, keys) per layer
    for component, layers in accs.items():
        for acc in layers:
            if acc.res is None or acc.res_keys is None:
                kept.append((component, np.zeros((0, acc.dim), np.float32), np.zeros(0)))
            else:
                vectors = acc.res.detach().cpu().numpy().astype(np.float32, copy=False)
                kept.append((component, vectors, acc.res_keys.detach().cpu().numpy()))
    found = [
        (np.full(len(k), -1, np.int64), np.full(len(k), -1, np.int64), np.full(len(k), -1, np.int64))
        for _, _, k in kept
    ]
    for base, tokens in _windows(feeder):
        where = _token_keys(tokens, seed, base)
        for (component, _, keys), (sample, position, ids) in zip(kept, found, strict=True):
            _locate(keys, where, tokens, base, component == "decoder", start, (sample, position, ids))
    texts: dict[int, str] = {}
    out: Sample = {}
    for (component, vectors, _), (sample, position, ids) in zip(kept, found, strict=True):
        order = np.lexsort((position, sample))
        ids = ids[order]
        for i in np.unique(ids[ids >= 0]).tolist():
            if i not in texts:
                texts[i] = str(tokenizer.convert_ids_to_tokens(int(i))) if tokenizer is not None else ""
        layer = LayerSample(
            vectors[order], sample[order], position[order], ids, [texts.get(int(i), "") for i in ids]
        )
        out.setdefault(component, []).append(layer)
    return out


def _windows(feeder: Any) -> Any:
    """(corpus index of its first sample, its tokens) of each part of a text corpus: the whole
    corpus at once, or a streamed one's windows; none for images and audio."""
    if hasattr(feeder, "windows"):
        return feeder.windows()
    tokens = getattr(feeder, "tokens", None)
    return [] if tokens is None else [(0, tokens)]


def _token_keys(tokens: Any, seed: int, base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted keys, their sample in the corpus, their position) for every token of ``tokens``,
    whose first sample is the corpus's ``base``."""
    import torch

    from isotui.core.accumulator import sample_keys

    lengths = np.diff(tokens.offsets)
    local = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    position = np.arange(len(local), dtype=np.int64) - tokens.offsets[:-1].astype(np.int64)[local]
    sample = local + base
    keys = sample_keys(seed, torch.from_numpy(sample), torch.from_numpy(position)).numpy()
    order = np.argsort(keys, kind="stable")
    return keys[order], sample[order], position[order]


def _locate(
    keys: np.ndarray,
    where: tuple[np.ndarray, np.ndarray, np.ndarray],
    tokens: Any,
    base: int,
    decoder: bool,
    start: int,
    out: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    """Fill ``out`` (sample, position, token id) for the ``keys`` that are tokens of ``tokens``
    (``where``: their keys). The decoder of an encoder-decoder reads the text shifted right:
    position p is token p - 1, and position 0 its start token."""
    sorted_keys, samples, positions = where
    if not len(keys) or not len(sorted_keys):
        return
    at = np.clip(np.searchsorted(sorted_keys, keys), 0, len(sorted_keys) - 1)
    hit = sorted_keys[at] == keys
    sample, position = samples[at][hit], positions[at][hit]
    index = tokens.offsets[sample - base] + position - (1 if decoder else 0)
    ids = tokens.ids[np.clip(index, 0, len(tokens.ids) - 1)].astype(np.int64)
    if decoder:
        ids = np.where(position == 0, start, ids)
    out[0][hit], out[1][hit], out[2][hit] = sample, position, ids
