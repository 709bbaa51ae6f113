"""Worker threads that never hold the process: a pool of daemon threads.

:class:`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits, so a
thread stuck in a system call on a hung mount (a stopped FUSE daemon, an NFS server gone) would
keep an engine from ever exiting, after ``close()`` had long returned. :class:`DaemonPool` runs the
same jobs on daemon threads that nothing joins at exit; ``shutdown(wait=False)`` leaves a stuck
one behind.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["DaemonPool"]

T = TypeVar("T")
_STOP = object()


class DaemonPool:
    """``submit(fn)`` -> :class:`~concurrent.futures.Future`, on up to ``max_workers`` daemon threads."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self.max_workers = max(1, max_workers)
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
