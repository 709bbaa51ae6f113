"""Running the work lookups ask for: promotions into reserved primary slots, presence probes.

A promotion is one gateway ``load`` straight into the pool rows admission reserved for it; its
blocks become READY batch by batch as they land (a waiting ``get`` can copy them at once), and a
block that fails frees its slot and every pin on it. Probes of one tier and group are batched:
keys asked for while a probe task is scheduled but not started ride along with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import anyio

from tierkv.admission import Admission, Promotion
from tierkv.bridge import LoopBridge
from tierkv.gateway import TierGateway
from tierkv.lookup import Work
from tierkv.pool import SlotPool

__all__ = ["Promoter"]


class Promoter:
    """Starts and tracks promotions and probes for one store (state under the bridge's lock)."""

    def __init__(self, bridge: LoopBridge, pools: Mapping[int, SlotPool], gateways: Sequence[TierGateway],
                 admission: Admission, changed: Callable[[], None]) -> None:
        self._bridge = bridge
        self._pools = pools
        self._gateways = gateways
        self._admission = admission
        self._changed = changed
        #: keys being promoted -> the event set when each lands (or fails)
        self.promoting: dict[bytes, anyio.Event] = {}
        #: keys waiting for a scheduled probe task: (tier position, group) -> keys
        self._probe_batches: dict[tuple[int, int], list[bytes]] = {}

    def start(self, work: Work) -> None:
        """Start the promotions and probes of ``work`` (call under the lock)."""
        for p in work.promotions:
            for k in p.keys:
                self.promoting[k] = anyio.Event()
            self._bridge.begin()
            self._bridge.spawn(self._promote, p)
        for (pos, group), keys in work.probes.items():
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

    async def _promote(self, p: Promotion) -> None:
        gw = self._gateways[p.tier]
        pool = self._pools[p.group]

        def landed(positions: list[int], ok: list[bool]) -> None:
            p.landed(ok)
            good = [p.slots[i] for i, f in zip(positions, ok, strict=True) if f]
            pool.mark_ready(good)
            gw.stats.promotions += len(good)
            for i, f in zip(positions, ok, strict=True):
                key = p.keys[i]
                if not f:
                    gw.stats.promotions_failed += 1
                    self._admission.drop(p.group, key)
                ev = self.promoting.pop(key, None)
                if ev is not None:
                    self._bridge.set_event(ev)

        try:
            await gw.load(p.group, p.keys, pool.tensor, p.slots, on_batch=landed)
        finally:
            with self._bridge.lock:
                left = [i for i, k in enumerate(p.keys) if k in self.promoting]
                if left:  # cancelled (the store is closing): what did not land is dropped
                    landed(left, [False] * len(left))
                self._bridge.end()
                self._changed()

    async def _probe(self, gw: TierGateway, pos: int, group: int) -> None:
        try:
            with self._bridge.lock:
                keys = self._probe_batches.pop((pos, group))
            await gw.probe(group, keys)
        finally:
            with self._bridge.lock:
                self._bridge.end()
                self._changed()
