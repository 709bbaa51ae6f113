"""Local (or mounted: NFS, any shared directory) file systems through os calls: the driver, its
worker threads (a read lane and a write lane) and reader processes; one record file is read by
:mod:`tierkv.backends.fsspec._localsource`."""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import anyio

from tierkv.backends.fsspec._driver import (
    PAUSE_MAX_S,
    PAUSE_STEP_S,
    Driver,
    Entry,
    NoWaitUnsupported,
    WouldBlock,
    detach,
)
from tierkv.backends.fsspec._localsource import (
    RWF_NOWAIT,
    LocalSource,
    may_be_cached,
    probe_nowait,
    touch_in_order,
)
from tierkv.backends.fsspec._readproc import ReaderProcess, ReaderProcesses
from tierkv.backends.fsspec._readproc import supported as readproc_supported
from tierkv.backends.threads import DaemonPool, Jobs
from tierkv.blocks import sharedmem
from tierkv.records import batchio, directio
from tierkv.records.batchio import has_cachestat
from tierkv.records.outcomes import SKIPPED, Failed, Found, RecordWrite, Written
from tierkv.records.read import RecordSource

__all__ = ["DIRECT_MIN_BYTES", "LocalDriver", "LocalSource", "RWF_NOWAIT", "probe_nowait"]

log = logging.getLogger("tierkv.fsspec")

T = TypeVar("T")
R = TypeVar("R")

#: a call's items are handed to the worker threads in chunks of about this many bytes (or fewer
#: items, when that gives every thread a chunk): small enough that the threads end a call
#: together, large enough that handing chunks out costs nothing next to reading them
CHUNK_BYTES = 8 << 20
#: how long opening the tier waits for its reader processes to start (then it goes on; a helper
#: that becomes ready later is used from then on)
READERS_READY_S = 5.0
#: where verified rows are copied on as they land (a ``get`` into the caller's rows), a helper gets
#: its records in requests of about this many bytes, two in flight: the waiting thread copies one
#: request's rows out while the helper reads the next
HELPER_REQUEST_BYTES = 4 << 20
#: with direct I/O on, records of at least this many bytes are written past the page cache;
#: smaller ones cost more in their system calls than in their copy, and stay buffered
DIRECT_MIN_BYTES = 64 << 10
#: the writing threads' nice increment: restores (reads) get the CPU first when both want it
WRITE_NICE = 10


def _chunks(n: int, parts: int) -> list[range]:
    """``range(n)`` in ``parts`` consecutive runs whose lengths differ by one at most."""
    if n <= 0:
        return []
    parts = max(1, min(parts, n))
    step, longer = divmod(n, parts)
    bounds = [i * step + min(i, longer) for i in range(parts + 1)]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


