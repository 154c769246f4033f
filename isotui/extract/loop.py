"""The engine loop every experiment that streams a model over a corpus runs on.

:class:`BatchLoop` owns what is the same for all of them: the feeder and the batch plan
(length-sorted, token budgets), the model's device and dtype, hooks that live for one pass,
out-of-memory back-off (halve the batch and retry, said once), progress with the phase and the
memory in use, cancellation between batches, and giving the CPU heap back every few batches.
An experiment hands :meth:`BatchLoop.run` a *step*: a function that gets one :class:`Batch`
(its sample ids, the fed inputs on the CPU and on the device), runs the model, folds what it
measures into its own accumulators and returns how many input units it measured.

When a step raises out of memory the loop runs the same samples again in two halves (and those
in halves again, down to one sample): the batches tried for one planned batch are nested or
disjoint. So a step may commit part by part (each layer as soon as its sums are made, freeing
them before the next layer's) if it asks the batch first: ``batch.pending(key)`` says whether
the part ``key`` (a layer) still has to fold these samples, and ``batch.committed(key)`` records
that it has; a retried half skips the parts that already folded the samples of a batch it lies
in, so nothing is counted twice or lost (:class:`Ledger`). A step that folds in one go must fold
all of a batch or nothing (compute partial sums first, or restore what was folded before
re-raising).

    loop = BatchLoop(loaded, device, opts, on_progress, should_stop)
    loop.prepare(samples, "text", max_length)
    stats = loop.run(step)   # step(batch) -> units measured
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from isotui.errors import Cancelled, IsotuiError
from isotui.extract.device import memory_in_use, to_device
from isotui.extract.heap import TRIM_EVERY, release_free_memory
from isotui.extract.inputs import Fed, make_feeder
from isotui.extract.planning import TOKEN_BUDGET, BatchPlan, ExtractOptions, selected_ids
from isotui.extract.progress import Progress, ProgressCallback, StopCheck, never_stop, no_progress
from isotui.extract.streaming import is_stream, stream_plan
from isotui.models.loading import LoadedModel


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says the device ran out of memory (CUDA's error, or any 'out of memory')."""
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class Hooks:
    """Forward (and forward-pre) hooks registered together and removed together, however the
    code that needed them ends (a context manager, or :meth:`remove`)."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def forward(self, module: Any, hook: Callable[..., Any], *, prepend: bool = False) -> None:
        """``hook(module, args, output)`` after ``module`` runs (with ``prepend``, before the
        module's other forward hooks: what it returns is what they see)."""
        self.handles.append(module.register_forward_hook(hook, prepend=prepend))

    def pre(
        self, module: Any, hook: Callable[..., Any], *, with_kwargs: bool = False, prepend: bool = False
    ) -> None:
        """``hook(module, args)`` before ``module`` runs (``hook(module, args, kwargs)`` with
        ``with_kwargs``; with ``prepend``, before the module's other pre-hooks)."""
        self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=with_kwargs, prepend=prepend))

    def undo(self, fn: Callable[[], None]) -> None:
        """``fn()`` when the hooks are removed: a change to the model that lives for one pass."""
        self.handles.append(SimpleNamespace(remove=fn))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.remove()


class Ledger:
    """Which parts of a step (layers, by any hashable key) already folded which samples of one
    planned batch, while the loop backs off out of memory. The batches tried for a planned batch
    are nested or disjoint (halves of halves), so a part folded a batch's samples exactly when
    it folded a batch that holds them all; a partial overlap would be a bug and says so."""

    def __init__(self) -> None:
        self.done: dict[Hashable, list[frozenset[int]]] = {}

    def covers(self, key: Hashable, idx: Sequence[int]) -> bool:
        """Whether part ``key`` already folded all the samples ``idx``."""
        mine = frozenset(idx)
        for folded in self.done.get(key, ()):
            if mine <= folded:
                return True
            if mine & folded:
                raise RuntimeError(f"{key!r} folded some of these samples but not all")
        return False

    def add(self, key: Hashable, idx: Sequence[int]) -> None:
        self.done.setdefault(key, []).append(frozenset(idx))


@dataclass
class Batch:
    """One batch as a step gets it: ``idx`` (sample indices into the whole corpus, longest
    first), ``ids`` (the same as a CPU long tensor), ``fed`` (the feeder's inputs and masks,
    on the CPU) and ``inputs`` (the model's keyword inputs on its device, floats in its dtype);
    ``ledger``: what the tries of its planned batch already folded (see the module's doc)."""

    idx: list[int]
    ids: Any
    fed: Fed
    inputs: dict[str, Any]
    ledger: Ledger = field(default_factory=Ledger)

    def pending(self, key: Hashable) -> bool:
        """Whether part ``key`` still has to fold this batch (not done by a try it lies in)."""
        return not self.ledger.covers(key, self.idx)

    def committed(self, key: Hashable) -> None:
        """Part ``key`` folded this batch: a retried half of it skips that part."""
        self.ledger.add(key, self.idx)

    @property
    def units(self) -> int:
        """Real input units (tokens, audio frames; images count one each), padding left out."""
        if self.fed.valid is not None:
            return int(self.fed.valid.sum())
        return len(self.idx)


