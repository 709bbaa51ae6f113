"""Loads never queue behind stores (#50): a file tier's writes have threads of their own.

With one pool of worker threads for both directions, a burst of stores (a cascade of a long
prefix) filled the threads' queue and a restore waited behind every write ahead of it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import anyio
import pytest
import torch
from helpers import FULL, blocks, hashes

from tierkv import GroupSpec, Layout, TieredStore
from tierkv.backends.fsspec._local import LocalDriver

BB = 4096
LAYOUT = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])


def config(directory: Path) -> dict[str, object]:
    return {"layout": LAYOUT, "namespace": "lanes", "max_concurrent_requests": 2,
            "tiers": [{"kind": "cpu", "slots": {FULL: 64}},
                      {"kind": "fsspec", "url": f"file://{directory}", "io_threads": 2}]}


@pytest.mark.anyio
async def test_a_restore_does_not_wait_for_stores_stuck_in_the_tier(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = hashes(8, doc=1), hashes(48, doc=2)
    data_old, data_new = blocks(8, BB, seed=1), blocks(48, BB, seed=2)
    async with TieredStore(config(tmp_path)) as store:
        await store.put(FULL, old, data_old)
        await store.flush()

    gate = threading.Event()
    stuck = threading.Semaphore(0)
    write_one = LocalDriver._write_one

    def slow_write(self: LocalDriver, path: str, data: object) -> None:
        stuck.release()
        gate.wait(30)  # every write thread is held here until the restore is done
        write_one(self, path, data)  # type: ignore[arg-type]

    monkeypatch.setattr(LocalDriver, "_write_one", slow_write)
    try:
        async with TieredStore(config(tmp_path)) as store:
            await store.put(FULL, new, data_new)  # cascades: writes that cannot end
            for _ in range(2):  # both write threads are busy, more writes queued behind them
                assert await anyio.to_thread.run_sync(stuck.acquire, True, 10)
            out = torch.empty(len(old), BB, dtype=torch.uint8)
            t0 = time.monotonic()
            with anyio.fail_after(10):
                await store.get(FULL, old, out)  # not in the primary: read from the file tier
            took = time.monotonic() - t0
            assert torch.equal(out, data_old)
            assert not gate.is_set()
            gate.set()
            await store.flush()
            assert store.stats().tiers[1].stores == len(new), "the stores went on once let through"
    finally:
        gate.set()
    assert took < 5
