"""How far the reservoir metrics lie from their all-vectors values (``--exact``), in standard errors.

One run as usual and one with ``--exact`` (same model, corpus and reservoir), then per layer and
reservoir metric: the sampled value ± its SE, the exact value and |sampled - exact| / SE. Run it
under two checkouts to compare (``PYTHONPATH=CHECKOUT python benchmarks/sampled_vs_exact.py``).
docs/metrics.md quotes its summary; tests/test_docs_numbers.py checks the page against it.

    python benchmarks/sampled_vs_exact.py [--model minilm] [--samples 1000] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
from typing import NamedTuple


class Gap(NamedTuple):
    """One layer's reservoir metric: its value and SE, the all-vectors value, and |diff| / SE."""

    layer: int
    metric: str
    value: float
    se: float
    exact: float
    z: float


def compare(model: str = "minilm", samples: int = 1000, threads: int = 1) -> tuple[list[Gap], int]:
    """Every (layer, reservoir metric)'s gap, and the reservoir's size."""
    from isotui.core.sampled import SAMPLED
    from isotui.experiments.layerwise import measure
    from isotui.spec import make_spec

    kw = {"max_samples": samples, "threads": threads}
    plain = measure(make_spec(model, "builtin", **kw), None)
    exact = measure(make_spec(model, "builtin", exact=True, **kw), None)
    gaps = []
    for a, b in zip(plain.rows, exact.rows, strict=True):
        for name in SAMPLED:
            value, se, want = getattr(a, name), getattr(a, f"{name}_se"), getattr(b, name)
            gaps.append(
                Gap(a.layer, name, value, se, want, abs(value - want) / se if se > 0 else float("nan"))
            )
    return gaps, plain.rows[0].n_sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    gaps, n_sample = compare(args.model, args.samples, args.threads)
    print(f"model={args.model} samples={args.samples} load before={load}")
    print(f"{'layer':>5} {'metric':>17} {'sampled':>10} {'± SE':>9} {'exact':>10} {'|diff|/SE':>9}")
    for g in gaps:
        print(f"{g.layer:>5} {g.metric:>17} {g.value:10.4g} {g.se:9.2g} {g.exact:10.4g} {g.z:9.2f}")
    within, far = sum(g.z <= 1.5 for g in gaps), max(g.z for g in gaps)
    print(f"within 1.5 SE: {within} of {len(gaps)}; farthest {far:.2f} SE; n_sample={n_sample}")


if __name__ == "__main__":
    main()
