"""The ``mooncake`` tier against a real ``mooncake_master`` on loopback (``tierkv.testing.mooncake``).

The tier's own process contributes the segment the objects live in. Covered: the conformance
suite; restores through a TieredStore; objects the master evicted (misses, never errors, never
PENDING for ever); damaged and truncated objects (counted misses, removed); objects a killed writer
left unfinished (written over); the master killed under a running store, restarted (writes while
it has no segment again wait in the retry queue), and down at start. Where Mooncake (the wheel,
its OS libraries, the master binary) is missing, every test here says what is missing and skips.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from test_fsspec_tier import logs

from tierkv import BackendError, BlockMissing, GroupSpec, Layout, Lookup, TieredStore
from tierkv.backends.base import Tier
from tierkv.backends.mooncake._config import MooncakeTierConfig
from tierkv.backends.registry import get_backend
from tierkv.errors import BackendNotFound
from tierkv.keys import make_key
from tierkv.records import decode_record, encode_record, read_header
from tierkv.testing import TierTests, conformance_layout
from tierkv.testing.mooncake import MooncakeMaster, UnfinishedPuts, missing

__all__ = ["logs"]

WHY = missing()
#: tests that need Mooncake's client and a real master (the settings and the missing-package hint
#: are tested anywhere)
needs_mooncake = pytest.mark.skipif(WHY is not None, reason=f"Mooncake is not usable here: {WHY}")

FULL = 0
MIB = 1 << 20


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One master for the tests that do not stop it (each uses its own namespace)."""
    with MooncakeMaster(tmp_path_factory.mktemp("mooncake")) as m:
        yield m


@pytest.fixture
def own_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master of this test's own, to kill and restart."""
    with MooncakeMaster(tmp_path) as m:
        yield m


def tier_cfg(endpoint: str, **kw: Any) -> dict[str, Any]:
    return {"kind": "mooncake", "master": endpoint, "segment_bytes": 32 * MIB, "buffer_bytes": 16 * MIB,
            "health_interval_s": 0.2, **kw}


def store_cfg(endpoint: str, layout: Layout, slots: int = 4, **kw: Any) -> dict[str, Any]:
    return {"layout": layout, "namespace": f"mc-{uuid.uuid4().hex[:8]}", "max_concurrent_requests": 2,
            "tiers": [{"kind": "cpu", "slots": {FULL: slots}}, tier_cfg(endpoint, **kw)]}


def one_group(block_bytes: int) -> Layout:
    return Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=block_bytes)])


def hashes(n: int, salt: int) -> list[bytes]:
    return [bytes([salt]) * 4 + i.to_bytes(28, "big") for i in range(n)]


def rand_blocks(n: int, nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)


async def settle(store: TieredStore, hs: list[bytes], request_id: str | None = None) -> list[Lookup]:
    """Look ``hs`` up until no answer is PENDING (probes and promotions done)."""
    res = store.lookup(FULL, hs, request_id=request_id)
    while Lookup.PENDING in res:
        await store.idle()
        await anyio.sleep(0.05)
        res = store.lookup(FULL, hs, request_id=request_id)
    return res


def raw(tier: Tier) -> Any:
    """The tier's own Mooncake client (``MooncakeDistributedStore``), to reach objects directly."""
    return tier.client.store  # type: ignore[attr-defined]


def replace(tier: Tier, key: bytes, blob: bytes) -> None:
    store, name = raw(tier), tier.name(key)  # type: ignore[attr-defined]
    store.remove(name, True)
    assert store.put(name, blob) == 0


# ---- conformance -----------------------------------------------------------------------------------
@needs_mooncake
class TestMooncakeTier(TierTests):
    """The conformance suite; the oracle reads and writes objects with the tier's own client."""

    kind = "mooncake"

    @pytest.fixture(autouse=True)
    def _master(self, master: MooncakeMaster) -> None:
        self.endpoint = master.endpoint
        self.namespace = f"conf-{uuid.uuid4().hex[:8]}"  # type: ignore[misc]

    def tier_config(self) -> dict[str, Any]:
        return tier_cfg(self.endpoint)

    async def oracle_set(self, tier: Tier, group: int, key: bytes, data: bytes) -> None:
        replace(tier, key, encode_record(key=key, fingerprint=tier.context.fingerprint, payload=data))

    async def oracle_get(self, tier: Tier, group: int, key: bytes) -> bytes | None:
        blob = raw(tier).get(tier.name(key))  # type: ignore[attr-defined]
        if not blob:
            return None
        return decode_record(blob, key=key, fingerprint=tier.context.fingerprint,
                             max_raw_bytes=len(blob)).tobytes()

    @pytest.mark.anyio
    async def test_capacity_is_bounded(self) -> None:
        """The master bounds the pool: ``capacity_bytes`` is refused, saying so."""
        with pytest.raises(ValueError, match="the master bounds the pool"):
            self.make(capacity_bytes=self.small_capacity())


