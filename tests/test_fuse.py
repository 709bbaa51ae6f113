"""The ``file://`` tier on a real FUSE network file system (SeaweedFS's ``weed mount``): two
processes writing and restoring through it, its daemon stopped (a hung mount) and killed (a dead
one) while a store uses it. Needs /dev/fuse and fuse3 (``scripts/dev`` installs it as root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import torch
from fusemount import WeedMount, missing
from helpers import blocks, hashes
from seaweed import seaweed_server

from tierkv import GroupSpec, Layout, Lookup, TieredStore
from tierkv.tools.audit import verify_tier

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

BB = 128 << 10
LAYOUT = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])

WRITER = """
import sys, anyio, torch
sys.path.insert(0, {tests!r})
from helpers import blocks, hashes
from tierkv import TieredStore
cfg = {cfg}
cfg["layout"] = {layout}
async def main():
    async with TieredStore(cfg) as store:
        await store.put(0, hashes({n}, doc={doc}), blocks({n}, {bb}, seed={doc}))
        await store.flush()
        st = store.stats().tiers[1]
        assert st.stores == {n}, st
anyio.run(main)
"""


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[WeedMount]:
    why = missing()
    if why:
        pytest.skip(f"no FUSE here: {why}")
    m = WeedMount(seaweed_server(), tmp_path / "mnt")
    m.start()
    try:
        yield m
    finally:
        m.close()


def cfg(root: Path, **tier: object) -> dict[str, object]:
    return {"layout": LAYOUT, "namespace": "fuse", "max_pending_s": 3, "tiers": [
        {"kind": "cpu", "slots": {0: 64}},
        {"kind": "fsspec", "url": f"file://{root}", "open_timeout_s": 5, "close_timeout_s": 3,
         "health_interval_s": 0.5, **tier}]}


def write_in_another_process(root: Path, n: int, doc: int) -> None:
    c = cfg(root)
    del c["layout"]
    layout = f"__import__('tierkv').Layout.model_validate({LAYOUT.model_dump()!r})"
    code = WRITER.format(tests=str(Path(__file__).parent), cfg=json.dumps(c), layout=layout,
                         n=n, doc=doc, bb=BB)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


async def restore(store: TieredStore, hs: list[bytes], deadline_s: float = 30) -> tuple[Lookup, torch.Tensor]:
    rid = f"r{time.monotonic_ns()}"
    with anyio.fail_after(deadline_s):
        while (found := store.lookup_prefix(hs, request_id=rid)).state is Lookup.PENDING:
            await anyio.sleep(0.005)
    out = torch.zeros(found.blocks, BB, dtype=torch.uint8)
    if found.state is Lookup.HIT and found.blocks:
        await store.get(0, hs[:found.blocks], out, request_id=rid)
    store.release(rid)
    return found.state, out


async def test_two_processes_write_and_restore_through_a_fuse_mount(mount: WeedMount) -> None:
    root = mount.path / "kv"
    write_in_another_process(root, 24, doc=1)
    hs, data = hashes(24, doc=1), blocks(24, BB, seed=1)
    async with TieredStore(cfg(root)) as store:
        state, out = await restore(store, hs)
        assert state is Lookup.HIT and torch.equal(out, data)
        backend = store.stats().tiers[1].backend
        assert backend.get("read_errors", 0) == 0
        await store.put(0, hashes(8, doc=2), blocks(8, BB, seed=2))
        await store.flush()
    report = await verify_tier(f"file://{root}")
    assert report.ok == 32 and not report.corrupt and not report.errors


async def test_a_hung_mount_never_holds_lookups_puts_or_close(mount: WeedMount) -> None:
    root = mount.path / "kv"
    hs, data = hashes(16, doc=3), blocks(16, BB, seed=3)
    async with TieredStore(cfg(root)) as store:
        await store.put(0, hs, data)
        await store.flush()
    store = TieredStore(cfg(root))
    await store.open()
    try:
        mount.freeze()
        t0 = time.monotonic()
        state, out = await restore(store, hs, deadline_s=10)  # answers by max_pending_s at the latest
        assert time.monotonic() - t0 < 3 + 2
        if state is Lookup.HIT:  # what the page cache still held
            assert torch.equal(out, data[:out.shape[0]])
        await store.put(0, hashes(8, doc=4), blocks(8, BB, seed=4))  # the primary takes them at once
        assert store.lookup_prefix(hashes(8, doc=4)).state is Lookup.HIT
    finally:
        t1 = time.monotonic()
        await store.close()
        closing = time.monotonic() - t1
        mount.thaw()
    assert closing < 3 + 5, f"close took {closing:.1f} s on a hung mount"
    st = store.stats().tiers[1]
    assert st.stores_abandoned + st.stores + st.stores_requeue_dropped >= 8 or st.stores_requeued >= 8


async def test_a_killed_mount_is_written_again_once_it_is_mounted_again(mount: WeedMount) -> None:
    root = mount.path / "kv"
    first, later = hashes(8, doc=5), hashes(12, doc=6)
    async with TieredStore(cfg(root)) as store:
        await store.put(0, first, blocks(8, BB, seed=5))
        await store.flush()
        mount.kill()  # ENOTCONN from now on
        for i in range(0, 12, 3):  # several batches fail: the tier is down, their blocks wait
            await store.put(0, later[i:i + 3], blocks(12, BB, seed=6)[i:i + 3])
            await store.flush()
        st = store.stats().tiers[1]
        assert st.up == 0 and st.stores_requeued >= 3, st
        state, _ = await restore(store, hashes(4, doc=99), deadline_s=5)
        assert state is Lookup.MISS  # no hang, no PENDING forever
        mount.remount()
        with anyio.fail_after(30):
            while (st := store.stats().tiers[1]).up == 0 or st.stores < 8 + 12:
                await anyio.sleep(0.1)
    async with TieredStore(cfg(root)) as fresh:  # what waited for the mount is there
        state, out = await restore(fresh, later)
        assert state is Lookup.HIT and torch.equal(out, blocks(12, BB, seed=6))


def test_a_mount_leaves_nothing_in_the_temporary_directory(tmp_path: Path) -> None:
    why = missing()
    if why:
        pytest.skip(f"no FUSE here: {why}")
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    sockets = set(Path("/tmp").glob("seaweedfs-mount-*.sock"))
    m = WeedMount(seaweed_server(), tmp_path / "mnt", env={**os.environ, "TMPDIR": str(tmpdir)})
    m.start()
    try:
        data = os.urandom(4 << 20)
        (m.path / "f").write_bytes(data)
        assert (m.path / "f").read_bytes() == data
    finally:
        m.close()
    assert list(tmpdir.iterdir()) == []
    assert not m.cache_dir.exists()
    assert set(Path("/tmp").glob("seaweedfs-mount-*.sock")) <= sockets
