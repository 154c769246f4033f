"""The memory options' values: ``--device-map``'s choices, ``--max-memory``'s sizes (parsed,
and checked against this machine's GPUs) and the plan's fixed inputs (the token budget of a
batch, the token types self-similarity follows): read where the options are read (the app's
settings too) and by the planner alike, without the planner and its imports."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from isotui.errors import IsotuiError

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
MAX_MEMORY_FORM = "DEVICE=SIZE pairs such as 0=70GiB,1=70GiB,cpu=200GiB (devices: GPU numbers, cpu, disk)"


def parse_size(text: str) -> int | None:
    """``70GiB``, ``500MB``, ``1.5GB``, ``2048`` (bytes) -> bytes; None if it is no size."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_max_memory(value: Any) -> tuple[tuple[int | str, int], ...] | None:
    """``0=70GiB,1=70GiB,cpu=200GiB`` (or a dict from a config table or the Python API) ->
    ((0, bytes), (1, bytes), ("cpu", bytes)), as accelerate's ``max_memory`` keys them."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        pairs = [(str(k), str(v)) for k, v in value.items()]
    elif isinstance(value, tuple | list) and all(isinstance(p, tuple | list) and len(p) == 2 for p in value):
        pairs = [(str(k), str(v)) for k, v in value]
    else:
        pairs = [part.partition("=")[::2] for part in str(value).split(",") if part.strip()]
    out: dict[int | str, int] = {}
    for key, size in pairs:
        key = key.strip().lower().removeprefix("cuda:")
        if not (key.isdigit() or key in ("cpu", "disk", "mps")):
            raise IsotuiError(f"max-memory must be {MAX_MEMORY_FORM}: {key or '(nothing)'!r} is no device")
        amount = parse_size(size)
        if amount is None or amount <= 0:
            raise IsotuiError(f"max-memory must be {MAX_MEMORY_FORM}: {size.strip()!r} is no size for {key}")
        device = int(key) if key.isdigit() else key
        if device in out:  # cpu=1GiB,cpu=2GiB: which one was meant?
            raise IsotuiError(
                f"max-memory names {key} twice ({out[device]:,} and {amount:,} bytes); give each device once"
            )
        out[device] = amount
    if not out:
        raise IsotuiError(f"max-memory must be {MAX_MEMORY_FORM} (got nothing)")
    return tuple(out.items())


TOKEN_BUDGET = {"cpu": 4096, "mps": 8192, "cuda": 32768}  # padded input units per batch (auto)
SELF_SIM_TYPES = 1000  # token types followed for self-similarity (the most frequent ones)


def check_devices(max_memory: Sequence[tuple[int | str, int]] | None) -> None:
    """Refuse ``--max-memory`` for a GPU this machine does not have (a real run; a dry run plans
    for the devices it names)."""
    import torch

    if not max_memory:
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for key, _ in max_memory:
        if isinstance(key, int) and key >= count:
            have = f"GPUs 0 to {count - 1}" if count else "no CUDA GPU"
            raise IsotuiError(f"--max-memory gives memory to GPU {key}, but this machine has {have}")
        if key == "mps" and not torch.backends.mps.is_available():
            raise IsotuiError("--max-memory gives memory to mps, which this machine does not have")
