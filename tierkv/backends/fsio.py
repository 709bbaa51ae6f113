"""File I/O behind the ``fsspec`` tier: local paths with os calls, other fsspec file systems.

Three drivers share one small interface: ``LocalDriver`` (``file://`` and plain paths: os calls
in worker threads, temporary name + ``os.replace``, optional fsync), ``SyncDriver`` (any synchronous
fsspec file system, e.g. ``memory://``: temporary name + move) and ``AsyncDriver`` (asynchronous
fsspec file systems such as s3fs: one PUT publishes a whole object, so no temporary name).

A tier hands each driver the same per-record jobs (:meth:`Driver.write_each`,
:meth:`Driver.read_each`); the driver decides where they run: local jobs run whole in a worker
thread beside their system calls (a scatter read straight into the caller's row, say), remote
ones after (or before) the request, in a worker thread when the batch is large. A record's path
that holds anything but a regular file (a FIFO, a device, a symlink) is :class:`SpecialFile`,
never opened for reading: a reader would block in ``open`` beyond any cancel scope.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import secrets
import socket
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import anyio

__all__ = ["AsyncDriver", "BytesSource", "Driver", "Entry", "LocalDriver", "LocalSource", "RecordSource",
           "SpecialFile", "SyncDriver", "TEMP_MARK", "WouldBlock", "temp_owner_alive"]

T = TypeVar("T")
R = TypeVar("R")

#: batches of about this many bytes or fewer have their CPU work done inline, larger ones in a
#: worker thread
INLINE_BYTES = 1 << 20

#: temporary files are ``.<name>.tkvtmp-<host>-<pid>-<random>``: host and pid say who wrote them
TEMP_MARK = ".tkvtmp-"
_HOST = socket.gethostname().replace("-", "_")[:32] or "host"


@dataclass(frozen=True)
class Entry:
    """One listed file: path, size in bytes, modification time (seconds since the epoch)."""

    path: str
    size: int
    mtime: float


class SpecialFile(OSError):
    """A record's path holds something that is not a regular file (FIFO, device, symlink, ...)."""


class RecordSource(Protocol):
    """One record's bytes, wherever they are: a file to read, or bytes already fetched."""

    def readinto(self, bufs: list[Any]) -> int | None:
        """Fill ``bufs`` in order from the start of the record; bytes read, None when absent."""

    def read_all(self, buf: memoryview) -> memoryview | None:
        """The record's bytes (at most ``len(buf)``; ``buf`` may receive them); None when absent."""


class WouldBlock(Exception):
    """A read would wait for the device: the record is not (all) in the page cache."""


#: ``preadv2`` flag: fail instead of waiting for the device (Linux; None where unknown)
RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)


#: errors that mean "not a regular file" once a path opened (a FIFO, a directory, a device)
_NOT_REGULAR = (errno.ESPIPE, errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.EAGAIN)


def _open_record(path: str) -> int | None:
    """A read-only descriptor of ``path``; None when absent.

    ``O_NONBLOCK`` makes a FIFO or a device open (and read) at once instead of blocking, and a
    symlink is never followed: anything but a regular file ends in :class:`SpecialFile`, here or
    at the first read.
    """
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise SpecialFile(errno.ELOOP, "a symlink where a record should be", path) from None
        if exc.errno in _NOT_REGULAR:
            raise SpecialFile(exc.errno, "not a regular file where a record should be", path) from None
        raise