class LocalDriver(Driver):
    """Local (or mounted: NFS, any shared directory) file system through os calls.

    The driver owns a pool of ``threads`` worker threads, which bounds the tier's concurrency
    (``limiter`` is not used here). Jobs go straight to the pool's queue, so a thread that finishes
    one job starts the next without a round trip through the event loop: with page-cache reads of
    30 us, that round trip was a fifth of a load (docs/performance-history.md). A caller cancelled while its
    jobs run still waits for them: they write into the caller's buffers.
    """

    def __init__(self, limiter: anyio.CapacityLimiter, threads: int, fsync: bool, depth: int = 16,
                 direct_io: bool | str = False, read_processes: int = 0, file_mode: int = 0o600) -> None:
        super().__init__(limiter)
        self.threads = threads
        self.depth = max(depth, threads)
        self.fsync = fsync
        #: the setting (``"auto"``, True, False); :meth:`prepare` decides :attr:`direct`
        self.direct_io = direct_io
        #: records of at least :data:`DIRECT_MIN_BYTES` are written with ``O_DIRECT``
        self.direct = False
        #: records not in the page cache that can be read in place are read with ``O_DIRECT``
        #: straight into page-aligned rows (the tier's ``direct_reads``; see :class:`LocalSource`)
        self.direct_reads = False
        self._counts: dict[str, int] = {}
        self._count_lock = threading.Lock()
        self._pool = DaemonPool(threads, "tierkv-io")
        #: writes have threads of their own: a burst of stores never queues a load behind it
        self._writes: DaemonPool | None = None
        #: reads of records not in the page cache: they wait for the device, many at once
        self._cold: DaemonPool | None = None
        #: helper processes for reads into shared memory (:mod:`~tierkv.backends.fsspec._readproc`)
        self.read_processes = read_processes if readproc_supported() else 0
        self._readers: ReaderProcesses | None = None
        self._reader_deaths_before = 0
        #: whether reads first take only what the page cache holds (``RWF_NOWAIT``); off where
        #: the file system refuses it (tmpfs, FUSE), found by :meth:`prepare` or by a refused read
        self.nowait = RWF_NOWAIT is not None
        self.root_hint = "a local tier"
        #: every file this driver creates gets this mode, every directory the matching search bits
        self.file_mode = file_mode
        self.dir_mode = file_mode | ((file_mode & 0o444) >> 2)
        self._jobs = Jobs(self._count)

    def _count(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def counts(self) -> dict[str, int]:
        """``direct_writes``: records written with ``O_DIRECT``; ``direct_fallbacks``: direct
        writes the file system refused (then written buffered); ``reader_reads``: records read
        and verified by reader processes; ``reader_batches_cold``: batches read without them, their
        first record not in the page cache; ``reader_deaths``: reader processes that ended;
        ``io_native`` or ``io_python`` (1): whether records are read by the C module."""
        with self._count_lock:
            out = dict(self._counts)
        out["io_native" if batchio.native() is not None else "io_python"] = 1
        return out

    async def prepare(self, directory: str) -> None:
        """Start the reader processes when this process has shared memory to read into; decide
        whether to use direct I/O, by :func:`~tierkv.records.directio.probe` of ``directory``
        (with ``direct_io`` ``"auto"`` or True). Raises ``OSError`` when ``direct_io`` is True and
        the file system cannot do it."""
        self.root_hint = directory
        if self.nowait and await self.run(probe_nowait, directory) is False:
            await self.refuse_nowait("the probe at start")
        self._start_readers()
        if self._readers is not None:
            # a helper's start (an interpreter, its mappings) is CPU work: done before the store
            # serves, it never competes with the first restore after a restart
            await self.run(self._readers.wait_ready, READERS_READY_S)
        if self.direct_io is not False:
            self.direct = await self.run(use_direct_io, directory, self.direct_io is True)

    def features(self) -> dict[str, bool]:
        """What this file system was found to do: ``direct_io`` (records written past the page
        cache) and ``page_cache_reads`` (``RWF_NOWAIT``: warm reads first, reader processes); and
        ``cachestat``: the page cache is asked whether it holds a record before it is read (Linux 6.5);
        ``native_reads``: records are read and written by the C module
        (:mod:`~tierkv.records.batchio`)."""
        return {"direct_io": self.direct, "page_cache_reads": self.nowait,
                "cachestat": self.nowait and has_cachestat(),
                "native_reads": batchio.native() is not None}

    async def refuse_nowait(self, how: str) -> None:
        """Reads wait for the device from now on, and reader processes (which read only the page
        cache) stop; said once."""
        if not self.nowait:
            return
        self.nowait = False
        self.read_processes = 0
        self._count("nowait_refused")
        log.info("%s: this file system refuses page-cache-only reads (RWF_NOWAIT; seen by %s): every "
                 "read waits for the file system, no reader processes", self.root_hint, how)
        readers, self._readers = self._readers, None
        if readers is not None:
            await self.run(readers.close)

    def _start_readers(self) -> None:
        """Start the helpers once, if wanted and some shared region is live (they map it)."""
        if self._readers is not None or not self.read_processes:
            return
        live = sharedmem.regions()
        if not live:
            return
        try:
            self._readers = ReaderProcesses(self.read_processes, live)
        except OSError as exc:
            log.warning("cannot start reader processes (%s): reading in threads", exc)
            self.read_processes = 0

    async def _restart_readers(self, old: ReaderProcesses) -> None:
        """Replace the helpers by new ones that map every live region (old deaths stay counted)."""
        if self._readers is not old:
            return  # another call did it
        self._readers = None
        with self._count_lock:
            self._reader_deaths_before += old.dead()
        await self.run(old.close)
        self._start_readers()

    def reads_in_place(self) -> bool:
        """True when reader processes may take records (some shared memory is mapped)."""
        if self.read_processes and self._readers is None:
            self._start_readers()
        return self._readers is not None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking ``fn`` in one of this driver's threads; a cancelled caller does not wait
        for it (it touches no buffer of the caller's)."""
        return (await self._jobs.run_all(self._pool, [functools.partial(fn, *args)], buffers=False))[0]

    def abandon(self) -> None:
        """See :meth:`Driver.abandon`."""
        self._jobs.abandon()

    async def map(self, fn: Callable[[int], T], n: int, nbytes: int = 0,
                  buffers: bool = True, pool: DaemonPool | None = None) -> list[T | OSError]:
        """``fn(i)`` for ``i`` in ``range(n)``, in chunks over this driver's worker threads (the
        read lane's, or ``pool``'s).

        Per item, what ``fn`` returned or the ``OSError`` it raised: a tier does a whole per-record
        job (encode + write) in one worker thread, with no intermediate buffers handed back.
        Items go to the threads in chunks of about :data:`CHUNK_BYTES` (``nbytes`` is the whole
        call's), so the threads finish a call together instead of one idling while the other
        works through a long chunk. A cancelled call returns once the items already running have
        ended; no other item starts.
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
                    results[i] = detach(exc)  # type: ignore[assignment]

        parts = -(-max(self.threads, -(-nbytes // CHUNK_BYTES)) // self.threads) * self.threads
        jobs: list[Callable[[], None]] = [functools.partial(chunk, idx) for idx in _chunks(n, parts)]
        await self._jobs.run_all(pool or self._pool, jobs, stop, buffers)
        return results

    async def close(self) -> None:
        """Stop the worker threads (after the jobs already queued) and the reader processes;
        after :meth:`abandon`, without waiting for threads stuck in a call."""
        if self._readers is not None:
            readers, self._readers = self._readers, None
            await anyio.to_thread.run_sync(readers.close, abandon_on_cancel=True)
        await self._jobs.shutdown([p for p in (self._pool, self._writes, self._cold) if p is not None])

    async def write_records(self, paths: list[str], job: Callable[[int], list[Any] | None],
                            nbytes: int) -> list[RecordWrite]:
        """Encode and publish each record in one worker thread (``writev`` of its pieces). The
        records of one call get file times in reverse order (the first the newest): a call holds
        a prefix in order, and eviction by age then takes a prefix's end before its beginning."""
        base = time.time_ns()
        n = len(paths)

        def one(i: int) -> RecordWrite:
            parts = job(i)
            if parts is None:
                return SKIPPED
            self._write_one(paths[i], parts)
            when = base + (n - i) * 1000
            with contextlib.suppress(OSError):
                os.utime(paths[i], ns=(when, when), follow_symlinks=False)
            return Written(sum(memoryview(p).nbytes for p in parts))

        results = await self.map(one, n, nbytes, pool=self._write_pool())
        return [Failed(r) if isinstance(r, BaseException) else r for r in results]

    def _write_pool(self) -> DaemonPool:
        with self._count_lock:
            if self._writes is None:
                self._writes = DaemonPool(self.threads, "tierkv-io-write", nice=WRITE_NICE)
            return self._writes

    async def read_records(self, paths: list[str], limit: int, job: Callable[[int, RecordSource], R],
                           nbytes: int, inplace: list[tuple[bytes, Any]] | None = None,
                           landed: Callable[[int], None] | None = None) -> list[R | Found | Failed]:
        """Each job runs in a worker thread on the file itself (a scatter read into its rows).

        Records whose ``inplace`` rows lie in shared memory go first to the reader processes
        (:mod:`~tierkv.backends.fsspec._readproc`), unless the batch's first record is known not to
        be in the page cache (helpers read only what it holds); what they could not verify is read
        here. Jobs first run on the CPU-count threads reading only what the page cache holds (asked
        with ``cachestat`` first, so a cold record is told apart without starting its read); each
        record that must come from the device is handed at once to up to ``depth`` threads that
        wait for it, while the first pass goes on: a cold batch keeps the device busy from its
        first record, and warm reads never queue behind cold ones. Reads stay buffered with direct
        I/O on (as fast here, and a record read once is in the page cache for every process on the
        node).
        """
        results: list[Any] = [None] * len(paths)
        todo = list(range(len(paths)))
        if inplace is not None and self._readers is not None:
            todo = await self._read_in_helpers(self._readers, paths, inplace, results, landed)
        nowait = self.nowait
        stop, refused = [False], [False]
        cold: list[Future[None]] = []  # the records that wait for the device, as each is found

        def cold_read(i: int) -> None:
            if stop[0]:
                return
            try:
                results[i] = job(i, LocalSource(paths[i], direct=self.direct_reads))
            except OSError as exc:
                results[i] = detach(exc)

        def first(j: int) -> Any:
            i = todo[j]
            try:
                results[i] = job(i, LocalSource(paths[i], nowait=nowait, direct=self.direct_reads))
            except WouldBlock as exc:
                refused[0] = refused[0] or isinstance(exc, NoWaitUnsupported)
                cold.append(self._cold_pool().submit(functools.partial(cold_read, i)))
            except OSError as exc:
                results[i] = detach(exc)

        if todo:
            try:
                await self.map(first, len(todo), nbytes * len(todo) // len(paths))
            finally:  # cancelled too: the cold reads already started write into the caller's rows
                if cold:
                    await self._jobs.wait(cold, stop)
        if refused[0]:
            await self.refuse_nowait("a read")
        return [Failed(r) if isinstance(r, BaseException) else r for r in results]

    def _cold_pool(self) -> DaemonPool:
        with self._count_lock:
            if self._cold is None:
                self._cold = DaemonPool(self.depth, "tierkv-io-wait")
            return self._cold

    async def _read_in_helpers(self, readers: ReaderProcesses, paths: list[str],
                               inplace: list[tuple[bytes, Any]], results: list[Any],
                               landed: Callable[[int], None] | None) -> list[int]:
        """Hand the records with rows in shared memory to the ready helpers, in even runs; their
        verified sizes go into ``results`` (and each verified position to ``landed``, in the
        thread that waited for its helper). The positions left for the threads."""
        ready = readers.ready()
        self._note_deaths(readers)
        if not ready:
            return list(range(len(paths)))
        positions, items, unknown = readers.items(paths, inplace)
        if unknown:  # a pool mapped after the helpers started: new helpers map it (this batch: threads)
            await self._restart_readers(readers)
            return list(range(len(paths)))
        if not items:
            return list(range(len(paths)))
        if not await self.run(may_be_cached, paths[positions[0]]):
            # a cold batch (a restart's): the helpers would only turn every record away
            self._count("reader_batches_cold")
            return list(range(len(paths)))
        parts = _chunks(len(items), len(ready))

        per_request = max(1, HELPER_REQUEST_BYTES // max(1, items[0][2])) if landed is not None else 0

        def ask(helper: ReaderProcess, run: range) -> list[int]:
            def answered(start: int, sizes: list[int]) -> None:
                for k, size in enumerate(sizes):
                    if size > 0 and landed is not None:
                        landed(positions[run.start + start + k])

            return helper.read(items[run.start:run.stop], per_request, answered)

        answers = await self._jobs.run_all(self._pool, [functools.partial(ask, p, r)
                                                        for p, r in zip(ready, parts, strict=False)])
        done = 0
        for r, sizes in zip(parts, answers, strict=False):
            for j, size in zip(r, sizes, strict=True):
                if size > 0:
                    results[positions[j]] = Found(size)
                    done += 1
        if done:
            self._count("reader_reads", done)
        self._note_deaths(readers)
        return [i for i, r in enumerate(results) if r is None]

    def _note_deaths(self, readers: ReaderProcesses) -> None:
        dead = self._reader_deaths_before + readers.dead()
        with self._count_lock:
            known = self._counts.get("reader_deaths", 0)
            if dead > known:
                self._counts["reader_deaths"] = dead
        if dead > known:
            log.warning("%d of %d reader processes ended; their reads go to threads", dead,
                        len(readers.procs))

    def _write_one(self, path: str, data: bytes | list[Any]) -> None:
        """Publish one record (temporary file, ``O_DIRECT`` write, rename) through the batch writer:
        the C module with the GIL released, or its Python fallback."""
        bufs = data if isinstance(data, list) else [data]
        (size,), direct, refused = batchio.write_batch([(path, None, bufs)], self.fsync, self.file_mode,
                                                       self.direct, DIRECT_MIN_BYTES, self.dir_mode)
        if size < 0:
            raise OSError(-size, os.strerror(-size), path)
        if direct:
            self._count("direct_writes")
        if refused:
            self._count("direct_fallbacks")

    async def exists_many(self, paths: list[str]) -> list[bool]:
        """One worker thread stats the whole batch."""
        return await self.run(lambda: [os.path.isfile(p) for p in paths])

    async def touch_many(self, paths: list[str]) -> None:
        """Refresh the records' file times in a worker thread (the first path the newest)."""
        await self.run(touch_in_order, paths)

    async def delete_many(self, paths: list[str]) -> list[BaseException | None]:
        """Unlink in a worker thread, each path on its own (see :func:`_remove`: an empty directory
        where a file belongs goes too)."""
        return await self.run(lambda: [_remove(p) for p in paths])

    async def listdir(self, root: str, pause: Callable[[], bool] | None = None) -> list[Entry]:
        """Walk ``root`` in a worker thread (waiting between directories while ``pause()``)."""
        # a long listing never holds an I/O thread; a hung one is left behind when cancelled
        return await anyio.to_thread.run_sync(walk, root, pause, abandon_on_cancel=True)


def use_direct_io(directory: str, required: bool) -> bool:
    """Whether records under ``directory`` are written with ``O_DIRECT`` (:func:`directio.probe`);
    ``OSError`` when ``required`` and the file system cannot."""
    try:
        ok = directio.probe(directory)
    except OSError:
        if required:
            raise
        ok = False  # a directory this process cannot write to (read-only, say): buffered
    if not ok and required:
        raise OSError(errno.EINVAL, "direct_io is true but this file system does not support O_DIRECT "
                      "(older tmpfs, some FUSE mounts); set direct_io to auto or false", directory)
    return ok


def walk(root: str, pause: Callable[[], bool] | None) -> list[Entry]:
    """Every file under ``root`` (symlinks listed, never followed), sleeping between directories
    while ``pause()`` says so (at most :data:`PAUSE_MAX_S` in all)."""
    out = []
    deadline = time.monotonic() + PAUSE_MAX_S
    for d, _, files in os.walk(root):
        while pause is not None and pause() and time.monotonic() < deadline:
            time.sleep(PAUSE_STEP_S)
        for name in files:
            p = f"{d}/{name}"
            try:
                st = os.lstat(p)  # a symlink (a loop, say) is listed, never followed
            except OSError:
                continue  # vanished, or unreadable: one bad entry never stops a listing
            out.append(Entry(p, st.st_size, st.st_mtime))
    return out


def _remove(path: str) -> OSError | None:
    """Unlink ``path``: None when it is gone (or was absent), else the error that kept it.

    Only files are listed, so a directory here stands where a file (a record) belongs: removed
    when empty; one that holds anything is someone else's and stays (an error saying so).
    """
    try:
        os.unlink(path)
        return None
    except FileNotFoundError:
        return None
    except OSError as exc:
        try:
            is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
        except OSError:
            is_dir = False
        if not is_dir:
            return detach(exc)
    try:
        os.rmdir(path)
        return None
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return OSError(exc.errno, "a directory that is not empty stands where a file belongs", path)
        return detach(exc)

