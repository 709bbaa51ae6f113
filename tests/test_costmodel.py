"""Restore only when it beats recompute: the cost model's choice, and the deadline on PENDING."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from helpers import FULL, REC, SW, blocks, group_stats, hashes, hybrid_layout
from hypothesis import given
from hypothesis import strategies as st

from tierkv import GroupSpec, Layout, Lookup, PrefixLookup, TieredStore
from tierkv.movement.costmodel import FALLBACK_DEADLINE_S, CostModel
from tierkv.movement.lookup import KeyState
from tierkv.movement.transfers import MAX_RATE, MIN_RATE, RATE_WINDOW, RateEstimate

pytestmark = pytest.mark.anyio

BB = 64 << 10
LAYOUT = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])


def test_the_choice_maximises_the_time_saved() -> None:
    cm = CostModel(tokens_per_block=16, recompute_tokens_per_s=1600.0, max_pending_s=None)
    # recomputing one block takes 0.01 s; blocks 0-3 are resident, 4-7 cost 0.001 s, 8-11 0.1 s
    costs = [0.0] * 4 + [0.001] * 4 + [0.1] * 4
    d = cm.choose(12, costs, lambda k: 0.0, lambda k: 0.0)
    assert d.blocks == 8 and d.usable == 12
    assert cm.blocks_recomputed == 4 and cm.decisions == 1
    # a long queue ahead on the tier makes every load lose: only the resident prefix is kept
    d = cm.choose(12, costs, lambda k: 0.0, lambda k: 5.0 if k > 4 else 0.0)
    assert d.blocks == 4


def test_the_deadline_rule() -> None:
    assert CostModel(16, None, 2.5).deadline_s(100) == 2.5
    assert CostModel(16, 1600.0, None).deadline_s(100) == pytest.approx(1.0)
    assert CostModel(16, None, None).deadline_s(100) == FALLBACK_DEADLINE_S
    assert CostModel(16, 1600.0, None, enabled=False).deadline_s(100) == FALLBACK_DEADLINE_S


def cfg(tiers: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {"layout": LAYOUT, "namespace": "cost", "tiers": [{"kind": "cpu", "slots": {0: 64}}, *tiers],
            **kw}


async def write_to_disk(root: Path, hs: list[bytes], data: torch.Tensor) -> None:
    async with TieredStore(cfg([{"kind": "fsspec", "url": f"file://{root}"}])) as store:
        await store.put(0, hs, data)
        await store.flush()


async def until_settled(store: TieredStore, hs: list[bytes], rid: str) -> PrefixLookup:
    with anyio.fail_after(30):
        while True:
            pl = store.lookup_prefix(hs, request_id=rid)
            if pl.state is not Lookup.PENDING:
                return pl
            await anyio.sleep(0.005)


async def test_the_longest_prefix_that_wins_on_a_fast_pool_and_a_slow_disk(tmp_path: Path) -> None:
    """Blocks 0-9 in the CPU pool, 10-19 in a fast memory tier, 20-29 only on a slow disk: with a
    recompute rate between the two, the request loads from the fast tier and recomputes the rest."""
    hs, data = hashes(30), blocks(30, BB)
    await write_to_disk(tmp_path, hs[20:], data[20:])
    disk = {"kind": "fsspec", "url": f"file://{tmp_path}", "read_bytes_per_s": 1e6}  # 65 ms a block
    memory = {"kind": "memory", "read_bytes_per_s": 1e10}
    # recomputing a block of 16 tokens at 1600 tokens/s: 10 ms, between the two tiers
    async with TieredStore(cfg([memory, disk], recompute_tokens_per_s=1600.0)) as store:
        await store.put(0, hs[10:20], data[10:20])
        await store.flush()
        store.engine.clear()
        await store.put(0, hs[:10], data[:10])
        await store.flush()
        pl = await until_settled(store, hs, "r")
        assert pl == PrefixLookup(20, Lookup.HIT)
        st = store.stats()
        assert st.cost.decisions >= 1 and st.cost.blocks_recomputed >= 10
        assert st.cost.last is not None and st.cost.last["blocks"] == 20
        assert st.tiers[2].promotions == 0, "nothing was read from the slow disk"
        out = torch.zeros((20, BB), dtype=torch.uint8)
        await store.get(0, hs[:20], out, request_id="r")
        assert torch.equal(out, data[:20])
        store.release("r")
        # the same layout where recomputing is slow: everything is loaded
        store.set_recompute_rate(10.0)
        pl = await until_settled(store, hs, "s")
        assert pl == PrefixLookup(30, Lookup.HIT)


async def test_a_throttled_tier_is_learnt_from_its_loads_and_then_recomputed(tmp_path: Path) -> None:
    """The tier claims 500 MB/s (the prior) but reads at 4 MB/s (16 ms a block): the first two
    requests load (their deadline set long) and measure it (one slow sample moves the estimate by
    one rank of its window, never replaces it; two make it the median); recomputing takes 10 ms a
    block, so the next request recomputes."""
    hs, data = hashes(12), blocks(12, BB)
    await write_to_disk(tmp_path, hs, data)
    slow = {"kind": "faulty", "inner": {"kind": "fsspec", "url": f"file://{tmp_path}"},
            "max_read_bytes_per_s": 4e6}
    async with TieredStore(cfg([slow], recompute_tokens_per_s=1600.0, max_pending_s=10.0)) as store:
        for n, rid in enumerate(("a", "a2")):
            part = slice(4 * n, 4 * n + 4)
            t0 = time.monotonic()
            assert await until_settled(store, hs[part], rid) == PrefixLookup(4, Lookup.HIT)
            assert time.monotonic() - t0 >= 4 * BB / 4e6 * 0.9, "the cap was not applied"
            out = torch.zeros((4, BB), dtype=torch.uint8)
            await store.get(0, hs[part], out, request_id=rid)
            assert torch.equal(out, data[part])
            store.release(rid)
            if n == 0:
                assert store.stats().tiers[1].read_bytes_per_s == 500e6, "one sample replaced the estimate"
        assert store.stats().tiers[1].read_bytes_per_s < 8e6
        hs = hs[8:] + hashes(4, doc=1)
        await write_to_disk(tmp_path, hs[4:], blocks(4, BB, seed=1))
        assert await until_settled(store, hs[:4], "b") == PrefixLookup(0, Lookup.MISS)
        st = store.stats()
        assert st.cost.blocks_recomputed == 4 and st.tiers[1].promotions == 8, "read again from the slow tier"
        # an engine looking keys up one by one (the vLLM adapter) gets the same answer per block
        full_key = hs[6] + (0).to_bytes(4, "big")
        with anyio.fail_after(10):
            while (ks := store.engine.key_state(0, full_key, "c")) is KeyState.PROBING:
                await anyio.sleep(0.005)
        assert ks is KeyState.MISS
        await anyio.sleep(0.1)
        assert store.stats().tiers[1].promotions == 8


async def test_a_run_of_blocks_too_short_to_pay_for_the_restore_wait_is_recomputed() -> None:
    """An engine that looks keys up one at a time (vLLM): a restore from a lower tier waits a fixed
    time whatever its size (promotion, engine steps: measured, 45 ms here); recomputing a block
    takes 10 ms (16 tokens at 1,600 tokens/s), reading it next to nothing. A request whose run of
    blocks on the tier is 2 long is declined as a whole (asked again, its first block is a MISS);
    one whose run is 8 long restores it, from the 5th block on (5 x 10 ms pays for the wait) and
    the 4 counted before it; its wait, once READY, is measured for the next requests."""
    memory = {"kind": "memory", "read_bytes_per_s": 1e10}
    tail = (0).to_bytes(4, "big")
    async with TieredStore(cfg([memory], recompute_tokens_per_s=1600.0)) as store:
        hs = hashes(10)
        await store.put(0, hs, blocks(10, BB))
        await store.flush()
        store.engine.clear()
        store._cost.observe_fixed(0, 0.045)  # the first lower tier
        keys = [h + tail for h in hs]
        Q, P, M, R = KeyState.QUEUED, KeyState.PROMOTING, KeyState.MISS, KeyState.READY

        def scan(rid: str, ks: list[bytes]) -> list[KeyState]:
            out = []
            for k in ks:
                out.append(store.engine.key_state(0, k, rid))
                if out[-1] is M:
                    break
            return out

        short = [*keys[:2], hashes(1, doc=5)[0] + tail]  # the third block is nowhere
        assert scan("a", short) == [Q, Q, M]
        assert scan("a", short) == [M]
        assert store.stats().cost.blocks_recomputed == 2
        assert scan("b", keys[2:]) == [Q] * 4 + [P] * 4
        with anyio.fail_after(10):
            while (got := scan("b", keys[2:])) != [R] * 8:
                assert R not in got or got.index(P) > got.index(R), got
                await anyio.sleep(0.005)
        assert store.stats().tiers[1].promotions == 8
        assert store._cost.fixed_s(0) != 0.045  # the wait measured: the median of two now
        store.release("a")
        store.release("b")


async def test_the_read_cap_holds_across_concurrent_loads(tmp_path: Path) -> None:
    hs, data = hashes(4), blocks(4, BB)
    await write_to_disk(tmp_path, hs, data)
    slow = {"kind": "faulty", "inner": {"kind": "fsspec", "url": f"file://{tmp_path}"},
            "max_read_bytes_per_s": 8e6}
    async with TieredStore(cfg([slow], max_pending_s=10.0)) as store:
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            for i, h in enumerate(hs):  # four requests, one block each, all loading at once
                tg.start_soon(until_settled, store, [h], f"r{i}")
        assert time.monotonic() - t0 >= 4 * BB / 8e6 * 0.9
        assert store.stats().tiers[1].promotions == 4


async def test_without_a_recompute_rate_everything_usable_is_loaded(tmp_path: Path) -> None:
    hs, data = hashes(12), blocks(12, BB)
    await write_to_disk(tmp_path, hs, data)
    disk = {"kind": "fsspec", "url": f"file://{tmp_path}", "read_bytes_per_s": 1.0}
    async with TieredStore(cfg([disk])) as store:
        assert await until_settled(store, hs, "r") == PrefixLookup(12, Lookup.HIT)
        assert store.stats().cost.decisions == 0


STALL = {"kind": "faulty", "inner": {"kind": "memory"}, "delay_s": 3600.0, "ops": ["get"]}


async def test_a_tier_that_stalls_never_holds_a_request_past_its_deadline() -> None:
    hs, data = hashes(8), blocks(8, BB)
    async with TieredStore(cfg([STALL], max_pending_s=0.3)) as store:
        await store.put(0, hs, data)
        await store.flush()
        store.engine.clear()
        await store.put(0, hs[:3], data[:3])  # the first 3 are in the pool again
        t0 = time.monotonic()
        assert store.lookup_prefix(hs, request_id="r") == PrefixLookup(8, Lookup.PENDING)
        with anyio.fail_after(5):
            while (pl := store.lookup_prefix(hs, request_id="r")).state is Lookup.PENDING:
                await anyio.sleep(0.02)
        assert 0.3 <= time.monotonic() - t0 < 2.0
        assert pl == PrefixLookup(3, Lookup.HIT), "what is ready is a HIT, the rest recomputed"
        assert store.lookup_prefix(hs, request_id="r") == pl, "the answer stands for this request"
        st = store.stats()
        assert st.pending_deadline_miss == 1
        assert group_stats(store, 0).pinned == 3, "its pins on what is not ready are gone"
        out = torch.zeros((3, BB), dtype=torch.uint8)
        await store.get(0, hs[:3], out, request_id="r")
        assert torch.equal(out, data[:3])
        store.release("r")
        st = store.stats()
        assert st.requests_active == 0 and st.admission_queue == 0
        assert group_stats(store, 0).pinned == 0 and store.check() == []


async def test_the_deadline_follows_the_recompute_estimate_without_max_pending_s() -> None:
    hs, data = hashes(4), blocks(4, BB)
    # 4 blocks x 16 tokens at 320 tokens/s: a 0.2 s recompute estimate is the deadline
    async with TieredStore(cfg([STALL], recompute_tokens_per_s=320.0)) as store:
        await store.put(0, hs, data)
        await store.flush()
        store.engine.clear()
        t0 = time.monotonic()
        with anyio.fail_after(5):
            while (pl := store.lookup_prefix(hs, request_id="r")).state is Lookup.PENDING:
                await anyio.sleep(0.02)
        assert pl == PrefixLookup(0, Lookup.MISS) and time.monotonic() - t0 < 2.0
        assert store.stats().pending_deadline_miss == 1


async def test_the_engine_slot_api_turns_a_stalled_key_into_a_miss() -> None:
    """What the vLLM adapter sees: HIT_PENDING (PROMOTING) until the deadline, then MISS."""
    layout = hybrid_layout(bb=BB)
    conf = {"layout": layout, "namespace": "cost", "max_pending_s": 0.3,
            "tiers": [{"kind": "cpu", "slots": {FULL: 8, SW: 8, REC: 4}}, STALL]}
    async with TieredStore(conf) as store:
        hs = hashes(2)
        await store.put(FULL, hs, blocks(2, BB))
        await store.flush()
        store.engine.clear()
        key = hs[0] + FULL.to_bytes(4, "big")
        assert store.engine.key_state(FULL, key, "r").lookup is Lookup.PENDING
        with anyio.fail_after(5):
            while (state := store.engine.key_state(FULL, key, "r")).lookup is Lookup.PENDING:
                await anyio.sleep(0.02)
        assert state.lookup is Lookup.MISS
        assert store.stats().pending_deadline_miss == 1
        store.release("r")
        assert sum(g.pinned for g in store.stats().groups) == 0


# ---- read-rate estimates that recover -------------------------------------------------------------
@given(prior=st.floats(1e3, 1e11), samples=st.lists(
    st.one_of(st.floats(0, 1e13), st.just(0.0), st.just(-1.0), st.just(float("nan")), st.just(float("inf"))),
    max_size=40))
def test_the_read_rate_estimate_is_a_bounded_median_that_no_sample_breaks(prior: float,
                                                                           samples: list[float]) -> None:
    est = RateEstimate(prior)
    for x in samples:
        v = est.add(x)
        assert MIN_RATE <= v <= MAX_RATE and v == v  # never NaN, never 0, never inf
    real = [min(max(x, MIN_RATE), MAX_RATE) for x in samples if x == x and x > 0]
    window = [min(max(prior, MIN_RATE), MAX_RATE), *real][-RATE_WINDOW:]
    assert est.value == sorted(window)[len(window) // 2]


@given(good=st.floats(1e8, 1e10), stall=st.floats(1e3, 1e6), burst=st.integers(1, 2))
def test_a_stall_moves_the_estimate_by_one_rank_and_good_samples_bring_it_back(
        good: float, stall: float, burst: int) -> None:
    est = RateEstimate(good)
    for _ in range(RATE_WINDOW):
        est.add(good)
    for _ in range(burst):  # fewer stalled samples than half the window: the estimate stays good
        est.add(stall)
    assert est.value == good
    for _ in range(RATE_WINDOW):  # a tier slow for good is learnt within one window
        est.add(stall)
    assert est.value == stall
    for _ in range(RATE_WINDOW // 2 + 1):  # and it recovers as soon as the samples do
        est.add(good)
    assert est.value == good


def test_a_tier_unmeasured_below_its_prior_is_planned_with_the_prior_again(monkeypatch: pytest.MonkeyPatch
                                                                          ) -> None:
    from tierkv.backends.base import TierContext
    from tierkv.backends.memory import MemoryTier, MemoryTierConfig
    from tierkv.movement.gateway import TierGateway
    from tierkv.movement.transfers import REPROBE_S

    ctx = TierContext(layout=LAYOUT, namespace="", fingerprint="x")
    tier = MemoryTier(MemoryTierConfig(kind="memory"), ctx)
    gw = TierGateway(1, tier)
    now = time.monotonic()
    for _ in range(RATE_WINDOW):
        gw._rate.landed(1000, now + 1)
        gw._rate.busy_since = now
    assert gw.read_bytes_per_s < 1e4
    assert gw.planning_rate(now + 1.5) == gw.read_bytes_per_s
    assert gw.planning_rate(now + 1 + REPROBE_S) == 500e6, "never measured again: restores off for good"
