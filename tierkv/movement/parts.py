"""The parts of an open store, built once over the primary's pools and the lower tiers' gateways:
the composition root :class:`~tierkv.store.TieredStore` holds."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tierkv.blocks.admission import Admission
from tierkv.blocks.ledger import BlockLedger
from tierkv.blocks.pool import SlotPool
from tierkv.bridge import LoopBridge
from tierkv.layout import Layout
from tierkv.movement.cascade import Cascader
from tierkv.movement.costmodel import CostModel
from tierkv.movement.engine import EngineSlots
from tierkv.movement.gateway import TierGateway
from tierkv.movement.keystates import KeyLookups
from tierkv.movement.lookup import Resolver
from tierkv.movement.promotion import Promoter
from tierkv.movement.reader import Reader
from tierkv.observing.metrics import TierStats

__all__ = ["Parts"]


@dataclass(frozen=True)
class Parts:
    """Who does what in an open store: admission and the ledger (the block's life in the primary),
    the resolver (prefix lookups) and per-key lookups, the promoter, the cascader, the reader
    (``get``, ``borrow``) and the engine slot API, over ``pools`` and one gateway per lower tier."""

    pools: Mapping[int, SlotPool]
    gateways: list[TierGateway]
    admission: Admission
    ledger: BlockLedger
    cascader: Cascader
    promoter: Promoter
    resolver: Resolver
    keys: KeyLookups
    engine: EngineSlots
    reader: Reader
    primary_stats: TierStats
    counts: dict[str, int]

    @classmethod
    def build(cls, *, layout: Layout, pools: Mapping[int, SlotPool], gateways: list[TierGateway],
              bridge: LoopBridge, cost: CostModel, admission_config: Any, primary_stats: TierStats,
              check_open: Callable[[], None], counts: dict[str, int]) -> Parts:
        """Wire the parts; ``primary_stats`` and ``counts`` (``evictions_unbacked``) are the store's
        counters the parts add to."""
        admission = Admission(pools, admission_config)
        ledger = BlockLedger(pools, admission, bridge.set_event)
        cascader = Cascader(bridge, ledger, gateways)
        promoter = Promoter(bridge, ledger, gateways)
        resolver = Resolver(layout, ledger, gateways, admission, promoter, cost)
        keys = KeyLookups(resolver)
        committed: list[Callable[[int, list[bytes], list[int]], None]] = []
        engine = EngineSlots(lock=bridge.lock, layout=layout, ledger=ledger, admission=admission,
                             resolver=resolver, keys=keys, check_open=check_open, stats=primary_stats,
                             committed=lambda g, keys, slots: committed[0](g, keys, slots))
        reader = Reader(bridge=bridge, ledger=ledger, admission=admission, gateways=gateways,
                        promoter=promoter, stats=primary_stats)
        parts = cls(pools, gateways, admission, ledger, cascader, promoter, resolver, keys, engine, reader,
                    primary_stats, counts)
        committed.append(parts.committed)
        ledger.subscribe(parts.admit_queued)
        for g, pool in pools.items():
            pool.on_evict = functools.partial(parts.evicted, g)
        return parts

    def stats_fields(self) -> dict[str, Any]:
        """The parts' share of the store's :class:`~tierkv.observing.metrics.StoreStats`."""
        return {"requests_active": len(self.admission.requests), "admission_queue": len(self.admission.queue),
                "pending_seconds": self.resolver.pending_seconds.snapshot(),
                "promotions_pending": len(self.ledger.promoting),
                "leases_expired": self.admission.leases_expired}

    def admit_queued(self) -> None:
        """Slots may have come free: admit the requests waiting in the queue, first come first
        served, and start their promotions (under the lock)."""
        if self.admission.queue:
            self.promoter.start(self.admission.service(self.resolver.held_by))

    def committed(self, group: int, keys: list[bytes], slots: list[int]) -> None:
        """Blocks just became READY in the primary (a ``put``, an engine's commit): count them and
        cascade them down."""
        self.primary_stats.stores += len(slots)
        self.primary_stats.bytes_written += len(slots) * self.pools[group].block_bytes
        self.cascader.start(group, keys, slots, None)

    def evicted(self, group: int, keys: list[bytes]) -> None:
        """Keys left the primary to make room: count those no lower tier holds; tell the engine's
        listeners."""
        now = time.monotonic()
        unbacked = sum(1 for k in keys if not any(gw.presence(group, k, now) for gw in self.gateways))
        self.counts["evictions_unbacked"] += unbacked
        self.engine.notify_evicted(group, keys)
