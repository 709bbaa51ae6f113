"""The scheduler side: vLLM's ``OffloadingManager`` contract over a :class:`~tierkv.TieredStore`.

The store runs on its own event loop in a background thread; vLLM's calls go straight to the
store's synchronous, lock-protected API, so none of them waits on I/O or on the loop.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Collection, Iterable
from contextlib import AbstractContextManager
from typing import Any

import anyio.from_thread
import numpy as np
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from tierkv.keys import GROUP_BYTES
from tierkv.layout import Layout
from tierkv.store import KeyState, TieredStore

__all__ = ["TierKVLoadStoreSpec", "TierKVOffloadingManager"]

log = logging.getLogger("tierkv.vllm")

_RESULT = {
    KeyState.READY: LookupResult.HIT,
    KeyState.STORING: LookupResult.HIT_PENDING,
    KeyState.PROMOTING: LookupResult.HIT_PENDING,
    KeyState.PROBING: LookupResult.RETRY,
    KeyState.QUEUED: LookupResult.RETRY,
    KeyState.MISS: LookupResult.MISS,
}

#: counters reported through vLLM's connector stats (declared in the spec's metric definitions)
STAT_COUNTERS = {
    "tierkv:lower_tier_hits": "Blocks promoted from tierkv's lower tiers into the CPU pool",
    "tierkv:bytes_promoted": "Bytes read from tierkv's lower tiers",
    "tierkv:bytes_cascaded": "Bytes written to tierkv's lower tiers",
    "tierkv:stores_shed": "Cascades to lower tiers shed under backpressure",
    "tierkv:stores_failed": "Cascades to lower tiers that failed",
    "tierkv:corrupt_records": "Records that failed verification (counted misses)",
}
STAT_GAUGES = {"tierkv:promotions_pending": "Promotions in flight"}


class TierKVLoadStoreSpec(LoadStoreSpec):  # type: ignore[misc,unused-ignore]
    """Where blocks sit in tierkv's shared CPU pool: one (group index, slot) per key, in order."""

    def __init__(self, groups: list[int], slots: list[int]) -> None:
        self.groups = np.asarray(groups, dtype=np.int64)
        self.slots = np.asarray(slots, dtype=np.int64)

    @staticmethod
    def medium() -> str:
        """vLLM's name for where these blocks live."""
        return "TIERKV"

    def __repr__(self) -> str:
        return f"TierKVLoadStoreSpec(groups={self.groups.tolist()}, slots={self.slots.tolist()})"


