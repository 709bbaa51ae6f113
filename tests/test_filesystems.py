"""The ``file://`` tier on the file systems users mount for it: tmpfs here (``/dev/shm``), which
refuses page-cache-only reads (``RWF_NOWAIT``), so every restore must still be served, once the
tier has noticed, said so once, and stopped asking."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import torch
from helpers import blocks, hashes

from tierkv import GroupSpec, Layout, Lookup, TieredStore
from tierkv.backends import localfs

pytestmark = pytest.mark.anyio

BB = 256 << 10
LAYOUT = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])


def _tmpfs_refuses_nowait(directory: str) -> bool:
    return localfs.probe_nowait(directory) is False


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm (tmpfs) on this machine")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="tierkv-test-") as d:
        yield Path(d)


def cfg(root: Path, **tier: object) -> dict[str, object]:
    return {"layout": LAYOUT, "namespace": "fs", "tiers": [
        {"kind": "cpu", "slots": {0: 16}}, {"kind": "fsspec", "url": f"file://{root}", **tier}]}


async def _restore(store: TieredStore, hs: list[bytes]) -> torch.Tensor:
    with anyio.fail_after(30):
        while (found := store.lookup_prefix(hs, request_id="r")).state is Lookup.PENDING:
            await anyio.sleep(0.002)
    assert found.state is Lookup.HIT and found.blocks == len(hs), found
    out = torch.empty(len(hs), BB, dtype=torch.uint8)
    await store.get(0, hs, out, request_id="r")
    store.release("r")
    return out


async def test_a_tmpfs_tier_serves_every_restore(shm_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tierkv")
    hs, data = hashes(8), blocks(8, BB, seed=1)
    async with TieredStore(cfg(shm_dir)) as store:
        await store.put(0, hs, data)
        await store.flush()
    caplog.clear()
    async with TieredStore(cfg(shm_dir)) as store:
        assert torch.equal(await _restore(store, hs), data)
        backend = store.stats().tiers[1].backend
        assert backend.get("read_errors", 0) == 0
        if _tmpfs_refuses_nowait(str(shm_dir)):
            assert backend.get("nowait_refused") == 1
            said = [r for r in caplog.records if "RWF_NOWAIT" in r.getMessage()]
            assert len(said) == 1, [r.getMessage() for r in said]  # once, not per record


async def test_a_refused_page_cache_read_falls_back_in_the_same_call(
        tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the probe at start could not tell (a read-only root, say) the first refused read is
    retried the blocking way at once: the restore is served, later reads never ask again."""
    if not _tmpfs_refuses_nowait(str(shm_dir)):
        pytest.skip("this kernel's tmpfs reads RWF_NOWAIT: nothing refuses it here")
    monkeypatch.setattr(localfs, "probe_nowait", lambda directory: None)
    hs, data = hashes(6, doc=3), blocks(6, BB, seed=3)
    async with TieredStore(cfg(shm_dir)) as store:
        await store.put(0, hs, data)
        await store.flush()
    async with TieredStore(cfg(shm_dir)) as store:
        assert torch.equal(await _restore(store, hs[:3]), data[:3])
        assert torch.equal(await _restore(store, hs), data)
        backend = store.stats().tiers[1].backend
        assert backend.get("nowait_refused") == 1 and backend.get("read_errors", 0) == 0
