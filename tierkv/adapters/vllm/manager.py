"""The scheduler side: vLLM's ``OffloadingManager`` contract over a :class:`~tierkv.TieredStore`.

The store runs on its own event loop in a background thread (:class:`~tierkv.bridge.LoopThread`);
vLLM's calls go straight to the store's engine slot API (:class:`~tierkv.movement.engine.EngineSlots`),
which is lock-protected and synchronous, so none of them waits on I/O or on the loop.
"""

from __future__ import annotations

import functools
import heapq
import logging
import os
import threading
import time
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from tierkv import Layout, TieredStore
from tierkv.adapter import (
    AHEAD_KEYS,
    GROUP_BYTES,
    LATENCY_BUCKETS,
    MAX_RATE_TOKENS_S,
    DaemonStore,
    EngineSlots,
    KeyState,
    LoopThread,
    Metric,
    samples,
    tier_is_local,
)

__all__ = ["STATS_INTERVAL_S", "RateMeter", "TierKVLoadStoreSpec", "TierKVOffloadingManager",
           "vllm_metric_definitions"]

log = logging.getLogger("tierkv.vllm")

#: vLLM asks for the connector's stats after every engine step; tierkv builds them at most this
#: often (counters add up and histograms keep their observations in between, so nothing is lost).
#: A full snapshot costs 1-3 ms on a 2-core machine (every pool's slot counts), which every
#: request's first step paid (docs/performance.md, "Serving a Mooncake trace")
STATS_INTERVAL_S = 1.0

_RESULT = {
    KeyState.READY: LookupResult.HIT,
    KeyState.STORING: LookupResult.HIT_PENDING,
    KeyState.PROMOTING: LookupResult.HIT_PENDING,
    KeyState.PROBING: LookupResult.RETRY,
    KeyState.QUEUED: LookupResult.RETRY,
    KeyState.MISS: LookupResult.MISS,
}


def vllm_metric_definitions(metrics: Iterable[Metric]) -> dict[str, OffloadingMetricMetadata]:
    """tierkv's metrics as vLLM metric definitions (the same names and labels as everywhere)."""
    out: dict[str, OffloadingMetricMetadata] = {}
    for m in metrics:
        if m.kind == "histogram":
            out[m.full_name] = OffloadingHistogramMetadata(documentation=m.doc, labelnames=m.labels,
                                                           buckets=LATENCY_BUCKETS)
            continue
        cls = OffloadingCounterMetadata if m.kind == "counter" else OffloadingGaugeMetadata
        out[m.full_name] = cls(documentation=m.doc, labelnames=m.labels)
    return out


class CounterDeltas:
    """Turns cumulative samples into vLLM connector stats: counter increases and gauge values."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}

    def stats(self, rows: Iterable[tuple[Metric, tuple[str, ...], float]],
              observations: Iterable[tuple[Metric, tuple[str, ...], list[float]]] = ()) -> Any:
        """An ``OffloadingConnectorStats`` of what changed since the last call (None: nothing);
        ``observations`` are raw durations for the histograms."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        for m, labels, value in rows:
            if m.kind == "gauge":
                stats.set_gauge(m.full_name, value, labels)
                continue
            key = (m.full_name, labels)
            delta = value - self._last.get(key, 0.0)
            self._last[key] = value
            if delta > 0:
                stats.increase_counter(m.full_name, delta, labels)
        for m, labels, values in observations:
            for v in values:
                stats.observe_histogram(m.full_name, v, labels)
        return None if stats.is_empty() else stats


def _following(req_context: ReqContext, key: bytes) -> list[bytes]:
    """The request's keys of ``key``'s group after it, in prefix order, as many as a daemon lookup
    asks ahead: vLLM's scheduler records every key's end position in the request context before
    it looks them up (none when this vLLM does not: the lookups are then one message each)."""
    positions = getattr(req_context, "_offload_key_positions", None)
    if not isinstance(positions, dict) or (at := positions.get(key)) is None:
        return []
    tail = key[-GROUP_BYTES:]
    later = [(p, k) for k, p in positions.items() if p > at and k[-GROUP_BYTES:] == tail]
    return [bytes(k) for _, k in heapq.nsmallest(AHEAD_KEYS - 1, later)]


#: stores being timed at most (beyond, those older than OPEN_MAX_S are dropped)
OPEN_MAX = 4096
OPEN_MAX_S = 60.0


