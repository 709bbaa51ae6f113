"""The fsspec tier's driver calls, the same on every driver: ``write_records`` / ``read_records``
with one typed result per record, whole small files on top of them, and the one concurrency
setting (``io_depth``) each driver honours."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import ValidationError

from tierkv.backends.fsspec import FsspecTierConfig
from tierkv.backends.fsspec._driver import Driver, WouldBlock
from tierkv.backends.fsspec._open import open_driver
from tierkv.backends.fsspec._tier import FsspecTier
from tierkv.backends.mooncake import MooncakeTierConfig
from tierkv.records.outcomes import SKIPPED, Failed, Written
from tierkv.records.read import RecordSource

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["file", "memory"])
async def driver(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[Driver, str]]:
    url = f"file://{tmp_path}" if request.param == "file" else f"memory://drivers-{os.getpid()}-{id(tmp_path)}"
    d, root = open_driver(url, {}, anyio.CapacityLimiter(4), None, False)
    try:
        yield d, root
    finally:
        await d.close()


async def test_each_record_written_or_skipped_is_said_with_its_size(driver: tuple[Driver, str]) -> None:
    d, root = driver
    pieces = [[b"head", b"body"], None, [b"x" * 1000]]
    got = await d.write_records([f"{root}/a/1.tkv", f"{root}/a/2.tkv", f"{root}/b/3.tkv"],
                                lambda i: pieces[i], 1008)
    assert got == [Written(8), SKIPPED, Written(1000)]
    assert await d.read_files([f"{root}/a/1.tkv", f"{root}/a/2.tkv", f"{root}/b/3.tkv"], 2000) == \
        [b"headbody", None, b"x" * 1000]
    (long,) = await d.read_files([f"{root}/b/3.tkv"], 9)
    assert long == b"x" * 10, "at most limit + 1 bytes: a longer file shows"


async def test_a_read_job_s_result_comes_back_and_its_error_is_that_record_s_failure(
        driver: tuple[Driver, str]) -> None:
    d, root = driver
    await d.write_records([f"{root}/r/{i}.tkv" for i in range(3)], lambda i: [bytes([i]) * 16], 48)

    def job(i: int, src: RecordSource) -> Any:
        buf = bytearray(16)
        got = src.readinto([buf])
        if i == 1:
            raise OSError(5, "the job's own I/O error")
        return None if got is None else bytes(buf[:got])

    paths = [f"{root}/r/0.tkv", f"{root}/r/1.tkv", f"{root}/r/none.tkv"]
    got = await d.read_records(paths, 17, job, 48)
    assert got[0] == bytes(16)
    assert isinstance(got[1], Failed) and isinstance(got[1].error, OSError) and got[1].error.errno == 5
    assert got[2] is None, "an absent record reaches the job as a source with nothing in it"


async def test_a_failed_write_is_that_record_s_failure_not_the_batch_s(tmp_path: Path) -> None:
    d, root = open_driver(f"file://{tmp_path}", {}, anyio.CapacityLimiter(4), None, False)
    (tmp_path / "taken").write_bytes(b"a file where a directory should be")
    try:
        got = await d.write_records([f"{root}/ok.tkv", f"{root}/taken/x.tkv"], lambda i: [b"data"], 8)
    finally:
        await d.close()
    assert got[0] == Written(4)
    assert isinstance(got[1], Failed) and isinstance(got[1].error, OSError)


# ---- one concurrency setting per medium -------------------------------------------------------------
def test_io_depth_is_the_setting_and_io_threads_its_old_name_off_local_paths() -> None:
    cfg = FsspecTierConfig(url="s3://bucket/kv", io_threads=8)
    assert cfg.io_depth == 8 and cfg.io_threads is None
    with pytest.raises(ValidationError, match="set io_depth only"):
        FsspecTierConfig(url="s3://bucket/kv", io_threads=8, io_depth=4)
    assert FsspecTierConfig(url="s3://bucket/kv", io_threads=4, io_depth=4).io_depth == 4
    local = FsspecTierConfig(url="/tmp/kv", io_threads=3)  # local: the page-cache threads
    assert local.io_threads == 3 and local.io_depth is None
    mc = MooncakeTierConfig(master="127.0.0.1:50051", io_threads=6)
    assert mc.io_depth == 6
    with pytest.raises(ValidationError, match="set io_depth only"):
        MooncakeTierConfig(master="127.0.0.1:50051", io_threads=6, io_depth=2)


@pytest.mark.parametrize("url", ["memory://depth", "file://TMP"])
async def test_every_driver_bounds_its_io_by_io_depth(url: str, tmp_path: Path) -> None:
    from tierkv.backends.base import TierContext
    from tierkv.layout import GroupSpec, Layout

    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=64)])
    ctx = TierContext(namespace="depth", fingerprint=layout.fingerprint("depth"), layout=layout)
    tier = FsspecTier(FsspecTierConfig(url=url.replace("TMP", str(tmp_path)), io_depth=3,
                                       scan_on_open=False), ctx)
    await tier.open()
    try:
        d = tier.driver
        if url.startswith("file"):
            assert d.depth == 3  # type: ignore[attr-defined]
        else:
            assert d.limiter.total_tokens == 3
            running, most = 0, 0

            def slow_read(path: str, limit: int) -> bytes | None:
                nonlocal running, most
                running += 1
                most = max(most, running)
                import time

                time.sleep(0.02)
                running -= 1
                return None

            d._read_one = slow_read  # type: ignore[method-assign]
            d.inline = False  # type: ignore[attr-defined]
            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(d.read_files, [f"x/{i}"], 10)
            assert 1 < most <= 3, most
    finally:
        await tier.close()


async def test_a_record_that_waits_for_the_device_is_read_while_the_page_cache_pass_goes_on(
        tmp_path: Path) -> None:
    """A cold record starts its blocking read as soon as the page-cache pass finds it cold, not
    after that pass has looked at every record of the batch: here the pass's second record waits
    until the first one's read has started."""
    d, root = open_driver(f"file://{tmp_path}", {}, anyio.CapacityLimiter(2), 2, False, depth=2)
    try:
        paths = [f"{root}/r/{i}.tkv" for i in range(2)]
        await d.write_records(paths, lambda i: [bytes([i]) * 16], 32)
        started = threading.Event()

        def job(i: int, src: Any) -> Any:
            if i == 0 and src.nowait:
                raise WouldBlock  # as for a record the page cache does not hold
            if i == 0:
                started.set()
            elif src.nowait and not started.wait(10):
                raise OSError(110, "the cold read of record 0 had not started")
            buf = bytearray(16)
            return bytes(buf[:src.readinto([buf])])

        with anyio.fail_after(30):
            got = await d.read_records(paths, 17, job, 32)
        assert got == [bytes([0]) * 16, bytes([1]) * 16]
    finally:
        await d.close()
