"""Loads during a burst of stores, through the public API: restore latency against the same
restores with no store running, and with a plain writer of the same bytes running, in one run.

    python bench/lanes.py [--block-kib 256] [--restores 200] [--rate-mib 256] [--rounds 3] [--json]

A store holds ``--restores`` small prefixes (8 blocks each) on a ``file://`` tier, out of its
primary; each timed restore is ``get`` of one prefix (page cache warm, as a busy node's is).

- ``idle``: the restores alone.
- ``raw``: the same restores while a thread does what any store burst costs the machine, without
  tierkv: copy 64 blocks (as ``put`` copies into the pool) and write them as 64 files, at
  ``--rate-mib`` MiB/s. The baseline: what the machine itself does to the restores.
- ``burst``: the same restores while a task of the same event loop ``put`` s 64 new blocks at
  ``--rate-mib`` MiB/s; every block cascades to the same tier.

Both bursts run until the last restore ends. Printed: p50 and p99 of each, burst/idle (the
issue's target: p99 at most 1.2x), burst/raw (what tierkv adds to the machine's own contention)
and the rate each burst reached. Medians over ``--rounds``.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from typing import Any

import anyio
import torch

from tierkv import GroupSpec, Layout, TieredStore

PREFIX = 8
BATCH = 64


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def raw_writer(where: str, block: int, period: float, ran: list[int], stop: threading.Event) -> None:
    """Copy and write ``BATCH`` blocks as files every ``period`` seconds, until ``stop``."""
    src = torch.randint(0, 256, (BATCH, block), dtype=torch.uint8)
    dst = torch.empty_like(src)
    n = 0
    t = time.perf_counter()
    while not stop.is_set():
        dst.copy_(src)
        rows = dst.numpy()
        for i in range(BATCH):
            fd = os.open(f"{where}/r{n + i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, rows[i])
            finally:
                os.close(fd)
        n += BATCH
        ran[0] = n
        t += period
        time.sleep(max(0.0, t - time.perf_counter()))


async def timed_restores(store: TieredStore, prefixes: list[list[bytes]], out: torch.Tensor) -> list[float]:
    lat: list[float] = []
    for hs in prefixes:
        store.engine.clear()  # the prefix is read from the tier, not the pool
        t0 = time.perf_counter()
        await store.get(0, hs, out)
        lat.append(time.perf_counter() - t0)
    return lat


async def one_round(block: int, restores: int, rate_mib: int) -> dict[str, float]:
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=block)])
    period = BATCH * block / (rate_mib << 20)  # seconds per batch
    with tempfile.TemporaryDirectory(prefix="tkv-lanes-") as d:
        def cfg(slots: int) -> dict[str, Any]:
            return {"layout": layout, "namespace": "lanes", "max_concurrent_requests": 4,
                    "tiers": [{"kind": "cpu", "slots": {0: slots}},
                              {"kind": "fsspec", "url": f"file://{d}/tier"}]}

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
            for mode in ("idle", "raw", "burst"):
                done = anyio.Event()
                stop = threading.Event()
                ran = [0]

                async def burst(done: anyio.Event, ran: list[int]) -> None:
                    src = torch.randint(0, 256, (BATCH, block), dtype=torch.uint8)
                    t = time.perf_counter()
                    while not done.is_set():
                        await store.put(0, [f"b{ran[0] + i}".encode() for i in range(BATCH)], src)
                        ran[0] += BATCH
                        t += period
                        await anyio.sleep(max(0.0, t - time.perf_counter()))

                raw_dir = tempfile.mkdtemp(dir=d)
                writer = threading.Thread(target=raw_writer, args=(raw_dir, block, period, ran, stop),
                                          daemon=True)
                try:
                    async with anyio.create_task_group() as tg:
                        if mode == "burst":
                            tg.start_soon(burst, done, ran)
                        elif mode == "raw":
                            writer.start()
                        if mode != "idle":
                            await anyio.sleep(0.05)
                        t0, n0 = time.perf_counter(), ran[0]
                        lat = await timed_restores(store, prefixes, out)
                        rate = (ran[0] - n0) * block / (time.perf_counter() - t0) / (1 << 20)
                        done.set()
                finally:  # the writer ends before its directory goes, Ctrl-C included
                    stop.set()
                    if writer.is_alive():
                        writer.join()
                if mode != "idle":
                    result[f"{mode}_mib_s"] = rate
                result[f"{mode}_p50_ms"] = pct(lat, 0.5) * 1e3
                result[f"{mode}_p99_ms"] = pct(lat, 0.99) * 1e3
            await store.flush()
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-kib", type=benchmain.positive, default=256)
    ap.add_argument("--restores", type=benchmain.positive, default=200)
    ap.add_argument("--rate-mib", type=benchmain.positive, default=256,
                    help="MiB/s either burst stores (as long as the restores run)")
    ap.add_argument("--rounds", type=benchmain.positive, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rounds = [anyio.run(one_round, a.block_kib << 10, a.restores, a.rate_mib) for _ in range(a.rounds)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    for q in ("p50", "p99"):
        med[f"{q}_ratio"] = statistics.median(r[f"burst_{q}_ms"] / r[f"idle_{q}_ms"] for r in rounds)
        med[f"{q}_vs_raw"] = statistics.median(r[f"burst_{q}_ms"] / r[f"raw_{q}_ms"] for r in rounds)
    if a.json:
        print(json.dumps({"block_kib": a.block_kib, "restores": a.restores, **med}))
    else:
        print(f"restores of {PREFIX} x {a.block_kib} KiB, median of {a.rounds} rounds")
        for mode in ("idle", "raw", "burst"):
            rate = f"  ({med[f'{mode}_mib_s']:.0f} MiB/s stored)" if mode != "idle" else ""
            print(f"  {mode:5}: p50 {med[f'{mode}_p50_ms']:.2f} ms  p99 {med[f'{mode}_p99_ms']:.2f} ms{rate}")
        print(f"  burst/idle: p50 {med['p50_ratio']:.2f}x  p99 {med['p99_ratio']:.2f}x")
        print(f"  burst/raw : p50 {med['p50_vs_raw']:.2f}x  p99 {med['p99_vs_raw']:.2f}x")
    return 0


if __name__ == "__main__":
    benchmain.run(main)
