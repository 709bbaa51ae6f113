"""Direct I/O (``O_DIRECT``) writes of local record files: past the page cache, to the device.

A record's pieces are copied (``numpy.copyto``, which lets other threads run meanwhile) into a
page-aligned per-thread scratch buffer and written from it in aligned chunks of at most
:data:`CHUNK_BYTES`; the bytes after the last whole aligned block are written buffered, with
``O_DIRECT`` turned off on the file first (padding and truncating back cost more). Records keep
their format: any reader reads the same bytes.

Why: a buffered write of a new file must first get page-cache pages for it, and the kernel must
later write them back; both cost more than the copy into the device's buffer (docs/design.md has
the figures). Whether a directory supports ``O_DIRECT`` (older tmpfs, some FUSE file systems do
not) is found out once by :func:`probe`.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from tierkv.records.tempnames import temp_name

__all__ = ["ALIGN", "CHUNK_BYTES", "O_DIRECT", "UNSUPPORTED", "preallocate", "probe", "write_file"]

#: ``O_DIRECT`` where the platform has it, else 0 (then :func:`probe` always says no)
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
#: offsets, lengths and buffer addresses of direct I/O are multiples of this (a page: more than
#: any device's logical block)
ALIGN = 4096
#: the largest scratch buffer a thread keeps, and the largest single read or write
CHUNK_BYTES = 4 << 20
#: errors that mean "this file system does not do direct I/O (here)"
UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
#: below this many bytes numpy's call overhead is more than the copy
_SMALL = 4096


class _Scratch(threading.local):
    buf: mmap.mmap | None = None


_scratch = _Scratch()


def _buffer(n: int) -> memoryview:
    """This thread's page-aligned scratch: ``n`` bytes rounded up to :data:`ALIGN`, at most
    :data:`CHUNK_BYTES`."""
    size = min(CHUNK_BYTES, -(-n // ALIGN) * ALIGN)
    buf = _scratch.buf
    if buf is None or len(buf) < size:  # the old one goes with its last view
        buf = _scratch.buf = mmap.mmap(-1, size)
    return memoryview(buf)[:size]


def _bytes(b: Any) -> memoryview:
    return memoryview(b).cast("B")


def _copy(dst: memoryview, src: memoryview) -> None:
    if len(dst) <= _SMALL:
        dst[:] = src
    else:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def probe(directory: str) -> bool:
    """Whether files in ``directory`` (which must exist) can be written and read with ``O_DIRECT``."""
    if not O_DIRECT:
        return False
    path = temp_name(f"{directory}/direct-probe")  # a temporary: a crashed probe's file is swept
    buf = _buffer(ALIGN)[:ALIGN]
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_DIRECT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        if exc.errno in UNSUPPORTED:
            return False
        raise
    try:
        return os.pwrite(fd, buf, 0) == ALIGN and os.preadv(fd, [buf], 0) == ALIGN
    except OSError as exc:
        if exc.errno in UNSUPPORTED:
            return False
        raise
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def write_file(fd: int, parts: list[Any]) -> int:
    """Write ``parts`` in order to ``fd`` (a new file opened with ``O_DIRECT``); bytes written.

    Whole :data:`ALIGN` blocks go straight to the device; the bytes after the last one (the end
    of a record whose length is not a multiple of it) are written buffered, with ``O_DIRECT``
    turned off on ``fd`` first: measured cheaper than padding and truncating the file back. The
    file's blocks are allocated first (:func:`preallocate`), so that tail lies right after them.
    """
    views = [_bytes(p) for p in parts]
    total = sum(len(v) for v in views)
    if total % ALIGN:
        preallocate(fd, total)
    scratch = _buffer(total)
    done = 0
    vi, vo = 0, 0
    while done < total:
        fill = min(len(scratch), total - done)
        s = 0
        while s < fill:
            v = views[vi]
            k = min(len(v) - vo, fill - s)
            _copy(scratch[s:s + k], v[vo:vo + k])
            s += k
            vo += k
            if vo == len(v):
                vi, vo = vi + 1, 0
        aligned = fill // ALIGN * ALIGN
        _pwrite_all(fd, scratch[:aligned], done)
        if aligned < fill:  # the file's last bytes: buffered (a padded write would need a truncate)
            _buffered(fd)
            _pwrite_all(fd, scratch[aligned:fill], done + aligned)
        done += fill
    return total


def _libc_fallocate() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):  # not Linux with glibc or musl
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _libc_fallocate()


def preallocate(fd: int, size: int) -> bool:
    """Give the new file ``fd`` all ``size`` bytes' blocks at once (``fallocate``); False where the
    file system cannot (the writes then allocate them, as without it).

    Without it, the whole blocks written with ``O_DIRECT`` are placed at once but the buffered
    tail only at writeback, away from them: every record read from the device took two requests
    in two places (docs/performance-history.md, "Cold loads: where the time goes"). Not
    ``os.posix_fallocate``: where the file system has no ``fallocate`` the C library emulates it
    by writing every block.
    """
    return _fallocate is not None and _fallocate(fd, 0, 0, size) == 0


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    off = 0
    while off < len(data):
        n = os.pwrite(fd, data[off:], offset + off)
        if n <= 0:
            raise OSError(errno.EIO, "a write wrote nothing")
        off += n


def _buffered(fd: int) -> None:
    """Turn ``O_DIRECT`` off on ``fd`` (Linux allows it on an open file)."""
    import fcntl  # POSIX only; direct writes are never on elsewhere

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)
