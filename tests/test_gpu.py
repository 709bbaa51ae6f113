"""The device copy path (tierkv.transfer) and slot pools on a device: on CUDA where there is one.

Every test runs on the CPU too (the same code path minus streams), so the logic is checked on any
machine; the ``cuda`` cases need a GPU and are what ``scripts/dev gpu-check`` runs there. Only
torch, numpy, pydantic and pytest are needed (``scripts/dev gpu-check`` runs this file on a bare
GPU machine).
"""

from __future__ import annotations

import pytest
import torch

from tierkv.blocks.pool import SlotPool
from tierkv.layout import GroupSpec, Layout
from tierkv.transfer import Copy, DeviceTransfer

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])
DEVICES = ["cpu", CUDA]


def kv(n: int, page: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (n, page), dtype=torch.int8, generator=g).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_store_then_load_round_trips_pages_through_pool_rows(device: str) -> None:
    """Two layers' pages of 6 engine blocks go into pool rows (each layer at its own offset in the
    row), then come back into other engine blocks unchanged."""
    page = 4096
    layers = [kv(16, page, device, seed=i) for i in range(2)]
    pool = torch.zeros((8, 2 * page), dtype=torch.uint8)
    t = DeviceTransfer(device)
    blocks = torch.tensor([3, 1, 4, 9, 2, 6])
    rows = torch.tensor([7, 0, 5, 2, 3, 1])
    t.store(1, [Copy(layer, blocks, page, pool, rows, i * page) for i, layer in enumerate(layers)])
    t.wait({1})
    (done,) = t.finished()
    assert done.job_id == 1 and done.nbytes == 2 * 6 * page and done.seconds >= 0
    for i, layer in enumerate(layers):
        assert torch.equal(pool[rows, i * page:(i + 1) * page], layer[blocks].cpu().view(torch.uint8))
    fresh = [torch.zeros_like(layer) for layer in layers]
    dst = torch.tensor([0, 2, 5, 8, 11, 15])
    t.load(2, [Copy(f, dst, page, pool, rows, i * page) for i, f in enumerate(fresh)])
    t.wait({2})
    assert [d.job_id for d in t.finished()] == [2]
    for f, layer in zip(fresh, layers, strict=True):
        assert torch.equal(f[dst], layer[blocks])
    assert t.pending == 0


@pytest.mark.parametrize("device", DEVICES)
def test_jobs_follow_the_compute_stream_and_finish_in_order(device: str) -> None:
    """KV written on the compute stream just before a store is what gets stored, and several jobs
    are reported once each, in submission order."""
    page = 1 << 16
    cache = kv(64, page, device)
    pool = torch.zeros((64, page), dtype=torch.uint8)
    t = DeviceTransfer(device)
    fresh = kv(8, page, device, seed=7)
    cache[:8] = fresh  # queued on the compute stream (CUDA) right before the store
    ids = list(range(10, 14))
    for j in ids:
        rows = torch.arange((j - 10) * 8, (j - 9) * 8)
        t.store(j, [Copy(cache, torch.arange(8), page, pool, rows)])
    t.wait(set(ids))
    seen = [d.job_id for d in t.finished()]
    assert seen == ids
    assert t.finished() == []
    for j in range(4):
        assert torch.equal(pool[j * 8:(j + 1) * 8], fresh.cpu().view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_a_slot_pool_on_the_device_copies_rows_batched(device: str) -> None:
    pool = SlotPool(0, 4096, 16, device=device)
    assert pool.tensor.device.type == device
    keys = [i.to_bytes(8, "big") for i in range(6)]
    got = pool.allocate(keys)
    assert got is not None
    src = torch.randint(0, 256, (6, 4096), dtype=torch.uint8)
    pool.write(got[0], src)
    pool.mark_ready(got[0])
    out = torch.empty_like(src)
    pool.read(got[0], out)
    assert torch.equal(out, src)
    scattered = [got[0][i] for i in (5, 0, 3)]
    part = torch.empty((3, 4096), dtype=torch.uint8, device=device)
    pool.read(scattered, part)
    assert torch.equal(part.cpu(), src[[5, 0, 3]])
    assert pool.problems() == []


@pytest.mark.parametrize("device", DEVICES)
def test_a_store_with_a_device_primary_round_trips(device: str) -> None:
    import anyio

    from tierkv.store import TieredStore

    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=8192)])
    cfg = {"layout": layout, "tiers": [{"kind": "device", "device": device, "slots": {0: 8}},
                                       {"kind": "memory"}]}
    data = torch.randint(0, 256, (12, 8192), dtype=torch.uint8)
    hashes = [i.to_bytes(16, "big") for i in range(12)]

    async def run() -> None:
        async with TieredStore(cfg) as store:
            for i in range(0, 12, 4):
                await store.put(0, hashes[i:i + 4], data[i:i + 4])
                await store.flush()
            out = torch.zeros_like(data)
            await store.get(0, hashes, out)  # 4 of them were evicted: they come from memory
            assert torch.equal(out, data)
            gpu_out = torch.zeros((4, 8192), dtype=torch.uint8, device=device)
            await store.get(0, hashes[8:], gpu_out)
            assert torch.equal(gpu_out.cpu(), data[8:])

    anyio.run(run)
