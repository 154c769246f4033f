"""Sweeps: every (model, checkpoint, shard) task of a run config, run by a pool of local processes
or by Ray; shared by ``isotui sweep`` (:mod:`isotui.cli.sweep`, a bar over tasks) and the app (a
:class:`SweepRequest` job in the backend, one row over tasks in the jobs pane).

A sweep config is a run config (:mod:`isotui.config`) plus a ``[sweep]`` table. Each task is the
real ``isotui run CONFIG --model M --shard I/K`` in its own process (a subprocess, or a subprocess
of a Ray task), so a task that dies takes nothing else with it, and the shards meet in the result
cache as they do in a Slurm array (:mod:`isotui.experiments.shards`). Before anything is launched
the cache is asked which runs and shards are there already: a rerun resumes where the last one
stopped. A task that crashes (killed, out of memory, an internal error) is run again up to
``retries`` times; a task refused for bad input (exit 2) is not, since it would be refused again.
Whoever runs a sweep is told of each finished task through a callback, and may stop it
(``should_stop``): no task starts after that, and running ones are terminated.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isotui.errors import IsotuiError
from isotui.spec import MAX_SHARDS

if TYPE_CHECKING:
    from isotui.experiments.base import Context

EXECUTORS = ("local", "ray")
MAX_TASKS = MAX_SHARDS  # runs x shards: each task is a process
EXIT_BAD_INPUT = 2
INSTALL_RAY = "pip install 'isotui[ray]'"
# [sweep] key -> the TOML types it may have
SWEEP_KEYS: dict[str, tuple[type, ...]] = {
    "checkpoints": (list,),
    "shards": (int,),
    "executor": (str,),
    "address": (str,),
    "gpus_per_task": (int, float),
    "retries": (int,),
    "workers": (int,),
    "shared_cache": (bool,),
    "worker_cache_dir": (str,),
}
_TYPE_NAMES = {
    list: "list",
    int: "whole number",
    float: "number",
    str: "string",
    bool: "boolean (true or false)",
}


@dataclass(frozen=True)
class SweepSettings:
    """The ``[sweep]`` table, checked."""

    checkpoints: tuple[str, ...] = ()
    shards: int = 1
    executor: str = "local"
    address: str | None = None
    gpus_per_task: float | None = None  # None: one GPU per task where there are GPUs, else none
    retries: int = 1
    workers: int | None = None  # local: processes at once (default: one per visible device, else 1)
    # Ray: whether every node sees the driver's cache folder (None: only a local cluster started
    # by the sweep does); False: states come back through Ray's object store (:func:`run_ray`)
    shared_cache: bool | None = None
    worker_cache_dir: str | None = None  # Ray, not shared: each node's own cache (ISOTUI_CACHE_DIR)

    def shares_cache(self) -> bool:
        """Whether Ray's workers use the driver's cache folder itself (see :func:`run_ray`)."""
        if self.shared_cache is not None:
            return self.shared_cache
        return self.address in (None, "", "local")


def read_sweep(path: Path, table: dict[str, Any] | None) -> SweepSettings:
    """The ``[sweep]`` table of config file ``path``; a bad key or value is one sentence naming it."""
    table = table or {}
    where = f"config file {path}: [sweep]"
    for key, value in table.items():
        if key not in SWEEP_KEYS:
            raise IsotuiError(f"{where} has no key {key!r} (known: {', '.join(SWEEP_KEYS)})")
        allowed = SWEEP_KEYS[key]
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
            want = " or ".join(_TYPE_NAMES[t] for t in allowed)
            raise IsotuiError(f"{where} {key} must be a {want} (got {value!r})")
    checkpoints = table.get("checkpoints", [])
    if "checkpoints" in table and (not checkpoints or not all(isinstance(c, str) for c in checkpoints)):
        raise IsotuiError(f"{where} checkpoints must be a non-empty list of checkpoint names or folders")
    settings = SweepSettings(
        checkpoints=tuple(checkpoints),
        shards=table.get("shards", 1),
        executor=table.get("executor", "local"),
        address=table.get("address"),
        gpus_per_task=float(table["gpus_per_task"]) if "gpus_per_task" in table else None,
        retries=table.get("retries", 1),
        workers=table.get("workers"),
        shared_cache=table.get("shared_cache"),
        worker_cache_dir=table.get("worker_cache_dir"),
    )
    if settings.shards < 1:
        raise IsotuiError(f"{where} shards = {settings.shards}: a run needs at least 1 shard")
    if settings.shards > MAX_SHARDS:
        raise IsotuiError(
            f"{where} shards = {settings.shards} is more than {MAX_SHARDS:,} (each shard is a process "
            "of its own and needs samples of its own)"
        )
    if settings.executor not in EXECUTORS:
        raise IsotuiError(f"{where} executor = {settings.executor!r} is not one of {', '.join(EXECUTORS)}")
    if settings.retries < 0:
        raise IsotuiError(f"{where} retries = {settings.retries} must be 0 or more")
    gpus = settings.gpus_per_task
    if gpus is not None and gpus < 0:
        raise IsotuiError(f"{where} gpus_per_task = {gpus:g} must be 0 or more")
    if settings.executor == "local" and gpus is not None and gpus != int(gpus):
        raise IsotuiError(
            f"{where} gpus_per_task = {gpus:g}: a local task gets whole GPUs (Ray's executor shares "
            "them by fractions)"
        )
    if settings.workers is not None and settings.workers < 1:
        raise IsotuiError(f"{where} workers = {settings.workers} must be at least 1")
    if settings.executor == "local" and settings.address:
        raise IsotuiError(f'{where} address is for executor = "ray" (the executor here is local)')
    for key in ("shared_cache", "worker_cache_dir"):
        if settings.executor == "local" and key in table:
            raise IsotuiError(
                f'{where} {key} is for executor = "ray" (local tasks share this machine\'s cache)'
            )
    if settings.shared_cache and settings.worker_cache_dir:
        raise IsotuiError(
            f"{where} worker_cache_dir is for shared_cache = false (with a shared cache every "
            "task writes the driver's cache folder)"
        )
    if settings.executor == "ray" and settings.workers is not None:
        raise IsotuiError(f'{where} workers is for executor = "local"; Ray runs as many as the cluster can')
    return settings


def resolve_models(path: Path, models: list[str], checkpoints: Sequence[str]) -> list[str]:
    """The runs of a sweep: each model, or each of its checkpoints (:func:`resolve_checkpoints`,
    the parser of ``--checkpoints``: hub revisions of the model, model ids, checkpoint folders).
    A checkpoint name that is a sub-folder of a local model folder (an ``isotui train-tiny``
    output) is that folder; ``./`` paths are relative to the config file."""
    from isotui.experiments.series import resolve_checkpoints

    if not checkpoints:
        return list(models)
    base = path.resolve().parent
    out: list[str] = []
    for model in models:
        items = []
        for item in checkpoints:
            if item.startswith(("./", "../")):
                item = str((base / item).resolve())
            elif Path(model).is_dir() and (Path(model) / item).is_dir():
                item = str(Path(model) / item)
            items.append(item)
        try:
            out += [c.model for c in resolve_checkpoints(model, items)]
        except IsotuiError as exc:
            raise IsotuiError(f"config file {path}: [sweep] checkpoints of {model}: {exc}") from None
    return out


# --- tasks ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """One process's work: run ``model`` (shard ``index`` of ``count``; the whole run when 1)."""

    model: str
    index: int
    count: int
    # what a task on a machine without the driver's cache measures (its RunSpec) and the run's
    # key there (:func:`plan` fills them; the task's identity is the three fields above)
    spec: Any = field(default=None, compare=False, repr=False)
    key: str = field(default="", compare=False, repr=False)

    @property
    def name(self) -> str:
        label = Path(self.model).name if Path(self.model).is_dir() else self.model
        return f"{label} shard {self.index}/{self.count}" if self.count > 1 else label

    def argv(self, config: Path, cache_root: Path) -> list[str]:
        """The ``isotui run`` arguments of this task; its --csv/--json go nowhere (the sweep
        writes the config's outputs once, for all runs)."""
        argv = ["run", str(config), "--model", self.model, "--cache-dir", str(cache_root), "-q"]
        argv += ["--csv", os.devnull, "--json", os.devnull]
        return argv + (["--shard", f"{self.index}/{self.count}"] if self.count > 1 else [])


