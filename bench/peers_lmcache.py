"""LMCache's local-disk tier for bench/peers.py: a worker run with LMCache's own venv.

    .venv-lmcache/bin/python bench/peers_lmcache.py    # started by bench/peers.py, not by hand

LMCache cannot live in tierkv's venv (it pins older numpy, protobuf, grpcio, ...), so bench/peers.py
starts this script with LMCache's python and talks to it in JSON lines: this script writes
``{"ready": true, "version": ..., "torch": ...}`` once LMCache is imported (or ``{"ready": false,
"why": ...}``), then answers each command line on stdin with one line on stdout (everything that
libraries print goes to stderr). Commands: ``{"op": "phase" | "guarantees", "root", "pool", "calls",
"tag", "threads", "staging_bytes", "drop", "timeout_s", "cap_blocks"}`` and ``{"op": "quit"}``. The
blocks are bench/peers.py's own (``Blocks``: the pool of KV-like blocks saved by the parent as .npy,
the calls, the stamps and the key hashes from ``tag``), so both processes store and verify the same
bytes under the same hashes.

The backend is built as LMCache's ``CreateStorageBackends`` builds a ``local_disk`` config, except
that the CPU staging allocator is a plain ``HostMemoryAllocator`` of ``staging_bytes`` (the default
path asks for pinned memory)::

    config = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=False, local_disk=ROOT,
                 max_local_disk_size=GB, extra_config={"disk_io_threads": T, "use_odirect": False})
    cpu    = LocalCPUBackend(config, metadata=None, dst_device="cpu", memory_allocator=...)
    disk   = LocalDiskBackend(config, loop, cpu, dst_device="cpu")   # loop: asyncio, own thread

Store, per call: ``cpu.allocate`` one ``KV_2LTD`` bf16 object per block (``[2, L, 256, 256]``;
waits while the staging pool is full), fill it, ``disk.batched_submit_put_task(keys, objs,
on_complete_callback)``, drop this side's references (the put tasks hold their own); the phase ends
when the callback has fired for every key. Load, per call: ``disk.batched_get_blocking(keys)``
(LMCache's ``StorageManager.batched_get`` path: its read pool of ``disk_io_threads``), copy each
object out, release it. Keys: ``CacheEngineKey("peers/model", 1, 0, <first 8 bytes of the block
hash>, bfloat16)``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers

MODEL = "peers/model"


class Disk:
    """One LocalDiskBackend (and its CPU staging backend) over ``root``."""

    def __init__(self, root: str, threads: int, capacity_bytes: int, staging_bytes: int) -> None:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=256, local_cpu=False, max_local_cpu_size=staging_bytes / 2**30,
            local_disk=root, max_local_disk_size=capacity_bytes / 2**30,
            extra_config={"disk_io_threads": threads, "use_odirect": False})
        self.cpu = LocalCPUBackend(config, metadata=None, dst_device="cpu",
                                   memory_allocator=HostMemoryAllocator(staging_bytes))
        self.disk = LocalDiskBackend(config, self.loop, self.cpu, dst_device="cpu")

    def close(self) -> None:
        self.disk.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def shape_of(block_bytes: int) -> Any:
    import torch

    layers, rest = divmod(block_bytes, 2 * 256 * 256 * 2)
    return torch.Size([2, layers, 256, 256] if layers and not rest else [2, 1, 1, block_bytes // 4])


def view(obj: Any) -> np.ndarray:
    """The object's bytes as a numpy array (no copy)."""
    import torch

    return obj.tensor.view(torch.uint8).reshape(-1).numpy()


def make_keys(blocks: peers.Blocks) -> list[Any]:
    import torch
    from lmcache.utils import CacheEngineKey

    return [CacheEngineKey(MODEL, 1, 0, int.from_bytes(h[:8], "big"), torch.bfloat16) for h in blocks.hashes]


def store(d: Disk, blocks: peers.Blocks, keys: list[Any], calls: list[tuple[int, int]], timeout: float,
          admitted_only: bool = False) -> float:
    """Every call's blocks through batched_submit_put_task; returns once every write completed
    (``admitted_only``: once no key is still being written, for puts the capacity may refuse)."""
    import torch
    from lmcache.v1.memory_management import MemoryFormat

    shape = shape_of(blocks.block_bytes)
    total = sum(n for _, n in calls)
    done = [0]
    lock = threading.Lock()
    all_done = threading.Event()

    def written(key: Any) -> None:
        with lock:
            done[0] += 1
            if done[0] == total:
                all_done.set()

    deadline = time.monotonic() + timeout
    t0 = time.perf_counter()
    for start, n in calls:
        objs = []
        for j in range(n):
            while (obj := d.cpu.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD, eviction=False,
                                         busy_loop=False)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError("the staging pool never had room")
                time.sleep(0.0002)
            blocks.fill(view(obj), start + j)
            objs.append(obj)
        d.disk.batched_submit_put_task(keys[start:start + n], objs, on_complete_callback=written)
        for obj in objs:
            obj.ref_count_down()  # the put task took its own reference
    if admitted_only:
        mine = [k for s, n in calls for k in keys[s:s + n]]
        while any(d.disk.exists_in_put_tasks(k) for k in mine):
            if time.monotonic() > deadline:
                raise TimeoutError("puts never finished")
            time.sleep(0.001)
    elif not all_done.wait(max(0.0, deadline - time.monotonic())):
        raise TimeoutError(f"only {done[0]} of {total} puts finished")
    return time.perf_counter() - t0


