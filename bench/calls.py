"""Blocking batch calls through the public API, one call at a time, against plain loops of the same run.

    python bench/calls.py [--block-kib 256,1024] [--total-mib 512] [--call 38] [--rounds 5]
                          [--read-processes 0] [--json FILE]

How a batch-API user (an engine without vLLM's scheduler, LMCache's harness) drives a store:

- **store**: ``put`` of ``--call`` blocks, then ``flush`` (every record written to the ``file://``
  tier), call after call; timed to the end of an ``os.sync``;
- **cold load**: after ``echo 3 > /proc/sys/vm/drop_caches`` (root), a new store over the same
  directory serves, call after call, ``lookup_prefix`` then ``get`` into the caller's rows;
- **warm load**: the same once more, the records now in the page cache (a new store: its
  primary starts empty, so every block is read from its file again).

Baselines, same run, same rounds, 4 threads like the tier's ``io_depth``: **store**: a plain loop
writing each block to its own file (``open`` / ``write`` / ``close`` / ``os.replace``, buffered)
then ``os.sync``; **cold load**: a plain loop reading the tier's own record files, in the same
call order, into rows (``open`` / ``readinto`` / ``close``), after the same drop; **warm load**:
that loop again on the cached files. Ratios are
baseline time / tierkv time within a round (above 1: tierkv faster); figures are medians of the
rounds.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import torch

from tierkv import GroupSpec, Layout, TieredStore, make_key
from tierkv.tools.bench.tier import drop_caches

THREADS = 4


def config(root: str, block_bytes: int, rows: int, read_processes: int) -> dict[str, Any]:
    tier = {"kind": "fsspec", "url": f"file://{root}", "io_depth": THREADS, "read_concurrency": THREADS,
            "codec": "none", "read_processes": read_processes, "scan_on_open": False}
    cpu = {"kind": "cpu", "slots": {0: rows}, "shm_path": f"/dev/shm/tkcalls-{uuid.uuid4().hex[:8]}"}
    return {"layout": Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=block_bytes)]),
            "namespace": "calls", "tiers": [cpu, tier]}


def spans(n: int, call: int) -> list[tuple[int, int]]:
    return [(i, min(n, i + call)) for i in range(0, n, call)]


async def store(cfg: dict[str, Any], hashes: list[bytes], src: torch.Tensor,
                call: int) -> tuple[float, list[str]]:
    async with TieredStore(cfg) as s:
        t0 = time.perf_counter()
        for a, b in spans(len(hashes), call):
            await s.put(0, hashes[a:b], src[a:b])
            await s.flush()
        os.sync()
        dt = time.perf_counter() - t0
        paths = [s.tiers[1].path(make_key(h, 0)) for h in hashes]  # type: ignore[attr-defined]
    return dt, paths


async def load(cfg: dict[str, Any], hashes: list[bytes], out: torch.Tensor, call: int) -> float:
    async with TieredStore(cfg) as s:
        t0 = time.perf_counter()
        for c, (a, b) in enumerate(spans(len(hashes), call)):
            s.lookup_prefix(hashes[a:b], request_id=f"r{c}")
            await s.get(0, hashes[a:b], out[a:b], request_id=f"r{c}")
            s.release(f"r{c}")
        return time.perf_counter() - t0


def plain_store(root: str, src: torch.Tensor, call: int, pool: ThreadPoolExecutor) -> float:
    os.makedirs(root, exist_ok=True)

    def one(i: int) -> None:
        final = f"{root}/b{i}"
        with open(final + ".tmp", "wb") as f:
            f.write(src[i].numpy().data)
        os.replace(final + ".tmp", final)

    t0 = time.perf_counter()
    for a, b in spans(len(src), call):
        list(pool.map(one, range(a, b)))
    os.sync()
    return time.perf_counter() - t0


def plain_load(paths: list[str], rows: torch.Tensor, call: int, pool: ThreadPoolExecutor) -> float:
    def one(i: int) -> None:
        with open(paths[i], "rb", buffering=0) as f:
            f.readinto(rows[i].numpy().data)

    t0 = time.perf_counter()
    for a, b in spans(len(paths), call):
        list(pool.map(one, range(a, b)))
    return time.perf_counter() - t0


def one_size(block_kib: int, args: argparse.Namespace, pool: ThreadPoolExecutor) -> dict[str, Any]:
    block = block_kib << 10
    n = max(args.call, (args.total_mib << 20) // block)
    src = torch.randint(0, 256, (n, block), dtype=torch.uint8)
    hashes = [uuid.uuid4().bytes * 2 for _ in range(n)]
    out = torch.zeros(n, block, dtype=torch.uint8)
    rows = torch.zeros(n + 1, block + 4096, dtype=torch.uint8)  # a record is a little longer than its block
    figures: dict[str, list[float]] = {"store": [], "plain store": [], "cold": [], "plain cold": [],
                                       "warm": [], "plain warm": []}
    base = benchmain.remove_at_exit(tempfile.mkdtemp(prefix="tierkv-calls-", dir=args.dir))
    try:
        for r in range(args.rounds):
            root = f"{base}/tier{r}"
            cfg = config(root, block, min(n, 9 * args.call), args.read_processes)
            figures["plain store"].append(plain_store(f"{base}/plain{r}", src, args.call, pool))
            shutil.rmtree(f"{base}/plain{r}")
            dt, paths = anyio.run(store, cfg, hashes, src, args.call)
            figures["store"].append(dt)
            if not drop_caches():
                raise SystemExit("calls: dropping the page cache needs root "
                                 "(echo 3 > /proc/sys/vm/drop_caches)")
            figures["cold"].append(anyio.run(load, cfg, hashes, out, args.call))
            if not torch.equal(out, src):
                raise SystemExit("calls: a loaded block differs from the stored one")
            drop_caches()
            figures["plain cold"].append(plain_load(paths, rows, args.call, pool))
            out.zero_()
            figures["warm"].append(anyio.run(load, cfg, hashes, out, args.call))
            if not torch.equal(out, src):
                raise SystemExit("calls: a loaded block differs from the stored one")
            figures["plain warm"].append(plain_load(paths, rows, args.call, pool))
            shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    mb = n * block / 1e6
    res: dict[str, Any] = {"block_kib": block_kib, "blocks": n, "rounds": args.rounds}
    for k, v in figures.items():
        res[f"{k} MB/s"] = round(mb / statistics.median(v))
    for what in ("store", "cold", "warm"):
        pairs = zip(figures[f"plain {what}"], figures[what], strict=True)
        res[f"{what} x plain"] = round(statistics.median(p / t for p, t in pairs), 2)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block-kib", type=benchmain.positive_list, default=[256, 1024])
    p.add_argument("--total-mib", type=benchmain.positive, default=512)
    p.add_argument("--call", type=benchmain.positive, default=38, help="blocks per call")
    p.add_argument("--rounds", type=benchmain.positive, default=5)
    p.add_argument("--read-processes", type=int, choices=range(0, 5), default=0)
    p.add_argument("--dir", type=benchmain.directory, default=None,
                   help="where the files go (default: the temp dir)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    results = []
    with ThreadPoolExecutor(THREADS) as pool:
        for kib in args.block_kib:
            r = one_size(kib, args, pool)
            results.append(r)
            print(f"{kib:5d} KiB: store {r['store MB/s']:6,} MB/s ({r['store x plain']:.2f}x plain loop)  "
                  f"cold load {r['cold MB/s']:6,} MB/s ({r['cold x plain']:.2f}x plain loop, same files)  "
                  f"warm load {r['warm MB/s']:6,} MB/s ({r['warm x plain']:.2f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "bench/calls.py", "results": results}, f, indent=1)


if __name__ == "__main__":
    benchmain.run(main)
