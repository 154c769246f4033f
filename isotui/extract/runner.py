"""Push samples through a model in length-sorted batches and stream hidden states into accumulators.

Nothing here keeps hidden states beyond one batch: memory is set by the batch, the layer count
and d, never by the corpus size.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from isotui.core.accumulator import LayerAccumulator, LayerStats, sample_keys
from isotui.errors import Cancelled, IsotuiError
from isotui.extract.device import memory_in_use
from isotui.extract.heap import TRIM_EVERY, release_free_memory
from isotui.extract.progress import Progress, ProgressCallback, StopCheck, never_stop, no_progress
from isotui.extract.tokens import Tokens, tokenize
from isotui.models.loading import LoadedModel, final_norm_modules

DEFAULT_MAX_LENGTH_CAP = 512
TOKEN_BUDGET = {"cpu": 4096, "mps": 8192, "cuda": 32768}
COV_BUDGET_BYTES = 1 << 30  # exact streamed covariance while all layers' d x d fit in 1 GiB


@dataclass
class ExtractOptions:
    max_length: int | None = None
    special_tokens: str = "exclude"
    batch_size: int | None = None
    seed: int = 0
    reservoir: int = 4096


@dataclass
class Extraction:
    """Per-layer statistics plus what the table must say about how they were made."""

    layers: list[LayerStats]
    final_norm: bool
    final_norm_module: str | None
    n_samples: int
    n_tokens: int
    max_length: int
    seconds: float
    notes: list[str] = field(default_factory=list)


def position_limit(loaded: LoadedModel) -> int | None:
    """How many positions the model's embeddings have, when its config says so."""
    config = loaded.model.config
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _special_count(tokenizer: Any) -> int:
    try:
        return int(tokenizer.num_special_tokens_to_add())
    except Exception:
        return 0


