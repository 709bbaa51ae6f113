"""Batched put/get between a source tensor and the CPU pool, as a ratio to ``Tensor.copy_``.

    python bench/pool_copy.py [--total-mib 128] [--repeats 7]

For each block size, the same bytes are copied by (a) ``dst.copy_(src)`` (the baseline: memcpy
speed on this machine), (b) ``SlotPool.write`` / ``SlotPool.read`` on scattered slots (the batched
index copy), and (c) ``TieredStore.put`` / ``TieredStore.get`` (keys, validation and slot
bookkeeping included). Figures are medians; ratios above 1 are faster than the baseline.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import statistics
import time
from collections.abc import Callable

import anyio
import torch

from tierkv import GroupSpec, Layout, TieredStore
from tierkv.blocks.pool import SlotPool


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


async def store_times(bb: int, n: int, repeats: int) -> tuple[float, float]:
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=bb)])
    cfg = {"layout": layout, "tiers": [{"kind": "cpu", "slots": {0: n}}]}
    src = torch.randint(0, 256, (n, bb), dtype=torch.uint8)
    out = torch.empty_like(src)
    puts, gets = [], []
    async with TieredStore(cfg) as store:
        for r in range(repeats + 1):
            hashes = [r.to_bytes(4, "big") + i.to_bytes(8, "big") for i in range(n)]
            store.engine.clear()
            t0 = time.perf_counter()
            await store.put(0, hashes, src)
            t1 = time.perf_counter()
            await store.get(0, hashes, out)
            t2 = time.perf_counter()
            if r:
                puts.append(t1 - t0)
                gets.append(t2 - t1)
        assert torch.equal(out, src)
    return statistics.median(puts), statistics.median(gets)


def pool_times(bb: int, n: int, repeats: int) -> tuple[float, float, float]:
    src = torch.randint(0, 256, (n, bb), dtype=torch.uint8)
    dst = torch.empty_like(src)
    base = timed(lambda: dst.copy_(src), repeats)
    pool = SlotPool(0, bb, n)
    got = pool.allocate([i.to_bytes(8, "big") for i in range(n)])
    assert got is not None
    slots = [got[0][i] for i in torch.randperm(n).tolist()]
    w = timed(lambda: pool.write(slots, src), repeats)
    r = timed(lambda: pool.read(slots, dst), repeats)
    assert torch.equal(dst, src)
    return base, w, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=benchmain.positive, default=128)
    ap.add_argument("--repeats", type=benchmain.positive, default=7)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.total_mib} MiB per batch,"
          f" median of {args.repeats}")
    print(f"{'block':>8} {'blocks':>7} {'copy_ GB/s':>10} | {'pool write':>10} {'pool read':>10} |"
          f" {'store put':>10} {'store get':>10}   (ratios to copy_)")
    for bb in (16 << 10, 256 << 10, 2 << 20):
        n = (args.total_mib << 20) // bb
        base, w, r = pool_times(bb, n, args.repeats)
        put, get = anyio.run(store_times, bb, n, args.repeats)
        gbs = n * bb / base / 1e9
        print(f"{bb >> 10:>6}Ki {n:>7} {gbs:>10.2f} | {base / w:>10.2f} {base / r:>10.2f} |"
              f" {base / put:>10.2f} {base / get:>10.2f}")

if __name__ == "__main__":
    benchmain.run(main)
