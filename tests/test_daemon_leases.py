"""Puts through the daemon into leased slots: copied before the daemon is asked anything, named
after; served to every client as any put; a block the pool holds already is not replaced; what a
closed, killed or idle client held goes back to the pool; small pools lend nothing."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import blocks, hashes
from tests.test_daemon import BIG, ENV, ROOT, Daemon, hello, raw, refused
from tierkv import GroupSpec, Layout, Lookup, TieredStore
from tierkv.daemon import leases
from tierkv.daemon.protocol import encode, recv_message

pytestmark = pytest.mark.anyio

#: 1 MiB of 16 KiB blocks: 64 slots, lending up to 8 to a connection, 16 in all
MID = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=16384)])
BB = 16384


def ops_sent(store: TieredStore) -> list[str]:
    """Record the operations ``store``'s link sends from now on (calls and messages owed)."""
    link = store._link  # type: ignore[attr-defined]
    sent: list[str] = []
    call, owing = link.call, link.send_owing
    link.call = lambda msg, **kw: (sent.append(msg["op"]), call(msg, **kw))[1]
    link.send_owing = lambda msg, cb: (sent.append(msg["op"]), owing(msg, cb))[1]
    return sent


def writing(store: TieredStore) -> int:
    return store.stats().groups[0].writing


