"""Give freed CPU heap memory back to the system between batches (glibc only).

A CPU forward pass over length-sorted batches allocates tensors of ever-changing shapes; glibc's
heap fragments and the process's resident memory creeps up with the number of batches, even for
a bare ``model(...)`` loop (MiniLM, 500 -> 5,000 samples: +400 MB). ``malloc_trim`` every few
batches returns the free pages, so memory stays flat with the corpus size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
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
