"""The one bridge between an event loop and the threads that call into it.

Two pieces, used by the store and by every engine adapter:

- :class:`LoopBridge` belongs to an object whose synchronous methods may be called from any
  thread (a serving engine's scheduler) while its background work runs on an asyncio loop. It
  owns the lock every state change is made under, starts background tasks from any thread, sets
  events across threads and counts background work. Its task group lives in a host task of its
  own, so the object may be closed from any task or cancel scope (inside a timeout, say).
- :class:`LoopThread` runs an event loop in a daemon thread for callers that have none (engine
  adapters): ``call`` runs a coroutine function there and waits for its result, ``submit``
  waits only until its task exists, ``spawn`` does not wait for the loop's thread at all.

:func:`locked` runs a synchronous method under ``self._lock``; it is generic, so modules below the
store can use it without importing the store.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, TypeVar, cast

import anyio
import anyio.abc
import anyio.from_thread

from tierkv.errors import StoreClosed

__all__ = ["ENGINE_SWITCH_INTERVAL_S", "LoopBridge", "LoopThread", "cap_switch_interval", "locked"]

log = logging.getLogger("tierkv")

#: the GIL switch interval engine adapters cap their process's at: a spinning step loop hands the GIL
#: to tierkv's I/O threads within 0.1 ms (a 4k-token restore from a warm file in vLLM: 0.21 s at
#: 0.5 ms, 0.15 s at 0.1 ms, the engine's prefill unchanged; docs/performance-history.md)
ENGINE_SWITCH_INTERVAL_S: float = 0.0001

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def locked(fn: F) -> F:
    """Run a synchronous method under ``self._lock`` (callers may be on any thread)."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return fn(self, *args, **kwargs)

    return cast(F, wrapper)


class LoopBridge:
    """Background work on one asyncio loop, started from any thread, under one lock."""

    def __init__(self, name: str = "tierkv") -> None:
        self.name = name
        #: every state change of the owning object happens under this lock
        self.lock = threading.RLock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._tg: anyio.abc.TaskGroup | None = None
        self._host: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._queue: collections.deque[tuple[Callable[..., Coroutine[Any, Any, Any]], tuple[Any, ...]]] = (
            collections.deque())
        self._wakeup_pending = False
        self._wakeup: asyncio.Event | None = None
        self._background = 0
        self._idle = anyio.Event()
        self._idle.set()

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._tg is not None

    async def start(self) -> None:
        """Start the host task that owns the task group; must run on an asyncio loop."""
        if self._host is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._stop = asyncio.Event()
        self._wakeup = asyncio.Event()
        ready = asyncio.Event()
        self._host = self._loop.create_task(self._run_host(ready), name=f"{self.name}-host")
        await ready.wait()

    async def _run_host(self, ready: asyncio.Event) -> None:
        assert self._stop is not None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._spawner)
                ready.set()
                await self._stop.wait()
                tg.cancel_scope.cancel()
        finally:
            self._tg = None
            ready.set()

    async def stop(self) -> None:
        """Cancel every background task and wait until they have ended. Safe from any task."""
        host, self._host = self._host, None
        if host is None:
            return
        with anyio.CancelScope(shield=True):
            assert self._stop is not None
            self._stop.set()
            try:
                await host
            except BaseException:  # the host's errors were logged by the tasks themselves
                log.debug("%s: host task ended with an error", self.name, exc_info=True)
        self._queue.clear()
        self._wakeup_pending = False

    # ---- from any thread ----------------------------------------------------------------------
    def on_loop(self) -> bool:
        """True when called from the loop's own thread."""
        return threading.get_ident() == self._loop_thread

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Start ``fn(*args)`` as a background task, from the loop's thread or any other."""
        tg = self._tg
        if tg is None:
            raise StoreClosed(f"{self.name} is not open")
        if self.on_loop():
            tg.start_soon(fn, *args)
            return
        assert self._loop is not None and self._wakeup is not None
        self._queue.append((fn, args))
        if not self._wakeup_pending:
            self._wakeup_pending = True
            self._loop.call_soon_threadsafe(self._wakeup.set)

    async def _spawner(self) -> None:
        """Start, inside the loop, the background work other threads asked for."""
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            self._wakeup_pending = False  # before draining: a later append wakes the loop again
            tg = self._tg
            while self._queue and tg is not None:
                fn, args = self._queue.popleft()
                tg.start_soon(fn, *args)

    def set_event(self, ev: anyio.Event) -> None:
        """Set an event tasks on the loop may wait on, from whichever thread we are on."""
        if self._loop is None or self.on_loop():
            ev.set()
        else:
            self._loop.call_soon_threadsafe(ev.set)

    # ---- background work accounting ------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """True while counted background work runs."""
        return self._background > 0

    def begin(self) -> None:
        """Count one more piece of background work (call under the lock)."""
        if self._background == 0:
            self._idle = anyio.Event()
        self._background += 1

    def end(self) -> None:
        """One piece of background work ended (call under the lock)."""
        self._background -= 1
        if self._background == 0:
            self.set_event(self._idle)

    async def wait_idle(self) -> None:
        """Wait until no counted background work runs."""
        while self._background:
            await self._idle.wait()


