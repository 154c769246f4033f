"""How far a half-precision run's numbers are from float32's: the run's samples (or its first
:data:`CHECK_MAX`) run in float32 too, and per metric the largest change over the layers, relative
and in units of the run's own standard error where the metric has one.

isotui's own sums are float64 whatever the model's dtype (every metric equals float64 on the
same half-precision states to ~1e-14); what moves the numbers is the model's forward in bf16 or
fp16. A subset is a poor guide for the centred metrics: on MiniLM (120 samples, bf16) the first 32
samples said 8.4% for centred I(W) where the run moved 1.3%, and 0.7% for all-but-the-top where it
moved 5.9% (issue 37). So a run of up to :data:`CHECK_MAX` samples is checked on all of them, with
the run itself as the half side (one float32 pass more); a longer one on its first
:data:`CHECK_MAX`, and the note says that this is a subset. Half precision also makes the numbers
depend on the batch (its size and padding change the half-precision forward); float32's do not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, NotRequired, TypedDict, cast

from isotui.errors import Cancelled, IsotuiError

if TYPE_CHECKING:
    from isotui.results import ModelResult
    from isotui.spec import RunSpec

HALF_DTYPES = ("bfloat16", "float16")
CHECK_MAX = 128  # samples checked: all of a run up to this many, else its first this many
SHOWN = 4  # metrics named in the note (the JSON has them all)
NEAR_ZERO = 1e-3  # a value this small changes by an absolute amount, not a relative one


def checked_metrics() -> tuple[str, ...]:
    """Every metric of the layer table: the plotted ones and the top rogue dimension's share."""
    from isotui.results import LAYER_METRICS

    return (*LAYER_METRICS, "top_rogue_share")


class HalfCheck(TypedDict):
    """The half-precision check of a run (its metadata's ``half_check``): the dtype, the samples
    compared, and per metric the largest changes (or why it was skipped)."""

    dtype: str
    samples: int
    of_samples: NotRequired[int]  # absent from entries cached before it was said
    skipped: NotRequired[str]
    max_rel_change: NotRequired[dict[str, float]]
    max_abs_change: NotRequired[dict[str, float]]
    max_se_change: NotRequired[dict[str, float]]
    near_zero: NotRequired[list[str]]


def changes(half: ModelResult, full: ModelResult) -> dict[str, dict[str, float]]:
    """Per metric, the largest change over the layers both have: ``max_rel_change`` |half -
    float32| / |float32|, ``max_abs_change`` |half - float32|, and for a metric with a standard
    error ``max_se_change`` |half - float32| in units of the half run's own SE (its sampling noise:
    under 1 SE is within it; layers whose SE is 0, every vector kept, left out)."""
    from isotui.results import METRIC

    out: dict[str, dict[str, float]] = {"max_rel_change": {}, "max_abs_change": {}, "max_se_change": {}}
    for name in checked_metrics():
        se = METRIC[name].se if name in METRIC else None
        for a, b in zip(half.rows, full.rows, strict=True):
            x, y = getattr(a, name), getattr(b, name)
            if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
                continue
            seen = {
                "max_rel_change": abs(x - y) / max(abs(y), 1e-12),
                "max_abs_change": abs(x - y),
            }
            if se and math.isfinite(getattr(a, se)) and getattr(a, se) > 0:
                seen["max_se_change"] = abs(x - y) / getattr(a, se)
            for kind, value in seen.items():
                out[kind][name] = max(out[kind].get(name, 0.0), value)
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
    measure: Callable[[RunSpec], ModelResult],
    spec: RunSpec,
    dtype: str,
    n_samples: int,
    weights: int = 0,
    device: str | None = None,
    run: ModelResult | None = None,
) -> HalfCheck:
    """Run the samples in float32 (no cache) and compare with ``run``, the half-precision run
    itself, when it has at most :data:`CHECK_MAX` samples; else run the first ones in ``dtype``
    and in float32. Only when the float32 copy fits (:func:`too_large`; ``weights``: the half
    model's bytes). A float32 run that does not fit (out of memory, or any refusal) is reported,
    never fatal. ``measure``: the layer run of a spec, uncached (the layer run hands itself in:
    this check is one of its steps, below it)."""
    k = min(CHECK_MAX, n_samples)
    small = replace(spec, max_samples=k, exact=False, shard=None)
    check: HalfCheck = {"dtype": dtype, "samples": k, "of_samples": n_samples}
    if why := too_large(spec, weights, device):
        check["skipped"] = why
        return check
    try:
        whole = k == n_samples and not spec.exact
        half = run if run is not None and whole else measure(replace(small, dtype=dtype))
        full = measure(replace(small, dtype="float32"))
    except (KeyboardInterrupt, Cancelled):
        raise
    except (IsotuiError, RuntimeError, MemoryError) as exc:  # torch's out-of-memory is a RuntimeError
        check["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return check
    check |= cast("HalfCheck", changes(half, full))  # only its max_*_change keys: what |= adds
    near_zero = [m for m in check["max_abs_change"] if all(abs(getattr(r, m)) < NEAR_ZERO for r in full.rows)]
    check["near_zero"] = near_zero
    return check


def _change(check: HalfCheck, name: str) -> str:
    """One metric's change in its own terms: relative (absolute for a value near 0), and in units
    of the run's standard error where it has one."""
    if name in check.get("near_zero", ()):
        amount = f"{check['max_abs_change'][name]:.1g} absolute"
    else:
        amount = f"{check['max_rel_change'][name]:.2%}"
    se = check.get("max_se_change", {}).get(name)
    return f"{name} {amount}" + (f" ({se:.1f} SE)" if se is not None else "")


def _rank(check: HalfCheck, name: str) -> float:
    """Where a metric's change ranks: its relative change; a metric near 0, whose relative change
    means nothing, by its change in SE units, 1 SE ranking with a 1% change."""
    if name in check.get("near_zero", ()):
        return float(check.get("max_se_change", {}).get(name, 0.0)) * 0.01
    return float(check["max_rel_change"][name])


def note(check: HalfCheck) -> str:
    """The check in one sentence, with what a paper should use."""
    dtype, k = check["dtype"], check["samples"]
    n = check.get("of_samples", k)
    if "skipped" in check:
        return (
            f"{dtype}: the float32 comparison on {k} samples did not run ({check['skipped']}); half "
            "precision moves the numbers by up to a few percent (docs: Run options): for a paper use "
            "--dtype float32"
        )
    if "max_abs_change" in check:
        names = sorted(check["max_rel_change"], key=lambda m: -_rank(check, m))
        shown = ", ".join(_change(check, name) for name in names[:SHOWN])
    else:  # a cached entry from before the changes were said in SE units
        changes = sorted(check["max_rel_change"].items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{name} {value:.2%}" for name, value in changes[:SHOWN])
    where = f"on all {k} samples"
    if k < n:
        where = f"on the first {k} of {n} samples (a subset: the run's change can differ several-fold)"
    return (
        f"{dtype} forward: {where} float32 differs by up to {shown} (largest first; half_check in "
        "the JSON has every metric); half precision also makes the numbers depend on the batch "
        "size and padding; isotui's sums are float64 either way, the change is the model's "
        "forward: for a paper use --dtype float32"
    )
