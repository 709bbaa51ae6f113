"""Worker threads that never hold the process: a pool of daemon threads, and the calls an event
loop hands to it.

:class:`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits, so a
thread stuck in a system call on a hung mount (a stopped FUSE daemon, an NFS server gone) would
keep an engine from ever exiting, after ``close()`` had long returned. :class:`DaemonPool` runs the
same jobs on daemon threads that nothing joins at exit; ``shutdown(wait=False)`` leaves a stuck
one behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import anyio

__all__ = ["DaemonPool", "Jobs"]

T = TypeVar("T")
_STOP = object()


class DaemonPool:
    """``submit(fn)`` -> :class:`~concurrent.futures.Future`, on up to ``max_workers`` daemon threads."""

    def __init__(self, max_workers: int, thread_name_prefix: str, nice: int = 0) -> None:
        self.max_workers = max(1, max_workers)
        self._nice = nice
        self._prefix = thread_name_prefix
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)  # released by a worker each time it waits for a job
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on a worker thread; its result or exception in the future."""
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the pool is shut down")
            self._queue.put((fut, fn))
            if not self._idle.acquire(timeout=0) and len(self._threads) < self.max_workers:
                t = threading.Thread(target=self._work, name=f"{self._prefix}_{len(self._threads)}",
                                     daemon=True)
                self._threads.append(t)
                t.start()
        return fut

    def _work(self) -> None:
        if self._nice:
            _lower_priority(self._nice)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fut, fn = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # the caller sees it through the future
                    fut.set_exception(exc)
            del item, fut, fn  # no reference to the job's buffers while idle
            self._idle.release()

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Stop the threads once the queued jobs ran (``cancel_futures``: drop the queued ones);
        ``wait``: until the threads ended."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    item[0].cancel()
        for _ in threads:
            self._queue.put(_STOP)
        if wait:
            for t in threads:
                t.join()

    def busy(self) -> bool:
        """True while a thread of the pool is alive (after :meth:`shutdown`: still ending)."""
        return any(t.is_alive() for t in self._threads)


def _lower_priority(nice: int) -> None:
    """Make the calling thread ``nice`` steps less favoured by the CPU scheduler (Linux: each
    thread has its own nice value; elsewhere, or when refused, nothing changes)."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Jobs:
    """Runs batches of calls on :class:`DaemonPool` s from an event loop, and can stop waiting for
    them (:meth:`abandon`: ``close`` past its bound on a file system that does not answer).
    ``count(name, n)`` is told how many calls were left behind."""

    def __init__(self, count: Callable[[str, int], None]) -> None:
        self._count = count
        self.abandoned = False
        self._event: asyncio.Event | None = None

    def abandon(self) -> None:
        """From now on a cancelled batch returns at once, even one whose calls use its buffers."""
        self.abandoned = True
        if self._event is not None:
            self._event.set()

    async def run_all(self, pool: DaemonPool, calls: list[Callable[[], T]], stop: list[bool] | None = None,
                      buffers: bool = True) -> list[T]:
        """Run ``calls`` on ``pool``; their results in order, once every one has ended (see :meth:`wait`)."""
        return await self.wait([pool.submit(c) for c in calls], stop, buffers)

    async def wait(self, jobs: list[Future[T]], stop: list[bool] | None = None,
                   buffers: bool = True) -> list[T]:
        """The results of ``jobs`` (submitted to a :class:`DaemonPool`), in order, once every one has ended.

        The event loop is woken once, when the last job ends (not once per job). On
        cancellation (or an error) the jobs not started are dropped, ``stop[0]`` is set for
        those running to end early, and, when they use the caller's ``buffers``, this waits for
        them before it raises (until :meth:`abandon`: then it stops waiting).
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        left = [len(jobs)]
        lock = threading.Lock()

        def finished(_: object) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                loop.call_soon_threadsafe(_resolve, done)

        for j in jobs:
            j.add_done_callback(finished)
        try:
            if jobs:
                await done
            return [j.result() for j in jobs]
        except BaseException:
            if stop is not None:
                stop[0] = True
            for j in jobs:
                j.cancel()
            running = [asyncio.wrap_future(j) for j in jobs if not j.done()]
            if running and buffers and not self.abandoned:
                with anyio.CancelScope(shield=True):
                    await self._wait_unless_abandoned(running)
            running = [f for f in running if not f.done()]
            if running:
                self._count("calls_abandoned", len(running))
            raise

    async def _wait_unless_abandoned(self, running: list[asyncio.Future[Any]]) -> None:
        if self._event is None:
            self._event = asyncio.Event()
        gave_up = asyncio.ensure_future(self._event.wait())
        try:
            left = set(running)
            while left and not gave_up.done():
                await asyncio.wait([*left, gave_up], return_when=asyncio.FIRST_COMPLETED)
                left = {f for f in left if not f.done()}
        finally:
            gave_up.cancel()

    async def shutdown(self, pools: list[DaemonPool]) -> None:
        """Stop ``pools`` once their queued calls ran; wait for their threads on the loop, not in a
        thread, so a cancelled close (or one past :meth:`abandon`) leaves a stuck one behind."""
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=self.abandoned)
            while not self.abandoned and pool.busy():
                await anyio.sleep(0.005)
