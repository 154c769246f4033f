"""What the header says about the machine: GPU names and free memory, without importing torch.

``nvidia-smi`` answers in a few milliseconds and works before (and without) torch; importing
torch just to name the GPU would cost seconds of startup. No ``nvidia-smi``: CPU (or Apple MPS).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    free_mib: int
    total_mib: int


def query_gpus(timeout_s: float = 3.0) -> list[Gpu]:
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


def describe_devices(gpus: list[Gpu]) -> str:
    """``cuda:0 NVIDIA H100 (71.2/79.6 GiB free)``, or the CPU line when there is no GPU."""
    if gpus:
        return "  ".join(
            f"cuda:{g.index} {g.name} ({g.free_mib / 1024:.1f}/{g.total_mib / 1024:.1f} GiB free)"
            for g in gpus
        )
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return "mps (Apple GPU) / cpu"
    return "cpu (no GPU found)"
