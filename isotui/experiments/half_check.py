"""How far a half-precision run's numbers are from float32's: the same first samples run in the
run's half dtype and in float32, the largest relative change per metric over the layers.

isotui's own sums are float64 whatever the model's dtype (every metric equals float64 on the
same half-precision states to ~1e-14); what moves the numbers is the model's forward in bf16 or
fp16 (issue 28's audit, MiniLM in bf16: avg_cos 0.3%, avg_cos_centered 3.7%, I(W) 1.8%). A
half-precision layer run measures it on :data:`CHECK_SAMPLES` samples and says it in its notes and
JSON (``half_check``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from isotui.errors import Cancelled, IsotuiError

if TYPE_CHECKING:
    from isotui.results import ModelResult
    from isotui.spec import RunSpec

HALF_DTYPES = ("bfloat16", "float16")
CHECK_SAMPLES = 32
SHOWN = 4  # metrics named in the note (the JSON has them all)


def max_changes(half: ModelResult, full: ModelResult) -> dict[str, float]:
    """Per metric, the largest |half - float32| / |float32| over the layers both have."""
    from isotui.results import LAYER_METRICS

    out: dict[str, float] = {}
    for name in LAYER_METRICS:
        worst = -1.0
        for a, b in zip(half.rows, full.rows, strict=True):
            x, y = getattr(a, name), getattr(b, name)
            if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
                continue
            worst = max(worst, abs(x - y) / max(abs(y), 1e-12))
        if worst >= 0:
            out[name] = worst
    return out


def too_large(spec: RunSpec, weights: int, device: str | None) -> str:
    """Why the float32 copy is not tried ('' when it is): a model placed across devices, or one
    whose float32 weights (twice the half ones) would not fit in what ``device`` has free. Loading
    a 70B model again in float32 would offload it to disk for hours, or get the process killed."""
    from isotui.extract.device import available_memory

    if spec.device_map is not None:
        return "the model is placed across devices (--device-map): its float32 copy is not loaded"
    free = available_memory(device) if device else None
    if free is not None and 2 * weights > 0.9 * free:
        return (
            f"its float32 weights ({2 * weights / 1e9:.1f} GB) would not fit in the "
            f"{free / 1e9:.1f} GB {device} has free"
        )
    return ""


def half_check(
    spec: RunSpec, dtype: str, n_samples: int, weights: int = 0, device: str | None = None
) -> dict[str, Any]:
    """Run the first samples in ``dtype`` and in float32 (no cache) and compare, when the float32
    copy fits (:func:`too_large`; ``weights``: the half model's bytes). A float32 run that does
    not fit (out of memory, or any refusal) is reported, never fatal."""
    from isotui.experiments.layerwise import compute, prepare

    k = min(CHECK_SAMPLES, n_samples)
    small = replace(spec, max_samples=k, exact=False, shard=None)
    check: dict[str, Any] = {"dtype": dtype, "samples": k}
    if why := too_large(spec, weights, device):
        check["skipped"] = why
        return check
    try:
        half = compute(prepare(replace(small, dtype=dtype)))
        full = compute(prepare(replace(small, dtype="float32")))
    except (KeyboardInterrupt, Cancelled):
        raise
    except (IsotuiError, RuntimeError, MemoryError) as exc:  # torch's out-of-memory is a RuntimeError
        check["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return check
    check["max_rel_change"] = max_changes(half, full)
    return check


def note(check: dict[str, Any]) -> str:
    """The check in one sentence, with what a paper should use."""
    dtype, k = check["dtype"], check["samples"]
    if "skipped" in check:
        return (
            f"{dtype}: the float32 comparison on {k} samples did not run ({check['skipped']}); half "
            "precision moves the numbers by up to a few percent (docs: Run options): for a paper use "
            "--dtype float32"
        )
    changes = sorted(check["max_rel_change"].items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{name} {value:.2%}" for name, value in changes[:SHOWN])
    return (
        f"{dtype} forward: on the first {k} samples float32 differs by up to {shown} (largest first; "
        "half_check in the JSON has every metric); isotui's sums are float64 either way, the change "
        "is the model's forward: for a paper use --dtype float32"
    )
