"""Futures that another runtime's threads complete, and a process exit that must not race them.

obstore's requests run on tokio threads; when one ends, its thread takes the GIL and calls the
event loop's ``call_soon_threadsafe``, which writes a byte to the loop's wake-up socket with the
GIL released. Before Python 3.14, a thread that asks for the GIL back once the interpreter is
finalizing is ended with ``pthread_exit``, which aborts a Rust thread: the process dies with
SIGABRT and no message. It happened to processes whose last request ended just before they
exited (4 of 30 short writers, core dumps: the tokio thread in ``take_gil`` under ``sock_send``
under ``call_soon_threadsafe``, the main thread in ``Py_FinalizeEx``).

:class:`ForeignFutures` tracks every such future. :meth:`ForeignFutures.settle`, on close, waits
for the requests still running (cancelling those a server leaves unanswered), leaves the threads
of cancelled requests a moment to see it (each takes the GIL once more to look), then waits until
no thread that Python did not start is inside Python code (the tail of ``call_soon_threadsafe``).

A store never closed settles nothing, so at interpreter exit (:func:`atexit`, while the stores'
loop threads still run) :func:`_settle_at_exit` waits the same bounded time for the requests still
tracked to end and for foreign threads to leave Python code: a process that exits with a request
in flight then ends cleanly instead of aborting (1 of 10 such processes did, on a busy machine).
"""

from __future__ import annotations

import asyncio
import atexit
import sys
import threading
import time
import weakref
from collections.abc import Awaitable
from typing import Any

import anyio

__all__ = ["ForeignFutures", "foreign_threads_in_python", "threads_out_of_python"]

#: how long :meth:`ForeignFutures.settle` waits for the requests in flight (a healthy server
#: answers in milliseconds; one that does not would hold a closing store, or Ctrl-C, for the
#: client's whole timeout)
WAIT_S = 2.0
#: how long it leaves the threads of cancelled requests to see the cancellation (each takes the
#: GIL once more to look)
CANCELLED_S = 0.05
#: how long it waits for other runtimes' threads to leave Python code
SETTLE_S = 1.0


def foreign_threads_in_python() -> int:
    """How many threads that Python did not start (tokio's, ...) are inside Python code now."""
    known = {t.ident for t in threading.enumerate()}
    return sum(1 for ident in sys._current_frames() if ident not in known)


async def threads_out_of_python() -> None:
    """Wait (at most :data:`SETTLE_S`) until no thread that Python did not start is inside Python
    code: what a process that used a client of another runtime (obstore) without tierkv's driver
    (a raw baseline) does before it exits."""
    end = time.monotonic() + SETTLE_S
    while foreign_threads_in_python() and time.monotonic() < end:
        await anyio.sleep(0.002)


#: every client's futures, for the wait at interpreter exit
_LIVE: weakref.WeakSet[ForeignFutures] = weakref.WeakSet()


def _settle_at_exit() -> None:
    """At interpreter exit: wait (at most :data:`WAIT_S` + :data:`SETTLE_S`) until no tracked
    request is still running and no foreign thread is inside Python code."""
    end = time.monotonic() + WAIT_S + SETTLE_S
    while time.monotonic() < end:
        running = any(len(ff) for ff in list(_LIVE) if not ff._abandoned)
        if not running and not foreign_threads_in_python():
            return
        time.sleep(0.002)


atexit.register(_settle_at_exit)


class ForeignFutures:
    """The asyncio futures of one client whose requests other threads complete."""

    def __init__(self) -> None:
        self._pending: set[asyncio.Future[Any]] = set()
        self._cancelled = False
        self._abandoned = False
        _LIVE.add(self)

    def __len__(self) -> int:
        return len(self._pending)

    async def wait(self, request: Awaitable[Any]) -> Any:
        """Await ``request`` (a future from the other runtime), tracked while it runs; cancelling
        the caller cancels the request. Tracked around the await, with no done callback: that
        would be one more turn of the event loop per request."""
        fut = asyncio.ensure_future(request)
        self._pending.add(fut)
        try:
            return await fut
        finally:
            self._pending.discard(fut)
            if fut.cancelled():
                self._cancelled = True

    def abandon(self) -> None:
        """From now on :meth:`settle` does not wait for the requests still running."""
        self._abandoned = True

    async def settle(self) -> None:
        """Wait for the requests still running (at most :data:`WAIT_S`; not at all once abandoned)
        and cancel those left (a server that does not answer); give the threads of cancelled
        requests :data:`CANCELLED_S` to see it; then wait (at most :data:`SETTLE_S`) until no
        foreign thread is inside Python code."""
        try:
            if self._pending and not self._abandoned:
                await asyncio.wait(list(self._pending), timeout=WAIT_S)
        finally:
            for fut in self._pending:
                fut.cancel()
                self._cancelled = True
            self._pending.clear()
        if self._cancelled:
            self._cancelled = False
            await anyio.sleep(CANCELLED_S)  # a cancelled request's thread takes the GIL once more
        await threads_out_of_python()
