"""Device and dtype resolution. ``auto`` dtype needs torch only when the answer depends on it."""

from __future__ import annotations

import re
from typing import Any

from isotui.errors import IsotuiError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"), ("half", "float16"))
_HALF = ("bfloat16", "float16")


_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:[0-9]+)?)$")


def validate_device(device: str) -> str:
    """The device's form (no torch needed): auto, cpu, mps, cuda or cuda:N with N a number."""
    if not _DEVICE.match(device):
        raise IsotuiError(f"device {device!r} is not one of auto, cpu, cuda, cuda:N (N a GPU number) or mps")
    return device


def resolve_device(device: str) -> str:
    """``auto``: cuda, then mps, then cpu. An explicit device must exist."""
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        mps = getattr(torch.backends, "mps", None)
        return "mps" if mps is not None and mps.is_available() else "cpu"
    kind = device.split(":", 1)[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise IsotuiError(
            f"device {device!r} was asked for but this torch sees no CUDA GPU; use --device cpu"
        )
    if kind == "cuda" and ":" in device:
        index, count = int(device.split(":", 1)[1]), torch.cuda.device_count()
        if index >= count:
            raise IsotuiError(
                f"device {device!r} does not exist: this machine has {count} CUDA GPU(s), "
                f"cuda:0 to cuda:{count - 1}"
            )
    if kind == "mps" and not torch.backends.mps.is_available():
        raise IsotuiError("device 'mps' was asked for but it is not available here; use --device cpu")
    return device


def needs_device_for_dtype(dtype: str, declared: str | None) -> bool:
    """Whether resolving ``dtype`` needs to know the device (and so needs torch)."""
    return dtype == "auto" and declared in _HALF


def resolve_dtype(dtype: str, device_kind: str | None, declared: str | None) -> str:
    """``auto``: float32 on CPU (exact); on a GPU the checkpoint's own half dtype, if it has one.

    ``device_kind`` may be None only when :func:`needs_device_for_dtype` is False.
    """
    if dtype not in DTYPES:
        raise IsotuiError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype
    if declared in _HALF and device_kind not in (None, "cpu"):
        return declared
    return "float32"


def available_memory(device: str) -> int | None:
    """Bytes a job could still allocate on ``device``: free GPU memory, or on the CPU (Linux) the
    system's available RAM or what this process's cgroup memory limit leaves (a Slurm job's, a
    container's), whichever is less; None where it cannot be told."""
    import torch

    kind = device.split(":", 1)[0]
    if kind == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if kind != "cpu":
        return None
    from isotui.extract.cgroup import cgroup_memory_left

    system = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    system = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    limited = cgroup_memory_left()
    if system is None or limited is None:
        return limited if system is None else system
    return min(system, limited)


def memory_in_use(device: str) -> int:
    """Bytes in use for a job on ``device``: allocated GPU memory, or this process's RSS on CPU."""
    import torch

    kind = device.split(":", 1)[0]
    if kind == "cuda":
        return int(torch.cuda.memory_allocated(device))
    if kind == "mps":
        return int(torch.mps.current_allocated_memory())
    return process_rss()


def fixed_cost() -> int:
    """What this process holds resident before any model is loaded: Python, torch and
    transformers' model code (imported here if not yet: loading imports them anyway), the same
    point in a dry run and a run. Outside every plan and ``--max-memory``; stated beside them."""
    import torch  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    return process_rss()


def process_rss() -> int:
    """Resident memory of this process (Linux: current, elsewhere: peak), in bytes."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


PINNED_ON_CPU = False  # tests: the GPU's staging through pinned memory, traced on the CPU


def to_device(t: Any, device: Any) -> Any:
    """A host tensor on ``device`` without waiting for it (issue 26): a copy from pageable memory
    to a GPU waits until the GPU has done everything queued before it, so the tensor is staged in
    pinned memory and copied non-blocking (the pinned block is not reused before the copy ran);
    a tensor already there, or a CPU target, as it is."""
    import torch

    dev = torch.device(device)
    if t.device == dev and not PINNED_ON_CPU:
        return t
    if t.device.type == "cpu" and (dev.type == "cuda" or PINNED_ON_CPU):
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)
