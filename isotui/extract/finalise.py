"""Finalisation: every layer's sums into metrics, its eigendecompositions batched on the device.

Issue 26: on a GPU each layer's two float64 ``eigh`` were one call each (and each call waits for
the device to report convergence); here the layers of one d on one device are decomposed in one
batched call (:func:`~isotui.core.exact_spectrum.exact_eigens`), the first layer alone so that
its time gives the rate of the rest. Out of memory halves the batch; a layer that does not fit
alone is finalised from a copy of its sums on the CPU; one note says what happened. The CPU keeps
its one-layer-at-a-time path (a batch there is the same LAPACK calls in a row, holding every
layer's eigenvectors at once).

The time left: before any layer is done, the CPU's calibrated model (none on another device: the
model was 40-190x off on an H100); from the first finalised layer on, the seconds spent per unit
of :func:`layer_cost` times the cost left (:class:`FinaliseEta`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from isotui.core.accumulator import LayerAccumulator, LayerStats
from isotui.core.exact_spectrum import ExactEigen, exact_eigens
from isotui.extract.heap import release_free_memory
from isotui.extract.progress import Progress, ProgressCallback

if TYPE_CHECKING:
    import torch

# Finalisation per layer at one CPU thread, reservoir 4096 full (benchmarks/finalisation.py, issue
# 15: d = 256 / 1,024 / 4,096: 0.21 / 2.3 / 55 s of CPU): the two d x d eigh (d^3) whatever the
# reservoir holds, and its projections (K d^2); an estimate for the ETA before finalisation starts
# on the CPU, and each layer's weight in the extrapolation from the layers finalised.
FINALIZE_BASE_S = 0.15
FINALIZE_PER_DIM2_S = 7e-7
FINALIZE_PER_DIM3_S = 6.3e-10
BATCH_ON_CPU = False  # tests: the GPU's batched path, traced on the CPU
MAX_BATCH = 64  # layers per batched eigh (out of memory halves it)


def layer_cost(acc: LayerAccumulator) -> float:
    """A layer's finalisation in CPU seconds by the calibrated model: its weight in the ETA.

    The model counts the work :meth:`LayerAccumulator.finalize` does: the eigenproblem is d x d
    only where the layer holds the d x d sums and its reservoir does not hold every vector;
    otherwise it is the reservoir's, at most k x k for k vectors held (a flattened conv map of
    d = 200,000 is never decomposed as d x d: costing it d^3 said ``ETA 1418:20:43``, issue 38).
    """
    fill = min(1.0, acc.n_all / max(1, acc.reservoir_size))
    held = min(acc.n_all, acc.reservoir_size)  # vectors in the reservoir
    d = acc.dim
    exact = acc.gram is not None and acc.n_all >= 2 and not acc.spectrum_from_sample()
    size = d if exact else min(d, held)  # the side of the matrix decomposed
    return (FINALIZE_BASE_S + FINALIZE_PER_DIM2_S * d * size) * max(fill, 0.05) + (
        FINALIZE_PER_DIM3_S * size**3
    )


def finalize_estimate_s(all_accs: dict[str, list[LayerAccumulator]] | None) -> float | None:
    """Seconds the finalisation of every layer will take, estimated from each layer's d and how
    full its reservoir is (the reservoir's per-vector metrics grow with it, the eigh do not);
    None when a layer's sums live on another device than the CPU (its rate is measured once
    finalisation starts)."""
    if not all_accs:
        return None
    accs = [acc for accs in all_accs.values() for acc in accs]
    if any(acc.device.type != "cpu" for acc in accs):
        return None
    return sum(layer_cost(acc) for acc in accs)


class FinaliseEta:
    """Seconds of finalisation left, from ``clock``: ``estimate`` until the first layer is done,
    then the time spent per unit of cost (``costs``: each layer's, in the order they finalise)
    times the cost left."""

    def __init__(
        self, costs: Sequence[float], estimate: float | None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.costs = list(costs)
        self.estimate = estimate
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.done_cost = 0.0

    def layer_done(self) -> None:
        self.done_cost += self.costs[self.done]
        self.done += 1

    def left(self) -> float | None:
        if self.done == 0 or self.done_cost <= 0:
            return self.estimate
        return (self.clock() - self.start) / self.done_cost * sum(self.costs[self.done :])


def _batch_key(acc: LayerAccumulator) -> tuple[str, int] | None:
    """(device, d) of a layer whose d x d sums are decomposed in a batch; None: on its own."""
    if acc.device.type == "cpu" and not BATCH_ON_CPU:
        return None
    if acc.exact_eigen_inputs() is None or acc.spectrum_from_sample():
        return None
    return (str(acc.device), acc.dim)


def decompose(accs: Sequence[LayerAccumulator]) -> list[ExactEigen]:
    """The exact eigendecompositions of ``accs`` (one d, one device, the same
    :meth:`~LayerAccumulator.needs_directions`) in one batched call."""
    sums = [acc.exact_eigen_inputs() for acc in accs]
    return exact_eigens([s for s in sums if s is not None], directions=accs[0].needs_directions())


def _free(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()


def _warm(devices: set[torch.device]) -> None:
    """One tiny ``eigh`` per GPU before the clock starts: the solver's first call sets itself up
    (tenths of a second), which would make the first layer's rate too slow."""
    import torch

    for device in devices:
        if device.type == "cuda":
            torch.linalg.eigh(torch.eye(4, dtype=torch.float64, device=device))


def _on_host(acc: LayerAccumulator) -> LayerStats:
    """The layer finalised from a copy of its sums on the CPU (its device's memory ran out)."""
    return LayerAccumulator.from_state(acc.state()).finalize()


def finalize_all(
    all_accs: dict[str, list[LayerAccumulator]],
    on_progress: ProgressCallback,
    at: Progress,
    estimate: float | None,
    *,
    notes: list[str] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[LayerStats]]:
    """Finalise every layer, posting one progress event per layer with the time left (see
    :class:`FinaliseEta`); ``notes`` gets one sentence when memory ran out."""
    from isotui.extract.loop import is_oom

    order = [(c, i, acc) for c, accs in all_accs.items() for i, acc in enumerate(accs)]
    _warm({acc.device for _, _, acc in order})
    out: dict[str, list[Any]] = {c: [None] * len(accs) for c, accs in all_accs.items()}
    eta = FinaliseEta([layer_cost(acc) for _, _, acc in order], estimate, clock)
    size: dict[tuple[str, int], int] = {}
    asked: dict[tuple[str, int], int] = {}
    on_cpu = 0

    def post(done: int) -> None:
        on_progress(
            replace(
                at,
                stage="finalize",
                phase="finalising",
                layers_done=done,
                layers_total=len(order),
                finalize_left_s=eta.left(),
            )
        )

    # the batches' (or a merge's) freed heap given back before the first layer, and each layer's
    # workspace after it: finalisation's peak is then one layer's workspace above the sums (the
    # plan's), not that plus the heap glibc kept (isotui.extract.heap)
    release_free_memory()
    k = 0
    while k < len(order):
        key = _batch_key(order[k][2])
        end = k + 1
        if key is not None and k > 0:  # the first layer alone: its time is the rate
            limit = size.setdefault(key, first_batch(*key))
            same = order[k][2].needs_directions()  # one batch decomposes with or without directions
            while end < len(order) and end - k < limit and _batch_key(order[end][2]) == key:
                if order[end][2].needs_directions() != same:
                    break
                end += 1
            asked.setdefault(key, end - k)
        chunk = [acc for _, _, acc in order[k:end]]
        post(k)
        eigens: list[ExactEigen | None] = [None] * len(chunk)
        if len(chunk) > 1:
            try:
                eigens = list(decompose(chunk))
            except Exception as exc:
                if not is_oom(exc) or key is None:
                    raise
                _free(chunk[0].device)
                size[key] = max(1, len(chunk) // 2)
                continue
        for j, ((component, i, acc), eigen) in enumerate(zip(order[k:end], eigens, strict=True)):
            if j:
                post(k + j)
            try:
                stats = acc.finalize(eigen)
            except Exception as exc:
                if not is_oom(exc) or (acc.device.type == "cpu" and not BATCH_ON_CPU):
                    raise
                eigens[j:] = [None] * (len(eigens) - j)  # free what the batch holds
                _free(acc.device)
                stats = _on_host(acc)
                on_cpu += 1
            out[component][i] = stats
            release_free_memory()
            eta.layer_done()
        k = end
    if notes is not None and (on_cpu or any(size[key] < asked[key] for key in size if key in asked)):
        notes.append(_memory_note(size, asked, on_cpu, len(order)))
    return out


Key = tuple[str, int]  # (device, d)


def first_batch(device: str, dim: int) -> int:
    """Layers of width ``dim`` decomposed at once on ``device`` at first: as many as the memory
    it has free holds at the plan's finalisation workspace each
    (:func:`~isotui.extract.memory_plan.finalisation_workspace_bytes`), at most
    :data:`MAX_BATCH`, at least one; out of memory still halves it."""
    from isotui.extract.device import available_memory
    from isotui.extract.memory_plan import finalisation_workspace_bytes

    free = available_memory(device)
    if free is None:
        return MAX_BATCH
    return max(1, min(MAX_BATCH, free // max(1, finalisation_workspace_bytes(dim, exact=True, sample=0))))


def _memory_note(size: dict[Key, int], asked: dict[Key, int], on_cpu: int, n: int) -> str:
    """One sentence: the batches finalisation backed off to, and the layers finalised on the CPU."""
    parts = [
        f"eigendecompositions of d = {d} on {dev} {size[(dev, d)]} layers at a time (not {asked[(dev, d)]})"
        for dev, d in sorted(size)
        if (dev, d) in asked and size[(dev, d)] < asked[(dev, d)]
    ]
    if on_cpu:
        parts.append(f"{on_cpu} of {n} layers finalised on the CPU (one did not fit alone)")
    return "finalisation ran out of device memory: " + "; ".join(parts)
