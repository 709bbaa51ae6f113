"""The storage users run: the ``file://`` tier on tmpfs (``/dev/shm``), which refuses page-cache-only
reads (``RWF_NOWAIT``), and tiers that are silent, stalled or down when a store starts."""

from __future__ import annotations

import os
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from helpers import blocks, hashes
from test_fsspec_tier import logs

from tierkv import GroupSpec, Layout, Lookup, TieredStore
from tierkv.backends.fsspec import _local as localfs
from tierkv.errors import BackendError

__all__ = ["logs"]  # a fixture, imported for this module

pytestmark = pytest.mark.anyio

BB = 256 << 10
LAYOUT = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])


def _tmpfs_refuses_nowait(directory: str) -> bool:
    return localfs.probe_nowait(directory) is False


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm (tmpfs) on this machine")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="tierkv-test-") as d:
        yield Path(d)


def cfg(root: Path, **tier: object) -> dict[str, object]:
    return {"layout": LAYOUT, "namespace": "fs", "tiers": [
        {"kind": "cpu", "slots": {0: 16}}, {"kind": "fsspec", "url": f"file://{root}", **tier}]}


async def _restore(store: TieredStore, hs: list[bytes]) -> torch.Tensor:
    with anyio.fail_after(30):
        while (found := store.lookup_prefix(hs, request_id="r")).state is Lookup.PENDING:
            await anyio.sleep(0.002)
    assert found.state is Lookup.HIT and found.blocks == len(hs), found
    out = torch.empty(len(hs), BB, dtype=torch.uint8)
    await store.get(0, hs, out, request_id="r")
    store.release("r")
    return out


async def test_a_tmpfs_tier_serves_every_restore(shm_dir: Path, logs: Any) -> None:
    hs, data = hashes(8), blocks(8, BB, seed=1)
    async with TieredStore(cfg(shm_dir)) as store:
        await store.put(0, hs, data)
        await store.flush()
    logs.lines.clear()
    async with TieredStore(cfg(shm_dir)) as store:
        assert torch.equal(await _restore(store, hs), data)
        backend = store.stats().tiers[1].backend
        assert backend.get("read_errors", 0) == 0
        if _tmpfs_refuses_nowait(str(shm_dir)):
            assert backend.get("nowait_refused") == 1
            said = [line for line in logs.lines if "RWF_NOWAIT" in line]
            assert len(said) == 1, said  # once, not per record


