"""TieredStore's public behaviour: the API of DESIGN.md and its semantics."""

from __future__ import annotations

import inspect

import anyio
import pytest
import torch
from helpers import FULL, REC, SCRATCH, SW, blocks, config, group_stats, hashes, hybrid_layout

from tierkv import (
    BlockMissing,
    CapacityError,
    ConfigError,
    InvalidArgument,
    Lookup,
    PrefixLookup,
    StoreClosed,
    TieredStore,
)

pytestmark = pytest.mark.anyio

LAYOUT = hybrid_layout()
ALL = {FULL: 16, SW: 16, REC: 4}


def bb(g: int) -> int:
    return LAYOUT.groups[g].block_bytes


async def test_put_get_round_trip_every_group() -> None:
    async with TieredStore(config(LAYOUT, {"kind": "memory"}, slots=ALL)) as store:
        hs = hashes(6)
        for g in (FULL, SW, REC):
            data = blocks(6, bb(g), seed=g)
            await store.put(g, hs, data)
            out = torch.zeros_like(data)
            await store.get(g, hs, out)
            assert torch.equal(out, data)


async def test_any_dtype_with_rows_of_block_bytes() -> None:
    async with TieredStore(config(LAYOUT, slots=ALL)) as store:
        data = torch.randn(3, bb(FULL) // 2).to(torch.bfloat16)
        await store.put(FULL, hashes(3), data)
        out = torch.empty_like(data)
        await store.get(FULL, hashes(3), out)
        assert torch.equal(out.view(torch.int16), data.view(torch.int16))


async def test_evicted_blocks_come_back_from_the_lower_tier() -> None:
    async with TieredStore(config(LAYOUT, {"kind": "memory"}, slots={FULL: 4, SW: 4, REC: 2})) as store:
        hs = hashes(12)
        data = blocks(12, bb(FULL), seed=1)
        for i in range(12):
            await store.put(FULL, hs[i:i + 1], data[i:i + 1])
            await store.flush()
        assert group_stats(store, FULL).evictions == 8
        assert store.lookup(FULL, hs[:4], request_id="r") == [Lookup.PENDING] * 4
        out = torch.zeros_like(data)
        await store.get(FULL, hs, out, request_id="r")
        assert torch.equal(out, data)
        st = store.stats()
        assert st.tiers[1].hits + st.tiers[1].promotions >= 8


async def test_a_block_the_tier_already_holds_is_not_written_again() -> None:
    async with TieredStore(config(LAYOUT, {"kind": "memory"}, slots={FULL: 4, SW: 4, REC: 2})) as store:
        hs = hashes(8)
        data = blocks(8, bb(FULL), seed=2)
        await store.put(FULL, hs, data)  # 4 stay in the pool, 4 go down from a copy
        await store.flush()
        assert store.stats().tiers[1].stores == 8
        await store.put(FULL, hs, data)  # the tier holds all 8: none is written again
        await store.flush()
        st = store.stats().tiers[1]
        assert st.stores == 8 and st.stores_skipped >= 4


async def test_lookup_is_synchronous_and_answers_pending_while_a_slow_tier_is_probed() -> None:
    slow = {"kind": "faulty", "inner": {"kind": "fsspec", "url": "memory://slow-probe"}, "delay_s": 0.5}
    async with TieredStore(config(LAYOUT, slow, slots=ALL)) as store:
        assert not inspect.iscoroutinefunction(TieredStore.lookup)
        assert not inspect.iscoroutinefunction(TieredStore.lookup_prefix)
        t0 = anyio.current_time()
        res = store.lookup(FULL, hashes(4))
        assert anyio.current_time() - t0 < 0.1
        assert res == [Lookup.PENDING] * 4
        await store.idle()
        assert store.lookup(FULL, hashes(4)) == [Lookup.MISS] * 4


async def test_miss_hit_and_pending() -> None:
    async with TieredStore(config(LAYOUT, {"kind": "memory"}, slots={FULL: 2, SW: 2, REC: 2})) as store:
        hs = hashes(4)
        assert store.lookup(FULL, hs) == [Lookup.MISS] * 4
        await store.put(FULL, hs, blocks(4, bb(FULL)))
        await store.flush()
        # two blocks found a primary slot, two went straight to the lower tier
        assert store.stats().put_blocks_direct == 2
        assert store.lookup(FULL, hs[2:]) == [Lookup.PENDING] * 2
        await store.idle()
        assert store.lookup(FULL, hs[2:], request_id="a") == [Lookup.HIT] * 2
        # one request can never hold 4 blocks in a pool of 2: the blocks past what fits are MISS
        assert store.lookup(FULL, hs, request_id="a") == [Lookup.MISS] * 2 + [Lookup.HIT] * 2


async def test_promoted_slot_is_pinned_for_its_request() -> None:
    async with TieredStore(config(LAYOUT, {"kind": "memory"}, slots={FULL: 3, SW: 2, REC: 2})) as store:
        a = hashes(1, doc=1)
        da = blocks(1, bb(FULL), seed=5)
        await store.put(FULL, a, da)
        await store.flush()
        await store.put(FULL, hashes(3, doc=2), blocks(3, bb(FULL), seed=6))  # evicts a
        assert store.lookup(FULL, a, request_id="A") == [Lookup.PENDING]
        await store.idle()
        # request B fills the pool with new blocks: A's promoted slot must survive
        for d in range(3, 8):
            await store.put(FULL, hashes(2, doc=d), blocks(2, bb(FULL), seed=d))
        assert store.lookup(FULL, a, request_id="A") == [Lookup.HIT]
        await store.flush()  # cascades pin the slots they read: only A's pin is left after them
        assert group_stats(store, FULL).pinned == 1
        out = torch.zeros_like(da)
        await store.get(FULL, a, out, request_id="A")
        assert torch.equal(out, da)
        assert group_stats(store, FULL).pinned == 0


async def test_release_drops_pins() -> None:
    async with TieredStore(config(LAYOUT, slots=ALL)) as store:
        await store.put(FULL, hashes(5), blocks(5, bb(FULL)))
        store.lookup(FULL, hashes(5), request_id="r")
        assert store.stats().groups[0].pinned == 5
        store.release("r")
        assert store.stats().groups[0].pinned == 0
        assert store.stats().requests_active == 0


async def test_pins_expire_after_the_lease() -> None:
    async with TieredStore(config(LAYOUT, slots=ALL, pin_lease_s=0.2)) as store:
        await store.put(FULL, hashes(2), blocks(2, bb(FULL)))
        store.lookup(FULL, hashes(2), request_id="gone")
        assert store.stats().groups[0].pinned == 2
        await anyio.sleep(0.6)
        st = store.stats()
        assert st.groups[0].pinned == 0
        assert st.leases_expired == 1


async def test_lookup_prefix_applies_the_hybrid_rules() -> None:
    layout = hybrid_layout(window=2)
    async with TieredStore(config(layout, slots={FULL: 32, SW: 32, REC: 8})) as store:
        hs = hashes(10)
        await store.put(FULL, hs, blocks(10, bb(FULL)))
        await store.put(SW, hs[6:10], blocks(4, bb(SW)))       # window 2: prefixes 7..10 usable
        await store.put(REC, [hs[7]], blocks(1, bb(REC)))      # recurrent state only at block 7
        assert store.lookup_prefix(hs) == PrefixLookup(8, Lookup.HIT)
        await store.put(REC, [hs[9]], blocks(1, bb(REC), seed=2))
        assert store.lookup_prefix(hs) == PrefixLookup(10, Lookup.HIT)
        assert store.lookup_prefix(hashes(3, doc=9)) == PrefixLookup(0, Lookup.MISS)


async def test_lookup_prefix_ignores_scratch_groups_and_needs_every_full_block() -> None:
    async with TieredStore(config(LAYOUT, slots=ALL)) as store:
        hs = hashes(6)
        await store.put(FULL, hs[:2] + hs[3:], blocks(5, bb(FULL)))  # block 2 missing
        await store.put(SW, hs, blocks(6, bb(SW)))
        await store.put(REC, hs, blocks(6, bb(REC)))
        assert store.lookup_prefix(hs) == PrefixLookup(2, Lookup.HIT)


async def test_lookup_prefix_pending_while_promotions_run_then_hit() -> None:
    async with TieredStore(config(LAYOUT, {"kind": "memory"}, slots=ALL)) as store:
        hs = hashes(4)
        for g in (FULL, SW, REC):
            await store.put(g, hs, blocks(4, bb(g), seed=g))
        await store.flush()
        assert store.engine.clear() == 12
        first = store.lookup_prefix(hs, request_id="r")
        assert first == PrefixLookup(4, Lookup.PENDING)
        await store.idle()
        assert store.lookup_prefix(hs, request_id="r") == PrefixLookup(4, Lookup.HIT)


async def test_lookup_prefix_falls_back_to_the_longest_prefix_that_fits() -> None:
    async with TieredStore(config(LAYOUT, {"kind": "memory"}, slots={FULL: 5, SW: 4, REC: 2})) as store:
        hs = hashes(8)
        for g in (FULL, SW, REC):
            for i in range(8):
                await store.put(g, hs[i:i + 1], blocks(1, bb(g), seed=i))
                await store.flush()
        res = store.lookup_prefix(hs, request_id="r")
        assert res.blocks == 5  # the full pool holds 5 blocks: never 0, never 8
        await store.idle()
        assert store.lookup_prefix(hs, request_id="r") == PrefixLookup(5, Lookup.HIT)


@pytest.mark.parametrize("bad", [
    lambda s: s.put(SCRATCH, hashes(1), blocks(1, 64)),
    lambda s: s.put(7, hashes(1), blocks(1, 1024)),
    lambda s: s.put(FULL, [b"x", b"x"], blocks(2, 1024)),
    lambda s: s.put(FULL, ["not-bytes"], blocks(1, 1024)),
    lambda s: s.put(FULL, hashes(2), blocks(3, 1024)),
    lambda s: s.put(FULL, hashes(2), blocks(2, 1000)),
    lambda s: s.put(FULL, hashes(2), torch.zeros(2, 1024, dtype=torch.float32)),
    lambda s: s.put(FULL, hashes(2), torch.zeros(2, 1024, dtype=torch.uint8, device="meta")),
    lambda s: s.put(FULL, hashes(2), blocks(2, 2048)[:, ::2]),
    lambda s: s.put(FULL, b"abc", blocks(3, 1024)),
    lambda s: s.get(SCRATCH, hashes(1), torch.zeros(1, 64, dtype=torch.uint8)),
    lambda s: s.get(FULL, hashes(2), torch.zeros(2, 512, dtype=torch.uint8)),
])
async def test_bad_input_is_refused_before_any_state_changes(bad) -> None:  # type: ignore[no-untyped-def]
    async with TieredStore(config(LAYOUT, {"kind": "memory"}, slots=ALL)) as store:
        before = store.stats().model_dump()
        with pytest.raises(InvalidArgument):
            await bad(store)
        after = store.stats().model_dump()
        assert before == after


@pytest.mark.parametrize("call", [
    lambda s: s.lookup(SCRATCH, hashes(1)),
    lambda s: s.lookup(-1, hashes(1)),
    lambda s: s.lookup(FULL, hashes(1) * 2),
    lambda s: s.lookup_prefix([1, 2]),
    lambda s: s.lookup(FULL, hashes(1), request_id=5),
])
async def test_bad_lookup_is_refused(call) -> None:  # type: ignore[no-untyped-def]
    async with TieredStore(config(LAYOUT, slots=ALL)) as store:
        before = store.stats().model_dump()
        with pytest.raises(InvalidArgument):
            call(store)
        assert store.stats().model_dump() == before


async def test_scratch_groups_get_no_pool() -> None:
    async with TieredStore(config(LAYOUT, capacity=1 << 20)) as store:
        assert SCRATCH not in [g.group for g in store.stats().groups]
        assert [g.group for g in store.stats().plan.groups] == [FULL, SW, REC]


async def test_capacity_zero_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"tiers\.0\.capacity_bytes"):
        TieredStore(config(LAYOUT, capacity=0))
    with pytest.raises(ConfigError, match=r"tiers\.1\.capacity_bytes"):
        TieredStore(config(LAYOUT, {"kind": "memory", "capacity_bytes": 0}, slots=ALL))


