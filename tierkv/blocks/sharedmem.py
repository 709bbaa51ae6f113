"""Which of this process's memory is a shared file mapping, so other processes can write into it.

:func:`~tierkv.blocks.pool.shared_pool_tensors` registers each pool it maps (the mapping and a descriptor
of its file); :func:`region_of` tells whether a buffer lies inside one, and where. Reader
processes (:mod:`tierkv.backends.fsspec._readproc`) map the same file through the descriptor and read
records straight into those bytes. A region is forgotten, and its descriptor closed, when its
mapping is freed, so an address reused by a later allocation never points at a stale file.

:func:`adopt` registers a shared file mapping another library made (vLLM's CPU offload region),
found in ``/proc/self/maps``; its caller keeps the mapping alive until :func:`release`.

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
from typing import Any

__all__ = ["SharedRegion", "adopt", "region_of", "register", "regions", "release"]


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


def _mapping_of(address: int, nbytes: int) -> tuple[int, int, int, int, str] | None:
    """``(start, end, device, inode, path)`` of the shared file mapping at offset 0 that holds
    ``nbytes`` at ``address`` (consecutive entries of one file joined), else None."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found: list[Any] | None = None
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        offset, inode = int(parts[2], 16), int(parts[4])
        major, minor = (int(x, 16) for x in parts[3].split(":"))
        path = parts[5] if len(parts) > 5 else ""
        if found is not None:
            if lo == found[1] and inode == found[3] and offset == found[1] - found[0]:
                found[1] = hi  # the same file, mapped on
            else:
                break
        elif lo <= address < hi:
            if parts[1][3] != "s" or inode == 0 or offset != 0:
                return None
            found = [lo, hi, os.makedev(major, minor), inode, path]
        if found is not None and address + nbytes <= found[1]:
            return found[0], found[1], found[2], found[3], found[4]
    return None


def _reopen(device: int, inode: int, path: str) -> int | None:
    """A new read-write descriptor of the file ``device``/``inode``: through a descriptor this
    process has open (the file may be unlinked), else its path; None when neither works."""
    candidates = []
    try:
        candidates = [f"/proc/self/fd/{n}" for n in os.listdir("/proc/self/fd")]
    except OSError:
        pass
    if path.startswith("/") and not path.endswith(" (deleted)"):
        candidates.append(path)
    for c in candidates:
        try:
            st = os.stat(c)
            if (st.st_dev, st.st_ino) != (device, inode):
                continue
            fd = os.open(c, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (device, inode):
            return fd
        os.close(fd)
    return None


def adopt(address: int, nbytes: int) -> SharedRegion | None:
    """Register the shared file mapping that holds ``nbytes`` at ``address``, made by other code
    (a region whose file's descriptor or path this process can open again); None when that memory
    is not such a mapping. The caller keeps the mapping alive until :func:`release`."""
    found = _mapping_of(address, nbytes)
    if found is None:
        return None
    start, end, device, inode, path = found
    fd = _reopen(device, inode, path)
    if fd is None:
        return None
    region = SharedRegion(id=next(_ids), fd=fd, base=start, size=end - start)
    with _lock:
        _drop_freed()
        _regions[region.id] = region
    return region


def release(region: SharedRegion) -> None:
    """Forget a region :func:`adopt` registered (before its mapping goes away)."""
    with _lock:
        _freed.append(region.id)
        _drop_freed()


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