async def test_a_refused_page_cache_read_falls_back_in_the_same_call(
        tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the probe at start could not tell (a read-only root, say) the first refused read is
    retried the blocking way at once: the restore is served, later reads never ask again."""
    if not _tmpfs_refuses_nowait(str(shm_dir)):
        pytest.skip("this kernel's tmpfs reads RWF_NOWAIT: nothing refuses it here")
    monkeypatch.setattr(localfs, "probe_nowait", lambda directory: None)
    hs, data = hashes(6, doc=3), blocks(6, BB, seed=3)
    async with TieredStore(cfg(shm_dir)) as store:
        await store.put(0, hs, data)
        await store.flush()
    async with TieredStore(cfg(shm_dir)) as store:
        assert torch.equal(await _restore(store, hs[:3]), data[:3])
        assert torch.equal(await _restore(store, hs), data)
        backend = store.stats().tiers[1].backend
        assert backend.get("nowait_refused") == 1 and backend.get("read_errors", 0) == 0


# ---- tiers that are silent, stalled or down at start -------------------------------------------------
@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A loopback socket that accepts connections and never answers (a hung S3 server)."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    srv.close()


def _s3_tier(endpoint: str, **kw: object) -> dict[str, object]:
    return {"kind": "fsspec", "url": "s3://silent-bucket/kv", "open_timeout_s": 2, "retry_attempts": 1,
            "storage_options": {"endpoint_url": endpoint, "key": "k", "secret": "s"}, **kw}


async def test_a_silent_s3_endpoint_never_holds_the_start(silent_endpoint: str) -> None:
    hs, data = hashes(4, doc=5), blocks(4, BB, seed=5)
    cfg = {"layout": LAYOUT, "namespace": "fs", "tiers": [{"kind": "cpu", "slots": {0: 16}},
                                                          _s3_tier(silent_endpoint)]}
    t0 = time.monotonic()
    async with TieredStore(cfg) as store:
        assert time.monotonic() - t0 < 2 + 3, "the start waited longer than open_timeout_s"
        st = store.stats().tiers[1]
        assert st.up == 0 and st.down_reason
        await store.put(0, hs, data)  # the primary serves; the tier's share waits for it
        assert store.lookup_prefix(hs).state is Lookup.HIT
        t1 = time.monotonic()
    assert time.monotonic() - t1 < 35  # close's bound


async def test_a_required_tier_that_is_silent_fails_the_start_naming_the_endpoint(
        silent_endpoint: str) -> None:
    cfg = {"layout": LAYOUT, "namespace": "fs", "tiers": [{"kind": "cpu", "slots": {0: 16}},
                                                          _s3_tier(silent_endpoint, required=True)]}
    t0 = time.monotonic()
    with pytest.raises(BackendError) as info:
        async with TieredStore(cfg):
            pass
    assert time.monotonic() - t0 < 2 + 3
    message = str(info.value)
    assert "required" in message and "s3://silent-bucket/kv" in message and "open_timeout_s=2" in message


class StallingMemory(MemoryFileSystem):
    """A memory file system whose reads stall while ``stall`` is set (a hung server)."""

    protocol = "stallmem"
    stall = threading.Event()

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: object) -> bytes:
        while self.stall.is_set():
            time.sleep(0.01)
        return bytes(super().cat_file(path, start=start, end=end, **kw))


@pytest.fixture
def stalling() -> Iterator[type[StallingMemory]]:
    fsspec.register_implementation("stallmem", StallingMemory, clobber=True)
    StallingMemory.stall.set()
    yield StallingMemory
    StallingMemory.stall.clear()


async def test_a_file_system_that_stalls_at_start_joins_when_it_answers(
        stalling: type[StallingMemory]) -> None:
    hs, data = hashes(4, doc=6), blocks(4, BB, seed=6)
    root = f"stallmem://t{uuid.uuid4().hex[:8]}"
    cfg = {"layout": LAYOUT, "namespace": "fs", "tiers": [
        {"kind": "cpu", "slots": {0: 16}},
        {"kind": "fsspec", "url": root, "open_timeout_s": 1, "health_interval_s": 0.2}]}
    t0 = time.monotonic()
    async with TieredStore(cfg) as store:
        assert time.monotonic() - t0 < 1 + 2
        assert store.stats().tiers[1].up == 0
        await store.put(0, hs, data)
        stalling.stall.clear()  # it answers again: it joins, and what waited for it is written
        with anyio.fail_after(20):
            while not (st := store.stats().tiers[1]).up or st.stores < 4:
                await anyio.sleep(0.05)
        assert st.stores == 4 and st.stores_requeued == 4
    async with TieredStore(cfg) as again:  # a new process restores what was written late
        assert torch.equal(await _restore(again, hs), data)


async def test_cancellation_cuts_a_start_that_waits_for_a_tier(stalling: type[StallingMemory]) -> None:
    cfg = {"layout": LAYOUT, "namespace": "fs", "tiers": [
        {"kind": "cpu", "slots": {0: 16}},
        {"kind": "fsspec", "url": f"stallmem://c{uuid.uuid4().hex[:8]}", "open_timeout_s": 60}]}
    t0 = time.monotonic()
    with anyio.move_on_after(1):
        async with TieredStore(cfg):
            pytest.fail("the start cannot have finished: the tier stalls and is waited for 60 s")
    assert time.monotonic() - t0 < 1 + 3


async def test_inspect_says_what_the_store_found_the_file_system_does(shm_dir: Path, tmp_path: Path) -> None:
    from tierkv.tools.audit import inspect_tier

    on_tmpfs = await inspect_tier(f"file://{shm_dir}")
    on_disk = await inspect_tier(f"file://{tmp_path}")
    assert on_tmpfs.features["page_cache_reads"] is (not _tmpfs_refuses_nowait(str(shm_dir)))
    assert on_disk.features["page_cache_reads"] is (localfs.probe_nowait(str(tmp_path)) is not False)
    assert on_disk.features["cachestat"] is on_disk.features["page_cache_reads"], "Linux 6.5 on: cachestat"
    assert on_tmpfs.features["cachestat"] is on_tmpfs.features["page_cache_reads"]
    assert "features" in on_disk.to_json()


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for the test (root only, as CI runs)."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True, timeout=30)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], timeout=30)


def test_bench_tier_on_a_full_file_system_is_one_line_and_exit_2(full_tmpfs: Path) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tierkv.cli", "bench", "tier", str(full_tmpfs), "--blocks", "32",
           "--batch", "8", "--no-drop-caches"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "please report" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("tierkv: error:")]
    assert len(errors) == 1 and "blocks were stored" in errors[0], proc.stderr[-3000:]
    warnings = [ln for ln in proc.stderr.splitlines() if "records on" in ln and "failed" in ln]
    assert 1 <= len(warnings) <= 32 // 8, proc.stderr[-3000:]  # one per failed batch, never per record


# ---- who can read the cache -------------------------------------------------------------------------
def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = p.stat().st_mode & 0o777
    return out


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
async def test_nothing_a_tier_creates_is_readable_by_others_under_umask_022(tmp_path: Path,
                                                                           direct_io: bool) -> None:
    root = tmp_path / "new" / "kv"  # the tier creates its root too
    old = os.umask(0o022)
    try:
        async with TieredStore(cfg(root, direct_io=direct_io if direct_io else False)) as store:
            await store.put(0, hashes(4, doc=8), blocks(4, BB, seed=8))
            await store.flush()
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "new")
    assert any(name.endswith(".tkv") for name in modes) and any(n.endswith("layout.json") for n in modes)
    assert {oct(m) for m in modes.values() if m & 0o077} == set(), modes


async def test_file_mode_gives_a_service_group_read_access(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    old = os.umask(0o077)  # even a stricter umask does not take what file_mode grants
    try:
        async with TieredStore(cfg(root, file_mode="0o640")) as store:
            await store.put(0, hashes(2, doc=9), blocks(2, BB, seed=9))
            await store.flush()
    finally:
        os.umask(old)
    modes = _modes(root)
    files = {m for n, m in modes.items() if (root / n).is_file()}
    dirs = {m for n, m in modes.items() if (root / n).is_dir()}
    assert files == {0o640} and dirs == {0o750}, modes


@pytest.mark.parametrize("mode", [0o644 | 0o100, 0o400, 0o1600, "rw-r--r--"])
def test_a_file_mode_that_makes_no_sense_is_refused(tmp_path: Path, mode: object) -> None:
    from tierkv.config import StoreConfig
    from tierkv.errors import ConfigError

    with pytest.raises(ConfigError, match="file_mode"):
        StoreConfig(**cfg(tmp_path, file_mode=mode))


async def test_verify_never_calls_sound_what_the_stores_read_path_cannot_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from tierkv.tools.audit import verify_tier

    hs, data = hashes(4, doc=12), blocks(4, BB, seed=12)
    async with TieredStore(cfg(tmp_path)) as store:
        await store.put(0, hs, data)
        await store.flush()
    assert (await verify_tier(f"file://{tmp_path}")).ok == 4

    def refused(self: Any, bufs: Any) -> Any:  # whole reads work, the store's scatter reads do not
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(localfs.LocalSource, "readinto", refused)
    report = await verify_tier(f"file://{tmp_path}")
    assert report.ok == 0 and len(report.errors) == 4
    assert all("the store's read path" in p.detail for p in report.errors)


HUNG_READ = """
import os, sys, time, anyio, torch
sys.path.insert(0, {tests!r})
from helpers import blocks, hashes
from tierkv import GroupSpec, Layout, Lookup, TieredStore
layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=65536)])
cfg = {{"layout": layout, "namespace": "hung", "max_pending_s": 1, "tiers": [
    {{"kind": "cpu", "slots": {{0: 16}}}},
    {{"kind": "fsspec", "url": "file://{root}", "close_timeout_s": 2, "read_processes": 0}}]}}
