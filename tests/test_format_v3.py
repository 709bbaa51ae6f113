"""Record format version 3 (docs/format.md): a ``none`` record's block starts on a page boundary;
version 2 records, as the previous release wrote them (tests/data/v2), are still served; a newer
version is refused and left in place; the C and Python write and read paths agree byte for byte."""

from __future__ import annotations

import importlib.util
import mmap
import os
import struct
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from helpers import evict

from tierkv.backends.base import TierContext
from tierkv.backends.fsspec import FsspecTier, FsspecTierConfig
from tierkv.errors import CorruptRecord
from tierkv.keys import make_key
from tierkv.records import (
    FORMAT_VERSION,
    PAGE_ALIGN,
    TRAILER_LEN,
    batchio,
    decode_record,
    encode_record,
    encode_record_parts,
    none_header,
    none_parts_match,
    read_header,
    verify_record,
)
from tierkv.records.batchio import page_cached
from tierkv.records.encryption import KeyRing
from tierkv.records.tempnames import TEMP_MARK
from tierkv.testing import conformance_layout
from tierkv.tools.audit import inspect_tier, verify_tier

pytestmark = pytest.mark.anyio

V2 = Path(__file__).parent / "data" / "v2"
LAYOUT = conformance_layout()
NS = "tier-tests"
FP = LAYOUT.fingerprint(NS)
FULL = 0
BB = LAYOUT.groups[FULL].block_bytes


def _v2_maker() -> ModuleType:
    """tests/data/v2/make_records.py: what the version 2 fixtures hold."""
    spec = importlib.util.spec_from_file_location("make_v2_records", V2 / "make_records.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


MAKER = _v2_maker()


def tier_at(root: Path, **kw: Any) -> FsspecTier:
    return FsspecTier(FsspecTierConfig(url=f"file://{root}", **kw),
                      TierContext(layout=LAYOUT, namespace=NS, fingerprint=FP))


def aes_key_file(tmp_path: Path) -> Path:
    path = tmp_path / "test.key"
    path.write_text(MAKER.AES_KEY.hex() + "\n")
    path.chmod(0o600)
    return path


def blocks(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, BB), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# ---- the layout of version 3 --------------------------------------------------------------------------
@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
@pytest.mark.parametrize("key_len", [36, 1, 4000])
@pytest.mark.parametrize("raw_len", [4096, 8192, 256 << 10, 4095, 100, 0])
def test_a_none_block_of_a_page_or_more_starts_on_a_page(raw_len: int, key_len: int, sealed: bool) -> None:
    ring = KeyRing(bytes(32)) if sealed else None
    block = np.random.default_rng(raw_len).integers(0, 256, raw_len, dtype=np.uint8)
    record = encode_record(key=bytes(key_len) + b"k", fingerprint=FP, payload=block, keys=ring)
    h = read_header(record)
    assert h.version == FORMAT_VERSION == 3
    unpadded = 56 + key_len + 1 + (24 if sealed else 0)
    align = PAGE_ALIGN if raw_len >= PAGE_ALIGN else 64
    assert h.header_len % align == 0 and unpadded <= h.header_len < unpadded + align
    assert record[unpadded:h.header_len] == bytes(h.header_len - unpadded)
    if not sealed:
        assert record[h.header_len:h.header_len + raw_len] == block.tobytes()
    assert len(record) == h.header_len + raw_len + (16 if sealed else 0) + TRAILER_LEN
    assert decode_record(record, key=bytes(key_len) + b"k", fingerprint=FP, max_raw_bytes=raw_len,
                         keys=ring).tobytes() == block.tobytes()


@pytest.mark.parametrize("codec", ["zstd", "zstd-shuffle"])
def test_compressed_records_keep_64_byte_headers(codec: str) -> None:
    record = encode_record(key=b"k" * 36, fingerprint=FP, payload=bytes(1 << 16), codec=codec)
    assert read_header(record).header_len in (128, 192)


def test_a_page_aligned_header_with_a_64_aligned_length_is_damage() -> None:
    """The reader holds each version and codec to its own padding rule, so the header length of a
    version 2 record is no valid version 3 one (and the reverse)."""
    block = bytes(range(256)) * 16
    v3 = bytearray(encode_record(key=b"k" * 36, fingerprint=FP, payload=block))
    as_v2 = bytearray(v3)
    struct.pack_into("<H", as_v2, 8, 2)
    end = len(as_v2) - TRAILER_LEN
    as_v2[end:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(as_v2[:end])))
    with pytest.raises(CorruptRecord) as exc:
        decode_record(bytes(as_v2), key=b"k" * 36, fingerprint=FP, max_raw_bytes=len(block))
    assert exc.value.reason == "size"