def test_settings_are_checked_with_clear_errors() -> None:
    model = MooncakeTierConfig
    with pytest.raises(ValueError, match="is not host:port"):
        model.model_validate({"kind": "mooncake", "master": "no-port-here"})
    with pytest.raises(ValueError, match="protocol"):
        model.model_validate({"kind": "mooncake", "master": "h:1", "protocol": "udp"})
    with pytest.raises(ValueError, match="segment_bytes"):
        model.model_validate({"kind": "mooncake", "master": "h:1", "segment_bytes": -1})
    cfg = model.model_validate({"kind": "mooncake", "master": "127.0.0.1:5000", "segment_bytes": 0})
    assert cfg.hostname == "127.0.0.1"


def test_a_missing_client_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import tierkv.backends.registry as registry

    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # the import fails as when not installed
    for mod in ("tierkv.backends.mooncake", "tierkv.backends.mooncake._tier",
                "tierkv.backends.mooncake._client"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    monkeypatch.delitem(registry._loaded, "mooncake", raising=False)
    with pytest.raises(BackendNotFound) as exc:
        get_backend("mooncake")
    assert "mooncake-transfer-engine-non-cuda" in str(exc.value) and "[mooncake]" in str(exc.value)


# ---- through a TieredStore ---------------------------------------------------------------------------
@needs_mooncake
@pytest.mark.anyio
async def test_blocks_the_primary_evicted_come_back_identical(master: MooncakeMaster) -> None:
    layout = one_group(256 << 10)
    hs = hashes(24, salt=1)
    data = rand_blocks(24, 256 << 10, seed=1)
    async with TieredStore(store_cfg(master.endpoint, layout)) as store:
        for i in range(0, 24, 4):
            await store.put(FULL, hs[i:i + 4], data[i:i + 4])
        await store.flush()
        assert store.stats().tiers[1].stores == 24
        store.engine.clear()
        out = torch.zeros_like(data)
        for i in range(0, 24, 4):
            await store.get(FULL, hs[i:i + 4], out[i:i + 4])
        assert torch.equal(out, data)
        st = store.stats().tiers[1]
        assert st.hits >= 20 and st.backend.get("corrupt", 0) == 0, st


@needs_mooncake
@pytest.mark.anyio
async def test_objects_the_master_evicted_are_misses_never_errors(tmp_path: Path) -> None:
    """Forty 1 MiB blocks into a 16 MiB pool: the master evicts the older objects (once their
    lease, here 300 ms, has ended; a write that finds no room yet fails, counted as
    ``pool_full``, and the tier stays up). Every lookup settles (never PENDING for ever),
    evicted blocks are MISS / BlockMissing, the rest come back identical."""
    layout = one_group(MIB)
    hs = hashes(40, salt=2)
    data = rand_blocks(40, MIB, seed=2)
    with MooncakeMaster(tmp_path, lease_ms=300, eviction_ratio=0.3) as master:
        async with TieredStore(store_cfg(master.endpoint, layout, segment_bytes=16 * MIB)) as store:
            for i in range(0, 40, 4):
                await store.put(FULL, hs[i:i + 4], data[i:i + 4])
                await store.flush()
                await anyio.sleep(0.4)
            st = store.stats().tiers[1]
            assert st.stores + st.stores_failed == 40 and st.stores >= 20, st
            assert st.stores_failed == st.backend.get("pool_full", 0) and st.up == 1, st
            store.engine.clear()
            with anyio.fail_after(30):
                res = await settle(store, hs, "r")
            store.release("r")
            assert Lookup.MISS in res, "a 16 MiB pool cannot hold 40 MiB"
            assert Lookup.HIT in res, "the newest objects stay"
            for i in range(40):
                out = torch.zeros((1, MIB), dtype=torch.uint8)
                try:
                    await store.get(FULL, hs[i:i + 1], out)
                except BlockMissing:
                    continue
                assert torch.equal(out[0], data[i]), f"block {i} came back different"
            backend = store.stats().tiers[1].backend
            assert backend.get("read_errors", 0) == 0 and backend.get("corrupt", 0) == 0, backend
            assert store.stats().tiers[1].up == 1


@needs_mooncake
@pytest.mark.anyio
async def test_damaged_objects_are_counted_misses_and_removed(master: MooncakeMaster) -> None:
    layout = conformance_layout()
    bb = layout.groups[FULL].block_bytes
    hs = hashes(9, salt=3)
    data = rand_blocks(9, bb, seed=3)
    cfg = store_cfg(master.endpoint, layout)
    cfg["tiers"][0]["slots"] = {FULL: 16, 2: 2}
    async with TieredStore(cfg) as store:
        await store.put(FULL, hs, data)
        await store.flush()
        tier = store.tiers[1]
        ks = [make_key(h, FULL) for h in hs]
        good = raw(tier).get(tier.name(ks[0]))  # type: ignore[attr-defined]
        header_len = read_header(good).header_len
        flipped, header_flip = bytearray(good), bytearray(good)
        flipped[header_len + 5] ^= 0x10
        header_flip[42] ^= 0x01
        other_fp = encode_record(key=ks[0], fingerprint=layout.fingerprint("other"),
                                 payload=data[0].numpy().tobytes())
        damaged = [bytes(flipped), bytes(header_flip), good[:header_len], b"plain text, no record", other_fp,
                   good[:-1], good + b"x"]
        for k, blob in zip(ks, damaged, strict=False):  # objects 0..6 damaged, 7 and 8 sound
            replace(tier, k, blob)
        store.engine.clear()
        with anyio.fail_after(30):
            res = await settle(store, hs, "r")
        assert res == [Lookup.MISS] * 7 + [Lookup.HIT] * 2  # the promotions read and checked them
        out = torch.zeros_like(data)
        with pytest.raises(BlockMissing) as exc:
            await store.get(FULL, hs, out, request_id="r")
        store.release("r")
        assert exc.value.missing == list(range(7))
        assert torch.equal(out[7:], data[7:])
        backend = store.stats().tiers[1].backend
        assert backend["corrupt"] == 7 and backend["corrupt_removed"] == 7, backend
        assert await tier.contains(FULL, ks) == [False] * 7 + [True] * 2


@needs_mooncake
@pytest.mark.anyio
async def test_blocks_a_killed_writer_left_unfinished_are_written_over_never_counted_held(
        master: MooncakeMaster) -> None:
    """Another node started puts of the same blocks and was killed before it ended them: the master
    holds the names unfinished (Mooncake answers a put of such a name with success, and lets the
    unfinished put go only 30 s later). Lookups meanwhile are misses; this store's put writes them
    over, counts them stored only once the master holds them complete, and they read back
    identical at once."""
    layout = one_group(64 << 10)
    hs, data = hashes(12, salt=9), rand_blocks(12, 64 << 10, seed=9)
    async with TieredStore(store_cfg(master.endpoint, layout, slots=16)) as store:
        tier = store.tiers[1]
        ks = [make_key(h, FULL) for h in hs]
        fp = tier.context.fingerprint
        sizes = [len(encode_record(key=k, fingerprint=fp, payload=d.numpy().tobytes()))
                 for k, d in zip(ks, data, strict=True)]
        with UnfinishedPuts(master, [tier.name(k) for k in ks], sizes) as writer:  # type: ignore[attr-defined]
            writer.kill()
        assert await tier.contains(FULL, ks) == [False] * 12, "an unfinished object is not there to read"
        with anyio.fail_after(30):
            assert await settle(store, hs, "before") == [Lookup.MISS] * 12
        store.release("before")

        await store.put(FULL, hs, data)
        await store.flush()
        st = store.stats().tiers[1]
        assert st.stores == 12 and st.stores_failed == 0, st
        store.engine.clear()
        with anyio.fail_after(30):
            res = await settle(store, hs, "after")
            assert res == [Lookup.HIT] * 12, f"counted stored, yet not there to read: {res}"
            out = torch.zeros_like(data)
            await store.get(FULL, hs, out, request_id="after")
        store.release("after")
        assert torch.equal(out, data)
        assert store.stats().tiers[1].backend.get("replaced") == 12, store.stats().tiers[1].backend


# ---- failures of the master ----------------------------------------------------------------------------
@needs_mooncake
@pytest.mark.anyio
async def test_a_store_rides_out_a_killed_master_and_recovers_by_itself(own_master: MooncakeMaster) -> None:
    """SIGKILL the master under a running store: resident blocks are served, lookups of blocks
    only in Mooncake answer MISS within a deadline, puts return; close is bounded. The master
    restarted (empty): the tier writes and restores again, the store never restarted."""
    layout = one_group(256 << 10)
    bb = 256 << 10
    hs = hashes(16, salt=4)
    data = rand_blocks(16, bb, seed=4)
    store = TieredStore(store_cfg(own_master.endpoint, layout, slots=8, close_timeout_s=5))
    await store.open()
    try:
        for i in range(0, 16, 4):
            await store.put(FULL, hs[i:i + 4], data[i:i + 4])
            await store.flush()
        remote_only, resident = hs[:8], hs[8:]
        assert store.lookup(FULL, resident) == [Lookup.HIT] * 8

        own_master.kill()
        with anyio.fail_after(10):
            out = torch.zeros((8, bb), dtype=torch.uint8)
            await store.get(FULL, resident, out)
        assert torch.equal(out, data[8:]), "resident blocks are served while the master is down"
        with anyio.fail_after(5):  # about 0.5 s measured: the master's port refuses at once
            res = await settle(store, remote_only, "down")
        assert res == [Lookup.MISS] * 8, res
        with anyio.fail_after(5), pytest.raises(BlockMissing):
            await store.get(FULL, remote_only[:4], out[:4], request_id="down")
        store.release("down")
        new, new_data = hashes(4, salt=5), rand_blocks(4, bb, seed=5)
        t0 = time.monotonic()
        await store.put(FULL, new, new_data)
        assert time.monotonic() - t0 < 5, "a put never waits for the dead master"

        own_master.restart()
        with anyio.fail_after(60):
            for salt in range(6, 200):  # new blocks until the tier is up again and they land
                later, later_data = hashes(8, salt=salt), rand_blocks(8, bb, seed=salt)
                await store.put(FULL, later, later_data)
                await store.flush()
                if await _all_in_tier(store, later):
                    break
                await anyio.sleep(0.5)
        store.engine.clear()
        out = torch.zeros((8, bb), dtype=torch.uint8)
        with anyio.fail_after(30):
            await settle(store, later, "back")
            await store.get(FULL, later, out, request_id="back")
        store.release("back")
        assert torch.equal(out, later_data)
        assert store.stats().tiers[1].up == 1
        own_master.kill()
    finally:
        t0 = time.monotonic()
        await store.close()
        assert time.monotonic() - t0 < 5 + 5, "close is bounded by close_timeout_s"


@needs_mooncake
@pytest.mark.anyio
async def test_writes_while_a_restarted_master_has_no_segment_wait_and_land(
        own_master: MooncakeMaster) -> None:
    """The master killed for 5 s under a store writing steadily, then restarted: it holds no
    segment until the client mounts this process's again (its next heartbeat, seconds), and
    answers each write "no room" meanwhile. That is not a full pool: the tier is taken for not
    answering, the writes wait in the retry queue, and once the master takes writes again every
    block put after it returned is stored and reads back identical; nothing counted pool_full."""
    bb = 64 << 10
    layout = one_group(bb)
    store = TieredStore(store_cfg(own_master.endpoint, layout, slots=1024, close_timeout_s=5,
                                  segment_bytes=128 * MIB))  # room for every block: no pool is full here
    await store.open()
    salt = iter(range(20, 250))

    async def write(batches: int) -> tuple[list[bytes], list[torch.Tensor]]:
        hs_all, rows = [], []
        for _ in range(batches):
            s = next(salt)
            hs, data = hashes(8, salt=s), rand_blocks(8, bb, seed=s)
            await store.put(FULL, hs, data)
            hs_all += hs
            rows.append(data)
            await anyio.sleep(0.05)
        return hs_all, rows

    try:
        await write(2)
        await store.flush()
        own_master.kill()
        with anyio.move_on_after(5):
            while True:
                await write(1)
        own_master.start()
        after, rows = await write(16)
        deadline = time.monotonic() + 30
        while not await _all_in_tier(store, after) and time.monotonic() < deadline:
            await store.flush()
            await anyio.sleep(0.2)
        landed = await store.tiers[1].contains(FULL, [make_key(h, FULL) for h in after])
        st = store.stats().tiers[1]
        assert all(landed), f"{landed.count(False)} of {len(after)} blocks put after the master returned " \
                            f"never landed: {st}"
        assert st.backend.get("pool_full", 0) == 0, f"a master without segments is not a full pool: {st}"
        assert st.up == 1 and st.stores_requeued > 0, st
        store.engine.clear()
        out = torch.zeros((len(after), bb), dtype=torch.uint8)
        with anyio.fail_after(30):
            await settle(store, after, "back")
            await store.get(FULL, after, out, request_id="back")
        store.release("back")
        assert torch.equal(out, torch.cat(rows))
    finally:
        await store.close()


@needs_mooncake
@pytest.mark.anyio
async def test_a_hung_master_costs_lookups_a_bounded_wait(own_master: MooncakeMaster) -> None:
    """The master SIGSTOPped (connections open, no answers): Mooncake's calls to it time out after
    ``request_timeout_s`` (not Mooncake's 30 s), lookups of blocks only in Mooncake settle MISS,
    resident blocks are served, close is bounded; once it answers again the tier reads again."""
    layout = one_group(64 << 10)
    hs, data = hashes(8, salt=8), rand_blocks(8, 64 << 10, seed=8)
    store = TieredStore(store_cfg(own_master.endpoint, layout, slots=4, close_timeout_s=5))
    await store.open()
    try:
        for i in range(0, 8, 4):
            await store.put(FULL, hs[i:i + 4], data[i:i + 4])
            await store.flush()
        own_master.freeze()
        try:
            t0 = time.monotonic()
            with anyio.fail_after(60):
                out = torch.zeros((4, 64 << 10), dtype=torch.uint8)
                await store.get(FULL, hs[4:], out)
                assert torch.equal(out, data[4:])
                res = await settle(store, hs[:4], "hung")
            store.release("hung")
            assert res == [Lookup.MISS] * 4, res
            hung_s = time.monotonic() - t0
            assert hung_s < 15, f"lookups waited {hung_s:.1f}s on a hung master, not request_timeout_s (5 s)"
        finally:
            own_master.freeze(False)
        with anyio.fail_after(60):
            while not await _all_in_tier(store, hs[:4]):
                await anyio.sleep(0.2)
    finally:
        t0 = time.monotonic()
        await store.close()
        assert time.monotonic() - t0 < 5 + 5


async def _all_in_tier(store: TieredStore, hs: list[bytes]) -> bool:
    try:
        return all(await store.tiers[1].contains(FULL, [make_key(h, FULL) for h in hs]))
    except BackendError:
        return False


@needs_mooncake
@pytest.mark.anyio
async def test_a_master_down_at_start_never_holds_the_start_and_joins_later(tmp_path: Path) -> None:
    master = MooncakeMaster(tmp_path)  # not started: nothing listens on its port
    layout = one_group(64 << 10)
    cfg = store_cfg(master.endpoint, layout, open_timeout_s=3)
    t0 = time.monotonic()
    async with TieredStore(cfg) as store:
        assert time.monotonic() - t0 < 3 + 2, "the start waited past open_timeout_s"
        st = store.stats().tiers[1]
        assert st.up == 0 and master.endpoint in st.down_reason, st
        hs, data = hashes(4, salt=7), rand_blocks(4, 64 << 10, seed=7)
        await store.put(FULL, hs, data)  # served from the primary meanwhile
        master.start()
        try:
            with anyio.fail_after(60):
                while store.stats().tiers[1].up != 1:
                    await anyio.sleep(0.2)
                while not await _all_in_tier(store, hs):
                    await store.put(FULL, hs, data)
                    await store.flush()
                    await anyio.sleep(0.2)
        finally:
            master.close()


@needs_mooncake
@pytest.mark.anyio
async def test_a_required_tier_whose_master_is_down_fails_the_start_naming_endpoint_and_cause(
        tmp_path: Path) -> None:
    master = MooncakeMaster(tmp_path)
    cfg = store_cfg(master.endpoint, one_group(64 << 10), open_timeout_s=2, required=True)
    t0 = time.monotonic()
    with pytest.raises(BackendError) as exc:
        async with TieredStore(cfg):
            pass
    assert time.monotonic() - t0 < 2 + 3
    message = str(exc.value)
    assert "required" in message and master.endpoint in message and "refused" in message.lower(), message
