"""Direct I/O on local tiers: records of 64 KiB and more written with O_DIRECT are the same bytes
as buffered ones, read back exact (cold too), damage still caught, and a file system without
O_DIRECT still works."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from helpers import evict, extents

from tierkv import GroupSpec, Layout, Lookup, PrefixLookup, StoreConfig, TieredStore
from tierkv.backends.base import TierContext
from tierkv.backends.fsspec import FsspecTier, FsspecTierConfig
from tierkv.backends.fsspec._driver import WouldBlock
from tierkv.backends.fsspec._local import LocalSource
from tierkv.errors import BackendError
from tierkv.keys import make_key
from tierkv.records import directio
from tierkv.records._batchio_py import page_cached

pytestmark = pytest.mark.anyio

#: not a multiple of the alignment, with the record's header and trailer even less so
BB = 256 * 1024 + 6
SMALL = 4096


def ctx(block_bytes: int) -> TierContext:
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=block_bytes)])
    return TierContext(layout=layout, namespace="direct", fingerprint=layout.fingerprint("direct"))


def tier(root: Path, block_bytes: int = BB, **kw: Any) -> FsspecTier:
    return FsspecTier(FsspecTierConfig(url=f"file://{root}", **kw), ctx(block_bytes))


def keys(n: int) -> list[bytes]:
    return [make_key(i.to_bytes(32, "big"), 0) for i in range(n)]


def blocks(n: int, nbytes: int = BB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)


def record_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.tkv"))


def evict_from_page_cache(root: Path) -> None:
    """Drop the records' pages from the page cache (no root needed: clean pages of one file)."""
    for p in record_files(root):
        evict(p)


async def put_get(root: Path, n: int, data: torch.Tensor, nbytes: int = BB, evict: bool = True,
                  **kw: Any) -> tuple[list[bool], torch.Tensor, dict[str, int], dict[str, int]]:
    t = tier(root, nbytes, **kw)
    await t.open()
    try:
        assert await t.put(0, keys(n), data) == [True] * n
        t.used_bytes()
        wrote = dict(t.counters)
    finally:
        await t.close()
    if evict:
        evict_from_page_cache(root)
    t = tier(root, nbytes, **kw)
    await t.open()
    try:
        out = torch.zeros_like(data)
        found = await t.get(0, keys(n), out)
        t.used_bytes()
        return found, out, wrote, dict(t.counters)
    finally:
        await t.close()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    d = tmp_path / "tier"
    d.mkdir()
    if not directio.probe(str(d)):
        pytest.fail(f"{d} does not support O_DIRECT: these tests need a file system that does")
    return d


async def test_large_records_written_directly_read_back_cold_byte_exact(root: Path) -> None:
    data = blocks(6)
    found, out, wrote, _ = await put_get(root, 6, data)
    assert wrote.get("direct_writes") == 6
    assert found == [True] * 6 and torch.equal(out, data)
    # the files are exactly the records (the alignment padding was cut off)
    sizes = {p.stat().st_size for p in record_files(root)}
    assert len(sizes) == 1 and sizes.pop() % directio.ALIGN != 0