async def test_budget_below_the_floor_is_refused() -> None:
    with pytest.raises(CapacityError, match="floor"):
        async with TieredStore(config(hybrid_layout(states=4), capacity=4096)):
            pass


async def test_slots_override_below_floor_is_honoured_and_reported() -> None:
    cfg = config(hybrid_layout(states=2), capacity=1 << 20, slots={REC: 1})
    async with TieredStore(cfg) as store:
        plan = {g.group: g for g in store.stats().plan.groups}
        assert plan[REC].slots == 1 and plan[REC].floor == 4
        assert "below the floor" in plan[REC].reason
        assert group_stats(store, REC).slots == 1


async def test_unopened_store_refuses_calls() -> None:
    store = TieredStore(config(LAYOUT, slots=ALL))
    with pytest.raises(StoreClosed):
        store.lookup(FULL, hashes(1))


async def test_failing_lower_tier_is_counted_and_primary_still_serves() -> None:
    bad = {"kind": "faulty", "inner": {"kind": "memory"}, "fail_every": 1, "ops": ["put"], "error": "ENOSPC"}
    async with TieredStore(config(LAYOUT, bad, slots=ALL)) as store:
        data = blocks(3, bb(FULL))
        await store.put(FULL, hashes(3), data)
        await store.flush()
        st = store.stats()
        assert st.tiers[1].stores_failed == 3 and st.tiers[1].stores == 0
        assert store.lookup(FULL, hashes(3)) == [Lookup.HIT] * 3
        out = torch.zeros_like(data)
        await store.get(FULL, hashes(3), out)
        assert torch.equal(out, data)