class LocalSource:
    """A record in a local (or mounted) file.

    With ``nowait``, reads take only what the page cache holds and raise :class:`WouldBlock`
    when the device would have to be waited for (the driver then retries on a thread that may
    block), so page-cache hits never queue behind reads of cold records.
    """

    def __init__(self, path: str, nowait: bool = False) -> None:
        self.path = path
        self.nowait = nowait and RWF_NOWAIT is not None

    def _read(self, fd: int, bufs: list[Any]) -> int:
        try:
            if not self.nowait or RWF_NOWAIT is None:
                return os.readv(fd, bufs)
            try:
                got = os.preadv(fd, bufs, 0, RWF_NOWAIT)
            except BlockingIOError:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    raise WouldBlock from None
                raise
            if got < sum(memoryview(b).nbytes for b in bufs):
                # short: the file ends here, or the page cache holds no more of it
                try:
                    if os.preadv(fd, [bytearray(1)], got, RWF_NOWAIT):
                        raise WouldBlock
                except BlockingIOError:
                    raise WouldBlock from None
            return got
        except OSError as exc:
            if exc.errno in _NOT_REGULAR:
                raise SpecialFile(exc.errno, "not a regular file where a record should be",
                                  self.path) from None
            raise

    def readinto(self, bufs: list[Any]) -> int | None:
        """One read into ``bufs``. Regular files read short only at their end, so a result equal
        to the total length of ``bufs`` means the file is at least that long."""
        fd = _open_record(self.path)
        if fd is None:
            return None
        try:
            return self._read(fd, bufs)
        finally:
            os.close(fd)

    def read_all(self, buf: memoryview) -> memoryview | None:
        """The record's bytes (at most ``len(buf)``), read into ``buf``; None when absent."""
        fd = _open_record(self.path)
        if fd is None:
            return None
        try:
            got = self._read(fd, [buf])
            while not self.nowait and 0 < got < len(buf):  # regular files read short only at
                more = os.readv(fd, [buf[got:]])            # the end, but be sure
                if not more:
                    break
                got += more
            return buf[:got]
        finally:
            os.close(fd)


class BytesSource:
    """A record fetched whole (an object store's GET)."""

    def __init__(self, data: bytes | None) -> None:
        self.data = data

    def readinto(self, bufs: list[Any]) -> int | None:
        """Copy the bytes into ``bufs`` in order."""
        if self.data is None:
            return None
        view = memoryview(self.data)
        done = 0
        for b in bufs:
            dst = memoryview(b).cast("B")
            n = min(len(dst), len(view) - done)
            dst[:n] = view[done:done + n]
            done += n
            if n < len(dst):
                break
        return done

    def read_all(self, buf: memoryview) -> memoryview | None:
        """The bytes (at most ``len(buf)``), without a copy."""
        return None if self.data is None else memoryview(self.data)[:len(buf)]


def temp_name(path: str) -> str:
    """A unique temporary name beside ``path``."""
    head, _, tail = path.rpartition("/")
    return f"{head}/.{tail}{TEMP_MARK}{_HOST}-{os.getpid()}-{secrets.token_hex(6)}"