async def test_a_put_into_leased_slots_asks_nothing_first_and_is_served_to_others(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    try:
        async with d.store(MID) as a, d.store(MID) as b:
            first, second = hashes(4, 1), hashes(4, 2)
            await a.put(0, first, blocks(4, BB, seed=1))  # asks: reserve, then a lease
            a.stats()  # a round trip: the lease's answer is in
            sent = ops_sent(a)
            data = blocks(4, BB, seed=2)
            await a.put(0, second, data)
            assert sent == ["adopt"], f"a put into leased slots asked first: {sent}"
            a.stats()  # a round trip: the adopt (not waited for) is in
            assert b.lookup(0, second) == [Lookup.HIT] * 4
            out = torch.zeros_like(data)
            await b.get(0, second, out)
            assert torch.equal(out, data)
            assert a.stats().puts == 2
            assert 0 < writing(b) <= 8, "the lease is held (WRITING), within its bound"
            await a.put(0, hashes(4, 7), blocks(4, BB, seed=7))  # closed with its lease's answer unread
        async with d.store(MID) as c:
            assert writing(c) == 0, "a closed client's lease was not given back"
            assert c.lookup(0, second) == [Lookup.HIT] * 4
    finally:
        assert d.stop()[0] == 0


async def test_a_leased_put_of_blocks_the_pool_holds_keeps_them_and_frees_its_slots(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    try:
        hs, data = hashes(4, 3), blocks(4, BB, seed=3)
        async with d.store(MID) as a, d.store(MID) as b:
            await b.put(0, hs, data)
            b.stats()  # a round trip: b's commit (sent unanswered) is in
            await a.put(0, hashes(4, 4), blocks(4, BB, seed=4))
            a.stats()
            ready = a.stats().groups[0].ready
            sent = ops_sent(a)
            await a.put(0, hs, blocks(4, BB, seed=99))  # other bytes under the same keys
            assert sent == ["adopt"]
            a.stats()
            assert a.stats().groups[0].ready == ready, "a block was stored twice"
            out = torch.zeros_like(data)
            await b.get(0, hs, out)
            assert torch.equal(out, data), "a leased put replaced a block the pool held"
            assert not a.check() and not b.check()
    finally:
        assert d.stop()[0] == 0


#: puts twice (the second into a lease), then waits to be killed
HOLDER = """
import sys, time, anyio
from tierkv import TieredStore, Layout
from tests.helpers import blocks, hashes
sock, layout = sys.argv[1], Layout.model_validate_json(sys.argv[2])
async def main():
    async with TieredStore({"layout": layout, "daemon": sock}) as s:
        await s.put(0, hashes(4, 5), blocks(4, 16384, seed=5))
        s.stats()
        await s.put(0, hashes(4, 6), blocks(4, 16384, seed=6))
        s.stats()
        print("leased", flush=True)
        time.sleep(600)
anyio.run(main)
"""


async def test_a_killed_clients_lease_goes_back_to_the_pool(tmp_path: Path) -> None:
    d = Daemon(tmp_path, drop_grace_s=1.0).start()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, d.socket, MID.model_dump_json()],
                              env=ENV, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "leased"
        async with d.store(MID) as store:
            assert writing(store) > 0
            assert store.lookup(0, hashes(4, 6)) == [Lookup.HIT] * 4
            holder.kill()
            holder.wait()
            deadline = time.monotonic() + 30
            while writing(store):
                assert time.monotonic() < deadline, "a killed client's leased slots stayed WRITING"
                time.sleep(0.05)
            assert store.lookup(0, hashes(4, 6)) == [Lookup.HIT] * 4
    finally:
        holder.kill()
        assert d.stop()[0] == 0


async def test_leases_stay_within_their_bounds_and_a_small_pool_lends_nothing(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    try:
        stores = [d.store(MID) for _ in range(4)]
        for i, s in enumerate(stores):
            await s.open()
            await s.put(0, hashes(4, 10 + i), blocks(4, BB, seed=i))
            await s.put(0, hashes(4, 20 + i), blocks(4, BB, seed=i))
            s.stats()
        assert writing(stores[0]) <= 64 // 4, "more than a quarter of the pool leased"
        for s in stores:
            await s.close()
        async with d.store(BIG) as big:  # 8 slots: a put of 2 would want 4 leased, over an eighth
            await big.put(0, hashes(2, 30), blocks(2, 131072, seed=30))
            big.stats()
            assert writing(big) == 0
            sent = ops_sent(big)
            await big.put(0, hashes(2, 31), blocks(2, 131072, seed=31))
            assert "reserve" in sent and "lease" not in sent, f"a refused client asked again: {sent}"
    finally:
        assert d.stop()[0] == 0


BAD = [
    {"op": "adopt", "g": 0, "h": ["00"], "s": "x", "ok": True},
    {"op": "adopt", "g": 0, "h": ["00"], "s": [1, 2], "ok": True},
    {"op": "adopt", "g": 0, "h": [], "s": [], "ok": 1},
    {"op": "adopt", "g": 0, "h": [], "s": [], "ok": False, "free": [None]},
    {"op": "lease", "g": 0, "n": -1},
    {"op": "lease", "g": 0, "n": "8"},
]


async def test_a_bad_lease_message_is_refused_and_the_daemon_serves_on(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    try:
        for bad in BAD:
            s = raw(d)
            s.sendall(encode(hello(layout=MID)))
            recv_message(s)
            s.sendall(encode(bad))
            assert refused(s), bad
        async with d.store(MID) as store:
            await store.put(0, hashes(1, 40), blocks(1, BB, seed=40))
            assert store.lookup(0, hashes(1, 40)) == [Lookup.HIT]
    finally:
        assert d.stop()[0] == 0


def lease_watchers() -> int:
    return sum(t.name == "tierkv-lease-idle" for t in threading.enumerate())


async def test_an_idle_client_gives_its_leased_slots_back_and_a_busy_one_keeps_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases, "IDLE_S", 0.5)
    d = Daemon(tmp_path).start()
    try:
        async with d.store(MID) as a, d.store(MID) as b:
            await a.put(0, hashes(4, 50), blocks(4, BB, seed=50))  # reserve, then a lease
            a.stats()  # a round trip: the lease's answer is in
            assert writing(b) > 0 and lease_watchers() == 1
            sent = ops_sent(a)
            t0, n = time.monotonic(), 0
            while time.monotonic() - t0 < 3 * leases.IDLE_S:  # busy: a put every 0.1 s
                await a.put(0, hashes(4, 100 + n), blocks(4, BB, seed=100 + n))
                a.stats()
                n += 1
                time.sleep(0.1)
            assert sent.count("adopt") == n and "reserve" not in sent, f"a busy client lost its lease: {sent}"
            deadline = time.monotonic() + 20
            while writing(b):
                assert time.monotonic() < deadline, "an idle client kept its leased slots"
                time.sleep(0.05)
            while lease_watchers():
                assert time.monotonic() < deadline, "the watching thread outlived the lease"
                time.sleep(0.05)
            for i in range(max(0, n - 4), n):  # the blocks last put stay served (64 slots in all)
                assert b.lookup(0, hashes(4, 100 + i)) == [Lookup.HIT] * 4
            sent.clear()
            data = blocks(4, BB, seed=70)
            await a.put(0, hashes(4, 70), data)  # no lease now: reserve first, then lease again
            assert sent[0] == "reserve", sent
            a.stats()
            assert writing(b) > 0, "a client that puts again is not lent slots again"
            out = torch.zeros_like(data)
            await b.get(0, hashes(4, 70), out)
            assert torch.equal(out, data)
            assert not a.check() and not b.check()
        assert lease_watchers() == 0
    finally:
        assert d.stop()[0] == 0
