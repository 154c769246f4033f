"""How fast the app answers a key, idle and while a layer run computes (issue 12).

Drives the real app in a detached tmux session (a real terminal, as a user has it): moves the
models list's cursor between two models and times how long until the app has written the change
(the layer table's title naming the newly highlighted model). Keys go in and the app's output
comes back through a tmux control-mode client (``tmux -C``), which tmux tells of every write as it
happens: nothing polls, so the probe does not take CPU from the app it times on a small machine
(polling ``capture-pane`` every 2 ms took about a core). First with nothing running, then while
``--model`` runs on the built-in corpus (pressed ``r``). Prints median, p90, p99 and max of each,
and the machine's load.

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
import threading
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


class Watcher:
    """A tmux control-mode client of the session: sends keys, and keeps what the app writes
    (``%output`` notifications, unescaped) with the time each arrived."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            ["tmux", "-C", "attach", "-t", SESSION], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
        )
        self.cond = threading.Condition()
        self.chunks: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        pending = b""
        assert self.proc.stdout is not None
        while data := os.read(self.proc.stdout.fileno(), 65536):
            now = time.perf_counter()
            pending += data
            *lines, pending = pending.split(b"\n")
            out = [
                re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), line.split(b" ", 2)[2])
                for line in lines
                if line.startswith(b"%output ") and line.count(b" ") >= 2
            ]
            if out:
                with self.cond:
                    self.chunks.extend((now, chunk.decode("utf-8", "replace")) for chunk in out)
                    self.cond.notify_all()

    def press(self, key: str, expect: re.Pattern[str], timeout: float = 10.0) -> float:
        """Seconds from sending ``key`` until the app has written text matching ``expect``."""
        with self.cond:
            seen = len(self.chunks)
        start = time.perf_counter()
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"send-keys -t {SESSION} {key}\n".encode())
        with self.cond:
            while True:
                text = "".join(chunk for _, chunk in self.chunks[seen:])
                if expect.search(text):
                    return self.chunks[-1][0] - start
                left = start + timeout - time.perf_counter()
                if left <= 0 or not self.cond.wait(left):
                    raise SystemExit(
                        f"the app did not write {expect.pattern!r} within {timeout} s of {key!r}"
                    )

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.write(b"detach\n")
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def title_pattern(model: str) -> re.Pattern[str]:
    """The layer table's title for ``model``: with no result yet, or a result's (``model · ...``)."""
    return re.compile(re.escape(model) + r" [(·]")


def highlighted(lines: list[str]) -> str:
    """The model the layer table's title names."""
    match = re.search(r"[─╭┌](\S+?) [(·]", title_line(lines))
    return match[1] if match else ""


def running(lines: list[str]) -> bool:
    """The jobs pane shows a job computing (its state, then its progress bar)."""
    return any(re.search(r"\brunning\s+[█░]", line) for line in lines)


TRACE: list[str] = []


def measure(watcher: Watcher, models: tuple[str, str], presses: int, still_busy=lambda: True) -> list[float]:
    """Alternate down/up between the two ``models`` ``presses`` times; a short think time between keys."""
    times = []
    for i in range(presses):
        if not still_busy():
            break
        key, target = ("Down", models[1]) if i % 2 == 0 else ("Up", models[0])
        times.append(watcher.press(key, title_pattern(target)))
        TRACE.append(f"{time.monotonic():.2f} {times[-1] * 1000:6.0f} ms")
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
        watcher = None
        try:
            wait_for(lambda lines: highlighted(lines) == args.model, 60, "the first frame")
            time.sleep(1.0)
            watcher = Watcher()
            tmux("send-keys", "-t", SESSION, "Down")
            other = highlighted(
                wait_for(lambda lines: highlighted(lines) not in ("", args.model), 10, "Down")
            )
            watcher.press("Up", title_pattern(args.model))
            models = (args.model, other)
            idle = measure(watcher, models, args.presses)
            # back on the first model, run it; measure while the jobs pane says it is in flight
            if highlighted(screen()) != args.model:
                watcher.press("Up", title_pattern(args.model))
            tmux("send-keys", "-t", SESSION, "r")
            wait_for(running, 300, "the job to run")
            busy_now = lambda: any("in flight" in line for line in screen())  # noqa: E731
            busy = measure(watcher, models, args.presses, busy_now)
            still = busy_now()
        finally:
            if watcher is not None:
                watcher.close()
            subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    print(f"isotui from {args.root}, {args.size}, {args.model} running on the built-in corpus")
    print(summary("idle", idle))
    print(summary("busy", busy) + ("" if still else "  (the job ended before all presses)"))
    print("load:", os.getloadavg(), "cores:", os.cpu_count())
    if os.environ.get("KEY_LATENCY_TRACE"):
        Path(os.environ["KEY_LATENCY_TRACE"]).write_text("\n".join(TRACE) + "\n")


if __name__ == "__main__":
    main()
