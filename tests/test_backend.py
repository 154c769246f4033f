"""The backend as the terminal app uses it: events, cache first, one job per device, cancel."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from isotui.backend import (
    LANE_NICENESS,
    Backend,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobProgress,
    JobQueued,
    JobStarted,
)
from isotui.errors import Cancelled, IsotuiError
from isotui.experiments import layer_pass
from isotui.extract.progress import Progress
from isotui.spec import make_spec
from isotui.store.cache import ResultCache

from .conftest import corpus

TERMINAL = (JobFinished, JobFailed, JobCancelled)


class Events:
    """Collects events posted from worker threads; waits for a job's last one."""

    def __init__(self) -> None:
        self.items: list = []
        self.cond = threading.Condition()

    def __call__(self, event) -> None:
        with self.cond:
            self.items.append(event)
            self.cond.notify_all()

    def of(self, job_id: int) -> list:
        with self.cond:
            return [e for e in self.items if e.job_id == job_id]

    def wait_end(self, job_id: int, timeout: float = 120):
        with self.cond:
            ok = self.cond.wait_for(
                lambda: any(isinstance(e, TERMINAL) for e in self.items if e.job_id == job_id), timeout
            )
        assert ok, f"job {job_id} did not end: {self.of(job_id)}"
        return self.of(job_id)[-1]


def _until(predicate, what: str, bound: float = 120) -> None:
    """Waits for ``predicate`` (a bound, not a timing check: on a loaded machine a thread may get
    no CPU for seconds)."""
    deadline = time.monotonic() + bound
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {bound} s"
        time.sleep(0.01)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(corpus(12)) + "\n", encoding="utf-8")
    return f"text:{path}"


@pytest.mark.slow
def test_real_job_then_cache_hit_without_computing(tmp_path, tiny_models, data):
    events = Events()
    backend = Backend(ResultCache(tmp_path / "c"), events)
    spec = make_spec(str(tiny_models["bert"]), data, batch_size=4)
    first = backend.submit(spec)
    end = events.wait_end(first)
    assert isinstance(end, JobFinished) and not end.result.from_cache
    kinds = [type(e) for e in events.of(first)]
    assert kinds[0] is JobQueued and JobStarted in kinds and kinds.count(JobProgress) >= 3
    second = backend.submit(spec)
    end = events.wait_end(second)
    assert isinstance(end, JobFinished) and end.result.from_cache
    assert JobStarted not in [type(e) for e in events.of(second)]  # answered from the cache
    assert [r.avg_cos for r in end.result.rows] == [r.avg_cos for r in events.of(first)[-1].result.rows]
    backend.close()


def _gated_compute(gate: threading.Event, started: list):
    """A stand-in for the model run: waits on ``gate``, reports progress, honours stop."""

    def compute(prepared, *, on_progress, should_stop):
        started.append(prepared.spec.model)
        while not gate.wait(0.01):
            if should_stop():
                raise Cancelled()
        on_progress(Progress(1, 1, 10, 0.1))
        return layer_pass.compute(prepared)

    return compute


def test_identical_requests_share_a_job_and_one_device_runs_one_at_a_time(tmp_path, tiny_models, data):
    events, gate, started = Events(), threading.Event(), []
    backend = Backend(None, events, compute=_gated_compute(gate, started))
    a = make_spec(str(tiny_models["bert"]), data, device="cpu")
    b = make_spec(str(tiny_models["gpt2"]), data, device="cpu")
    job_a = backend.submit(a)
    assert backend.submit(a) == job_a  # deduplicated while in flight
    job_b = backend.submit(b)
    _until(lambda: started, "job a started")
    time.sleep(0.5)  # room for b to start wrongly
    assert started == [str(tiny_models["bert"])]  # b waits for the device
    assert [j for j, _ in backend.in_flight()] == [job_a, job_b]
    gate.set()
    assert isinstance(events.wait_end(job_a), JobFinished)
    assert isinstance(events.wait_end(job_b), JobFinished)
    starts = [e.job_id for e in events.items if isinstance(e, JobStarted)]
    ends = [e.job_id for e in events.items if isinstance(e, JobFinished)]
    assert starts == [job_a, job_b] and ends == [job_a, job_b]
    order = [(type(e), e.job_id) for e in events.items]
    assert order.index((JobFinished, job_a)) < order.index((JobStarted, job_b))
    backend.close()


