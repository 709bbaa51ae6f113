"""Requests that another runtime's threads complete (obstore's tokio threads): a process that
exits while one of those threads is inside Python code aborts (SIGABRT, no message), so closing
the driver waits for every request in flight and for those threads to leave Python code."""

from __future__ import annotations

import _thread
import asyncio
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import anyio
import pytest
from s3util import new_bucket, s3_endpoint, storage_options

from tierkv.backends.fsspec import _foreign as foreign
from tierkv.backends.fsspec._foreign import ForeignFutures, foreign_threads_in_python
from tierkv.backends.fsspec._obstore import ENV_CLIENT, ObstoreDriver, obstore_module
from tierkv.tools.simulate import Scenario

__all__ = ["s3_endpoint"]  # the fixture, imported for this module

pytestmark = pytest.mark.anyio


def _complete_from_a_foreign_thread(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[str],
                                    after_s: float, linger_s: float) -> threading.Event:
    """What a tokio thread does when its request ends: from a thread Python did not start
    (``_thread``, not ``threading``), ``call_soon_threadsafe`` of a callback that sets the result
    unless the future was cancelled, then more Python code for ``linger_s`` (the tail of
    ``call_soon_threadsafe`` with the GIL released)."""
    left = threading.Event()

    def run() -> None:
        time.sleep(after_s)
        loop.call_soon_threadsafe(lambda: fut.cancelled() or fut.set_result("done"))
        end = time.monotonic() + linger_s
        while time.monotonic() < end:
            time.sleep(0.005)
        left.set()

    _thread.start_new_thread(run, ())
    return left


async def test_settle_waits_for_the_requests_in_flight_and_for_their_threads_to_leave_python() -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[str] = loop.create_future()
    futures = ForeignFutures()
    left = _complete_from_a_foreign_thread(loop, fut, after_s=0.2, linger_s=0.2)
    async with anyio.create_task_group() as tg:  # a request whose caller is still waiting
        tg.start_soon(futures.wait, fut)
        await anyio.sleep(0.01)
        assert len(futures) == 1
        await futures.settle()
    assert fut.result() == "done" and len(futures) == 0
    assert left.is_set() and foreign_threads_in_python() == 0


async def test_a_cancelled_caller_cancels_its_request_and_settle_leaves_its_thread_time() -> None:
    fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    futures = ForeignFutures()
    with anyio.move_on_after(0.01):  # a request's deadline
        await futures.wait(fut)
    assert fut.cancelled() and len(futures) == 0
    t0 = time.monotonic()
    await futures.settle()
    assert time.monotonic() - t0 >= foreign.CANCELLED_S
    t0 = time.monotonic()
    await futures.settle()  # nothing cancelled since: no wait
    assert time.monotonic() - t0 < foreign.CANCELLED_S


async def test_settle_cancels_a_request_a_server_leaves_unanswered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(foreign, "WAIT_S", 0.2)
    fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()  # never answered
    futures = ForeignFutures()
    async with anyio.create_task_group() as tg:
        tg.start_soon(futures.wait, fut)
        await anyio.sleep(0.01)
        t0 = time.monotonic()
        await futures.settle()
        assert fut.cancelled() and len(futures) == 0 and 0.2 <= time.monotonic() - t0 < 2
        tg.cancel_scope.cancel()


async def test_settle_after_abandon_cancels_what_is_still_running() -> None:
    fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    futures = ForeignFutures()
    async with anyio.create_task_group() as tg:
        tg.start_soon(futures.wait, fut)
        await anyio.sleep(0.01)
        futures.abandon()
        with anyio.fail_after(1):
            await futures.settle()
        assert fut.cancelled() and len(futures) == 0
        tg.cancel_scope.cancel()


async def test_closing_the_obstore_driver_waits_for_its_requests_and_threads() -> None:
    obs = obstore_module()
    assert obs is not None, "obstore is a test dependency"
    driver = ObstoreDriver(anyio.CapacityLimiter(4), obs, obs.store.MemoryStore(), "b")
    await driver.write_file("b/kv/x", b"a record")
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[str] = loop.create_future()
    left = _complete_from_a_foreign_thread(loop, fut, after_s=0.1, linger_s=0.3)
    async with anyio.create_task_group() as tg:
        tg.start_soon(driver._futures.wait, fut)
        await anyio.sleep(0.01)
        await driver.close()
        assert fut.done() and left.is_set()
    assert await driver.read_files(["b/kv/x"], 100) == [b"a record"]


_WRITER = """
import json, sys, anyio
from tierkv.tools.simulate import Scenario, write_documents
anyio.run(write_documents, Scenario(**json.loads(sys.argv[1])))
"""


@pytest.mark.slow
def test_processes_that_wrote_through_obstore_exit_cleanly(s3_endpoint: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: 4 of 30 such writers (a store, an ``s3://`` tier through obstore, closed, then
    the interpreter's normal exit) died by SIGABRT with no message."""
    monkeypatch.setenv(ENV_CLIENT, "obstore")
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    ended = []
    for _ in range(20):
        sc = Scenario(documents=4, requests=4, kinds=["full", "recurrent"], slots={1: 3},
                      url=f"s3://{new_bucket(s3_endpoint)}/kv", storage_options=storage_options(s3_endpoint))
        proc = subprocess.run([sys.executable, str(script), json.dumps(asdict(sc))], capture_output=True,
                              text=True, timeout=120)
        ended.append(proc.returncode)
        assert proc.returncode >= 0, f"killed by signal {-proc.returncode}: {ended}\n{proc.stderr[-2000:]}"
        assert proc.returncode == 0, proc.stderr[-2000:]
