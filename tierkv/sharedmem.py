"""Which of this process's memory is a shared file mapping, so other processes can write into it.

:func:`~tierkv.pool.shared_pool_tensors` registers each pool it maps (the mapping and a descriptor
of its file); :func:`region_of` tells whether a buffer lies inside one, and where. Reader
processes (:mod:`tierkv.backends.readproc`) map the same file through the descriptor and read
records straight into those bytes. A region is forgotten, and its descriptor closed, when its
mapping is freed, so an address reused by a later allocation never points at a stale file.

A mapping's finalizer can run anywhere in its thread (a collection started by any allocation, a
signal handler), including while that thread holds this module's lock: it only queues the
region, and every entry point drops the queued regions under the lock before it looks.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

__all__ = ["SharedRegion", "region_of", "register", "regions"]


@dataclass(frozen=True)
class SharedRegion:
    """A live shared mapping: ``size`` bytes at address ``base`` of the file open as ``fd``."""

    id: int
    fd: int
    base: int
    size: int


_lock = threading.Lock()
_regions: dict[int, SharedRegion] = {}
_ids = itertools.count(1)
_freed: list[int] = []


def _address(mapped: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mapped))


def _forget(region_id: int) -> None:
    _freed.append(region_id)


def _drop_freed() -> None:
    """Drop the regions whose mappings were freed; the caller holds ``_lock``."""
    while _freed:
        region = _regions.pop(_freed.pop(), None)
        if region is not None:
            os.close(region.fd)


def register(mapped: mmap.mmap, fd: int) -> SharedRegion:
    """Note that ``mapped`` maps the file open as ``fd`` (a duplicate is kept) shared."""
    region = SharedRegion(id=next(_ids), fd=os.dup(fd), base=_address(mapped), size=len(mapped))
    os.set_inheritable(region.fd, False)
    with _lock:
        _drop_freed()
        _regions[region.id] = region
    weakref.finalize(mapped, _forget, region.id)
    return region


def regions() -> list[SharedRegion]:
    """The live shared mappings."""
    with _lock:
        _drop_freed()
        return list(_regions.values())


def region_of(address: int, nbytes: int) -> tuple[SharedRegion, int] | None:
    """The region holding ``nbytes`` at ``address`` and their offset in it, or None."""
    with _lock:
        _drop_freed()
        for r in _regions.values():
            if r.base <= address and address + nbytes <= r.base + r.size:
                return r, address - r.base
    return None
