"""A whole-prefix restore of blocks stored several to a record against one to a record.

    python bench/records_per_chunk.py [--block-kib 256] [--total-mib 256] [--per 1,4] [--repeats 3]
                                      [--url file|s3]

For each ``blocks_per_record`` in ``--per``: one store writes ``--total-mib`` of blocks to a
``file://`` tier through ``put`` (``codec: none``) and closes; each round a *new* store (CPU pool
big enough for all of them) serves one request: ``lookup_prefix`` polled every millisecond until
it is not PENDING, then ``get`` of the whole prefix into a preallocated, touched tensor. The
time runs from the first lookup to ``get``'s return. The baseline, same run, same files:
``raw read``, a single-threaded ``open / read / close`` of each record file. The page cache is
warm (the files were just written or read). ``--url s3``: the same restore from an ``s3://`` tier
on a SeaweedFS server started on loopback (the tier's default client), with no raw baseline.

Printed per ``blocks_per_record``: records, the medians of ``--repeats`` rounds, and the ratio
``raw read / tierkv`` taken within each round (above 1: faster than the raw loop); then the
restore time of each ``N`` over that of the first (below 1: faster).
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from tierkv import GroupSpec, Layout, Lookup, TieredStore

MIB = 1 << 20


def config(tier: dict[str, Any], block: int, per: int, n: int) -> dict[str, Any]:
    layout = Layout(tokens_per_block=16, blocks_per_record=per,
                    groups=[GroupSpec(kind="full", block_bytes=block)])
    return {"layout": layout, "namespace": "bench-records-per-chunk",
            "tiers": [{"kind": "cpu", "slots": {0: n // per}}, {**tier, "codec": "none"}]}


async def write(cfg: dict[str, Any], hashes: list[bytes], data: torch.Tensor) -> None:
    async with TieredStore(cfg) as store:
        await store.put(0, hashes, data)
        await store.flush()


async def restore(cfg: dict[str, Any], hashes: list[bytes], out: torch.Tensor) -> float:
    async with TieredStore(cfg) as store:
        t0 = time.perf_counter()
        while True:
            ans = store.lookup_prefix(hashes, request_id="r")
            if ans.state is not Lookup.PENDING:
                break
            await anyio.sleep(0.001)
        if ans.state is not Lookup.HIT or ans.blocks != len(hashes):
            raise SystemExit(f"restore answered {ans}, expected HIT for {len(hashes)} blocks")
        await store.get(0, hashes, out, request_id="r")
        return time.perf_counter() - t0


def raw_read(paths: list[Path]) -> float:
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            f.read()
    return time.perf_counter() - t0


def run(per: int, args: argparse.Namespace, base: Path, server: Any) -> dict[str, Any]:
    block = args.block_kib << 10
    n = max(per, (args.total_mib * MIB) // block // per * per)
    data = torch.randint(0, 256, (n, block), dtype=torch.uint8)
    hashes = [b"chunks--" + i.to_bytes(24, "big") for i in range(n)]
    root = base / f"per{per}"
    if server is None:
        tier: dict[str, Any] = {"kind": "fsspec", "url": f"file://{root}"}
    else:
        bucket = server.new_bucket(f"per{per}")
        tier = {"kind": "fsspec", "url": f"s3://{bucket}/kv", "storage_options": server.storage_options()}
    cfg = config(tier, block, per, n)
    anyio.run(write, cfg, hashes, data)
    if server is None:
        paths = sorted(root.rglob("*.tkv"))
        stored = len(paths)
    else:
        paths, stored = [], sum(1 for k in server.objects(bucket, "kv/") if k.endswith(".tkv"))
    if stored != n // per:
        raise SystemExit(f"{stored} records for {n} blocks at {per} a record")
    out = torch.zeros_like(data)
    times, raws = [], []
    for _ in range(args.repeats):
        raws.append(raw_read(paths) if paths else float("nan"))
        out.zero_()
        times.append(anyio.run(restore, cfg, hashes, out))
        if not torch.equal(out, data):
            raise SystemExit("restored bytes differ from those stored")
    return {"per": per, "blocks": n, "records": stored, "restore_s": statistics.median(times),
            "raw_s": statistics.median(raws),
            "ratio": statistics.median(r / t for r, t in zip(raws, times, strict=True))}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block-kib", type=benchmain.positive, default=256)
    p.add_argument("--total-mib", type=benchmain.positive, default=256)
    p.add_argument("--per", type=benchmain.positive_list, default=[1, 4], help="blocks_per_record values")
    p.add_argument("--repeats", type=benchmain.positive, default=3)
    p.add_argument("--url", choices=["file", "s3"], default="file")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tierkv-per-chunk-") as tmp:
        server = None
        if args.url == "s3":
            from tierkv.testing.seaweed import SeaweedServer

            server = SeaweedServer(Path(tmp) / "seaweed")
            server.start()
        try:
            results = [run(per, args, Path(tmp), server) for per in args.per]
        finally:
            if server is not None:
                server.close()
    print(f"{args.url}: {args.block_kib} KiB blocks, {args.total_mib} MiB, warm page cache, "
          f"medians of {args.repeats}")
    print(f"{'N':>3} {'blocks':>7} {'records':>8} {'restore ms':>11} {'raw read ms':>12} {'raw/tierkv':>11}")
    for r in results:
        print(f"{r['per']:>3} {r['blocks']:>7} {r['records']:>8} {r['restore_s'] * 1e3:>11.1f} "
              f"{r['raw_s'] * 1e3:>12.1f} {r['ratio']:>11.2f}")
    first = results[0]
    for r in results[1:]:
        print(f"restore time N={r['per']} / N={first['per']}: {r['restore_s'] / first['restore_s']:.2f}")


if __name__ == "__main__":
    benchmain.run(main)
