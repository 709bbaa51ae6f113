"""A seeded load on one store through its public API, every byte checked (tests/test_load.py and
``scripts/dev soak``).

Many tasks and a thread at once: ``put``, ``lookup``, ``lookup_prefix``, ``get`` (with and without a
request, cancelled at random points), ``borrow``, ``lend_slots``, engine ``reserve``/``commit``
(some commits failed), ``release``; over a primary pool much smaller than what they use, so
blocks are evicted and promoted again all the time, above a file tier that fails, stalls and comes
back. A block's bytes are its key repeated, so any row handed out can be checked against the key it
was asked for; at the end the store's accounting must be clean, no pin left, and a new store over
the same directory must read back every record it still holds as the block of its own key.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from tierkv import BlockMissing, GroupSpec, Layout, Lookup, StoreConfig, TieredStore
from tierkv.backends.registry import register_backend
from tierkv.testing.faults import FaultyTier

BB = 256
FULL, SW = 0, 1
LAYOUT = Layout(tokens_per_block=16, groups=[
    GroupSpec(kind="full", block_bytes=BB),
    GroupSpec(kind="sliding_window", block_bytes=BB, window_blocks=2),
])


def chain(doc: int, n: int) -> list[bytes]:
    """The block hashes of document ``doc``'s first ``n`` blocks (chained, as an engine's)."""
    out, prev = [], doc.to_bytes(8, "big")
    for i in range(n):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "big"), digest_size=16).digest()
        out.append(prev)
    return out


def block_of(h: bytes, group: int) -> torch.Tensor:
    """The one right content of block ``h`` of ``group``: its key, repeated."""
    key = h + group.to_bytes(4, "big")
    return torch.frombuffer(bytearray((key * (BB // len(key) + 1))[:BB]), dtype=torch.uint8)


def blocks_of(hs: Sequence[bytes], group: int) -> torch.Tensor:
    return torch.stack([block_of(h, group) for h in hs]) if hs else torch.empty(0, BB, dtype=torch.uint8)


class Flaky(FaultyTier):
    """A lower tier whose calls, while :attr:`mode` says so, fail (``fail``) or hang (``stall``)."""

    kind = "loadtest-flaky"
    mode = "ok"

    async def _maybe_fail(self, op: str) -> None:
        while self.mode == "stall":
            await anyio.sleep(0.01)
        if self.mode == "fail":
            raise OSError(5, "injected EIO (the tier is failing)")


register_backend("loadtest-flaky", Flaky)


@dataclass
class Tally:
    """What the load saw; ``wrong`` must stay empty."""

    calls: dict[str, int] = field(default_factory=dict)
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def count(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1

    def check_rows(self, what: str, hs: Sequence[bytes], group: int, rows: torch.Tensor,
                   skip: Sequence[int] = ()) -> None:
        expect = blocks_of(hs, group)
        for i, h in enumerate(hs):
            if i not in skip and not torch.equal(rows[i], expect[i]):
                got = bytes(rows[i][:20].tolist())[:20]
                self.wrong.append(f"{what} of {h.hex()[:12]}/{group} returned {got.hex()[:24]}")


def config(directory: str, slots: int, **tier: Any) -> StoreConfig:
    return StoreConfig(layout=LAYOUT, namespace="load", max_concurrent_requests=4, max_pending_s=2.0,
                       tiers=[{"kind": "cpu", "slots": {FULL: slots, SW: slots}},
                              {"kind": "loadtest-flaky", "inner": {"kind": "fsspec", "url": f"file://{directory}",
                                                                   **tier},
                               "open_timeout_s": 5.0}])


async def run_load(directory: str, seconds: float, seed: int, slots: int = 24, docs: int = 40,
                   blocks_per_doc: int = 12) -> tuple[Tally, set[bytes]]:
    """Run the load for ``seconds``; what it saw and the hashes it put. Raises AssertionError when
    the store's accounting is not clean at the end."""
    tally = Tally()
    chains = [chain(seed * 1000 + d, blocks_per_doc) for d in range(docs)]
    put_hashes: set[bytes] = set()
    end = time.monotonic() + seconds
    async with TieredStore(config(directory, slots)) as store:
        flaky = store.tiers[1]
        assert isinstance(flaky, Flaky)

        def some_prefix(rng: random.Random) -> list[bytes]:
            c = rng.choice(chains)
            return c[: rng.randint(1, len(c))]

        async def putter(rng: random.Random) -> None:
            while time.monotonic() < end:
                hs = some_prefix(rng)
                for g in (FULL, SW):
                    await store.put(g, hs, blocks_of(hs, g))
                put_hashes.update(hs)
                tally.count("put")
                await anyio.sleep(rng.random() * 0.004)

        async def getter(rng: random.Random, wid: int) -> None:
            n = 0
            while time.monotonic() < end:
                n += 1
                hs = some_prefix(rng)
                hs = rng.sample(hs, rng.randint(1, len(hs)))
                g = rng.choice((FULL, SW))
                rid = f"get-{wid}-{n}" if rng.random() < 0.5 else None
                out = torch.empty(len(hs), BB, dtype=torch.uint8)
                cancelled = rng.random() < 0.2
                with anyio.move_on_after(rng.random() * 0.01 if cancelled else 30) as scope:
                    try:
                        await store.get(g, hs, out, request_id=rid)
                    except BlockMissing as exc:
                        tally.count("get-missing")
                        tally.check_rows("get", hs, g, out, skip=exc.missing)
                    else:
                        tally.count("get")
                        tally.check_rows("get", hs, g, out)
                if scope.cancelled_caught:
                    tally.count("get-cancelled")
                if rid is not None:
                    store.release(rid)
                await anyio.sleep(0)

        async def prefix_reader(rng: random.Random, wid: int) -> None:
            n = 0
            while time.monotonic() < end:
                n += 1
                rid = f"prefix-{wid}-{n}"
                hs = some_prefix(rng)
                try:
                    found = store.lookup_prefix(hs, request_id=rid)
                    deadline = time.monotonic() + 5
                    while found.state is Lookup.PENDING and time.monotonic() < deadline:
                        await anyio.sleep(0.002)
                        found = store.lookup_prefix(hs, request_id=rid)
                    tally.count(f"prefix-{found.state.value}")
                    if rng.random() < 0.15:
                        continue  # walks away without loading: release drops its pins
                    for g, spec in enumerate(LAYOUT.groups):
                        need = [hs[i] for i in spec.blocks_needed(found.blocks)]
                        if not need:
                            continue
                        out = torch.empty(len(need), BB, dtype=torch.uint8)
                        try:
                            with anyio.move_on_after(rng.random() * 0.02 if rng.random() < 0.1 else 30):
                                await store.get(g, need, out, request_id=rid)
                                tally.check_rows("prefix get", need, g, out)
                        except BlockMissing as exc:
                            tally.count("prefix-get-missing")
                            tally.check_rows("prefix get", need, g, out, skip=exc.missing)
                finally:
                    store.release(rid)
                await anyio.sleep(rng.random() * 0.002)

        async def borrower(rng: random.Random) -> None:
            while time.monotonic() < end:
                hs = some_prefix(rng)
                hs = hs[-rng.randint(1, min(4, len(hs))):]
                g = rng.choice((FULL, SW))
                try:
                    with anyio.move_on_after(0.5):
                        async with store.borrow(g, hs) as rows:
                            tally.check_rows("borrow", hs, g, rows)
                            await anyio.sleep(rng.random() * 0.003)
                            tally.check_rows("borrow (after a wait)", hs, g, rows)
                            tally.count("borrow")
                except BlockMissing:
                    tally.count("borrow-missing")
                await anyio.sleep(0.001)

        async def engine_writer(rng: random.Random) -> None:
            engine = store.engine
            while time.monotonic() < end:
                hs = some_prefix(rng)
                g = rng.choice((FULL, SW))
                keys = [h + g.to_bytes(4, "big") for h in hs]
                res = engine.reserve(g, keys)
                if res is None:
                    tally.count("reserve-none")
                    await anyio.sleep(0.002)
                    continue
                await anyio.sleep(rng.random() * 0.003)  # the engine copies while others run
                rows = engine.pool_rows()[g]
                mine = [(h, k, s) for h, k, s in zip(hs, keys, res.slots, strict=True) if s is not None]
                ok = rng.random() < 0.8
                for h, _, s in mine:
                    rows[s].copy_(block_of(h, g) if ok else torch.zeros(BB, dtype=torch.uint8))
                engine.commit(g, [k for _, k, _ in mine], success=ok)
                if ok:
                    put_hashes.update(h for h, _, _ in mine)
                tally.count("commit" if ok else "commit-failed")

        async def chaos(rng: random.Random) -> None:
            while time.monotonic() < end:
                await anyio.sleep(0.3 + rng.random() * 0.5)
                flaky.mode = rng.choice(("fail", "stall", "ok"))
                await anyio.sleep(rng.random() * 0.4)
                flaky.mode = "ok"
                tally.count("chaos")

        stop = threading.Event()

        def other_thread(rng: random.Random) -> None:
            pools = store.tiers[0].pools  # type: ignore[attr-defined]
            while not stop.is_set():
                hs = some_prefix(rng)
                g = rng.choice((FULL, SW))
                try:
                    store.lookup(g, hs)
                    with store.lend_slots(g, hs) as lent:
                        if lent is not None:
                            tally.check_rows("lend_slots", hs, g, pools[g].tensor[lent])
                            tally.count("lend")
                except Exception as exc:  # pragma: no cover - reported as a failure
                    tally.errors.append(f"thread: {exc!r}")
                    return
                time.sleep(0.0005)

        rng = random.Random(seed)
        thread = threading.Thread(target=other_thread, args=(random.Random(rng.random()),), daemon=True)
        thread.start()
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(putter, random.Random(rng.random()))
                for wid in range(6):
                    tg.start_soon(getter, random.Random(rng.random()), wid)
                for wid in range(3):
                    tg.start_soon(prefix_reader, random.Random(rng.random()), wid)
                tg.start_soon(borrower, random.Random(rng.random()))
                tg.start_soon(engine_writer, random.Random(rng.random()))
                tg.start_soon(chaos, random.Random(rng.random()))
        finally:
            stop.set()
            await anyio.to_thread.run_sync(thread.join)
        flaky.mode = "ok"
        with anyio.fail_after(60):
            await store.idle()
        problems = store.check()
        assert not problems, problems
        pools = store.tiers[0].pools  # type: ignore[attr-defined]
        left = {g: sum(pool.pins) for g, pool in pools.items()}
        assert not any(left.values()), f"pins left after every request was released: {left}"
        assert store.stats().requests_active == 0
    return tally, put_hashes


async def read_back(directory: str, hashes: set[bytes], tally: Tally) -> int:
    """Read every put block through a new store over the same directory; how many it holds."""
    found = 0
    hs = sorted(hashes)
    async with TieredStore(config(directory, 8)) as store:
        for g in (FULL, SW):
            for a in range(0, len(hs), 8):
                part = hs[a:a + 8]
                out = torch.empty(len(part), BB, dtype=torch.uint8)
                missing: Sequence[int] = ()
                try:
                    await store.get(g, part, out)
                except BlockMissing as exc:
                    missing = exc.missing
                tally.check_rows("read back", part, g, out, skip=missing)
                found += len(part) - len(missing)
    return found
