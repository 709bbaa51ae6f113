"""The retry queue keeps what it promises (issue #46): writes that failed because a lower tier did
not answer, in a whole batch or only in part, and blocks shed while the tier stalled, are written
once it answers again; what the queue cannot keep is counted.

The invariant every test here checks, through the public API: once the tier answers again and
``flush()`` returned, every block put and still in the primary is on the tier, or counted in a
counter that excuses it (``stores_requeue_dropped``; ``stores_shed`` only for blocks shed while the
tier did not stall, or past the queue's bound).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import anyio
import pytest
import torch
from helpers import blocks, hashes

from tierkv import GroupSpec, Layout, Lookup, TieredStore
from tierkv.backends import registry
from tierkv.backends.memory import MemoryTier
from tierkv.keys import make_key
from tierkv.observing.health import MAX_WRITE_ATTEMPTS, STALL_FACTOR
from tierkv.observing.metrics import TierStats

pytestmark = pytest.mark.anyio

BB = 1024
LAYOUT = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])


class FlakyTier(MemoryTier):
    """A memory tier that fails some writes as an unreachable server would (each failed record
    counted in ``unavailable_errors``, as the file tier counts them), and stalls on demand."""

    kind = "flaky-memory"
    #: keys whose next write fails; keys whose every write fails; keys refused as by a full disk
    #: (not an outage: not counted in ``unavailable_errors``)
    fail_once: ClassVar[set[bytes]] = set()
    fail_always: ClassVar[set[bytes]] = set()
    refuse: ClassVar[set[bytes]] = set()
    #: a call with a key failing as above answers this much later (its errors counted at once)
    fail_delay_s = 0.0
    #: while set, writes and health checks hang (a stopped server), up to ``deadline_s``
    stalled = False
    deadline_s = 10.0

    async def _answer(self) -> None:
        t0 = time.monotonic()
        while FlakyTier.stalled:
            if time.monotonic() - t0 > FlakyTier.deadline_s:
                raise TimeoutError("no answer within the request deadline")
            await anyio.sleep(0.01)

    async def put(self, group: int, keys: Sequence[bytes], blocks: torch.Tensor) -> list[bool]:
        await self._answer()
        bad = [k in FlakyTier.fail_once or k in FlakyTier.fail_always for k in keys]
        refused = [k in FlakyTier.refuse for k in keys]
        FlakyTier.fail_once.difference_update(keys)
        good = [i for i in range(len(keys)) if not (bad[i] or refused[i])]
        if good:
            await super().put(group, [keys[i] for i in good], blocks[good])
        if any(bad):
            self.count("unavailable_errors", sum(bad))
            await anyio.sleep(FlakyTier.fail_delay_s)
        return [i in good for i in range(len(keys))]

    async def check(self) -> None:
        await self._answer()


@pytest.fixture
def flaky() -> Iterator[type[FlakyTier]]:
    known, loaded = dict(registry._known), dict(registry._loaded)
    registry.register_backend("flaky-memory", FlakyTier)
    FlakyTier.fail_once, FlakyTier.fail_always, FlakyTier.refuse = set(), set(), set()
    FlakyTier.stalled, FlakyTier.fail_delay_s = False, 0.0
    try:
        yield FlakyTier
    finally:
        FlakyTier.stalled = False
        registry._known.clear()
        registry._known.update(known)
        registry._loaded.clear()
        registry._loaded.update(loaded)


def store_config(slots: int, **tier: Any) -> dict[str, Any]:
    return {"layout": LAYOUT, "namespace": "retry", "max_concurrent_requests": 2,
            "tiers": [{"kind": "cpu", "slots": {0: slots}},
                      {"kind": "flaky-memory", "health_interval_s": 0.1, **tier}]}


def missing(store: TieredStore, hs: list[bytes]) -> list[bytes]:
    """Blocks put and still ready in the primary that the lower tier does not hold."""
    tier = store.tiers[1]
    assert isinstance(tier, MemoryTier)
    resident = [h for h in hs if store.lookup(0, [h]) == [Lookup.HIT]]
    assert len(resident) == len(hs), "the primary has room for every block: all stay there"
    return [h for h in resident if make_key(h, 0) not in tier._data]


async def recovered(store: TieredStore) -> TierStats:
    """What docs/tiers.md says to do after an outage: ``flush()`` until the tier is up and its
    retry queue empty (the health checks write what flush cannot yet)."""
    with anyio.fail_after(20):
        await store.flush()
        while not (st := store.stats().tiers[1]).up or st.requeue_waiting:
            await anyio.sleep(0.05)
            await store.flush()
    return st


async def test_a_batch_that_fails_in_part_is_written_once_the_tier_answers(flaky: type[FlakyTier]) -> None:
    """One put, one batch: half its writes fail (the tier did not answer them), the other half
    succeed. ``flush`` writes the failed half again; a block whose every write fails is given
    up after MAX_WRITE_ATTEMPTS, counted, and never takes the tier down."""
    hs = hashes(9, doc=1)
    flaky.fail_once = {make_key(h, 0) for h in hs[1:8:2]}
    flaky.fail_always = {make_key(hs[8], 0)}
    async with TieredStore(store_config(64)) as store:
        await store.put(0, hs, blocks(9, BB, seed=1))
        with anyio.fail_after(20):
            await store.flush()
        assert missing(store, hs[:8]) == [], "the failed half is written by flush, the tier answering"
        with anyio.fail_after(20):
            while store.stats().tiers[1].stores_requeue_dropped == 0:
                await anyio.sleep(0.05)
        st = store.stats().tiers[1]
        assert missing(store, hs) == [hs[8]]
        assert st.stores == 8 and st.stores_failed == 4 + MAX_WRITE_ATTEMPTS, st
        assert st.stores_requeue_dropped == 1, "the block given up is counted"
        assert st.up == 1, "one block that fails alone is not an outage"
        out = torch.zeros((8, BB), dtype=torch.uint8)
        store.engine.clear()  # the primary forgets: the blocks come back from the tier
        await store.get(0, hs[:8], out)
        assert torch.equal(out, blocks(9, BB, seed=1)[:8])


async def test_an_outage_failure_is_retried_when_a_full_disk_failure_ends_first(
        flaky: type[FlakyTier]) -> None:
    """Two batches fail at once: one because the tier did not answer (it counts those errors at
    once, and its call ends later), one refused as by a full disk, which ends first. The first is
    written again; the refused one is a failed store, not retried."""
    hs = hashes(8, doc=3)
    flaky.fail_once = {make_key(h, 0) for h in hs[:4]}
    flaky.refuse = {make_key(h, 0) for h in hs[4:]}
    flaky.fail_delay_s = 0.3
    async with TieredStore(store_config(64)) as store:
        await store.put(0, hs[:4], blocks(4, BB, seed=3))
        await anyio.sleep(0.05)  # its errors are counted; its call has not ended
        await store.put(0, hs[4:], blocks(4, BB, seed=4))
        st = await recovered(store)
        assert missing(store, hs) == hs[4:], st
        assert st.stores == 4 and st.stores_requeued == 4 and st.stores_failed == 8, st
        assert st.requeue_waiting == 0 and st.stores_requeue_dropped == 0, st


async def stall_run(store: TieredStore, flaky: type[FlakyTier],
                    stall_s: float) -> tuple[list[bytes], list[TierStats]]:
    """Put 2 blocks every 20 ms for 2.5 s; the tier stalls from 0.4 s on for ``stall_s``. Returns
    the hashes put and the tier's stats sampled at the end of the stall."""
    hs = hashes(400, doc=2)
    data = blocks(400, BB, seed=2)
    put: list[bytes] = []
    during: list[TierStats] = []

    async def outage() -> None:
        await anyio.sleep(0.4)
        flaky.stalled = True
        await anyio.sleep(stall_s)
        during.append(store.stats().tiers[1])
        flaky.stalled = False

    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(outage)
        i = 0
        while time.monotonic() - t0 < 2.5 and i < 400:
            await store.put(0, hs[i:i + 2], data[i:i + 2])
            put.extend(hs[i:i + 2])
            i += 2
            await anyio.sleep(0.02)
    return put, during


