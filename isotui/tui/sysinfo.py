"""What the header says about the machine: GPU names, free memory, how busy each GPU is and what
isotui's own processes use on it, without importing torch.

NVML (the ``nvidia-ml-py`` package, module ``pynvml``: ``pip install 'isotui[gpu]'``) answers in
microseconds and gives per-process memory and utilisation; without it (or when the driver's
library cannot be loaded) ``nvidia-smi`` gives names and free memory. Either works before (and
without) torch; importing torch just to name the GPU would cost seconds of startup. Neither:
CPU (or Apple MPS).
"""

from __future__ import annotations

import contextlib
import platform
import shutil
import subprocess
import time
from collections.abc import Collection
from dataclasses import dataclass
from types import ModuleType
from typing import Any

MIB = 1024 * 1024
UTIL_WINDOW_S = 15.0  # per-process utilisation: the newest NVML sample of this window (>= the refresh)


@dataclass(frozen=True)
class GpuProcess:
    """One process on a GPU: its memory (None where the driver does not say, e.g. WDDM) and its
    share of the GPU's streaming multiprocessors in the last sample (None: no recent sample)."""

    pid: int
    used_mib: int | None
    sm_percent: int | None = None


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    free_mib: int
    total_mib: int
    util_percent: int | None = None  # NVML only: the GPU's utilisation
    processes: tuple[GpuProcess, ...] | None = None  # NVML only (None: not known)


def query_gpus(timeout_s: float = 3.0) -> list[Gpu]:
    """NVIDIA GPUs from NVML, else from ``nvidia-smi``; empty when there is none or both fail."""
    gpus = query_gpus_nvml()
    return gpus if gpus is not None else query_gpus_smi(timeout_s)


def _nvml_errors(nvml: ModuleType) -> tuple[type[BaseException], ...]:
    """What a pynvml call raises when the driver cannot answer: NVMLError (and its per-code
    subclasses), the library/driver version mismatch, or a function this pynvml lacks."""
    mismatch = getattr(nvml, "NVMLLibraryMismatchError", nvml.NVMLError)
    return (nvml.NVMLError, mismatch, OSError, AttributeError)


def query_gpus_nvml() -> list[Gpu] | None:
    """Every GPU with its utilisation and compute processes from NVML; None when pynvml is not
    installed or NVML cannot start (no driver library, no permission), so the caller falls back."""
    try:
        import pynvml as nvml
    except ImportError:
        return None
    errors = _nvml_errors(nvml)
    try:
        nvml.nvmlInit()
    except errors:
        return None
    try:
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                Gpu(
                    index,
                    _text(nvml.nvmlDeviceGetName(handle)),
                    int(memory.free) // MIB,
                    int(memory.total) // MIB,
                    _optional(errors, lambda h=handle: int(nvml.nvmlDeviceGetUtilizationRates(h).gpu)),
                    _processes(nvml, handle, errors),
                )
            )
        return gpus
    except errors:
        return None
    finally:
        with contextlib.suppress(*errors):
            nvml.nvmlShutdown()


def _text(name: Any) -> str:
    """pynvml gives ``str`` (older releases ``bytes``)."""
    return name.decode() if isinstance(name, bytes) else str(name)


def _optional(errors: tuple[type[BaseException], ...], get: Any) -> Any:
    """A reading some GPUs do not support (NVML_ERROR_NOT_SUPPORTED): None, the rest still shown."""
    try:
        return get()
    except errors:
        return None


def _processes(
    nvml: ModuleType, handle: Any, errors: tuple[type[BaseException], ...]
) -> tuple[GpuProcess, ...] | None:
    """The GPU's compute processes with their memory, and each one's newest SM utilisation sample
    (NVML raises NOT_FOUND when no process ran in the window: no percentages then)."""
    running = _optional(errors, lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    if running is None:
        return None
    since_us = int((time.time() - UTIL_WINDOW_S) * 1e6)
    samples = _optional(errors, lambda: nvml.nvmlDeviceGetProcessUtilization(handle, since_us)) or []
    newest: dict[int, Any] = {}
    for s in samples:
        if s.pid not in newest or s.timeStamp > newest[s.pid].timeStamp:
            newest[s.pid] = s
    out = []
    for p in running:
        used = p.usedGpuMemory
        sample = newest.get(p.pid)
        out.append(
            GpuProcess(
                int(p.pid),
                None if used is None else int(used) // MIB,
                None if sample is None else int(sample.smUtil),
            )
        )
    return tuple(out)


def query_gpus_smi(timeout_s: float = 3.0) -> list[Gpu]:
    """NVIDIA GPUs as ``nvidia-smi`` sees them; empty when there is none or it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.free,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            try:
                gpus.append(Gpu(int(parts[0]), parts[1], int(parts[2]), int(parts[3])))
            except ValueError:
                continue
    return gpus


def _gib(mib: int) -> str:
    return f"{mib / 1024:.1f} GiB"


def _usage(gpu: Gpu, own_pids: Collection[int]) -> str:
    """``, 35% busy; isotui 3.1 GiB 30%, 2 others 5.2 GiB``: what NVML adds to the line."""
    text = "" if gpu.util_percent is None else f", {gpu.util_percent}% busy"
    if gpu.processes is None:
        return text
    ours = [p for p in gpu.processes if p.pid in own_pids]
    others = [p for p in gpu.processes if p.pid not in own_pids]
    parts = []
    if ours:
        part = "isotui " + _gib(sum(p.used_mib or 0 for p in ours))
        sm = [p.sm_percent for p in ours if p.sm_percent is not None]
        parts.append(part + (f" {sum(sm)}%" if sm else ""))
    if others:
        n = len(others)
        parts.append(f"{n} other{'s' * (n != 1)} {_gib(sum(p.used_mib or 0 for p in others))}")
    return text + ("; " + ", ".join(parts) if parts else "")


def describe_devices(gpus: list[Gpu], own_pids: Collection[int] = ()) -> str:
    """``cuda:0 NVIDIA H100 (71.2/79.6 GiB free, 35% busy; isotui 3.1 GiB 30%)``, or the CPU line
    when there is no GPU. ``own_pids``: the app and its workers, told apart from other users."""
    if gpus:
        return "  ".join(
            f"cuda:{g.index} {g.name} ({g.free_mib / 1024:.1f}/{g.total_mib / 1024:.1f} GiB free"
            f"{_usage(g, own_pids)})"
            for g in gpus
        )
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return "mps (Apple GPU) / cpu"
    return "cpu (no GPU found)"
