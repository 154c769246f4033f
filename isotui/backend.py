"""The backend: the only part of isotui the terminal app talks to.

Jobs run in worker threads and report through typed events posted to a callback (the app turns
them into Textual messages; tests collect them). The cache answers first, on a lookup thread,
so a cached result never waits behind a running model. Computation goes to one queue per
device: one model at a time per device, the rest wait in order. Identical requests in flight
share one job. Cancellation is cooperative: a running job stops between batches, a queued job
never starts. A failing job posts one sentence and leaves every other job, and the cache, alone.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from isotui.errors import Cancelled, IsotuiError
from isotui.experiments import layerwise
from isotui.extract.device import resolve_device
from isotui.extract.progress import Progress
from isotui.results import ModelResult
from isotui.spec import RunSpec
from isotui.store.cache import ResultCache


@dataclass(frozen=True)
class JobEvent:
    """Something happened to job ``job_id`` (which measures ``spec``: a layer-wise RunSpec, or an
    experiment request of :mod:`isotui.experiments.requests`)."""

    job_id: int
    spec: Any


@dataclass(frozen=True)
class JobQueued(JobEvent):
    pass


@dataclass(frozen=True)
class JobStarted(JobEvent):
    device: str


@dataclass(frozen=True)
class JobProgress(JobEvent):
    progress: Progress


@dataclass(frozen=True)
class JobNotice(JobEvent):
    text: str


@dataclass(frozen=True)
class JobFinished(JobEvent):
    result: Any  # ModelResult for a RunSpec, the experiment's result type otherwise


@dataclass(frozen=True)
class JobFailed(JobEvent):
    message: str


@dataclass(frozen=True)
class JobCancelled(JobEvent):
    pass


Post = Callable[[JobEvent], None]


@dataclass
class _Job:
    job_id: int
    spec: Any
    stop: threading.Event = field(default_factory=threading.Event)
    prepared: layerwise.Prepared | None = None
    started: bool = False  # a lane is computing it (set under the backend's lock)
    ended: bool = False  # its last event is posted; nothing more may be


class Backend:
    """Runs layer-wise jobs off the caller's thread; see the module docstring."""

    def __init__(
        self,
        cache: ResultCache | None,
        post: Post,
        *,
        compute: Callable[..., ModelResult] = layerwise.compute,
        prepare: Callable[[RunSpec], layerwise.Prepared] | None = None,
    ) -> None:
        self.cache = cache
        self._post = post
        self._compute = compute
        # the cache also remembers local weights' content digests (no re-hash on a repeated run)
        self._prepare = prepare or (lambda spec: layerwise.prepare(spec, cache))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._active: dict[RunSpec, _Job] = {}
        # One lookup worker keeps submission order into the device queues (lookups are quick:
        # names, data hashes, the cache); computation is what takes long, in the lanes.
        self._lookups = ThreadPoolExecutor(max_workers=1, thread_name_prefix="isotui-lookup")
        self._lanes: dict[str, queue.Queue[_Job | None]] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, spec: Any) -> int:
        """Queue a job for ``spec`` (a RunSpec, or an experiment request); an identical job
        already queued or running is reused."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the backend is closed")
            if spec in self._active:
                return self._active[spec].job_id
            job = _Job(next(self._ids), spec)
            self._active[spec] = job
        self._post(JobQueued(job.job_id, spec))
        self._lookups.submit(self._lookup, job)
        return job.job_id

    def cancel(self, job_id: int) -> bool:
        """Stop a job: one not yet computing ends at once; a running one stops between batches.
        False if no such job is in flight."""
        with self._lock:
            job = next((j for j in self._active.values() if j.job_id == job_id), None)
            if job is None:
                return False
            job.stop.set()
            waiting = not job.started
        if waiting:
            self._end(job, JobCancelled(job.job_id, job.spec))
        return True

    def in_flight(self) -> list[tuple[int, RunSpec]]:
        """Jobs queued or running, oldest first."""
        with self._lock:
            return sorted((j.job_id, j.spec) for j in self._active.values())

    def busy(self) -> bool:
        """Whether a job is in flight (queued or running)."""
        with self._lock:
            return bool(self._active)

    def wait_idle(self, timeout: float) -> bool:
        """After :meth:`close`: wait up to ``timeout`` seconds for the workers to end (a running
        job stops at its next safe point); True if they all did."""
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def close(self, wait: bool = True) -> None:
        """Stop taking jobs, cancel those in flight, and (optionally) wait for the workers."""
        with self._lock:
            self._closed = True
            jobs = list(self._active.values())
        for job in jobs:
            job.stop.set()
        self._lookups.shutdown(wait=wait)
        for lane in self._lanes.values():
            lane.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    # -- workers ---------------------------------------------------------------------------

    def _lookup(self, job: _Job) -> None:
        """Resolve the spec and answer from the cache; otherwise hand over to a device lane."""
        try:
            if job.stop.is_set():
                raise Cancelled()
            if isinstance(job.spec, RunSpec):
                job.prepared = self._prepare(job.spec)
                hit = layerwise.lookup(job.prepared, self.cache, lambda t: self._notice(job, t))
            else:
                hit = job.spec.lookup(self._cache_root(), lambda t: self._notice(job, t))
            if hit is not None:
                self._end(job, JobFinished(job.job_id, job.spec, hit))
                return
        except BaseException as exc:
            self._end(job, self._failure(job, exc))
            return
        self._lane(job.spec.device).put(job)

    def _lane(self, device: str) -> queue.Queue[_Job | None]:
        with self._lock:
            lane = self._lanes.get(device)
            if lane is None:
                lane = self._lanes[device] = queue.Queue()
                thread = threading.Thread(
                    target=self._run_lane, args=(lane,), name=f"isotui-{device}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return lane

    def _run_lane(self, lane: queue.Queue[_Job | None]) -> None:
        while (job := lane.get()) is not None:
            with self._lock:
                if job.ended:  # cancelled while it waited
                    continue
                job.started = True
            try:
                if job.stop.is_set():
                    raise Cancelled()
                on_progress = lambda p, j=job: self._post(JobProgress(j.job_id, j.spec, p))  # noqa: E731
                if not isinstance(job.spec, RunSpec):  # an experiment request: it caches its own result
                    self._post(JobStarted(job.job_id, job.spec, resolve_device(job.spec.device)))
                    result = job.spec.compute(
                        self._cache_root(),
                        on_progress=on_progress,
                        should_stop=job.stop.is_set,
                        notice=lambda t, j=job: self._notice(j, t),
                    )
                else:
                    device = job.prepared.device or resolve_device(job.spec.device)
                    self._post(JobStarted(job.job_id, job.spec, device))
                    result = self._compute(job.prepared, on_progress=on_progress, should_stop=job.stop.is_set)
                    layerwise.store(result, self.cache, lambda t, j=job: self._notice(j, t))
                self._end(job, JobFinished(job.job_id, job.spec, result))
            except BaseException as exc:
                self._end(job, self._failure(job, exc))

    def _cache_root(self):
        return self.cache.root if self.cache is not None else None

    def _failure(self, job: _Job, exc: BaseException) -> JobEvent:
        if isinstance(exc, Cancelled):
            return JobCancelled(job.job_id, job.spec)
        if isinstance(exc, IsotuiError):
            return JobFailed(job.job_id, job.spec, str(exc))
        return JobFailed(job.job_id, job.spec, f"internal error: {type(exc).__name__}: {exc}")

    def _notice(self, job: _Job, text: str) -> None:
        self._post(JobNotice(job.job_id, job.spec, text))

    def _end(self, job: _Job, event: JobEvent) -> None:
        """Post the job's last event, once (a cancel and a worker may both try)."""
        with self._lock:
            if job.ended:
                return
            job.ended = True
            if self._active.get(job.spec) is job:
                del self._active[job.spec]
        self._post(event)
