"""Cold reads of ``none`` records through a ``file://`` tier: ``direct_reads`` (``O_DIRECT``
straight into page-aligned rows, possible since record format version 3 starts the block on a
page) against buffered reads, each as a ratio to a raw file read loop of the same round.

    python bench/direct_read.py [--blocks 256] [--block-kib 256] [--batch 64] [--repeats 3]
                                [--dir DIR] [--drop-caches] [--json FILE]

Each round makes every record cold before each variant (an ``fsync`` then
``posix_fadvise(DONTNEED)`` of each record file; ``--drop-caches``: ``echo 3 >
/proc/sys/vm/drop_caches`` instead, root only) and times, in a rotating order:

- *raw*: ``open / readinto(row) / close`` of the tier's own record files, whole (header, block
  and trailer) into a buffer per row, on as many threads as the tier has for cold reads
  (``io_depth``, 16): the baseline;
- *buffered*: the tier's ``get`` (``direct_reads: false``) of every key, ``--batch`` keys a call,
  into page-aligned rows;
- *direct*: the same with ``direct_reads: true``.

Printed: per variant the median time and MB/s (1 MB = 1e6 bytes of blocks), and the median over
rounds of the ratio raw time / variant time (above 1: faster than the raw loop), and of direct
against buffered. The directory must be on a disk file system that supports ``O_DIRECT`` (not
tmpfs): by default a fresh directory under the current one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tierkv import GroupSpec, Layout
from tierkv.backends.base import TierContext
from tierkv.backends.fsspec import FsspecTier, FsspecTierConfig
from tierkv.keys import make_key

DEPTH = 16


def _cold(paths: list[Path], drop_caches: bool) -> None:
    if drop_caches:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _aligned_rows(n: int, block: int) -> torch.Tensor:
    return torch.frombuffer(mmap.mmap(-1, n * block), dtype=torch.uint8).reshape(n, block)


def _raw(paths: list[Path], bufs: list[bytearray], pool: ThreadPoolExecutor) -> None:
    def one(i: int) -> int:
        with open(paths[i], "rb", buffering=0) as f:
            return f.readinto(bufs[i]) or 0

    assert all(n == len(bufs[0]) for n in pool.map(one, range(len(paths))))


async def _get(tier: FsspecTier, keys: list[bytes], out: torch.Tensor, batch: int) -> None:
    for i in range(0, len(keys), batch):
        assert all(await tier.get(0, keys[i:i + batch], out[i:i + batch]))


async def main(args: argparse.Namespace) -> dict[str, Any]:
    block = args.block_kib << 10
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=block)])
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="direct-read-", dir="."))
    ctx = TierContext(layout=layout, namespace="bench", fingerprint=layout.fingerprint("bench"))
    tiers = {name: FsspecTier(FsspecTierConfig(url=f"file://{root.resolve()}", codec="none",
                                               direct_reads=name == "direct", io_depth=DEPTH), ctx)
             for name in ("buffered", "direct")}
    for t in tiers.values():
        await t.open()
    try:
        keys = [make_key(i.to_bytes(32, "big"), 0) for i in range(args.blocks)]
        gen = torch.Generator().manual_seed(1)
        data = torch.randint(0, 256, (args.blocks, block), dtype=torch.uint8, generator=gen)
        for i in range(0, args.blocks, args.batch):
            assert all(await tiers["buffered"].put(0, keys[i:i + args.batch], data[i:i + args.batch]))
        paths = [Path(tiers["buffered"].path(k)) for k in keys]
        record_len = paths[0].stat().st_size
        bufs = [bytearray(record_len) for _ in paths]
        out = _aligned_rows(args.blocks, block)
        times: dict[str, list[float]] = {"raw": [], "buffered": [], "direct": []}
        ratios: dict[str, list[float]] = {"buffered": [], "direct": [], "direct/buffered": []}
        order = ["raw", "buffered", "direct"]
        with ThreadPoolExecutor(DEPTH) as pool:
            for r in range(args.repeats):
                this: dict[str, float] = {}
                for name in order[r % 3:] + order[:r % 3]:
                    _cold(paths, args.drop_caches)
                    out.zero_()
                    t0 = time.perf_counter()
                    if name == "raw":
                        _raw(paths, bufs, pool)
                    else:
                        await _get(tiers[name], keys, out, args.batch)
                    this[name] = time.perf_counter() - t0
                    if name != "raw":
                        assert torch.equal(out, data), name
                for name, t in this.items():
                    times[name].append(t)
                ratios["buffered"].append(this["raw"] / this["buffered"])
                ratios["direct"].append(this["raw"] / this["direct"])
                ratios["direct/buffered"].append(this["buffered"] / this["direct"])
        nbytes = args.blocks * block
        result = {"blocks": args.blocks, "block_kib": args.block_kib, "record_bytes": record_len,
                  "repeats": args.repeats, "cold": "drop_caches" if args.drop_caches else "fadvise",
                  "median_s": {k: statistics.median(v) for k, v in times.items()},
                  "median_ratio_to_raw": {k: statistics.median(v) for k, v in ratios.items() if "/" not in k},
                  "median_direct_over_buffered": statistics.median(ratios["direct/buffered"])}
        print(f"{args.blocks} blocks x {args.block_kib} KiB, cold ({result['cold']}), {args.repeats} rounds")
        for name in ("raw", "buffered", "direct"):
            s = result["median_s"][name]
            ratio = "" if name == "raw" else f"  x raw {result['median_ratio_to_raw'][name]:.3f}"
            print(f"  {name:9s} {s * 1e3:9.1f} ms  {nbytes / s / 1e6:8.0f} MB/s{ratio}")
        print(f"  direct vs buffered: x {result['median_direct_over_buffered']:.3f} (above 1: direct faster)")
        return result
    finally:
        for t in tiers.values():
            await t.close()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="an existing directory on a disk (default: a new one)")
    parser.add_argument("--drop-caches", action="store_true", help="drop all caches (root), not fadvise")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    res = asyncio.run(main(args))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
