"""A streamed text corpus on the engine loop: tokenised window by window, batches sorted by length
within a window, so the run's memory is set by the window and the batch, never by the corpus.

:class:`StreamFeeder` is a :class:`TextFeeder` whose tokens are those of the current window only
(batches name samples by their index in the whole corpus, as everywhere, so reservoir keys and
shards are the same as in a plain run); :class:`StreamPlan` is a :class:`BatchPlan` that reads
the next window when the batches of one are done. A shard (``opts.sample_ids``) runs its own
samples of each window and tokenises the others only for corpus-level counts (type weights).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeGuard

import numpy as np

from isotui.data.stream import StreamedSamples
from isotui.extract.inputs import PADDING_SENSITIVE, TextFeeder, _pad_id, make_feeder, takes_token_types
from isotui.extract.planning import BatchPlan, selected_ids
from isotui.extract.tokens import Tokens, tokenize
from isotui.models.loading import UNKNOWN_CHECK_SAMPLES, LoadedModel, check_unknown_share

WINDOW = 4096  # samples tokenised, and sorted by length, together


def is_stream(samples: Sequence[str]) -> TypeGuard[StreamedSamples]:
    """Whether ``samples`` is a streamed corpus (read window by window)."""
    return isinstance(samples, StreamedSamples)


class StreamFeeder(TextFeeder):
    """Text batches from the current window of a streamed corpus (see the module's doc).

    ``peak_held``: the most samples' texts held at once (the window), for tests."""

    def __init__(
        self,
        loaded: LoadedModel,
        samples: StreamedSamples,
        max_length: int,
        accepts: Callable[[str], bool],
    ) -> None:
        if loaded.modality != "text":  # the plain feeder's one sentence for a model of images or audio
            make_feeder(loaded, (), "text", max_length, accepts)
        self.loaded = loaded
        self.samples = samples
        self.max_length = max_length
        self.with_types = takes_token_types(loaded, accepts)
        self.pad_id = _pad_id(loaded.tokenizer)
        self.enc_dec = bool(getattr(loaded.model.config, "is_encoder_decoder", False))
        self.same_length = loaded.model_type in PADDING_SENSITIVE
        self.tokens = Tokens(np.zeros(0, np.int32), np.zeros(0, bool), None, np.zeros(1, np.int64))
        self.lengths = self.tokens.lengths
        self.same_length_key: np.ndarray | None = None
        self.base = 0  # the corpus index of the current window's first sample
        self.peak_held = 0
        self.checked = False

    def windows(self) -> Iterator[tuple[int, Tokens]]:
        """(corpus index of its first sample, its tokens) of each window, in corpus order."""
        base, texts = 0, []
        for text in self.samples:
            texts.append(text)
            if len(texts) == WINDOW:
                tokens, texts = self._tokenize(texts), []  # the texts go before the batches run
                yield base, tokens
                base += len(tokens.lengths)
        if texts:
            yield base, self._tokenize(texts)

    def token_windows(self) -> Iterator[Tokens]:
        """Every window's tokens (a pass of its own: corpus-level counts before the run)."""
        return (tokens for _, tokens in self.windows())

    def _tokenize(self, texts: list[str]) -> Tokens:
        self.peak_held = max(self.peak_held, len(texts))
        tokens = tokenize(self.loaded.tokenizer, texts, self.max_length, with_types=self.with_types)
        if not self.checked:  # as the plain feeder: the first samples, once
            first = int(tokens.offsets[min(UNKNOWN_CHECK_SAMPLES, len(tokens.lengths))])
            check_unknown_share(self.loaded, tokens.ids[:first], tokens.special[:first])
            self.checked = True
        return tokens

    def show(self, base: int, tokens: Tokens) -> None:
        """Make ``tokens`` (samples ``base``...) the window batches are fed from."""
        self.base, self.tokens, self.lengths = base, tokens, tokens.lengths
        self.same_length_key = self.lengths if self.same_length else None

    def local(self, idx: Sequence[int]) -> list[int]:
        """Corpus indices -> indices in the current window."""
        return [int(i) - self.base for i in idx]

    def feed(self, idx: list[int]) -> Any:
        return super().feed(self.local(idx))


class StreamPlan(BatchPlan):
    """Batches of a streamed corpus: each window's (shard's) samples, longest first, cut by the
    batch size or token budget as :class:`BatchPlan` cuts them (a back-off carries over to later
    windows); the batches name corpus indices."""

    def __init__(
        self,
        feeder: StreamFeeder,
        sample_ids: Sequence[int] | None,
        *,
        batch_size: int | None,
        token_budget: int,
    ) -> None:
        super().__init__(np.zeros(0, np.int64), [], batch_size=batch_size, token_budget=token_budget)
        self.feeder = feeder
        n = len(feeder.samples)
        self.member: np.ndarray | None = None
        self.total = n
        if sample_ids is not None:
            self.member = np.zeros(n, bool)
            self.member[selected_ids(n, sample_ids)] = True
            self.total = int(self.member.sum())

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[list[int]]:
        for base, tokens in self.feeder.windows():
            self.feeder.show(base, tokens)
            count = len(tokens.lengths)
            chosen = np.arange(count)
            if self.member is not None:
                chosen = chosen[self.member[base : base + count]]
            self.lengths, self.chosen = tokens.lengths, chosen
            self.same_key = self.feeder.same_length_key
            for batch in super().__iter__():
                yield [base + i for i in batch]

    def width(self, idx: Sequence[int]) -> int:
        return super().width(self.feeder.local(idx))

    def run_lengths(self) -> np.ndarray | None:
        """Not known before the pass: the window read so far is not the run."""
        return None


def stream_plan(
    loaded: LoadedModel,
    samples: StreamedSamples,
    max_length: int,
    accepts: Callable[[str], bool],
    sample_ids: Sequence[int] | None,
    *,
    batch_size: int | None,
    token_budget: int,
) -> tuple[StreamFeeder, StreamPlan]:
    """The feeder and batch plan of a streamed corpus (what :meth:`BatchLoop.prepare` keeps)."""
    feeder = StreamFeeder(loaded, samples, max_length, accepts)
    return feeder, StreamPlan(feeder, sample_ids, batch_size=batch_size, token_budget=token_budget)
