"""Give freed CPU heap memory back to the system between batches (glibc only).

A CPU forward pass over length-sorted batches allocates tensors of ever-changing shapes; glibc's
heap fragments and the process's resident memory creeps up with the number of batches, even for
a bare ``model(...)`` loop (MiniLM, 500 -> 5,000 samples: +400 MB). ``malloc_trim`` every few
batches returns the free pages, so memory stays flat with the corpus size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache

TRIM_EVERY = 8  # batches


@lru_cache(maxsize=2)
def _glibc(function: str) -> Callable[..., int] | None:
    """glibc's ``function`` (``malloc_trim``, ``mallopt``); None off Linux or glibc (e.g. musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return getattr(libc, function)
    except (OSError, AttributeError):
        return None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)
MMAP_THRESHOLD = TRIM_THRESHOLD = 128 << 10  # glibc's own starting values, kept instead of raised
USER_SETTING = "MALLOC_MMAP_THRESHOLD_"  # glibc's environment variable: set, it is left alone
HELD_NOTE = (
    "--max-memory cpu: freed memory goes back to the system at once (glibc's mmap threshold held "
    "at 128 KiB), so resident memory stays within the plan; a run computed on the CPU takes about "
    "a fifth longer for it (set MALLOC_MMAP_THRESHOLD_ to choose otherwise)"
)


def hold_heap_to_live_bytes() -> bool:
    """Make glibc give every freed block of :data:`MMAP_THRESHOLD` or more back to the system at
    once, for the rest of the process (False where the C library cannot).

    glibc raises its mmap threshold to the largest block freed so far, so after the first batch a
    batch's tensors come from the heap, and the heap keeps what they freed until a trim: an
    offloaded GPT-2 under ``--max-memory cpu=300MB`` held 7-9 MB of freed batch memory beside
    its plan of 24 MB. Fixing the threshold at glibc's starting value returns each block when it
    is freed, and the heap's free top is given back above the same size, so resident memory
    follows live bytes; what it costs is a page fault for each page of each new large block. A
    run under a CPU ``--max-memory`` asks for it (the same as
    ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment)."""
    set_option = _glibc("mallopt")
    if set_option is None or USER_SETTING in os.environ:  # the user's own choice stands
        return False
    # the trim threshold too: glibc doubles it with each raise of the mmap threshold, and a heap
    # whose free top stays under it is never shrunk
    return bool(set_option(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and set_option(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release_free_memory() -> bool:
    """Return free heap pages to the OS; False where the C library cannot."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


@contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off while a model loads, then as it was.

    Importing torch and transformers and building a model make about a million long-lived
    objects; the collector, triggered by that growth, walked them all again and again (MiniLM's
    `isotui run`: 1,000 young, 90 middle and 7 full collections, about a second of CPU on an idle
    machine, three under load; a bare forward script pays the same). Nothing a load makes is
    garbage worth collecting that early: the collections simply resume afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
