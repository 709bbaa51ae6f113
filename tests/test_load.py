"""Never wrong under load (#46): many tasks and a thread on one store at once, every byte checked.

The load (tests/loadgen.py) runs a few seconds per seed here; ``scripts/dev soak`` runs it for
minutes (``TIERKV_SOAK_S`` seconds per seed, ``TIERKV_SOAK_SEEDS`` seeds) before a release.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import anyio
import pytest
import torch
from loadgen import BB, FULL, block_of, chain, read_back, run_load

from tierkv import GroupSpec, Layout, StoreConfig, TieredStore

SECONDS = float(os.environ.get("TIERKV_SOAK_S", "12"))
SEEDS = [int(s) for s in os.environ.get("TIERKV_SOAK_SEEDS", "1,2").split(",")]


@pytest.mark.anyio
@pytest.mark.parametrize("seed", SEEDS)
async def test_a_store_under_load_never_hands_out_or_writes_another_keys_block(tmp_path: Path,
                                                                              seed: int) -> None:
    tally, put = await run_load(str(tmp_path), SECONDS, seed)
    assert not tally.errors, tally.errors[:5]
    assert not tally.wrong, f"{len(tally.wrong)} wrong blocks, e.g. {tally.wrong[:5]}"
    # the load did what it is for: evictions, promotions, misses, cancellations and a flaky tier
    for what in ("put", "get", "get-cancelled", "borrow", "commit", "commit-failed", "chaos", "lend"):
        assert tally.calls.get(what, 0) > 0, f"the load made no {what!r}: {tally.calls}"
    found = await read_back(str(tmp_path), put, tally)
    assert not tally.wrong, f"records read back as another key's block: {tally.wrong[:5]}"
    assert found > 0


@pytest.mark.anyio
async def test_concurrent_gets_under_eviction_pressure_return_their_own_blocks(tmp_path: Path) -> None:
    """Regression (#46): 8 tasks calling ``get`` of random stored keys through a 20-slot pool over
    a file tier got other keys' blocks ("every WRITING slot has an event" raised too) within
    seconds: an old promotion failing what it had left freed a newer promotion's slot mid-read."""
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])
    hs = chain(7, 300)

    def cfg() -> StoreConfig:
        return StoreConfig(layout=layout, namespace="x", max_concurrent_requests=4, tiers=[
            {"kind": "cpu", "slots": {FULL: 20}}, {"kind": "fsspec", "url": f"file://{tmp_path}"}])

    async with TieredStore(cfg()) as store:
        await store.put(FULL, hs, torch.stack([block_of(h, FULL) for h in hs]))
        await store.flush()
    wrong: list[str] = []
    calls = 0
    async with TieredStore(cfg()) as store:
        end = time.monotonic() + 6

        async def getter(seed: int) -> None:
            nonlocal calls
            rng = random.Random(seed)
            while time.monotonic() < end:
                pick = rng.sample(range(len(hs)), rng.randint(1, 6))
                out = torch.empty(len(pick), BB, dtype=torch.uint8)
                await store.get(FULL, [hs[i] for i in pick], out)
                calls += 1
                for j, i in enumerate(pick):
                    if not torch.equal(out[j], block_of(hs[i], FULL)):
                        wrong.append(hs[i].hex()[:12])

        async with anyio.create_task_group() as tg:
            for seed in range(8):
                tg.start_soon(getter, seed)
        assert store.check() == []
    assert calls > 100
    assert not wrong, f"{len(wrong)} gets returned another key's block"
