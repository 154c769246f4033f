"""The CPU heap's tuning (isotui/extract/heap.py): large blocks stay out of glibc's heap."""

from __future__ import annotations

import subprocess
import sys

import pytest

from isotui.extract.heap import _libc

PROBE = """
import ctypes, sys
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "tuned":
    from isotui.extract.heap import fixed_mmap_threshold
    assert fixed_mmap_threshold()
big = libc.malloc(8 << 20)  # mapped, and freed: glibc's default now maps only blocks >= 8 MiB
libc.free(big)
before = libc.mallinfo2().hblks
block = libc.malloc(4 << 20)  # a smaller batch's tensor
print(libc.mallinfo2().hblks - before)
"""


def _has_mallinfo2() -> bool:
    libc = _libc()
    return libc is not None and hasattr(libc, "mallinfo2")


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc >= 2.33 only")
def test_blocks_of_a_mebibyte_get_their_own_mapping_after_a_larger_one_was_freed() -> None:
    def mapped(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    assert mapped("default") == 0  # glibc's own: from the heap, where shapes that change fragment it
    assert mapped("tuned") == 1


def test_the_tuning_is_a_no_op_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    from isotui.extract import heap

    monkeypatch.setattr(heap.sys, "platform", "darwin")
    heap._libc.cache_clear()
    heap.fixed_mmap_threshold.cache_clear()
    try:
        assert heap.fixed_mmap_threshold() is False
        assert heap.release_free_memory() is False
    finally:
        heap._libc.cache_clear()
        heap.fixed_mmap_threshold.cache_clear()
