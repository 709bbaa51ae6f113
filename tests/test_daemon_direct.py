"""Gets through the daemon without a message: a client copies READY blocks out of the shared pool
where it last saw them, checked against the daemon's slot table before and after the copy. Nothing
another key took, nothing evicted or being written, and nothing of a dead daemon is ever returned;
the reads are counted as hits all the same."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import blocks, hashes
from tests.test_daemon import BIG, BIG_SLOTS, ENV, ROOT, SMALL, Daemon
from tierkv import BlockMissing
from tierkv.blocks.pool import SlotPool
from tierkv.blocks.slottable import KEY_BYTES, ORDERED_MEMORY, create_tables, map_tables
from tierkv.daemon import direct

pytestmark = pytest.mark.anyio

needs_ordered_memory = pytest.mark.skipif(not ORDERED_MEMORY, reason="direct reads are x86-64 only")


def test_a_slots_version_is_even_exactly_while_it_is_ready(tmp_path: Path) -> None:
    tables, where = create_tables(str(tmp_path / "t.slots"), {0: 4})
    pool = SlotPool(0, 64, 4)
    pool.table = tables[0]
    reader = map_tables(str(tmp_path / "t.slots"), where)[0]  # as another process maps it
    k1, k2 = b"a" * 36, b"b" * 36
    (s,), _ = pool.allocate([k1])
    assert reader.snapshot([s], [k1]) is None, "a block being written must not be read"
    pool.mark_ready([s])
    before = reader.snapshot([s], [k1])
    assert before is not None and reader.unchanged([s], before)
    assert reader.snapshot([s], [k2]) is None, "another key's slot"
    pool.free([s])
    assert not reader.unchanged([s], before), "a copy made while the slot was freed must be thrown away"
    (s2,), _ = pool.allocate([k2])
    pool.mark_ready([s2])
    assert s2 == s and reader.snapshot([s], [k1]) is None and reader.snapshot([s], [k2]) is not None
    assert not reader.unchanged([s], before), "freed and filled again: the version moved on"
    (s3,), _ = pool.allocate([b"c" * (KEY_BYTES + 1)])
    pool.mark_ready([s3])
    assert reader.snapshot([s3], [b"c" * (KEY_BYTES + 1)]) is None, "a key too long is never published"
    assert reader.snapshot([99], [k2]) is None


@needs_ordered_memory
async def test_a_get_of_pool_blocks_sends_no_message_and_is_counted(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    try:
        hs, data = hashes(8, 1), blocks(8, 4096, seed=1)
        async with d.store(SMALL) as store:
            await store.put(0, hs, data)
            hits = store.stats().tiers[0].hits
            link = store._link  # type: ignore[attr-defined]
            sent: list[object] = []
            call = link.call
            link.call = lambda msg, **kw: (sent.append(msg["op"]), call(msg, **kw))[1]
            out = torch.zeros_like(data)
            await store.get(0, hs, out)
            assert torch.equal(out, data)
            assert sent == [], f"a get of blocks this store put asked the daemon: {sent}"
            link.call = call
            assert store.stats().tiers[0].hits == hits + 8, "direct reads are reported as hits"
    finally:
        assert d.stop()[0] == 0


@needs_ordered_memory
async def test_a_copy_the_table_contradicts_afterwards_is_thrown_away(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon frees a slot while the client copies it: the copy is not returned; the pinned get
    copies again."""
    d = Daemon(tmp_path).start()
    try:
        hs, data = hashes(4, 2), blocks(4, 4096, seed=2)
        async with d.store(SMALL) as store:
            await store.put(0, hs, data)
            store.stats()  # a round trip: the put's commit (sent unanswered) is in
            reads = store._direct  # type: ignore[attr-defined]
            table = store._link.tables[0]  # type: ignore[attr-defined]
            slot = reads._slot[hs[2] + b"\0\0\0\0"]

            def racing(pool: torch.Tensor, slots: list[int], out8: torch.Tensor) -> None:
                out8.fill_(0xEE)  # what the slot held by the time the copy ran
                table.freed(slot)  # as the daemon does when it evicts the block

            monkeypatch.setattr(direct, "gather", racing)
            out = torch.zeros_like(data)
            served = reads.served
            await store.get(0, hs, out)
            assert torch.equal(out, data), "a copy of a slot that changed under it was returned"
            assert reads.served == served
    finally:
        assert d.stop()[0] == 0


