"""Batch record I/O in Python: the fallback of the C module ``tierkv.records._batchio``, same API and
results.

:mod:`tierkv.records.batchio` documents the API and picks one of the two; the tests run every
case against both. The system calls are the ones the C module makes, one Python call each (each
releases the GIL while it runs, but the interpreter is taken back between them).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import stat
import threading
from collections.abc import Callable, Sequence
from typing import Any

from tierkv.records import directio

__all__ = ["ALIGN", "CHUNK_BYTES", "make_dirs", "read_batch", "write_batch"]

ALIGN = directio.ALIGN
CHUNK_BYTES = directio.CHUNK_BYTES
_MAX_PARTS = 1024
_O_DIRECT = directio.O_DIRECT
_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
_OPEN = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_REFUSED = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS})

Buffers = Any  # a buffer, or a list/tuple of buffers filled (or written) in order


class _Scratch(threading.local):
    buf: mmap.mmap | None = None


_scratch = _Scratch()


def make_dirs(d: str, mode: int) -> None:
    """Create ``d`` and its missing parents, each with ``mode`` (``os.makedirs`` gives the parents
    the umask's default, 0o755 under the usual umask)."""
    missing = []
    p = d
    while p and p != "/" and not os.path.isdir(p):
        missing.append(p)
        p = os.path.dirname(p)
    for p in reversed(missing):
        try:
            os.mkdir(p, mode)
        except FileExistsError:
            continue
        if mode != 0o700:  # what the umask took from a wider mode
            with contextlib.suppress(OSError):
                os.chmod(p, mode)


def _aligned_scratch() -> memoryview:
    if _scratch.buf is None:
        _scratch.buf = mmap.mmap(-1, CHUNK_BYTES)  # page-aligned
    return memoryview(_scratch.buf)


def _views(item: Buffers, writable: bool, index: int) -> list[memoryview]:
    objs = list(item) if isinstance(item, (list, tuple)) else [item]
    if len(objs) > _MAX_PARTS:
        raise ValueError(f"item {index} has {len(objs)} buffers; at most {_MAX_PARTS}")
    out = []
    for o in objs:
        mv = memoryview(o)
        if not mv.c_contiguous:
            raise ValueError(f"item {index}: buffers must be C-contiguous")
        if writable and mv.readonly:
            raise TypeError(f"item {index}: a read needs writable buffers, got a read-only "
                            f"{type(o).__name__}")
        out.append(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv)
    return out


def _from(views: list[memoryview], off: int) -> list[memoryview]:
    """The views from logical offset ``off`` on."""
    out = []
    for v in views:
        if off >= len(v):
            off -= len(v)
            continue
        out.append(v[off:])
        off = 0
    return out


def _copy(views: list[memoryview], off: int, flat: memoryview, to_views: bool) -> None:
    n, pos = len(flat), 0
    for v in views:
        if n == 0:
            break
        if off >= len(v):
            off -= len(v)
            continue
        k = min(len(v) - off, n)
        if to_views:
            v[off:off + k] = flat[pos:pos + k]
        else:
            flat[pos:pos + k] = v[off:off + k]
        pos, n, off = pos + k, n - k, 0


def _no_direct(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


# ---- reads ------------------------------------------------------------------------------------------
class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_CACHESTAT = 451  # the same number on every architecture (Linux 6.5)


def _syscall() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    if fn(_CACHESTAT, -1, ctypes.byref(_Range()), ctypes.byref(_CacheStat()), 0) == 0 \
            or ctypes.get_errno() != errno.EBADF:  # no cachestat in this kernel (ENOSYS)
        return None
    return fn


_cachestat = _syscall() if os.uname().sysname == "Linux" else None


def has_cachestat() -> bool:
    """Whether this kernel answers :func:`page_cached` (Linux 6.5 and later)."""
    return _cachestat is not None


def page_cached(fd: int, size: int) -> bool | None:
    """Whether the page cache holds every page of the first ``size`` bytes of ``fd``, asked without
    reading (``cachestat``); None where the kernel cannot say (before Linux 6.5).

    A page-cache-only read (``RWF_NOWAIT``) of a record that is not there starts the kernel's
    readahead of it before it gives up: the read that follows finds it on its way, but the
    non-blocking pass then did a cold read's work, one record after the other.
    """
    if _cachestat is None:
        return None
    if size <= 0:
        return True
    rng, st = _Range(0, size), _CacheStat()
    if _cachestat(_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        return None
    return bool(st.nr_cache >= -(-size // mmap.PAGESIZE))


def _read_buffered(fd: int, views: list[memoryview], total: int, nowait: bool) -> int:
    off = 0
    while off < total:
        parts = _from(views, off)
        try:
            if nowait and _RWF_NOWAIT is not None:
                n = os.preadv(fd, parts, off, _RWF_NOWAIT)
            else:
                n = os.preadv(fd, parts, off)
        except BlockingIOError:
            if nowait:
                return -errno.EAGAIN
            raise
        except OSError as exc:
            if nowait and exc.errno in _REFUSED:
                return -errno.EOPNOTSUPP
            raise
        if n == 0:
            break
        off += n
    return off


def _read_direct(fd: int, views: list[memoryview], total: int) -> int | None:
    """Aligned chunks through the scratch; None when the file system refused the first read."""
    buf = _aligned_scratch()
    off = 0
    while off < total:
        want = min(total - off, CHUNK_BYTES)
        ask = -(-want // ALIGN) * ALIGN
        try:
            n = os.preadv(fd, [buf[:ask]], off)
        except OSError as exc:
            if off == 0 and exc.errno in _REFUSED:
                return None
            raise
        got = min(n, want)
        _copy(views, off, buf[:got], True)
        off += got
        if n < ask:
            break
    return off


def _read_one(path: str | bytes, views: list[memoryview], direct: bool, nowait: bool) -> int:
    total = sum(len(v) for v in views)
    direct = direct and bool(_O_DIRECT)
    try:
        fd = os.open(path, _OPEN | (_O_DIRECT if direct else 0))
    except OSError as exc:
        if not (direct and exc.errno in _REFUSED):
            return -(exc.errno or errno.EIO)
        direct = False
        try:
            fd = os.open(path, _OPEN)
        except OSError as exc2:
            return -(exc2.errno or errno.EIO)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return -errno.ESPIPE
        if direct:
            got = _read_direct(fd, views, total)
            if got is not None:
                return got
            _no_direct(fd)
            return _read_buffered(fd, views, total, False)
        if nowait and page_cached(fd, os.fstat(fd).st_size) is False:
            return -errno.EAGAIN
        return _read_buffered(fd, views, total, nowait)
    except OSError as exc:
        return -(exc.errno or errno.EIO)
    finally:
        os.close(fd)


def read_batch(paths: Sequence[str | bytes], bufs: Sequence[Buffers], direct: bool = False,
               nowait: bool = False) -> list[int]:
    """See :func:`tierkv.records.batchio.read_batch`."""
    paths, bufs = list(paths), list(bufs)  # copies: __fspath__ may change the caller's lists
    if len(paths) != len(bufs):
        raise ValueError(f"{len(paths)} paths but {len(bufs)} buffers")
    encoded = [os.fsencode(p) for p in paths]
    views = [_views(b, True, i) for i, b in enumerate(bufs)]
    return _run(len(encoded), lambda i: _read_one(encoded[i], views[i], direct, nowait))


# ---- writes -----------------------------------------------------------------------------------------
def _write_buffered(fd: int, views: list[memoryview], total: int) -> None:
    off = 0
    while off < total:
        n = os.pwritev(fd, _from(views, off), off)
        if n <= 0:
            raise OSError(errno.EIO, "a write wrote nothing")
        off += n


def _write_temp(tmp: bytes, views: list[memoryview], total: int, direct: bool, fsync: bool, mode: int,
                dir_mode: int) -> None:
    """The new file ``tmp`` with the record's bytes (removed again when anything fails)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | (_O_DIRECT if direct else 0)
    try:
        fd = os.open(tmp, flags, mode)
    except FileNotFoundError:
        make_dirs(os.fsdecode(os.path.dirname(tmp)), dir_mode)
        fd = os.open(tmp, flags, mode)
    try:
        if mode != 0o600:  # what the umask took from a wider mode
            with contextlib.suppress(OSError):
                os.fchmod(fd, mode)
        if direct:
            directio.write_file(fd, views)
        else:
            _write_buffered(fd, views, total)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quiet(tmp)
        raise
    try:
        os.close(fd)
    except BaseException:
        _unlink_quiet(tmp)
        raise


def _write_one(final: bytes, tmp: bytes, views: list[memoryview], fsync: bool, mode: int, direct: bool,
               direct_min: int, dir_mode: int, flags: list[int]) -> int:
    """Bytes written or -errno; ``flags[0]``/``flags[1]``: written direct / direct refused."""
    total = sum(len(v) for v in views)
    direct = direct and bool(_O_DIRECT) and total >= direct_min
    try:
        if direct:
            try:
                _write_temp(tmp, views, total, True, fsync, mode, dir_mode)
                flags[0] = 1
            except OSError as exc:
                if exc.errno not in _REFUSED:
                    raise
                flags[1] = 1
                direct = False
        if not direct:
            _write_temp(tmp, views, total, False, fsync, mode, dir_mode)
        try:
            os.replace(tmp, final)
        except BaseException:
            flags[0] = 0
            _unlink_quiet(tmp)
            raise
        if fsync:
            dfd = os.open(os.path.dirname(final) or b".", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except OSError as exc:
        return -(exc.errno or errno.EIO)
    return total


def write_batch(items: Sequence[tuple[Any, Any, Buffers]], fsync: bool = False, mode: int = 0o600,
                direct: bool = False, direct_min: int = 65536,
                dir_mode: int | None = None) -> tuple[list[int], int, int]:
    """See :func:`tierkv.records.batchio.write_batch`."""
    if not 0 <= mode <= 0o7777:
        raise ValueError(f"mode must be a permission mode, got {mode}")
    dmode = mode | ((mode & 0o444) >> 2) if dir_mode is None else dir_mode
    if not 0 <= dmode <= 0o7777:
        raise ValueError(f"dir_mode must be a permission mode, got {dmode}")
    jobs = []
    for i, it in enumerate(list(items)):
        if not isinstance(it, tuple) or len(it) != 3:
            raise TypeError(f"item {i} must be a tuple (final_path, tmp_path, buffers)")
        jobs.append((os.fsencode(it[0]), os.fsencode(it[1]), _views(it[2], False, i)))
    flags = [[0, 0] for _ in jobs]
    sizes = _run(len(jobs), lambda i: _write_one(*jobs[i], fsync, mode, direct, direct_min, dmode,
                                                          flags[i]))
    return sizes, sum(f[0] for f in flags), sum(f[1] for f in flags)


# ---- a batch -----------------------------------------------------------------------------------------
def _run(n: int, one: Callable[[int], int]) -> list[int]:
    """``one(i)`` for every item, in turn. On the main thread the items run in a thread of their
    own that the caller waits for: an interrupt reaches the caller, never an item half done (a
    temporary file is always removed or renamed), and stops items from starting while the one
    started ends.

    The caller waits on the thread's own event, not ``Thread.join``: a join interrupted by Ctrl-C
    can mark a thread that is still running as ended (Python before 3.13), and the batch then
    returned while an item was still writing its temporary file.
    """
    if threading.current_thread() is not threading.main_thread():
        return [one(i) for i in range(n)]  # a worker thread: no interrupt lands here
    results = [0] * n
    stop = [False]
    failed: list[BaseException] = []
    done = threading.Event()

    def work() -> None:
        try:
            for i in range(n):
                if stop[0]:
                    return
                results[i] = one(i)
        except BaseException as exc:  # handed to the caller
            failed.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=work, daemon=True)
    try:
        worker.start()
        done.wait()
    except BaseException:  # an interrupt (it may land while the thread starts): wait for its item
        stop[0] = True
        if worker.ident is not None:
            done.wait()
        raise
    if failed:
        raise failed[0]
    return results


def _unlink_quiet(path: bytes) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
