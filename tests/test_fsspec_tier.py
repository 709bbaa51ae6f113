"""The fsspec tier on its own and behind a TieredStore: codecs, corruption, capacity, faults, secrets."""

from __future__ import annotations

import logging
import os
import re
import socket
import struct
import subprocess
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import xxhash
import zstandard
from s3util import boto_client, new_bucket, s3_endpoint, storage_options

from tierkv import BlockMissing, Lookup, StoreConfig, TieredStore
from tierkv.backends.base import TierContext
from tierkv.backends.fsspec import FsspecTier, FsspecTierConfig
from tierkv.errors import BackendError, ConfigError
from tierkv.keys import make_key
from tierkv.movement.gateway import TierGateway
from tierkv.records import FIXED_HEADER_LEN, TRAILER_LEN, encode_record, read_header
from tierkv.records.tempnames import HOST as _HOST
from tierkv.records.tempnames import TEMP_MARK
from tierkv.testing import conformance_layout

__all__ = ["s3_endpoint"]  # the fixture, imported for this module

pytestmark = pytest.mark.anyio

LAYOUT = conformance_layout()
FULL, REC = 0, 2
BB = LAYOUT.groups[FULL].block_bytes
NS = "tier-tests"
FP = LAYOUT.fingerprint(NS)
SECRET = "SUPERSECRET123"


def ctx(namespace: str = NS) -> TierContext:
    return TierContext(layout=LAYOUT, namespace=namespace, fingerprint=LAYOUT.fingerprint(namespace))


def make_tier(url: str, **kw: Any) -> FsspecTier:
    return FsspecTier(FsspecTierConfig(url=url, **kw), ctx())


def keys(n: int, salt: int = 0, group: int = FULL) -> list[bytes]:
    return [make_key(bytes([salt]) * 4 + i.to_bytes(28, "big"), group) for i in range(n)]


def hashes(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt]) * 4 + i.to_bytes(28, "big") for i in range(n)]


def kv_like(n: int, nbytes: int, seed: int = 0) -> torch.Tensor:
    """bf16 values shaped like KV: per-channel scales, correlated along tokens (compressible)."""
    g = torch.Generator().manual_seed(seed)
    chans = nbytes // 2 // 16
    scale = torch.rand(chans, generator=g) * 2 + 0.1
    x = torch.cumsum(torch.randn(n, 16, chans, generator=g) * 0.1, dim=1) * scale
    return x.to(torch.bfloat16).view(torch.uint8).reshape(n, nbytes).contiguous()


def rand_blocks(n: int, nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)


