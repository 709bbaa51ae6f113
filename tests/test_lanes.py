"""Loads never queue behind stores (#50): a file tier's writes have threads of their own, at a
lower CPU priority, and a put copies outside the store's lock (and, while the store restores,
outside its caller's event loop).

With one pool of worker threads for both directions, a burst of stores (a cascade of a long
prefix) filled the threads' queue and a restore waited behind every write ahead of it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest
import torch
from helpers import FULL, blocks, hashes

from tierkv import GroupSpec, Layout, TieredStore
from tierkv.backends.fsspec._local import WRITE_NICE, LocalDriver
from tierkv.blocks.pool import SlotPool
from tierkv.movement import writer
from tierkv.movement.lookup import Lookup

BB = 4096
LAYOUT = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])


def config(directory: Path) -> dict[str, object]:
    return {"layout": LAYOUT, "namespace": "lanes", "max_concurrent_requests": 2,
            "tiers": [{"kind": "cpu", "slots": {FULL: 64}},
                      {"kind": "fsspec", "url": f"file://{directory}", "io_threads": 2}]}


@pytest.mark.anyio
async def test_a_restore_does_not_wait_for_stores_stuck_in_the_tier(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = hashes(8, doc=1), hashes(48, doc=2)
    data_old, data_new = blocks(8, BB, seed=1), blocks(48, BB, seed=2)
    async with TieredStore(config(tmp_path)) as store:
        await store.put(FULL, old, data_old)
        await store.flush()

    gate = threading.Event()
    stuck = threading.Semaphore(0)
    write_one = LocalDriver._write_one

    def slow_write(self: LocalDriver, path: str, data: object) -> None:
        stuck.release()
        gate.wait(30)  # every write thread is held here until the restore is done
        write_one(self, path, data)  # type: ignore[arg-type]

    monkeypatch.setattr(LocalDriver, "_write_one", slow_write)
    try:
        async with TieredStore(config(tmp_path)) as store:
            await store.put(FULL, new, data_new)  # cascades: writes that cannot end
            for _ in range(2):  # both write threads are busy, more writes queued behind them
                assert await anyio.to_thread.run_sync(stuck.acquire, True, 10)
            out = torch.empty(len(old), BB, dtype=torch.uint8)
            t0 = time.monotonic()
            with anyio.fail_after(10):
                await store.get(FULL, old, out)  # not in the primary: read from the file tier
            took = time.monotonic() - t0
            assert torch.equal(out, data_old)
            assert not gate.is_set()
            gate.set()
            await store.flush()
            assert store.stats().tiers[1].stores == len(new), "the stores went on once let through"
    finally:
        gate.set()
    assert took < 5


def _cpu_only(slots: int = 64) -> dict[str, object]:
    return {"layout": LAYOUT, "namespace": "lanes", "tiers": [{"kind": "cpu", "slots": {FULL: slots}}]}


@pytest.mark.anyio
async def test_a_put_copies_without_holding_the_store_or_its_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large put while the store restores copies on a worker thread, outside the store's lock:
    gets and lookups of other blocks go on meanwhile, and its own blocks are PENDING until the
    copy is done."""
    monkeypatch.setattr(writer, "THREAD_BYTES", 16 * BB)
    monkeypatch.setattr(writer, "RESTORING_S", 1e9)  # the store counts as restoring
    held, new = hashes(8, doc=3), hashes(16, doc=4)
    data_held, data_new = blocks(8, BB, seed=3), blocks(16, BB, seed=4)
    copying, gate = threading.Event(), threading.Event()
    waited: list[bool] = []
    pool_write = SlotPool.write

    def slow_write(self: SlotPool, slots: list[int], src: torch.Tensor) -> None:
        if len(slots) == len(new):
            copying.set()
            waited.append(gate.wait(10))
        pool_write(self, slots, src)

    monkeypatch.setattr(SlotPool, "write", slow_write)
    async with TieredStore(_cpu_only()) as store:
        await store.put(FULL, held, data_held)
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.put, FULL, new, data_new)
            assert await anyio.to_thread.run_sync(copying.wait, 10)
            out = torch.empty(len(held), BB, dtype=torch.uint8)
            with anyio.fail_after(5):
                await store.get(FULL, held, out)  # the loop and the lock are free
            assert torch.equal(out, data_held)
            assert set(store.lookup(FULL, new)) == {Lookup.PENDING}, "half-copied blocks are never HIT"
            reading = torch.empty(len(new), BB, dtype=torch.uint8)
            async with anyio.create_task_group() as readers:
                readers.start_soon(store.get, FULL, new, reading)  # waits for the copy to end
                await anyio.sleep(0.05)
                gate.set()
        assert waited == [True], "the copy ran while the other calls were served"
        assert torch.equal(reading, data_new)
        assert set(store.lookup(FULL, new)) == {Lookup.HIT}


