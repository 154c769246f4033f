"""The backend: the only part of isotui the terminal app talks to.

Jobs are driven by backend threads and report through typed events posted to a callback (the
app turns them into Textual messages; tests collect them). Their work runs in worker processes
(spawned): a model's forward passes, imports and metric finalisation hold Python's lock for
seconds at a time, and in the app's own process that froze the keys. The app's process never
imports torch. The cache answers first, in a lookup process, so a cached result never waits
behind a running model. Computation goes to one queue per device, each with its own process:
one model at a time per device, the rest wait in order; the process writes the cache itself.
A job split over several devices (``--device-map``) holds every device it may use (those its
``--max-memory`` names, else all): no other job computes on them until it ends.
Identical requests in flight share one job. Cancellation is cooperative: a running job stops
between batches (a shared flag), a queued job never starts; quitting kills what does not stop
in time. A failing job, or a process that dies (killed, out of memory), posts one sentence and
leaves every other job, and the cache, alone. Tests that inject fake steps run them in-process.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

from isotui.errors import Cancelled, IsotuiError
from isotui.extract.device import resolve_device
from isotui.extract.progress import Progress
from isotui.results import ModelResult
from isotui.spec import RunSpec
from isotui.store.cache import ResultCache

if TYPE_CHECKING:  # the layers experiment (numpy, the accumulators) loads with the first job, not the app
    from isotui.experiments import layer_pass
    from isotui.experiments.base import Context


@dataclass(frozen=True)
class JobEvent:
    """Something happened to job ``job_id`` (which measures ``spec``: a layer-wise RunSpec, or an
    experiment's request, defined in its module)."""

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
# What a job's step tells whoever runs it, in order: ("notice", text)*, ("started", device),
# ("progress", Progress)*, then one last word: ("done", result), ("miss", request) (a lookup
# found nothing: compute this request), ("cancelled",) or ("failed", sentence).
Message = tuple[Any, ...]
Send = Callable[[Message], None]
LAST_WORDS = frozenset({"done", "miss", "cancelled", "failed"})
# A device lane's process yields the CPU to the app's: on a busy CPU the keys' redraws come
# first (issue 12: key latency), and an idle app costs the job nothing.
LANE_NICENESS = 10


class Request(Protocol):
    """A job as the backend runs it (an experiment's request, the contract of
    :class:`isotui.experiments.base.Request`)."""

    kind: ClassVar[str]  # which experiment (layers, attention... and sweep)

    @property
    def device(self) -> str: ...

    def lookup(self, cache_root: Path | None, notice: Callable[[str], None]) -> Any: ...

    def compute(self, context: Context) -> Any: ...


def as_request(
    spec: Any,
    prepare: Callable[[RunSpec], layer_pass.Prepared] | None,
    compute: Callable[..., ModelResult] | None,
) -> Request:
    """What the backend runs for ``spec``: the app submits a layer-wise run as its RunSpec, which
    is the layers experiment's request (``prepare``/``compute``: tests' fakes); an experiment's
    request is itself."""
    if isinstance(spec, RunSpec):  # the one place a submitted RunSpec becomes its request
        from isotui.experiments import layerwise

        return layerwise.LayersRequest(spec, compute_fn=compute, prepare_fn=prepare)
    return cast(Request, spec)


def job_kind(job: Any) -> str:
    """Which experiment a job runs: its request's ``kind`` (``layers`` for a layer run, also
    when submitted as its RunSpec; ``sweep`` for a sweep)."""
    return str(as_request(job, None, None).kind)


def _started_device(request: Request) -> str:
    """The device a job runs on, as the jobs pane shows it once it starts: the one its lookup
    resolved when the request keeps it (a layer run), else the spec's own, resolved."""
    mapped = devices_label(request)
    if mapped is not None:
        return mapped
    resolved: Callable[[], str] | None = getattr(request, "resolved_device", None)
    return resolved() if resolved is not None else resolve_device(request.device)


ALL_DEVICES = "*"  # a device map without --max-memory: accelerate may use every device


def _spec_of(job: Any) -> Any:
    """The RunSpec a job (a RunSpec, or an experiment request holding one) runs, or None."""
    return getattr(as_request(job, None, None), "spec", None)


def job_devices(job: Any) -> frozenset[str]:
    """The devices a job occupies while it computes: a device-map job every device its
    ``--max-memory`` names (the GPUs and the CPU; disk is no device), or every device when it
    names none; any other job its one device (``cuda`` is ``cuda:0``). Torch-free: the app's
    process decides from the spec alone."""
    spec = _spec_of(job)
    if spec is not None and getattr(spec, "device_map", None):
        if not spec.max_memory:
            return frozenset({ALL_DEVICES})
        named = [k for k, _ in spec.max_memory if k != "disk"]
        return frozenset(f"cuda:{k}" if isinstance(k, int) else str(k) for k in named)
    device = str(spec.device if spec is not None else getattr(job, "device", "auto"))
    return frozenset({"cuda:0" if device == "cuda" else device})


def devices_label(job: Any) -> str | None:
    """What the jobs pane's device column says of a device-map job (None: any other job)."""
    spec = _spec_of(job)
    if spec is None or not getattr(spec, "device_map", None):
        return None
    devices = job_devices(job)
    if ALL_DEVICES in devices:
        return f"all devices (map {spec.device_map})"
    order = sorted(devices, key=lambda d: (not d.startswith("cuda"), len(d), d))
    return "+".join(order) + " (map)"


class DeviceClaims:
    """Which devices running jobs occupy: a job computes only once none of its devices
    (:func:`job_devices`) is another running job's, so a job split over several devices by
    ``--device-map`` keeps every one of them to itself, whichever lane runs it."""

    def __init__(self) -> None:
        self._held: list[frozenset[str]] = []
        self._cond = threading.Condition()

    @staticmethod
    def _clash(a: frozenset[str], b: frozenset[str]) -> bool:
        return ALL_DEVICES in a or ALL_DEVICES in b or bool(a & b)

    def claim(self, devices: frozenset[str], stop: threading.Event) -> bool:
        """Wait until ``devices`` are free, then hold them; False if ``stop`` is set first."""
        with self._cond:
            while any(self._clash(devices, held) for held in self._held):
                if stop.is_set():
                    return False
                self._cond.wait(0.1)
            self._held.append(devices)
            return True

    def release(self, devices: frozenset[str]) -> None:
        with self._cond:
            self._held.remove(devices)
            self._cond.notify_all()


def failure_sentence(exc: BaseException) -> str:
    """What a job's failure says: the error's own sentence, or its type for an unexpected one."""
    if isinstance(exc, IsotuiError):
        return str(exc)
    return f"internal error: {type(exc).__name__}: {exc}"


def run_step(
    step: str, request: Request, cache_root: Path | None, send: Send, should_stop: Callable[[], bool]
) -> None:
    """Run a job's ``lookup`` or ``compute`` step, telling ``send`` what happens (see
    :data:`Message`); a failure is its last message, not an exception (in a worker process or
    on a backend thread alike), unless the messages themselves cannot be sent."""

    def notice(text: str) -> None:
        send(("notice", text))

    from contextlib import nullcontext

    from isotui import service

    progress = nullcontext(lambda p: send(("progress", p)))
    session = service.Session(cache_root, bar=lambda _name: progress, notice=notice, should_stop=should_stop)
    try:
        if step == "lookup":
            hit = service.cached(request, session)
            send(("done", hit) if hit is not None else ("miss", request))
            return
        if should_stop():
            raise Cancelled()
        send(("started", _started_device(request)))
        send(("done", service.compute(request, session)))
    except Cancelled:
        send(("cancelled",))
    except BaseException as exc:  # one sentence; the worker goes on with the next job
        send(("failed", failure_sentence(exc)))


class WorkerDied(Exception):
    """The process computing a job ended without its last word (killed, out of memory...)."""


class _InProcess:
    """Steps run on the calling backend thread (tests that inject fake models)."""

    def __init__(self) -> None:
        self.stop = threading.Event()

    def run(self, step: str, request: Request, cache_root: Path | None, send: Send) -> None:
        run_step(step, request, cache_root, send, self.stop.is_set)

    def close(self) -> None:
        pass

    def terminate(self) -> bool:
        return False  # a thread cannot be stopped from outside

    def pid(self) -> int | None:
        return None


class _Child:
    """One worker process running a job's steps one at a time, its messages coming back through a
    pipe. Spawned (a fresh interpreter), never forked: the app has threads, and forking them is
    unsafe. Started on first use and again after it died."""

    def __init__(self, ctx: SpawnContext, name: str, niceness: int = 0) -> None:
        self._ctx = ctx
        self.name = name
        self.niceness = niceness
        self.stop = ctx.Event()  # set: the running step stops at its next batch
        self._process: SpawnProcess | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def _start(self) -> Connection:
        ours, theirs = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main, args=(theirs, self.stop, self.niceness), name=self.name, daemon=True
        )
        process.start()
        theirs.close()  # so that a dead child reads as the end of the pipe
        with self._lock:
            self._process, self._conn = process, ours
        return ours

    def run(self, step: str, request: Request, cache_root: Path | None, send: Send) -> None:
        conn = self._conn if self._process is not None and self._process.is_alive() else None
        conn = conn or self._start()
        try:
            conn.send((step, request, cache_root))
            while True:
                message = conn.recv()
                send(message)
                if message[0] in LAST_WORDS:
                    return
        except (EOFError, OSError):
            raise WorkerDied(self._reap()) from None

    def _reap(self) -> str:
        """Collect the dead (or broken) process and say how it ended."""
        with self._lock:
            process, conn, self._process, self._conn = self._process, self._conn, None, None
        if conn is not None:
            conn.close()
        if process is None:
            return "it was stopped"
        process.join(5)
        if process.exitcode is None:
            process.kill()
            process.join(5)
        code = process.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            return f"killed by {name}" + (", perhaps for lack of memory" if -code == signal.SIGKILL else "")
        return f"exit code {code}"

    def close(self) -> None:
        """Let the process end after its step (it reads no more tasks)."""
        with self._lock:
            process, conn = self._process, self._conn
        if process is None or conn is None:
            return
        with contextlib.suppress(OSError):
            conn.send(None)
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join(5)
        with self._lock:
            self._process = self._conn = None
        conn.close()

    def terminate(self) -> bool:
        with self._lock:
            process = self._process
        if process is not None and process.is_alive():
            process.kill()
            process.join(5)
        return True

    def pid(self) -> int | None:
        with self._lock:
            process = self._process
        return process.pid if process is not None and process.is_alive() else None