def test_cancel_running_and_queued_jobs_and_failures_stay_local(tmp_path, tiny_models, data):
    events, gate, started = Events(), threading.Event(), []
    cache = ResultCache(tmp_path / "c")
    backend = Backend(cache, events, compute=_gated_compute(gate, started))
    running = backend.submit(make_spec(str(tiny_models["bert"]), data, device="cpu"))
    queued = backend.submit(make_spec(str(tiny_models["gpt2"]), data, device="cpu"))
    broken = backend.submit(make_spec("no-such-org/no-such-model", data, device="cpu"))
    end = events.wait_end(broken)
    assert isinstance(end, JobFailed) and "not in the local Hugging Face cache" in end.message
    _until(lambda: started, "the running job started")
    assert backend.cancel(queued) and backend.cancel(running)
    assert isinstance(events.wait_end(running), JobCancelled)
    assert isinstance(events.wait_end(queued), JobCancelled)
    assert started == [str(tiny_models["bert"])]  # the queued job never started
    assert not cache.entries() and not backend.in_flight()
    assert not backend.cancel(running)
    gate.set()
    ok = backend.submit(make_spec(str(tiny_models["gpt_neox"]), data, device="cpu"))
    assert isinstance(events.wait_end(ok), JobFinished)  # the lane survived all of that
    backend.close()


def test_a_queued_job_cancels_at_once_without_waiting_for_the_running_one(tmp_path, tiny_models, data):
    events, gate, started = Events(), threading.Event(), []
    backend = Backend(None, events, compute=_gated_compute(gate, started))
    running = backend.submit(make_spec(str(tiny_models["bert"]), data, device="cpu"))
    queued = backend.submit(make_spec(str(tiny_models["gpt2"]), data, device="cpu"))
    _until(lambda: started, "the running job started")
    assert backend.cancel(queued)
    assert isinstance(events.wait_end(queued), JobCancelled)  # the gate is still shut: not behind it
    assert [j for j, _ in backend.in_flight()] == [running]
    gate.set()
    assert isinstance(events.wait_end(running), JobFinished)
    time.sleep(0.2)
    assert started == [str(tiny_models["bert"])]
    assert len([e for e in events.of(queued) if isinstance(e, TERMINAL)]) == 1  # one last word
    backend.close()


def test_backend_import_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, isotui.backend; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- worker processes: the fakes below are importable, so a spawned process can run them -------


def fake_prepare(spec):
    return layer_pass.Prepared(spec, f"fake-{spec.model}", [], "fp", "dfp", "float32", "cpu")


def slow_compute(prepared, *, on_progress, should_stop):
    """Reports its process id as the progress detail, until told to stop."""
    for i in range(100_000):
        if should_stop():
            raise Cancelled()
        on_progress(Progress(i + 1, 100_000, i, 0.1, detail=str(os.getpid())))
        time.sleep(0.02)
    raise AssertionError("never stopped")


def pid_compute(prepared, *, on_progress, should_stop):
    raise IsotuiError(f"computed in process {os.getpid()}")


def _pid_of(events, job_id: int) -> int:
    deadline = time.monotonic() + 600  # stops a hang only: the worker starts at nice +10
    while time.monotonic() < deadline:
        progress = [e for e in events.of(job_id) if isinstance(e, JobProgress)]
        if progress:
            return int(progress[0].progress.detail)
        time.sleep(0.05)
    raise AssertionError(f"no progress from job {job_id}: {events.of(job_id)}")


@pytest.mark.slow
def test_jobs_compute_in_a_worker_process_and_cancel_between_batches(tmp_path):
    events = Events()
    backend = Backend(None, events, compute=slow_compute, prepare=fake_prepare, processes=True)
    job = backend.submit(make_spec("fake-a", device="cpu"))
    pid = _pid_of(events, job)
    assert pid != os.getpid() and pid in backend.worker_pids()
    # the lane yields the CPU to the app's process (its keys)
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, ours + LANE_NICENESS)
    assert backend.cancel(job)
    assert isinstance(events.wait_end(job), JobCancelled)
    assert not backend.in_flight()
    backend.close()
    assert backend.wait_idle(120) and backend.worker_pids() == []


