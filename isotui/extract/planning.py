"""What a streamed run measures and how it cuts the corpus into batches, before any forward pass.

The options every experiment that streams a model shares (:class:`ExtractOptions`), the max
length a model can take, the shard of samples a run measures, and the batch plan: samples sorted
longest first and cut by a batch size or a token budget, so that padding stays small and memory
is set by the batch, never by the corpus.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from isotui.core.plugin import StreamingMetric
from isotui.errors import IsotuiError
from isotui.extract.memory_values import TOKEN_BUDGET as TOKEN_BUDGET  # importable from here too
from isotui.extract.progress import Progress, ProgressCallback
from isotui.models.limits import config_position_limit, default_length, tokenizer_limit
from isotui.models.loading import LoadedModel

if TYPE_CHECKING:
    from isotui.extract.memory_plan import MemoryPlan


@dataclass
class ExtractOptions:
    max_length: int | None = None
    special_tokens: str = "exclude"
    batch_size: int | None = None
    seed: int = 0
    reservoir: int = 4096
    map_units: str = "auto"
    cap_max_length: bool = False  # see RunSpec.cap_max_length
    # a shard: measure only these samples (indices into the whole corpus, which still sets the
    # reservoir keys, masks, type weights and tracked types); None: every sample
    sample_ids: tuple[int, ...] | None = None
    exact: bool = False  # a second pass: the reservoir metrics over every vector
    # given the memory plan this process would make at its first batch, the plan to follow (a
    # shard follows the plan its run's first shard fixed); None: its own
    settle_plan: Callable[[MemoryPlan], MemoryPlan] | None = None
    keep_sample: bool = False  # hand out every layer's reservoir (Extraction.sample; extract/sample.py)
    # --max-memory as accelerate keys it: the devices whose budgets it sets (as the dry run's)
    max_memory: tuple[tuple[int | str, int], ...] | None = None
    # padded input units per batch (auto batches) where the plan sets it; None: TOKEN_BUDGET's
    token_budget: int | None = None
    # --modules: the module globs and named sites whose outputs are the rows (None: the layers)
    modules: tuple[str, ...] | None = None
    # plug-in metrics in force (isotui.core.plugin): each layer's accumulator streams them too
    metrics: tuple[StreamingMetric, ...] = ()


def position_limit(loaded: LoadedModel) -> int | None:
    """How many positions the model's embeddings have, when its config says so."""
    return config_position_limit(getattr(loaded.model, "config", None))


def _special_count(tokenizer: Any) -> int:
    try:
        return int(tokenizer.num_special_tokens_to_add())
    except Exception:
        return 0


def resolve_max_length(
    loaded: LoadedModel, requested: int | None, model_name: str, *, cap: bool = False
) -> int:
    """``requested`` if the model can take it, else the model's and tokenizer's limit (<= 512).
    With ``cap`` a ``requested`` above the model's limit becomes the limit (the app's ceiling)
    instead of an error. Images and audio have no token length: 0."""
    if loaded.modality != "text":
        return 0
    limit = position_limit(loaded)
    special = _special_count(loaded.tokenizer)
    if requested is not None and requested <= special:
        raise IsotuiError(
            f"max-length {requested} leaves no room for text: the tokenizer of {model_name!r} adds "
            f"{special} special tokens; use --max-length {special + 1} or more"
        )
    if requested is not None:
        if cap and limit is not None and requested > limit:
            return limit
        if limit is not None and requested > limit:
            raise IsotuiError(
                f"max-length {requested} is longer than model {model_name!r} accepts "
                f"({limit} positions); use --max-length {limit} or less"
            )
        return requested
    return default_length(limit, tokenizer_limit(getattr(loaded.tokenizer, "model_max_length", None)))


def effective_max_length(
    loaded: LoadedModel, opts: ExtractOptions, model_name: str, on_progress: ProgressCallback
) -> int:
    """The max length a run uses (:func:`resolve_max_length`); a capped ceiling is said once
    through ``on_progress`` (the app shows it as a notice)."""
    length = resolve_max_length(loaded, opts.max_length, model_name, cap=opts.cap_max_length)
    if opts.max_length is not None and 0 < length < opts.max_length:
        on_progress(
            Progress(
                0,
                0,
                0,
                0.0,
                message=f"max length {opts.max_length} is more than {model_name!r} accepts: "
                f"capped at its {length} positions",
                stage="notice",
            )
        )
    return length


def selected_ids(n: int, sample_ids: Iterable[int] | None) -> list[int]:
    """The sample indices a run measures: all ``n``, or the shard ``sample_ids`` (sorted, once)."""
    if sample_ids is None:
        return list(range(n))
    ids = sorted(set(sample_ids))
    if ids and (ids[0] < 0 or ids[-1] >= n):
        raise IsotuiError(f"sample ids must lie in 0..{n - 1} (the corpus has {n} samples)")
    return ids


class BatchPlan:
    """Sample indices, longest first, cut by a batch size or by a token budget (auto).

    Iterating is lazy, so that :meth:`shrink` after running out of memory shrinks the later
    batches of the pass under way (and of every later pass) too. ``same_key``: only samples with
    equal keys share a batch (inputs that must not be padded).
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        chosen: Sequence[int],
        *,
        same_key: Sequence[int] | np.ndarray | None = None,
        batch_size: int | None = None,
        token_budget: int = TOKEN_BUDGET["cpu"],
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.chosen = np.asarray(chosen, dtype=np.int64)
        self.same_key = None if same_key is None else np.asarray(same_key, dtype=np.int64)
        self.batch_size = batch_size
        self.token_budget = token_budget

    def __len__(self) -> int:
        """How many samples a pass covers."""
        return len(self.chosen)

    def __iter__(self) -> Iterator[list[int]]:
        lengths, same, chosen = self.lengths, self.same_key, self.chosen
        sub = lengths[chosen]
        keys = (-sub,) if same is None else (-same[chosen], -sub)
        order = chosen[np.lexsort(keys)]  # stable: longest first, then by key, then in sample order
        pos = 0
        while pos < len(order):
            width = max(int(lengths[order[pos]]), 1)
            cap = self.batch_size or max(1, self.token_budget // width)
            batch: list[int] = order[pos : pos + cap].tolist()
            if same is not None:  # equal keys sit next to each other in this order
                batch = [i for i in batch if same[i] == same[batch[0]]]
            yield batch
            pos += len(batch)

    def width(self, idx: Sequence[int]) -> int:
        """The longest input of a batch, in input units."""
        return int(self.lengths[np.asarray(idx, dtype=np.int64)].max())

    def run_lengths(self) -> np.ndarray | None:
        """The input lengths of the whole run, every shard's samples with this one's: what the
        memory plan bounds a layer's vectors by, so that a shard plans as the one-pass run
        (issue 36); None where not known before the pass (a streamed corpus)."""
        return self.lengths

    def shrink(self, size: int, width: int) -> None:
        """Later batches hold at most ``size`` samples of ``width`` units (a back-off)."""
        if self.batch_size:
            self.batch_size = size
        else:
            self.token_budget = max(1, size * width)
