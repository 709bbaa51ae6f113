"""Running the work lookups ask for: promotions into reserved primary slots, presence probes.

A promotion is one gateway ``load`` straight into the pool rows admission reserved for it; its
blocks become READY batch by batch as they land (a waiting ``get`` can copy them at once; the
reading thread copies each verified block into the rows of the ``get`` calls listening on its
landing, :mod:`tierkv.blocks.rowsink`), and a block that fails frees its slot and every pin on it.
Probes of one tier and group are batched: keys asked for while a probe task is scheduled but not
started ride along with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierkv.blocks.admission import Promotion, Request
from tierkv.blocks.ledger import BlockLedger, Landing
from tierkv.bridge import LoopBridge
from tierkv.movement.gateway import TierGateway

__all__ = ["Promoter"]


class Promoter:
    """Starts promotions and probes for one store and runs them; the ledger records what they do
    to the blocks (state under the bridge's lock)."""

    def __init__(self, bridge: LoopBridge, ledger: BlockLedger, gateways: Sequence[TierGateway]) -> None:
        self._bridge = bridge
        self._gateways = gateways
        self._ledger = ledger
        #: keys waiting for a scheduled probe task: (tier position, group) -> keys
        self._probe_batches: dict[tuple[int, int], list[bytes]] = {}
        #: promotions whose task is scheduled and has not started, by (tier, group, request):
        #: later promotions of the same request ride along (an engine that looks keys up one by
        #: one admits one block per lookup; they load as one batch, not one read call each)
        self._scheduled: dict[tuple[int, int, Request | None], tuple[Promotion, Landing]] = {}

    def start(self, promotions: list[Promotion],
              probes: dict[tuple[int, int], list[bytes]] | None = None) -> None:
        """Start ``promotions`` and the presence ``probes`` ((tier position, group) -> keys) a
        lookup or the admission queue asked for (call under the lock)."""
        for p in promotions:
            slot = (p.tier, p.group, p.request)
            waiting = self._scheduled.get(slot)
            if waiting is not None:
                first, landing = waiting
                first.keys.extend(p.keys)
                first.slots.extend(p.slots)
                first.tokens.extend(p.tokens)
                self._ledger.begin_promotion(p, landing)
            else:
                self._scheduled[slot] = (p, self._ledger.begin_promotion(p))
                self._bridge.begin()
                self._bridge.spawn(self._promote, slot)
        for (pos, group), keys in (probes or {}).items():
            gw = self._gateways[pos]
            keys = [k for k in dict.fromkeys(keys) if k not in gw.probing]
            if not keys:
                continue
            gw.probing.update(keys)
            batch = self._probe_batches.get((pos, group))
            if batch is not None:  # a probe task is scheduled and has not started: it takes these
                batch.extend(keys)
                continue
            self._probe_batches[(pos, group)] = list(keys)
            self._bridge.begin()
            self._bridge.spawn(self._probe, gw, pos, group)

    async def _promote(self, slot: tuple[int, int, Request | None]) -> None:
        with self._bridge.lock:
            p, landing = self._scheduled.pop(slot)  # what rides along is in p from here on
        gw = self._gateways[p.tier]
        pool = self._ledger.pools[p.group]
        #: positions not landed or failed yet: only these are this promotion's to end
        open_ = bytearray(b"\x01") * len(p.keys)
        remaining = [len(p.keys)]

        def landed(positions: list[int], ok: list[bool]) -> None:
            mine = [(i, f) for i, f in zip(positions, ok, strict=True) if open_[i]]
            if not mine:
                return
            for i, _ in mine:
                open_[i] = 0
            remaining[0] -= len(mine)
            n = self._ledger.end_promotion(p, landing, [i for i, _ in mine], [f for _, f in mine],
                                           last=remaining[0] == 0)
            gw.stats.promotions += n
            gw.stats.promotions_failed += len(mine) - n

        def verified(pos: int, row: torch.Tensor) -> None:  # in the reading thread
            for sink in landing.sinks:
                sink.fill(p.keys[pos], row)

        try:
            await gw.load(p.group, p.keys, pool.tensor, p.slots, on_batch=landed, on_row=verified)
        finally:
            with self._bridge.lock:
                left = [i for i in range(len(p.keys)) if open_[i]]
                if left:  # cancelled (the store is closing): what did not land is dropped
                    landed(left, [False] * len(left))
                self._bridge.end()
                self._ledger.changed()

    async def _probe(self, gw: TierGateway, pos: int, group: int) -> None:
        try:
            with self._bridge.lock:
                keys = self._probe_batches.pop((pos, group))
            await gw.probe(group, keys)
        finally:
            with self._bridge.lock:
                self._bridge.end()
                self._ledger.changed()
