"""fsspec file systems other than local paths: synchronous ones, and asynchronous ones (s3fs)."""

from __future__ import annotations

import asyncio
import errno
import random
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import anyio

from tierkv.backends.fsspec._driver import BytesSource, Driver, Entry, abs_path, detach, info_mtime
from tierkv.errors import DOWN_TYPES
from tierkv.records.outcomes import SKIPPED, Failed, Found, RecordWrite, Written
from tierkv.records.read import RecordSource
from tierkv.records.tempnames import temp_name

__all__ = ["AsyncDriver", "RequestDriver", "RetryPolicy", "SyncDriver", "transient"]

T = TypeVar("T")
R = TypeVar("R")

class SyncDriver(Driver):
    """A synchronous fsspec file system (``memory://`` and others), in worker threads."""

    def __init__(self, limiter: anyio.CapacityLimiter, fs: Any, inline: bool) -> None:
        super().__init__(limiter)
        self.fs = fs
        self.inline = inline

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args) if self.inline else await self.run(fn, *args)

    def _write_one(self, path: str, data: bytes) -> None:
        """Temporary name, then move."""
        tmp = temp_name(path)
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, path)

    def _read_one(self, path: str, limit: int) -> bytes | None:
        try:
            data: bytes = self.fs.cat_file(path, start=0, end=limit + 1)
            return data
        except FileNotFoundError:
            return None

    async def exists_many(self, paths: list[str]) -> list[bool]:
        """``fs.isfile`` per path."""
        return await self._blocking(lambda: [bool(self.fs.isfile(p)) for p in paths])

    async def delete_many(self, paths: list[str]) -> list[BaseException | None]:
        """``fs.rm_file`` per path, each on its own."""

        def rm(path: str) -> BaseException | None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
            except Exception as exc:  # any file system's error is this path's
                return detach(exc)
            return None

        return await self._blocking(lambda: [rm(p) for p in paths])

    async def listdir(self, root: str, pause: Callable[[], bool] | None = None) -> list[Entry]:
        """``fs.find`` with details (one call: ``pause`` is not asked)."""

        def find() -> list[Entry]:
            try:
                found = self.fs.find(root, detail=True)
            except FileNotFoundError:
                return []
            return [Entry(abs_path(p), int(i.get("size") or 0), info_mtime(i)) for p, i in found.items()]

        return await self._blocking(find)


#: errno values of transient server trouble, as s3fs translates it (503 SlowDown is EBUSY, a 500 is
#: EREMOTEIO) and as sockets report it
_TRANSIENT_ERRNO = frozenset({errno.EBUSY, errno.EREMOTEIO, errno.EAGAIN, errno.ECONNRESET,
                              errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE})
