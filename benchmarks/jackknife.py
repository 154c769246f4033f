"""CPU seconds of one layer's jackknife standard errors of I(W), centred I(W) and all-but-the-top.

The reservoir (4,096 vectors of d = 384: MiniLM's) in float64, torch at one thread, G = 8 groups;
CPU seconds (``time.process_time``), which a loaded machine moves less than the wall clock. Run
it under two checkouts to compare (``PYTHONPATH=CHECKOUT python benchmarks/jackknife.py``).

    python benchmarks/jackknife.py [--vectors 4096] [--dim 384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vectors", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from isotui.core.sampled import eigen_jackknife_se, key_groups

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    scales = torch.linspace(1.5, 0.5, args.dim, dtype=torch.float64)
    x = torch.randn(args.vectors, args.dim, generator=gen, dtype=torch.float64) * scales + 0.5
    centred = x - x.mean(0)
    parts = key_groups(torch.rand(args.vectors, generator=gen))
    assert parts is not None
    eigen_jackknife_se(x, centred, parts)  # warm-up: first-call allocations
    times = []
    for _ in range(args.repeats):
        start = time.process_time()
        se = eigen_jackknife_se(x, centred, parts)
        times.append(time.process_time() - start)
    print(f"vectors={args.vectors} dim={args.dim} threads=1 load={os.getloadavg()[0]:.2f}")
    print(f"jackknife CPU s: best {min(times):.3f}, all {', '.join(f'{t:.3f}' for t in times)}")
    print("SEs:", ", ".join(f"{k}={v:.6g}" for k, v in se.items()))


if __name__ == "__main__":
    main()
