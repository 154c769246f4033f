"""Whole-process `isotui experiment drift-block` (the BERT-base default sizes) in two source trees,
alternating, as a ratio; and whether both give the same numbers for the same seed.

Issue 15's target: the BERT-base default at most 60 s per seed on a 2-core CPU. Each run is a
whole process (imports, the seed's draws, every N, the table) with `--no-cache`; the trees are
timed alternately so adjacent runs share the machine's load, and each pair records `uptime`'s
load averages and the threads. `--before` is another checkout (for example the main branch's
worktree); without it only this tree is timed. The JSON outputs of the two trees are compared
number by number (the largest relative difference is printed: 0 means bit for bit).

    python benchmarks/drift_block.py [--norms 0:30:31] [--seed 0] [--threads default]
                                     [--before /path/to/other/checkout] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from process import timed, uptime  # benchmarks/process.py: whole-process timing, load averages

ROOT = Path(__file__).resolve().parent.parent


def max_rel_diff(a: Any, b: Any) -> float:
    """The largest relative difference between two JSON documents' numbers (timings skipped);
    inf when their structure or any non-number differs."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return math.inf
        skip = ("seconds", "key", "keys", "versions", "created")
        return max((max_rel_diff(a[k], b[k]) for k in a if k not in skip), default=0.0)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return math.inf
        return max((max_rel_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    if isinstance(a, int | float) and isinstance(b, int | float):
        if (math.isnan(a) and math.isnan(b)) or a == b:
            return 0.0
        return abs(a - b) / max(abs(a), abs(b))
    return 0.0 if a == b else math.inf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--norms", default="0:30:31", help="drift-block's --norms (default: its own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", default="default", help="OMP_NUM_THREADS for both, or default")
    parser.add_argument("--before", type=Path, help="another checkout to time alternately")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    trees = {"this": ROOT} | ({"before": args.before.resolve()} if args.before else {})
    env = dict(os.environ)
    if args.threads != "default":
        env["OMP_NUM_THREADS"] = args.threads
    count = len(args.norms.split(",")) if ":" not in args.norms else int(args.norms.split(":")[2])
    print(
        f"drift-block BERT-base defaults, --norms {args.norms} ({count} N), seed {args.seed}, "
        f"threads {args.threads}, cores {os.cpu_count()}"
    )
    outputs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            load = uptime()
            row = []
            for name, tree in trees.items():
                out = Path(tmp) / f"{name}.json"
                argv = [
                    sys.executable,
                    "-m",
                    "isotui",
                    "experiment",
                    "drift-block",
                    "--norms",
                    args.norms,
                    "--seeds",
                    str(args.seed),
                    "--no-cache",
                    "--quiet",
                    "--json",
                    str(out),
                ]
                wall, cpu, _ = timed(argv, env | {"PYTHONPATH": str(tree)})
                outputs[name] = json.loads(out.read_text())
                row.append((name, wall, cpu))
            cells = "  ".join(
                f"{name}: {wall:.1f} s wall ({wall / count:.2f} s/N, {wall / count * 31:.0f} s per "
                f"31-N seed), {cpu:.1f} s CPU"
                for name, wall, cpu in row
            )
            ratio = f"  before/this {row[1][1] / row[0][1]:.2f}x" if len(row) > 1 else ""
            print(f"[{repeat}] load {load}  {cells}{ratio}")
    if "before" in outputs:
        print(
            f"largest relative difference between the trees' numbers: "
            f"{max_rel_diff(outputs['before'], outputs['this']):.3g}"
        )


if __name__ == "__main__":
    main()