def _worker_main(conn: Connection, stop: Any, niceness: int = 0) -> None:
    """A worker process: run the steps sent to it until told to end (None) or its parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ctrl+c is a key of the app, not for us
    if niceness and hasattr(os, "nice"):
        with contextlib.suppress(OSError):
            os.nice(niceness)
    devnull = os.open(os.devnull, os.O_WRONLY)  # the app owns the terminal: libraries' chatter goes
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    parent = os.getppid()

    def should_stop() -> bool:
        return stop.is_set() or os.getppid() != parent

    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        step, request, cache_root = task
        try:
            run_step(step, request, cache_root, conn.send, should_stop)
        except OSError:  # the parent went away mid-step
            return


Runner = _InProcess | _Child


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (it keeps the workers' shared flags) with the
    real stderr: it is handed ``sys.stderr``'s descriptor, and the app's captured stderr has none."""
    from multiprocessing import resource_tracker

    captured = sys.stderr
    try:
        sys.stderr = sys.__stderr__
        resource_tracker.ensure_running()
    finally:
        sys.stderr = captured


@dataclass(eq=False)
class _Job:
    job_id: int
    spec: Any
    request: Request
    stop: threading.Event = field(default_factory=threading.Event)
    runner: Runner | None = None  # what computes it, once a lane took it
    started: bool = False  # a lane is computing it (set under the backend's lock)
    ended: bool = False  # its last event is posted; nothing more may be


