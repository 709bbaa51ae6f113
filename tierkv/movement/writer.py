"""What ``put`` does with new blocks: free (or evictable) primary slots first, the rest straight
to the lower tiers from a private copy, or dropped and counted when no tier takes them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tierkv.blocks.ledger import BlockLedger
from tierkv.movement.cascade import Cascader
from tierkv.tensors import take_rows

__all__ = ["place_blocks"]


def place_blocks(ledger: BlockLedger, group: int, keys: list[bytes], src: torch.Tensor, cascader: Cascader,
                 committed: Callable[[int, list[bytes], list[int]], None], counts: dict[str, int]) -> None:
    """Store rows ``src[i]`` as ``keys[i]`` (the caller holds the store's lock); blocks already held
    are only touched. ``committed(group, keys, slots)`` is told of the blocks that became READY;
    ``counts`` gets ``put_blocks_direct`` and ``put_blocks_dropped``."""
    pool = ledger.pools[group]
    new = [i for i, k in enumerate(keys) if pool.slot_of(k) is None]
    if len(new) < len(keys):
        held = set(new)
        ledger.touch(group, [k for i, k in enumerate(keys) if i not in held])
    if not new:
        return
    n = min(len(new), pool.available())
    placed = new[:n]
    if placed:
        slots = ledger.place(group, [keys[i] for i in placed], src, placed)
        assert slots is not None, "they fit: available() counted them"
        committed(group, [keys[i] for i in placed], slots)
    direct = new[n:]
    if direct:
        copy = take_rows(src, direct).to("cpu", copy=True)
        if cascader.start(group, [keys[i] for i in direct], None, copy):
            counts["put_blocks_direct"] += len(direct)
        else:
            counts["put_blocks_dropped"] += len(direct)
