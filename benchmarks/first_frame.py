"""How long ``isotui`` takes from the command to its first frame in a real terminal (issue 29).

Starts the app in a detached tmux session (a private result cache and config folder: no session
to restore), and times from the start of the command until the terminal shows the first frame:
the footer's keys and the models list with its first entry. Then the import of the app's module
alone (``python -c "import isotui.tui.app"``), so the two costs can be told apart. Prints the
median and the spread of ``--runs`` tries and the machine's load, which the time follows closely
on a small shared machine.

    python benchmarks/first_frame.py [--runs 5] [--size 80x24] [--root PATH]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SESSION = "isotui-first-frame"


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def drawn(lines: list[str]) -> bool:
    """The first frame: the footer's keys and the list's first bundled model are on screen."""
    text = "\n".join(lines)
    return "Help" in text and "minilm" in text and "bundled" in text


def first_frame(root: Path, size: str) -> float:
    width, height = size.split("x")
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            "PYTHONPATH": str(root),
            "ISOTUI_CACHE_DIR": f"{tmp}/cache",
            "XDG_CONFIG_HOME": f"{tmp}/config",
            "HF_HUB_OFFLINE": "1",
        }
        command = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        command += f" {shlex.quote(sys.executable)} -m isotui"
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
        start = time.perf_counter()
        tmux("new-session", "-d", "-s", SESSION, "-x", width, "-y", height, f"cd {tmp} && {command}")
        try:
            while time.perf_counter() - start < 60:
                if drawn(tmux("capture-pane", "-p", "-t", SESSION).splitlines()):
                    return time.perf_counter() - start
                time.sleep(0.02)
            raise SystemExit("no first frame within 60 s:\n" + tmux("capture-pane", "-p", "-t", SESSION))
        finally:
            subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)


def import_time(root: Path) -> float:
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", "import isotui.tui.app"], check=True, env=env)
    return time.perf_counter() - start


def summary(name: str, times: list[float]) -> str:
    return (
        f"{name:12s} median {statistics.median(times):.2f} s  "
        f"min {min(times):.2f} s  max {max(times):.2f} s  (n={len(times)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--size", default="80x24")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    load_before = os.getloadavg()
    frames, imports = [], []
    for _ in range(args.runs):
        frames.append(first_frame(args.root, args.size))
        imports.append(import_time(args.root))
        time.sleep(0.5)
    print(f"isotui from {args.root}, {args.size}")
    print(summary("first frame", frames))
    print(summary("import only", imports))
    print("load before:", load_before, "after:", os.getloadavg(), "cores:", os.cpu_count())


if __name__ == "__main__":
    main()
