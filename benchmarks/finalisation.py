"""Finalisation time per layer, from the exact covariance (issue 15) against another checkout.

Part 1, per d: one layer's accumulator (exact d x d sums, a full 4,096-vector reservoir) fed
5,000 random anisotropic vectors around a common mean (float32, as a model gives them), then
``finalize()`` timed (wall and CPU seconds, best of ``--repeats``). Each (checkout, d) runs in a
process of its own with that checkout first on PYTHONPATH, the checkouts alternating per d so they
share the machine's load. Part 2: the finalisation share of a whole
``isotui run -m minilm --max-samples 2000`` (its own forward and finalise timings) per checkout.
Every row records `uptime`'s load and the threads.

On paper, d = 8,192 (not run here): two float64 syevd of 8,192^2, about 4.7 d^3 = 2.6e12 flop each
(tridiagonal reduction 4/3 d^3, half of it memory-bound; back-transformation 2 d^3; divide and
conquer) plus the reservoir's projections, 2 K d^2 = 5.5e11 flop each. An A100 (9.7 TFLOP/s
float64, 1.5 TB/s): about 1-2 s per eigh, 3-5 s per layer; a GPU with 1/64-rate float64 (an RTX
4090's 1.3 TFLOP/s): about 5-10 s per eigh, 10-20 s per layer; this CPU at one thread (eigh of
2,048^2 takes 2.7 s, times 64): about 3 minutes per eigh. The device holds the d x d sum, X^T X,
the scatter and two eigenvector matrices (512 MiB each) plus the solver's workspace: about 3.5 GiB
while one layer is finalised.

Make the "before" checkout from the parent commit without touching the repository's worktrees:
``mkdir /tmp/before && git archive main isotui | tar -x -C /tmp/before``.

    python benchmarks/finalisation.py --before /tmp/before [--dims 256,512,1024,2048,4096]
                                      [--threads 1] [--repeats 1] [--run-samples 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys, time
import torch
import isotui
from isotui.core.accumulator import LayerAccumulator, sample_keys
d, n, threads, repeats = (int(a) for a in sys.argv[1:5])
torch.set_num_threads(threads)
gen = torch.Generator().manual_seed(d)
scales = torch.logspace(0, -2, d, dtype=torch.float64)
mean = torch.randn(d, generator=gen, dtype=torch.float64) * 2
best_wall = best_cpu = float("inf")
for _ in range(repeats):
    acc = LayerAccumulator(d, torch.device("cpu"), full_cov=True, reservoir=4096)
    for start in range(0, n, 500):
        rows = torch.arange(start, min(start + 500, n))
        x = (torch.randn(len(rows), d, generator=gen, dtype=torch.float64) * scales + mean).float()
        ids = rows // 25 - start // 25
        acc.commit(acc.partial(x, ids, sample_keys(0, rows // 25, rows % 25)))
    wall, cpu = time.perf_counter(), time.process_time()
    stats = acc.finalize()
    best_wall = min(best_wall, time.perf_counter() - wall)
    best_cpu = min(best_cpu, time.process_time() - cpu)
print(json.dumps({"wall": best_wall, "cpu": best_cpu, "module": isotui.__file__}))
"""


def uptime() -> str:
    """`uptime`'s load averages (1, 5, 15 minutes)."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def env_for(checkout: Path, threads: int) -> dict[str, str]:
    """The checkout first on the path (the child also runs in it: ``-c`` and ``-m`` put the working
    directory before PYTHONPATH)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(checkout)
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def layer(checkout: Path, d: int, n: int, threads: int, repeats: int) -> dict[str, float]:
    argv = [sys.executable, "-c", CHILD, str(d), str(n), str(threads), str(repeats)]
    env = env_for(checkout, threads)
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=checkout, check=False)
    if proc.returncode != 0:
        sys.exit(f"d={d} under {checkout} failed:\n{proc.stderr}")
    got = dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    if not Path(got["module"]).resolve().is_relative_to(checkout):
        sys.exit(f"d={d}: imported {got['module']}, not the checkout {checkout}")
    return got


def whole_run(checkout: Path, samples: int, threads: int) -> dict[str, float]:
    """A whole `isotui run` (no cache) under ``checkout``: its timings from the JSON's meta."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        env = env_for(checkout, threads) | {"ISOTUI_CACHE_DIR": str(Path(tmp) / "cache")}
        argv = [sys.executable, "-m", "isotui", "run", "-m", "minilm", "--max-samples", str(samples)]
        argv += ["--no-cache", "-q", "--json", str(out), "--threads", str(threads)]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=checkout, check=False)
        if proc.returncode != 0:
            sys.exit(f"isotui run under {checkout} failed:\n{proc.stderr}")
        doc = json.loads(out.read_text(encoding="utf-8"))
    meta = doc["results"][0]["meta"] if "results" in doc else doc["meta"]
    return dict(meta["timings"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the checkout to compare with")
    parser.add_argument("--after", type=Path, default=ROOT, help="default: this checkout")
    parser.add_argument("--dims", default="256,512,1024,2048,4096")
    parser.add_argument("--vectors", type=int, default=5000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--run-samples", type=int, default=2000, help="0: skip the whole run")
    args = parser.parse_args()

    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    print(f"before={checkouts['before']} after={checkouts['after']} threads={args.threads}")
    print(f"one layer: {args.vectors:,} vectors, exact d x d sums, reservoir 4,096; best of {args.repeats}")
    head = f"{'d':>5} {'load':>16} {'before s':>9} {'after s':>8} {'speed-up':>8}"
    print(f"{head} {'before cpu':>10} {'after cpu':>9} {'speed-up':>8}")
    for d in (int(v) for v in args.dims.split(",")):
        load = uptime()
        got = {k: layer(path, d, args.vectors, args.threads, args.repeats) for k, path in checkouts.items()}
        b, a = got["before"], got["after"]
        print(
            f"{d:>5} {load:>16} {b['wall']:9.2f} {a['wall']:8.2f} {b['wall'] / a['wall']:7.1f}x "
            f"{b['cpu']:10.2f} {a['cpu']:9.2f} {b['cpu'] / a['cpu']:7.1f}x",
            flush=True,
        )
    if args.run_samples:
        print(f"\nisotui run -m minilm --max-samples {args.run_samples} --threads {args.threads} (no cache)")
        print(f"{'':>7} {'load':>16} {'forward s':>9} {'finalise s':>10} {'share':>6}")
        for name, path in checkouts.items():
            load = uptime()
            t = whole_run(path, args.run_samples, args.threads)
            share = t["finalise_s"] / t["forward_s"]
            row = f"{name:>7} {load:>16} {t['forward_s']:9.2f} {t['finalise_s']:10.2f}"
            print(f"{row} {share:6.1%}", flush=True)
        print("target (issue 15): finalisation <= 10% of the forward")


if __name__ == "__main__":
    main()
