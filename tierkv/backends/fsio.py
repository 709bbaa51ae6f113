"""File I/O behind the ``fsspec`` tier: local paths with os calls, other fsspec file systems.

Three drivers share one small interface: ``LocalDriver`` (``file://`` and plain paths: os calls
in worker threads, temporary name + ``os.replace``, optional fsync), ``SyncDriver`` (any synchronous
fsspec file system, e.g. ``memory://``: temporary name + move) and ``AsyncDriver`` (asynchronous
fsspec file systems such as s3fs: one PUT publishes a whole object, so no temporary name).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import secrets
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

__all__ = ["AsyncDriver", "Driver", "Entry", "LocalDriver", "SyncDriver", "TEMP_MARK", "temp_owner_alive"]

T = TypeVar("T")

#: temporary files are ``.<name>.tkvtmp-<host>-<pid>-<random>``: host and pid say who wrote them
TEMP_MARK = ".tkvtmp-"
_HOST = socket.gethostname().replace("-", "_")[:32] or "host"


@dataclass(frozen=True)
class Entry:
    """One listed file: path, size in bytes, modification time (seconds since the epoch)."""

    path: str
    size: int
    mtime: float


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

    def __init__(self, limiter: anyio.CapacityLimiter, threads: int, fsync: bool) -> None:
        super().__init__(limiter)
        self.threads = threads
        self.fsync = fsync
        self._dirs: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierkv-io")
        self._calls = 0  # map() calls in flight

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking ``fn`` in one of this driver's threads."""
        return (await self._run_all([functools.partial(fn, *args)]))[0]

    async def _run_all(self, calls: list[Callable[[], T]], stop: list[bool] | None = None) -> list[T]:
        """Run ``calls`` on the pool; their results in order, once every one has ended.

        On cancellation (or an error) the calls not started are dropped, ``stop[0]`` is set for
        those running to end early, and this waits for them before it raises.
        """
        jobs = [self._pool.submit(c) for c in calls]
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
                except OSError as exc:
                    results[i] = exc

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

    @staticmethod
    def read_scatter(path: str, bufs: list[Any]) -> int | None:
        """Read ``path`` into ``bufs`` in order with one ``readv``; the bytes read, None when absent.

        Regular files read short only at their end, so a result equal to the total length of
        ``bufs`` means the file is at least that long (a caller that must know it is not longer
        gives one spare byte in its last buffer).
        """
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return os.readv(fd, bufs)
        finally:
            os.close(fd)

    @staticmethod
    def read_upto(path: str, buf: memoryview) -> int | None:
        """Read at most ``len(buf)`` bytes of ``path`` into ``buf``; how many, None when absent."""
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise OSError(errno.EISDIR, "a directory where a record should be", path) from None
        with f:
            done = 0
            while done < len(buf):
                got = f.readinto(buf[done:])
                if not got:
                    break
                done += got
            return done

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
        try:
            with open(path, "rb", buffering=0) as f:
                return f.read(limit + 1)
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise OSError(errno.EISDIR, "a directory where a record should be", path) from None

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
                        st = os.stat(p)
                    except FileNotFoundError:
                        continue
                    out.append(Entry(p, st.st_size, st.st_mtime))
            return out

        return await self.run(walk)


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