# ---- version 2 records of the previous release --------------------------------------------------------
def test_the_version_2_fixtures_are_what_the_previous_release_wrote() -> None:
    for i, (name, codec, sealed) in enumerate(MAKER.RECORDS):
        data = (V2 / f"{name}.tkv").read_bytes()
        h = read_header(data)
        assert (h.version, h.codec, h.encrypted, h.key, h.raw_len) == (2, codec, sealed, MAKER.key(i), BB)
        assert h.header_len % 64 == 0 and h.header_len < PAGE_ALIGN
        assert len(data) < 5000
        assert verify_record(data, max_raw_bytes=BB, keys=KeyRing(MAKER.AES_KEY)) == h


@pytest.mark.parametrize("tier_codec", ["none", "zstd-shuffle"])
async def test_version_2_records_are_served_by_a_file_tier(tmp_path: Path, tier_codec: str) -> None:
    """Each fixture placed where its key's record lives is served (the in-place read of a ``none``
    tier expects a version 3 header, finds another and falls back to decoding): found, not damage,
    and left where it is."""
    plain = tier_at(tmp_path / "kv", codec=tier_codec)
    sealed = tier_at(tmp_path / "kv", codec=tier_codec, encryption_key_file=str(aes_key_file(tmp_path)))
    for tier in (plain, sealed):
        await tier.open()
    try:
        for i, (name, _codec, is_sealed) in enumerate(MAKER.RECORDS):
            key = MAKER.key(i)
            assert key == make_key(key[:32], FULL)
            path = Path(plain.path(key))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes((V2 / f"{name}.tkv").read_bytes())
            tier = sealed if is_sealed else plain
            out = torch.zeros((1, BB), dtype=torch.uint8)
            assert await tier.get(FULL, [key], out) == [True], name
            assert out[0].numpy().tobytes() == MAKER.block(i), name
            assert path.exists()
        for tier in (plain, sealed):
            assert not any(k.startswith("corrupt") for k in tier.counters), tier.counters
    finally:
        for tier in (plain, sealed):
            await tier.close()


async def test_verify_and_inspect_take_both_versions(tmp_path: Path) -> None:
    tier = tier_at(tmp_path, codec="none")
    await tier.open()
    try:
        assert await tier.put(FULL, [make_key(bytes([7]) * 32, FULL)], blocks(1, 7))
        for i, (name, _codec, _sealed) in enumerate(MAKER.RECORDS):
            path = Path(tier.path(MAKER.key(i)))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes((V2 / f"{name}.tkv").read_bytes())
    finally:
        await tier.close()
    report = await verify_tier(f"file://{tmp_path}", keys=KeyRing(MAKER.AES_KEY))
    assert (report.checked, report.ok, report.corrupt, report.authenticated) == (5, 5, [], 1)
    inspected = await inspect_tier(f"file://{tmp_path}")
    (ns,) = inspected.namespaces
    group = next(g for g in ns.groups if g.group == FULL)
    assert sum(g.records for g in ns.groups) == 5
    assert (group.records, group.bad_headers, group.encrypted) == (5, 0, 1)
    assert group.codecs == {"none": 3, "zstd": 1, "zstd-shuffle": 1}


# ---- damage and newer versions through a tier ---------------------------------------------------------
@pytest.mark.parametrize("where", ["padding", "payload", "trailer"])
async def test_a_damaged_version_3_record_is_a_counted_miss_and_removed(tmp_path: Path, where: str) -> None:
    tier = tier_at(tmp_path, codec="none")
    await tier.open()
    try:
        key, data = make_key(bytes([1]) * 32, FULL), blocks(1, 1)
        assert await tier.put(FULL, [key], data) == [True]
        path = Path(tier.path(key))
        record = bytearray(path.read_bytes())
        assert read_header(bytes(record)).header_len == PAGE_ALIGN
        at = {"padding": PAGE_ALIGN - 1, "payload": PAGE_ALIGN + 100, "trailer": len(record) - 1}[where]
        record[at] ^= 0x04
        path.write_bytes(bytes(record))
        out = torch.zeros_like(data)
        assert await tier.get(FULL, [key], out) == [False]
        reason = "version" if where == "padding" else "checksum"
        assert tier.counters["corrupt"] == 1 and tier.counters[f"corrupt_{reason}"] == 1
        assert not path.exists()
    finally:
        await tier.close()


