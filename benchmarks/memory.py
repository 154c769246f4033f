"""isotui's streaming pass vs the plain way papers use (keep every hidden state, then compute).

Each measurement runs in its own process, so peak memory (ru_maxrss) is not shared.
1. Speed at equal n (500 samples): plain = keep all hidden states, then all-pairs cosine by
   blocked U U^T, drift, mean norm and covariance eigenvalues; ours = the full metric set.
2. Peak memory from 500 to 5,000 samples: ours (fixed-size accumulators) against the plain way
   (its keep-everything phase plus O(n d) metrics; its O(n^2) step adds time only) and against
   the bare forward loop with no metrics at all, which shows the CPU heap's own creep.
3. ``--process``: the whole ``isotui run`` process's peak RSS (its own ``ru_maxrss``, from
   ``wait4``) at 300 and 2,100 samples, for each code tree given (``--code DIR``, e.g. main's
   and a branch's worktree: run alternately, with ``uptime``'s load), and the ratio 2,100 / 300
   (issue 15: <= 1.05); beside them the bare forward (benchmarks/bare_forward.py) over the same
   samples, same threads, so what grows in the forward alone is told from what isotui adds.

    python benchmarks/memory.py [--model minilm] [--max-length 128]
    python benchmarks/memory.py --process [--code DIR ...] [--repeats 2] [--threads N]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _corpus(n: int, path: Path) -> None:
    from isotui.data.sources import load_samples, parse_data

    base = load_samples(parse_data("builtin"))
    pairs = [f"{a} {b}" for a, b in itertools.pairwise(base)]
    mixed = base + pairs
    random.Random(0).shuffle(mixed)  # the first 500 have the same length mix as the first 5,000
    path.write_text("\n".join(mixed[:n]) + "\n", encoding="utf-8")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(mode: str, n: int, path: Path, model: str, max_length: int, pairs: bool) -> dict:
    import numpy as np
    import torch

    from isotui.data.sources import load_samples, parse_data
    from isotui.extract.loop import BatchLoop
    from isotui.extract.runner import ExtractOptions, extract
    from isotui.models.loading import load_model
    from isotui.models.naming import parse_model

    samples = load_samples(parse_data(f"text:{path}"), n)
    loaded = load_model(parse_model(model), device="cpu", dtype="float32", seed=0, trust_remote_code=False)
    opts = ExtractOptions(max_length=max_length)
    base_rss = _rss_mb()
    start = time.perf_counter()
    if mode == "ours":
        ex = extract(loaded, samples, device="cpu", opts=opts)
        avg = [layer.avg_cos for layer in ex.layers]
    elif mode == "bare":  # the forward loop alone: what the allocator does without any metric
        loop = BatchLoop(loaded, "cpu", opts)
        loop.prepare(samples, "text", max_length)
        for idx in loop.batches():
            with torch.inference_mode():
                loaded.model(**loop.batch(idx).inputs, output_hidden_states=True)
        avg = []
    else:
        loop = BatchLoop(loaded, "cpu", opts)
        loop.prepare(samples, "text", max_length)
        kept: list[list[np.ndarray]] | None = None
        for idx in loop.batches():
            batch = loop.batch(idx)
            keep = batch.fed.valid & ~batch.fed.special
            with torch.inference_mode():
                hs = loaded.model(**batch.inputs, output_hidden_states=True).hidden_states
            kept = kept or [[] for _ in hs]
            for layer, h in enumerate(hs):
                kept[layer].append(h[keep].numpy().copy())
        avg = []
        for chunks in kept:
            x = np.concatenate(chunks).astype(np.float64)
            u = x / np.linalg.norm(x, axis=1, keepdims=True)
            if pairs:  # all pairs, blocked, as an exact plain script would
                total = sum(float((u[i : i + 2048] @ u.T).sum()) for i in range(0, len(u), 2048))
            else:
                total = float(u.sum(0) @ u.sum(0))
            avg.append((total - len(u)) / (len(u) * (len(u) - 1)))
            np.linalg.norm(x.mean(0)), np.linalg.norm(x, axis=1).mean()
            np.linalg.eigvalsh(np.cov(x, rowvar=False))
    return {"seconds": time.perf_counter() - start, "peak_mb": _rss_mb(), "base_mb": base_rss, "avg_cos": avg}


def _measure(mode: str, n: int, path: Path, args, pairs: bool) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        mode,
        str(n),
        str(path),
        "--model",
        args.model,
        "--max-length",
        str(args.max_length),
    ] + (["--pairs"] if pairs else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_rss(n: int, path: Path, args, code: str) -> tuple[float, float]:
    """(peak RSS in MB, wall seconds) of one whole ``isotui run`` process over the first ``n``
    samples of ``path``, importing isotui from ``code``; ``code`` "bare" runs
    benchmarks/bare_forward.py instead over the same samples (the forward alone)."""

    with tempfile.TemporaryDirectory() as out:
        threads = ["--threads", str(args.threads)]
        if code == "bare":
            from isotui.models.naming import parse_model

            first = Path(out) / "corpus.txt"
            first.write_text("".join(path.read_text(encoding="utf-8").splitlines(True)[:n]), encoding="utf-8")
            here = Path(__file__).resolve().parent
            argv = [sys.executable, str(here / "bare_forward.py"), str(first)]
            argv += [str(parse_model(args.model).local_dir()), "--max-length", str(args.max_length)]
            code = str(here.parent)
        else:
            argv = [sys.executable, "-m", "isotui", "run", "-m", args.model, "--data", f"text:{path}"]
            argv += ["--max-samples", str(n), "--max-length", str(args.max_length), "--no-cache", "-q"]
            argv += ["--csv", str(Path(out) / "run.csv")]
        argv += threads
        env = {**os.environ, "PYTHONPATH": code}
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=code)
        _pid, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        err = proc.stderr.read().decode() if proc.stderr else ""
        if status != 0:
            sys.exit(f"{' '.join(argv)} failed:\n{err}")
    return usage.ru_maxrss / 1024, seconds


def _process(args) -> None:
    """Part 3 (see the module's doc): peak RSS at 300 and 2,100 samples per code tree."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from process import uptime  # the load averages, as the process benchmark records them

    codes = ["bare"] + (args.code or [str(Path(__file__).resolve().parents[1])])
    peaks: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.txt"
        _corpus(2100, path)
        print(
            f"whole-process peak RSS, MB ({args.model}, max length {args.max_length}, "
            f"{args.threads} threads; bare = benchmarks/bare_forward.py):"
        )
        for _ in range(args.repeats):
            for n in (300, 2100):
                for code in codes:
                    load = uptime()
                    rss, seconds = _run_rss(n, path, args, code)
                    peaks.setdefault((code, n), []).append(rss)
                    print(f"  {code}: {n:>5} samples  {rss:7.1f} MB  {seconds:6.1f} s  (load {load})")
    for code in codes:
        low, high = min(peaks[code, 300]), min(peaks[code, 2100])
        print(f"{code}: peak {high:.1f} MB at 2,100, {low:.1f} MB at 300: ratio {high / low:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "N", "PATH"))
    parser.add_argument("--pairs", action="store_true")
    parser.add_argument("--process", action="store_true", help="part 3 only: whole isotui run processes")
    parser.add_argument("--code", action="append", help="with --process: a tree to import isotui from")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="with --process")
    args = parser.parse_args()
    if args.process:
        _process(args)
        return
    if args.worker:
        mode, n, path = args.worker
        print(json.dumps(_worker(mode, int(n), Path(path), args.model, args.max_length, args.pairs)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.txt"
        _corpus(5000, path)
        ours, plain = _measure("ours", 500, path, args, False), _measure("plain", 500, path, args, True)
        diff = max(abs(a - b) for a, b in zip(ours["avg_cos"], plain["avg_cos"], strict=True))
        print(f"speed at 500 samples ({args.model}, max length {args.max_length}):")
        print(
            f"  plain (keep all, all pairs): {plain['seconds']:.1f} s   ours: {ours['seconds']:.1f} s   "
            f"plain/ours = {plain['seconds'] / ours['seconds']:.2f}   max |avg_cos diff| = {diff:.1e}"
        )
        print("peak memory (max RSS) above the loaded model, MB:")
        modes = ("ours", "plain", "bare")
        used = {}
        for n in (500, 5000):
            for mode in modes:
                r = _measure(mode, n, path, args, False)
                used[mode, n] = r["peak_mb"] - r["base_mb"]
            print(f"  {n:>5} samples: " + "   ".join(f"{m} {used[m, n]:6.0f}" for m in modes))
        grow = {m: used[m, 5000] - used[m, 500] for m in modes}
        print("growth 500 -> 5000: " + ", ".join(f"{m} {grow[m]:+.0f} MB" for m in modes))
        print("(bare = the forward loop alone, no metrics: the CPU heap's own creep with batch count)")


if __name__ == "__main__":
    main()