def resolve_max_length(loaded: LoadedModel, requested: int | None, model_name: str) -> int:
    """``requested`` if the model can take it, else the model's and tokenizer's limit (<= 512)."""
    limit = position_limit(loaded)
    special = _special_count(loaded.tokenizer)
    if requested is not None and requested <= special:
        raise IsotuiError(
            f"max-length {requested} leaves no room for text: the tokenizer of {model_name!r} adds "
            f"{special} special tokens; use --max-length {special + 1} or more"
        )
    if requested is not None:
        if limit is not None and requested > limit:
            raise IsotuiError(
                f"max-length {requested} is longer than model {model_name!r} accepts "
                f"({limit} positions); use --max-length {limit} or less"
            )
        return requested
    limits = [DEFAULT_MAX_LENGTH_CAP] + ([limit] if limit else [])
    tok_max = getattr(loaded.tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
        limits.append(tok_max)
    return min(limits)


def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class _Runner:
    def __init__(
        self,
        loaded: LoadedModel,
        device: str,
        opts: ExtractOptions,
        on_progress: ProgressCallback,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = device
        self.opts = opts
        self.on_progress = on_progress
        self.accs: list[LayerAccumulator] | None = None
        self.final_norm: bool = False
        self.final_norm_name: str | None = None
        self.notes: list[str] = []
        self.token_budget = TOKEN_BUDGET.get(device.split(":")[0], 4096)
        self.batch_cap: int | None = opts.batch_size
        self.pad_id = self._pad_id()

    def _pad_id(self) -> int:
        tok = self.loaded.tokenizer
        for candidate in (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id):
            if isinstance(candidate, int):
                return candidate
        return 0

    def _accepts(self, name: str) -> bool:
        import inspect

        params = inspect.signature(self.model.forward).parameters
        return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

    def tokenize(self, samples: list[str], max_length: int) -> Tokens:
        return tokenize(
            self.loaded.tokenizer, samples, max_length, with_types=self._accepts("token_type_ids")
        )

    def batches(self, lengths: Sequence[int]) -> Iterator[list[int]]:
        """Sample indices, longest first, cut by batch size or by token budget (auto).

        A generator, so that a back-off after running out of memory shrinks later batches too.
        """
        lengths = [int(n) for n in lengths]
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        pos = 0
        while pos < len(order):
            width = max(lengths[order[pos]], 1)
            cap = self.batch_cap or max(1, self.token_budget // width)
            yield order[pos : pos + cap]
            pos += cap

    def run_batch(self, tokens: Tokens, idx: list[int]) -> int:
        """Forward one batch and fold it in; returns its number of real tokens."""
        import torch

        b = tokens.batch(idx, self.pad_id)
        mask, special = b["attention_mask"], b["special"]
        width = mask.shape[1]
        inputs = {"input_ids": b["input_ids"].to(self.device), "attention_mask": mask.to(self.device)}
        if b["token_type_ids"] is not None:
            inputs["token_type_ids"] = b["token_type_ids"].to(self.device)

        hook_out: dict[str, Any] = {}
        handles = []
        if self.accs is None:  # first batch: which final norm, if any, made the last hidden state
            for name, module in final_norm_modules(self.model):
                hook = (lambda key: lambda _m, _i, o: hook_out.__setitem__(key, o))(name)
                handles.append(module.register_forward_hook(hook))
        try:
            with torch.inference_mode():
                out = self.model(**inputs, output_hidden_states=True, return_dict=True)
        except Exception as exc:
            if _is_oom(exc):
                raise
            raise IsotuiError(
                f"model {type(self.model).__name__} failed on a batch of text "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"
            ) from None
        finally:
            for handle in handles:
                handle.remove()
        hidden = getattr(out, "hidden_states", None)
        if not hidden:
            raise IsotuiError(
                f"model {type(self.model).__name__} returned no hidden states; isotui needs a model "
                "whose forward accepts output_hidden_states=True"
            )
        if self.accs is None:
            self._first_batch(hidden, hook_out)

        keep = mask.bool()
        if self.opts.special_tokens == "exclude":
            keep &= ~special
        flat = keep.flatten().nonzero().squeeze(1)
        local = flat // width
        positions = flat % width
        global_ids = torch.tensor(idx, dtype=torch.long)[local]
        acc_device = self.accs[0].device  # the CPU when the model is on MPS (no float64 there)
        keys = sample_keys(self.opts.seed, global_ids, positions).to(acc_device)
        flat_d, local_d = flat.to(self.device), local.to(acc_device)
        partials = []
        with torch.inference_mode():
            for acc, h in zip(self.accs, hidden, strict=True):
                x = h.reshape(-1, h.shape[-1]).index_select(0, flat_d)
                partials.append(acc.partial(x, local_d, keys))
            for acc, p in zip(self.accs, partials, strict=True):  # only now: all or nothing
                acc.commit(p)
        return int(mask.sum())

    def _first_batch(self, hidden: tuple, hook_out: dict[str, Any]) -> None:
        import torch

        dims = [h.shape[-1] for h in hidden]
        full_cov = sum(d * d * 8 for d in dims) <= COV_BUDGET_BYTES
        dev = hidden[0].device
        if dev.type == "mps":  # no float64 on MPS: accumulate on the CPU
            dev = torch.device("cpu")
        self.accs = [LayerAccumulator(d, dev, full_cov=full_cov, reservoir=self.opts.reservoir) for d in dims]
        if not full_cov:
            self.notes.append(
                f"spectrum from a uniform sample of {self.opts.reservoir} vectors per layer (d={max(dims)})"
            )
        last = hidden[-1]
        for name, out in hook_out.items():
            normed = out[0] if isinstance(out, tuple) else out
            if isinstance(normed, torch.Tensor) and normed.shape == last.shape and torch.equal(normed, last):
                self.final_norm, self.final_norm_name = True, name
                break

    def process(self, tokens: Tokens, idx: list[int]) -> int:
        """``run_batch`` with out-of-memory back-off: halve the batch and retry, say so."""
        try:
            return self.run_batch(tokens, idx)
        except Exception as exc:
            if not _is_oom(exc):
                raise
        self._free()
        width = int(tokens.lengths[idx].max())
        if len(idx) == 1:
            raise IsotuiError(
                f"one sample of {width} tokens does not fit in {self.device} memory; lower "
                "--max-length or use --dtype bfloat16"
            )
        half = len(idx) // 2
        if self.batch_cap:
            self.batch_cap = half
        else:
            self.token_budget = max(1, half * width)
        message = f"out of memory on a batch of {len(idx)} x {width} tokens; retrying with batches of {half}"
        self.notes.append(message)
        self.on_progress(Progress(0, 0, 0, 0.0, message=message, stage="oom"))
        return self.process(tokens, idx[:half]) + self.process(tokens, idx[half:])

    def _free(self) -> None:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def extract(
    loaded: LoadedModel,
    samples: list[str],
    *,
    device: str,
    opts: ExtractOptions,
    on_progress: ProgressCallback = no_progress,
    should_stop: StopCheck = never_stop,
    model_name: str = "",
) -> Extraction:
    """Measure every hidden layer of ``loaded`` over ``samples`` (see design.md for metrics)."""
    runner = _Runner(loaded, device, opts, on_progress)
    max_length = resolve_max_length(loaded, opts.max_length, model_name)
    tokens = runner.tokenize(samples, max_length)
    total = len(samples)
    start = time.perf_counter()
    done = n_tokens = 0
    on_progress(Progress(0, total, 0, 0.0))
    for batch_no, idx in enumerate(runner.batches(tokens.lengths), 1):
        if should_stop():
            raise Cancelled()
        n_tokens += runner.process(tokens, idx)
        done += len(idx)
        if device == "cpu" and batch_no % TRIM_EVERY == 0:
            release_free_memory()
        on_progress(
            Progress(done, total, n_tokens, time.perf_counter() - start, memory_bytes=memory_in_use(device))
        )
    assert runner.accs is not None
    if runner.accs[0].n_all == 0:
        raise IsotuiError(
            f"no token of the {total} samples was kept: all were special tokens or padding; use "
            "--special-tokens include or a larger --max-length"
        )
    elapsed = time.perf_counter() - start
    memory = memory_in_use(device)
    on_progress(Progress(done, total, n_tokens, elapsed, stage="finalize", memory_bytes=memory))
    layers = [acc.finalize() for acc in runner.accs]
    return Extraction(
        layers=layers,
        final_norm=runner.final_norm,
        final_norm_module=runner.final_norm_name,
        n_samples=total,
        n_tokens=n_tokens,
        max_length=max_length,
        seconds=time.perf_counter() - start,
        notes=runner.notes,
    )
