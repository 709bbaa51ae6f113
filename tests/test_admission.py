"""Concurrent restores through small pools: PENDING instead of MISS, FIFO admission, fallback."""

from __future__ import annotations

import pytest
import torch
from helpers import FULL, REC, SW, blocks, config, group_stats, hashes, hybrid_layout
from s3util import new_bucket, s3_endpoint, storage_options

from tierkv import Lookup, PrefixLookup, TieredStore
from tierkv.tools.simulate import Scenario, run_scenario

pytestmark = pytest.mark.anyio
__all__ = ["s3_endpoint"]  # the fixture


async def test_reported_scenario_no_miss_and_at_most_two_extra_steps() -> None:
    """1 full group (plenty of slots) + 1 recurrent group with 3 slots, 4 documents on file://,
    written by another process; a new process restores all 4 in the same step."""
    small = await run_scenario(Scenario(documents=4, requests=4, kinds=["full", "recurrent"], slots={1: 3}))
    roomy = await run_scenario(Scenario(documents=4, requests=4, kinds=["full", "recurrent"], slots={1: 4}))
    assert small.lookups["miss"] == 0
    for r in small.requests:
        assert not r.from_scratch and r.mismatches == 0
        assert r.tokens_restored == r.tokens_on_disk
    assert small.restored_fraction == 1.0
    assert max(r.steps_waited for r in small.requests) <= max(r.steps_waited for r in roomy.requests) + 2


async def test_the_naive_policy_shows_the_bug_this_prevents() -> None:
    naive = await run_scenario(Scenario(documents=4, requests=4, slots={1: 3}, admission="naive",
                                        writer_subprocess=False))
    assert any(r.from_scratch for r in naive.requests)
    assert naive.restored_fraction < 1.0


GRID = [(1, 1), (2, 1), (4, 2), (8, 3), (16, 8), (33, 4), (64, 1), (64, 8)]


@pytest.mark.parametrize(("requests", "slots"), GRID)
@pytest.mark.parametrize("kinds", [["full", "recurrent"], ["full", "sliding_window", "recurrent"],
                                   ["sliding_window", "recurrent", "full"]])
