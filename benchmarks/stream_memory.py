"""Peak memory of a whole ``isotui run`` process with ``--stream``: 10k vs 1M lines of text.

The corpus is streamed (read, tokenised and length-sorted in windows), so the peak resident set
of the process should not grow with the corpus: the target is a ratio of at most 1.10. Each run
is a fresh ``python -m isotui run`` child on a tiny random GPT-2 with a small max length (so 1M
lines finish in a few minutes on a CPU); its peak RSS is the child's own ``ru_maxrss`` from
``os.wait4``. ``--plain`` also runs both sizes without ``--stream``, for comparison.

    python benchmarks/stream_memory.py [--small 10000] [--large 1000000] [--plain]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from isotui.paths import builtin_corpus_path

MODEL = "random:gpt2:n_layer=2,n_embd=32,n_head=2"
WORDS = sorted(set(builtin_corpus_path().read_text(encoding="utf-8").split()))  # real words


def write_corpus(path: Path, lines: int, seed: int = 0) -> None:
    """``lines`` lines of 3 to 14 words, the same first lines for every size."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(lines):
            f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) + "\n")


def peak_rss(argv: list[str]) -> tuple[int, float]:
    """(peak resident set in bytes, wall seconds) of one child process running ``argv``."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{err[-2000:]}")
    return usage.ru_maxrss * 1024, seconds  # Linux: kilobytes


def run_argv(data: Path, max_length: int, stream: bool) -> list[str]:
    argv = [sys.executable, "-m", "isotui", "run", "-m", MODEL, "--data", f"text:{data}"]
    argv += ["--max-length", str(max_length), "--batch-size", "2048", "--no-cache", "--threads", "1", "-q"]
    return argv + (["--stream"] if stream else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--max-length", type=int, default=8)
    parser.add_argument("--plain", action="store_true", help="also run both sizes without --stream")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for n in (args.small, args.large):
            files[n] = Path(tmp) / f"{n}.txt"
            write_corpus(files[n], n)
        modes = [True, False] if args.plain else [True]
        for stream in modes:
            peaks = {}
            for n, path in files.items():
                argv = run_argv(path, args.max_length, stream)
                peaks[n], seconds = peak_rss(argv)
                size = path.stat().st_size / 2**20
                print(
                    f"{'--stream' if stream else 'plain   '} {n:>9,} lines ({size:6.1f} MiB): "
                    f"peak RSS {peaks[n] / 2**20:7.1f} MiB in {seconds:6.1f} s",
                    flush=True,
                )
            ratio = peaks[args.large] / peaks[args.small]
            target = " (target <= 1.10)" if stream else ""
            mode = "--stream" if stream else "plain   "
            print(f"{mode} ratio {args.large:,} / {args.small:,}: {ratio:.3f}x{target}")
    print("command:", " ".join(run_argv(Path("FILE"), args.max_length, True)))
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
