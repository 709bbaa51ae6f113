"""The loop thread engine adapters hand work to: an engine's scheduler thread never waits for a busy
loop to take a job, and nothing it started outlives the thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest

from tierkv.bridge import LoopThread
from tierkv.errors import StoreClosed


def test_spawn_returns_at_once_while_the_loop_is_busy_and_the_work_runs_after() -> None:
    lt = LoopThread()
    try:
        busy = threading.Event()
        ran = threading.Event()

        async def hog() -> None:  # blocks the loop's thread, as a long CPU step on the loop would
            busy.set()
            time.sleep(0.6)

        async def job(tag: str) -> None:
            ran.set()

        lt.submit(hog)
        assert busy.wait(5)
        t0 = time.monotonic()
        lt.spawn(job, "a")
        took = time.monotonic() - t0
        assert took < 0.2, f"spawn waited {took:.2f} s for the loop"
        assert not ran.is_set()
        assert ran.wait(5), "the spawned job runs once the loop is free"
    finally:
        lt.stop()


def endless(started: threading.Event, ended: threading.Event) -> Callable[[], Coroutine[Any, Any, None]]:
    """Work that runs until cancelled, saying when it started and when it ended."""

    async def forever() -> None:
        started.set()
        try:
            await anyio.sleep(3600)
        finally:
            ended.set()

    return forever


def test_cancel_spawned_ends_running_work_and_later_spawns_are_refused() -> None:
    lt = LoopThread()
    started, ended = threading.Event(), threading.Event()
    forever = endless(started, ended)
    try:
        lt.spawn(forever)
        assert started.wait(5)
        lt.cancel_spawned()
        assert ended.is_set(), "cancel_spawned returns once the work has ended"
        with pytest.raises(StoreClosed):
            lt.spawn(forever)
    finally:
        lt.stop()
    lt.stop()  # idempotent
    with pytest.raises(StoreClosed):
        lt.spawn(forever)


def test_stop_cancels_what_spawn_started() -> None:
    lt = LoopThread()
    started, ended = threading.Event(), threading.Event()
    lt.spawn(endless(started, ended))
    assert started.wait(5)
    lt.stop()
    assert ended.is_set()