async def test_lend_slots_pins_ready_blocks_without_the_loop_and_takes_nothing_otherwise() -> None:
    async with TieredStore(config(LAYOUT, slots=ALL)) as store:
        data = blocks(3, bb(FULL), seed=9)
        await store.put(FULL, hashes(3), data)
        pool = store.tiers[0].pools[FULL].tensor  # type: ignore[attr-defined]
        hits = store.stats().tiers[0].hits

        def lend(hs: list[bytes]) -> tuple[list[int] | None, int, list[torch.Tensor]]:
            with store.lend_slots(FULL, hs) as slots:  # from a thread: it never touches the loop
                rows = [pool[s].clone() for s in slots] if slots is not None else []
                return slots, group_stats(store, FULL).pinned, rows

        slots, pinned, rows = await anyio.to_thread.run_sync(lend, hashes(3))
        assert slots is not None and pinned == 3
        assert torch.equal(torch.stack(rows), data)
        assert group_stats(store, FULL).pinned == 0
        assert store.stats().tiers[0].hits == hits + 3
        slots, pinned, _ = lend(hashes(4))  # one block absent: None, nothing pinned or counted
        assert slots is None and pinned == 0
        assert store.stats().tiers[0].hits == hits + 3


async def test_a_failed_store_is_never_visible() -> None:
    bad = {"kind": "faulty", "inner": {"kind": "memory"}, "fail_every": 1, "ops": ["put"]}
    async with TieredStore(config(LAYOUT, bad, slots={FULL: 2, SW: 2, REC: 2})) as store:
        await store.put(FULL, hashes(2), blocks(2, bb(FULL)))
        await store.flush()
        await store.put(FULL, hashes(2, doc=5), blocks(2, bb(FULL)))  # evicts the first two
        await store.flush()
        assert store.lookup(FULL, hashes(2)) == [Lookup.MISS] * 2
        with pytest.raises(BlockMissing) as exc:
            await store.get(FULL, hashes(2), torch.zeros(2, bb(FULL), dtype=torch.uint8))
        assert exc.value.missing == [0, 1]