@dataclass(frozen=True)
class PassStats:
    """What one :meth:`BatchLoop.run` did: samples, the units its step measured, seconds since
    its start, and its last progress event (from which later phases' events go on)."""

    samples: int
    units: int
    seconds: float
    last: Progress


Step = Callable[[Batch], int]


class BatchLoop:
    """Batches, device and dtype, hooks, out-of-memory back-off, progress, cancellation and heap
    trimming for one model over one corpus (see the module's doc)."""

    def __init__(
        self,
        loaded: LoadedModel,
        device: str,
        opts: ExtractOptions,
        on_progress: ProgressCallback | None = None,
        should_stop: StopCheck | None = None,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = device
        self.opts = opts
        self.on_progress: ProgressCallback = on_progress or no_progress
        self.should_stop: StopCheck = should_stop or never_stop
        self.dtype = next((p.dtype for p in self.model.parameters()), None)
        self.hooks = Hooks()  # registered for the next run, removed when it ends
        self.notes: list[str] = []  # what the table must say (back-offs; steps may add theirs)
        self.feed_s = 0.0  # building batches and moving them to the device
        self._feeder: Any = None
        self._plan: BatchPlan | None = None

    # --- planning -------------------------------------------------------------------------

    def accepts(self, name: str) -> bool:
        """Whether the model's forward takes the keyword ``name``."""
        import inspect

        params = inspect.signature(self.model.forward).parameters
        return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

    def prepare(self, samples: Sequence[str], modality: str, max_length: int) -> None:
        """Tokenise (or read) the corpus and plan its batches; samples outside the shard of
        ``opts.sample_ids`` are read too (they set corpus-level choices) but never run. A
        streamed corpus is tokenised window by window as the batches go (extract/streaming.py)."""
        budget = self.opts.token_budget or TOKEN_BUDGET.get(self.device.split(":")[0], TOKEN_BUDGET["cpu"])
        if is_stream(samples):
            self._feeder, self._plan = stream_plan(
                self.loaded,
                samples,
                max_length,
                self.accepts,
                self.opts.sample_ids,
                batch_size=self.opts.batch_size,
                token_budget=budget,
            )
            return
        self._feeder = make_feeder(self.loaded, samples, modality, max_length, self.accepts)
        lengths = self._feeder.lengths
        self._plan = BatchPlan(
            lengths,
            selected_ids(len(lengths), self.opts.sample_ids),
            same_key=getattr(self._feeder, "same_length_key", None),
            batch_size=self.opts.batch_size,
            token_budget=budget,
        )

    @property
    def feeder(self) -> Any:
        """The corpus as the model reads it: lengths, token ids, masks (after :meth:`prepare`)."""
        if self._feeder is None:
            raise RuntimeError("BatchLoop.prepare must run first")
        return self._feeder

    @property
    def plan(self) -> BatchPlan:
        """The batch plan (after :meth:`prepare`)."""
        if self._plan is None:
            raise RuntimeError("BatchLoop.prepare must run first")
        return self._plan

    @property
    def total(self) -> int:
        """How many samples a pass measures (the shard's, or the corpus's)."""
        return len(self.plan)

    def selected(self) -> list[int]:
        """The sample indices a pass measures, in corpus order."""
        return [int(i) for i in self.plan.chosen]

    def batches(self) -> Iterator[list[int]]:
        """The planned batches' sample indices (what :meth:`run` goes through; for benchmarks
        that time a bare forward over the same batches)."""
        return iter(self.plan)

    # --- one batch ------------------------------------------------------------------------

    def batch(self, idx: list[int], ledger: Ledger | None = None) -> Batch:
        """Feed the samples ``idx`` and move them to the model's device."""
        import torch

        started = time.perf_counter()
        fed = self.feeder.feed(idx)
        batch = Batch(
            idx, torch.tensor(idx, dtype=torch.long), fed, self.device_inputs(fed), ledger or Ledger()
        )
        self.feed_s += time.perf_counter() - started
        return batch

    def device_inputs(self, fed: Fed) -> dict[str, Any]:
        """A fed batch on the model's device, floating inputs in the model's dtype."""
        inputs = {}
        for name, value in fed.inputs.items():
            if value.is_floating_point() and self.dtype is not None:
                value = value.to(self.dtype)
            inputs[name] = to_device(value, self.device)  # pinned, non-blocking (issue 26)
        return inputs

    def keep(self, fed: Fed, component: str, width: int) -> Any:
        """(B, width) bool: the positions of a component's layer that count (real, and not
        special unless ``opts.special_tokens`` is ``include``)."""
        valid, special = self.feeder.mask(fed, component, width)
        return valid if self.opts.special_tokens == "include" else valid & ~special

    def failure(self, exc: Exception, what: str) -> Exception:
        """The exception to raise for a failed forward pass: out of memory as it is (the loop
        backs off), anything else as one sentence naming the model and ``what`` it was fed."""
        if is_oom(exc):
            return exc
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        return IsotuiError(
            f"model {type(self.model).__name__} failed on {what} ({type(exc).__name__}: {first})"
        )

    @contextmanager
    def model_call(self, what: str) -> Iterator[None]:
        """Around a step's call of the model: its failures become :meth:`failure`'s sentence."""
        try:
            yield
        except (IsotuiError, Cancelled):
            raise
        except Exception as exc:
            raise self.failure(exc, what) from None

    # --- the pass -------------------------------------------------------------------------

    def run(
        self,
        step: Step,
        *,
        phase: str = "running",
        start: float | None = None,
        finalize_left: Callable[[int], float | None] | None = None,
    ) -> PassStats:
        """One pass over the planned batches: ``step`` on each, a progress event after each
        (samples, the units ``step`` returned, seconds since ``start``, memory, ``phase`` and
        ``finalize_left(batch number)`` when given). Stops with :class:`Cancelled` between
        batches when asked; :attr:`hooks` are removed when the pass ends, however it ends."""
        start = time.perf_counter() if start is None else start
        self._product_scheme()
        done = units = 0
        left = None
        last = Progress(0, self.total, 0, 0.0, phase=phase)
        try:
            for batch_no, idx in enumerate(self.plan, 1):
                if self.should_stop():
                    raise Cancelled()
                units += self._attempt(step, idx)
                done += len(idx)
                if self.device == "cpu" and batch_no % TRIM_EVERY == 0:
                    release_free_memory()
                if finalize_left is not None:
                    left = finalize_left(batch_no)
                last = Progress(
                    done,
                    self.total,
                    units,
                    time.perf_counter() - start,
                    memory_bytes=memory_in_use(self.device),
                    phase=phase,
                    finalize_left_s=left,
                )
                self.on_progress(last)
            # the last batches' freed memory (fewer than TRIM_EVERY since the last trim) given
            # back before finalisation starts
            release_free_memory()
        finally:
            self.hooks.remove()
        return PassStats(done, units, time.perf_counter() - start, last)

    def _product_scheme(self) -> None:
        """Measure which products the device's d x d sums use (once per kind of device, issue
        26: isotui/extract/tensor_cores.py) and say so in the notes (not on the CPU)."""
        from isotui.extract.tensor_cores import ensure_scheme, scheme_note

        ensure_scheme(self.device)
        note = scheme_note(self.device)
        if note is not None and note not in self.notes:
            self.notes.append(note)

    def _attempt(self, step: Step, idx: list[int], ledger: Ledger | None = None) -> int:
        """``step`` on ``idx`` with out-of-memory back-off: halve the batch and retry, say so,
        and keep later batches that small. ``ledger`` (one per planned batch) goes with every
        try, so parts that committed before the failure skip these samples in the halves."""
        ledger = ledger or Ledger()
        try:
            return step(self.batch(idx, ledger))
        except Exception as exc:
            if not is_oom(exc):
                raise
        self._free()
        width = self.plan.width(idx)
        if len(idx) == 1:
            raise IsotuiError(
                f"one sample ({self.describe(1, width)}) does not fit in {self.device} memory; "
                + ("lower --max-length or " if self.loaded.modality == "text" else "")
                + "use --dtype bfloat16"
            )
        half = len(idx) // 2
        self.plan.shrink(half, width)
        message = (
            f"out of memory on a batch of {self.describe(len(idx), width)}; retrying with batches of {half}"
        )
        self.notes.append(message)
        self.on_progress(Progress(0, 0, 0, 0.0, message=message, stage="oom"))
        return self._attempt(step, idx[:half], ledger) + self._attempt(step, idx[half:], ledger)

    def describe(self, n: int, width: int) -> str:
        """``n`` samples of ``width`` input units, in the modality's words."""
        if self.loaded.modality == "text":
            return f"{n} x {width} tokens"
        if self.loaded.modality == "image":
            return f"{n} images"
        return f"{n} clips of up to {width * 20 / 1000:.1f} s"

    def _free(self) -> None:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def merge_facts(
    states: Sequence[dict[str, Any]],
    *,
    added: Sequence[str] = ("n_samples", "n_tokens", "seconds"),
    any_of: Sequence[str] = (),
    max_of: Sequence[str] = (),
) -> dict[str, Any]:
    """The facts of disjoint shards' streamed states as one: ``added`` counts and seconds add,
    ``notes`` are the union (first seen first), ``any_of`` flags or, ``max_of`` take the
    largest; everything else is the first shard's (the same model, options and corpus)."""
    if not states:
        raise ValueError("nothing to merge")
    return {
        **states[0],
        **{k: sum(s[k] for s in states) for k in added},
        "notes": list(dict.fromkeys(n for s in states for n in s["notes"])),
        **{k: any(s[k] for s in states) for k in any_of},
        **{k: max(s[k] for s in states) for k in max_of},
    }