def _as_version(record: bytes, version: int) -> bytes:
    buf = bytearray(record)
    struct.pack_into("<H", buf, 8, version)
    end = len(buf) - TRAILER_LEN
    buf[end:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(buf[:end])))
    return bytes(buf)


async def test_a_version_4_record_is_refused_and_left_in_place(tmp_path: Path) -> None:
    """A newer tierkv's record sharing the storage is a miss counted apart, never removed: only an
    intact one (its trailer checks); a version field changed by damage is damage."""
    tier = tier_at(tmp_path, codec="none")
    await tier.open()
    try:
        ks = [make_key(bytes([i]) * 32, FULL) for i in (2, 3)]
        data = blocks(2, 2)
        assert await tier.put(FULL, ks, data) == [True, True]
        newer = Path(tier.path(ks[0]))
        newer.write_bytes(_as_version(newer.read_bytes(), 4))
        damaged = Path(tier.path(ks[1]))
        flipped = bytearray(damaged.read_bytes())
        flipped[8] = 4  # the version's bits changed, the checksum left as it was
        damaged.write_bytes(bytes(flipped))
        out = torch.zeros_like(data)
        assert await tier.get(FULL, ks, out) == [False, False]
        assert tier.counters["newer_version_misses"] == 1
        assert tier.counters["corrupt"] == 1 and tier.counters["corrupt_version"] == 1
        assert newer.exists() and not damaged.exists()
        with pytest.raises(CorruptRecord) as exc:
            decode_record(newer.read_bytes(), key=ks[0], fingerprint=FP, max_raw_bytes=BB)
        assert exc.value.reason == "newer"
    finally:
        await tier.close()


async def test_verify_repair_keeps_a_newer_versions_record_and_removes_a_damaged_one(tmp_path: Path) -> None:
    tier = tier_at(tmp_path, codec="none")
    await tier.open()
    try:
        ks = [make_key(bytes([i]) * 32, FULL) for i in (4, 5)]
        assert await tier.put(FULL, ks, blocks(2, 4)) == [True, True]
        newer, damaged = (Path(tier.path(k)) for k in ks)
    finally:
        await tier.close()
    newer.write_bytes(_as_version(newer.read_bytes(), 4))
    flipped = bytearray(damaged.read_bytes())
    flipped[8] = 4
    damaged.write_bytes(bytes(flipped))
    report = await verify_tier(f"file://{tmp_path}", repair=True)
    assert (report.checked, report.ok, report.newer) == (2, 1, 1)
    assert [p.reason for p in report.corrupt] == ["version"] and report.removed == [report.corrupt[0].path]
    assert newer.exists() and not damaged.exists()


# ---- the C module and the Python fallback --------------------------------------------------------------
IMPLS = ["native", "python"]


def _impl(name: str) -> ModuleType:
    assert batchio.native_error() is None, f"the C module did not build: {batchio.native_error()}"
    return batchio.implementation(name)


