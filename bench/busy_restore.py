"""A warm restore beside a busy Python thread: threads against reader processes.

    python bench/busy_restore.py [--blocks 128] [--block-kib 1024] [--repeats 7] [--json FILE]

An engine's scheduler process runs a step loop that holds the GIL most of the time while a
request waits for its blocks (vLLM's loop spins). This runs the restore of ``bench/restore.py``
(a new store, ``lookup_prefix`` polled every millisecond until HIT, then ``borrow`` of the rows:
the path the vLLM adapter takes) in a process with such a thread (a loop of dict stores, switch
interval 0.1 ms as the adapters set it), with and without it, for three pools:

* ``private``: the CPU pool in private memory; the tier reads in its threads;
* ``shared, read_processes 0``: the pool in a shared file mapping (``shm_path``), threads only;
* ``shared, read_processes auto``: the same pool, read by reader processes.

Baseline, same run: a single-threaded ``open / readinto`` loop of the same record files into a
touched tensor, timed with the busy thread running and without. The record files are read before
every round (warm page cache). Medians of ``--repeats`` rounds; ``ratio`` is baseline time /
restore time (above 1: faster than the raw loop).
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
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).parent))
from restore import config, hashes_for, raw_readinto_loop, until_hit, write

from tierkv import TieredStore
from tierkv.tools.bench.pagecache import read_files

VARIANTS = {"private": (False, 0), "shared, read_processes 0": (True, 0),
            "shared, read_processes auto": (True, "auto")}


class Busy:
    """A thread that keeps the GIL busy, as an engine's step loop does, while on."""

    def __init__(self) -> None:
        self.on = False
        self._stop = False
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        d: dict[int, int] = {}
        while not self._stop:
            if not self.on:
                time.sleep(0.001)
                continue
            for i in range(100):
                d[i] = i * 2

    def stop(self) -> None:
        self._stop = True
        self._thread.join()


async def restore_once(cfg: dict[str, Any], hashes: list[bytes], data: torch.Tensor,
                       busy: Busy, spin: bool) -> tuple[float, dict[str, int]]:
    async with TieredStore(cfg) as store:
        await anyio.sleep(0.5)  # reader processes start with the tier; an engine's first restore comes later
        busy.on = spin
        try:
            t0 = time.perf_counter()
            await until_hit(store, hashes)
            async with store.borrow(0, hashes, request_id="r") as rows:
                elapsed = time.perf_counter() - t0
                busy.on = False
                if not torch.equal(rows, data):
                    raise SystemExit("restored rows differ from those stored")
        finally:
            busy.on = False
        return elapsed, dict(store.stats().tiers[1].backend)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=benchmain.positive, default=128)
    p.add_argument("--block-kib", type=benchmain.positive, default=1024)
    p.add_argument("--repeats", type=benchmain.positive, default=7)
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    sys.setswitchinterval(1e-4)
    block, n = args.block_kib * 1024, args.blocks
    data = torch.randint(0, 256, (n, block), dtype=torch.uint8)
    hashes = hashes_for("busy", n)
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    busy = Busy()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tierkv-busy-") as tmp, \
            tempfile.TemporaryDirectory(prefix="tierkv-busy-pool-", dir=shm_dir) as pools:
        tier = {"kind": "fsspec", "url": f"file://{tmp}/tier"}
        anyio.run(write, config(block, n, tier, None), hashes, data)
        files = sorted(Path(tmp, "tier").rglob("*.tkv"))
        paths = [str(f) for f in files]
        rows = torch.zeros(n, block + 4096, dtype=torch.uint8)  # each record file fits its row
        times: dict[tuple[str, bool], list[float]] = {}
        counters: dict[str, dict[str, int]] = {}
        for _ in range(args.repeats):
            for spin in (False, True):
                read_files(files)
                busy.on = spin
                t0 = time.perf_counter()
                raw_readinto_loop(paths, rows)
                times.setdefault(("raw readinto", spin), []).append(time.perf_counter() - t0)
                busy.on = False
                for name, (shared, procs) in VARIANTS.items():
                    cfg = config(block, n, {**tier, "read_processes": procs}, None)
                    if shared:
                        cfg["tiers"][0]["shm_path"] = f"{pools}/pool"
                    read_files(files)
                    t, backend = anyio.run(restore_once, cfg, hashes, data, busy, spin)
                    times.setdefault((name, spin), []).append(t)
                    counters[name] = backend
        busy.stop()
    gb = n * block / 1e9
    print(f"{n} x {args.block_kib} KiB ({gb * 1e3:.0f} MB), warm page cache, medians of {args.repeats}")
    print(f"{'':32} {'busy thread':>12} {'s':>8} {'GB/s':>7} {'ratio':>6}")
    for spin in (False, True):
        base = statistics.median(times[("raw readinto", spin)])
        for name in ["raw readinto", *VARIANTS]:
            t = statistics.median(times[(name, spin)])
            results.append({"variant": name, "busy": spin, "seconds": t, "gb_s": gb / t,
                            "ratio": base / t, "samples": times[(name, spin)],
                            "reader_reads": counters.get(name, {}).get("reader_reads", 0)})
            print(f"{name:32} {'yes' if spin else 'no':>12} {t:8.4f} {gb / t:7.2f} {base / t:6.2f}")
    reads = counters["shared, read_processes auto"].get("reader_reads", 0)
    print(f"records read by reader processes in the last round: {reads} of {n}")
    if args.json:
        out = {"blocks": n, "block_bytes": block, "results": results}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    benchmain.run(main)