class RateMeter:
    """The engine's prefill rate (tokens/s), timed while the engine computes.

    vLLM prepares a request's stores in the scheduler pass that schedules the tokens they hold
    (before the step computes them) and completes them once the step has computed and copied
    them: the time between is the engine computing them (with whatever else the step ran). The
    first store prepared after a request's lookup (the pass that scheduled its prefill) is timed;
    later ones are decode blocks or later chunks, not counted. Blocks are counted over the union
    of these intervals, in windows of at least ``window_s`` of it: requests computed side by side
    in one step add blocks, not time, and time the engine spends idle between requests adds
    nothing. (Blocks stored per second of any activity measured the offered load below
    saturation, 5-10x low: docs/performance.md, "Serving a Mooncake trace".)
    """

    def __init__(self, tokens_per_block: int, alpha: float = 0.2, window_s: float = 0.25) -> None:
        self.tokens_per_block = tokens_per_block
        self.alpha = alpha
        self.window_s = window_s
        self.rate: float | None = None
        #: requests looked up since their last timed store
        self._looked: set[str] = set()
        #: request id -> when its timed store was prepared
        self._open: dict[str, float] = {}
        self._busy_until = -float("inf")
        self._busy = 0.0
        self._blocks = 0
        self._samples = 0

    def looked_up(self, req_id: str) -> None:
        """The scheduler looked ``req_id`` up: its prefill may be scheduled in this pass."""
        self._looked.add(req_id)

    def preparing(self, req_id: str, now: float) -> None:
        """The scheduler prepares a store of ``req_id``'s blocks that this step computes."""
        if req_id in self._looked:
            self._looked.discard(req_id)
            if len(self._open) >= OPEN_MAX:  # stores that never completed (aborted requests)
                for old in [r for r, t in self._open.items() if now - t > OPEN_MAX_S]:
                    del self._open[old]
            self._open[req_id] = now

    def finished(self, req_id: str) -> None:
        """The request ended: no more lookups of it. A store of it in flight is still timed when
        it completes (a request of one output token ends before its blocks are stored)."""
        self._looked.discard(req_id)

    def failed(self, req_id: str) -> None:
        """A store of ``req_id`` failed: it is not timed."""
        self._open.pop(req_id, None)

    def stored(self, req_id: str, blocks: int, now: float | None = None) -> float | None:
        """``req_id``'s store of ``blocks`` blocks completed; the rate once two windows are in."""
        start = self._open.pop(req_id, None)
        if start is not None and blocks > 0:
            now = time.monotonic() if now is None else now
            self._busy += max(0.0, now - max(start, self._busy_until))
            self._busy_until = max(self._busy_until, now)
            self._blocks += blocks
            if self._busy >= self.window_s:
                sample = min(self._blocks * self.tokens_per_block / self._busy, MAX_RATE_TOKENS_S)
                self.rate = sample if self.rate is None else self.rate + self.alpha * (sample - self.rate)
                self._samples += 1
                self._busy, self._blocks = 0.0, 0
        return self.rate if self._samples >= 2 else None


class TierKVLoadStoreSpec(LoadStoreSpec):  # type: ignore[misc,unused-ignore]
    """Where blocks sit in tierkv's shared CPU pool: one (group index, slot) per key, in order;
    ``pool`` names the pool ('' for the engine's own, a daemon's pool id through the daemon)."""

    def __init__(self, groups: list[int], slots: list[int], pool: str = "") -> None:
        self.groups = np.asarray(groups, dtype=np.int64)
        self.slots = np.asarray(slots, dtype=np.int64)
        self.pool = pool

    @staticmethod
    def medium() -> str:
        """vLLM's name for where these blocks live."""
        return "TIERKV"

    def __repr__(self) -> str:
        return (f"TierKVLoadStoreSpec(groups={self.groups.tolist()}, slots={self.slots.tolist()}, "
                f"pool={self.pool!r})")