def temp_owner_alive(name: str) -> bool | None:
    """Whether the process that wrote temporary file ``name`` still runs (None: another host)."""
    _, _, owner = name.partition(TEMP_MARK)
    parts = owner.split("-")
    if len(parts) != 3 or parts[0] != _HOST or not parts[1].isdigit():
        return None
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Driver:
    """What the fsspec tier needs from a file system. Paths are absolute, ``/``-separated."""

    def __init__(self, limiter: anyio.CapacityLimiter) -> None:
        self.limiter = limiter

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking I/O ``fn`` in a worker thread bounded by this tier's limiter."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work (encoding, checking records) in a worker thread; it takes no I/O slot."""
        return await anyio.to_thread.run_sync(fn, *args)

    async def write_many(self, items: list[tuple[str, bytes | list[Any]]]) -> list[BaseException | None]:
        """Publish each ``(path, data)`` atomically; per item, None or the error it raised."""
        raise NotImplementedError

    async def read_many(self, paths: list[str], limit: int) -> list[bytes | BaseException | None]:
        """Per path its bytes (at most ``limit + 1``), None when absent, or the error raised."""
        raise NotImplementedError

    async def exists_many(self, paths: list[str]) -> list[bool]:
        """Per path, whether it exists."""
        raise NotImplementedError

    async def delete_many(self, paths: list[str]) -> None:
        """Remove paths; absent ones are ignored."""
        raise NotImplementedError

    async def listdir(self, root: str) -> list[Entry]:
        """Every file under ``root`` (recursively), temporary files included."""
        raise NotImplementedError

    async def write_each(self, paths: list[str], job: Callable[[int], list[Any] | None],
                         nbytes: int) -> list[int | BaseException | None]:
        """Publish the record ``job(i)`` returns (pieces, or None: skip it) at ``paths[i]``.

        Per item: its size, None when skipped, or the error. ``nbytes`` (about the batch's size)
        decides whether the jobs run inline or in a worker thread.
        """
        def encode_all() -> list[bytes | None]:
            out: list[bytes | None] = []
            for i in range(len(paths)):
                parts = job(i)  # pieces may view per-thread scratch: join them at once
                out.append(None if parts is None else b"".join(bytes(memoryview(p)) for p in parts))
            return out

        blobs = encode_all() if nbytes <= INLINE_BYTES else await self.compute(encode_all)
        results: list[int | BaseException | None] = [None] * len(paths)
        todo = [i for i, b in enumerate(blobs) if b is not None]
        errors = await self.write_many([(paths[i], blobs[i]) for i in todo])  # type: ignore[misc]
        for i, err in zip(todo, errors, strict=True):
            results[i] = err if err is not None else len(blobs[i])  # type: ignore[arg-type]
        return results

    async def read_each(self, paths: list[str], limit: int, job: Callable[[int, RecordSource], R],
                        nbytes: int) -> list[R | BaseException]:
        """``job(i, source)`` over each record's bytes (at most ``limit``); per item its result or
        the error reading it raised (an ``OSError`` the job raises counts as one)."""
        datas = await self.read_many(paths, limit - 1)

        def check_all() -> list[R | BaseException]:
            out: list[R | BaseException] = []
            for i, d in enumerate(datas):
                if isinstance(d, BaseException):
                    out.append(d)
                    continue
                try:
                    out.append(job(i, BytesSource(d)))
                except OSError as exc:
                    out.append(exc)
            return out

        return check_all() if nbytes <= INLINE_BYTES else await self.compute(check_all)

    async def write_small(self, path: str, data: bytes) -> None:
        """Publish a small file atomically (namespace manifests)."""
        errs = await self.write_many([(path, data)])
        if errs[0] is not None:
            raise errs[0]

    async def close(self) -> None:
        """Release connections."""


