"""What ``put`` does with new blocks: free (or evictable) primary slots first, the rest straight
to the lower tiers from a private copy, or dropped and counted when no tier takes them.

The copies run outside the store's lock: slots are reserved (WRITING: lookups see PENDING, gets
wait) under it, filled without it, then made READY under it again. A put of megabytes would
otherwise hold every other caller (and the tier threads landing reads) for its whole copy. A put of
at least :data:`THREAD_BYTES` copies on a worker thread, so the caller's event loop (where its own
restores may be waiting) is not held for the copy either.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import torch

from tierkv.blocks.ledger import BlockLedger
from tierkv.movement.cascade import Cascader
from tierkv.tensors import take_rows

__all__ = ["THREAD_BYTES", "put_blocks"]

#: puts of this many bytes or more copy on a worker thread (a hand-off costs tens of microseconds)
THREAD_BYTES = 4 << 20


async def put_blocks(lock: threading.RLock, ledger: BlockLedger, group: int, keys: list[bytes],
                     src: torch.Tensor, cascader: Cascader,
                     committed: Callable[[int, list[bytes], list[int]], None],
                     counts: dict[str, int]) -> None:
    """Store rows ``src[i]`` as ``keys[i]`` (see :func:`_put_now`), on a worker thread when
    ``src`` is large (the call ends, commit included, even when the caller is cancelled meanwhile)."""
    args = (lock, ledger, group, keys, src, cascader, committed, counts)
    if src.device.type == "cpu" and src.numel() * src.element_size() >= THREAD_BYTES:
        await anyio.to_thread.run_sync(_put_now, *args)
    else:
        _put_now(*args)


def _put_now(lock: threading.RLock, ledger: BlockLedger, group: int, keys: list[bytes],
             src: torch.Tensor, cascader: Cascader,
             committed: Callable[[int, list[bytes], list[int]], None], counts: dict[str, int]) -> None:
    """Store rows ``src[i]`` as ``keys[i]`` (the caller does not hold ``lock``); blocks already
    held are only touched. ``committed(group, keys, slots)`` is told of the blocks that became
    READY; ``counts`` gets ``put_blocks_direct`` and ``put_blocks_dropped``."""
    pool = ledger.pools[group]
    with lock:
        new = [i for i, k in enumerate(keys) if pool.slot_of(k) is None]
        if len(new) < len(keys):
            held = set(new)
            ledger.touch(group, [k for i, k in enumerate(keys) if i not in held])
        if not new:
            return
        n = min(len(new), pool.available())
        placed, direct = new[:n], new[n:]
        placed_keys = [keys[i] for i in placed]
        got = ledger.reserve(group, placed_keys) if placed else None
        assert got is not None or not placed, "they fit: available() counted them"
    copy: torch.Tensor | None = None
    filled = False
    try:
        if got is not None:
            pool.write(got[0], take_rows(src, placed))
        if direct:
            copy = take_rows(src, direct).to("cpu", copy=True)
        filled = True
    finally:
        with lock:
            if got is not None:
                ledger.commit(group, placed_keys, filled, committed)
            if copy is not None and cascader.start(group, [keys[i] for i in direct], None, copy):
                counts["put_blocks_direct"] += len(direct)
            elif direct:
                counts["put_blocks_dropped"] += len(direct)