# ---- round trip per codec and dtype ------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["none", "zstd", "zstd-shuffle"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int64])
async def test_round_trip_every_codec_and_dtype(tmp_path: Path, codec: str, dtype: torch.dtype) -> None:
    elem = torch.empty(0, dtype=dtype).element_size()
    tier = make_tier(f"file://{tmp_path}", codec=codec, elem_size=elem)
    await tier.open()
    try:
        n = 6
        if dtype.is_floating_point:
            data = (torch.randn(n, BB // elem) * 3).to(dtype)
        else:
            data = torch.randint(0, 100, (n, BB // elem)).to(dtype)
        ks = keys(n)
        assert await tier.put(FULL, ks, data) == [True] * n
        out = torch.zeros_like(data)
        assert await tier.get(FULL, ks, out) == [True] * n
        assert torch.equal(out.view(torch.uint8), data.view(torch.uint8))
        header = read_header(Path(tier.path(ks[0])).read_bytes())
        assert header.codec == codec and header.raw_len == BB and header.fingerprint == FP
    finally:
        await tier.close()


async def test_zstd_shuffle_pays_on_kv_like_bf16(tmp_path: Path) -> None:
    sizes = {}
    for codec in ("none", "zstd", "zstd-shuffle"):
        tier = make_tier(f"file://{tmp_path}/{codec}", codec=codec)
        await tier.open()
        data = kv_like(8, BB)
        await tier.put(FULL, keys(8), data)
        sizes[codec] = tier.used_bytes()
        out = torch.zeros_like(data)
        assert await tier.get(FULL, keys(8), out) == [True] * 8
        assert torch.equal(out, data)
        await tier.close()
    assert sizes["zstd-shuffle"] < sizes["zstd"] < sizes["none"]


# ---- corruption through the tier ---------------------------------------------------------------------
def _fix_checksum(rec: bytearray) -> bytes:
    end = len(rec) - TRAILER_LEN
    rec[end:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(rec[:end])))
    return bytes(rec)


def _record(key: bytes, data: bytes, codec: str = "none", fp: str = FP) -> bytes:
    return encode_record(key=key, fingerprint=fp, payload=data, codec=codec)


class _Corrupter:
    """A tier on a directory, one good record, and a way to put damaged versions in its place."""

    def __init__(self, tier: FsspecTier) -> None:
        self.tier = tier
        self.key = keys(1, salt=77)[0]
        self.data = kv_like(1, BB)
        self.path = Path(tier.path(self.key))

    async def write_good(self) -> bytes:
        assert await self.tier.put(FULL, [self.key], self.data) == [True]
        return self.path.read_bytes()

    async def expect_miss(self, damaged: bytes, reason: str | None = None) -> str:
        """Place ``damaged``; ``get`` must be a counted miss that removes the file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(damaged)
        before = dict(self.tier.counters)
        out = torch.full((1, BB), 0xAB, dtype=torch.uint8)
        assert await self.tier.get(FULL, [self.key], out) == [False]
        after = self.tier.counters
        assert after.get("corrupt", 0) == before.get("corrupt", 0) + 1
        assert after.get("corrupt_removed", 0) == before.get("corrupt_removed", 0) + 1
        got = [k[len("corrupt_"):] for k in after
               if k.startswith("corrupt_") and k != "corrupt_removed" and after[k] != before.get(k, 0)]
        assert len(got) == 1, got
        if reason is not None:
            assert got[0] == reason
        assert not self.path.exists(), "a corrupt record must be removed"
        return got[0]


@pytest.fixture
async def corrupter(tmp_path: Path) -> Any:
    tier = make_tier(f"file://{tmp_path}", codec="zstd-shuffle")
    await tier.open()
    try:
        yield _Corrupter(tier)
    finally:
        await tier.close()


@pytest.mark.parametrize("codec", ["none", "zstd-shuffle"])
async def test_a_flipped_bit_anywhere_is_a_counted_miss_and_removed(tmp_path: Path, codec: str) -> None:
    tier = make_tier(f"file://{tmp_path}", codec=codec)
    await tier.open()
    try:
        c = _Corrupter(tier)
        good = await c.write_good()
        header = read_header(good)
        # every bit of the fields, the key and the plane table; a sample of a page's zero padding
        fields_end = min(header.header_len, 128)
        positions = [(i, b) for i in range(fields_end) for b in range(8)]
        positions += [(i, i % 8) for i in range(fields_end, header.header_len, 61)]
        positions += [(header.header_len - 1, 0)] if header.header_len > fields_end else []
        payload = range(header.header_len, header.header_len + header.stored_len)
        positions += [(i, i % 8) for i in list(payload)[:: max(1, header.stored_len // 61)]]
        positions += [(len(good) - TRAILER_LEN + i, 7 - i) for i in range(TRAILER_LEN)]
        reasons: set[str] = set()
        for pos, bit in positions:
            bad = bytearray(good)
            bad[pos] ^= 1 << bit
            reasons.add(await c.expect_miss(bytes(bad)))
        assert tier.counters["corrupt"] == len(positions)
        assert {"magic", "version", "codec", "checksum", "size", "truncated"} >= reasons - {"key"}
        assert "checksum" in reasons and "magic" in reasons
        # and a good record still reads back after all that
        assert await tier.put(FULL, [c.key], c.data) == [True]
        out = torch.zeros((1, BB), dtype=torch.uint8)
        assert await tier.get(FULL, [c.key], out) == [True] and torch.equal(out, c.data)
    finally:
        await tier.close()


async def test_truncation_at_every_header_boundary(corrupter: _Corrupter) -> None:
    good = await corrupter.write_good()
    h = read_header(good)
    key_end = FIXED_HEADER_LEN + len(h.key)
    cuts = [0, 1, 7, 8, 10, 11, 12, 13, 14, 16, 20, 24, 40, 48, 55, FIXED_HEADER_LEN, key_end - 1, key_end,
            key_end + 16, h.header_len - 1, h.header_len, h.header_len + 1, h.header_len + h.stored_len,
            len(good) - 1]
    for cut in cuts:
        reason = await corrupter.expect_miss(good[:cut])
        assert reason == ("empty" if cut == 0 else "truncated"), (cut, reason)


async def test_foreign_empty_wrong_fingerprint_wrong_key_and_absurd_sizes(corrupter: _Corrupter) -> None:
    c = corrupter
    good = await c.write_good()
    data = c.data[0].numpy().tobytes()
    other_fp = LAYOUT.fingerprint("someone-else")
    cases: list[tuple[bytes, str]] = [
        (b"", "empty"),
        (b"GIF89a" + bytes(5000), "magic"),
        (b"#!/bin/sh\necho not a record\n", "magic"),
        (good[:8], "truncated"),  # only the magic
        (_record(c.key, data, fp=other_fp), "fingerprint"),  # written for another namespace, copied in
        (_record(keys(1, salt=5)[0], data), "key"),  # a record of another key under this key's path
        (_record(c.key, data + data), "size"),  # a block of another size
        (good + b"\0", "size"),  # trailing garbage
    ]
    # header fields rewritten with the checksum fixed, so only the field itself is wrong
    absurd = bytearray(_record(c.key, data))
    struct.pack_into("<QQ", absurd, 40, 1 << 62, 1 << 62)
    cases.append((_fix_checksum(absurd), "size"))
    huge = bytearray(_record(c.key, data))
    struct.pack_into("<QQ", huge, 40, 1 << 40, 1 << 40)  # allowed by the format, not by block_bytes
    cases.append((_fix_checksum(huge), "size"))
    for v in (0, 1):  # formats no release wrote (a newer one is refused, left in place: test_format_v3.py)
        version = bytearray(good)
        struct.pack_into("<H", version, 8, v)
        cases.append((_fix_checksum(version), "version"))
    # a zstd "bomb": a small frame that declares 64 MiB behind a header that claims block_bytes
    frame = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    bomb = bytearray(_record(c.key, data, codec="zstd"))
    h = read_header(bytes(bomb))
    bomb = bomb[: h.header_len] + bytearray(frame) + bytearray(TRAILER_LEN)
    struct.pack_into("<Q", bomb, 48, len(frame))
    cases.append((_fix_checksum(bomb), "decompress"))
    for damaged, reason in cases:
        assert await c.expect_miss(damaged) == reason, reason
    counters = c.tier.counters
    assert counters["corrupt"] == len(cases)
    assert sum(v for k, v in counters.items()
               if k.startswith("corrupt_") and k != "corrupt_removed") == len(cases)


def _damage_kinds(good: bytes, key: bytes, data: bytes) -> list[bytes]:
    h = read_header(good)
    flipped = bytearray(good)
    flipped[h.header_len + 5] ^= 0x10
    header_flip = bytearray(good)
    header_flip[42] ^= 0x01
    return [flipped, header_flip, good[: h.header_len], b"", b"plain text, no record",
            _record(key, data, fp=LAYOUT.fingerprint("other")), _record(make_key(b"z" * 32, FULL), data),
            good[:-1]]


async def test_corrupt_records_are_misses_through_the_store(tmp_path: Path) -> None:
    cfg = {"layout": LAYOUT, "namespace": NS, "max_concurrent_requests": 2,
           "tiers": [{"kind": "cpu", "slots": {FULL: 16, REC: 4}},
                     {"kind": "fsspec", "url": f"file://{tmp_path}", "codec": "zstd"}]}
    hs = hashes(10, salt=3)
    data = kv_like(10, BB, seed=3)
    async with TieredStore(cfg) as store:
        await store.put(FULL, hs, data)
        await store.flush()
        tier = store.tiers[1]
        ks = [make_key(h, FULL) for h in hs]
        damaged = _damage_kinds(Path(tier.path(ks[0])).read_bytes(), ks[0], data[0].numpy().tobytes())
        assert len(damaged) == 8
        for k, blob in zip(ks, damaged, strict=False):  # blocks 0..7 damaged, 8 and 9 sound
            Path(tier.path(k)).write_bytes(blob)
        store.engine.clear()  # forget the primary's copies
        assert store.lookup(FULL, hs, request_id="r") == [Lookup.PENDING] * 10
        for _ in range(5):
            await store.idle()
            res = store.lookup(FULL, hs, request_id="r")
            if Lookup.PENDING not in res:
                break
        assert res == [Lookup.MISS] * 8 + [Lookup.HIT] * 2
        assert store.lookup_prefix(hs, request_id="r").blocks == 0
        out = torch.zeros_like(data)
        with pytest.raises(BlockMissing) as exc:
            await store.get(FULL, hs, out, request_id="r")
        assert exc.value.missing == list(range(8))
        await store.get(FULL, hs[8:], out[8:], request_id="r")
        assert torch.equal(out[8:], data[8:])
        store.release("r")
        backend = store.stats().tiers[1].backend
        assert backend["corrupt"] == 8 and backend["corrupt_removed"] == 8
        assert sum(v for k, v in backend.items() if k.startswith("corrupt_") and k != "corrupt_removed") == 8
        assert not any(Path(tier.path(k)).exists() for k in ks[:8])
        # direct gets after removal: plain misses, nothing raised
        for i in range(8):
            with pytest.raises(BlockMissing):
                await store.get(FULL, hs[i:i + 1], out[i:i + 1])
        groups = store.stats().groups[0]
        assert groups.writing == 0 and groups.pinned == 0


# ---- capacity ----------------------------------------------------------------------------------------
def _record_len(codec: str = "none") -> int:
    return len(encode_record(key=keys(1)[0], fingerprint=FP, payload=bytes(BB), codec=codec))


def _on_disk(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.tkv"))


async def test_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    rl = _record_len()
    tier = make_tier(f"file://{tmp_path}", capacity_bytes=5 * rl)
    await tier.open()
    try:
        ks = keys(12, salt=9)
        data = rand_blocks(12, BB)
        await tier.put(FULL, ks[:5], data[:5])
        out = torch.zeros((1, BB), dtype=torch.uint8)
        assert await tier.get(FULL, ks[:1], out) == [True]  # key 0 is now the most recently used
        await tier.put(FULL, ks[5:6], data[5:6])
        # one put holds a prefix: its end goes before its beginning (key 4, not key 1)
        assert await tier.contains(FULL, ks[:6]) == [True, True, True, True, False, True]
        for i in range(6, 12):
            await tier.put(FULL, ks[i:i + 1], data[i:i + 1])
            assert tier.used_bytes() <= 5 * rl
            assert sum(p.stat().st_size for p in _on_disk(tmp_path)) <= 5 * rl
        assert await tier.contains(FULL, ks) == [False] * 7 + [True] * 5
        assert tier.counters["evictions"] == 7
        # a record larger than the whole capacity is refused, not written and then lost
        small = make_tier(f"file://{tmp_path}/small", capacity_bytes=rl - 1)
        await small.open()
        assert await small.put(FULL, ks[:1], data[:1]) == [False]
        assert small.counters["too_large"] == 1
        await small.close()
    finally:
        await tier.close()


async def test_usage_is_rebuilt_after_restart_and_evicted_down_to_capacity(tmp_path: Path) -> None:
    rl = _record_len()
    url = f"file://{tmp_path}"
    first = make_tier(url)
    await first.open()
    ks = keys(20, salt=4)
    data = rand_blocks(20, BB, seed=4)
    await first.put(FULL, ks, data)
    await first.close()
    for i, k in enumerate(ks):  # record i is older than record i + 1
        os.utime(first.path(k), (1_000_000 + i, 1_000_000 + i))
    cfg = {"layout": LAYOUT, "namespace": NS, "max_concurrent_requests": 2,
           "tiers": [{"kind": "cpu", "slots": {FULL: 4, REC: 2}},
                     {"kind": "fsspec", "url": url, "capacity_bytes": 8 * rl}]}
    async with TieredStore(cfg) as store:
        tier = store.tiers[1]
        assert isinstance(tier, FsspecTier)
        with anyio.fail_after(10):
            await tier.wait_scanned()
        st = store.stats().tiers[1]
        assert st.used_bytes == 8 * rl
        assert st.backend["scanned"] == 20 and st.backend["evictions"] == 12
        assert [p.name for p in _on_disk(tmp_path)] == sorted(f"{k.hex()}.tkv" for k in ks[12:])
        out = torch.zeros((8, BB), dtype=torch.uint8)
        await store.get(FULL, hashes(20, salt=4)[12:], out)
        assert torch.equal(out, data[12:])


async def test_scan_removes_temporary_files_of_dead_writers_only(tmp_path: Path) -> None:
    tier = make_tier(f"file://{tmp_path}", stale_temp_s=600)
    await tier.open()
    await tier.put(FULL, keys(1), rand_blocks(1, BB))
    d = Path(tier.path(keys(1)[0])).parent
    dead = subprocess.run(["true"]).args and _dead_pid()
    names = {
        "dead": f".x.tkv{TEMP_MARK}{_HOST}-{dead}-0123456789ab",
        "live": f".y.tkv{TEMP_MARK}{_HOST}-{os.getpid()}-0123456789ab",
        "remote_fresh": f".z.tkv{TEMP_MARK}otherhost-1-0123456789ab",
        "remote_old": f".w.tkv{TEMP_MARK}otherhost-2-0123456789ab",
    }
    for name in names.values():
        (d / name).write_bytes(b"partial")
    os.utime(d / names["remote_old"], (1_000_000, 1_000_000))
    await tier.scan()
    left = {p.name for p in d.iterdir() if TEMP_MARK in p.name}
    assert left == {names["live"], names["remote_fresh"]}
    assert tier.counters["temp_removed"] == 2
    await tier.close()


async def test_the_background_listing_waits_while_reads_are_in_flight(tmp_path: Path) -> None:
    """Accounting for capacity is background work: a restore that starts as the tier opens gets
    the CPU first, and the listing runs once the reads are done."""
    writer = make_tier(f"file://{tmp_path}")
    await writer.open()
    await writer.put(FULL, keys(8), rand_blocks(8, BB))
    await writer.close()
    tier = make_tier(f"file://{tmp_path}")
    await tier.open()
    gate = anyio.Event()
    real = tier.driver.read_records

    async def held(*args: Any) -> Any:
        await gate.wait()  # a read that takes its time
        return await real(*args)

    tier.driver.read_records = held  # type: ignore[method-assign]
    out = torch.zeros((8, BB), dtype=torch.uint8)
    got: list[list[bool]] = []

    async def read() -> None:
        got.append(await tier.get(FULL, keys(8), out))

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await anyio.sleep(0.01)  # the read is in flight
        tg.start_soon(tier.background)
        await anyio.sleep(0.3)
        assert "scanned" not in tier.counters, "the listing ran while a read was in flight"
        gate.set()
        with anyio.fail_after(10):
            await tier.wait_scanned()
        tg.cancel_scope.cancel()
    assert got == [[True] * 8]
    assert tier.counters["scanned"] == 8
    await tier.close()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ---- faults ------------------------------------------------------------------------------------------
def _inner(kind: str, tmp_path: Path, endpoint: str | None) -> dict[str, Any]:
    if kind == "file":
        return {"kind": "fsspec", "url": f"file://{tmp_path}", "codec": "zstd-shuffle"}
    if kind == "memory":
        return {"kind": "fsspec", "url": f"memory://tkv-{uuid.uuid4().hex}"}
    assert endpoint is not None
    return {"kind": "fsspec", "url": f"s3://{new_bucket(endpoint)}/kv",
            "storage_options": storage_options(endpoint)}


@pytest.mark.parametrize(("where", "error"), [("file", "ENOSPC"), ("file", "EIO"), ("file", "SlowDown"),
                                              ("memory", "EIO"), ("s3", "SlowDown")])
async def test_faulty_tier_store_keeps_serving_and_leaks_nothing(
        tmp_path: Path, request: pytest.FixtureRequest, where: str, error: str) -> None:
    endpoint = request.getfixturevalue("s3_endpoint") if where == "s3" else None
    faulty = {"kind": "faulty", "inner": _inner(where, tmp_path, endpoint), "fail_every": 3,
              "error": error, "ops": ["put", "get", "contains"], "negative_ttl_s": 0.05}
    cfg = {"layout": LAYOUT, "namespace": NS, "max_concurrent_requests": 2,
           "tiers": [{"kind": "cpu", "slots": {FULL: 4, REC: 2}}, faulty]}
    hs = hashes(16, salt=6)
    data = rand_blocks(16, BB, seed=6)
    async with TieredStore(cfg) as store:
        for i in range(16):
            await store.put(FULL, hs[i:i + 1], data[i:i + 1])
            await store.flush()
        # the primary keeps the newest blocks whatever the lower tier does
        assert store.lookup(FULL, hs[-4:]) == [Lookup.HIT] * 4
        served = missing = 0
        for rnd in range(2):
            for i in range(16):
                rid = f"r{rnd}-{i}"
                store.lookup(FULL, hs[i:i + 1], request_id=rid)
                await store.idle()
                store.lookup(FULL, hs[i:i + 1], request_id=rid)
                out = torch.zeros((1, BB), dtype=torch.uint8)
                try:
                    await store.get(FULL, hs[i:i + 1], out, request_id=rid)
                    assert torch.equal(out[0], data[i]), "wrong bytes served"
                    served += 1
                except BlockMissing:
                    missing += 1
                store.release(rid)
        await store.flush()
        await store.idle()
        st = store.stats()
        faulty_tier = store.tiers[1]
        assert faulty_tier.injected > 0 and st.tiers[1].backend["injected"] == faulty_tier.injected
        t = st.tiers[1]
        assert t.stores_failed > 0
        # each block is written, shed, failed for good, or queued for a retry (EIO: the tier did
        # not answer) and then written, given up (counted) or still waiting in the queue
        failed_for_good = 0 if error == "EIO" else t.stores_failed
        given_up = t.stores_requeue_dropped
        assert t.stores + t.stores_shed + failed_for_good + given_up + t.requeue_waiting == 16, t
        assert served >= 8 and served + missing == 32
        assert st.tiers[1].inflight_bytes == 0 and st.tiers[1].inflight_ops == 0
        assert all(g.writing == 0 and g.pinned == 0 for g in st.groups)
        assert st.promotions_pending == 0 and st.requests_active == 0 and st.admission_queue == 0
        # with the faults gone (and failed reads out of the negative cache), every block the tier
        # acknowledged is served
        faulty_tier.enabled = False
        await anyio.sleep(0.1)
        store.engine.clear()
        await store.flush()  # a retry still running ends; none can start (nothing left in the primary)
        stored = store.stats().tiers[1].stores
        got = 0
        for i in range(16):
            out = torch.zeros((1, BB), dtype=torch.uint8)
            try:
                await store.get(FULL, hs[i:i + 1], out)
                assert torch.equal(out[0], data[i])
                got += 1
            except BlockMissing:
                pass
        assert got == stored


# ---- credentials ---------------------------------------------------------------------------------------
class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def logs() -> Iterator[_Collect]:
    handler = _Collect()
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    tkv = logging.getLogger("tierkv")
    old = root.level, tkv.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    tkv.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old[0])
        tkv.setLevel(old[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _assert_no_secret(*texts: object) -> None:
    for t in texts:
        assert SECRET not in str(t), str(t)[:2000]


async def test_credentials_never_appear_in_reprs_stats_or_logs(
        tmp_path: Path, s3_endpoint: str, logs: _Collect) -> None:
    bucket = new_bucket(s3_endpoint)
    opts = {k: v for k, v in storage_options(s3_endpoint).items() if k not in ("key", "secret")}
    tiers: list[dict[str, Any]] = [
        {"kind": "cpu", "slots": {FULL: 2, REC: 2}},
        # credentials in the URL's user info (s3fs gets them as key / secret)
        {"kind": "fsspec", "url": f"s3://AKIAUSER:{SECRET}@{bucket}/kv", "storage_options": opts},
        # a file URL with user info
        {"kind": "fsspec", "url": f"file://u:{SECRET}@{tmp_path}/t"},
    ]
    # credentials in storage_options that a local tier refuses: the refusal names the key only
    refused = StoreConfig(layout=LAYOUT, namespace=NS, tiers=[
        {"kind": "cpu", "slots": {FULL: 2, REC: 2}},
        {"kind": "fsspec", "url": f"file://{tmp_path}/r",
         "storage_options": {"secret": SECRET, "client_kwargs": {"token": SECRET}}}])
    with pytest.raises(ConfigError, match="takes no option") as info:
        async with TieredStore(refused):
            pass
    _assert_no_secret(str(info.value))
    config = StoreConfig(layout=LAYOUT, namespace=NS, tiers=tiers)
    _assert_no_secret(repr(config), str(config), *(repr(t) for t in config.tiers),
                      *(str(t) for t in config.tiers))
    hs = hashes(6, salt=8)
    data = rand_blocks(6, BB, seed=8)
    async with TieredStore(config) as store:
        await store.put(FULL, hs, data)
        await store.flush()
        st = store.stats()
        assert st.tiers[1].stores == 6, "the URL's credentials must reach s3fs"
        assert st.tiers[2].stores == 6
        assert list((tmp_path / "t").iterdir()), "user info in a file URL is not part of the path"
        out = torch.zeros_like(data)
        await store.get(FULL, hs, out)
        assert torch.equal(out, data)
        # the bucket goes away: stores and reads fail, and say so in the log
        client = boto_client(s3_endpoint)
        for obj in client.list_objects_v2(Bucket=bucket).get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])
        client.delete_bucket(Bucket=bucket)
        hs2 = hashes(4, salt=9)
        await store.put(FULL, hs2, rand_blocks(4, BB, seed=9))
        await store.flush()
        st = store.stats()
        assert st.tiers[1].stores_failed == 4 and st.tiers[1].backend["write_errors"] == 4
        _assert_no_secret(*(repr(t) for t in store.tiers), *(t.describe() for t in store.tiers),
                          str(st.model_dump()), st.model_dump_json())
    failed = [line for line in logs.lines if "writing records" in line]
    counts = [int(m.group(1)) for line in failed if (m := re.search(r"(\d+) of \d+ records", line))]
    assert sum(counts) >= 4 and len(failed) < 4, logs.lines  # one warning per batch, not per record
    _assert_no_secret("\n".join(logs.lines))


def test_faulty_wrapper_config_repr_hides_credentials() -> None:
    config = StoreConfig(layout=LAYOUT, namespace=NS, tiers=[
        {"kind": "cpu", "slots": {FULL: 2, REC: 2}},
        {"kind": "faulty", "inner": {"kind": "fsspec", "url": "memory://x",
                                     "storage_options": {"secret": SECRET}}}])
    _assert_no_secret(repr(config))


@pytest.mark.parametrize("url", [f"s3://AKIAUSER:{SECRET}@bucket/kv", "s3://bucket/kv"])
async def test_credentials_never_appear_in_errors_of_a_dead_endpoint(url: str, logs: _Collect) -> None:
    opts = {"endpoint_url": f"http://127.0.0.1:{_free_port()}", "secret": SECRET, "key": "AKIAUSER",
            "retries": 1, "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    if "@" in url:
        del opts["secret"], opts["key"]
    tier = {"kind": "fsspec", "url": url, "storage_options": opts, "open_timeout_s": 5, "retry_attempts": 1}
    cfg = {"layout": LAYOUT, "namespace": NS, "tiers": [{"kind": "cpu", "slots": {FULL: 2, REC: 2}},
                                                        {**tier, "required": True}]}
    with pytest.raises(BackendError) as exc:
        async with TieredStore(cfg):
            pass
    text = "".join(traceback.format_exception(exc.value))
    assert "is required and did not open" in str(exc.value) and "opening the tier" in str(exc.value)
    assert "endpoint http://127.0.0.1:" in str(exc.value)
    _assert_no_secret(text, str(exc.value), repr(exc.value), "\n".join(logs.lines))
    # not required: the store opens without it, says why it is down, and never leaks the secret
    async with TieredStore({**cfg, "tiers": [cfg["tiers"][0], tier]}) as store:
        st = store.stats().tiers[1]
        assert st.up == 0 and "opening the tier" in st.down_reason
        _assert_no_secret(st.model_dump_json(), "\n".join(logs.lines))
    # the tier on its own: every operation fails with a clean error
    tier = FsspecTier(FsspecTierConfig(url=url, storage_options=opts), ctx())
    with pytest.raises(BackendError) as exc2:
        await tier.open()
    _assert_no_secret(str(exc2.value), "".join(traceback.format_exception(exc2.value)), repr(tier))


def test_redact_url_and_config_repr() -> None:
    from tierkv.backends.fsspec._tier import Redactor, redact_url

    assert redact_url(f"s3://AK:{SECRET}@bucket/p?x=1") == "s3://bucket/p"
    assert redact_url(f"http://u:{SECRET}@host:9000/p") == "http://host:9000/p"
    cfg = FsspecTierConfig(url=f"s3://AK:{SECRET}@b/p",
                           storage_options={"client_kwargs": {"aws_secret": SECRET}})
    _assert_no_secret(repr(cfg), str(cfg))
    assert "s3://b/p" in repr(cfg)
    red = Redactor(cfg.url, {"client_kwargs": {"aws_session_token": SECRET}, "endpoint_url": "http://h"})
    assert red(f"boom {SECRET} http://h") == "boom *** http://h"
    assert SECRET not in red.error(OSError(f"failed for {SECRET}"))

    class Group(Exception):  # what an exception group looks like to the redactor
        exceptions = (ValueError(f"leaf {SECRET}"),)

    assert red.error(Group("outer")) == "ValueError: leaf ***"



async def test_a_cancelled_local_call_returns_only_after_its_running_jobs_end() -> None:
    """Local jobs write into the caller's buffers: none may run on after a cancelled call returns."""
    import threading
    import time

    from tierkv.backends.fsspec._local import LocalDriver

    driver = LocalDriver(anyio.CapacityLimiter(2), threads=2, fsync=False)
    lock, running, started, finished = threading.Lock(), [0], [0], [0]

    def job(i: int) -> int:
        with lock:
            running[0] += 1
            started[0] += 1
        time.sleep(0.05)
        with lock:
            running[0] -= 1
            finished[0] += 1
        return i

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(driver.map, job, 40)
            while started[0] == 0:  # cancel once jobs run
                await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
        assert running[0] == 0 and started[0] == finished[0]
        assert 0 < started[0] < 40  # the chunks that had not started were dropped
        done = started[0]
        await anyio.sleep(0.15)
        assert started[0] == done  # nothing queued runs later
        assert await driver.map(lambda i: i * 2, 5) == [0, 2, 4, 6, 8]  # the driver still works
    finally:
        await driver.close()


async def test_a_listing_tells_the_gateway_what_is_present_and_a_removal_unsays_it(tmp_path: Path) -> None:
    """After the start-up listing a lookup of a listed record is answered present without a probe
    (an engine then promotes at its first lookup instead of asking again a step later); a record
    removed afterwards is forgotten, so the next lookup looks for it again."""
    url = f"file://{tmp_path}"
    ks = keys(5, salt=23)
    writer = make_tier(url)
    await writer.open()
    await writer.put(FULL, ks[:4], rand_blocks(4, BB))
    await writer.close()
    tier = make_tier(url)
    gw = TierGateway(1, tier)
    seen: list[str] = []
    tier.add_listener(lambda event, _: seen.append(event))
    await tier.open()
    try:
        now = time.monotonic()
        assert gw.presence_many(FULL, ks, now) == [None] * 5  # nothing known before the listing
        await tier.scan()
        assert "listed" in seen
        assert gw.presence_many(FULL, ks, time.monotonic()) == [True] * 4 + [None]
        await tier.delete(FULL, ks[:1])
        assert gw.presence_many(FULL, ks[:2], time.monotonic()) == [None, True]
        assert gw.stats.probes == 0
    finally:
        await tier.close()


async def test_a_sole_writer_answers_absence_from_its_ledger_without_a_probe(tmp_path: Path) -> None:
    """``sole_writer``: once its listing is done a record the ledger does not know is absent, said
    from memory (no probe, no PENDING round trip: docs/performance.md, "Serving a Mooncake trace");
    before the listing it probes. ``listing_trusted_s``: the same within that time of a listing
    (a record another process wrote since is a missed hit), then it probes again. Default: probe."""
    ks = keys(6, salt=29)
    for n, (kw, after_listing) in enumerate([({}, [None] * 4), ({"sole_writer": True}, [False] * 4),
                                             ({"listing_trusted_s": 2.0}, [False] * 4)]):
        url = f"file://{tmp_path}/{n}"
        writer = make_tier(url)
        await writer.open()
        await writer.put(FULL, ks[:2], rand_blocks(2, BB))
        await writer.close()
        tier = make_tier(url, **kw)
        gw = TierGateway(1, tier)
        await tier.open()
        try:
            assert gw.presence_many(FULL, ks[2:], time.monotonic()) == [None] * 4  # not listed yet
            await tier.scan()
            assert gw.presence_many(FULL, ks, time.monotonic()) == [True] * 2 + after_listing, kw
            assert gw.presence(FULL, ks[5], time.monotonic()) is after_listing[-1]
            await tier.put(FULL, ks[2:3], rand_blocks(1, BB))  # its own writes: in its ledger
            own = after_listing[:2] if not kw else [True, False]
            assert gw.presence_many(FULL, ks[2:4], time.monotonic()) == own
            if "listing_trusted_s" in kw:
                other = make_tier(url)
                await other.open()
                await other.put(FULL, ks[4:5], rand_blocks(1, BB))
                await other.close()
                assert gw.presence(FULL, ks[4], time.monotonic()) is False  # a missed hit, for now
                await anyio.sleep(2.05)
                assert gw.presence(FULL, ks[4], time.monotonic()) is None  # probed again
                await tier.scan()
                assert gw.presence(FULL, ks[4], time.monotonic()) is True
            assert gw.stats.probes == 0
        finally:
            await tier.close()


async def test_probes_of_records_it_knows_need_no_storage_round_trip(tmp_path: Path) -> None:
    """A new process restoring a prefix probes records its start-up listing already found: answered
    from memory (no per-file check on storage); unknown ones are still looked for; one removed
    behind its back is answered present and then read as a counted miss, never served."""
    url = f"file://{tmp_path}"
    ks = keys(6, salt=21)
    data = rand_blocks(6, BB)
    writer = make_tier(url)
    await writer.open()
    await writer.put(FULL, ks[:4], data[:4])
    await writer.close()
    tier = make_tier(url)
    await tier.open()
    try:
        await tier.scan()  # what the store's background task does at start
        asked: list[int] = []
        real = tier.driver.exists_many

        async def counting(paths: list[str]) -> list[bool]:
            asked.append(len(paths))
            return await real(paths)

        tier.driver.exists_many = counting  # type: ignore[method-assign]
        assert await tier.contains(FULL, ks[:4]) == [True] * 4
        assert asked == []
        assert await tier.contains(FULL, ks) == [True] * 4 + [False] * 2
        assert asked == [2]
        os.unlink(tier.path(ks[0]))  # another process evicted it
        assert await tier.contains(FULL, ks[:1]) == [True]
        out = torch.zeros((1, BB), dtype=torch.uint8)
        assert await tier.get(FULL, ks[:1], out) == [False]
        assert not out.any()
        assert await tier.contains(FULL, ks[:1]) == [False]  # the miss was learned
    finally:
        await tier.close()


def test_a_call_is_cut_into_runs_of_even_length_so_the_threads_end_together() -> None:
    from tierkv.backends.fsspec._local import _chunks

    for n, parts in [(38, 6), (5, 2), (10, 3), (3, 5), (1, 4), (64, 8)]:
        runs = _chunks(n, parts)
        assert [i for r in runs for i in r] == list(range(n))
        assert len(runs) == min(n, parts)
        assert max(map(len, runs)) - min(map(len, runs)) <= 1
    assert _chunks(0, 2) == []


async def test_scattered_rows_move_in_one_tier_call_per_batch_with_no_staging_copy(tmp_path: Path) -> None:
    """An engine's free pool rows are rarely adjacent (vLLM's CPU rows came in runs of 3 in the
    peers bench): the gateway hands a whole batch of scattered rows to the file tier in one call,
    which reads and writes each block where its row lies. One call per batch, not one per run, and
    every row right; a key the tier does not hold is a miss whose row is never reported."""
    tier = make_tier(f"file://{tmp_path}")
    gw = TierGateway(1, tier)
    calls: list[str] = []
    for name in ("get", "put", "get_rows", "put_rows"):
        real = getattr(tier, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kw)

        setattr(tier, name, spy)
    await tier.open()
    try:
        n = 9
        ks = keys(n, salt=31)
        data = rand_blocks(n, BB, seed=4)
        src = torch.zeros((40, BB), dtype=torch.uint8)
        at = [30, 1, 2, 17, 25, 26, 27, 5, 11]  # runs of 1, 2, 1, 3, 1 and 1
        src[at] = data
        assert gw.admit_store(n * BB)
        assert await gw.store(FULL, ks[:-1], src, at[:-1], (n - 1) * BB) == [True] * (n - 1)
        assert calls == ["put_rows"]
        calls.clear()
        dest = torch.zeros((40, BB), dtype=torch.uint8)
        to = [4, 38, 12, 13, 0, 22, 7, 8, 36]
        batches: list[list[int]] = []
        got = await gw.load(FULL, ks, dest, to, on_batch=lambda pos, ok: batches.append(list(pos)))
        assert got == [True] * (n - 1) + [False]
        assert calls == ["get_rows"] and batches == [list(range(n))]
        for i in range(n - 1):
            assert torch.equal(dest[to[i]], data[i])
        assert not dest[[r for r in range(40) if r not in to]].any()
    finally:
        await tier.close()
