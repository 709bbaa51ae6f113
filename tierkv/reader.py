"""The read half of the facade: ``get`` (copy blocks out) and ``borrow`` (lend pool rows).

``get`` copies READY rows out in one batched copy per run, waits for PENDING ones (promotions
land batch by batch, so it copies as they arrive), and reads blocks no primary slot holds straight
into the caller's rows through the gateways, keeping them in the primary when a slot is free.
``borrow`` lends the rows where they lie in the pool, pinned until the caller is done.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import anyio
import torch

from tierkv.admission import Admission, Request
from tierkv.cascade import Cascader
from tierkv.engine import EngineSlots
from tierkv.errors import BlockMissing
from tierkv.gateway import TierGateway
from tierkv.metrics import TierStats
from tierkv.pool import SlotPool, SlotState, contiguous_run
from tierkv.promotion import Promoter
from tierkv.tensors import row_span, take_rows

__all__ = ["Reader"]


class Reader:
    """``get`` and ``borrow`` over one store's state (locks taken here, never held across awaits)."""

    def __init__(self, *, lock: Any, admission: Admission, gateways: Sequence[TierGateway],
                 cascader: Cascader, promoter: Promoter, engine: EngineSlots, stats: TierStats,
                 changed: Callable[[], None]) -> None:
        self._lock = lock
        self._admission = admission
        self._gateways = gateways
        self._cascader = cascader
        self._promoter = promoter
        self._engine = engine
        self._stats = stats
        self._changed = changed

    def _waiter(self, key: bytes) -> anyio.Event | None:
        landing = self._promoter.promoting.get(key)
        return landing.event if landing is not None else self._engine.storing(key)

    def _done(self, req: Request | None, group: int, keys: list[bytes]) -> None:
        if req is not None:
            with self._lock:
                self._admission.unpin_many(req, group, keys)
                self._changed()

    async def get(self, group: int, pool: SlotPool, keys: list[bytes], out8: torch.Tensor,
                  req: Request | None) -> None:
        """See :meth:`tierkv.TieredStore.get` (``out8``: the caller's rows as bytes, checked)."""
        todo = list(range(len(keys)))
        missing: list[int] = []
        while todo:
            with self._lock:
                absent, waits = self._copy_resident(pool, keys, todo, out8)
            if absent:
                missing += await self._read_lower(group, pool, keys, absent, out8)
            if waits:
                await next(iter(waits.values())).wait()
            todo = list(waits)
        self._done(req, group, keys)
        if missing:
            raise BlockMissing(f"{len(missing)} of {len(keys)} blocks of group {group} are held"
                               f" by no tier", missing=sorted(missing))

    def _copy_resident(self, pool: SlotPool, keys: list[bytes], todo: list[int],
                       out8: torch.Tensor) -> tuple[list[int], dict[int, anyio.Event]]:
        """Copy READY (and staged) rows out; the rows held by no slot, and events to wait for."""
        ready: list[int] = []
        absent: list[int] = []
        waits: dict[int, anyio.Event] = {}
        index, state = pool.index, pool.state
        for i in todo:
            s = index.get(keys[i])
            if s is None:
                staged = self._cascader.staged_row(keys[i])
                if staged is not None:
                    out8[i].copy_(staged)
                else:
                    absent.append(i)
            elif state[s] is SlotState.READY:
                ready.append(i)
            else:
                ev = self._waiter(keys[i])
                assert ev is not None, "every WRITING slot has an event"
                waits[i] = ev
        if ready:
            slots = [index[keys[i]] for i in ready]
            r = contiguous_run(ready)
            if r is not None:
                pool.read(slots, out8[r[0]:r[1]])
            else:
                tmp = torch.empty((len(ready), pool.block_bytes), dtype=torch.uint8, device=out8.device)
                pool.read(slots, tmp)
                out8.index_copy_(0, torch.tensor(ready, dtype=torch.int64, device=out8.device), tmp)
            for i in ready:
                pool.touch(keys[i])
            self._stats.hits += len(ready)
            self._stats.bytes_read += len(ready) * pool.block_bytes
        return absent, waits

    async def _read_lower(self, group: int, pool: SlotPool, keys: list[bytes], rows: list[int],
                          out8: torch.Tensor) -> list[int]:
        """Read blocks held by no primary slot straight into ``out8``; the rows still missing."""
        left = rows
        now = time.monotonic()
        for gw in self._gateways:
            if not left:
                break
            with self._lock:
                sub = [i for i in left if gw.presence(group, keys[i], now) is not False]
            if not sub:
                continue
            sub_keys = [keys[i] for i in sub]
            ok = await gw.load(group, sub_keys, out8, sub)
            got = [j for j, f in enumerate(ok) if f]
            if got:
                with self._lock:
                    self._keep(pool, [sub_keys[j] for j in got], out8, [sub[j] for j in got])
            done = {sub[j] for j in got}
            left = [i for i in left if i not in done]
        return left

    def _keep(self, pool: SlotPool, keys: list[bytes], src: torch.Tensor, rows: list[int]) -> None:
        """Keep blocks read from a lower tier in the primary when slots can be had now."""
        take = [j for j, k in enumerate(keys) if pool.slot_of(k) is None]
        if not take or pool.available() < len(take) or self._admission.queue:
            return
        got = pool.allocate([keys[j] for j in take])
        if got is None:
            return
        pool.write(got[0], take_rows(src, [rows[j] for j in take]))
        pool.mark_ready(got[0])

    @contextlib.asynccontextmanager
    async def borrow(self, group: int, pool: SlotPool, keys: list[bytes],
                     req: Request | None) -> AsyncIterator[torch.Tensor]:
        """See :meth:`tierkv.TieredStore.borrow`."""
        lender = self._admission.anonymous()
        try:
            while True:
                with self._lock:
                    missing, waits, slots = self._lendable(pool, keys)
                    if not missing and not waits:
                        self._admission.pin_many(lender, group, keys, slots)
                        break
                if missing:
                    raise BlockMissing(f"{len(missing)} of {len(keys)} blocks of group {group} are not "
                                       f"in the primary", missing=missing)
                ev = next((e for e in waits if e is not None), None)
                if ev is None:
                    await anyio.sleep(0)
                else:
                    await ev.wait()
            run = contiguous_run(slots)
            if run is not None:
                rows = row_span(pool.tensor, run[0], run[1])
            else:
                rows = pool.tensor.index_select(0, torch.tensor(slots, dtype=torch.int64, device=pool.device))
            with self._lock:
                pool.touch_many(keys)
                self._stats.hits += len(keys)
                self._stats.bytes_read += len(keys) * pool.block_bytes
            yield rows
        finally:
            with self._lock:
                self._admission.end_call(lender)
            self._done(req, group, keys)

    @contextlib.contextmanager
    def lend(self, group: int, pool: SlotPool, keys: list[bytes]) -> Iterator[list[int] | None]:
        """See :meth:`tierkv.TieredStore.lend_slots`."""
        with self._lock:
            index, state, ready = pool.index, pool.state, SlotState.READY
            slots = [index.get(k) for k in keys]
            if any(s is None or state[s] is not ready for s in slots):
                lender = None
            else:
                lender = self._admission.anonymous()
                self._admission.pin_many(lender, group, keys, slots)  # type: ignore[arg-type]
                pool.touch_many(keys)
                self._stats.hits += len(keys)
                self._stats.bytes_read += len(keys) * pool.block_bytes
        if lender is None:
            yield None
            return
        try:
            yield slots  # type: ignore[misc]
        finally:
            with self._lock:
                self._admission.end_call(lender)

    def _lendable(self, pool: SlotPool, keys: list[bytes]) -> tuple[list[int], list[anyio.Event | None],
                                                                   list[int]]:
        missing: list[int] = []
        waits: list[anyio.Event | None] = []
        slots: list[int] = []
        for i, k in enumerate(keys):
            s = pool.index.get(k)
            if s is None:
                missing.append(i)
            elif pool.state[s] is not SlotState.READY:
                waits.append(self._waiter(k))
            else:
                slots.append(s)
        return missing, waits, slots