async def test_failed_promotion_is_a_counted_miss_and_frees_its_slot() -> None:
    flaky = {"kind": "faulty", "inner": {"kind": "memory"}, "fail_every": 1, "ops": ["get"]}
    async with TieredStore(config(LAYOUT, flaky, slots={FULL: 2, SW: 2, REC: 2})) as store:
        await store.put(FULL, hashes(2), blocks(2, bb(FULL)))
        await store.flush()
        await store.put(FULL, hashes(2, doc=3), blocks(2, bb(FULL)))
        await store.flush()
        assert store.lookup(FULL, hashes(2), request_id="r") == [Lookup.PENDING] * 2
        await store.idle()
        st = store.stats()
        assert st.tiers[1].promotions_failed == 2
        assert st.groups[0].pinned == 0 and st.groups[0].writing == 0
        assert store.lookup(FULL, hashes(2), request_id="r") == [Lookup.MISS] * 2


async def test_put_beyond_a_full_pinned_primary_goes_straight_down() -> None:
    async with TieredStore(config(LAYOUT, {"kind": "memory"}, slots={FULL: 2, SW: 2, REC: 2})) as store:
        await store.put(FULL, hashes(2), blocks(2, bb(FULL)))
        store.lookup(FULL, hashes(2), request_id="pin")
        data = blocks(3, bb(FULL), seed=9)
        await store.put(FULL, hashes(3, doc=4), data)  # no slot can be had: direct cascade
        out = torch.zeros_like(data)
        await store.get(FULL, hashes(3, doc=4), out)
        assert torch.equal(out, data)
        await store.flush()
        assert store.stats().put_blocks_direct == 3
        out.zero_()
        await store.get(FULL, hashes(3, doc=4), out)
        assert torch.equal(out, data)


