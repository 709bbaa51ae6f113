"""fsspec file systems other than local paths: synchronous ones, and asynchronous ones (s3fs)."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from tierkv.backends.fsio import Driver, Entry, abs_path, info_mtime, temp_name

__all__ = ["AsyncDriver", "SyncDriver"]

T = TypeVar("T")

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
            return [Entry(abs_path(p), int(i.get("size") or 0), info_mtime(i)) for p, i in found.items()]

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
        return [Entry(p, int(i.get("size") or 0), info_mtime(i)) for p, i in found.items()]

    async def close(self) -> None:
        """Close the client session."""
        s3 = getattr(self.fs, "_s3", None)
        if s3 is not None:
            try:
                await s3.__aexit__(None, None, None)
            except Exception:
                pass

