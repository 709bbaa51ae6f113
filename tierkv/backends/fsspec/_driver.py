"""File I/O behind the ``fsspec`` tier: the driver interface, and what every driver shares.

Three drivers implement :class:`Driver`: :class:`~tierkv.backends.fsspec._local.LocalDriver`
(``file://`` and plain paths: os calls in worker threads, temporary name + ``os.replace``,
optional fsync), :class:`~tierkv.backends.fsspec._remote.SyncDriver` (any synchronous fsspec file
system, e.g. ``memory://``: temporary name + move) and
:class:`~tierkv.backends.fsspec._remote.AsyncDriver` (asynchronous fsspec file systems such as s3fs:
one PUT publishes a whole object, so no temporary name).

A tier hands each driver the same per-record jobs through its two record calls
(:meth:`Driver.write_records`, :meth:`Driver.read_records`, each a batch with one typed result
per record: :mod:`~tierkv.records.outcomes`); the driver decides where they run: local
jobs run whole in a worker thread beside their system calls (a scatter read straight into the
caller's row, say), remote ones after (or before) the request: for an asynchronous file system
on the event loop, one record as its request ends (or starts), for a synchronous one in a worker
thread when the batch is large. A driver that does one record at a time implements
:meth:`Driver._read_one` and :meth:`Driver._write_one` and takes the bulk calls as they are. A
record's path that holds anything but a regular file (a FIFO, a device, a symlink) is
:class:`SpecialFile`, never read as a record: a reader would block in ``open`` beyond any cancel scope.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from tierkv.records.outcomes import SKIPPED, Failed, Found, RecordWrite, Written
from tierkv.records.read import RecordSource

__all__ = ["INLINE_BYTES", "PAUSE_MAX_S", "PAUSE_STEP_S", "BytesSource", "Driver",
           "Entry", "NoWaitUnsupported", "WouldBlock", "abs_path", "detach",
           "info_mtime"]

T = TypeVar("T")
R = TypeVar("R")

#: batches of about this many bytes or fewer have their CPU work done inline, larger ones in a
#: worker thread
INLINE_BYTES = 1 << 20

#: the longest a listing waits in all for ``pause`` to say False (then it goes on regardless)
PAUSE_MAX_S = 30.0
#: how long a paused listing sleeps before it asks again
PAUSE_STEP_S = 0.005



@dataclass(frozen=True)
class Entry:
    """One listed file: path, size in bytes, modification time (seconds since the epoch)."""

    path: str
    size: int
    mtime: float




E = TypeVar("E", bound=BaseException)


def detach(exc: E) -> E:
    """``exc`` without its traceback and chained exceptions, to be kept as an item's result: their
    frames hold the item's buffers (rows of an engine's shared memory among them) in a reference
    cycle that only a garbage collection would free, so a region could not be unmapped until then."""
    exc.__traceback__ = None
    exc.__context__ = None
    exc.__cause__ = None
    return exc


class WouldBlock(Exception):
    """A read would wait for the device: the record is not (all) in the page cache."""


class NoWaitUnsupported(WouldBlock):
    """The file system refused a non-blocking page-cache read (``RWF_NOWAIT``: EOPNOTSUPP on tmpfs
    and FUSE, EINVAL on older kernels): read it the blocking way, and stop asking."""



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



class Driver:
    """What the fsspec tier needs from a file system. Paths are absolute, ``/``-separated.

    ``client`` names the library that does the I/O (``obstore``, ``s3fs``, ``fsspec``...).
    """

    client = "fsspec"

    def __init__(self, limiter: anyio.CapacityLimiter) -> None:
        self.limiter = limiter

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking I/O ``fn`` in a worker thread bounded by this tier's limiter. Cancelling
        the caller does not wait for the call (it touches no buffer of the caller's): a call stuck
        on a hung file system is left to end on its own."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter, abandon_on_cancel=True)

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work (encoding, checking records) in a worker thread; it takes no I/O slot."""
        return await anyio.to_thread.run_sync(fn, *args)

    async def exists_many(self, paths: list[str]) -> list[bool]:
        """Per path, whether it exists."""
        raise NotImplementedError

    async def delete_many(self, paths: list[str]) -> list[BaseException | None]:
        """Remove each path, each on its own (one that cannot go never keeps the others): per path
        None when it is gone (an absent one included), else the error that kept it."""
        raise NotImplementedError

    async def listdir(self, root: str, pause: Callable[[], bool] | None = None) -> list[Entry]:
        """Every file under ``root`` (recursively), temporary files included.

        ``pause``, when given, is asked between directories: while it says True (the tier is
        serving reads, say), a driver that lists directory by directory waits before going on,
        for at most :data:`PAUSE_MAX_S` in all, so a background listing never slows a restore.
        """
        raise NotImplementedError

    # ---- the two record calls: every driver's bulk, each item typed ----------------------------
    async def write_records(self, paths: list[str], job: Callable[[int], list[Any] | None],
                            nbytes: int) -> list[RecordWrite]:
        """Publish the record ``job(i)`` returns (pieces, or None: skip it) at ``paths[i]``,
        atomically: a reader sees the whole record or none.

        ``nbytes`` (about the batch's size) decides whether the jobs run inline or in a worker
        thread. The default writes one record at a time with :meth:`_write_one`.
        """
        def encode_all() -> list[bytes | None]:
            out: list[bytes | None] = []
            for i in range(len(paths)):
                parts = job(i)  # pieces may view per-thread scratch: join them at once
                out.append(None if parts is None else b"".join(parts))
            return out

        blobs = encode_all() if nbytes <= INLINE_BYTES else await self.compute(encode_all)
        results: list[RecordWrite] = []
        for path, blob in zip(paths, blobs, strict=True):
            if blob is None:
                results.append(SKIPPED)
                continue
            try:
                await self._blocking(self._write_one, path, blob)
                results.append(Written(len(blob)))
            except Exception as exc:  # any file system's error is this item's failure
                results.append(Failed(detach(exc)))
        return results

    def reads_in_place(self) -> bool:
        """Whether :meth:`read_records` may use ``inplace`` (building it costs the caller a little)."""
        return False

    async def read_records(self, paths: list[str], limit: int, job: Callable[[int, RecordSource], R],
                           nbytes: int, inplace: list[tuple[bytes, Any]] | None = None,
                           landed: Callable[[int], None] | None = None) -> list[R | Found | Failed]:
        """``job(i, source)`` over each record's bytes (at most ``limit``); per item its result, or
        :class:`Failed` with the error reading it raised (an ``OSError`` the job raises counts as
        one).

        ``inplace[i]``, when given, is ``(header, row)``: record ``i`` should be a ``none`` record,
        ``header`` then the numpy row's bytes then the trailer. A driver may read such a record
        into ``row`` itself and verify it (:func:`~tierkv.records.none_parts_match`); its result is
        then :class:`Found`, as ``job`` returns for one it verified, and ``landed(i)`` is called
        (when given) from the thread that learned it, before this returns. The others go to ``job``.
        The default reads one record at a time with :meth:`_read_one`.
        """
        datas: list[bytes | Failed | None] = []
        for p in paths:
            try:
                datas.append(await self._blocking(self._read_one, p, limit - 1))
            except Exception as exc:
                datas.append(Failed(detach(exc)))

        def check_all() -> list[R | Found | Failed]:
            out: list[R | Found | Failed] = []
            for i, d in enumerate(datas):
                if isinstance(d, Failed):
                    out.append(d)
                    continue
                try:
                    out.append(job(i, BytesSource(d)))
                except OSError as exc:
                    out.append(Failed(detach(exc)))
            return out

        return check_all() if nbytes <= INLINE_BYTES else await self.compute(check_all)

    # ---- what a driver that takes the defaults implements -----------------------------------------
    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one blocking primitive: in a worker thread (:meth:`run`) unless a driver says."""
        return await self.run(fn, *args)

    def _write_one(self, path: str, data: bytes) -> None:
        """Publish ``data`` at ``path`` atomically (blocking)."""
        raise NotImplementedError

    def _read_one(self, path: str, limit: int) -> bytes | None:
        """At most ``limit + 1`` bytes of ``path``, or None when it is absent (blocking)."""
        raise NotImplementedError

    # ---- small whole files (manifests, an audit's probes), on the record calls -------------------
    async def read_files(self, paths: list[str], limit: int) -> list[bytes | Failed | None]:
        """Per path its bytes (at most ``limit + 1``: a longer file shows as one byte longer),
        None when absent, or :class:`Failed`."""
        def whole(i: int, src: RecordSource) -> bytes | None:
            data = src.read_all(memoryview(bytearray(limit + 1)))
            return None if data is None else bytes(data)

        got = await self.read_records(paths, limit + 1, whole, 0)
        return [None if isinstance(g, Found) else g for g in got]  # no in-place reads: never Found

    async def write_file(self, path: str, data: bytes) -> None:
        """Publish a small file atomically (namespace manifests); raises what the write raised."""
        (res,) = await self.write_records([path], lambda _: [data], len(data))
        if isinstance(res, Failed):
            raise res.error

    async def touch_many(self, paths: list[str]) -> None:
        """Refresh the modification time of existing files (absent ones are ignored); drivers that
        cannot do it cheaply leave it."""

    async def prepare(self, directory: str) -> None:
        """Settle what depends on the file system at ``directory`` (the tier's namespace, which
        exists): called once the tier's manifest is written."""

    def counts(self) -> dict[str, int]:
        """The driver's own counters, reported among the tier's (only those above zero)."""
        return {}

    def abandon(self) -> None:
        """Stop waiting for calls in flight (``close`` past its bound, a hung file system): from
        now on a cancelled call returns at once, even one whose threads still use its buffers
        (which stay referenced by those threads until they end)."""

    async def close(self) -> None:
        """Release connections."""


def abs_path(p: str) -> str:
    return p if p.startswith("/") else "/" + p


def info_mtime(info: dict[str, Any]) -> float:
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
