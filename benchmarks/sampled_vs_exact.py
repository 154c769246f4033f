"""How far the reservoir metrics lie from their all-vectors values (``--exact``), in standard errors.

One run as usual and one with ``--exact`` (same model, corpus and reservoir), then per layer and
reservoir metric: the sampled value ± its SE, the exact value and |sampled - exact| / SE. Run it
under two checkouts to compare (``PYTHONPATH=CHECKOUT python benchmarks/sampled_vs_exact.py``).

    python benchmarks/sampled_vs_exact.py [--model minilm] [--samples 1000] [--threads 1]
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from isotui.core.sampled import SAMPLED
    from isotui.experiments.layerwise import measure
    from isotui.spec import make_spec

    kw = {"max_samples": args.samples, "threads": args.threads}
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    plain = measure(make_spec(args.model, "builtin", **kw), None)
    exact = measure(make_spec(args.model, "builtin", exact=True, **kw), None)
    print(f"model={args.model} samples={args.samples} load before={load}")
    print(f"{'layer':>5} {'metric':>17} {'sampled':>10} {'± SE':>9} {'exact':>10} {'|diff|/SE':>9}")
    zs = []
    for a, b in zip(plain.rows, exact.rows, strict=True):
        for name in SAMPLED:
            value, se, want = getattr(a, name), getattr(a, f"{name}_se"), getattr(b, name)
            z = abs(value - want) / se if se > 0 else float("nan")
            zs.append(z)
            print(f"{a.layer:>5} {name:>17} {value:10.4g} {se:9.2g} {want:10.4g} {z:9.2f}")
    n = len(zs)
    within = sum(z <= 1.5 for z in zs)
    print(f"within 1.5 SE: {within} of {n}; farthest {max(zs):.2f} SE; n_sample={plain.rows[0].n_sample}")


if __name__ == "__main__":
    main()
