"""Cascades: writing blocks from the primary down to every lower tier, in the background.

A cascade pins the primary slots it reads until every tier it was admitted to has written them
(or failed); blocks that found no primary slot cascade from a private copy (*staged* in the
:class:`~tierkv.blocks.ledger.BlockLedger`), which lookups and ``get`` see until the cascade ends. Each
tier's gateway admits or sheds the cascade (semantics 7: stores are shed, counted, before loads
suffer); ``flush`` waits for every cascade that was admitted, then writes what waits in the retry
queue of each tier that answers (:mod:`tierkv.observing.health`), until none is left.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import torch

from tierkv.blocks.ledger import BlockLedger
from tierkv.bridge import LoopBridge
from tierkv.movement.gateway import TierGateway
from tierkv.observing.health import Retry

__all__ = ["REDO_BATCH", "Cascader"]

#: blocks of one tier's retry queue re-cascaded at once
REDO_BATCH = 256


class Cascader:
    """Starts and tracks cascades for one store (state changes under the bridge's lock)."""

    def __init__(self, bridge: LoopBridge, ledger: BlockLedger, gateways: Sequence[TierGateway]) -> None:
        self._bridge = bridge
        self._ledger = ledger
        self._pools = ledger.pools
        self._gateways = gateways
        self.running = 0
        #: blocks of admitted cascades not finished yet, per tier index
        self.pending: dict[int, int] = {}
        #: staged blocks no tier took: held by nothing once their cascades ended
        self.dropped = 0
        self._idle = anyio.Event()
        self._idle.set()

    def start(self, group: int, keys: list[bytes], slots: list[int] | None,
              copy: torch.Tensor | None, only: TierGateway | None = None, attempts: int = 0) -> int:
        """Cascade ``keys`` (in ``slots`` of the primary, or rows of ``copy``) to every lower tier
        (or ``only`` that one: a retry of writes that failed ``attempts`` times).

        A tier that is down, or found stalled now, queues the keys for a retry instead. Returns
        how many tiers admitted at least one of the keys (0: nothing will hold a staged copy).
        Call under the lock.
        """
        pool = self._pools[group]
        now = time.monotonic()
        admitted = 0
        for gw in self._gateways if only is None else [only]:
            if only is None and gw.check_stall(now):
                gw.health.requeue(group, keys)  # written when the tier answers, if still in the primary
                continue
            idx = [i for i, k in enumerate(keys) if gw.presence(group, k, now) is not True]
            gw.stats.stores_skipped += len(keys) - len(idx)
            if not idx:
                admitted += 1
                continue
            nbytes = len(idx) * pool.block_bytes
            if not gw.admit_store(nbytes):
                refused = [keys[i] for i in idx]
                if only is not None:  # a retry waits in the queue for room, not shed
                    gw.health.requeue(group, refused, attempts, counted=False)
                elif gw.health.redo or gw.health.retrying:  # it catches up after an outage: in turn
                    gw.health.requeue(group, refused)
                else:
                    gw.shed(len(idx), group, refused)
                continue
            admitted += 1
            sub_keys = [keys[i] for i in idx]
            sub_slots = [slots[i] for i in idx] if slots is not None else None
            if sub_slots is not None:
                self._ledger.pin_cascade(group, sub_slots)
                src, rows = pool.tensor, sub_slots
            else:
                assert copy is not None
                src, rows = copy, idx
                for i, k in zip(idx, sub_keys, strict=True):
                    self._ledger.stage(k, copy[i])
            if self.running == 0:
                self._idle = anyio.Event()
            self.running += 1
            self.pending[gw.index] = self.pending.get(gw.index, 0) + len(sub_keys)
            if only is not None:
                gw.health.retrying += len(sub_keys)
            self._bridge.spawn(self._run, gw, group, sub_keys, src, rows, sub_slots, nbytes, attempts,
                               only is not None)
        return admitted

    def retry(self, group: int, keys: list[bytes], slots: list[int], gw: TierGateway,
              attempts: int = 0) -> None:
        """Write again, to ``gw`` only, queued blocks (in ``slots`` of the primary) whose writes
        failed ``attempts`` times (under the lock)."""
        self.start(group, keys, slots, None, only=gw, attempts=attempts)

    def retry_due(self, gw: TierGateway, limit: int = REDO_BATCH) -> int:
        """Re-cascade to ``gw`` up to ``limit`` blocks of its retry queue, when it is up and
        answers (:meth:`TierHealth.due`); how many were taken from the queue (under the lock)."""
        due: list[Retry] = gw.health.due(self._pools, limit)
        for group, attempts, keys, slots in due:
            self.retry(group, keys, slots, gw, attempts)
        return sum(len(keys) for _, _, keys, _ in due)

    async def _run(self, gw: TierGateway, group: int, keys: list[bytes], src: torch.Tensor,
                   rows: list[int], slots: list[int] | None, nbytes: int, attempts: int, retry: bool) -> None:
        ok = [False] * len(keys)
        try:
            ok = await gw.store(group, keys, src, rows, nbytes, attempts)
        finally:
            with self._bridge.lock:
                self.pending[gw.index] -= len(keys)
                if retry:
                    gw.health.retrying -= len(keys)
                self._done(group, keys, slots, ok)

    def _done(self, group: int, keys: list[bytes], slots: list[int] | None, ok: list[bool]) -> None:
        if slots is not None:
            self._ledger.unpin_cascade(group, slots)
        else:
            for k, stored in zip(keys, ok, strict=True):
                if self._ledger.unstage(k, stored):
                    self.dropped += 1
        self.running -= 1
        if self.running == 0:
            self._bridge.set_event(self._idle)
        self._ledger.changed()

    async def flush(self) -> None:
        """Wait until every admitted cascade has finished (or failed, counted), and the retry
        queue of every tier that is up and answers is written (a tier that is down keeps its
        queue for its health check). Ends: each retry that fails counts an attempt, and a tier
        whose batch of writes fails wholly no longer answers until a check passes."""
        while True:
            while self.running:
                await self._idle.wait()
            with self._bridge.lock:
                queued = sum(len(gw.health.redo) for gw in self._gateways)
                taken = sum(self.retry_due(gw) for gw in self._gateways)
                left = sum(len(gw.health.redo) for gw in self._gateways)
            if not taken or (not self.running and left >= queued):
                return  # nothing due, or nothing could start (it went back to the queue)