async def test_cascades_are_shed_under_backpressure_and_counted() -> None:
    slow = {"kind": "faulty", "inner": {"kind": "memory"}, "delay_s": 0.05,
            "max_inflight_bytes": 2 * 1024, "max_inflight_ops": 1}
    async with TieredStore(config(LAYOUT, slow, slots={FULL: 64, SW: 2, REC: 2})) as store:
        for d in range(20):
            await store.put(FULL, hashes(1, doc=d), blocks(1, bb(FULL), seed=d))
        await store.flush()
        t = store.stats().tiers[1]
        assert t.stores_shed > 0
        assert t.stores + t.stores_shed + t.stores_failed == 20
        assert t.inflight_bytes == 0


async def test_flush_waits_for_every_cascade() -> None:
    slow = {"kind": "faulty", "inner": {"kind": "memory"}, "delay_s": 0.05}
    async with TieredStore(config(LAYOUT, slow, slots=ALL)) as store:
        await store.put(FULL, hashes(4), blocks(4, bb(FULL)))
        assert store.stats().tiers[1].stores == 0
        await store.flush()
        assert store.stats().tiers[1].stores == 4


async def test_stats_prometheus_exposition() -> None:
    from tierkv import to_prometheus

    async with TieredStore(config(LAYOUT, {"kind": "memory"}, slots=ALL)) as store:
        await store.put(FULL, hashes(2), blocks(2, bb(FULL)))
        await store.flush()
        text = to_prometheus(store.stats())
        assert 'tierkv_tier_stores_total{tier="1",kind="memory"} 2' in text
        assert 'tierkv_pool_slots{group="0",kind="full"} 16' in text


