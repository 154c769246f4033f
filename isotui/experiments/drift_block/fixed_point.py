"""N*: where the input and output mean-norm curves cross."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def fixed_point(
    norms: Sequence[float], in_norm: Sequence[float], out_norm: Sequence[float]
) -> tuple[float, str | None]:
    """N where the input and output mean-norm curves first cross (linear between sweep points).

    Returns (N*, note); N* is NaN, with a note saying why, when they do not cross.
    """
    x = np.asarray(norms, dtype=np.float64)
    d = np.asarray(in_norm, dtype=np.float64) - np.asarray(out_norm, dtype=np.float64)
    span = f"N in [{x[0]:g}, {x[-1]:g}]" if len(x) else "an empty sweep"
    crossings: list[float] = []
    for i in range(len(x)):
        if d[i] == 0 and (i == 0 or d[i - 1] != 0):
            crossings.append(float(x[i]))
        elif i + 1 < len(x) and d[i] * d[i + 1] < 0:
            crossings.append(float(x[i] + (x[i + 1] - x[i]) * d[i] / (d[i] - d[i + 1])))
    if not crossings:
        if len(x) and np.all(np.isfinite(d)):
            side = "below" if d[0] < 0 else "above"
            return math.nan, (
                f"the input and output mean norms do not cross for {span} (the input stays {side} "
                "the output); widen --norms to find N*"
            )
        return math.nan, f"N* is undefined for {span}"
    note = None
    if len(crossings) > 1:
        note = f"the mean norms cross {len(crossings)} times for {span}; N* is the first crossing"
    return crossings[0], note