@needs_ordered_memory
async def test_a_slot_another_key_took_is_never_read_for_the_old_one(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    try:
        hs, data = hashes(2, 3), blocks(2, BIG.groups[0].block_bytes, seed=3)
        async with d.store(BIG) as a, d.store(BIG) as b:
            await a.put(0, hs, data)
            a.stats()  # a round trip: a's commit (sent unanswered) is in before b's put
            others = hashes(BIG_SLOTS, 4)
            await b.put(0, others, blocks(BIG_SLOTS, BIG.groups[0].block_bytes, seed=4))  # evicts a's
            served = a._direct.served  # type: ignore[attr-defined]
            with pytest.raises(BlockMissing):
                await a.get(0, hs, torch.zeros_like(data))
            assert a._direct.served == served  # type: ignore[attr-defined]
    finally:
        assert d.stop()[0] == 0


@needs_ordered_memory
async def test_a_killed_daemons_pool_is_not_read(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    hs, data = hashes(3, 5), blocks(3, 4096, seed=5)
    async with d.store(SMALL) as store:
        await store.put(0, hs, data)
        store.stats()  # a round trip: the put's commit (sent unanswered) is in
        await store.get(0, hs, torch.zeros_like(data))
        assert store._direct.served == 1  # type: ignore[attr-defined]
        assert d.proc is not None
        d.proc.kill()
        d.proc.wait()
        with pytest.raises(BlockMissing):  # the first call after the kill: no message sent yet
            await store.get(0, hs, torch.zeros_like(data))


#: puts keys of a small keyspace over and over (each key's bytes a function of the key), so that
#: the pool evicts and reuses slots under the reader's feet
WRITER = """
import random, sys, time, anyio, torch
from tierkv import TieredStore, Layout
from tests.helpers import blocks, hashes
sock, layout = sys.argv[1], Layout.model_validate_json(sys.argv[2])
n, seconds = int(sys.argv[3]), float(sys.argv[4])
bb = layout.groups[0].block_bytes
hs, data = hashes(n, 9), blocks(n, bb, seed=9)
async def main():
    async with TieredStore({"layout": layout, "daemon": sock}) as s:
        end, rng = time.monotonic() + seconds, random.Random(1)
        print("ready", flush=True)
        while time.monotonic() < end:
            i = rng.randrange(n - 3)
            await s.put(0, hs[i:i + 3], data[i:i + 3])
anyio.run(main)
"""


@needs_ordered_memory
async def test_gets_while_another_process_evicts_are_right_or_missing(tmp_path: Path) -> None:
    n, seconds = 4 * BIG_SLOTS, 4.0
    d = Daemon(tmp_path).start()
    bb = BIG.groups[0].block_bytes
    hs, data = hashes(n, 9), blocks(n, bb, seed=9)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, d.socket, BIG.model_dump_json(), str(n),
                               str(seconds)], env=ENV, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    right = missing = 0
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        async with d.store(BIG) as store:
            rng = random.Random(2)
            out = torch.empty(3, bb, dtype=torch.uint8)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                i = rng.randrange(n - 3)
                try:
                    await store.get(0, hs[i:i + 3], out)
                except BlockMissing:
                    missing += 1
                    continue
                assert torch.equal(out, data[i:i + 3]), f"blocks {i}..{i + 2} came back wrong"
                right += 1
            served = store._direct.served  # type: ignore[attr-defined]
        assert writer.wait(60) == 0
    finally:
        writer.kill()
        assert d.stop()[0] == 0
    assert right > 0 and missing > 0, (right, missing)
    assert served > 0, "no get was served from the table"