def _records() -> list[tuple[bytes, np.ndarray, list[bytes | memoryview]]]:
    """(key, block, record pieces): a plain and a sealed ``none`` record of a page-multiple, one
    of an odd length, one ``zstd-shuffle``."""
    ring = KeyRing(bytes(range(32)))
    rng = np.random.default_rng(5)
    out = []
    for i, (n, codec, keys) in enumerate([(64 << 10, "none", None), (64 << 10, "none", ring),
                                          (5000, "none", None), (64 << 10, "zstd-shuffle", None)]):
        key = make_key(bytes([i]) * 32, FULL)
        block = rng.integers(0, 256, n, dtype=np.uint8)
        parts = encode_record_parts(key=key, fingerprint=FP, payload=block, codec=codec, keys=keys)
        out.append((key, block, [bytes(p) for p in parts]))
    return out


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_c_and_python_write_the_same_bytes_and_read_each_others(tmp_path: Path, direct: bool) -> None:
    records = _records()
    for writer in IMPLS:
        items = [(str(tmp_path / writer / f"r{i}"), str(tmp_path / writer / f".r{i}{TEMP_MARK}test"), parts)
                 for i, (_, _, parts) in enumerate(records)]
        sizes, _, _ = _impl(writer).write_batch(items, direct=direct, direct_min=4096)
        assert sizes == [sum(len(p) for p in parts) for _, _, parts in records]
    for i, (_, _, parts) in enumerate(records):
        whole = b"".join(parts)
        assert (tmp_path / "native" / f"r{i}").read_bytes() == whole
        assert (tmp_path / "python" / f"r{i}").read_bytes() == whole
    ring = KeyRing(bytes(range(32)))
    for reader in IMPLS:
        io = _impl(reader)
        for writer in IMPLS:
            paths = [str(tmp_path / writer / f"r{i}") for i in range(len(records))]
            bufs = [bytearray(len(b"".join(parts)) + 1) for _, _, parts in records]
            got = io.read_batch(paths, bufs, direct=direct)
            for (key, block, parts), buf, n in zip(records, bufs, got, strict=True):
                assert n == len(b"".join(parts))
                decoded = decode_record(memoryview(buf)[:n], key=key, fingerprint=FP,
                                        max_raw_bytes=block.size, keys=ring)
                assert decoded.tobytes() == block.tobytes()
            # the in-place read of the plain page-multiple record: header, the row, trailer
            key, block, _ = records[0]
            expected = none_header(key=key, fingerprint=FP, raw_len=block.size)
            head, tail = bytearray(len(expected)), bytearray(TRAILER_LEN + 1)
            row = np.zeros(block.size, np.uint8)
            (n,) = io.read_batch([paths[0]], [[head, row, tail]], direct=direct)
            assert len(expected) == PAGE_ALIGN and none_parts_match(expected, head, row, tail, n)
            assert row.tobytes() == block.tobytes()


# ---- direct reads (a file tier's direct_reads) ----------------------------------------------------------
def _aligned_rows(n: int) -> torch.Tensor:
    """``n`` rows of a block each, in an anonymous mapping: every row starts on a page."""
    return torch.frombuffer(mmap.mmap(-1, n * BB), dtype=torch.uint8).reshape(n, BB)


def _cached(path: Path) -> bool | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return page_cached(fd, path.stat().st_size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct_reads", [True, False])
async def test_direct_reads_land_cold_records_in_aligned_rows_past_the_page_cache(
        tmp_path: Path, direct_reads: bool) -> None:
    """With ``direct_reads`` a cold ``none`` record is read with O_DIRECT straight into its
    page-aligned row: served and verified, and the page cache holds none of it afterwards (a
    buffered read leaves it there). A row off a page boundary, a version 2 record and a damaged
    record take the ordinary path: served, served, a counted miss."""
    tier = tier_at(tmp_path, codec="none", direct_io=False, direct_reads=direct_reads)
    await tier.open()
    try:
        ks = [make_key(bytes([40 + i]) * 32, FULL) for i in range(4)]
        data = blocks(4, 40)
        assert await tier.put(FULL, ks, data) == [True] * 4
        paths = [Path(tier.path(k)) for k in ks]
        v2_key = MAKER.key(0)
        v2_path = Path(tier.path(v2_key))
        v2_path.parent.mkdir(parents=True, exist_ok=True)
        v2_path.write_bytes((V2 / "none.tkv").read_bytes())
        damaged = bytearray(paths[3].read_bytes())
        damaged[PAGE_ALIGN + 7] ^= 0x20
        paths[3].write_bytes(bytes(damaged))
        for p in [*paths, v2_path]:
            evict(p)
            assert _cached(p) is False
        out = _aligned_rows(4)
        assert await tier.get(FULL, ks[:3], out[:3]) == [True] * 3
        assert torch.equal(out[:3], data[:3])
        assert [_cached(p) for p in paths[:3]] == [not direct_reads] * 3
        v2_out = _aligned_rows(1)
        assert await tier.get(FULL, [v2_key], v2_out) == [True]
        assert v2_out[0].numpy().tobytes() == MAKER.block(0)
        assert await tier.get(FULL, [ks[3]], out[3:]) == [False]
        assert tier.counters["corrupt_checksum"] == 1 and not paths[3].exists()
        evict(paths[0])
        shifted = torch.frombuffer(mmap.mmap(-1, 2 * BB), dtype=torch.uint8)[64:64 + BB].reshape(1, BB)
        assert await tier.get(FULL, ks[:1], shifted) == [True]
        assert torch.equal(shifted[0], data[0]) and _cached(paths[0]) is True
    finally:
        await tier.close()