async def test_every_request_restores_its_whole_prefix(requests: int, slots: int, kinds: list[str]) -> None:
    rec = kinds.index("recurrent")
    sc = Scenario(documents=min(requests, 8), requests=requests, blocks=6, kinds=kinds,
                  slots={rec: slots}, default_slots=4096, block_bytes=1024, writer_subprocess=False,
                  max_steps=400)
    res = await run_scenario(sc)
    assert res.lookups["miss"] == 0
    assert all(not r.from_scratch and r.mismatches == 0 for r in res.requests)
    assert res.restored_fraction == 1.0
    # FIFO, one recurrent slot per request: request i waits about i // slots rounds at most
    worst = max(r.steps_waited for r in res.requests)
    assert worst <= 2 + -(-requests // slots) * 2


async def test_fifo_admission_serves_the_first_asker_first() -> None:
    layout = hybrid_layout(bb=256)
    cfg = config(layout, {"kind": "memory"}, slots={FULL: 64, SW: 64, REC: 1})
    async with TieredStore(cfg) as store:
        docs = [hashes(2, doc=d) for d in range(3)]
        for hs in docs:
            for g in (FULL, SW, REC):
                await store.put(g, hs, blocks(2, layout.groups[g].block_bytes))
                await store.flush()
        store.engine.clear()
        order = []
        waiting = {f"r{i}": docs[i] for i in range(3)}
        for _ in range(20):
            for rid, hs in list(waiting.items()):
                pl = store.lookup_prefix(hs, request_id=rid)
                assert pl.state is not Lookup.MISS
                if pl.state is Lookup.HIT:
                    order.append(rid)
                    store.release(rid)
                    del waiting[rid]
            await store.idle()
            if not waiting:
                break
        assert order == ["r0", "r1", "r2"]


async def test_a_queued_request_holds_no_pins_so_requests_never_deadlock() -> None:
    layout = hybrid_layout(bb=256)
    cfg = config(layout, {"kind": "memory"}, slots={FULL: 64, SW: 64, REC: 1})
    async with TieredStore(cfg) as store:
        a, b = hashes(2, doc=1), hashes(2, doc=2)
        for hs in (a, b):
            for g in (FULL, SW, REC):
                await store.put(g, hs, blocks(2, layout.groups[g].block_bytes))
                await store.flush()
        store.engine.clear()
        assert store.lookup_prefix(a, request_id="A").state is Lookup.PENDING
        assert store.lookup_prefix(b, request_id="B").state is Lookup.PENDING
        assert store.stats().admission_queue == 1
        # B holds no pins: every pinned slot is one of A's promotions (one block per group... 2 full)
        assert sum(g.pinned for g in store.stats().groups) == sum(g.writing for g in store.stats().groups)
        await store.idle()
        assert store.lookup_prefix(a, request_id="A") == PrefixLookup(2, Lookup.HIT)
        store.release("A")
        await store.idle()
        assert store.lookup_prefix(b, request_id="B") == PrefixLookup(2, Lookup.HIT)


async def test_pending_not_miss_when_the_pool_is_full_of_in_flight_promotions() -> None:
    slow = {"kind": "faulty", "inner": {"kind": "memory"}, "delay_s": 0.2, "ops": ["get"]}
    layout = hybrid_layout(bb=256)
    async with TieredStore(config(layout, slow, slots={FULL: 2, SW: 2, REC: 2})) as store:
        await store.put(FULL, hashes(2), blocks(2, 256))
        await store.flush()
        await store.put(FULL, hashes(2, doc=1), blocks(2, 256))
        await store.flush()
        assert store.lookup(FULL, hashes(2), request_id="a") == [Lookup.PENDING] * 2
        g = group_stats(store, FULL)
        assert g.free + g.evictable == 0 and g.writing == 2
        # both slots are held by promotions in flight: another request waits, it does not miss
        assert store.lookup(FULL, hashes(2, doc=1)[:1], request_id="b") == [Lookup.PENDING]
        await store.idle()
        assert store.lookup(FULL, hashes(2), request_id="a") == [Lookup.HIT] * 2
        assert store.lookup(FULL, hashes(2, doc=1)[:1], request_id="b") == [Lookup.PENDING]
        store.release("a")
        await store.idle()
        assert store.lookup(FULL, hashes(2, doc=1)[:1], request_id="b") == [Lookup.HIT]


async def test_longest_prefix_whose_states_fit() -> None:
    layout = hybrid_layout(bb=256, window=4)
    async with TieredStore(config(layout, {"kind": "memory"}, slots={FULL: 32, SW: 2, REC: 2})) as store:
        hs = hashes(10)
        for g in (FULL, SW, REC):
            for i in range(10):
                await store.put(g, hs[i:i + 1], blocks(1, 256 * (2 if g == REC else 1), seed=i))
                await store.flush()
        # the window needs 4 blocks but the sliding-window pool has 2 slots: 2 blocks is what fits
        pl = store.lookup_prefix(hs, request_id="r")
        assert pl.blocks == 2 and pl.state is not Lookup.MISS
        await store.idle()
        assert store.lookup_prefix(hs, request_id="r") == PrefixLookup(2, Lookup.HIT)


async def test_no_slot_leaks_when_requests_abort_mid_promotion() -> None:
    slow = {"kind": "faulty", "inner": {"kind": "memory"}, "delay_s": 0.1, "ops": ["get"]}
    layout = hybrid_layout(bb=256)
    async with TieredStore(config(layout, slow, slots={FULL: 4, SW: 4, REC: 4})) as store:
        hs = hashes(4)
        await store.put(FULL, hs, blocks(4, 256))
        await store.flush()
        store.engine.clear()
        assert store.lookup(FULL, hs, request_id="gone") == [Lookup.PENDING] * 4
        store.release("gone")  # aborted while its promotions are in flight
        await store.idle()
        g = store.stats().groups[0]
        assert g.pinned == 0 and g.writing == 0 and g.ready == 4
        g = group_stats(store, FULL)
        assert g.free + g.evictable == 4


async def test_failed_reads_free_their_slots_and_count_a_miss() -> None:
    bad = {"kind": "faulty", "inner": {"kind": "memory"}, "fail_every": 1, "ops": ["get"], "error": "EIO"}
    layout = hybrid_layout(bb=256)
    async with TieredStore(config(layout, bad, slots={FULL: 4, SW: 4, REC: 4})) as store:
        hs = hashes(3)
        await store.put(FULL, hs, blocks(3, 256))
        await store.flush()
        store.engine.clear()
        assert store.lookup(FULL, hs, request_id="r") == [Lookup.PENDING] * 3
        await store.idle()
        st = store.stats()
        assert st.tiers[1].promotions_failed == 3
        assert st.groups[0].writing == 0 and st.groups[0].pinned == 0
        g = group_stats(store, FULL)
        assert g.free + g.evictable == 4
        assert store.lookup(FULL, hs, request_id="r") == [Lookup.MISS] * 3
        store.release("r")
        out = torch.zeros(3, 256, dtype=torch.uint8)
        with pytest.raises(Exception) as exc:
            await store.get(FULL, hs, out)
        assert type(exc.value).__name__ == "BlockMissing"



async def test_reported_scenario_through_s3(s3_endpoint: str) -> None:
    url = f"s3://{new_bucket(s3_endpoint)}/kv"
    sc = Scenario(documents=4, requests=4, kinds=["full", "recurrent"], slots={1: 3}, url=url,
                  storage_options=storage_options(s3_endpoint))
    res = await run_scenario(sc)
    assert res.lookups["miss"] == 0
    assert all(not r.from_scratch and r.mismatches == 0 for r in res.requests)
    assert res.restored_fraction == 1.0


async def test_queue_service_counts_the_blocks_it_pins_as_taken() -> None:
    """Regression: a queued request wanting a resident block plus a promotion was admitted when the
    only evictable slot was that very block, and the promotion then found no slot."""
    layout = hybrid_layout(bb=256)
    async with TieredStore(config(layout, {"kind": "memory"}, slots={FULL: 2, SW: 2, REC: 2})) as store:
        k1, k2, x = hashes(1, doc=1), hashes(1, doc=2), hashes(1, doc=3)
        await store.put(FULL, k2, blocks(1, 256, seed=2))
        await store.flush()
        await store.put(FULL, k1, blocks(1, 256, seed=1))
        await store.flush()
        await store.put(FULL, x, blocks(1, 256, seed=3))  # evicts k2 (only on the lower tier now)
        await store.flush()
        assert store.lookup(FULL, x, request_id="B") == [Lookup.HIT]  # x stays pinned
        assert store.lookup(FULL, k1 + k2, request_id="A") == [Lookup.HIT, Lookup.PENDING]
        assert store.stats().admission_queue == 1
        store.release("nobody")  # any event that services the queue
        await store.idle()
        assert store.stats().admission_queue == 1  # still waiting: its own block is not a free slot
        store.release("B")
        await store.idle()
        assert store.lookup(FULL, k1 + k2, request_id="A") == [Lookup.HIT, Lookup.HIT]
