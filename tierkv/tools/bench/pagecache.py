"""The page cache of the benchmarks' record files: drop it, ask how much of them it holds, read them
raw (the yardstick a restore is compared with)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["drop_page_cache", "read_files", "resident_fraction"]

try:
    _LIBC: Any = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def drop_page_cache(paths: Sequence[Path], method: str) -> str:
    """Drop the page cache: the machine's (``drop_caches``, root) or the files' (``fadvise``).

    Returns the method that ran: ``drop_caches``, or ``fadvise`` (asked for, or because
    /proc/sys/vm/drop_caches could not be written: not root).
    """
    os.sync()
    if method == "drop_caches":
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            method = "fadvise (drop_caches not writable: not root)"
    for p in paths:
        with contextlib.suppress(OSError):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return method


def resident_fraction(paths: Sequence[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (``mincore``); None where that cannot be asked."""
    if _LIBC is None or not paths:
        return None
    libc = _LIBC
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    total = resident = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            try:
                if libc.mincore(addr, size, vec) != 0:
                    return None
            finally:
                libc.munmap(addr, size)
            total += pages
            resident += sum(b & 1 for b in vec)
        finally:
            os.close(fd)
    return resident / total if total else None


def read_files(paths: Sequence[Path]) -> tuple[int, float]:
    """Read every file whole, one after the other, in one thread: (bytes, seconds)."""
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    nbytes = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                nbytes += n
    return nbytes, time.perf_counter() - t0