class TierKVOffloadingManager(OffloadingManager):  # type: ignore[misc,unused-ignore]
    """vLLM's offloading manager backed by tierkv's pools and lower tiers."""

    def __init__(self, store_config: dict[str, Any], group_order: list[int],
                 enable_events: bool = False, cleanup: list[str] | None = None,
                 measure_recompute: bool = False) -> None:
        self._loop, self.store = LoopThread.running(TieredStore(store_config))
        self.engine: EngineSlots = self.store.engine
        self.layout: Layout = self.store.layout
        self._cacheable = frozenset(self.layout.cacheable_groups)
        self._order = {g: i for i, g in enumerate(group_order)}
        #: the 4-byte tail of a key -> its group, for the groups that have pools
        self._tails = {g.to_bytes(GROUP_BYTES, "big"): g for g in self._cacheable}
        #: through the daemon, a lookup is a message: the keys vLLM asks next go with it
        self._ahead = isinstance(self.store, DaemonStore)
        self._events_on = enable_events
        self._events: list[OffloadingEvent] = []
        self._events_lock = threading.Lock()
        self._closed = False
        self._cleanup = list(cleanup or [])
        self._deltas = CounterDeltas()
        self._stats_at = -float("inf")
        self._rate = RateMeter(self.layout.tokens_per_block) if measure_recompute else None
        if enable_events:
            self.engine.subscribe_evictions(self._on_evict)
            self._local = [tier_is_local(t) for t in store_config.get("tiers", [])[1:]]
            self.store.subscribe_tier_events(self._on_tier_event)

    def _on_tier_event(self, tier: int, event: str, keys: list[bytes]) -> None:
        # through the daemon, its tiers: where they keep their data is the daemon's to say
        local = self.store.lower_tiers_local if isinstance(self.store, DaemonStore) else self._local
        locality = None if tier > len(local) else Locality.LOCAL if local[tier - 1] else Locality.REMOTE
        ev = OffloadingEvent(keys=[OffloadKey(k) for k in keys], medium=Medium.STORAGE,
                             removed=event == "removed", locality=locality)
        with self._events_lock:
            self._events.append(ev)

    def _on_evict(self, group: int, keys: list[bytes]) -> None:
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
        if self._rate is not None:
            self._rate.looked_up(req_context.req_id)
        if self._ahead and self.layout.groups[group].kind == "full":  # vLLM walks a full group forward
            return _RESULT[self.engine.key_state(group, key, req_context.req_id,
                                                 ahead=functools.partial(_following, req_context, key))]
        return _RESULT[self.engine.key_state(group, key, req_context.req_id)]

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
            found = self.engine.ready_slots(g, gkeys, req_context.req_id)
            if None in found:
                raise RuntimeError("prepare_load of a block that is not ready: tierkv pins HITs, so"
                                   " this means the connector loaded a key it did not look up")
            groups += [g] * len(found)
            slots += [s for s in found if s is not None]
        return TierKVLoadStoreSpec(groups, slots, self.engine.pool_of(req_context.req_id))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Recency is refreshed by lookups; nothing more to do."""

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """The request has its blocks: drop its pins on them."""
        for g, gkeys in self._by_tail(keys):
            self.engine.unpin(g, gkeys, req_context.req_id)

    # ---- stores ----------------------------------------------------------------------------------
    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        """Reserve slots for keys not held yet (evicting); None when the pool cannot make room."""
        if self._rate is not None:
            self._rate.preparing(req_context.req_id, time.monotonic())
        reserved: list[tuple[int, list[bytes]]] = []
        to_store: list[bytes] = []
        groups: list[int] = []
        slots: list[int] = []
        evicted: list[bytes] = []
        pools: set[str] = set()
        for g, gkeys in self._by_tail(keys):
            res = self.engine.reserve(g, gkeys)
            if res is not None:
                pools.add(res.pool)
                new = [(k, s) for k, s in zip(gkeys, res.slots, strict=True) if s is not None]
                nkeys = [k for k, _ in new]
                reserved.append((g, nkeys))
            if res is None or len(pools) > 1:  # no room, or a daemon restarted between groups
                for rg, rk in reserved:
                    self.engine.commit(rg, rk, success=False)
                return None
            to_store += nkeys
            groups += [g] * len(nkeys)
            slots += [s for _, s in new]
            evicted += res.evicted
        return PrepareStoreOutput(keys_to_store=[OffloadKey(k) for k in to_store],
                                  store_spec=TierKVLoadStoreSpec(groups, slots, pools.pop() if pools else ""),
                                  evicted_keys=[OffloadKey(k) for k in evicted])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        """Stored blocks become visible and cascade down; failed ones are freed and never seen."""
        if self._rate is not None:
            if success:
                rate = self._rate.stored(req_context.req_id, len(keys) // max(1, len(self._cacheable)))
                if rate is not None and rate >= 1e-3:
                    self.store.set_recompute_rate(rate)
            else:
                self._rate.failed(req_context.req_id)
        for g, gkeys in self._by_tail(keys):
            self.engine.commit(g, gkeys, success=success)
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
        if self._rate is not None:
            self._rate.finished(req_context.req_id)
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
        self.engine.clear()

    def get_stats(self) -> Any:
        """tierkv's counters since the last report and its gauges, as vLLM's connector stats; None
        within :data:`STATS_INTERVAL_S` of the last report (vLLM asks after every step)."""
        now = time.monotonic()
        if now - self._stats_at < STATS_INTERVAL_S:
            return None
        self._stats_at = now
        try:
            return self._deltas.stats(samples(self.store.stats()), self.store.latency_observations())
        except ImportError:
            return None

    def shutdown(self) -> None:
        """Wait for accepted cascades, close the store and stop its thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.stop()
        finally:
            for path in self._cleanup:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
