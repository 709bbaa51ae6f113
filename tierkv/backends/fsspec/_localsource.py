"""One local record file: opened safely (no symlink followed, nothing but a regular file), read
with one scatter read, first only from the page cache (``RWF_NOWAIT``) where the file system
allows it; and the probes and hints around that (:func:`probe_nowait`, :func:`may_be_cached`,
:func:`touch_in_order`). The driver that runs these reads on its threads is
:mod:`tierkv.backends.fsspec._local`."""

from __future__ import annotations

import contextlib
import errno
import os
import time
from typing import Any

from tierkv.backends.fsspec._driver import NoWaitUnsupported, WouldBlock
from tierkv.records import batchio
from tierkv.records.batchio import page_cached
from tierkv.records.read import SpecialFile
from tierkv.records.tempnames import temp_name

__all__ = ["NOWAIT_REFUSED", "RWF_NOWAIT", "LocalSource", "may_be_cached", "probe_nowait", "touch_in_order"]

RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
#: what a file system that cannot read "only from the page cache" answers ``RWF_NOWAIT`` with
NOWAIT_REFUSED = frozenset({errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})


#: errors that mean "not a regular file" once a path opened (a FIFO, a directory, a device)
_NOT_REGULAR = (errno.ESPIPE, errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.EAGAIN)


_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


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

    __slots__ = ("nowait", "path")

    def __init__(self, path: str, nowait: bool = False) -> None:
        self.path = path
        self.nowait = nowait and RWF_NOWAIT is not None

    def readinto(self, bufs: list[Any]) -> int | None:
        """One read into ``bufs``, the GIL released for the whole of it. Regular files read short
        only at their end, so a result equal to the total length of ``bufs`` means the file is at
        least that long."""
        return self._read(bufs)

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
