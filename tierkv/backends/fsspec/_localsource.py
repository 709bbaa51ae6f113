"""One local record file: opened safely (no symlink followed, nothing but a regular file), read
with one scatter read, first only from the page cache (``RWF_NOWAIT``) where the file system
allows it; and the probes and hints around that (:func:`probe_nowait`, :func:`may_be_cached`,
:func:`touch_in_order`). The driver that runs these reads on its threads is
:mod:`tierkv.backends.fsspec._local`."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
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
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


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


def _open_record(path: str) -> int | None:
    """A read-only descriptor of ``path``; None when absent.

    ``O_NONBLOCK`` makes a FIFO or a device open (and read) at once instead of blocking, and a
    symlink is never followed: anything but a regular file ends in :class:`SpecialFile`, here or
    at the first read.
    """
    try:
        return os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _special(exc, path) from None


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
    """A record in a local (or mounted) file.

    With ``nowait``, reads take only what the page cache holds and raise :class:`WouldBlock`
    when the device would have to be waited for (the driver then retries on a thread that may
    block), so page-cache hits never queue behind reads of cold records.
    """

    __slots__ = ("nowait", "path")

    def __init__(self, path: str, nowait: bool = False) -> None:
        self.path = path
        self.nowait = nowait and RWF_NOWAIT is not None

    def _read(self, fd: int, bufs: list[Any]) -> int:
        try:
            if not self.nowait:
                return os.readv(fd, bufs)
            if page_cached(fd, os.fstat(fd).st_size) is False:
                raise WouldBlock
            try:
                got = os.preadv(fd, bufs, 0, RWF_NOWAIT)  # type: ignore[arg-type]
            except BlockingIOError:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    raise WouldBlock from None
                raise
            except OSError as exc:
                if exc.errno in NOWAIT_REFUSED and stat.S_ISREG(os.fstat(fd).st_mode):
                    raise NoWaitUnsupported(exc.errno) from None
                raise
            if got % _PAGE == 0 and got < sum(memoryview(b).nbytes for b in bufs):
                # short at a page boundary: the file ends here, or the page cache holds no more
                # of it (a read that stops inside a page stopped at the end of the file: pages
                # are cached whole)
                try:
                    if os.preadv(fd, [bytearray(1)], got, RWF_NOWAIT):  # type: ignore[arg-type]
                        raise WouldBlock
                except BlockingIOError:
                    raise WouldBlock from None
            return got
        except OSError as exc:
            raise _special(exc, self.path) from None

    def readinto(self, bufs: list[Any]) -> int | None:
        """One read into ``bufs``. Regular files read short only at their end, so a result equal
        to the total length of ``bufs`` means the file is at least that long."""
        c = batchio.native()
        if c is not None:  # open, read and close in one call of the C module, the GIL released
            got: int = c.read_batch([self.path], [bufs], False, self.nowait, 1)[0]
            if got >= 0:
                return got
            self._failed(-got)
            return None
        try:
            fd = os.open(self.path, _OPEN_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _special(exc, self.path) from None
        try:
            return self._read(fd, bufs)
        finally:
            os.close(fd)

    def _failed(self, err: int) -> None:
        """Raise the C module's ``-errno`` of a read as the Python path does (an absent file, ENOENT,
        raises nothing: the read's result is None)."""
        if err == errno.ENOENT:
            return
        if self.nowait and err == errno.EAGAIN:
            raise WouldBlock
        if self.nowait and err == errno.EOPNOTSUPP:
            raise NoWaitUnsupported(err)
        raise _special(OSError(err, os.strerror(err), self.path), self.path)

    def read_all(self, buf: memoryview) -> memoryview | None:
        """The record's bytes (at most ``len(buf)``), read into ``buf``; None when absent."""
        fd = _open_record(self.path)
        if fd is None:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SpecialFile(errno.EINVAL, "not a regular file where a record should be", self.path)
            got = self._read(fd, [buf])
            while not self.nowait and 0 < got < len(buf):  # regular files read short only at
                more = os.readv(fd, [buf[got:]])            # the end, but be sure
                if not more:
                    break
                got += more
            return buf[:got]
        finally:
            os.close(fd)


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
