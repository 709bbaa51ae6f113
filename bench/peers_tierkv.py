"""tierkv through its own batch API for bench/peers.py: a worker process, driven as LMCache's is.

    python bench/peers_tierkv.py    # started by bench/peers.py (system ``tierkv-api``), not by hand

The same JSON-lines protocol as bench/peers_lmcache.py (``{"ready": true, ...}``, then one answer
per command; ``phase`` and ``guarantees``), the same blocks and hashes (bench/peers.py's
``Blocks``), and the same shape of work: blocking batch calls, one call at a time, in a process of
its own (its own GIL, as LMCache's child has). The store is a public :class:`tierkv.TieredStore`:

    tiers = [{"kind": "cpu", "slots": {0: ROWS}, "shm_path": "/dev/shm/..."},
             {"kind": "fsspec", "url": "file://ROOT", "io_threads": T, "io_depth": T,
              "read_concurrency": T, "shed_after_s": 3600, ...}]

the tier settings of the ``tierkv`` row (vLLM's manager) and a primary of the same rows, in
shared memory as the vLLM adapter's is (so reader processes read into it, as they do there).

Store, per call: ``await store.put(0, hashes, rows)`` from a prebuilt array of every block (the
engine's KV memory; ``put`` copies the rows into the primary, the GPU->CPU copy), then ``await
store.flush()`` (every cascade to the file tier finished): the phase's time. Load, per call:
``store.lookup_prefix(hashes, request_id=r)`` (starts the promotions, pins), ``await
store.get(0, hashes, out, request_id=r)`` into the caller's rows (the copy out), ``release(r)``.
Each load phase opens a new store over the same directory (the primary starts empty, as after a
restart; opened untimed, with ``scan_on_open: false``: the capacity scan of a restart would
otherwise run inside the timed load, and no capacity is set).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers

GROUP = 0


def config(cmd: dict[str, Any], root: str, block_bytes: int, rows: int, *, capacity: int | None = None,
           scan: bool = True) -> dict[str, Any]:
    from tierkv import GroupSpec, Layout

    tier: dict[str, Any] = {"kind": "fsspec", "url": f"file://{root}", **cmd["tier_settings"],
                            "scan_on_open": scan}
    if capacity is not None:
        tier["capacity_bytes"] = capacity
    cpu: dict[str, Any] = {"kind": "cpu", "slots": {GROUP: rows}}
    if cmd.get("shm", True):
        cpu["shm_path"] = f"/dev/shm/tkpeers-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return {"layout": Layout(tokens_per_block=16, groups=[GroupSpec(kind="full", block_bytes=block_bytes)]),
            "namespace": "peers", "tiers": [cpu, tier]}


def rows_of(cmd: dict[str, Any], block_bytes: int) -> int:
    return max(1, int(cmd["staging_bytes"]) // block_bytes)


async def store_calls(cfg: dict[str, Any], blocks: peers.Blocks, src: np.ndarray,
                      calls: list[tuple[int, int]], *, check: bool = True, record_of: int | None = None
                      ) -> tuple[float, str | None]:
    """``put`` of every call's rows, then ``flush``: (the seconds from the first put to the flush,
    the record file of block ``record_of``). ``check``: every block must have been stored."""
    import torch

    from tierkv import TieredStore, make_key

    rows = torch.from_numpy(src)
    async with TieredStore(cfg) as store:
        t0 = time.perf_counter()
        for start, n in calls:
            await store.put(GROUP, blocks.hashes[start:start + n], rows[start:start + n])
        await store.flush()
        dt = time.perf_counter() - t0
        st = store.stats().tiers[1]
        want = sum(n for _, n in calls)
        if check and st.stores + st.stores_skipped < want:
            raise RuntimeError(f"the file tier stored {st.stores} of {want} blocks ({st.stores_shed} shed,"
                               f" {st.stores_failed} failed)")
        path = None
        if record_of is not None:
            path = store.tiers[1].path(make_key(blocks.hashes[record_of], GROUP))  # type: ignore[attr-defined]
    return dt, path


async def load_calls(cfg: dict[str, Any], blocks: peers.Blocks, calls: list[tuple[int, int]],
                     dest: np.ndarray, loaded: np.ndarray) -> tuple[float, int]:
    """Per call ``lookup_prefix`` then ``get`` into ``dest``'s rows; (seconds, reader-process reads)."""
    import torch

    from tierkv import BlockMissing, TieredStore

    out = torch.from_numpy(dest)
    async with TieredStore(cfg) as store:
        before = store.stats().tiers[1].backend.get("reader_reads", 0)
        t0 = time.perf_counter()
        for c, (start, n) in enumerate(calls):
            rid = f"l{c}"
            want = blocks.hashes[start:start + n]
            store.lookup_prefix(want, request_id=rid)
            try:
                await store.get(GROUP, want, out[start:start + n], request_id=rid)
            except BlockMissing:
                continue  # counted as missing by the caller's verify
            finally:
                store.release(rid)
            loaded[start:start + n] = True
        dt = time.perf_counter() - t0
        reads = store.stats().tiers[1].backend.get("reader_reads", 0) - before
    return dt, int(reads)


