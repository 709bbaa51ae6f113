"""The read half of the facade: ``get`` (copy blocks out) and ``borrow`` (lend pool rows).

``get`` copies READY rows out in one batched copy per run, waits for PENDING ones (promotions
land batch by batch, so it copies as they arrive; the threads reading a promotion it listens on
copy each verified block into its row at once), and promotes blocks no primary slot holds,
waiting for them the same way (only a pool with no room now makes it read them aside). Every
byte reaches the caller's rows through the call's :class:`~tierkv.blocks.rowsink.RowSink`.
``borrow`` lends the rows where they lie in the pool, pinned until the caller is done.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import anyio
import torch

from tierkv.blocks.admission import Admission, Request
from tierkv.blocks.ledger import BlockLedger, Landing
from tierkv.blocks.pool import SlotPool, SlotState
from tierkv.blocks.rowsink import RowSink
from tierkv.bridge import LoopBridge
from tierkv.errors import BlockMissing
from tierkv.movement.gateway import TierGateway
from tierkv.movement.promotion import Promoter
from tierkv.observing.metrics import TierStats
from tierkv.tensors import contiguous_run, row_span

__all__ = ["Reader"]


class Reader:
    """``get`` and ``borrow`` over one store's state (locks taken here, never held across awaits)."""

    def __init__(self, *, bridge: LoopBridge, ledger: BlockLedger, admission: Admission,
                 gateways: Sequence[TierGateway], promoter: Promoter, stats: TierStats) -> None:
        self._bridge = bridge
        self._lock = bridge.lock
        self._ledger = ledger
        self._admission = admission
        self._gateways = gateways
        self._promoter = promoter
        self._stats = stats

    def _done(self, req: Request | None, group: int, keys: list[bytes]) -> None:
        if req is not None:
            with self._lock:
                self._ledger.unpin(req, group, keys)

    async def get(self, group: int, pool: SlotPool, keys: list[bytes], out8: torch.Tensor,
                  req: Request | None) -> None:
        """See :meth:`tierkv.TieredStore.get` (``out8``: the caller's rows as bytes, checked).

        One road for every block: READY rows are copied out; blocks on their way are waited for;
        a block no slot holds is promoted (slots reserved and pinned for this call, the read
        landing in the pool) and waited for like any other. Only when the pool has no room now
        is a block read into a buffer of the read's own. The caller's rows are written only
        here, by copies: cancelling ``get`` always cuts its wait, whatever a tier's read does.
        """
        todo = list(range(len(keys)))
        missing: list[int] = []
        promoted: set[int] = set()
        sink = RowSink(out8, keys)
        listened: list[Landing] = []
        with self._lock:
            call = self._admission.open_call()
        try:
            while todo:
                with self._lock:
                    absent, waits = self._copy_resident(pool, keys, todo, sink)
                    if absent:
                        absent = self._promote(group, keys, absent, promoted, call, waits)
                    if waits and out8.device.type == "cpu":
                        self._ledger.listen([keys[i] for i in waits], sink, listened)
                if absent:
                    missing += await self._read_aside(group, pool, keys, absent, sink)
                if waits:
                    await next(iter(waits.values())).wait()
                todo = list(waits)
        finally:
            sink.close()
            with self._lock:
                self._ledger.unlisten(listened, sink)
                self._admission.end_call(call)
        self._done(req, group, keys)
        if missing:
            raise BlockMissing(f"{len(missing)} of {len(keys)} blocks of group {group} are held"
                               f" by no tier", missing=sorted(missing))

    def _copy_resident(self, pool: SlotPool, keys: list[bytes], todo: list[int],
                       sink: RowSink) -> tuple[list[int], dict[int, anyio.Event]]:
        """Copy READY (and staged) rows out, but for those a reading thread filled already; the
        rows held by no slot, and events to wait for."""
        ready: list[int] = []
        filled: list[bytes] = []  # rows a reading thread filled: only touched here
        absent: list[int] = []
        waits: dict[int, anyio.Event] = {}
        index, state = pool.index, pool.state
        for i in todo:
            s = index.get(keys[i])
            if s is None:
                staged = self._ledger.staged_row(keys[i])
                if staged is not None:
                    sink.copy_rows([i], staged.unsqueeze(0))
                else:
                    absent.append(i)
            elif state[s] is SlotState.READY:
                if sink.filled(i):
                    filled.append(keys[i])
                else:
                    ready.append(i)
            else:
                ev = self._ledger.waiter(keys[i])
                assert ev is not None, "every WRITING slot has an event"
                waits[i] = ev
        if ready:
            sink.copy_slots(ready, pool, [index[keys[i]] for i in ready])
        if ready or filled:
            self._ledger.touch(pool.group, filled + [keys[i] for i in ready])
        n = len(ready) + len(filled)
        self._stats.hits += n
        self._stats.bytes_read += n * pool.block_bytes
        return absent, waits

    def _promote(self, group: int, keys: list[bytes], rows: list[int], promoted: set[int],
                 call: Request, waits: dict[int, anyio.Event]) -> list[int]:
        """Promote the blocks of ``rows`` a lower tier may hold into slots pinned for ``call``
        and add their landings to ``waits`` (call under the lock). Returns the rows left to read
        aside: those promoted once already (their promotion failed: the other tiers are tried),
        those no tier may hold, and all of them when the pool has no room now."""
        now = time.monotonic()
        first: dict[bytes, int] = {}
        wants: list[tuple[bytes, int]] = []
        aside: list[int] = []
        for i in rows:
            k = keys[i]
            if i in promoted:
                aside.append(i)
                continue
            if k in first:  # the same key twice: both rows wait for one landing
                continue
            tier = next((p for p, gw in enumerate(self._gateways)
                         if gw.presence(group, k, now) is not False), None)
            if tier is None:
                aside.append(i)
                continue
            first[k] = i
            wants.append((k, tier))
        started = self._admission.reserve(call, group, wants) if wants else None
        if started is None:
            return rows
        self._promoter.start(started)
        for i in rows:
            if i not in promoted and keys[i] in first:
                ev = self._ledger.waiter(keys[i])
                assert ev is not None, "just started"
                waits[i] = ev
                promoted.add(i)
        return aside

    async def _read_aside(self, group: int, pool: SlotPool, keys: list[bytes], rows: list[int],
                          sink: RowSink) -> list[int]:
        """Read blocks held by no primary slot into a buffer of the read's own, in a task of the
        store's, then copy them into their rows: the rows still missing. A cancelled caller stops
        waiting at once; the read ends on its own."""
        buf = torch.empty((len(rows), pool.block_bytes), dtype=torch.uint8)
        sub_keys = [keys[i] for i in rows]
        done = anyio.Event()
        result: list[list[bool]] = []

        async def read() -> None:
            try:
                result.append(await self._read_lower(group, sub_keys, buf))
            finally:
                with self._lock:
                    self._bridge.end()
                self._bridge.set_event(done)

        with self._lock:
            self._bridge.begin()
        self._bridge.spawn(read)
        await done.wait()
        ok = result[0] if result else [False] * len(rows)
        got = [j for j, f in enumerate(ok) if f]
        if got:
            src = buf if len(got) == len(rows) else buf[got]
            sink.copy_rows([rows[j] for j in got], src)
            with self._lock:
                self._keep(group, pool, [sub_keys[j] for j in got], src)
        return [rows[j] for j, f in enumerate(ok) if not f]

    async def _read_lower(self, group: int, keys: list[bytes], buf: torch.Tensor) -> list[bool]:
        """Read ``keys`` into the rows of ``buf`` from the first lower tier that may hold each."""
        ok = [False] * len(keys)
        left = list(range(len(keys)))
        now = time.monotonic()
        for gw in self._gateways:
            if not left:
                break
            with self._lock:
                sub = [i for i in left if gw.presence(group, keys[i], now) is not False]
            if not sub:
                continue
            loaded = await gw.load(group, [keys[i] for i in sub], buf, sub)
            for i, f in zip(sub, loaded, strict=True):
                ok[i] = f
            left = [i for i in left if not ok[i]]
        return ok

    def _keep(self, group: int, pool: SlotPool, keys: list[bytes], src: torch.Tensor) -> None:
        """Keep blocks read aside in the primary when slots can be had now."""
        take = [j for j, k in enumerate(dict.fromkeys(keys)) if pool.slot_of(k) is None]
        uniq = list(dict.fromkeys(keys))
        if not take or pool.available() < len(take) or self._admission.queue:
            return
        pos = {k: j for j, k in enumerate(keys)}
        self._ledger.place(group, [uniq[j] for j in take], src, [pos[uniq[j]] for j in take])

    @contextlib.asynccontextmanager
    async def borrow(self, group: int, pool: SlotPool, keys: list[bytes],
                     req: Request | None) -> AsyncIterator[torch.Tensor]:
        """See :meth:`tierkv.TieredStore.borrow`."""
        with self._lock:
            lender = self._admission.open_call()
        try:
            while True:
                with self._lock:
                    missing, waits, slots = self._lendable(pool, keys)
                    if not missing and not waits:
                        self._ledger.pin(lender, group, keys, slots)
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
                self._ledger.touch(group, keys)
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
                lender = self._admission.open_call()
                self._ledger.pin(lender, group, keys, slots)  # type: ignore[arg-type]
                self._ledger.touch(group, keys)
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
                waits.append(self._ledger.waiter(k))
            else:
                slots.append(s)
        return missing, waits, slots