async def test_blocks_shed_while_the_tier_stalls_are_written_when_it_answers(flaky: type[FlakyTier]) -> None:
    """The tier stops answering for 1.5 s (writes hang, nothing fails) under a writer: its queue
    fills and stores are shed. No write answered for STALL_FACTOR x shed_after_s takes it for
    down; what was shed until then, and every put meanwhile, is written once it answers."""
    cfg = store_config(512, shed_after_s=0.2, max_inflight_bytes=4 * BB, max_queued_bytes=8 * BB,
                       max_inflight_ops=2)
    assert STALL_FACTOR * 0.2 < 1.0
    async with TieredStore(cfg) as store:
        put, during = await stall_run(store, flaky, 1.5)
        st = await recovered(store)
        assert missing(store, put) == [], st
        assert st.stores_shed > 0, "the stall filled the queue: stores were shed"
        assert st.stores_requeue_dropped == 0
        assert during[0].up == 0 and "stalled" in during[0].down_reason, during[0]


async def test_past_the_bound_the_retry_queue_counts_what_it_drops(flaky: type[FlakyTier]) -> None:
    """The same stall with a retry queue of 16 blocks: what it could not keep is counted."""
    cfg = store_config(512, shed_after_s=0.2, max_inflight_bytes=4 * BB, max_queued_bytes=8 * BB,
                       max_inflight_ops=2, retry_queue_blocks=16)
    async with TieredStore(cfg) as store:
        put, _ = await stall_run(store, flaky, 1.5)
        st = await recovered(store)
        lost = missing(store, put)
        assert st.stores_requeue_dropped > 0, st
        assert 0 < len(lost) <= st.stores_requeue_dropped + st.stores_shed, st