#: botocore / aiohttp exceptions of a dead, hung or dropping server (matched by class name, so that
#: neither library is imported here): those of a server that does not answer, and a dropped body
_TRANSIENT_TYPES = (DOWN_TYPES - {"TierUnavailable"}) | {"ClientPayloadError", "IncompleteReadError"}


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth a retry: the server was slow, busy, unreachable or dropped us."""
    if isinstance(exc, FileNotFoundError | PermissionError):
        return False
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNO:
        return True
    return any(t.__name__ in _TRANSIENT_TYPES for t in type(exc).__mro__)


@dataclass(frozen=True)
class RetryPolicy:
    """How a remote request is retried: transient errors only, with jittered exponential backoff,
    at most ``attempts`` tries and ``budget_s`` seconds in all; every try has ``timeout_s``."""

    attempts: int = 4
    base_s: float = 0.1
    cap_s: float = 2.0
    budget_s: float = 10.0
    timeout_s: float = 60.0


def _deadline(seconds: float) -> AbstractAsyncContextManager[Any]:
    """A deadline for one request; asyncio's own where it has one (a third of anyio's cost)."""
    timeout = getattr(asyncio, "timeout", None)  # Python 3.11+
    if timeout is not None:
        return cast("AbstractAsyncContextManager[Any]", timeout(seconds))
    return _AnyioDeadline(seconds)


class _AnyioDeadline:
    """``anyio.fail_after`` as an async context manager (Python 3.10)."""

    def __init__(self, seconds: float) -> None:
        self.scope = anyio.fail_after(seconds)

    async def __aenter__(self) -> None:
        self.scope.__enter__()

    async def __aexit__(self, *exc: Any) -> bool | None:
        return self.scope.__exit__(*exc)


class RequestDriver(Driver):
    """What every object store driver shares: concurrent requests, each with a deadline, transient
    failures (503 SlowDown, a 500, a dropped or refused connection, a timeout) retried with
    jittered backoff within :class:`RetryPolicy`'s bounds, then returned as that request's error:
    the gateway counts it, nothing hangs.
    """

    def __init__(self, limiter: anyio.CapacityLimiter, retry: RetryPolicy | None = None) -> None:
        super().__init__(limiter)
        self.retry = retry or RetryPolicy()
        self.retries = 0

    def counts(self) -> dict[str, int]:
        """``retries``: requests tried again after a transient failure; ``client_<name>``: 1, the
        library that sends this tier's requests (``client_s3fs``, ``client_obstore``, ...)."""
        out = {f"client_{self.client}": 1}
        if self.retries:
            out["retries"] = self.retries
        return out

    async def _attempt(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        policy = self.retry
        deadline = time.monotonic() + policy.budget_s
        for attempt in range(policy.attempts):
            try:
                async with _deadline(policy.timeout_s):
                    return await fn(*args)
            except Exception as exc:
                left = deadline - time.monotonic()
                if attempt + 1 >= policy.attempts or not transient(exc) or left <= 0:
                    raise
                self.retries += 1
                backoff = min(policy.cap_s, policy.base_s * 2 ** attempt)
                await anyio.sleep(min(left, random.uniform(0, backoff)))  # full jitter
        raise AssertionError("unreachable")

    async def _gather(self, fn: Callable[..., Any], args: list[tuple[Any, ...]],
                      absent_ok: bool = True, then: Callable[[int, Any], Any] | None = None) -> list[Any]:
        """``fn(*a)`` for each ``a``, concurrently; per call its result, or the error it raised.

        With ``absent_ok`` a FileNotFoundError is a None result (reads, probes, deletes); for writes
        it is an error like any other (s3fs raises it when the bucket does not exist). ``then(i,
        result)``, when given, replaces each result as soon as its request is done, outside the
        limiter.
        """
        results: list[Any] = [None] * len(args)

        async def one(i: int) -> None:
            async with self.limiter:
                try:
                    results[i] = await self._attempt(fn, args[i])
                except FileNotFoundError as exc:
                    results[i] = None if absent_ok else detach(exc)
                except Exception as exc:  # botocore / aiohttp errors are not all OSErrors
                    results[i] = detach(exc)
            if then is not None:
                # let the request this one's slot went to start first: its client's work (obstore:
                # all of it, on its own threads) then overlaps this result's check on the loop
                await asyncio.sleep(0)
                try:
                    results[i] = then(i, results[i])
                except Exception as exc:  # that item's error: the other requests go on
                    results[i] = detach(exc)

        # ``one`` never raises: a plain gather (a quarter of a task group's cost per request)
        await asyncio.gather(*(one(i) for i in range(len(args))))
        return results

    # -- what every object store does with its PUT and its GET -----------------------------------
    async def write_records(self, paths: list[str], job: Callable[[int], list[Any] | None],
                            nbytes: int) -> list[RecordWrite]:
        """One PUT per record (an object appears whole or not at all), each encoded on the event
        loop when its request gets a slot.

        The client's work for an object store (signing, parsing, the body) runs on the event
        loop; encoding there, one record at a time between requests, costs less than a worker
        thread contending with the loop for the GIL.
        """
        sizes: list[int | None] = [None] * len(paths)
        blobs: dict[int, bytes] = {}  # a retried request sends what its first try encoded

        async def put(i: int) -> None:
            blob = blobs.get(i)
            if blob is None:
                parts = job(i)
                if parts is None:
                    return
                blob = blobs[i] = b"".join(parts)  # pieces may view scratch
                sizes[i] = len(blob)
            await self._put(paths[i], blob)
            del blobs[i]

        errors = await self._gather(put, [(i,) for i in range(len(paths))], absent_ok=False)
        return [Failed(err) if err is not None else SKIPPED if (n := sizes[i]) is None else Written(n)
                for i, err in enumerate(errors)]

    async def read_records(self, paths: list[str], limit: int, job: Callable[[int, RecordSource], R],
                           nbytes: int, inplace: list[tuple[bytes, Any]] | None = None,
                           landed: Callable[[int], None] | None = None) -> list[R | Found | Failed]:
        """Ranged GETs; each record is checked on the event loop as soon as its GET returns (see
        :meth:`write_records` for why not in a worker thread), while the other requests go on."""

        def check(i: int, data: Any) -> R | Failed:
            if isinstance(data, BaseException):
                return Failed(data)
            try:
                return job(i, BytesSource(data))
            except Exception as exc:  # that item's failure: the other requests go on
                return Failed(detach(exc))

        return await self._gather(self._cat(limit - 1), [(p,) for p in paths], then=check)

    async def _put(self, path: str, blob: bytes) -> None:
        """One PUT of a whole object."""
        raise NotImplementedError

    def _cat(self, limit: int) -> Callable[[str], Awaitable[Any]]:
        """One ranged GET of at most ``limit + 1`` bytes (bytes, or an object with the buffer
        protocol)."""
        raise NotImplementedError


class AsyncDriver(RequestDriver):
    """An asynchronous fsspec file system (s3fs): concurrent requests, one PUT per record."""

    def __init__(self, limiter: anyio.CapacityLimiter, fs: Any, retry: RetryPolicy | None = None) -> None:
        super().__init__(limiter, retry)
        self.fs = fs
        self.client = type(fs).__module__.partition(".")[0] or "fsspec"

    async def _put(self, path: str, blob: bytes) -> None:
        await self.fs._pipe_file(path, blob)

    def _cat(self, limit: int) -> Callable[[str], Awaitable[bytes]]:
        """One ranged GET of at most ``limit + 1`` bytes."""
        # keywords: s3fs's _cat_file takes (path, version_id, start, end), others (path, start, end)
        async def cat(path: str) -> bytes:
            try:
                data: bytes = await self.fs._cat_file(path, start=0, end=limit + 1)
            except OSError as exc:
                # an empty object has no byte 0: S3 answers 416 (s3fs: EINVAL) to a ranged GET
                if exc.errno != errno.EINVAL:
                    raise
                data = await self.fs._cat_file(path)
                if len(data) > limit + 1:
                    raise
            return data

        return cat

    async def exists_many(self, paths: list[str]) -> list[bool]:
        """HEAD requests."""
        res = await self._gather(self.fs._exists, [(p,) for p in paths])
        return [r is True for r in res]

    async def touch_many(self, paths: list[str]) -> None:
        """S3: an in-place copy with new metadata (its LastModified becomes now); other stores: no-op."""
        call = getattr(self.fs, "_call_s3", None)
        if call is None:
            return

        async def touch(path: str) -> None:
            bucket, _, key = path.partition("/")
            await call("copy_object", CopySource={"Bucket": bucket, "Key": key}, Bucket=bucket, Key=key,
                       MetadataDirective="REPLACE", Metadata={"tierkv-touched": f"{time.time():.0f}"})

        await self._gather(touch, [(p,) for p in paths])

    async def delete_many(self, paths: list[str]) -> list[BaseException | None]:
        """DELETE requests, each on its own."""
        res = await self._gather(self.fs._rm_file, [(p,) for p in paths])
        return [r if isinstance(r, BaseException) else None for r in res]

    async def listdir(self, root: str, pause: Callable[[], bool] | None = None) -> list[Entry]:
        """A recursive listing (one paginated call: ``pause`` is not asked)."""
        async def find() -> dict[str, Any]:
            found: dict[str, Any] = await self.fs._find(root, detail=True)
            return found

        try:
            found = await self._attempt(find, ())
        except FileNotFoundError:
            return []
        return [Entry(p, int(i.get("size") or 0), info_mtime(i)) for p, i in found.items()]

    async def close(self) -> None:
        """Close the client session."""
        s3 = getattr(self.fs, "_s3", None)
        if s3 is not None:
            try:
                await s3.__aexit__(None, None, None)
            except Exception:
                pass

