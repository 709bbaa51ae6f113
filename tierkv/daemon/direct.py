"""Gets of blocks in the daemon's pool without a message: where a block lies, checked against the
daemon's slot table (:mod:`tierkv.blocks.slottable`).

A client remembers the slot of each record it was told of (the answers to its pins and
reservations); a ``get`` whose records all have one reads the slot table: when each slot is READY
and holds its key, the rows are copied out and the table read again, and the copy stands only if
no slot changed meanwhile. Anything else (a slot not known, evicted, reused, being written, the
daemon gone) is left to the pinned get, which asks the daemon. The reads are reported later in
batches (:meth:`DirectReads.touches`): the daemon counts them as hits and keeps the blocks recent for
eviction, a little after the fact.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from tierkv.daemon.link import Attachment
from tierkv.keys import GROUP_BYTES
from tierkv.tensors import contiguous_run, wide_view

__all__ = ["TOUCH_BATCH", "TOUCH_EVERY_S", "DirectReads", "gather"]

#: records read directly that are reported in one message at the latest
TOUCH_BATCH = 1024
#: ... or once this long passed since the last report (checked at the next call)
TOUCH_EVERY_S = 0.05


def gather(pool: torch.Tensor, slots: Sequence[int], out8: torch.Tensor) -> None:
    """``out8[i] = pool[slots[i]]`` in one batched copy (one ``copy_`` for a run of slots)."""
    run = contiguous_run(slots)
    if run is not None:
        out8.copy_(pool[run[0]:run[1]])
        return
    src, dst = wide_view(pool), wide_view(out8)
    if src.dtype != dst.dtype:
        src, dst = pool, out8
    torch.index_select(src, 0, torch.tensor(list(slots), dtype=torch.int64), out=dst)


class DirectReads:
    """One store's known slots and unreported direct reads (see the module docstring)."""

    def __init__(self, limit: int = 1 << 20) -> None:
        self._pool_id = ""
        self._slot: dict[bytes, int] = {}
        self._limit = limit
        self._read: dict[int, list[bytes]] = {}
        self._pending = 0
        self._last = time.monotonic()
        #: gets served without a message (for tests and curiosity)
        self.served = 0

    def learn(self, pool_id: str, keys: Sequence[bytes], slots: Sequence[int | None]) -> None:
        """The daemon said ``keys[i]`` is in slot ``slots[i]`` of the pool ``pool_id``."""
        if pool_id != self._pool_id or len(self._slot) > self._limit:
            self._slot.clear()
            self._pool_id = pool_id
        for k, s in zip(keys, slots, strict=True):
            if s is not None:
                self._slot[k] = s

    def get(self, at: Attachment | None, group: int, keys: list[bytes], out8: torch.Tensor) -> bool:
        """Copy the records ``keys`` into ``out8``'s rows from where they were last known to lie;
        True when every one was there, READY, before and after the copy (else ``out8`` holds
        nothing to rely on)."""
        if at is None or at.pool_id != self._pool_id:
            return False
        table, pool = at.tables.get(group), at.pools.get(group)
        if table is None or pool is None:
            return False
        known = self._slot
        slots = [known.get(k) for k in keys]
        if None in slots:
            return False
        ready: list[int] = slots  # type: ignore[assignment]
        before = table.snapshot(ready, keys)
        if before is None:
            return False
        gather(pool, ready, out8)
        if not table.unchanged(ready, before):
            return False
        self._read.setdefault(group, []).extend(keys)
        self._pending += len(keys)
        self.served += 1
        return True

    def touches(self, force: bool = False) -> list[dict[str, object]]:
        """The messages reporting the direct reads not reported yet, when a batch is due (or
        ``force``); each is sent without waiting for an answer."""
        now = time.monotonic()
        due = force or self._pending >= TOUCH_BATCH or now - self._last >= TOUCH_EVERY_S
        if not self._pending or not due:
            return []
        msgs: list[dict[str, object]] = []
        for group, keys in self._read.items():
            distinct = [k[:-GROUP_BYTES].hex() for k in dict.fromkeys(keys)]  # no hash twice in a message
            msgs += [{"op": "touch", "g": group, "h": distinct[i:i + TOUCH_BATCH], "nr": True}
                     for i in range(0, len(distinct), TOUCH_BATCH)]
        self._read.clear()
        self._pending = 0
        self._last = now
        return msgs
