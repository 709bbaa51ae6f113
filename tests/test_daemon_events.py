"""Events through the tierkv daemon: a client's eviction and tier event listeners hear what an
in-process store's would for the same puts (whichever client made them), a restarted daemon's
lost pool is reported evicted, and a subscriber that misbehaves is disconnected while others are
served."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import blocks, hashes
from tests.test_daemon import BIG, BIG_SLOTS, Daemon, hello, raw, refused
from tierkv import TieredStore
from tierkv.daemon.protocol import encode, recv_message
from tierkv.keys import GROUP_BYTES

pytestmark = pytest.mark.anyio

TAIL = (0).to_bytes(GROUP_BYTES, "big")


def wait_for(what: Callable[[], bool], why: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.02)


class Heard:
    """What a store's eviction and tier event listeners were told."""

    def __init__(self, store: TieredStore) -> None:
        self.evicted: list[bytes] = []
        self.tier: dict[str, list[bytes]] = {"stored": [], "removed": []}
        store.engine.subscribe_evictions(lambda g, keys: self.evicted.extend(keys))
        store.subscribe_tier_events(lambda t, event, keys: self.tier[event].extend(keys) if t == 1 else None)


async def scenario(first: TieredStore, second: TieredStore, heard: Heard) -> None:
    """``first`` stores 4 blocks and writes them down; ``second`` then fills the whole pool."""
    await first.put(0, hashes(4, 1), blocks(4, 131072, seed=1))
    await first.flush()
    await second.put(0, hashes(BIG_SLOTS, 2), blocks(BIG_SLOTS, 131072, seed=2))
    await second.flush()
    wait_for(lambda: len(heard.evicted) >= 4 and len(heard.tier["stored"]) >= 4 + BIG_SLOTS,
             "the events never came")
    time.sleep(0.2)  # nothing more is coming


async def test_a_client_hears_every_eviction_and_tier_event_of_the_shared_store_as_in_process(
        tmp_path: Path) -> None:
    tier = {"kind": "fsspec", "url": f"file://{tmp_path}/inproc"}
    async with TieredStore({"layout": BIG, "tiers": [{"kind": "cpu", "capacity_bytes": 1 << 20}, tier]}) as s:
        alone = Heard(s)
        await scenario(s, s, alone)
    assert sorted(alone.evicted) == sorted(h + TAIL for h in hashes(4, 1))

    d = Daemon(tmp_path, tiers=[{"kind": "fsspec", "url": f"file://{tmp_path}/tier"}]).start()
    try:
        async with d.store(BIG) as a, d.store(BIG) as b:
            heard = Heard(a)  # the listening client is not the one whose puts evict
            assert a.lower_tiers_local == [True]  # type: ignore[attr-defined]
            await scenario(a, b, heard)
            assert sorted(heard.evicted) == sorted(alone.evicted)
            assert sorted(heard.tier["stored"]) == sorted(alone.tier["stored"])
            assert heard.tier["removed"] == alone.tier["removed"] == []
            assert a.stats().events_dropped == 0
    finally:
        rc, err = d.stop()
    assert rc == 0, err


async def test_a_restarted_daemons_lost_pool_is_reported_evicted(tmp_path: Path) -> None:
    """The daemon's pool dies with it: each client is told its own blocks that were in it left."""
    d = Daemon(tmp_path).start()
    try:
        async with d.store(BIG) as a, d.store(BIG) as b:
            heard = Heard(a)
            await a.put(0, hashes(3, 1), blocks(3, 131072, seed=1))
            await b.put(0, hashes(2, 2), blocks(2, 131072, seed=2))
            time.sleep(0.2)
            assert heard.evicted == []
            assert d.proc is not None
            d.proc.kill()
            d.proc.wait()
            d.start()
            wait_for(lambda: len(heard.evicted) >= 3, "the lost blocks were never reported")
            time.sleep(0.2)
            assert sorted(heard.evicted) == sorted(h + TAIL for h in hashes(3, 1))
    finally:
        rc, err = d.stop()
    assert rc == 0, err


async def test_a_subscriber_that_misbehaves_is_disconnected_and_others_are_served(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    try:
        s = raw(d)
        s.sendall(encode(hello(layout=BIG)))
        assert "error" not in recv_message(s)
        s.sendall(encode({"op": "subscribe", "what": "everything"}))
        assert "what must be one of" in refused(s)

        s = raw(d)
        s.sendall(encode(hello(layout=BIG)))
        recv_message(s)
        s.sendall(encode({"op": "subscribe", "what": "evictions"}))
        assert recv_message(s)["slots"] == {"0": BIG_SLOTS}
        s.sendall(encode({"op": "ping"}))
        assert "a subscribed connection only receives" in refused(s)

        async with d.store(BIG) as store:
            heard = Heard(store)
            await store.put(0, hashes(BIG_SLOTS, 3), blocks(BIG_SLOTS, 131072, seed=3))
            await store.put(0, hashes(2, 4), blocks(2, 131072, seed=4))
            wait_for(lambda: len(heard.evicted) == 2, "the daemon stopped serving events")
        assert d.alive()
    finally:
        rc, err = d.stop()
    assert rc == 0, err