class LoopThread:
    """An asyncio loop in a daemon thread, for synchronous callers (engine adapters)."""

    def __init__(self) -> None:
        self._cm: AbstractContextManager[anyio.from_thread.BlockingPortal] = (
            anyio.from_thread.start_blocking_portal("asyncio"))
        self._portal: anyio.from_thread.BlockingPortal | None = self._cm.__enter__()
        self._entered: list[AbstractContextManager[Any]] = []
        self._bridge = LoopBridge("tierkv loop thread")
        try:
            self._portal.call(self._bridge.start)
        except BaseException:
            self._portal = None
            self._cm.__exit__(None, None, None)
            raise

    @property
    def portal(self) -> anyio.from_thread.BlockingPortal:
        """The portal into the loop."""
        if self._portal is None:
            raise StoreClosed("the loop thread has stopped")
        return self._portal

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop and wait for its result."""
        return self.portal.call(fn, *args)

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run synchronous ``fn(*args)`` on the loop's thread and wait for its result."""
        return self.portal.call(fn, *args)

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
        """Start ``fn(*args)`` on the loop; its future (cancelling it cancels the task). Waits until
        the loop's thread has created the task."""
        return self.portal.start_task_soon(fn, *args)

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Start ``fn(*args)`` on the loop without waiting for the loop's thread: an engine's
        scheduler hands work over and goes on, however busy the loop is. Its outcome is for
        ``fn`` to report; :meth:`cancel_spawned` and :meth:`stop` cancel it. Raises
        :class:`~tierkv.errors.StoreClosed` once those have run."""
        if self._portal is None:
            raise StoreClosed("the loop thread has stopped")
        self._bridge.spawn(fn, *args)

    def cancel_spawned(self) -> None:
        """Cancel everything :meth:`spawn` started and wait until it has ended; later spawns raise."""
        if self._portal is not None:
            self._portal.call(self._bridge.stop)

    def enter(self, cm: AbstractAsyncContextManager[T]) -> T:
        """Enter an async context manager on the loop; it is exited by :meth:`stop`, last first."""
        sync_cm = self.portal.wrap_async_context_manager(cm)
        value = sync_cm.__enter__()
        self._entered.append(sync_cm)
        return value

    @classmethod
    def running(cls, cm: AbstractAsyncContextManager[T]) -> tuple[LoopThread, T]:
        """A new loop thread with ``cm`` entered on it (a store, say); if entering fails, the thread
        is stopped again and the error raised."""
        loop = cls()
        try:
            return loop, loop.enter(cm)
        except BaseException:
            loop.stop()
            raise

    def stop(self) -> None:
        """Exit what :meth:`enter` entered, then stop the loop and its thread. Idempotent."""
        if self._portal is None:
            return
        try:
            try:
                self.cancel_spawned()
            except Exception:
                log.debug("cancelling the loop thread's tasks failed", exc_info=True)
            while self._entered:
                cm = self._entered.pop()
                try:
                    cm.__exit__(None, None, None)
                except Exception:
                    log.exception("closing on the loop thread failed")
        finally:
            self._portal = None
            try:
                self._cm.__exit__(None, None, None)
            except Exception:
                log.debug("stopping the loop thread failed", exc_info=True)


def cap_switch_interval(limit_s: float | None) -> None:
    """Lower the interpreter's GIL switch interval to at most ``limit_s`` (None: leave it).

    An engine's step loop that spins while tierkv's threads read holds the GIL for the whole
    interval (5 ms by default) every time one of them asks for it.
    """
    if limit_s is not None and sys.getswitchinterval() > limit_s:
        sys.setswitchinterval(limit_s)
