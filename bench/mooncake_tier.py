"""The mooncake tier through a TieredStore, against Mooncake's own batch API on the same objects
and against the S3 tier on SeaweedFS (named not to shadow the ``mooncake`` package).

    python bench/mooncake_tier.py [--block-kib 256,1024,2048] [--total-mib 128] [--repeats 3]
                             [--no-s3] [--io-threads N] [--json FILE]

On loopback: a ``mooncake_master`` and one storage node (``mooncake_client``) that contributes the
pool; the stores' tiers contribute none (``segment_bytes: 0``), so the objects outlive the store
that wrote them. One store writes ``--total-mib`` of blocks through ``put`` and closes; then, per
round:

``tierkv``
    a *new* store (CPU pool big enough for all of them) serves one request as bench/restore.py's
    restores do: ``lookup_prefix`` polled every millisecond until it is not PENDING (the blocks
    are read into the pool meanwhile), then ``get`` of the whole prefix into a preallocated,
    touched tensor (a second copy), checked equal to what was written; and, in another new store,
    the same ending in ``borrow`` (the rows used where they landed, no second copy).
``mooncake batch``
    a Mooncake client of its own reads the same objects (the records) with one
    ``batch_get_into`` call into a preallocated, registered buffer: what a connector that uses
    Mooncake directly does, with nothing checked.
``s3``
    bench/restore.py's S3 restore of the same number of bytes from an ``s3://`` tier on a SeaweedFS
    server on loopback (``--no-s3`` leaves it out).

Every figure is the median of ``--repeats`` rounds; the ratio to Mooncake's batch call is taken
within a round (its time / tierkv's: above 1 is faster than the batch call).
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import restore as rb
import torch

MIB = 1 << 20


def raw_client(endpoint: str) -> Any:
    """A Mooncake client that contributes no memory."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    if client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 * MIB, "tcp", "", endpoint) != 0:
        raise SystemExit(f"cannot set up a Mooncake client against {endpoint}")
    return client


def raw_batch_s(client: Any, names: list[str], sizes: list[int], buf: np.ndarray) -> float:
    """One ``batch_get_into`` of every object into ``buf``; its time."""
    base, ptrs, off = buf.ctypes.data, [], 0
    for s in sizes:
        ptrs.append(base + off)
        off += s
    t0 = time.perf_counter()
    codes = client.batch_get_into(names, ptrs, sizes)
    dt = time.perf_counter() - t0
    if list(codes) != sizes:
        raise SystemExit(f"Mooncake's batch read failed: {sorted(set(codes))}")
    return dt


def run_mooncake(args: argparse.Namespace, block: int, endpoint: str, client: Any) -> dict[str, Any]:
    from tierkv.backends.mooncake._tier import object_name
    from tierkv.keys import make_key

    n = max(1, (args.total_mib * MIB) // block)
    data = torch.randint(0, 256, (n, block), dtype=torch.uint8)
    out = torch.zeros_like(data)
    tier = {"kind": "mooncake", "master": endpoint, "segment_bytes": 0, "buffer_bytes": 64 * MIB}
    cfg = rb.config(block, n, tier, args.io_threads)
    hashes = rb.hashes_for(f"m{block}", n)
    anyio.run(rb.write, cfg, hashes, data)
    fp = cfg["layout"].fingerprint(cfg["namespace"])
    names = [object_name(fp, make_key(h, 0)) for h in hashes]
    sizes = [int(client.get_size(x)) for x in names]
    if min(sizes) <= block:
        raise SystemExit(f"objects missing from the pool after the write: sizes {sorted(set(sizes))[:4]}")
    buf = np.zeros(sum(sizes), dtype=np.uint8)
    client.register_buffer(buf.ctypes.data, buf.nbytes)
    rounds = []
    try:
        raw_batch_s(client, names, sizes, buf)  # not timed: connections to the storage node
        for _ in range(args.repeats):
            raw = raw_batch_s(client, names, sizes, buf)
            out.zero_()
            r = anyio.run(rb.restore, cfg, hashes, out, data)
            r["borrow_s"] = anyio.run(rb.restore_borrow, cfg, hashes, data)
            r["raw_s"] = raw
            rounds.append(r)
    finally:
        client.unregister_buffer(buf.ctypes.data)
        client.batch_remove(names, True)
    total = n * block
    keys = ("restore_s", "borrow_s", "raw_s", "lookup_phase_s", "get_s")
    med = {k: statistics.median(r[k] for r in rounds) for k in keys}
    return {"block_bytes": block, "blocks": n, "rounds": rounds,
            "restore_mb_s": total / med["restore_s"] / 1e6, "raw_mb_s": total / med["raw_s"] / 1e6,
            "borrow_mb_s": total / med["borrow_s"] / 1e6,
            "ratio_vs_raw": statistics.median(r["raw_s"] / r["restore_s"] for r in rounds),
            "ratio_borrow_vs_raw": statistics.median(r["raw_s"] / r["borrow_s"] for r in rounds),
            "lookup_phase_s": med["lookup_phase_s"], "get_s": med["get_s"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block-kib", default="256,1024,2048")
    p.add_argument("--total-mib", type=benchmain.positive, default=128, help="bytes restored per round")
    p.add_argument("--repeats", type=benchmain.positive, default=3)
    p.add_argument("--no-s3", action="store_true", help="leave the S3 tier out")
    p.add_argument("--io-threads", type=benchmain.positive, default=None)
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    if not all(x.isdigit() and int(x) > 0 for x in args.block_kib.split(",")):
        p.error(f"--block-kib: positive KiB, comma-separated (got {args.block_kib!r})")
    from tierkv.testing.mooncake import MooncakeMaster, StorageNode, missing

    why = missing()
    if why:
        raise SystemExit(f"Mooncake is not usable here: {why}")
    args.s3_total_mib = args.total_mib
    kibs = [int(x) for x in args.block_kib.split(",")]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tierkv-mooncake-") as tmp, MooncakeMaster(tmp) as master, \
            StorageNode(master, 2 * args.total_mib * MIB + 256 * MIB):
        client = raw_client(master.endpoint)
        server = None
        if not args.no_s3:
            from tierkv.testing.seaweed import SeaweedServer

            server = SeaweedServer(Path(tmp) / "seaweed")
            server.start()
        try:
            for kib in kibs:
                r = run_mooncake(args, kib << 10, master.endpoint, client)
                line = (f"{r['blocks']} x {kib} KiB: mooncake tier restore+get "
                        f"{r['restore_mb_s']:,.0f} MB/s, restore+borrow {r['borrow_mb_s']:,.0f} (lookups "
                        f"until HIT {r['lookup_phase_s']:.3f} s, get {r['get_s']:.3f} s); Mooncake "
                        f"batch_get_into {r['raw_mb_s']:,.0f} MB/s; ratios {r['ratio_vs_raw']:.2f} / "
                        f"{r['ratio_borrow_vs_raw']:.2f}")
                if server is not None:
                    s3 = rb.run_s3(args, kib << 10, server)
                    r["s3_restore_mb_s"] = s3["restore_mb_s"]
                    r["ratio_vs_s3"] = r["restore_mb_s"] / s3["restore_mb_s"]
                    line += (f"; s3 tier (SeaweedFS) restore+get {s3['restore_mb_s']:,.0f} MB/s, mooncake/s3 "
                             f"{r['ratio_vs_s3']:.2f}")
                results.append(r)
                print(line, flush=True)
        finally:
            client.close()
            if server is not None:
                server.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=1))


if __name__ == "__main__":
    benchmain.run(main)