def _chunks(n: int, parts: int) -> list[range]:
    if n <= 0:
        return []
    parts = max(1, min(parts, n))
    step = -(-n // parts)
    return [range(i, min(n, i + step)) for i in range(0, n, step)]


class LocalDriver(Driver):
    """Local (or mounted: NFS, any shared directory) file system through os calls.

    The driver owns a pool of ``threads`` worker threads, which bounds the tier's concurrency
    (``limiter`` is not used here). Jobs go straight to the pool's queue, so a thread that finishes
    one job starts the next without a round trip through the event loop: with page-cache reads of
    30 us, that round trip was a fifth of a load (docs/performance.md). A caller cancelled while its
    jobs run still waits for them: they write into the caller's buffers.
    """

    def __init__(self, limiter: anyio.CapacityLimiter, threads: int, fsync: bool, depth: int = 16) -> None:
        super().__init__(limiter)
        self.threads = threads
        self.depth = max(depth, threads)
        self.fsync = fsync
        self._dirs: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierkv-io")
        #: reads of records not in the page cache: they wait for the device, many at once
        self._cold: ThreadPoolExecutor | None = None
        self._calls = 0  # map() calls in flight

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking ``fn`` in one of this driver's threads."""
        return (await self._run_all([functools.partial(fn, *args)]))[0]

    async def _run_all(self, calls: list[Callable[[], T]], stop: list[bool] | None = None,
                       pool: ThreadPoolExecutor | None = None) -> list[T]:
        """Run ``calls`` on the pool; their results in order, once every one has ended.

        On cancellation (or an error) the calls not started are dropped, ``stop[0]`` is set for
        those running to end early, and this waits for them before it raises.
        """
        jobs = [(pool or self._pool).submit(c) for c in calls]
        try:
            return [await asyncio.wrap_future(j) for j in jobs]
        except BaseException:
            if stop is not None:
                stop[0] = True
            for j in jobs:
                j.cancel()
            running = [asyncio.wrap_future(j) for j in jobs if not j.done()]
            if running:
                with anyio.CancelScope(shield=True):
                    await asyncio.wait(running)
            raise

    async def map(self, fn: Callable[[int], T], n: int) -> list[T | OSError]:
        """``fn(i)`` for ``i`` in ``range(n)``, in chunks over this driver's worker threads.

        Per item, what ``fn`` returned or the ``OSError`` it raised: a tier does a whole per-record
        job (encode + write) in one worker thread, with no intermediate buffers handed back. A
        cancelled call returns once the items already running have ended; no other item starts.
        """
        results: list[T | OSError] = [None] * n  # type: ignore[list-item]
        stop = [False]

        def chunk(idx: range) -> None:
            for i in idx:
                if stop[0]:
                    return
                try:
                    results[i] = fn(i)
                except (OSError, WouldBlock) as exc:
                    results[i] = exc  # type: ignore[assignment]

        # split a call over the threads only when there are not already enough calls to keep them busy
        parts = 1 if self._calls >= self.threads else self.threads
        self._calls += 1
        try:
            await self._run_all([functools.partial(chunk, idx) for idx in _chunks(n, parts)], stop)
        finally:
            self._calls -= 1
        return results

    async def close(self) -> None:
        """Stop the worker threads (after the jobs already queued)."""
        await anyio.to_thread.run_sync(self._pool.shutdown)
        if self._cold is not None:
            await anyio.to_thread.run_sync(self._cold.shutdown)

    async def write_each(self, paths: list[str], job: Callable[[int], list[Any] | None],
                         nbytes: int) -> list[int | BaseException | None]:
        """Encode and publish each record in one worker thread (``writev`` of its pieces)."""

        def one(i: int) -> int | None:
            parts = job(i)
            if parts is None:
                return None
            self._write_one(paths[i], parts)
            return sum(memoryview(p).nbytes for p in parts)

        return list(await self.map(one, len(paths)))

    async def read_each(self, paths: list[str], limit: int, job: Callable[[int, RecordSource], R],
                        nbytes: int) -> list[R | BaseException]:
        """Each job runs in a worker thread on the file itself (a scatter read into its rows).

        Jobs first run on the CPU-count threads reading only what the page cache holds; those
        whose record must come from the device run again on up to ``depth`` threads that wait
        for it, so a cold batch keeps the device busy without slowing down warm reads.
        """
        results: list[Any] = await self.map(lambda i: job(i, LocalSource(paths[i], nowait=True)),
                                             len(paths))
        cold = [i for i, r in enumerate(results) if isinstance(r, WouldBlock)]
        if cold:
            if self._cold is None:
                self._cold = ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="tierkv-io-wait")
            stop = [False]

            def one(i: int) -> None:
                if stop[0]:
                    return
                try:
                    results[i] = job(i, LocalSource(paths[i]))
                except OSError as exc:
                    results[i] = exc

            await self._run_all([functools.partial(one, i) for i in cold], stop, self._cold)
        return results

    def write_one(self, path: str, data: bytes | list[Any]) -> None:
        """Publish ``data`` (bytes, or pieces written with one ``writev``) at ``path`` atomically."""
        self._write_one(path, data)

    def _write_one(self, path: str, data: bytes | list[Any]) -> None:
        d = path.rpartition("/")[0]
        if d not in self._dirs:
            os.makedirs(d, exist_ok=True)
            self._dirs.add(d)
        tmp = temp_name(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:
            # the directory vanished under us (another process or tool removed it): recreate it
            os.makedirs(d, exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
        try:
            bufs = data if isinstance(data, list) else [data]
            total = sum(memoryview(b).nbytes for b in bufs)
            done = os.writev(fd, bufs)
            if done != total:
                view = b"".join(bytes(b) for b in bufs)[done:]
                while view:
                    view = view[os.write(fd, view):]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quiet(tmp)
            raise
        os.close(fd)
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink_quiet(tmp)
            raise
        if self.fsync:
            dfd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    async def write_many(self, items: list[tuple[str, bytes | list[Any]]]) -> list[BaseException | None]:
        """Write the batch in chunks over the worker threads."""
        return await self.map(lambda i: self._write_one(*items[i]), len(items))

    @staticmethod
    def _read_one(path: str, limit: int) -> bytes | None:
        fd = _open_record(path)
        if fd is None:
            return None
        try:
            chunks, total = [], 0
            while total <= limit:
                got = os.read(fd, min(limit + 1 - total, 1 << 22))
                if not got:
                    break
                chunks.append(got)
                total += len(got)
            return b"".join(chunks)
        except OSError as exc:
            if exc.errno in _NOT_REGULAR:
                raise SpecialFile(exc.errno, "not a regular file where a record should be", path) from None
            raise
        finally:
            os.close(fd)

    async def read_many(self, paths: list[str], limit: int) -> list[bytes | BaseException | None]:
        """Read the batch in chunks over the worker threads."""
        return await self.map(lambda i: self._read_one(paths[i], limit), len(paths))

    async def exists_many(self, paths: list[str]) -> list[bool]:
        """One worker thread stats the whole batch."""
        return await self.run(lambda: [os.path.isfile(p) for p in paths])

    async def delete_many(self, paths: list[str]) -> None:
        """Unlink in a worker thread."""
        def unlink_all() -> None:
            for p in paths:
                _unlink_quiet(p)

        await self.run(unlink_all)

    async def listdir(self, root: str) -> list[Entry]:
        """Walk ``root`` in a worker thread."""

        def walk() -> list[Entry]:
            out = []
            for d, _, files in os.walk(root):
                for name in files:
                    p = f"{d}/{name}"
                    try:
                        st = os.lstat(p)  # a symlink (a loop, say) is listed, never followed
                    except OSError:
                        continue  # vanished, or unreadable: one bad entry never stops a listing
                    out.append(Entry(p, st.st_size, st.st_mtime))
            return out

        return await anyio.to_thread.run_sync(walk)  # a long listing never holds an I/O thread


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SyncDriver(Driver):
    """A synchronous fsspec file system (``memory://`` and others), in worker threads."""

    def __init__(self, limiter: anyio.CapacityLimiter, fs: Any, inline: bool) -> None:
        super().__init__(limiter)
        self.fs = fs
        self.inline = inline

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args) if self.inline else await self.run(fn, *args)

    def _write_one(self, path: str, data: bytes | list[Any]) -> None:
        blob = data if isinstance(data, bytes) else b"".join(bytes(b) for b in data)
        tmp = temp_name(path)
        self.fs.pipe_file(tmp, blob)
        self.fs.mv(tmp, path)

    async def write_many(self, items: list[tuple[str, bytes | list[Any]]]) -> list[BaseException | None]:
        """Temporary name, then move."""
        out: list[BaseException | None] = []
        for path, data in items:
            try:
                await self._call(self._write_one, path, data)
                out.append(None)
            except Exception as exc:  # any file system's error is this item's failure
                out.append(exc)
        return out

    def _read_one(self, path: str, limit: int) -> bytes | None:
        try:
            data: bytes = self.fs.cat_file(path, start=0, end=limit + 1)
            return data
        except FileNotFoundError:
            return None

    async def read_many(self, paths: list[str], limit: int) -> list[bytes | BaseException | None]:
        """Read each path."""
        out: list[bytes | BaseException | None] = []
        for p in paths:
            try:
                out.append(await self._call(self._read_one, p, limit))
            except Exception as exc:
                out.append(exc)
        return out

    async def exists_many(self, paths: list[str]) -> list[bool]:
        """``fs.isfile`` per path."""
        return await self._call(lambda: [bool(self.fs.isfile(p)) for p in paths])

    async def delete_many(self, paths: list[str]) -> None:
        """``fs.rm_file`` per path."""

        def rm() -> None:
            for p in paths:
                try:
                    self.fs.rm_file(p)
                except FileNotFoundError:
                    pass

        await self._call(rm)

    async def listdir(self, root: str) -> list[Entry]:
        """``fs.find`` with details."""

        def find() -> list[Entry]:
            try:
                found = self.fs.find(root, detail=True)
            except FileNotFoundError:
                return []
            return [Entry(_abs(p), int(i.get("size") or 0), _mtime(i)) for p, i in found.items()]

        return await self._call(find)


class AsyncDriver(Driver):
    """An asynchronous fsspec file system (s3fs): concurrent requests, one PUT per record."""

    def __init__(self, limiter: anyio.CapacityLimiter, fs: Any) -> None:
        super().__init__(limiter)
        self.fs = fs

    async def _gather(self, fn: Callable[..., Any], args: list[tuple[Any, ...]],
                      absent_ok: bool = True) -> list[Any]:
        """``fn(*a)`` for each ``a``, concurrently; per call its result, or the error it raised.

        With ``absent_ok`` a FileNotFoundError is a None result (reads, probes, deletes); for writes
        it is an error like any other (s3fs raises it when the bucket does not exist).
        """
        results: list[Any] = [None] * len(args)

        async def one(i: int) -> None:
            async with self.limiter:
                try:
                    results[i] = await fn(*args[i])
                except FileNotFoundError as exc:
                    results[i] = None if absent_ok else exc
                except Exception as exc:  # botocore / aiohttp errors are not all OSErrors
                    results[i] = exc

        async with anyio.create_task_group() as tg:
            for i in range(len(args)):
                tg.start_soon(one, i)
        return results

    async def write_many(self, items: list[tuple[str, bytes | list[Any]]]) -> list[BaseException | None]:
        """One PUT per record: an object appears whole or not at all."""

        async def put(path: str, data: bytes | list[Any]) -> None:
            blob = data if isinstance(data, bytes) else b"".join(bytes(b) for b in data)
            await self.fs._pipe_file(path, blob)

        return await self._gather(put, list(items), absent_ok=False)

    async def read_many(self, paths: list[str], limit: int) -> list[bytes | BaseException | None]:
        """Ranged GETs of at most ``limit + 1`` bytes."""
        # keywords: s3fs's _cat_file takes (path, version_id, start, end), others (path, start, end)
        async def cat(path: str) -> bytes:
            data: bytes = await self.fs._cat_file(path, start=0, end=limit + 1)
            return data

        return await self._gather(cat, [(p,) for p in paths])

    async def exists_many(self, paths: list[str]) -> list[bool]:
        """HEAD requests."""
        res = await self._gather(self.fs._exists, [(p,) for p in paths])
        return [r is True for r in res]

    async def delete_many(self, paths: list[str]) -> None:
        """DELETE requests."""
        await self._gather(self.fs._rm_file, [(p,) for p in paths])

    async def listdir(self, root: str) -> list[Entry]:
        """A recursive listing."""
        try:
            found = await self.fs._find(root, detail=True)
        except FileNotFoundError:
            return []
        return [Entry(p, int(i.get("size") or 0), _mtime(i)) for p, i in found.items()]

    async def close(self) -> None:
        """Close the client session."""
        s3 = getattr(self.fs, "_s3", None)
        if s3 is not None:
            try:
                await s3.__aexit__(None, None, None)
            except Exception:
                pass


def _abs(p: str) -> str:
    return p if p.startswith("/") else "/" + p


def _mtime(info: dict[str, Any]) -> float:
    for k in ("mtime", "LastModified", "created"):
        v = info.get(k)
        if v is None:
            continue
        if hasattr(v, "timestamp"):
            return float(v.timestamp())
        try:
            return float(v)
        except (TypeError, ValueError):
            continue
    return 0.0
