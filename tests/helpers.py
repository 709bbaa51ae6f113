"""Shared builders for tests."""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import struct
import subprocess
from typing import Any

import torch

from tierkv import GroupSpec, Layout

FULL, SCRATCH, SW, REC = 0, 1, 2, 3


def hybrid_layout(bb: int = 1024, window: int = 2, states: int = 1) -> Layout:
    return Layout(tokens_per_block=16, groups=[
        GroupSpec(kind="full", block_bytes=bb),
        GroupSpec(kind="scratch", block_bytes=64),
        GroupSpec(kind="sliding_window", block_bytes=bb, window_blocks=window),
        GroupSpec(kind="recurrent", block_bytes=2 * bb, states_per_request=states),
    ])


def hashes(n: int, doc: int = 0) -> list[bytes]:
    out, prev = [], doc.to_bytes(8, "big")
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "big")).digest()
        out.append(prev)
    return out


def blocks(n: int, nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)


def config(layout: Layout, *lower: dict[str, Any], slots: dict[int, int] | None = None,
           capacity: int | None = None, **kw: Any) -> dict[str, Any]:
    primary: dict[str, Any] = {"kind": "cpu"}
    if slots is not None:
        primary["slots"] = slots
    if capacity is not None:
        primary["capacity_bytes"] = capacity
    return {"layout": layout, "namespace": "test", "max_concurrent_requests": 2,
            "tiers": [primary, *lower], **kw}


def group_stats(store: Any, group: int) -> Any:
    """The ``stats().groups`` entry of one group."""
    return next(g for g in store.stats().groups if g.group == group)


def ctrl_c(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    """Send ``proc`` a Ctrl-C and wait for it to end; its stderr. Fails the test when it does not end."""
    import pytest

    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"{proc.args!r} did not end on Ctrl-C")
    return err


def extents(path: Any) -> int:
    """How many extents hold ``path``'s blocks on disk (``FS_IOC_FIEMAP``, after syncing the file):
    1 when the file lies in one piece."""
    fd = os.open(path, os.O_RDONLY)
    try:
        req = bytearray(struct.pack("=QQIIII", 0, 2**64 - 1, 1, 0, 0, 0))  # FIEMAP_FLAG_SYNC, no extent array
        fcntl.ioctl(fd, 0xC020660B, req)  # FS_IOC_FIEMAP
        return int(struct.unpack_from("=I", req, 20)[0])  # fm_mapped_extents
    finally:
        os.close(fd)


def evict(path: Any) -> None:
    """Drop a file's clean pages from the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
