"""How fast the app answers a key, idle and while a layer run computes (issue 12).

Drives the real app in a detached tmux session (a real terminal, as a user has it): moves the
models list's cursor between two models with ``tmux send-keys`` and times how long until the
screen shows it (the layer table's title names the highlighted model), by polling
``tmux capture-pane``. First with nothing running, then while ``--model`` runs on the built-in
corpus (pressed ``r``). Prints median, p90, p99 and max of each, and the machine's load.

    python benchmarks/key_latency.py [--presses 60] [--model minilm] [--root PATH]

``--root`` is the checkout whose ``isotui`` runs (default: this one), so a branch can be compared
with another. The run uses a private result cache and config folder (nothing cached, no session).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SESSION = "isotui-key-latency"


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def screen() -> list[str]:
    return tmux("capture-pane", "-p", "-t", SESSION).splitlines()


def title_line(lines: list[str]) -> str:
    """The layer table's title row (the line under the header), which names the selected model."""
    return lines[1] if len(lines) > 1 else ""


def wait_for(predicate, timeout: float, what: str) -> list[str]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        lines = screen()
        if predicate(lines):
            return lines
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}:\n" + "\n".join(screen()))


def press(key: str, before: str, timeout: float = 10.0) -> float:
    """Seconds from sending ``key`` until the title row differs from ``before``."""
    start = time.perf_counter()
    tmux("send-keys", "-t", SESSION, key)
    end = start + timeout
    while time.perf_counter() < end:
        if title_line(screen()) != before:
            return time.perf_counter() - start
        time.sleep(0.002)
    raise SystemExit(f"the screen did not change within {timeout} s of {key!r}")


def running(lines: list[str]) -> bool:
    """The jobs pane shows a job computing (its state, then its progress bar)."""
    return any(re.search(r"\brunning\s+[█░]", line) for line in lines)


TRACE: list[str] = []


def measure(presses: int, still_busy=lambda: True) -> list[float]:
    """Alternate down/up (two models) ``presses`` times; a short think time between keys."""
    times = []
    for i in range(presses):
        if not still_busy():
            break
        before = title_line(screen())
        times.append(press("Down" if i % 2 == 0 else "Up", before))
        jobs = [line.strip() for line in screen() if "running" in line or "finish" in line]
        TRACE.append(f"{time.monotonic():.2f} {times[-1] * 1000:6.0f} ms  {jobs[:1]}")
        time.sleep(0.15)
    return times


def summary(name: str, times: list[float]) -> str:
    ms = sorted(t * 1000 for t in times)
    if not ms:
        return f"{name}: no presses"

    def pct(p: float) -> float:
        return ms[min(len(ms) - 1, round(p / 100 * (len(ms) - 1)))]

    return (
        f"{name:5s} n={len(ms):3d}  median {statistics.median(ms):6.0f} ms  p90 {pct(90):6.0f} ms  "
        f"p99 {pct(99):6.0f} ms  max {ms[-1]:6.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presses", type=int, default=60)
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--size", default="120x36")
    args = parser.parse_args()
    width, height = args.size.split("x")
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            "PYTHONPATH": str(args.root),
            "ISOTUI_CACHE_DIR": f"{tmp}/cache",
            "XDG_CONFIG_HOME": f"{tmp}/config",
            "HF_HUB_OFFLINE": "1",
        }
        command = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        command += f" {shlex.quote(sys.executable)} -m isotui"
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
        tmux("new-session", "-d", "-s", SESSION, "-x", width, "-y", height, f"cd {tmp} && {command}")
        try:
            wait_for(lambda lines: args.model in title_line(lines), 60, "the first frame")
            time.sleep(1.0)
            idle = measure(args.presses)
            # back on the first model, run it; measure while the jobs pane says it is in flight
            if args.model not in title_line(screen()):
                press("Up", title_line(screen()))
            tmux("send-keys", "-t", SESSION, "r")
            wait_for(running, 300, "the job to run")
            busy_now = lambda: any("in flight" in line for line in screen())  # noqa: E731
            busy = measure(args.presses, busy_now)
            still = busy_now()
        finally:
            subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    print(f"isotui from {args.root}, {args.size}, {args.model} running on the built-in corpus")
    print(summary("idle", idle))
    print(summary("busy", busy) + ("" if still else "  (the job ended before all presses)"))
    print("load:", os.getloadavg(), "cores:", os.cpu_count())
    if os.environ.get("KEY_LATENCY_TRACE"):
        Path(os.environ["KEY_LATENCY_TRACE"]).write_text("\n".join(TRACE) + "\n")


if __name__ == "__main__":
    main()