class Backend:
    """Runs jobs off the caller's thread and (by default) out of its process; see the module
    docstring. ``compute``/``prepare``: tests' fake layer-wise steps; they run in-process unless
    ``processes`` says otherwise (then they must be importable functions)."""

    def __init__(
        self,
        cache: ResultCache | None,
        post: Post,
        *,
        compute: Callable[..., ModelResult] | None = None,
        prepare: Callable[[RunSpec], layer_pass.Prepared] | None = None,
        processes: bool | None = None,
    ) -> None:
        self.cache = cache
        self._post = post
        self._compute = compute
        self._prepare = prepare
        if processes is None:
            processes = compute is None and prepare is None
        self._ctx = multiprocessing.get_context("spawn") if processes else None
        if processes:
            _start_resource_tracker()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._active: dict[Any, _Job] = {}
        # One lookup worker keeps submission order into the device queues (lookups are quick:
        # names, data hashes, the cache); computation is what takes long, in the lanes.
        self._lookups = ThreadPoolExecutor(max_workers=1, thread_name_prefix="isotui-lookup")
        self._lookup_runner = self._runner("lookup")
        self._runners: list[Runner] = [self._lookup_runner]
        self._lanes: dict[str, queue.Queue[_Job | None]] = {}
        self._claims = DeviceClaims()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def _runner(self, name: str, niceness: int = 0) -> Runner:
        if self._ctx is None:
            return _InProcess()
        return _Child(self._ctx, f"isotui-{name}", niceness)

    def submit(self, spec: Any) -> int:
        """Queue a job for ``spec`` (a RunSpec, or an experiment request); an identical job
        already queued or running is reused."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the backend is closed")
            if spec in self._active:
                return self._active[spec].job_id
            job = _Job(next(self._ids), spec, as_request(spec, self._prepare, self._compute))
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
            if job.runner is not None:
                job.runner.stop.set()
            waiting = not job.started
        if waiting:
            self._end(job, JobCancelled(job.job_id, job.spec))
        return True

    def in_flight(self) -> list[tuple[int, Any]]:
        """Jobs queued or running, oldest first."""
        with self._lock:
            return sorted(((j.job_id, j.spec) for j in self._active.values()), key=lambda js: js[0])

    def busy(self) -> bool:
        """Whether a job is in flight (queued or running)."""
        with self._lock:
            return bool(self._active)

    def worker_pids(self) -> list[int]:
        """The worker processes alive now (none in-process)."""
        with self._lock:
            runners = list(self._runners)
        return [pid for r in runners if (pid := r.pid()) is not None]

    def wait_idle(self, timeout: float) -> bool:
        """After :meth:`close`: wait up to ``timeout`` seconds for the workers to end (a running
        job stops at its next safe point); True if they all did."""
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def terminate(self) -> bool:
        """The last resort after :meth:`close`: kill the worker processes (their jobs end as
        cancelled). False in-process, where a thread inside a model cannot be stopped."""
        with self._lock:
            runners = list(self._runners)
        return all([r.terminate() for r in runners])

    def close(self, wait: bool = True) -> None:
        """Stop taking jobs, cancel those in flight, and (optionally) wait for the workers."""
        with self._lock:
            first = not self._closed  # quitting closes, and so does unmounting the app
            self._closed = True
            jobs = list(self._active.values())
            for job in jobs:
                job.stop.set()
                if job.runner is not None:
                    job.runner.stop.set()
        if first:
            self._lookups.submit(self._lookup_runner.close)  # after the lookups queued before it
            for lane in self._lanes.values():
                lane.put(None)
        self._lookups.shutdown(wait=wait)
        if wait:
            for thread in self._threads:
                thread.join()

    # -- workers ---------------------------------------------------------------------------

    def _lookup(self, job: _Job) -> None:
        """Answer from the cache; otherwise hand the (resolved) request over to a device lane."""
        if job.stop.is_set():
            self._end(job, JobCancelled(job.job_id, job.spec))
            return
        self._step(self._lookup_runner, "lookup", job)

    def _lane(self, device: str) -> queue.Queue[_Job | None]:
        with self._lock:
            lane = self._lanes.get(device)
            if lane is None:
                lane = self._lanes[device] = queue.Queue()
                runner = self._runner(device, LANE_NICENESS)
                self._runners.append(runner)
                thread = threading.Thread(
                    target=self._run_lane, args=(lane, runner), name=f"isotui-{device}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return lane

    def _run_lane(self, lane: queue.Queue[_Job | None], runner: Runner) -> None:
        while (job := lane.get()) is not None:
            devices = job_devices(job.request)
            if not self._claims.claim(devices, job.stop):  # cancelled while its devices were busy
                self._end(job, JobCancelled(job.job_id, job.spec))
                continue
            try:
                self._run_claimed(job, runner)
            finally:
                self._claims.release(devices)
        runner.close()

    def _run_claimed(self, job: _Job, runner: Runner) -> None:
        """Run ``job``'s compute step on this lane's ``runner`` (its devices are claimed)."""
        with self._lock:
            if job.ended:  # cancelled while it waited
                return
            job.started, job.runner = True, runner
            runner.stop.clear()
            if job.stop.is_set():
                runner.stop.set()
        self._step(runner, "compute", job)

    def _step(self, runner: Runner, step: str, job: _Job) -> None:
        """Run one step of ``job`` on ``runner``, its messages turned into the job's events."""
        try:
            runner.run(step, job.request, self._cache_root(), lambda message: self._relay(job, message))
        except WorkerDied as died:
            if job.stop.is_set():  # killed on purpose (quitting)
                self._end(job, JobCancelled(job.job_id, job.spec))
            else:
                self._end(
                    job,
                    JobFailed(
                        job.job_id,
                        job.spec,
                        f"the process computing {job.spec.model} ended unexpectedly ({died}); "
                        "nothing of it was kept, and other jobs go on",
                    ),
                )
        except BaseException as exc:  # e.g. a request that cannot be sent to a process
            self._end(job, JobFailed(job.job_id, job.spec, failure_sentence(exc)))

    def _relay(self, job: _Job, message: Message) -> None:
        kind, *rest = message
        if kind == "notice":
            self._post(JobNotice(job.job_id, job.spec, rest[0]))
        elif kind == "started":
            self._post(JobStarted(job.job_id, job.spec, rest[0]))
        elif kind == "progress":
            self._post(JobProgress(job.job_id, job.spec, rest[0]))
        elif kind == "miss":
            job.request = rest[0]  # resolved by the lookup
            self._lane(devices_label(job.request) or job.request.device).put(job)  # a map: its own lane
        elif kind == "done":
            self._end(job, JobFinished(job.job_id, job.spec, rest[0]))
        elif kind == "cancelled":
            self._end(job, JobCancelled(job.job_id, job.spec))
        else:
            self._end(job, JobFailed(job.job_id, job.spec, rest[0]))

    def _cache_root(self) -> Path | None:
        return self.cache.root if self.cache is not None else None

    def _end(self, job: _Job, event: JobEvent) -> None:
        """Post the job's last event, once (a cancel and a worker may both try)."""
        with self._lock:
            if job.ended:
                return
            job.ended = True
            if self._active.get(job.spec) is job:
                del self._active[job.spec]
        self._post(event)
