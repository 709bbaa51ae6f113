"""What ``put`` does with new blocks: free (or evictable) primary slots first, the rest straight
to the lower tiers from a private copy, or dropped and counted when no tier takes them.

The copies run outside the store's lock: slots are reserved (WRITING: lookups see PENDING, gets
wait) under it, filled without it, then made READY under it again. A put of megabytes would
otherwise hold every other caller (and the tier threads landing reads) for its whole copy. A put of
at least :data:`THREAD_BYTES` made while the store is restoring blocks (promotions in flight, a
``get`` open, or one of them within the last :data:`RESTORING_S`) copies on a worker thread, so
the caller's event loop, where those restores wait, is not held for the copy either. Other puts
copy on the caller's thread: the hand-off, and a second team of torch's copying threads beside the
caller's, cost a large put about a third of its rate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import torch

from tierkv.blocks.ledger import BlockLedger
from tierkv.blocks.pool import SlotPool
from tierkv.movement.cascade import Cascader
from tierkv.tensors import take_rows

__all__ = ["RESTORING_S", "THREAD_BYTES", "put_blocks"]

#: puts of this many bytes or more copy on a worker thread while the store is restoring
THREAD_BYTES = 4 << 20
#: a store that began or landed a promotion this recently is still restoring (its next restore
#: is likely on its way)
RESTORING_S = 0.05


@dataclass
class _Plan:
    """What a put reserved: ``placed`` rows go to ``slots`` (None: none), ``direct`` rows
    straight down; ``hand_off``: copy on a worker thread."""

    pool: SlotPool
    placed: list[int]
    placed_keys: list[bytes]
    slots: list[int] | None
    direct: list[int]
    hand_off: bool


async def put_blocks(lock: threading.RLock, ledger: BlockLedger, group: int, keys: list[bytes],
                     src: torch.Tensor, cascader: Cascader,
                     committed: Callable[[int, list[bytes], list[int]], None],
                     counts: dict[str, int]) -> None:
    """Store rows ``src[i]`` as ``keys[i]`` (the caller does not hold ``lock``); blocks already
    held are only touched. ``committed(group, keys, slots)`` is told of the blocks that became
    READY; ``counts`` gets ``put_blocks_direct`` and ``put_blocks_dropped``. A put whose copy
    runs on a worker thread ends whole, commit included, even when the caller is cancelled."""
    with lock:
        plan = _reserve(ledger, group, keys, src)
    if plan is None:
        return
    copy: torch.Tensor | None = None
    filled = False
    try:
        copy = await anyio.to_thread.run_sync(_copy, plan, src) if plan.hand_off else _copy(plan, src)
        filled = True
    finally:
        with lock:
            if plan.slots is not None:
                ledger.commit(group, plan.placed_keys, filled, committed)
            if copy is not None and cascader.start(group, [keys[i] for i in plan.direct], None, copy):
                counts["put_blocks_direct"] += len(plan.direct)
            elif plan.direct:
                counts["put_blocks_dropped"] += len(plan.direct)


def _reserve(ledger: BlockLedger, group: int, keys: list[bytes], src: torch.Tensor) -> _Plan | None:
    """Touch the blocks held already and reserve slots for the new ones that fit (call under the
    lock); None when every block is held."""
    pool = ledger.pools[group]
    new = [i for i, k in enumerate(keys) if pool.slot_of(k) is None]
    if len(new) < len(keys):
        held = set(new)
        ledger.touch(group, [k for i, k in enumerate(keys) if i not in held])
    if not new:
        return None
    n = min(len(new), pool.available())
    placed = new[:n]
    placed_keys = [keys[i] for i in placed]
    got = ledger.reserve(group, placed_keys) if placed else None
    assert got is not None or not placed, "they fit: available() counted them"
    hand_off = (src.device.type == "cpu" and len(new) * pool.block_bytes >= THREAD_BYTES
                and ledger.restoring(RESTORING_S))
    return _Plan(pool, placed, placed_keys, None if got is None else got[0], new[n:], hand_off)


def _copy(plan: _Plan, src: torch.Tensor) -> torch.Tensor | None:
    """Fill the reserved slots from ``src``; the private copy of the rows going straight down
    (None when none do)."""
    if plan.slots is not None:
        plan.pool.write(plan.slots, take_rows(src, plan.placed))
    return take_rows(src, plan.direct).to("cpu", copy=True) if plan.direct else None