@dataclass
class TaskResult:
    task: Task
    ok: bool
    problem: str = ""  # one sentence, when not ok
    crashed: bool = False  # not a refusal of bad input (exit 2)
    cancelled: bool = False  # the sweep was stopped before or while it ran
    started: bool | None = True  # False: stopped before its process started; None: not known (Ray)


class TaskCrashed(Exception):
    """A task's process died or failed inside (not exit 2): Ray retries it (``retry_exceptions``)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


def _package_path() -> str:
    """The folder this isotui is imported from, so a task's process runs the same code."""
    return str(Path(__file__).resolve().parents[1])


def task_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_path(), env.get("PYTHONPATH", "")) if p)
    return env


def never() -> bool:
    """Default stop check: run every task."""
    return False


STOP_POLL_S = 0.2  # how often a running task's process checks whether the sweep was stopped
NOT_STARTED = "not started: the sweep was stopped"
STOPPED = "stopped while it ran: the sweep was stopped"
# how a task's process ends on ^C: isotui's exit status 130, or killed by the signal itself
INTERRUPTED = (130, -signal.SIGINT)
INTERRUPT_GRACE_S = 2.0  # a task ended by ^C: how long to wait for the sweep to see the ^C too


def _soon(stop: Callable[[], bool], within: float = INTERRUPT_GRACE_S) -> bool:
    """Whether ``stop`` says so within ``within`` seconds: a terminal's ^C reaches the sweep and
    its tasks at once, and a task may end before the sweep has handled it; a task interrupted
    on its own (``kill -INT`` of that process) is a crash, retried."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if stop():
            return True
        time.sleep(0.05)
    return stop()


def run_task(
    argv: list[str], extra_env: dict[str, str] | None = None, should_stop: Callable[[], bool] = never
) -> tuple[int, str]:
    """Run one task's ``isotui`` command in a new process; (exit status, its last words). Once
    ``should_stop`` says so, the process is terminated (killed if it does not end in 5 s)."""
    command = [sys.executable, "-m", "isotui", *argv]
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as said:
        proc = subprocess.Popen(command, env=task_env(extra_env), stdout=subprocess.DEVNULL, stderr=said)
        while True:
            try:
                proc.wait(STOP_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if should_stop():
                    proc.terminate()
                    try:
                        proc.wait(5)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                    break
        said.seek(0)
        return proc.returncode, _last_words(proc.returncode, said.read())


def _last_words(code: int, stderr: str) -> str:
    """What a failed task says: its last stderr line (isotui's one sentence), or how it died."""
    if code < 0:
        try:
            return f"its process was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"its process was killed by signal {-code}"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    text = lines[-1] if lines else f"it exited with status {code}"
    return text.removeprefix("isotui: error: ").removeprefix("isotui: ")


def ray_task(argv: list[str]) -> str:
    """A Ray task: the task's ``isotui`` command in the Ray worker's process (Ray gives it its
    GPUs in CUDA_VISIBLE_DEVICES, and a GPU task's worker serves that one task: Ray's default
    ``max_calls=1``; a CPU worker keeps its imports for the next task). A worker that dies is
    retried by Ray; an internal error raises :class:`TaskCrashed`, retried too (``retry_exceptions``);
    a refusal of bad input (exit 2) returns its sentence."""
    import contextlib
    import importlib
    import io

    # the task is the command itself, as a local task's process runs it (``python -m isotui``)
    main = importlib.import_module("isotui.cli").main
    said = io.StringIO()
    with contextlib.redirect_stderr(said):  # isotui's stderr console writes to sys.stderr
        code = main(argv)
    text = _last_words(code, said.getvalue())
    if code not in (0, EXIT_BAD_INPUT):
        raise TaskCrashed(text)
    return "" if code == 0 else text


def ray_state_task(spec: Any, index: int, count: int, plan: dict[str, Any] | None) -> tuple[str, Any]:
    """A Ray task on a machine that does not see the driver's cache (``shared_cache = false``):
    the shard (or whole run) measured in the worker's process with this node's own cache
    (``ISOTUI_CACHE_DIR``, set by the sweep's ``runtime_env`` from ``worker_cache_dir``), and
    ``("ok", (run key, the bytes of its cache entry))`` returned through Ray's object store;
    ``("refused", sentence)`` for bad input (not retried). An internal error raises
    :class:`TaskCrashed` (retried, as a worker that dies is)."""
    from isotui.experiments.layerwise import measure_for_driver
    from isotui.paths import cache_dir

    try:
        return "ok", measure_for_driver(spec, index, count, plan, cache_dir())
    except IsotuiError as exc:
        return "refused", str(exc)
    except Exception as exc:
        raise TaskCrashed(
            f"internal error in {spec.model}: {type(exc).__name__}: {exc}".splitlines()[0]
        ) from None


Report = Callable[[TaskResult], None]
Say = Callable[[str], None]


def local_devices() -> list[str]:
    """The visible GPUs (``CUDA_VISIBLE_DEVICES``, else torch's count); none on a CPU-only box."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return []
    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_groups(devices: Sequence[str], gpus_per_task: float | None) -> list[str | None]:
    """The ``CUDA_VISIBLE_DEVICES`` of each local worker: the visible GPUs cut into disjoint
    groups of ``gpus_per_task`` (default one each; ``0``: none, the tasks run on the CPU); None
    on a machine without GPUs (the environment is left as it is). One sentence when the machine
    has fewer GPUs than one task asks for."""
    per = 1 if gpus_per_task is None else int(gpus_per_task)
    if not devices:
        if per and gpus_per_task is not None:
            raise IsotuiError(f"[sweep] gpus_per_task = {per}, but this machine has no GPU visible")
        return [None]
    if per == 0:
        return [""]  # hides the GPUs: each task's plan is made for the CPU it runs on
    if per > len(devices):
        raise IsotuiError(
            f"[sweep] gpus_per_task = {per}, but this machine has {len(devices)} GPU"
            f"{'s' if len(devices) != 1 else ''} visible ({', '.join(devices)})"
        )
    return [",".join(devices[i * per : (i + 1) * per]) for i in range(len(devices) // per)]


def run_local(
    jobs: list[tuple[Task, list[str]]],
    settings: SweepSettings,
    done: Report,
    say: Say,
    should_stop: Callable[[], bool] = never,
) -> list[TaskResult]:
    """One process per group of ``gpus_per_task`` visible GPUs at once (default one GPU each;
    ``workers`` to choose; one on a CPU-only box), each task's process given its worker's GPUs
    through ``CUDA_VISIBLE_DEVICES``; a crash retried ``retries`` times."""
    groups = gpu_groups(local_devices(), settings.gpus_per_task)
    workers = settings.workers or len(groups)
    on_gpus = groups[0] not in (None, "")
    if on_gpus and workers > len(groups):  # never two running tasks on one GPU: the rest queue
        say(
            f"[sweep] workers = {workers}, but the visible GPUs make {len(groups)} group"
            f"{'s' if len(groups) != 1 else ''} of {settings.gpus_per_task or 1:g}: {len(groups)} "
            "tasks run at once, each on GPUs of its own, and the others wait"
        )
        workers = len(groups)
    free = list(range(workers))
    lock = threading.Lock()

    def one(task: Task, argv: list[str], stop: Callable[[], bool]) -> TaskResult:
        with lock:
            slot = free.pop(0)
        try:
            group = groups[slot] if on_gpus else groups[0]
            env = {"CUDA_VISIBLE_DEVICES": group} if group is not None else {}
            for attempt in range(settings.retries + 1):
                if stop():
                    return TaskResult(task, False, NOT_STARTED, cancelled=True, started=attempt > 0)
                code, text = run_task(argv, env, stop)
                if code == 0:
                    return TaskResult(task, True)
                if stop() or (code in INTERRUPTED and _soon(stop)):  # ^C reaches the tasks too
                    return TaskResult(task, False, STOPPED, cancelled=True)
                if code == EXIT_BAD_INPUT:
                    return TaskResult(task, False, text)
                if attempt < settings.retries:
                    say(f"{task.name}: {text}; retrying ({attempt + 2} of {settings.retries + 1} attempts)")
            return TaskResult(task, False, f"{text} ({settings.retries + 1} attempts)", crashed=True)
        finally:
            with lock:
                free.append(slot)

    stopping = threading.Event()  # set on a stop or an interrupt: no task starts, running ones end

    def stop_now() -> bool:
        return stopping.is_set() or should_stop()

    results: list[TaskResult] = []

    def finish(result: TaskResult) -> None:
        results.append(result)
        done(result)

    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        pending = {pool.submit(one, task, argv, stop_now): task for task, argv in jobs}
        while pending:
            ended, _ = wait(pending, timeout=STOP_POLL_S, return_when=FIRST_COMPLETED)
            for future in ended:
                del pending[future]
                finish(future.result())
            if stop_now():  # queued tasks never start; the running ones see it within STOP_POLL_S
                for future in [f for f in pending if f.cancel()]:
                    finish(TaskResult(pending.pop(future), False, NOT_STARTED, cancelled=True, started=False))
    except BaseException:  # an interrupt (^C without the CLI's handler): stop everything, then go
        stopping.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise IsotuiError(f'executor = "ray" needs Ray, which is not installed: {INSTALL_RAY}') from None
    return ray


# Ray's own notices that are not the sweep's news: "Token authentication is enabled for this Ray
# cluster..." on every local start (the local cluster is started here, with Ray's default)
RAY_QUIET_LOGGERS = ("ray._private.authentication.authentication_token_setup",)


def quiet_ray_notices() -> None:
    """Keep Ray's start-up notices (:data:`RAY_QUIET_LOGGERS`) out of the sweep's output; its
    errors still show."""
    import logging

    for name in RAY_QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


RAY_CONNECT_S = 10.0  # how long the sweep waits for a Ray cluster's address to answer


def check_ray_address(where: str, address: str | None, timeout: float = RAY_CONNECT_S) -> None:
    """One sentence when nothing answers at ``address`` (``HOST:PORT`` or ``ray://HOST:PORT``)
    within ``timeout`` seconds: ``ray.init`` itself retries such an address for many minutes,
    printing warnings. ``auto`` (or no address) is Ray's to find."""
    import socket

    if not address or address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rstrip("/").rpartition(":")
    host = host.strip("[]")  # [::1]:6379
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise IsotuiError(
            f'{where} address = "{address}" is not HOST:PORT, ray://HOST:PORT or "auto" (a Ray cluster)'
        )
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        reason = f"no answer in {timeout:g} s" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        raise IsotuiError(
            f'{where} address = "{address}": cannot connect to a Ray cluster there ({reason}); '
            "start one with `ray start --head`, or fix the address"
        ) from None


def run_ray(
    jobs: list[tuple[Task, list[str]]],
    settings: SweepSettings,
    done: Report,
    say: Say,
    should_stop: Callable[[], bool] = never,
    cache_root: Path | None = None,
) -> list[TaskResult]:
    """Ray tasks (``num_gpus=gpus_per_task``, ``max_retries=retries`` on a crash) on the cluster at
    ``address``, or on a local one started here (and shut down after).

    Where every node sees the driver's cache folder (:meth:`SweepSettings.shares_cache`), each
    task is ``isotui run --shard`` there (:func:`ray_task`): the shards meet in that folder and
    the last one merges. Where not (``shared_cache = false``; the default with an ``address``),
    each task measures with its node's own cache and returns its entry's bytes through Ray's
    object store (:func:`ray_state_task`), which the driver keeps in ``cache_root``: a run's
    first shard runs before the others, and the plan it fixed is sent with each of them; the
    driver merges (the sweep's last step, :func:`merged_result`). The code goes with the tasks
    (``runtime_env`` ``py_modules``); each node needs isotui's dependencies installed, and the
    models and data at the same paths (or hub ids in its own Hugging Face cache)."""
    ray = import_ray()
    quiet_ray_notices()
    shared = settings.shares_cache() or cache_root is None
    started = not ray.is_initialized()
    if started:
        if not settings.address:  # a local cluster's workers start from this process's environment
            os.environ["PYTHONPATH"] = task_env()["PYTHONPATH"]
        # the code goes with the tasks to a cluster's nodes (a local cluster's have PYTHONPATH)
        code = {"py_modules": [_package_dir()]} if settings.address or not shared else None
        try:
            ray.init(
                address=settings.address or None,
                include_dashboard=False,
                log_to_driver=False,  # a task's failure is said once, by the sweep
                logging_level="WARNING",
                runtime_env=code,
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise IsotuiError(f"cannot connect to the Ray cluster at {settings.address}: {exc}") from None
    try:
        options: dict[str, Any] = {
            "num_cpus": 1,
            "num_gpus": ray_gpus_per_task(settings.gpus_per_task, ray.cluster_resources()),
            "max_retries": settings.retries,
            "retry_exceptions": [TaskCrashed],
        }
        if shared:
            remote = ray.remote(ray_task).options(**options)
        else:
            remote = ray.remote(ray_state_task).options(**options, runtime_env=worker_runtime_env(settings))

        def submit(task: Task, argv: list[str], plan: dict[str, Any] | None) -> Any:
            if shared:
                return remote.remote(argv)
            return remote.remote(task.spec, task.index, task.count, plan)

        pending: dict[Any, Task] = {}
        # not shared: a run's first task -> the run's other tasks, sent once it has fixed the plan
        waiting: dict[Task, list[tuple[Task, list[str]]]] = {}
        for group in _by_run(jobs):
            first = group[0][0]
            plan = None
            if not shared and first.count > 1 and cache_root is not None:
                recorded = recorded_plan_of(cache_root, first)
                plan = recorded.to_json() if recorded is not None else None
                if recorded is None:  # its first shard fixes it, then the rest follow
                    pending[submit(first, group[0][1], None)] = first
                    waiting[first] = group[1:]
                    continue
            for task, argv in group:
                pending[submit(task, argv, plan)] = task
        results: list[TaskResult] = []

        def finish(result: TaskResult) -> None:
            done(result)
            results.append(result)

        try:
            while pending:
                if should_stop():  # nothing more starts, and the running ones are killed
                    _cancel_ray(ray, pending, results, done)
                    for task, _argv in (j for rest in waiting.values() for j in rest):
                        finish(TaskResult(task, False, NOT_STARTED, cancelled=True, started=False))
                    waiting.clear()
                    break
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=STOP_POLL_S)
                if not ready:
                    continue
                task = pending.pop(ready[0])
                plan = None
                try:
                    value = ray.get(ready[0])
                    if shared:
                        result = TaskResult(task, not value, value)
                    else:
                        assert cache_root is not None
                        result, plan = _keep(task, value, cache_root)
                    del value  # a state's bytes are not held while the next one comes
                except ray.exceptions.RayTaskError as exc:
                    cause = exc.cause if isinstance(getattr(exc, "cause", None), TaskCrashed) else None
                    text = cause.text if cause else str(exc).strip().splitlines()[-1]
                    result = TaskResult(
                        task, False, f"{text} ({settings.retries + 1} attempts)", crashed=True
                    )
                except ray.exceptions.RayError as exc:  # a worker or node lost beyond max_retries
                    result = TaskResult(
                        task, False, f"{type(exc).__name__}: {exc}".splitlines()[0], crashed=True
                    )
                finish(result)
                for later, argv in waiting.pop(task, []):
                    if result.ok:
                        pending[submit(later, argv, plan)] = later
                    else:  # the run's plan was not fixed: its other shards cannot follow one
                        finish(
                            TaskResult(
                                later,
                                False,
                                f"not run: {task.name}, which fixes the run's plan, failed",
                                crashed=result.crashed,
                            )
                        )
        except BaseException:  # an interrupt: the cluster's tasks of this sweep end too
            _cancel_ray(ray, pending, [], lambda _r: None)
            raise
        return results
    finally:
        if started:
            ray.shutdown()


def _package_dir() -> str:
    """This isotui's package folder: Ray's ``py_modules`` uploads it for the job's workers."""
    return str(Path(__file__).resolve().parent)


def worker_runtime_env(settings: SweepSettings) -> dict[str, Any]:
    """The task's ``runtime_env`` on a node without the driver's cache: the node's own cache
    folder (``ISOTUI_CACHE_DIR`` = ``worker_cache_dir``; unset: what the node's environment
    says, else its user's cache folder). (The code goes with the job's ``runtime_env``, set
    where the sweep connects to the cluster: Ray uploads a folder only for a whole job.)"""
    if not settings.worker_cache_dir:
        return {}
    return {"env_vars": {"ISOTUI_CACHE_DIR": settings.worker_cache_dir}}


def _by_run(jobs: list[tuple[Task, list[str]]]) -> list[list[tuple[Task, list[str]]]]:
    """The jobs grouped by run (model and shard count), in the sweep's order, each group by
    shard index."""
    groups: dict[tuple[str, int], list[tuple[Task, list[str]]]] = {}
    for job in jobs:
        groups.setdefault((job[0].model, job[0].count), []).append(job)
    return [sorted(g, key=lambda j: j[0].index) for g in groups.values()]


def recorded_plan_of(cache_root: Path, task: Task) -> Any:
    """The plan a run's shards already follow in the driver's cache (a resumed sweep), or None."""
    from isotui.experiments.shards import recorded_plan

    return recorded_plan(cache_root, task.key, task.count)


def _keep(task: Task, value: tuple[str, Any], cache_root: Path) -> tuple[TaskResult, dict[str, Any] | None]:
    """What a :func:`ray_state_task` returned, kept in the driver's cache: the task's result, and
    the run's plan for its later shards."""
    from isotui.experiments.shards import keep_from_worker

    status, body = value
    if status != "ok":
        return TaskResult(task, False, str(body)), None
    key, data = body
    if key != task.key:
        return (
            TaskResult(
                task,
                False,
                f"its Ray worker measured another run (key {key[:12]}, here {task.key[:12]}): the "
                "model or data differ on that node; every node needs them at the same paths",
            ),
            None,
        )
    try:
        plan = keep_from_worker(cache_root, key, task.index, task.count, data)
    except IsotuiError as exc:
        return TaskResult(task, False, str(exc), crashed=True), None
    return TaskResult(task, True), plan


def ray_gpus_per_task(gpus_per_task: float | None, resources: dict[str, float]) -> float:
    """Each Ray task's ``num_gpus``: ``gpus_per_task``, by default 1 on a cluster with GPUs
    (every task on a GPU of its own) and 0 without; one sentence when a task asks for more GPUs
    than the cluster has (Ray would queue it for ever)."""
    have = float(resources.get("GPU", 0.0))
    if gpus_per_task is None:
        return 1.0 if have >= 1 else 0.0
    if gpus_per_task > have:
        raise IsotuiError(
            f"[sweep] gpus_per_task = {gpus_per_task:g}, but the Ray cluster has {have:g} GPU"
            f"{'s' if have != 1 else ''}: no task could ever start"
        )
    return gpus_per_task


def _cancel_ray(ray: Any, pending: dict[Any, Task], results: list[TaskResult], done: Report) -> None:
    """Cancel every task of ``pending`` (queued or running: Ray kills a running one's worker)."""
    for ref, task in pending.items():
        with contextlib.suppress(Exception):  # ended meanwhile, or the cluster is gone
            ray.cancel(ref, force=True)
        results.append(
            TaskResult(task, False, "stopped: the sweep was stopped", cancelled=True, started=None)
        )
        done(results[-1])
    pending.clear()


# --- planning, running, collecting -------------------------------------------------------------------


def read_config(config: Path, given: Sequence[str] = ()) -> tuple[dict[str, Any], SweepSettings, list[str]]:
    """A sweep config's run settings, its checked ``[sweep]`` table and its runs (each model, or
    each of its checkpoints); ``given``: the config keys a command-line flag overrides."""
    from isotui.config import load_run_config

    settings = load_run_config(config, list(given))
    sweep = read_sweep(config, settings.get("sweep"))
    if sweep.executor == "ray":
        import_ray()  # not installed: say so before anything runs
        check_ray_address(f"config file {config}: [sweep]", sweep.address)  # nor one that hangs
    return settings, sweep, resolve_models(config, settings.get("models") or ["minilm"], sweep.checkpoints)


@dataclass
class Plan:
    """The sweep's runs and the tasks still to do (the rest answered from the cache)."""

    runs: list[str]
    tasks: list[Task]
    cached: int  # tasks whose run or shard is cached already
    shards: int = 1
    failed_early: list[tuple[str, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Every task of the sweep: to run, cached, and those of runs refused before they start."""
        return len(self.tasks) + self.cached + self.shards * len(self.failed_early)


def base_spec(config: Path, settings: dict[str, Any], model: str) -> Any:
    """The RunSpec ``isotui run CONFIG --model MODEL`` measures (``settings``: the run's, as the
    CLI reads them); a bad option is one sentence naming the config file."""
    from isotui.spec import given_options, make_spec

    if settings.get("shard") is not None:
        raise IsotuiError(f"config file {config}: shard is set by [sweep] shards; remove it")
    base_dir = settings.get("data_base_dir", settings.get("base_dir"))
    try:
        return make_spec(model, base_dir=base_dir, **given_options(settings))
    except IsotuiError as exc:
        raise IsotuiError(f"config file {config}: {exc}") from None


def plan(config: Path, settings: dict[str, Any], runs: list[str], shards: int, cache_root: Path) -> Plan:
    """Which (run, shard) tasks the cache does not answer yet. Each run's key comes from
    :func:`isotui.experiments.layer_pass.prepare` (cheap: names, data, no model load)."""
    from isotui.experiments import layer_pass
    from isotui.experiments.shards import check_shard_count, partial_runs
    from isotui.store.cache import ResultCache

    if len(runs) * shards > MAX_TASKS:
        raise IsotuiError(
            f"config file {config}: {len(runs)} run{'s' if len(runs) != 1 else ''} x [sweep] shards = "
            f"{shards} are {len(runs) * shards:,} tasks, more than a sweep runs ({MAX_TASKS:,}): use "
            "fewer shards, or split the sweep"
        )
    base = base_spec(config, settings, runs[0])
    cache = ResultCache(cache_root)
    partial = {(r.key, r.count): set(r.have) for r in partial_runs(cache_root)}
    out = Plan(runs, [], 0, shards)
    for model in runs:
        try:
            prepared = layer_pass.prepare(base.with_model(model), cache)
        except IsotuiError as exc:
            out.failed_early.append((model, str(exc)))
            continue
        if shards > 1:  # before any task starts: the check each task would make, once for all
            check_shard_count(
                len(prepared.samples), shards, f"config file {config}: [sweep] shards = {shards}"
            )
        if layer_pass.lookup(prepared, cache) is not None:
            out.cached += shards
            continue
        have = partial.get((prepared.key, shards), set()) if shards > 1 else set()
        out.cached += len(have)
        out.tasks += [
            Task(model, i, shards, prepared.spec, prepared.key) for i in range(shards) if i not in have
        ]
    return out


def execute(
    tasks: list[Task],
    sweep: SweepSettings,
    config: Path,
    cache_root: Path,
    done: Report,
    say: Say,
    should_stop: Callable[[], bool] = never,
) -> list[TaskResult]:
    """Run ``tasks`` with the sweep's executor, ``done`` told of each as it ends (a bar, a job's
    progress), ``say`` of each retry; every task's result."""
    cache_root.mkdir(parents=True, exist_ok=True)
    jobs = [(t, t.argv(config.resolve(), cache_root)) for t in tasks]
    if sweep.executor == "ray":
        return run_ray(jobs, sweep, done, say, should_stop, cache_root=cache_root)
    return run_local(jobs, sweep, done, say, should_stop)


@dataclass
class SweepResult:
    """A sweep run from the app: the merged result of every run whose tasks all succeeded."""

    name: str
    results: list[Any]  # ModelResult, in the config's order
    failed: list[str]  # the tasks (or runs refused before they started) that failed
    from_cache: bool  # no task had to run


@dataclass(frozen=True)
class SweepRequest:
    """A sweep as one backend job (the app's): its progress counts tasks, cancelling stops it
    (no task starts, the running ones are terminated), its result is a :class:`SweepResult`.
    The tasks write the app's cache (``cache_root``), so the runs are listed there after."""

    config: Path
    kind: str = "sweep"

    @property
    def model(self) -> str:  # what the jobs pane and notices name
        return self.config.stem

    @property
    def device(self) -> str:  # the backend's lane: sweeps queue behind each other, not behind runs
        return "sweep"

    def resolved_device(self) -> str:
        """What the jobs pane's device column says: the executor (``local`` or ``ray``)."""
        from isotui.config import load_run_config

        try:
            return read_sweep(self.config, load_run_config(self.config).get("sweep")).executor
        except IsotuiError:  # compute says it, in one sentence
            return "local"

    def lookup(self, cache_root: Path | None, notice: Callable[[str], None]) -> Any:
        return None  # the planning in compute asks the cache, run by run and shard by shard

    def compute(self, context: Context) -> SweepResult:
        from isotui.errors import Cancelled
        from isotui.extract.progress import Progress
        from isotui.paths import cache_dir

        cache_root, on_progress = context.cache_root, context.on_progress
        should_stop, notice = context.should_stop, context.notice

        settings, sweep, runs = read_config(self.config, ["cache_dir"] if cache_root else [])
        root = cache_root or cache_dir(settings.get("cache_dir"))
        todo = plan(self.config, settings, runs, sweep.shards, root)
        for model, text in todo.failed_early:
            notice(f"{Path(model).name}: {text}")
        started = time.monotonic()
        count = [todo.cached + sweep.shards * len(todo.failed_early)]

        def report() -> None:
            elapsed = time.monotonic() - started
            on_progress(Progress(count[0], todo.total, 0, elapsed, phase="running", detail="tasks"))

        def done(result: TaskResult) -> None:
            if not result.ok and not result.cancelled:
                notice(f"task {result.task.name} failed: {result.problem}")
            count[0] += 1
            report()

        report()
        results = execute(todo.tasks, sweep, self.config, root, done, notice, should_stop)
        if should_stop():
            raise Cancelled()
        failed = [r for r in results if not r.ok]
        lost = {r.task.model for r in failed} | {m for m, _ in todo.failed_early}
        merged = [
            m
            for m in (
                merged_result(self.config, settings, run, root, notice) for run in runs if run not in lost
            )
            if m
        ]
        names = [r.task.name for r in failed] + [Path(m).name for m, _ in todo.failed_early]
        return SweepResult(self.model, merged, names, from_cache=not todo.tasks)


def merged_result(
    config: Path, settings: dict[str, Any], model: str, cache_root: Path, notice: Callable[[str], None]
) -> Any:
    """The run's result once all its tasks are done: cached (the last shard merged) or merged
    now from its cached shards; None (said) if the cache has neither."""
    from isotui.experiments import layer_pass
    from isotui.experiments.shards import merge_cached
    from isotui.store.cache import ResultCache

    cache = ResultCache(cache_root)
    prepared = layer_pass.prepare(base_spec(config, settings, model), cache)
    found = layer_pass.lookup(prepared, cache, notice) or merge_cached(prepared, cache_root, on_notice=notice)
    if found is None:
        notice(f"{Path(model).name}: its tasks ended but the cache holds no result of it")
    return found