@pytest.mark.slow
def test_a_killed_worker_is_one_failure_and_the_next_job_gets_a_new_one(tmp_path):
    events = Events()
    backend = Backend(None, events, compute=slow_compute, prepare=fake_prepare, processes=True)
    doomed = backend.submit(make_spec("fake-a", device="cpu"))
    queued = backend.submit(make_spec("fake-b", device="cpu"))
    pid = _pid_of(events, doomed)
    os.kill(pid, signal.SIGKILL)  # as the kernel's out-of-memory killer would
    end = events.wait_end(doomed)
    assert isinstance(end, JobFailed), end
    assert end.message == (
        "the process computing fake-a ended unexpectedly (killed by SIGKILL, perhaps for lack of "
        "memory); nothing of it was kept, and other jobs go on"
    )
    assert [type(e) for e in events.of(doomed)].count(JobFailed) == 1
    new_pid = _pid_of(events, queued)  # the queued job runs, in a new process
    assert new_pid != pid
    backend.cancel(queued)
    assert isinstance(events.wait_end(queued), JobCancelled)
    backend.close()


@pytest.mark.slow
def test_quitting_kills_a_worker_that_does_not_stop(tmp_path):
    events = Events()
    backend = Backend(None, events, compute=slow_compute, prepare=fake_prepare, processes=True)
    job = backend.submit(make_spec("fake-a", device="cpu"))
    pid = _pid_of(events, job)
    backend.close(wait=False)
    backend.terminate()
    backend.close(wait=False)  # the app closes again as it unmounts: nothing more happens
    assert isinstance(events.wait_end(job), JobCancelled)
    assert backend.wait_idle(120)
    with pytest.raises(ProcessLookupError):
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.05)


@pytest.mark.slow
def test_the_app_process_never_imports_torch_while_a_real_job_runs(tiny_models, tmp_path):
    """A real layer run through the backend: computed (and cached) by a worker process; the
    calling process gets the result and never imports torch."""
    import subprocess
    import sys

    data = tmp_path / "samples.txt"
    data.write_text("\n".join(corpus(8)) + "\n", encoding="utf-8")
    code = f"""
import sys, threading
from isotui.backend import Backend, JobFinished, JobFailed
from isotui.spec import make_spec
from isotui.store.cache import ResultCache
done, events = threading.Event(), []
def post(e):
    events.append(e)
    if isinstance(e, (JobFinished, JobFailed)):
        done.set()
backend = Backend(ResultCache({str(tmp_path / "c")!r}), post)
backend.submit(make_spec({str(tiny_models["bert"])!r}, "text:{data}", batch_size=4))
assert done.wait(300), events
backend.close()
end = events[-1]
assert isinstance(end, JobFinished), end
print(len(end.result.rows), "torch" in sys.modules, len(ResultCache({str(tmp_path / "c")!r}).entries()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "False", "1"]  # 3 rows, no torch here, cached by the worker


def test_device_claims_keep_a_device_map_jobs_devices_to_itself():
    from isotui.backend import DeviceClaims, devices_label, job_devices

    split = make_spec("minilm", device_map="auto", max_memory="0=1GB,1=1GB,cpu=2GB,disk=9GB")
    everywhere = make_spec("minilm", device_map="balanced")  # no --max-memory: any device
    assert job_devices(split) == {"cuda:0", "cuda:1", "cpu"}  # disk is no device
    assert devices_label(split) == "cuda:0+cuda:1+cpu (map)"
    assert devices_label(everywhere) == "all devices (map balanced)"
    assert job_devices(make_spec("minilm", device="cuda")) == {"cuda:0"}
    assert devices_label(make_spec("minilm", device="cpu")) is None
    claims, stop = DeviceClaims(), threading.Event()
    assert claims.claim(job_devices(split), stop)
    stop.set()  # a claim that would wait gives up once its job is stopped
    assert not claims.claim(frozenset({"cpu"}), stop)
    assert not claims.claim(job_devices(everywhere), stop)
    assert claims.claim(frozenset({"cuda:2"}), stop)  # a device the split job does not use
    claims.release(job_devices(split))
    assert not claims.claim(job_devices(everywhere), stop)  # cuda:2 is still held
    claims.release(frozenset({"cuda:2"}))
    assert claims.claim(job_devices(everywhere), threading.Event())