hs = hashes(4, doc=1)
async def main():
    async with TieredStore(cfg) as store:
        await store.put(0, hs, blocks(4, 65536, seed=1))
        await store.flush()
    def hang(*a, **k):  # every read of a record now hangs, as on a stopped FUSE daemon
        time.sleep(3600)
    os.preadv = os.readv = hang
    async with TieredStore(cfg) as store:
        t0 = time.monotonic()
        while store.lookup_prefix(hs, request_id="r").state is Lookup.PENDING:
            await anyio.sleep(0.01)
        print("answered", round(time.monotonic() - t0, 1), flush=True)
    print("closed", flush=True)
anyio.run(main)
"""


def test_a_read_hung_in_the_kernel_holds_neither_close_nor_the_exit_of_the_process(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = HUNG_READ.format(tests=str(Path(__file__).parent), root=str(tmp_path / "kv"))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "answered" in proc.stdout and "closed" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert took < 60, f"the process took {took:.0f} s to exit: a stuck I/O thread held it"


# ---- a restore that a hung tier holds: cancelling it cuts the wait ----------------------------------
def _clear_later(stalling: type[StallingMemory], after_s: float) -> threading.Timer:
    timer = threading.Timer(after_s, stalling.stall.clear)  # a bound, should the cut not happen
    timer.start()
    return timer


@pytest.mark.parametrize("slots", [16, 2], ids=["promoted", "pool-too-small"])
async def test_cancelling_a_get_that_waits_for_a_hung_tier_returns_at_once(
        stalling: type[StallingMemory], slots: int) -> None:
    """``get`` of blocks no primary slot holds reads them from the tier; when that tier hangs, a
    timeout around the ``get`` must return at its deadline, not when the read ends (the engine
    gives up on the restore and recomputes). With room in the pool the read is a promotion the
    ``get`` waits for; without, a read into the tier's own buffer: neither is the caller's rows."""
    hs, data = hashes(4, doc=9), blocks(4, BB, seed=9)
    root = f"stallmem://g{uuid.uuid4().hex[:8]}"
    stalling.stall.clear()
    cfg = {"layout": LAYOUT, "namespace": "fs", "tiers": [
        {"kind": "cpu", "slots": {0: 16}}, {"kind": "fsspec", "url": root, "close_timeout_s": 1}]}
    async with TieredStore(cfg) as store:
        await store.put(0, hs, data)
    cfg["tiers"][0] = {"kind": "cpu", "slots": {0: slots}}  # type: ignore[index]
    async with TieredStore(cfg) as store:
        stalling.stall.set()
        timer = _clear_later(stalling, 8)
        out = torch.zeros(4, BB, dtype=torch.uint8)
        t0 = time.monotonic()
        with anyio.move_on_after(0.5):
            await store.get(0, hs, out)
            pytest.fail("the tier stalls: get cannot have finished")
        waited = time.monotonic() - t0
        assert waited < 2, f"cancelling get waited {waited:.1f}s for a hung read"
        stalling.stall.clear()
        timer.cancel()
        # the tier answers again: the same get now restores every block, and nothing leaked
        await store.get(0, hs, out)
        assert torch.equal(out, data)
        await store.idle()
        assert store.check() == []


@pytest.fixture
def hung_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """While the event is set, every read of a ``file://`` record blocks in its I/O thread, as a
    read of a hung mount does (the thread is inside the kernel, writing into the rows it was given)."""
    hang = threading.Event()
    read = localfs.LocalSource.readinto

    def stuck(self: localfs.LocalSource, bufs: list[Any]) -> int | None:
        while hang.is_set():
            time.sleep(0.01)
        return read(self, bufs)

    monkeypatch.setattr(localfs.LocalSource, "readinto", stuck)
    yield hang
    hang.clear()


@pytest.mark.parametrize("slots", [16, 2], ids=["promoted", "pool-too-small"])
async def test_cancelling_a_get_from_a_hung_local_tier_returns_at_once(
        tmp_path: Path, hung_reads: threading.Event, slots: int) -> None:
    """The same on a ``file://`` tier, whose reads go straight into rows: the rows a hung read
    writes into must never be the caller's, or cancelling could only wait for the read."""
    hs, data = hashes(4, doc=10), blocks(4, BB, seed=10)
    config = cfg(tmp_path, read_processes=0, close_timeout_s=1)
    async with TieredStore(config) as store:
        await store.put(0, hs, data)
    config["tiers"][0] = {"kind": "cpu", "slots": {0: slots}}  # type: ignore[index]
    async with TieredStore(config) as store:
        hung_reads.set()
        timer = threading.Timer(8, hung_reads.clear)
        timer.start()
        out = torch.zeros(4, BB, dtype=torch.uint8)
        t0 = time.monotonic()
        with anyio.move_on_after(0.5):
            await store.get(0, hs, out)
            pytest.fail("the tier hangs: get cannot have finished")
        waited = time.monotonic() - t0
        assert waited < 2, f"cancelling get waited {waited:.1f}s for a hung read"
        hung_reads.clear()
        timer.cancel()
        await store.get(0, hs, out)
        assert torch.equal(out, data)
        await store.idle()
        assert store.check() == []
