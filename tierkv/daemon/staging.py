"""Staging rows for puts that find no room in the daemon's pool.

When every slot of a group is pinned or being written, an in-process ``put`` writes its blocks
straight to the lower tiers from a private copy. Through the daemon the bytes must not cross the
socket, so the client copies them into a range of this shared file instead, and the daemon stores
them from there (into the pool if room appeared meanwhile, else down to the lower tiers) and frees
the range. Ranges are taken first-fit, page-aligned; a put that finds no free range is dropped and
counted, as when no tier takes it.
"""

from __future__ import annotations

import mmap
import os
import threading

import torch

__all__ = ["Staging"]

_ALIGN = 4096


class Staging:
    """A shared file of ``size`` bytes at ``path`` handed out in ranges (see the module docstring)."""

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        try:  # a killed daemon's file: a client may still map it, so never reuse its pages
            os.unlink(path)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, bytes), by offset

    def take(self, nbytes: int) -> int | None:
        """The offset of a free range of ``nbytes`` (rounded up to a page), None when none is."""
        need = -(-nbytes // _ALIGN) * _ALIGN
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                if size >= need:
                    if size == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, size - need)
                    return off
        return None

    def give(self, offset: int, nbytes: int) -> None:
        """Free the range :meth:`take` gave, merging it with free neighbours."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        with self._lock:
            spans = sorted([*self._free, (offset, size)])
            merged: list[tuple[int, int]] = []
            for off, n in spans:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((off, n))
            self._free = merged

    def rows(self, offset: int, n: int, block_bytes: int) -> torch.Tensor:
        """``[n, block_bytes]`` rows at ``offset``."""
        return self.flat[offset:offset + n * block_bytes].view(n, block_bytes)

    def close(self) -> None:
        """Remove the file (mappings of it stay valid until they go)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