async def test_a_tier_measured_slow_gets_its_cascades_shed_but_loads_still_served() -> None:
    """Shedding by latency: once the EMA says the queue would take longer than shed_after_s, new
    cascades are shed (counted) while reads from the same tier still go through."""
    slow = {"kind": "faulty", "inner": {"kind": "memory"}, "delay_s": 0.2, "ops": ["put"],
            "max_inflight_ops": 1, "shed_after_s": 0.01}
    async with TieredStore(config(LAYOUT, slow, slots={FULL: 64, SW: 2, REC: 2})) as store:
        await store.put(FULL, hashes(1, doc=0), blocks(1, bb(FULL)))
        await store.flush()  # one cascade completes: the tier's latency is now known (slow)
        assert store.stats().tiers[1].store_s_per_mib > 0
        for d in range(1, 6):
            await store.put(FULL, hashes(1, doc=d), blocks(1, bb(FULL), seed=d))
        await store.flush()
        t = store.stats().tiers[1]
        assert t.stores_shed >= 3
        assert t.stores + t.stores_shed == 6
        store.engine.clear()
        out = torch.zeros(1, bb(FULL), dtype=torch.uint8)
        await store.get(FULL, hashes(1, doc=0), out)  # promotions are never shed
        assert torch.equal(out, blocks(1, bb(FULL)))


async def test_concurrent_gets_of_blocks_on_a_lower_tier_read_each_block_once() -> None:
    """A ``get`` of blocks no primary slot holds promotes them: a second ``get`` of the same blocks
    meanwhile waits for that promotion instead of reading them again, and both get the bytes."""
    slow = {"kind": "faulty", "inner": {"kind": "memory"}, "delay_s": 0.2, "ops": ["get"]}
    async with TieredStore(config(LAYOUT, slow, slots=ALL)) as store:
        hs, data = hashes(4, doc=40), blocks(4, bb(FULL), seed=40)
        await store.put(FULL, hs, data)
        await store.flush()
        await store.put(FULL, hashes(16, doc=41), blocks(16, bb(FULL), seed=41))  # evicts hs
        await store.flush()
        assert store.stats().groups[0].ready == 16  # hs are on the lower tier only
        outs = [torch.zeros_like(data) for _ in range(2)]
        reads = store.stats().tiers[1].hits
        async with anyio.create_task_group() as tg:
            for out in outs:
                tg.start_soon(store.get, FULL, hs, out)
        assert all(torch.equal(out, data) for out in outs)
        assert store.stats().tiers[1].hits - reads == 4
        assert store.lookup(FULL, hs) == [Lookup.HIT] * 4
        assert store.check() == []


async def test_check_accounts_for_every_pin_while_cascades_run() -> None:
    """``check()`` knows each pin's owner (requests, calls, cascades), so it checks the pins while
    cascades pin slots too, and finds one that no owner accounts for."""
    slow = {"kind": "faulty", "inner": {"kind": "memory"}, "delay_s": 0.3, "ops": ["put"]}
    async with TieredStore(config(LAYOUT, slow, slots=ALL)) as store:
        hs = hashes(4, doc=50)
        await store.put(FULL, hs, blocks(4, bb(FULL), seed=50))
        store.lookup(FULL, hs[:2], request_id="r")
        assert store.has_pending_work() and group_stats(store, FULL).pinned == 4
        assert store.check() == []
        pool = store.tiers[0].pools[FULL]  # type: ignore[attr-defined]
        pool.pin(pool.slot_of(hs[3] + FULL.to_bytes(4, "big")))  # a pin with no owner
        assert any("do not match their owners" in p for p in store.check())
        pool.unpin(pool.slot_of(hs[3] + FULL.to_bytes(4, "big")))
        await store.flush()
        store.release("r")
        assert store.check() == [] and group_stats(store, FULL).pinned == 0
