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
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache

TRIM_EVERY = 8  # batches


@lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to do
        return None


def release_free_memory() -> bool:
    """Return free heap pages to the OS; False where the C library cannot."""
    trim = _malloc_trim()
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
