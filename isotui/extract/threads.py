"""How many CPU threads torch uses for a run (``--threads``).

torch's own default is every physical core, whatever else runs: on a shared machine its threads
wait for cores other processes hold, and every small parallel op costs a scheduler slice (issue 15:
MiniLM over 2,100 lines took 116-148 s at torch's 2 threads with one core busy elsewhere, 26 s at
one thread). The default here is the cores this process may use (its CPU affinity), scaled down by
how oversubscribed the machine is (the 1-minute load average over those cores), and the run says
so. The thread count never changes which vectors are measured, only the order of float sums inside
a matrix product, so it is not part of the cache key.

A requested count has a ceiling, :func:`max_threads`: 4 per logical CPU of the machine. torch
gains nothing from intra-op threads beyond the CPUs (the extra ones wait for a core at every op),
so the ceiling only stops a slip of the keyboard: ``--threads 100000`` started threads until the
machine's process table was full and every process on it failed to fork (issue 30). Four per CPU
still lets a user oversubscribe on purpose, and torch's two pools of that size stay far below a
Linux process table (2 x 4 x 128 = 1,024 threads on a 128-CPU server; pid_max is 32,768 or more).
"""

from __future__ import annotations

import contextlib
import math
import os

from isotui.errors import IsotuiError

THREADS_PER_CPU = 4  # the most threads a run may ask for, per logical CPU (see the module doc)


def max_threads() -> int:
    """The most threads a run may ask for: :data:`THREADS_PER_CPU` per logical CPU."""
    return THREADS_PER_CPU * max(1, os.cpu_count() or 1)


def check_threads(requested: int, name: str = "threads") -> int:
    """``requested`` if at most :func:`max_threads`, else one sentence naming ``name`` (the flag,
    config key or keyword), said before any work starts."""
    limit = max_threads()
    if requested > limit:
        cpus = limit // THREADS_PER_CPU
        raise IsotuiError(
            f"{name} {requested:,} is more than this machine can use: at most {limit:,} "
            f"({THREADS_PER_CPU} per logical CPU, {cpus:,} CPU{'s' if cpus != 1 else ''}); torch gains "
            "nothing from threads beyond the CPUs"
        )
    return requested


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; all cores where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows: no affinity masks
        return max(1, os.cpu_count() or 1)


def load_average() -> float | None:
    """The 1-minute load average, None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def default_threads(cores: int, load: float | None) -> tuple[int, str | None]:
    """(threads, note): ``cores`` when the machine is not loaded; when the load average is above
    the cores, each runnable thread gets about cores/load of a core, so the run takes that share of
    them, cores x cores/load (at least 1), rather than threads that wait for cores at every op.
    The note says what was chosen and why (None when nothing needs saying)."""
    if load is None or load <= cores:
        return cores, None
    threads = max(1, math.floor(cores * cores / load))
    plural = "s" if threads != 1 else ""
    note = (
        f"the machine is loaded (1-minute load average {load:.2f} on {cores} usable cores): "
        f"torch uses {threads} thread{plural}, its share of the cores (--threads sets it)"
    )
    return threads, note


def choose_threads(requested: int | None) -> tuple[int, str | None]:
    """The threads a run uses: ``requested`` (``--threads``) when given, else OMP_NUM_THREADS when
    the environment sets it, else :func:`default_threads` of this process's cores and the load.
    OMP_NUM_THREADS has the ceiling ``--threads`` has (:func:`max_threads`): a value above it is
    capped there, with a note (the environment is not the user's typing, so it is not refused:
    ``OMP_NUM_THREADS=100000`` started threads until the process table was full, then SIGSEGV)."""
    if requested is not None:
        return requested, None
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        asked, limit = int(env), max_threads()
        if asked <= limit:
            return asked, None
        cpus = limit // THREADS_PER_CPU
        return limit, (
            f"OMP_NUM_THREADS={asked:,} is more than this machine can use: torch uses {limit:,} "
            f"threads ({THREADS_PER_CPU} per logical CPU, {cpus:,} CPU{'s' if cpus != 1 else ''}), "
            "the ceiling of --threads"
        )
    return default_threads(usable_cores(), load_average())


def apply_threads(requested: int | None, *, interop: bool = True) -> str | None:
    """Set torch's intra-op threads (and, with ``interop``, its inter-op threads while torch
    still allows it: once set they cannot be set back) for this run; the note for the table when
    the load made the choice, else None."""
    import torch

    threads, note = choose_threads(requested)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if interop:
        with contextlib.suppress(RuntimeError):  # allowed only before the first inter-op work
            torch.set_num_interop_threads(threads)
    return note
