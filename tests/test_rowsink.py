"""A ``get``'s rows filled by the threads that read its blocks (tierkv.blocks.rowsink), and what a
caller relies on: every row right, and nothing written into its rows once ``get`` is over."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from helpers import FULL, blocks, config, hashes

from tierkv import GroupSpec, Layout, TieredStore, make_key
from tierkv.backends import registry
from tierkv.backends.base import RowLanded
from tierkv.backends.memory import MemoryTier
from tierkv.blocks import rowsink
from tierkv.blocks.pool import SlotPool
from tierkv.blocks.rowsink import RowSink
from tierkv.tensors import copy_row

pytestmark = pytest.mark.anyio


def one_group(block_bytes: int) -> Layout:
    return Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=block_bytes)])


def test_a_block_fills_every_row_that_wants_it_once() -> None:
    out = torch.zeros((3, 8), dtype=torch.uint8)
    sink = RowSink(out, [b"a", b"b", b"a"])
    sink.fill(b"a", torch.full((8,), 7, dtype=torch.uint8))
    assert [sink.filled(i) for i in range(3)] == [True, False, True]
    assert out[0].tolist() == [7] * 8 and out[2].tolist() == [7] * 8 and out[1].tolist() == [0] * 8
    sink.fill(b"a", torch.full((8,), 9, dtype=torch.uint8))  # filled rows are left alone
    assert out[0].tolist() == [7] * 8
    sink.fill(b"zz", torch.full((8,), 9, dtype=torch.uint8))  # a key it does not want
    assert not sink.filled(1)


def test_pool_copies_and_rows_read_aside_go_through_the_sink_and_stop_at_close() -> None:
    pool = SlotPool(0, 8, 4)
    slots, _ = pool.allocate([b"a", b"b", b"c"])  # type: ignore[misc]
    pool.write(slots, torch.arange(24, dtype=torch.uint8).reshape(3, 8))
    pool.mark_ready(slots)
    out = torch.zeros((4, 8), dtype=torch.uint8)
    sink = RowSink(out, [b"a", b"x", b"c", b"y"])
    sink.copy_slots([0, 2], pool, [slots[0], slots[2]])  # not a run: gathered, then scattered
    assert out[0].tolist() == list(range(8)) and out[2].tolist() == list(range(16, 24))
    sink.copy_rows([3], torch.full((1, 8), 5, dtype=torch.uint8))
    assert out[3].tolist() == [5] * 8 and out[1].tolist() == [0] * 8
    assert [sink.filled(i) for i in range(4)] == [True, False, True, True]
    sink.fill(b"a", torch.full((8,), 9, dtype=torch.uint8))  # a row copied from the pool stays as it is
    assert out[0].tolist() == list(range(8))
    sink.close()
    sink.fill(b"x", torch.full((8,), 9, dtype=torch.uint8))
    assert out[1].tolist() == [0] * 8


@pytest.mark.parametrize("where", ["caller", "worker thread"])
def test_a_row_copy_is_byte_exact_from_any_thread_and_falls_back_where_memmove_cannot(where: str) -> None:
    src = torch.randint(0, 256, (4, 4096), dtype=torch.uint8)
    out = torch.zeros((4, 4096), dtype=torch.uint8)
    strided = torch.zeros((4096, 2), dtype=torch.uint8)[:, 0]  # a row that is not contiguous
    wide = torch.zeros(1024, dtype=torch.int32)  # another dtype: copy_ converts values

    def work() -> None:
        copy_row(out[1], src[2])
        copy_row(strided, src[3])
        copy_row(wide, src[0, :1024])

    if where == "caller":
        work()
    else:
        t = threading.Thread(target=work)
        t.start()
        t.join(10)
    assert torch.equal(out[1], src[2]) and not out[0].any() and not out[2:].any()
    assert torch.equal(strided, src[3])
    assert torch.equal(wide, src[0, :1024].to(torch.int32))


def test_nothing_is_written_after_close_and_close_waits_for_a_copy_under_way(
        monkeypatch: pytest.MonkeyPatch) -> None:
    started, release = threading.Event(), threading.Event()

    def slow_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        started.set()
        release.wait(5)
        dst.copy_(src)

    monkeypatch.setattr(rowsink, "copy_row", slow_copy)
    out = torch.zeros((2, 4), dtype=torch.uint8)
    sink = RowSink(out, [b"a", b"b"])
    filler = threading.Thread(target=sink.fill, args=(b"a", torch.ones(4, dtype=torch.uint8)))
    filler.start()
    assert started.wait(5)
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (sink.close(), closed.set()))
    closer.start()
    time.sleep(0.1)
    assert not closed.is_set()  # the copy under way is waited for
    release.set()
    assert closed.wait(5)
    filler.join(5)
    closer.join(5)
    assert out[0].tolist() == [1] * 4
    sink.fill(b"b", torch.ones(4, dtype=torch.uint8))
    assert out[1].tolist() == [0] * 4 and not sink.filled(1)


async def test_rows_read_from_a_file_tier_reach_the_caller_without_a_copy_out_of_the_pool(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = one_group(64 << 10)
    hs = hashes(12)
    data = blocks(12, 64 << 10, seed=4)
    tier = {"kind": "fsspec", "url": f"file://{tmp_path}", "read_processes": 0}
    async with TieredStore(config(layout, tier, slots={FULL: 64})) as store:
        await store.put(FULL, hs, data)
        await store.flush()

    def no_copy_out(self: SlotPool, slots: Sequence[int], out: torch.Tensor) -> None:
        raise AssertionError("a row was copied out of the pool after its batch landed")

    async with TieredStore(config(layout, tier, slots={FULL: 64})) as store:
        monkeypatch.setattr(SlotPool, "read", no_copy_out)
        store.lookup_prefix(hs, request_id="r")
        out = torch.zeros((12, 64 << 10), dtype=torch.uint8)
        await store.get(FULL, hs, out, request_id="r")
        store.release("r")
        assert torch.equal(out, data)
        assert store.stats().tiers[0].hits == 12


class GatedTier(MemoryTier):
    """A memory tier whose reads wait for ``gate`` in a thread, then report each row."""

    kind = "gated-memory"
    gate = threading.Event()
    reading = threading.Event()

    async def get(self, group: int, keys: Sequence[bytes], out: torch.Tensor,
                  landed: RowLanded | None = None) -> list[bool]:
        def work() -> list[bool]:
            GatedTier.reading.set()
            GatedTier.gate.wait(10)
            out8 = out.view(torch.uint8).reshape(len(keys), -1)
            found = []
            for i, k in enumerate(keys):
                data = self._data.get(k)
                found.append(data is not None)
                if data is not None:
                    out8[i].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                    if landed is not None:
                        landed(i)
            return found

        return await anyio.to_thread.run_sync(work)


@pytest.fixture
def gated() -> Iterator[type[GatedTier]]:
    known, loaded = dict(registry._known), dict(registry._loaded)
    registry.register_backend("gated-memory", GatedTier)
    GatedTier.gate.clear()
    GatedTier.reading.clear()
    try:
        yield GatedTier
    finally:
        GatedTier.gate.set()
        registry._known.clear()
        registry._known.update(known)
        registry._loaded.clear()
        registry._loaded.update(loaded)


async def test_a_cancelled_get_leaves_its_rows_alone_when_the_read_lands_later(gated: Any) -> None:
    layout = one_group(4096)
    hs = hashes(4)
    data = blocks(4, 4096, seed=9)
    async with TieredStore(config(layout, {"kind": "gated-memory"}, slots={FULL: 16})) as store:
        await store.tiers[1].put(FULL, [make_key(h, FULL) for h in hs], data)
        out = torch.zeros((4, 4096), dtype=torch.uint8)

        async def get() -> None:
            await store.get(FULL, hs, out)

        async with anyio.create_task_group() as tg:
            tg.start_soon(get)
            assert await anyio.to_thread.run_sync(gated.reading.wait, 5)
            tg.cancel_scope.cancel()
        gated.gate.set()  # the read lands after the get is over
        with anyio.fail_after(10):
            while store.has_pending_work():
                await anyio.sleep(0.01)
        assert not out.any()
        again = torch.zeros_like(out)
        await store.get(FULL, hs, again)
        assert torch.equal(again, data)
