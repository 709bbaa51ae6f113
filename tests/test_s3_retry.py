"""Remote requests: transient failures retried with jittered backoff within bounds, then counted."""

from __future__ import annotations

import errno
import time
from typing import Any

import anyio
import pytest

from tierkv.backends.fsspec._remote import AsyncDriver, RetryPolicy, transient
from tierkv.records.outcomes import Failed

pytestmark = pytest.mark.anyio


class EndpointConnectionError(Exception):
    """Named like botocore's: a server that refuses connections."""


class FakeS3:
    """Fails the first ``fail`` calls of each path with ``error``, then answers."""

    def __init__(self, error: BaseException, fail: int, hang_s: float = 0.0) -> None:
        self.error, self.fail, self.hang_s = error, fail, hang_s
        self.calls: dict[str, int] = {}

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        n = self.calls[path] = self.calls.get(path, 0) + 1
        if self.hang_s:
            await anyio.sleep(self.hang_s)
        if n <= self.fail:
            raise self.error
        return b"record of " + path.encode()

    async def _pipe_file(self, path: str, data: bytes) -> None:
        await self._cat_file(path)


def driver(fs: Any, **policy: Any) -> AsyncDriver:
    return AsyncDriver(anyio.CapacityLimiter(4), fs, RetryPolicy(**{"base_s": 0.01, **policy}))


@pytest.mark.parametrize("error", [OSError(errno.EBUSY, "503 SlowDown"), OSError(errno.EREMOTEIO, "500"),
                                   EndpointConnectionError("refused"), TimeoutError()])
async def test_transient_failures_are_retried_then_served(error: BaseException) -> None:
    fs = FakeS3(error, fail=2)
    d = driver(fs)
    got = await d.read_files(["b/x", "b/y"], 100)
    assert got == [b"record of b/x", b"record of b/y"]
    assert fs.calls == {"b/x": 3, "b/y": 3} and d.retries == 4


async def test_retries_stop_at_the_attempt_bound_and_the_error_is_returned() -> None:
    fs = FakeS3(OSError(errno.EBUSY, "503 SlowDown"), fail=100)
    d = driver(fs, attempts=3)
    (got,) = await d.read_files(["b/x"], 100)
    assert isinstance(got, Failed) and isinstance(got.error, OSError) and got.error.errno == errno.EBUSY
    assert fs.calls["b/x"] == 3


@pytest.mark.parametrize("error", [PermissionError(errno.EACCES, "denied"), FileNotFoundError(),
                                   OSError(errno.EINVAL, "bad request"), ValueError("a bug")])
async def test_other_errors_are_not_retried(error: BaseException) -> None:
    fs = FakeS3(error, fail=100)
    d = driver(fs)
    (got,) = await d.write_records(["b/x"], lambda _: [b"data"], 4)
    assert fs.calls["b/x"] == 1 and d.retries == 0
    assert got == Failed(error)


async def test_a_hung_server_costs_at_most_the_request_timeout_times_the_attempts() -> None:
    fs = FakeS3(OSError(errno.EBUSY, "never"), fail=0, hang_s=60)
    d = driver(fs, attempts=2, timeout_s=0.2, budget_s=5)
    t0 = time.monotonic()
    (got,) = await d.read_files(["b/x"], 100)
    assert isinstance(got, Failed) and isinstance(got.error, TimeoutError)
    assert time.monotonic() - t0 < 2.0 and fs.calls["b/x"] == 2


async def test_the_retry_budget_bounds_the_time_spent() -> None:
    fs = FakeS3(OSError(errno.EBUSY, "503 SlowDown"), fail=100)
    d = driver(fs, attempts=1000, base_s=0.05, cap_s=0.05, budget_s=0.3)
    t0 = time.monotonic()
    (got,) = await d.read_files(["b/x"], 100)
    assert isinstance(got, Failed) and isinstance(got.error, OSError)
    assert time.monotonic() - t0 < 1.5


def test_what_counts_as_transient() -> None:
    assert transient(OSError(errno.EBUSY, "SlowDown")) and transient(EndpointConnectionError())
    assert transient(TimeoutError()) and transient(ConnectionResetError())
    assert not transient(PermissionError()) and not transient(FileNotFoundError())
    assert not transient(ValueError())