class TierKVOffloadingManager(OffloadingManager):  # type: ignore[misc,unused-ignore]
    """vLLM's offloading manager backed by tierkv's pools and lower tiers."""

    def __init__(self, store_config: dict[str, Any], group_order: list[int],
                 enable_events: bool = False, cleanup: list[str] | None = None) -> None:
        self._portal_cm: AbstractContextManager[Any] = anyio.from_thread.start_blocking_portal("asyncio")
        portal = self._portal_cm.__enter__()
        self._store_cm = portal.wrap_async_context_manager(TieredStore(store_config))
        try:
            self.store: TieredStore = self._store_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self.layout: Layout = self.store.layout
        self._cacheable = frozenset(self.layout.cacheable_groups)
        self._order = {g: i for i, g in enumerate(group_order)}
        #: the 4-byte tail of a key -> its group, for the groups that have pools
        self._tails = {g.to_bytes(GROUP_BYTES, "big"): g for g in self._cacheable}
        self._events_on = enable_events
        self._events: list[OffloadingEvent] = []
        self._events_lock = threading.Lock()
        self._closed = False
        self._cleanup = list(cleanup or [])
        self._last: dict[str, float] = {}
        if enable_events:
            for pool in self.store.pools.values():
                pool.on_evict = self._on_evict

    def _on_evict(self, keys: list[bytes]) -> None:
        with self._events_lock:
            self._events.append(OffloadingEvent(keys=[OffloadKey(k) for k in keys], medium=Medium.CPU,
                                                removed=True))

    # ---- lookups ---------------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT; HIT_PENDING while a store or promotion is in flight; RETRY while a probe runs or the
        request waits for a slot; MISS otherwise."""
        group = self._tails.get(key[-GROUP_BYTES:])
        if group is None or len(key) <= GROUP_BYTES:
            return LookupResult.MISS
        return _RESULT[self.store.key_state(group, key, req_context.req_id)]

    def _by_tail(self, keys: Collection[OffloadKey]) -> list[tuple[int, list[bytes]]]:
        """Keys of cacheable groups bucketed per group, groups in the engine's order.

        Within a group the engine's order is kept: vLLM lists keys and GPU blocks in the same
        group-major, chunk order, which is how the worker pairs them.
        """
        buckets: dict[bytes, list[bytes]] = {}
        for key in keys:
            tail = key[-GROUP_BYTES:]
            b = buckets.get(tail)
            if b is None:
                b = buckets[tail] = []
            b.append(key)
        out = [(g, b) for t, b in buckets.items() if (g := self._tails.get(t)) is not None]
        if len(out) > 1:
            out.sort(key=lambda e: self._order.get(e[0], e[0]))
        return out

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Slots of the blocks a request looked up as HIT (pinned for it until complete_load)."""
        groups: list[int] = []
        slots: list[int] = []
        for g, gkeys in self._by_tail(keys):
            found = self.store.ready_slots_keys(g, gkeys)
            if None in found:
                raise RuntimeError("prepare_load of a block that is not ready: tierkv pins HITs, so"
                                   " this means the connector loaded a key it did not look up")
            groups += [g] * len(found)
            slots += [s for s in found if s is not None]
        return TierKVLoadStoreSpec(groups, slots)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Recency is refreshed by lookups; nothing more to do."""

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """The request has its blocks: drop its pins on them."""
        for g, gkeys in self._by_tail(keys):
            self.store.unpin_keys(g, gkeys, req_context.req_id)

    # ---- stores ----------------------------------------------------------------------------------
    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        """Reserve slots for keys not held yet (evicting); None when the pool cannot make room."""
        reserved: list[tuple[int, list[bytes]]] = []
        to_store: list[bytes] = []
        groups: list[int] = []
        slots: list[int] = []
        evicted: list[bytes] = []
        for g, gkeys in self._by_tail(keys):
            res = self.store.reserve_keys(g, gkeys)
            if res is None:
                for rg, rk in reserved:
                    self.store.commit_keys(rg, rk, success=False)
                return None
            new = [(k, s) for k, s in zip(gkeys, res.slots, strict=True) if s is not None]
            nkeys = [k for k, _ in new]
            reserved.append((g, nkeys))
            to_store += nkeys
            groups += [g] * len(nkeys)
            slots += [s for _, s in new]
            evicted += res.evicted
        return PrepareStoreOutput(keys_to_store=[OffloadKey(k) for k in to_store],
                                  store_spec=TierKVLoadStoreSpec(groups, slots),
                                  evicted_keys=[OffloadKey(k) for k in evicted])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        """Stored blocks become visible and cascade down; failed ones are freed and never seen."""
        for g, gkeys in self._by_tail(keys):
            self.store.commit_keys(g, gkeys, success=success)
            if success and self._events_on:
                with self._events_lock:
                    stored = [OffloadKey(k) for k in gkeys]
                    self._events.append(OffloadingEvent(keys=stored, medium=Medium.CPU, removed=False))

    # ---- request life ----------------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Chunk-level offloading, vLLM's default."""
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Drop every pin the request holds (leases cover requests vLLM never finishes)."""
        self.store.release(req_context.req_id)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored and evicted keys since the last call (when KV cache events are on)."""
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def has_pending_work(self) -> bool:
        """True while promotions, probes, queued requests or cascades are in flight."""
        return not self._closed and self.store.has_pending_work()

    def reset_cache(self) -> None:
        """Empty the CPU pool (lower tiers keep their blocks)."""
        self.store.clear_primary()

    def get_stats(self) -> Any:
        """Counters since the last call, as vLLM's connector stats."""
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
                OffloadingConnectorStats,
            )
        except ImportError:
            return None
        st = self.store.stats()
        lower = st.tiers[1:]
        now = {
            "tierkv:lower_tier_hits": float(sum(t.promotions for t in lower)),
            "tierkv:bytes_promoted": float(sum(t.bytes_read for t in lower)),
            "tierkv:bytes_cascaded": float(sum(t.bytes_written for t in lower)),
            "tierkv:stores_shed": float(sum(t.stores_shed for t in lower)),
            "tierkv:stores_failed": float(sum(t.stores_failed for t in lower)),
            "tierkv:corrupt_records": float(sum(t.backend.get("corrupt", 0) for t in lower)),
        }
        stats = OffloadingConnectorStats()
        for name, value in now.items():
            delta = value - self._last.get(name, 0.0)
            if delta:
                stats.increase_counter(name, delta)
        self._last = now
        stats.set_gauge("tierkv:promotions_pending", float(st.promotions_pending))
        return stats

    def shutdown(self) -> None:
        """Wait for accepted cascades, close the store and stop its thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._store_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)
            for path in self._cleanup:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
