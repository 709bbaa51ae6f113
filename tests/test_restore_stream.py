"""In-flight bounds throttle, they never truncate: long prefixes stream in, bursts of puts queue."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import anyio
import pytest
import torch
from helpers import hashes

from tierkv import GroupSpec, Layout, Lookup, PrefixLookup, TieredStore

pytestmark = pytest.mark.anyio

BB = 64 << 10
LAYOUT = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])
BOUND = 1 << 20  # max_inflight_bytes: 16 blocks


def data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BB), dtype=torch.uint8, generator=g)


def cfg(lower: dict[str, object], slots: int = 256) -> dict[str, object]:
    return {"layout": LAYOUT, "namespace": "stream", "tiers": [{"kind": "cpu", "slots": {0: slots}}, lower]}


def file_tier(root: Path, **kw: object) -> dict[str, object]:
    return {"kind": "fsspec", "url": f"file://{root}", "max_inflight_bytes": BOUND, **kw}


async def test_a_prefix_four_times_the_inflight_bound_is_restored_whole(tmp_path: Path) -> None:
    n = 4 * BOUND // BB
    hs, blocks = hashes(n), data(n)
    async with TieredStore(cfg(file_tier(tmp_path))) as writer:
        await writer.put(0, hs, blocks)
        await writer.flush()
        assert writer.stats().tiers[1].stores == n
    # a new store reads through a tier slowed down per call, so the restore streams for a while
    slow = {"kind": "faulty", "inner": file_tier(tmp_path), "delay_s": 0.02, "ops": ["get"],
            "max_inflight_bytes": BOUND}
    samples: list[int] = []
    async with TieredStore(cfg(slow)) as store:
        answers = []
        with anyio.fail_after(60):
            while True:
                pl = store.lookup_prefix(hs, request_id="r")
                answers.append(pl)
                samples.append(store.stats().tiers[1].load_inflight_bytes)
                if pl.state is not Lookup.PENDING:
                    break
                await anyio.sleep(0.002)
        assert pl == PrefixLookup(n, Lookup.HIT), "every block of the prefix, none recomputed"
        assert all(a.state is not Lookup.MISS for a in answers)
        assert max(samples) <= BOUND, f"in-flight bytes went to {max(samples)} over a bound of {BOUND}"
        assert max(samples) > 0, "the restore was sampled while it streamed"
        assert sum(1 for s in samples if s) >= 3
        out = torch.zeros_like(blocks)
        await store.get(0, hs, out, request_id="r")
        assert torch.equal(out, blocks)
        st = store.stats().tiers[1]
        assert st.promotions == n and st.promotions_failed == 0


async def test_a_burst_of_puts_past_the_bound_is_queued_not_shed(tmp_path: Path) -> None:
    """Puts of 4x the bound back to back: cascades wait their turn, none is dropped."""
    n = 4 * BOUND // BB
    hs, blocks = hashes(n, doc=1), data(n, seed=1)
    slow = {"kind": "faulty", "inner": file_tier(tmp_path), "delay_s": 0.02, "ops": ["put"],
            "max_inflight_bytes": BOUND, "max_inflight_ops": 2}
    async with TieredStore(cfg(slow)) as store:
        queued = []
        for i in range(0, n, 4):
            await store.put(0, hs[i:i + 4], blocks[i:i + 4])
            t = store.stats().tiers[1]
            assert t.inflight_bytes <= BOUND
            queued.append(t.queued_bytes)
        assert max(queued) > 0, "the burst outran the bound: some cascades had to wait"
        await store.flush()
        t = store.stats().tiers[1]
        assert t.stores == n and t.stores_shed == 0 and t.stores_failed == 0
        assert t.inflight_bytes == 0 and t.queued_bytes == 0
    async with TieredStore(cfg(file_tier(tmp_path))) as reader:
        out = torch.zeros_like(blocks)
        await reader.get(0, hs, out)
        assert torch.equal(out, blocks)


async def test_stores_past_max_queued_bytes_are_shed_and_counted(tmp_path: Path) -> None:
    n = 32
    hs, blocks = hashes(n, doc=2), data(n, seed=2)
    slow = {"kind": "faulty", "inner": file_tier(tmp_path), "delay_s": 0.05, "ops": ["put"],
            "max_inflight_bytes": 4 * BB, "max_queued_bytes": 8 * BB, "max_inflight_ops": 1}
    async with TieredStore(cfg(slow)) as store:
        for i in range(0, n, 4):
            await store.put(0, hs[i:i + 4], blocks[i:i + 4])
        await store.flush()
        t = store.stats().tiers[1]
        assert t.stores_shed > 0, "a queue past max_queued_bytes sheds"
        assert t.stores + t.stores_shed == n
        # shed blocks are still in the primary: nothing is lost while they are resident
        out = torch.zeros_like(blocks)
        await store.get(0, hs, out)
        assert torch.equal(out, blocks)


async def test_one_by_one_lookups_of_a_request_load_as_one_batch(tmp_path: Path) -> None:
    """An engine that looks keys up one at a time (vLLM) admits one block per lookup; the blocks
    one request asked for in one pass load together, not one read call each."""
    n = 32
    hs, blocks = hashes(n, doc=3), data(n, seed=3)
    tier = {"kind": "fsspec", "url": f"file://{tmp_path}"}  # default bounds: one load batch fits
    async with TieredStore(cfg(tier)) as writer:
        await writer.put(0, hs, blocks)
        await writer.flush()
    keys = [h + (0).to_bytes(4, "big") for h in hs]
    async with TieredStore(cfg({**tier, "scan_on_open": False})) as store:
        # a new store knows nothing (no listing): the first lookups probe the tier, promote nothing
        assert {store.engine.key_state(0, k, "r").value for k in keys} == {"probing"}
        with anyio.fail_after(30):
            while store.stats().tiers[1].probes < n:
                await anyio.sleep(0.005)
        states = {store.engine.key_state(0, k, "r").value for k in keys}  # one pass, no awaits
        assert states == {"promoting"}
        with anyio.fail_after(30):
            while store.engine.ready_slots(0, keys).count(None):
                await anyio.sleep(0.005)
        loads = store.stats().tiers[1].load_seconds.count
        assert loads == 1, f"{n} blocks of one lookup pass took {loads} read calls"
        out = torch.zeros_like(blocks)
        await store.get(0, hs, out, request_id="r")
        assert torch.equal(out, blocks)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
async def test_pool_memory_is_given_back_at_close_not_at_garbage_collection() -> None:
    """Closing a store frees its pools at once: a collection much later would charge the unmap of
    gigabytes to whatever runs then (the next restore, say)."""
    size = 128 << 20
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])
    gc.disable()  # the store is kept alive below; no collection may free it by chance
    try:
        store = TieredStore({"layout": layout, "namespace": "mem",
                             "tiers": [{"kind": "cpu", "slots": {0: size // BB}}]})
        async with store:
            hs = hashes(4, doc=4)
            await store.put(0, hs, data(4, seed=4))
            async with store.borrow(0, hs) as rows:
                kept = rows.clone()
            del rows
            open_rss = _rss_bytes()
        freed = open_rss - _rss_bytes()
        assert freed > size * 3 // 4, f"closing freed {freed >> 20} MiB of a {size >> 20} MiB pool"
        assert torch.equal(kept, data(4, seed=4))
        assert store.stats().tiers[0].kind == "cpu"  # a closed store still answers stats()
    finally:
        gc.enable()


async def test_a_new_store_promotes_listed_blocks_at_the_first_lookup(tmp_path: Path) -> None:
    """A new engine process restoring a prefix its tier's start-up listing found: the first lookup
    of each block starts its promotion (no probe, no step spent answering RETRY), every block in
    one read call, and the events a router subscribes to carry no listing."""
    n = 32
    hs, blocks = hashes(n, doc=4), data(n, seed=4)
    tier = {"kind": "fsspec", "url": f"file://{tmp_path}"}
    async with TieredStore(cfg(tier)) as writer:
        await writer.put(0, hs, blocks)
        await writer.flush()
    keys = [h + (0).to_bytes(4, "big") for h in hs]
    store = TieredStore(cfg(tier))
    events: list[str] = []
    store.subscribe_tier_events(lambda _, event, __: events.append(event))
    async with store:
        with anyio.fail_after(30):
            while store.stats().tiers[1].backend.get("scanned", 0) < n:
                await anyio.sleep(0.005)
        states = {store.engine.key_state(0, k, "r").value for k in keys}
        assert states == {"promoting"}
        with anyio.fail_after(30):
            while store.engine.ready_slots(0, keys).count(None):
                await anyio.sleep(0.005)
        st = store.stats().tiers[1]
        assert st.probes == 0 and st.load_seconds.count == 1
        out = torch.zeros_like(blocks)
        await store.get(0, hs, out, request_id="r")
        assert torch.equal(out, blocks)
        assert "listed" not in events


async def test_a_listener_that_blocks_never_stalls_the_store(tmp_path: Path) -> None:
    """A router's listener that blocks (a slow network publish) runs on its own thread: flush and
    lookups go on at their own pace, and its events still arrive, in order, once it wakes."""
    import threading

    release = threading.Event()
    got: list[str] = []

    def slow(_: int, event: str, keys: list[bytes]) -> None:
        release.wait(10)
        got.append(event)

    hs, blocks = hashes(8, doc=9), data(8, seed=9)
    store = TieredStore(cfg({"kind": "fsspec", "url": f"file://{tmp_path}"}))
    store.subscribe_tier_events(slow)
    async with store:
        t0 = time.monotonic()
        for i in range(8):
            await store.put(0, hs[i:i + 1], blocks[i:i + 1])
            await store.flush()
        assert time.monotonic() - t0 < 3, "the listener held the event loop"
        assert got == []
        release.set()
        with anyio.fail_after(10):
            while len(got) < 8:
                await anyio.sleep(0.01)
    assert got == ["stored"] * 8 and store.stats().events_dropped == 0
