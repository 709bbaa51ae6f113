"""Loads during a burst of stores, through the public API: restore latency against the same
restores with no store running, in the same run.

    python bench/lanes.py [--block-kib 256] [--restores 200] [--burst-mib 512] [--rounds 3] [--json]

A store holds ``--restores`` small prefixes (8 blocks each) on a ``file://`` tier, out of its
primary; each timed restore is ``get`` of one prefix (page cache warm, as a busy node's is).
``idle``: the restores alone; ``burst``: the same restores while other tasks ``put`` a
``--burst-mib`` burst of new blocks (every one cascaded to the same tier). Printed: p50 and p99 of
each, and burst/idle (the issue's target: p99 at most 1.2x). Medians over ``--rounds``.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import anyio
import torch

from tierkv import GroupSpec, Layout, TieredStore

PREFIX = 8


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one_round(block: int, restores: int, burst_mib: int) -> dict[str, float]:
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=block)])
    burst_blocks = max(PREFIX, (burst_mib << 20) // block)
    with tempfile.TemporaryDirectory(prefix="tkv-lanes-") as d:
        def cfg(slots: int) -> dict[str, Any]:
            return {"layout": layout, "namespace": "lanes", "max_concurrent_requests": 4,
                    "tiers": [{"kind": "cpu", "slots": {0: slots}},
                              {"kind": "fsspec", "url": f"file://{d}"}]}

        prefixes = [[f"p{r}-{i}".encode() for i in range(PREFIX)] for r in range(restores)]
        data = torch.randint(0, 256, (PREFIX, block), dtype=torch.uint8)
        async with TieredStore(cfg(PREFIX * 4)) as store:
            for hs in prefixes:
                await store.put(0, hs, data)
            await store.flush()
        out = torch.empty(PREFIX, block, dtype=torch.uint8)
        result: dict[str, float] = {}
        async with TieredStore(cfg(PREFIX * 4 + 256)) as store:
            for hs in prefixes:  # warm the page cache and the presence cache
                await store.get(0, hs, out)
            for mode in ("idle", "burst"):
                lat: list[float] = []
                done = anyio.Event()

                async def burst(done: anyio.Event, tag: str) -> None:
                    src = torch.randint(0, 256, (64, block), dtype=torch.uint8)
                    n = 0
                    while not done.is_set() and n < burst_blocks:
                        await store.put(0, [f"b{tag}{n + i}".encode() for i in range(64)], src)
                        n += 64
                        await anyio.sleep(0.005)  # the puts' own copies take turns with the restores

                async with anyio.create_task_group() as tg:
                    if mode == "burst":
                        tg.start_soon(burst, done, mode)
                        await anyio.sleep(0.05)
                    for hs in prefixes:
                        store.engine.clear()  # the prefix is read from the tier, not the pool
                        t0 = time.perf_counter()
                        await store.get(0, hs, out)
                        lat.append(time.perf_counter() - t0)
                    done.set()
                result[f"{mode}_p50_ms"] = pct(lat, 0.5) * 1e3
                result[f"{mode}_p99_ms"] = pct(lat, 0.99) * 1e3
            await store.flush()
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-kib", type=benchmain.positive, default=256)
    ap.add_argument("--restores", type=benchmain.positive, default=200)
    ap.add_argument("--burst-mib", type=benchmain.positive, default=512)
    ap.add_argument("--rounds", type=benchmain.positive, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rounds = [anyio.run(one_round, a.block_kib << 10, a.restores, a.burst_mib) for _ in range(a.rounds)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    med["p50_ratio"] = statistics.median(r["burst_p50_ms"] / r["idle_p50_ms"] for r in rounds)
    med["p99_ratio"] = statistics.median(r["burst_p99_ms"] / r["idle_p99_ms"] for r in rounds)
    if a.json:
        print(json.dumps({"block_kib": a.block_kib, **med}))
    else:
        print(f"restores of {PREFIX} x {a.block_kib} KiB, median of {a.rounds} rounds")
        print(f"  idle : p50 {med['idle_p50_ms']:.2f} ms  p99 {med['idle_p99_ms']:.2f} ms")
        print(f"  burst: p50 {med['burst_p50_ms']:.2f} ms  p99 {med['burst_p99_ms']:.2f} ms")
        print(f"  burst/idle: p50 {med['p50_ratio']:.2f}x  p99 {med['p99_ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    benchmain.run(main)