def load(d: Disk, keys: list[Any], calls: list[tuple[int, int]], dest: np.ndarray,
         loaded: np.ndarray) -> float:
    t0 = time.perf_counter()
    for start, n in calls:
        objs = d.disk.batched_get_blocking(keys[start:start + n])
        for j, obj in enumerate(objs):
            if obj is None:
                continue
            dest[start + j] = view(obj)
            loaded[start + j] = True
            obj.ref_count_down()
    return time.perf_counter() - t0


def staging(cmd: dict[str, Any], block_bytes: int) -> int:
    return int(cmd["staging_bytes"]) + 4 * block_bytes


def phase(cmd: dict[str, Any]) -> dict[str, Any]:
    blocks = peers.blocks_of(cmd)
    keys = make_keys(blocks)
    res = peers.PhaseResult()
    os.sync()
    d = Disk(cmd["root"], cmd["threads"], 2 * blocks.total_bytes + (64 << 20),
             staging(cmd, blocks.block_bytes))
    try:
        res.store_s = store(d, blocks, keys, blocks.calls, cmd["timeout_s"])
        t0 = time.perf_counter()
        os.sync()
        res.sync_s = time.perf_counter() - t0
        res.files, res.file_bytes, res.disk_bytes = peers.tree_bytes(cmd["root"])
        dest = np.zeros((blocks.n, blocks.block_bytes), dtype=np.uint8)
        for cache in ("warm", "cold"):
            dest.fill(0)
            loaded = np.zeros(blocks.n, dtype=bool)
            if cache == "cold":
                res.cold_dropped = peers.drop_caches() if cmd["drop"] else False
            else:
                peers.warm_tree(cmd["root"])
            setattr(res, f"{cache}_s", load(d, keys, blocks.calls, dest, loaded))
            res.verify(cache, blocks, dest, loaded)
    finally:
        d.close()
    return {"result": asdict(res)}


def guarantees(cmd: dict[str, Any]) -> dict[str, Any]:
    blocks = peers.blocks_of(cmd)
    keys = make_keys(blocks)
    bb, n, timeout = blocks.block_bytes, peers.GUARD_N, cmd["timeout_s"]
    stage = staging(cmd, bb)
    dest = np.zeros((blocks.n, bb), dtype=np.uint8)
    loaded = np.zeros(blocks.n, dtype=bool)
    d1 = os.path.join(cmd["root"], "data")
    d = Disk(d1, cmd["threads"], 4 * blocks.total_bytes, stage)
    try:
        store(d, blocks, keys, [(0, n)], timeout)
        peers.flip_middle_byte(d.disk._key_to_path(keys[0]))
        load(d, keys, [(0, 1)], dest, loaded)
    finally:
        d.close()
    wrong, wrong_ok = peers.wrong_verdict(blocks, dest, loaded)
    d = Disk(d1, cmd["threads"], 4 * blocks.total_bytes, stage)  # restart: a new backend, same dir
    try:
        dest.fill(0)
        loaded[:] = False
        load(d, keys, [(1, n - 1)], dest, loaded)
    finally:
        d.close()
    restart, restart_ok = peers.restart_verdict(blocks, dest, loaded, n)
    cap_blocks = int(cmd["cap_blocks"])
    cap = cap_blocks * (bb + 8192)
    d2 = os.path.join(cmd["root"], "cap")
    d = Disk(d2, cmd["threads"], cap, stage)
    try:
        for c in range(3):
            store(d, blocks, keys, [(c * cap_blocks, cap_blocks)], timeout, admitted_only=True)
        files = peers.data_files(d2, ".pt")
        used = sum(p.stat().st_size for p in files)
    finally:
        d.close()
    capacity, cap_ok = peers.capacity_verdict(len(files), used, cap)
    return {"result": peers.guarantee(wrong, wrong_ok, capacity, cap_ok, restart, restart_ok)}


def main() -> int:
    send = peers.child_channel()
    try:
        import lmcache._version
        import lmcache.v1.storage_backend.local_disk_backend
        import torch
    except ImportError as exc:
        send({"ready": False, "why": f"{type(exc).__name__}: {exc}"})
        return 0
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("lmcache").setLevel(logging.ERROR)
    send({"ready": True, "version": f"lmcache {lmcache._version.__version__}, torch {torch.__version__}"})
    peers.serve_child(send, {"phase": phase, "guarantees": guarantees})
    return 0


if __name__ == "__main__":
    peers.child_signals()
    sys.exit(main())