def source(blocks: peers.Blocks, upto: int | None = None) -> np.ndarray:
    n = blocks.n if upto is None else upto
    src = np.empty((n, blocks.block_bytes), dtype=np.uint8)
    for i in range(n):
        blocks.fill(src[i], i)
    return src


async def phase_async(cmd: dict[str, Any]) -> dict[str, Any]:
    blocks = peers.blocks_of(cmd)
    bb, root = blocks.block_bytes, cmd["root"]
    rows = rows_of(cmd, bb)
    res = peers.PhaseResult()
    src = source(blocks)
    os.sync()
    res.store_s, _ = await store_calls(config(cmd, root, bb, rows), blocks, src, blocks.calls)
    del src
    t0 = time.perf_counter()
    os.sync()
    res.sync_s = time.perf_counter() - t0
    res.files, res.file_bytes, res.disk_bytes = peers.tree_bytes(root)
    dest = np.zeros((blocks.n, bb), dtype=np.uint8)
    for cache in ("warm", "cold"):
        dest.fill(0)
        loaded = np.zeros(blocks.n, dtype=bool)
        if cache == "cold":
            res.cold_dropped = peers.drop_caches() if cmd["drop"] else False
        else:
            peers.warm_tree(root)
        dt, reads = await load_calls(config(cmd, root, bb, rows, scan=False), blocks, blocks.calls, dest,
                                     loaded)
        setattr(res, f"{cache}_s", dt)
        if cache == "warm":
            res.warm_reader_reads = reads
        res.verify(cache, blocks, dest, loaded)
    return {"result": asdict(res)}


async def guarantees_async(cmd: dict[str, Any]) -> dict[str, Any]:
    blocks = peers.blocks_of(cmd)
    bb, n = blocks.block_bytes, peers.GUARD_N
    rows = 4 * blocks.n
    src = source(blocks)
    dest = np.zeros((blocks.n, bb), dtype=np.uint8)
    loaded = np.zeros(blocks.n, dtype=bool)
    d1 = os.path.join(cmd["root"], "data")
    _, target = await store_calls(config(cmd, d1, bb, rows), blocks, src, [(0, n)], record_of=0)
    assert target is not None
    peers.flip_middle_byte(target)
    await load_calls(config(cmd, d1, bb, rows, scan=False), blocks, [(0, 1)], dest, loaded)
    wrong, wrong_ok = peers.wrong_verdict(blocks, dest, loaded)
    dest.fill(0)
    loaded[:] = False
    await load_calls(config(cmd, d1, bb, rows), blocks, [(1, n - 1)], dest, loaded)  # restart
    restart, restart_ok = peers.restart_verdict(blocks, dest, loaded, n)
    cap_blocks = int(cmd["cap_blocks"])
    cap = cap_blocks * (bb + 8192)
    d2 = os.path.join(cmd["root"], "cap")
    for c in range(3):
        await store_calls(config(cmd, d2, bb, rows, capacity=cap), blocks, src,
                          [(c * cap_blocks, cap_blocks)], check=False)
    settle = time.monotonic() + 5  # eviction may finish in the background
    while True:
        files = peers.data_files(d2, ".tkv")
        used = sum(p.stat().st_size for p in files)
        if used <= cap or time.monotonic() > settle:
            break
        time.sleep(0.05)
    capacity, cap_ok = peers.capacity_verdict(len(files), used, cap)
    return {"result": peers.guarantee(wrong, wrong_ok, capacity, cap_ok, restart, restart_ok)}


def main() -> int:
    send = peers.child_channel()
    try:
        import anyio

        import tierkv
    except ImportError as exc:
        send({"ready": False, "why": f"{type(exc).__name__}: {exc}"})
        return 0
    import logging

    logging.getLogger("tierkv").setLevel(logging.ERROR)
    send({"ready": True, "version": f"tierkv {getattr(tierkv, '__version__', '?')}, own process"})
    handlers = {"phase": lambda cmd: anyio.run(phase_async, cmd),
                "guarantees": lambda cmd: anyio.run(guarantees_async, cmd)}
    peers.serve_child(send, handlers)
    return 0


if __name__ == "__main__":
    peers.child_signals()
    sys.exit(main())
