"""The memory a primary pool lives in: private (zero-filled, pinned where CUDA is present) or one
file mapped shared by every process that opens it with the same plan."""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING

import torch

from tierkv.blocks import sharedmem

if TYPE_CHECKING:
    from tierkv.blocks.pool import PoolPlan

__all__ = ["SHM_ALIGN", "allocate_pool_tensor", "shared_pool_tensors"]


def allocate_pool_tensor(rows: int, row_bytes: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """A ``[rows, row_bytes]`` uint8 tensor; pinned when it is on the CPU and CUDA is present.

    Returns the tensor (zero-filled, so its pages are in place) and whether it is pinned. Pinning
    falls back to plain memory when it fails.
    """
    if device.type == "cpu" and torch.cuda.is_available():
        try:
            return torch.zeros((rows, row_bytes), dtype=torch.uint8, pin_memory=True), True
        except RuntimeError:
            pass
    # zeroed, not empty: every page is faulted in now, not on a request's first restore
    return torch.zeros((rows, row_bytes), dtype=torch.uint8, device=device), False


SHM_ALIGN = 4096


def shared_pool_tensors(path: str, plan: PoolPlan) -> dict[int, torch.Tensor]:
    """The plan's pools as views of one file mapped shared (e.g. under ``/dev/shm``).

    Every process that opens the same path with the same plan sees the same bytes; the file is
    created, or resized to what the plan needs (a stale file of another size is fixed, not fatal).
    Group ``g``'s pool starts at the sum of the earlier groups' bytes, each rounded up to 4 KiB.
    The mapping is populated now (``MAP_POPULATE``: the file's pages allocated and mapped into
    this process), as a private pool is zero-filled: a first restore into never-touched shared
    pages ran at a tenth of the speed of one into mapped pages, a page fault every 4 KiB. The
    mapping is registered in :mod:`tierkv.blocks.sharedmem`, so reader processes can read into it.
    """
    offsets, total = {}, 0
    for g in plan.groups:
        offsets[g.group] = total
        total += -(-g.bytes // SHM_ALIGN) * SHM_ALIGN
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size != total:
            os.ftruncate(fd, total)
        mapped = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        sharedmem.register(mapped, fd)
    finally:
        os.close(fd)
    flat = torch.frombuffer(mapped, dtype=torch.uint8)  # the tensor keeps the mapping alive
    return {g.group: flat[offsets[g.group]:offsets[g.group] + g.bytes].view(g.slots, g.block_bytes)
            for g in plan.groups}
