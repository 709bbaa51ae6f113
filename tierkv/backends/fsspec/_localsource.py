"""One local record file: opened safely (no symlink followed, nothing but a regular file), read
with one scatter read, first only from the page cache (``RWF_NOWAIT``) where the file system
allows it, or with ``O_DIRECT`` straight into a page-aligned row (a tier's ``direct_reads``); and
the probes and hints around that (:func:`probe_nowait`, :func:`may_be_cached`,
:func:`touch_in_order`). The driver that runs these reads on its threads is
:mod:`tierkv.backends.fsspec._local`."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import threading
import time
from typing import Any

import numpy as np

from tierkv.backends.fsspec._driver import NoWaitUnsupported, WouldBlock
from tierkv.records import batchio
from tierkv.records.batchio import page_cached
from tierkv.records.directio import ALIGN, O_DIRECT, UNSUPPORTED
from tierkv.records.read import SpecialFile
from tierkv.records.tempnames import temp_name

__all__ = ["NOWAIT_REFUSED", "RWF_NOWAIT", "LocalSource", "may_be_cached", "probe_nowait", "touch_in_order"]

RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
#: what a file system that cannot read "only from the page cache" answers ``RWF_NOWAIT`` with
NOWAIT_REFUSED = frozenset({errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})


#: errors that mean "not a regular file" once a path opened (a FIFO, a directory, a device)
_NOT_REGULAR = (errno.ESPIPE, errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.EAGAIN)


_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


_DIRECT_FLAGS = _OPEN_FLAGS | O_DIRECT


class _Pages(threading.local):
    buf: mmap.mmap | None = None


_pages = _Pages()


def _page_buffer(n: int) -> memoryview:
    """This thread's page-aligned buffer of at least ``n`` bytes (an anonymous mapping)."""
    buf = _pages.buf
    if buf is None or len(buf) < n:
        buf = _pages.buf = mmap.mmap(-1, -(-n // ALIGN) * ALIGN)
    return memoryview(buf)


def _page_aligned(buf: Any) -> bool:
    """Whether ``buf`` starts on a page and is a whole number of pages long."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data % ALIGN == 0 and arr.nbytes % ALIGN == 0 and arr.nbytes > 0


def _special(exc: OSError, path: str) -> OSError:
    """``exc`` as :class:`SpecialFile` when it says the path is not a regular file, else itself."""
    if exc.errno in (errno.ELOOP, errno.EMLINK):
        return SpecialFile(errno.ELOOP, "a symlink where a record should be", path)
    if exc.errno in _NOT_REGULAR:
        return SpecialFile(exc.errno, "not a regular file where a record should be", path)
    return exc


def probe_nowait(directory: str) -> bool | None:
    """Whether the file system of ``directory`` reads "only what the page cache holds"
    (``RWF_NOWAIT``); None when no probe file could be written there (a read-only root)."""
    if RWF_NOWAIT is None:
        return False
    path = temp_name(f"{directory}/nowait-probe")  # a temporary: a crashed probe's file is swept
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:
        return None
    try:
        os.write(fd, b"tierkv")
        os.preadv(fd, [bytearray(6)], 0, RWF_NOWAIT)
        return True
    except BlockingIOError:
        return True
    except OSError as exc:
        if exc.errno in NOWAIT_REFUSED:
            return False
        return None
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class LocalSource:
    """A record in a local (or mounted) file, read by the batch reader of :mod:`tierkv.records.batchio`
    (the C module, or its Python twin where it is not built): opened without following a symlink,
    refused unless a regular file, one scatter read.

    With ``nowait``, reads take only what the page cache holds and raise :class:`WouldBlock`
    when the device would have to be waited for (the driver then retries on a thread that may
    block), so page-cache hits never queue behind reads of cold records.
    """

    __slots__ = ("direct", "nowait", "path")

    def __init__(self, path: str, nowait: bool = False, direct: bool = False) -> None:
        self.path = path
        self.nowait = nowait and RWF_NOWAIT is not None
        self.direct = direct and bool(O_DIRECT) and not self.nowait

    def readinto(self, bufs: list[Any]) -> int | None:
        """One read into ``bufs``, the GIL released for the whole of it. Regular files read short
        only at their end, so a result equal to the total length of ``bufs`` means the file is at
        least that long.

        With ``direct``, the in-place read of a page-aligned record (``bufs`` is a header of whole
        pages, a row on a page boundary of whole pages, and a trailer buffer) is one ``O_DIRECT``
        read: the header and the trailer's page into this thread's page buffer, the block straight
        into the row, nothing through the page cache. Any other read, or a file system that refuses
        ``O_DIRECT``, is buffered."""
        if self.direct and len(bufs) == 3 and len(bufs[0]) % ALIGN == 0 and len(bufs[2]) <= ALIGN \
                and _page_aligned(bufs[1]):
            got = self._read_direct(bufs[0], bufs[1], bufs[2])
            if got != -1:
                return got
        return self._read(bufs)

    def _read_direct(self, head: Any, row: Any, tail: Any) -> int | None:
        """The direct read of :meth:`readinto`; -1 when the file system refuses it."""
        try:
            fd = os.open(self.path, _DIRECT_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in UNSUPPORTED:
                return -1
            raise _special(exc, self.path) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SpecialFile(errno.ESPIPE, "not a regular file where a record should be", self.path)
            pages = _page_buffer(len(head) + ALIGN)
            got = os.preadv(fd, [pages[:len(head)], row, pages[len(head):len(head) + ALIGN]], 0)
        except OSError as exc:
            if exc.errno in UNSUPPORTED:
                return -1
            raise _special(exc, self.path) from None
        finally:
            os.close(fd)
        head[:] = pages[:len(head)]
        past = max(0, min(got - len(head) - memoryview(row).nbytes, len(tail)))
        tail[:past] = pages[len(head):len(head) + past]
        return min(got, len(head) + memoryview(row).nbytes + len(tail))

    def _read(self, bufs: list[Any]) -> int | None:
        got: int = batchio.read_batch([self.path], [bufs], False, self.nowait)[0]
        if got >= 0:
            return got
        self._failed(-got)
        return None

    def _failed(self, err: int) -> None:
        """Raise a read's ``-errno`` as the driver expects (an absent file, ENOENT, raises
        nothing: the read's result is None)."""
        if err == errno.ENOENT:
            return
        if self.nowait and err == errno.EAGAIN:
            raise WouldBlock
        if self.nowait and err == errno.EOPNOTSUPP:
            raise NoWaitUnsupported(err)
        raise _special(OSError(err, os.strerror(err), self.path), self.path)

    def read_all(self, buf: memoryview) -> memoryview | None:
        """The record's bytes (at most ``len(buf)``), read into ``buf``; None when absent."""
        got = self._read([buf])
        return None if got is None else buf[:got]


def may_be_cached(path: str) -> bool:
    """False only when the page cache is known not to hold all of the record at ``path``."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return True
    try:
        return page_cached(fd, os.fstat(fd).st_size) is not False
    except OSError:
        return True
    finally:
        os.close(fd)


def touch_in_order(paths: list[str]) -> None:
    """Refresh the file times of ``paths``, the first the newest (as ``write_records`` writes them)."""
    base = time.time_ns()
    for i, p in enumerate(paths):
        when = base + (len(paths) - i) * 1000
        with contextlib.suppress(FileNotFoundError):
            os.utime(p, ns=(when, when), follow_symlinks=False)