@pytest.mark.anyio
async def test_a_put_whose_copy_fails_frees_its_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    new = hashes(4, doc=5)

    def broken(self: SlotPool, slots: list[int], src: torch.Tensor) -> None:
        raise RuntimeError("copy failed")

    async with TieredStore(_cpu_only()) as store:
        with monkeypatch.context() as m:
            m.setattr(SlotPool, "write", broken)
            with pytest.raises(RuntimeError, match="copy failed"):
                await store.put(FULL, new, blocks(4, BB, seed=5))
        assert set(store.lookup(FULL, new)) == {Lookup.MISS}
        assert store.stats().groups[FULL].writing == 0
        assert store.check() == []
        await store.put(FULL, new, blocks(4, BB, seed=5))  # the same keys can be stored after
        assert set(store.lookup(FULL, new)) == {Lookup.HIT}


@pytest.mark.anyio
async def test_a_put_cancelled_during_its_copy_is_stored_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "THREAD_BYTES", 4 * BB)
    monkeypatch.setattr(writer, "RESTORING_S", 1e9)
    new, data = hashes(16, doc=6), blocks(16, BB, seed=6)
    copying, gate = threading.Event(), threading.Event()
    pool_write = SlotPool.write

    def slow_write(self: SlotPool, slots: list[int], src: torch.Tensor) -> None:
        copying.set()
        gate.wait(10)
        pool_write(self, slots, src)

    monkeypatch.setattr(SlotPool, "write", slow_write)
    async with TieredStore(_cpu_only()) as store:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.put, FULL, new, data)
            assert await anyio.to_thread.run_sync(copying.wait, 10)
            tg.cancel_scope.cancel()
            gate.set()
        out = torch.empty(len(new), BB, dtype=torch.uint8)
        await store.get(FULL, new, out)
        assert torch.equal(out, data)
        assert store.stats().groups[FULL].writing == 0


@pytest.mark.anyio
async def test_a_large_put_hands_its_copy_off_only_while_the_store_restores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Right after a restore begins, a large put copies on a worker thread (the restore's steps
    run in the caller's loop); in a store restoring nothing it copies on the caller's thread,
    with no hand-off to pay."""
    monkeypatch.setattr(writer, "THREAD_BYTES", 8 * BB)
    monkeypatch.setattr(writer, "RESTORING_S", 0.3)
    copied_on: list[int] = []
    pool_write = SlotPool.write

    def noting_write(self: SlotPool, slots: list[int], src: torch.Tensor) -> None:
        copied_on.append(threading.get_ident())
        pool_write(self, slots, src)

    old, data = hashes(16, doc=20), blocks(16, BB, seed=20)
    async with TieredStore(config(tmp_path)) as store:
        await store.put(FULL, old, data)
        await store.flush()
    loop = threading.get_ident()
    async with TieredStore(config(tmp_path)) as store:  # a new store: old is on the file tier only
        monkeypatch.setattr(SlotPool, "write", noting_write)
        await store.put(FULL, hashes(16, doc=21), blocks(16, BB, seed=21))
        assert copied_on == [loop], "a put in a store restoring nothing handed its copy off"
        assert store.lookup_prefix(old, request_id="r").state is Lookup.PENDING  # a restore begins
        await store.put(FULL, hashes(16, doc=22), blocks(16, BB, seed=22))
        assert copied_on[1] != loop, "a put beside a restore held the caller's loop for its copy"
        await store.put(FULL, hashes(4, doc=23), blocks(4, BB, seed=23))  # small: never handed off
        assert copied_on[2] == loop
        out = torch.empty(16, BB, dtype=torch.uint8)
        await store.get(FULL, old, out, request_id="r")
        assert torch.equal(out, data)
        await anyio.sleep(0.4)  # RESTORING_S after the restore's last landing
        await store.put(FULL, hashes(16, doc=24), blocks(16, BB, seed=24))
        assert copied_on[3] == loop, "a store stayed 'restoring' after its restores ended"
        for doc, seed in ((21, 21), (22, 22), (24, 24)):
            await store.get(FULL, hashes(16, doc=doc), out)
            assert torch.equal(out, blocks(16, BB, seed=seed))


@pytest.mark.skipif(sys.platform != "linux", reason="a nice value per thread is Linux's")
@pytest.mark.anyio
async def test_the_file_tiers_writing_threads_yield_the_cpu_to_its_reading_threads(tmp_path: Path) -> None:
    async with TieredStore(config(tmp_path)) as store:
        await store.put(FULL, hashes(8, doc=7), blocks(8, BB, seed=7))
        await store.flush()
        store.engine.clear()
        await store.get(FULL, hashes(8, doc=7), torch.empty(8, BB, dtype=torch.uint8))
        base = os.getpriority(os.PRIO_PROCESS, 0)
        nice = {t.name.rsplit("_", 1)[0]: os.getpriority(os.PRIO_PROCESS, t.native_id or 0)
                for t in threading.enumerate() if t.name.startswith("tierkv-io")}
    assert nice["tierkv-io-write"] == min(19, base + WRITE_NICE)
    assert nice["tierkv-io"] == base, "reads keep the process's priority"