async def test_records_written_directly_lie_in_one_piece(root: Path) -> None:
    """Each record (whole blocks with O_DIRECT, its tail buffered) is one extent on disk, so a cold
    read of it is one request to the device, not two in two places."""
    t = tier(root)
    await t.open()
    try:
        assert await t.put(0, keys(6), blocks(6)) == [True] * 6
        t.used_bytes()  # gathers the driver's counts
        assert t.counters.get("direct_writes") == 6
    finally:
        await t.close()
    assert [extents(p) for p in record_files(root)] == [1] * 6


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
async def test_a_page_cache_pass_leaves_a_cold_record_unread(root: Path, native: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The first, non-blocking look at a cold record tells the tier to wait for it without having
    started to read it (which made the first pass do the device's work, one record at a time)."""
    if not native:
        monkeypatch.setenv("TIERKV_NATIVE", "0")
    t = tier(root)
    await t.open()
    try:
        assert await t.put(0, keys(1), blocks(1)) == [True]
    finally:
        await t.close()
    evict_from_page_cache(root)
    (path,) = record_files(root)
    with pytest.raises(WouldBlock):
        LocalSource(str(path), nowait=True).readinto([bytearray(BB + 4096)])
    await anyio.sleep(0.3)  # a readahead started would have landed by now
    fd = os.open(path, os.O_RDONLY)
    try:
        assert page_cached(fd, os.fstat(fd).st_size) is False
    finally:
        os.close(fd)


async def test_direct_and_buffered_records_are_the_same_bytes(tmp_path: Path, root: Path) -> None:
    data = blocks(3)
    other = tmp_path / "buffered"
    other.mkdir()
    for where, mode in ((root, "auto"), (other, False)):
        t = tier(where, direct_io=mode)
        await t.open()
        await t.put(0, keys(3), data)
        await t.close()
    a, b = record_files(root), record_files(other)
    assert [p.name for p in a] == [p.name for p in b]
    assert all(x.read_bytes() == y.read_bytes() for x, y in zip(a, b, strict=True))


async def test_flipped_byte_read_directly_is_a_counted_miss(root: Path) -> None:
    data = blocks(4)
    t = tier(root)
    await t.open()
    await t.put(0, keys(4), data)
    await t.close()
    victim = record_files(root)[1]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    victim.write_bytes(bytes(raw))
    short = record_files(root)[2]
    short.write_bytes(short.read_bytes()[:-100])
    evict_from_page_cache(root)
    t = tier(root)
    await t.open()
    try:
        out = torch.zeros_like(data)
        found = await t.get(0, keys(4), out)
        t.used_bytes()
        assert found == [True, False, False, True]
        assert torch.equal(out[0], data[0]) and torch.equal(out[3], data[3])
        assert t.counters.get("corrupt") == 2
        assert len(record_files(root)) == 2, "damaged records are removed"
    finally:
        await t.close()


async def test_small_records_stay_buffered(root: Path) -> None:
    data = blocks(4, SMALL)
    found, out, wrote, _ = await put_get(root, 4, data, SMALL)
    assert found == [True] * 4 and torch.equal(out, data)
    assert "direct_writes" not in wrote


async def test_direct_io_false_never_bypasses_the_page_cache(root: Path) -> None:
    data = blocks(3)
    found, out, wrote, _ = await put_get(root, 3, data, direct_io=False)
    assert found == [True] * 3 and torch.equal(out, data)
    assert "direct_writes" not in wrote


def _refuse_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if flags & directio.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", no_direct)


async def test_a_file_system_without_o_direct_falls_back_or_fails_clearly(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _refuse_direct(monkeypatch)
    data = blocks(2)
    found, out, wrote, _ = await put_get(root, 2, data)  # auto: buffered, silently
    assert found == [True, True] and torch.equal(out, data)
    assert "direct_writes" not in wrote and "direct_fallbacks" not in wrote
    t = tier(root, direct_io=True)
    with pytest.raises(BackendError, match="direct_io is true but this file system does not support"):
        await t.open()


async def test_a_direct_write_refused_after_the_probe_is_written_buffered(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python path's fallback (the C module's is tests/test_batchio.py's, on a file system that
    refuses O_DIRECT: the refusal here is a patched ``os.open``, which the C module does not call)."""
    monkeypatch.setenv("TIERKV_NATIVE", "0")
    t = tier(root)
    await t.open()
    try:
        _refuse_direct(monkeypatch)
        data = blocks(2)
        assert await t.put(0, keys(2), data) == [True, True]
        t.used_bytes()
        assert t.counters.get("direct_fallbacks") == 2 and "direct_writes" not in t.counters
        out = torch.zeros_like(data)
        assert await t.get(0, keys(2), out) == [True, True] and torch.equal(out, data)
    finally:
        await t.close()
    assert not [p for p in root.rglob("*") if ".tkvtmp-" in p.name]


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 3 * 4096 + 17])
def test_directio_write_across_chunks(tmp_path: Path, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(directio, "CHUNK_BYTES", 2 * directio.ALIGN)  # several chunks per file
    if not directio.probe(str(tmp_path)):
        pytest.fail("tmp_path does not support O_DIRECT")
    payload = os.urandom(size)
    parts = [payload[:size // 3], bytearray(payload[size // 3:size // 2]), memoryview(payload)[size // 2:]]
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | directio.O_DIRECT)
    try:
        assert directio.write_file(fd, parts) == size
    finally:
        os.close(fd)
    assert path.read_bytes() == payload


async def test_a_store_restores_a_prefix_written_directly(root: Path) -> None:
    """The public road: one store writes, a new one restores from the file tier, bytes exact."""
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])
    hs = [i.to_bytes(32, "big") for i in range(5)]
    data = blocks(5)
    cfg = StoreConfig(layout=layout, namespace="direct-store",
                      tiers=[{"kind": "cpu", "slots": {0: 8}}, {"kind": "fsspec", "url": f"file://{root}"}])
    async with TieredStore(cfg) as s:
        await s.put(0, hs, data)
        await s.flush()
        assert s.stats().tiers[1].backend.get("direct_writes") == 5
    evict_from_page_cache(root)
    async with TieredStore(cfg) as s:
        with anyio.fail_after(30):
            while (pl := s.lookup_prefix(hs, request_id="r")).state is Lookup.PENDING:
                await anyio.sleep(0.005)
        assert pl == PrefixLookup(5, Lookup.HIT)
        out = torch.zeros_like(data)
        await s.get(0, hs, out, request_id="r")
        assert torch.equal(out, data)


async def test_a_directory_the_probe_cannot_write_to_opens_buffered(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier this process may only read (a read-only mount, say) still opens with ``auto``."""
    def denied(directory: str) -> bool:
        raise PermissionError(errno.EACCES, "Permission denied", directory)

    data = blocks(2)
    t = tier(root)
    await t.open()
    await t.put(0, keys(2), data)
    await t.close()
    monkeypatch.setattr(directio, "probe", denied)
    t = tier(root)
    await t.open()
    try:
        out = torch.zeros_like(data)
        assert await t.get(0, keys(2), out) == [True, True] and torch.equal(out, data)
    finally:
        await t.close()
    with pytest.raises(BackendError, match="Permission denied"):
        await tier(root, direct_io=True).open()
