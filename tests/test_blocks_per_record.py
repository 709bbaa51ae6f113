"""Several blocks to a record: ``Layout(blocks_per_record=N)`` through the public API."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import anyio
import pytest
import torch
from helpers import blocks, hashes

from tierkv import InvalidArgument, Layout, LayoutError, Lookup, TieredStore
from tierkv.store import KeyState
from tierkv.tools.audit import verify_tier

pytestmark = pytest.mark.anyio

BB = 1024  # bytes of one block
N = 4


def layout(n: int = N) -> Layout:
    return Layout(tokens_per_block=16, blocks_per_record=n, groups=[
        {"kind": "full", "block_bytes": BB}, {"kind": "scratch", "block_bytes": 64},
        {"kind": "full", "block_bytes": 2 * BB}])


def config(root: Path, lay: Layout | None = None, slots: int = 16) -> dict[str, object]:
    return {"layout": lay or layout(), "namespace": "chunks", "max_concurrent_requests": 2,
            "tiers": [{"kind": "cpu", "slots": {0: slots, 2: slots}},
                      {"kind": "fsspec", "url": f"file://{root}", "codec": "none"}]}


def records_on_disk(root: Path) -> list[Path]:
    return sorted(root.rglob("*.tkv"))


async def restored(store: TieredStore, hs: list[bytes], want: int) -> None:
    """Ask for the prefix until it is a HIT of ``want`` blocks (it comes up from the file tier)."""
    with anyio.fail_after(20):
        while True:
            ans = store.lookup_prefix(hs, request_id="r")
            if ans.state is Lookup.HIT and ans.blocks == want:
                return
            assert ans.state is not Lookup.MISS, ans
            await anyio.sleep(0.01)


async def test_ten_blocks_are_two_records_on_disk_and_come_back_after_a_restart(tmp_path: Path) -> None:
    hs = hashes(10)
    data = {0: blocks(10, BB, seed=1), 2: blocks(10, 2 * BB, seed=2)}
    async with TieredStore(config(tmp_path)) as store:
        for g, rows in data.items():
            await store.put(g, hs, rows)
        await store.flush()
        # two whole records of 4 blocks per group; the last 2 blocks are a record not yet full
        assert len(records_on_disk(tmp_path)) == 2 * 2
        assert store.lookup(0, hs) == [Lookup.HIT] * 8 + [Lookup.MISS] * 2
        assert store.lookup_states(2, hs) == [KeyState.READY] * 8 + [KeyState.MISS] * 2
        ans = store.lookup_prefix(hs)
        assert (ans.blocks, ans.state) == (8, Lookup.HIT)
        g0 = store.stats().groups[0]
        assert (g0.ready, g0.block_bytes) == (2, N * BB)  # stats count records

    async with TieredStore(config(tmp_path)) as store:  # a new process: nothing in its pool
        assert store.lookup_prefix(hs[:8], request_id="r").state is Lookup.PENDING
        await restored(store, hs, 8)
        for g, rows in data.items():
            out = torch.zeros(8, rows.shape[1], dtype=torch.uint8)
            await store.get(g, hs[:8], out, request_id="r")
            assert torch.equal(out, rows[:8])


async def test_get_reads_records_no_lookup_brought_up(tmp_path: Path) -> None:
    hs = hashes(8)
    data = blocks(8, BB, seed=3)
    async with TieredStore(config(tmp_path)) as store:
        await store.put(0, hs, data)
    async with TieredStore(config(tmp_path)) as store:
        out = torch.zeros_like(data)
        await store.get(0, hs, out)
        assert torch.equal(out, data)


async def test_a_slice_from_a_record_boundary_is_served_and_one_inside_finds_nothing(tmp_path: Path) -> None:
    hs = hashes(12)
    data = blocks(12, BB, seed=4)
    async with TieredStore(config(tmp_path)) as store:
        await store.put(0, hs, data)
        out = torch.zeros(4, BB, dtype=torch.uint8)
        await store.get(0, hs[4:8], out)
        assert torch.equal(out, data[4:8])
        assert store.lookup(0, hs[8:11]) == [Lookup.MISS] * 3  # a record's blocks, but not all of it
        assert store.lookup(0, hs[4:]) == [Lookup.HIT] * 8
        # a slice starting inside a record names other records: nothing is found, nothing is wrong
        assert Lookup.HIT not in store.lookup(0, hs[2:10])
        async with store.borrow(0, hs[:8]) as rows:
            assert rows.shape == (8, BB)
            assert torch.equal(rows, data[:8])
        with store.lend_slots(0, hs[:8]) as slots:
            assert slots is not None and len(slots) == 2
            pool = store.tiers[0].pools[0].tensor
            assert torch.equal(pool[slots[1]].view(N, BB), data[4:8])


async def test_a_put_shorter_than_a_record_stores_nothing(tmp_path: Path) -> None:
    hs = hashes(3)
    async with TieredStore(config(tmp_path)) as store:
        await store.put(0, hs, blocks(3, BB))
        await store.flush()
        assert store.lookup(0, hs) == [Lookup.MISS] * 3
        assert store.lookup_prefix(hs).blocks == 0
    assert records_on_disk(tmp_path) == []


async def test_wrong_inputs_are_clear_errors(tmp_path: Path) -> None:
    hs = hashes(8)
    async with TieredStore(config(tmp_path)) as store:
        with pytest.raises(InvalidArgument, match="blocks"):
            await store.put(0, hs, blocks(8, BB * N))  # rows of a record, not of a block
        with pytest.raises(InvalidArgument, match="blocks"):
            await store.put(0, hs, blocks(7, BB))
        await store.put(0, hs, blocks(8, BB))
        for short in (hs[:6], hs[:1]):
            with pytest.raises(InvalidArgument, match="multiple of 4 hashes"):
                await store.get(0, short, torch.zeros(len(short), BB, dtype=torch.uint8))
            with pytest.raises(InvalidArgument, match="multiple of 4 hashes"):
                async with store.borrow(0, short):
                    pass
            with pytest.raises(InvalidArgument, match="multiple of 4 hashes"):
                with store.lend_slots(0, short):
                    pass
        with pytest.raises(InvalidArgument, match="out"):
            await store.get(0, hs, torch.zeros(2, BB * N, dtype=torch.uint8))
        with pytest.raises(InvalidArgument, match="duplicate"):
            store.lookup_prefix([hs[0], hs[1], hs[0], hs[3]])
        assert store.check() == []


def test_layouts_refuse_what_records_of_several_blocks_cannot_hold() -> None:
    with pytest.raises(LayoutError, match="blocks_per_record must be > 0"):
        layout(0)
    for group in ({"kind": "sliding_window", "block_bytes": BB, "window_blocks": 2},
                  {"kind": "recurrent", "block_bytes": BB}):
        with pytest.raises(LayoutError, match="full attention"):
            Layout(tokens_per_block=16, blocks_per_record=2,
                   groups=[{"kind": "full", "block_bytes": BB}, group])
        Layout(tokens_per_block=16, groups=[{"kind": "full", "block_bytes": BB}, group])  # N = 1: fine


def test_one_block_to_a_record_keeps_the_fingerprint_records_were_written_under() -> None:
    groups = [{"kind": "full", "block_bytes": 4096}, {"kind": "scratch", "block_bytes": 64}]
    old = Layout(tokens_per_block=16, groups=groups)
    # the value tierkv gave this layout before blocks_per_record existed (commit 8d3a649)
    assert old.fingerprint("ns") == "44f71275ea90912631e6f101a42da014"
    assert Layout(tokens_per_block=16, groups=groups, blocks_per_record=1).fingerprint("ns") == \
        old.fingerprint("ns")
    assert "blocks_per_record" not in old.canonical_json()
    # the fingerprint is the digest of the canonical JSON, which has only the fields of old
    fields = json.dumps({"tokens_per_block": 16, "groups": json.loads(old.canonical_json())["groups"]},
                        sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(b"tierkv-layout-v1\0ns\0" + fields.encode()).hexdigest()
    assert old.fingerprint("ns") == digest[:32]
    four = Layout(tokens_per_block=16, groups=groups, blocks_per_record=4)
    # another N is another namespace, and so is the layout whose one block is that record
    record = four.record_layout()
    assert (record.tokens_per_block, record.groups[0].block_bytes) == (64, 4 * 4096)
    assert len({old.fingerprint("ns"), four.fingerprint("ns"), record.fingerprint("ns")}) == 3
    # a manifest's dump loads back to the same fingerprint
    assert Layout.model_validate(four.model_dump(mode="json")).fingerprint("ns") == four.fingerprint("ns")


async def test_the_tiers_manifest_and_verify_agree_with_records_of_several_blocks(tmp_path: Path) -> None:
    hs = hashes(8)
    async with TieredStore(config(tmp_path)) as store:
        await store.put(0, hs, blocks(8, BB))
        fp = store.fingerprint
    report = await verify_tier(f"file://{tmp_path}")
    assert report.namespaces == {fp: "ok"}
    assert (report.checked, report.ok, report.corrupt) == (2, 2, [])
    manifest = json.loads((tmp_path / fp / "layout.json").read_text())
    assert manifest["layout"]["blocks_per_record"] == N


async def test_a_second_pool_tier_holds_whole_records_too(tmp_path: Path) -> None:
    """A lower ``cpu`` tier sizes its slots by records, as the primary does: blocks that leave
    a small primary land there (none of its stores fail) and come back whole."""
    hs = hashes(32)
    rows = blocks(32, BB, seed=3)
    lay = Layout(tokens_per_block=16, blocks_per_record=N, groups=[{"kind": "full", "block_bytes": BB}])
    cfg = {"layout": lay, "namespace": "chunks", "max_concurrent_requests": 2,
           "tiers": [{"kind": "cpu", "slots": {0: 2}}, {"kind": "cpu", "slots": {0: 16}},
                     {"kind": "fsspec", "url": f"file://{tmp_path}", "codec": "none"}]}
    async with TieredStore(cfg) as store:
        for i in range(0, 32, 8):
            await store.put(0, hs[i:i + 8], rows[i:i + 8])
        await store.flush()
        second = store.stats().tiers[1]
        assert second.stores_failed == 0 and second.stores > 0
        out = torch.zeros_like(rows)
        await store.get(0, hs, out)
        assert torch.equal(out, rows)
